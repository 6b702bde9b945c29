"""Canzona's whole layout of a matrix buffer: every matrix whole in one DP rank's shard, shards
of variable size, no padding.

Buckets are Megatron's: contiguous runs of parameters in backprop order, each closing once
it reaches the configured size (:func:`~megatron.canzona.planning.geometry.stock_bucket_ranges`,
Megatron's own rule: the last bucket is whatever remains, so it reduces as early as AdamW's). Inside a bucket the
order of parameters is free, so each bucket lists its matrices grouped by owner, DP rank 0's
first, and cuts rank r's shard exactly around rank r's matrices (paper Eq. (1) with the
owners chosen for balance rather than by position). A rank may own nothing in a bucket: its
shard there is empty. The reduce-scatter and all-gather of such a bucket are uneven (torch's
list-form collectives), so the optimizer step needs no data-parallel traffic at all: every
gradient arrives whole at its owner.

An uneven bucket costs more than an even one, whatever the algorithm (a rank with an empty
shard sends the whole bucket; docs/projection.md): 1/(p − 1) more at DP p, 14% at an expert DP
of 8. So where a bucket's matrices can be dealt whole into dp_size shards of one size
(:func:`even_shards`: many matrices of few sizes, the experts of a MoE layer), the bucket is
cut so, and runs the stock equal-shard collectives; where Megatron's closing point does not
allow it, the bucket closes at the first later parameter that does, within
``BUCKET_GROWTH`` × the size (:func:`whole_bucket_ranges`). Each even shard then goes to the
DP rank it loads least (its matrices' compute; their bytes are equal by construction).

Owners (:func:`whole_owners`) are chosen over the whole stage at once, so loads carry across
buckets and model chunks: matrices go costliest first to the GPU (DP rank, TP rank) that
least grows

    α · compute of the GPU / compute lower bound + (1 − α) · elements of its DP rank's shards / mean

where a matrix every TP rank holds whole weighs on each TP rank of its owner. α = 1 balances
compute alone; α = 0 equal shard sizes (the memory each DP rank holds for optimizer state).
The only padding left is alignment: 64 elements before each parameter (Megatron's rule) and
a bucket end rounded to lcm(dp_size, 128) elements.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from .geometry import BUCKET_GROWTH, PARAM_ALIGNMENT, align_param_start, bucket_end_divisor, round_up, stock_bucket_ranges
from .plan import Bucket, BufferPlan, Placement
from .specs import ParamSpec


def even_shards(numels: Sequence[int], dp_size: int) -> list[list[int]] | None:
    """The matrices of one bucket (``numels``, any order) dealt whole into ``dp_size`` shards
    of one extent, as indices per shard (largest first, each to the fullest shard it fits);
    ``None`` where that fails: fewer matrices than shards, a size off Megatron's 64-element
    parameter alignment (its padding would then depend on the order), a total that the
    bucket-end alignment would pad, or no exact fit found."""
    if len(numels) < dp_size or any(n <= 0 or n % PARAM_ALIGNMENT for n in numels):
        return None
    total = sum(numels)
    if total % bucket_end_divisor(dp_size):
        return None
    width = total // dp_size
    if max(numels) > width:
        return None
    rooms = [(width, r) for r in range(dp_size)]  # ascending: the fullest shard that fits first
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        k = bisect.bisect_left(rooms, (numels[i], -1))
        if k == len(rooms):
            return None
        room, r = rooms.pop(k)
        shards[r].append(i)
        if room > numels[i]:
            bisect.insort(rooms, (room - numels[i], r))
    return shards


def whole_bucket_ranges(numels: list[int], bucket_size: int | None, dp_size: int) -> list[tuple[int, int]]:
    """Megatron's bucket ranges (:func:`~megatron.canzona.planning.geometry.stock_bucket_ranges`),
    except that a bucket whose matrices :func:`even_shards` cannot deal into equal shards
    closes at the first later parameter where it can, while it stays within
    ``BUCKET_GROWTH`` × ``bucket_size``; the last bucket holds what remains."""
    if bucket_size is None or dp_size == 1:
        return stock_bucket_ranges(numels, bucket_size)
    limit = BUCKET_GROWTH * bucket_size
    ranges, first = [], 0
    while first < len(numels):
        end, cursor = first, 0
        while end < len(numels) and cursor < bucket_size:
            cursor = align_param_start(cursor) + numels[end]
            end += 1
        if cursor >= bucket_size and even_shards(numels[first:end], dp_size) is None:
            later, extent, divisor = end, cursor, bucket_end_divisor(dp_size)
            while later < len(numels):
                extent = align_param_start(extent) + numels[later]
                later += 1
                if extent > limit:
                    break
                # (an extent that the bucket end would pad cannot be cut evenly: skip the fit)
                if extent % divisor == 0 and even_shards(numels[first:later], dp_size) is not None:
                    end = later
                    break
        ranges.append((first, end))
        first = end
    return ranges


def whole_owners(
    costs: Sequence[float], numels: Sequence[int], tp_sharded: Sequence[bool], *, dp_size: int, tp_size: int,
    alpha: float, bound: float, base: Sequence[float] | None = None, parts: Sequence[Sequence[float]] | None = None,
    even: Sequence[Sequence[Sequence[int]]] = (),
) -> list[int]:
    """The owning DP rank of each matrix (module docstring). ``costs``: one update's compute;
    ``bound``: the compute lower bound per GPU; ``base``: compute each GPU (index
    ``dp_rank * tp_size + tp_rank``) already has (its expert work); ``parts``: per matrix, the
    costs of its parts hosted apart (each TP-sharded part goes to its own least-loaded TP
    rank of the owner; default: one part). ``even``: per even bucket, its shards (matrix
    indices, :func:`even_shards`), each dealt first to its own DP rank, the costliest shard to
    the rank it loads least; the other matrices follow, costliest first."""
    load = [0.0] * (dp_size * tp_size) if base is None else [float(x) for x in base]
    held = [0.0] * dp_size
    mean = max(1.0, sum(numels) / dp_size)
    bound = bound or 1.0
    owners = [-1] * len(costs)

    def take(i: int, row: list[float]) -> tuple[list[float], float]:
        """A TP row's loads once matrix ``i`` is owned there, and the largest that took a part."""
        split = [costs[i]] if parts is None else list(parts[i])
        if tp_sharded[i]:
            return _take(row, split)
        return [x + costs[i] for x in row], max(row) + costs[i]

    def row_with(shard: Sequence[int], d: int) -> list[float]:
        row = load[d * tp_size:(d + 1) * tp_size]
        for i in shard:
            row = take(i, row)[0]
        return row

    def own(shard: Sequence[int], d: int) -> None:
        load[d * tp_size:(d + 1) * tp_size] = row_with(shard, d)
        for i in shard:
            held[d] += numels[i]
            owners[i] = d

    for shards in even:
        free = set(range(dp_size))
        for shard in sorted(shards, key=lambda shard: (-sum(costs[i] for i in shard), shard)):
            d = min(free, key=lambda d: (max(row_with(shard, d)), d))
            free.remove(d)
            own(shard, d)
    for i in sorted((i for i in range(len(costs)) if owners[i] < 0), key=lambda i: (-costs[i], -numels[i], i)):
        best: tuple[float, float, int] | None = None
        for d in range(dp_size):
            after = take(i, load[d * tp_size:(d + 1) * tp_size])[1]
            key = (alpha * after / bound + (1 - alpha) * (held[d] + numels[i]) / mean, after, d)
            if best is None or key < best:
                best = key
        own([i], best[2])  # type: ignore[index]
    return owners


