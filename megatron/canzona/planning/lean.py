"""Canzona's lean layout of a matrix buffer: stock equal shards, each matrix whole where that
costs no padding, split across shards otherwise.

Buckets are Megatron's: contiguous runs of parameters in backprop order near the configured
size (:func:`~megatron.canzona.planning.geometry.lean_bucket_ranges`), padded and cut into
dp_size equal shards, so the stock reduce-scatter and all-gather run unchanged. Inside a
bucket the order of parameters is free. Given a shard width, a bucket is filled shard by
shard:

1. whole matrices that fill the shard best (each distinct size tried first, then the
   largest that still fit);
2. then the rest of the shard stays padding if the remaining matrices still fit in the
   remaining shards, else one matrix starts there and runs across the boundary: a matrix
   wider than a shard first (it is split anyway), otherwise the smallest one (the fewest
   bytes to gather).

Given a home per matrix (:func:`balanced_homes`: list scheduling of every matrix of the
stage, as if bytes could go anywhere), a shard takes whole only the matrices at home on its
rank; the others lie across shards, and their hosts go where compute is short.

A matrix across a boundary is *split*: its host gathers the pieces, computes the update
once and scatters the slices back. Only matrices crossing one of the dp_size − 1 shard
boundaries of a bucket are split, so wider shards (more padding) leave more of them whole;
the planner tries a ladder of widths (:data:`SHARD_SLACK`) and scores each.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from .geometry import align_param_start, round_up, shard_divisor
from .plan import Bucket, BufferPlan, Placement
from .specs import ParamSpec

SHARD_SLACK: tuple[float, ...] = (0.0, 0.005, 0.01, 0.02, 0.035, 0.05, 0.08, 0.12, 0.2, 0.35, 0.6, 1.0)
"""Shard widths tried per bucket, as padding allowed over the tightest width."""


def item_size(numel: int) -> int:
    """Elements a parameter occupies, its start alignment included."""
    return align_param_start(numel)


def tightest_shard(numels: Sequence[int], dp_size: int) -> int:
    """The narrowest valid shard width that holds ``numels`` (any of them may be split)."""
    total = sum(item_size(n) for n in numels)
    return round_up(max(1, math.ceil(total / dp_size)), shard_divisor(dp_size))


def whole_shard(numels: Sequence[int], dp_size: int) -> int:
    """A shard width at which every matrix can be whole: the size-LPT packing."""
    used = [0] * dp_size
    for size in sorted((item_size(n) for n in numels), reverse=True):
        rank = min(range(dp_size), key=used.__getitem__)
        used[rank] += size
    return round_up(max(used, default=1), shard_divisor(dp_size))


def shard_ladder(numels: Sequence[int], dp_size: int) -> list[int]:
    """Distinct shard widths from :func:`tightest_shard` up to :func:`whole_shard`."""
    tight, whole = tightest_shard(numels, dp_size), whole_shard(numels, dp_size)
    divisor = shard_divisor(dp_size)
    widths = [min(max(whole, tight), round_up(math.ceil(tight * (1 + slack)), divisor)) for slack in SHARD_SLACK]
    return sorted(set(widths + [max(whole, tight)]))


def fill_bucket(
    numels: Sequence[int], dp_size: int, shard: int, *, homes: Sequence[int] | None = None,
) -> list[int]:
    """Start of each matrix (in input order) from the bucket's start, for ``dp_size``
    shards of ``shard`` elements (the rule in the module docstring).

    With ``homes`` (a DP rank per matrix), a shard takes whole only the matrices whose home
    is its rank; the rest of it is padding or pieces of split matrices."""
    capacity = dp_size * shard
    remaining = sum(item_size(n) for n in numels)
    if remaining > capacity:
        raise ValueError(f"{len(numels)} matrices of {remaining} elements do not fit {dp_size} shards of {shard}")
    wide = sorted((i for i, n in enumerate(numels) if n > shard), key=lambda i: (-numels[i], i))
    pool = sorted((numels[i], i) for i, n in enumerate(numels) if n <= shard)  # ascending
    starts = [0] * len(numels)
    pos = 0
    while wide or pool:
        rank = pos // shard
        shard_end = (rank + 1) * shard
        mine = pool if homes is None else [(n, i) for n, i in pool if homes[i] == rank]
        for numel, i in _best_fill(mine, align_param_start(pos), shard_end):
            pool.remove((numel, i))
            starts[i] = align_param_start(pos)
            pos = starts[i] + numel
            remaining -= item_size(numel)
        if not (wide or pool):
            break
        start = align_param_start(pos)
        if start >= shard_end or remaining <= capacity - shard_end:
            pos = shard_end  # the shard is full, or its rest can stay padding
            continue
        i = wide.pop(0) if wide else _crosser(pool, shard_end - start)  # cross the boundary
        starts[i], pos = start, start + numels[i]
        remaining -= item_size(numels[i])
    return starts


def _crosser(pool: list[tuple[int, int]], room: int) -> int:
    """The smallest matrix of ``pool`` (ascending) longer than ``room``; the smallest of all
    if none is (the shard then holds it whole, away from its home)."""
    k = bisect.bisect_right(pool, (room, math.inf))
    return pool.pop(k if k < len(pool) else 0)[1]


def _best_fill(pool: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """Matrices of ``pool`` (ascending) to place whole in ``[start, end)``: for each distinct
    size as the first one, the largest that fit after it; the fullest such fill wins."""
    best: list[tuple[int, int]] = []
    best_end = start
    for first in sorted({numel for numel, _ in pool if start + numel <= end}, reverse=True):
        chosen, left, cursor = [], list(pool), start
        k = bisect.bisect_left(left, (first, -1))
        while k >= 0:
            numel, i = left.pop(k)
            chosen.append((numel, i))
            cursor = align_param_start(cursor) + numel
            k = bisect.bisect_right(left, (end - align_param_start(cursor), math.inf)) - 1
        if cursor > best_end:
            best, best_end = chosen, cursor
        if best_end >= end - 63:
            break
    return best


def balanced_homes(costs: Sequence[float], dp_size: int, base: Sequence[float] | None = None) -> list[int]:
    """A DP rank per matrix, costliest first onto the least-loaded rank (list scheduling):
    where each matrix would go if its bytes could go anywhere. ``base``: load each DP rank
    starts with (its expert work)."""
    loads = [0.0] * dp_size if base is None else [float(load) for load in base]
    assert len(loads) == dp_size, (len(loads), dp_size)
    homes = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(dp_size), key=lambda r: (loads[r], r))
        homes[i] = rank
        loads[rank] += costs[i]
    return homes


def lean_buffer(
    mats: Sequence[ParamSpec], costs: Sequence[float], ranges: Sequence[tuple[int, int]], shards: Sequence[int],
    dp_size: int, *, homes: Sequence[int] | None = None,
) -> BufferPlan:
    """The buffer with bucket k holding ``mats[ranges[k]]`` in ``dp_size`` shards of
    ``shards[k]`` elements, filled by :func:`fill_bucket` (``homes``: the DP rank each
    matrix may be whole on)."""
    placements: list[Placement] = []
    buckets: list[Bucket] = []
    offset = 0
    for index, ((first, last), shard) in enumerate(zip(ranges, shards)):
        numels = [s.numel for s in mats[first:last]]
        starts = fill_bucket(numels, dp_size, shard, homes=None if homes is None else homes[first:last])
        for k in sorted(range(len(numels)), key=starts.__getitem__):
            start, end = offset + starts[k], offset + starts[k] + numels[k]
            lo, hi = starts[k] // shard, (starts[k] + numels[k] - 1) // shard
            placements.append(Placement(
                name=mats[first + k].name, start=start, end=end, bucket=index, host=lo if lo == hi else None,
                cost=costs[first + k],
            ))
        bounds = tuple(offset + r * shard for r in range(dp_size + 1))
        buckets.append(Bucket(start=offset, end=offset + dp_size * shard, numel_unpadded=sum(numels), shard_bounds=bounds))
        offset += dp_size * shard
    return BufferPlan(placements=tuple(placements), buckets=tuple(buckets))
