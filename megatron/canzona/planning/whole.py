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

from collections.abc import Sequence

from .geometry import align_param_start, bucket_end_divisor, round_up
from .plan import Bucket, BufferPlan, Placement
from .specs import ParamSpec


def whole_owners(
    costs: Sequence[float], numels: Sequence[int], tp_sharded: Sequence[bool], *, dp_size: int, tp_size: int,
    alpha: float, bound: float, base: Sequence[float] | None = None, parts: Sequence[Sequence[float]] | None = None,
) -> list[int]:
    """The owning DP rank of each matrix (module docstring). ``costs``: one update's compute;
    ``bound``: the compute lower bound per GPU; ``base``: compute each GPU (index
    ``dp_rank * tp_size + tp_rank``) already has (its expert work); ``parts``: per matrix, the
    costs of its parts hosted apart (each TP-sharded part goes to its own least-loaded TP
    rank of the owner; default: one part)."""
    load = [0.0] * (dp_size * tp_size) if base is None else [float(x) for x in base]
    held = [0.0] * dp_size
    mean = max(1.0, sum(numels) / dp_size)
    bound = bound or 1.0
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], -numels[i], i)):
        best: tuple[float, float, int] | None = None
        split = [costs[i]] if parts is None else list(parts[i])
        for d in range(dp_size):
            row = load[d * tp_size:(d + 1) * tp_size]
            after = _take(row, split)[1] if tp_sharded[i] else max(row) + costs[i]
            key = (alpha * after / bound + (1 - alpha) * (held[d] + numels[i]) / mean, after, d)
            if best is None or key < best:
                best = key
        d = best[2]  # type: ignore[index]
        row = range(d * tp_size, (d + 1) * tp_size)
        if tp_sharded[i]:
            load[d * tp_size:(d + 1) * tp_size] = _take(load[d * tp_size:(d + 1) * tp_size], split)[0]
        else:
            for g in row:
                load[g] += costs[i]
        held[d] += numels[i]
        owners[i] = d
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