def _take(row: Sequence[float], parts: Sequence[float]) -> tuple[list[float], float]:
    """Loads of one DP rank's TP ranks after each part (largest first) goes to the least
    loaded, and the largest load of a TP rank that took one."""
    row, after = list(row), 0.0
    for cost in sorted(parts, reverse=True):
        g = min(range(len(row)), key=lambda g: (row[g], g))
        row[g] += cost
        after = max(after, row[g])
    return row, after


def whole_buffer(
    mats: Sequence[ParamSpec], costs: Sequence[float], ranges: Sequence[tuple[int, int]], owners: Sequence[int],
    dp_size: int,
) -> BufferPlan:
    """The buffer with bucket k holding ``mats[ranges[k]]``, each matrix in its owner's shard
    (``owners``: a DP rank per matrix), shards cut at parameter boundaries."""
    placements: list[Placement] = []
    buckets: list[Bucket] = []
    offset = 0
    for index, (first, last) in enumerate(ranges):
        by_rank: list[list[int]] = [[] for _ in range(dp_size)]
        for i in range(first, last):
            by_rank[owners[i]].append(i)
        cursor, bounds = offset, []
        for rank, members in enumerate(by_rank):
            bounds.append(cursor)
            for i in members:
                start = align_param_start(cursor)
                cursor = start + mats[i].numel
                placements.append(Placement(name=mats[i].name, start=start, end=cursor, bucket=index, host=rank,
                                            cost=costs[i]))
        end = offset + round_up(max(cursor - offset, 1), bucket_end_divisor(dp_size))
        bounds.append(end)
        buckets.append(Bucket(start=offset, end=end, numel_unpadded=sum(s.numel for s in mats[first:last]),
                              shard_bounds=tuple(bounds)))
        offset = end
    return BufferPlan(placements=tuple(placements), buckets=tuple(buckets))
