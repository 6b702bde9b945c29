"""Canzona's α-balanced static partitioning of the matrix buffer across data-parallel ranks.

Each bucket stays a contiguous run of parameters in backprop order, split into dp_size
equal shards; every matrix sits whole in one shard, so the stock reduce-scatter delivers
whole gradients to the rank that updates them. Inside those rules the planner chooses
which rank hosts each matrix (order inside a bucket is free) and how wide the shards are:

1. Each bucket gets a shard capacity. Geometric steps from the tightest packing (minimal
   padding) up to the whole bucket are tried; at each step all matrices of all buckets
   are placed greedily, costliest first, on the least-loaded rank that has room in that
   matrix's bucket, so compute loads carry across buckets. Each candidate is scored
   α · makespan / lower bound + (1 − α) · buffer / parameter elements: α weighs compute
   balance against the padding every collective moves and every buffer stores.
   α = 0: the least padding found wins (the size-LPT packing Megatron-Core's layer-wise
   layout uses is a candidate, so padding never exceeds it on the same buckets).
   α = 1: only compute balance counts; the plain greedy (capacity = whole bucket) is a
   candidate, so the makespan obeys list scheduling's bound, total / dp_size + largest.
2. A local search moves or swaps matrices off the most loaded rank, inside each bucket's
   chosen shard width, while that lowers the pair's larger load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .cost import CostModel
from .geometry import align_param_start, default_bucket_size, round_up, shard_divisor, whole_param_bucket_ranges
from .partition import (
    CAPACITY_STEPS,
    DEFAULT_ALPHA,
    MAX_REFINE_ROUNDS,
    check_inputs,
    elementwise_buffer,
    item_size,
)
from .plan import Bucket, BufferPlan, DPPlan, Placement
from .specs import ParamSpec, matrix_specs


@dataclass
class _Work:
    """Mutable per-bucket state while planning."""

    items: list[int]
    regions: list[list[int]] = field(default_factory=list)
    used: list[int] = field(default_factory=list)
    capacity: int = 0


@dataclass(frozen=True)
class _Items:
    costs: list[float]
    sizes: list[int]


def plan_canzona(
    specs: Sequence[ParamSpec],
    *,
    dp_size: int,
    cost_model: CostModel,
    alpha: float = DEFAULT_ALPHA,
    bucket_size: int | None = None,
) -> DPPlan:
    """α-balanced whole-matrix ownership inside stock equal-shard buckets."""
    check_inputs(dp_size, alpha, bucket_size)
    bucket_size = default_bucket_size(dp_size) if bucket_size is None else bucket_size
    mats = matrix_specs(specs)
    items = _Items(costs=[cost_model.cost(s) for s in mats], sizes=[item_size(s.numel) for s in mats])
    ranges = whole_param_bucket_ranges([s.numel for s in mats], bucket_size, dp_size)
    work = [_Work(items=list(range(a, b))) for a, b in ranges]
    loads = _assign(work, items, dp_size, alpha)
    _refine(work, items, loads)
    return DPPlan(
        strategy="canzona",
        dp_size=dp_size,
        alpha=alpha,
        cost_kind=cost_model.kind,
        bucket_size=bucket_size,
        matrix=_layout(mats, items, work, dp_size),
        elementwise=elementwise_buffer(specs, dp_size, bucket_size),
        loads=tuple(loads),
    )


def tight_capacity(sizes: Sequence[int], dp_size: int) -> int:
    """Shard width of the size-LPT packing: largest first onto the emptiest shard."""
    used = [0] * dp_size
    for size in sorted(sizes, reverse=True):
        rank = min(range(dp_size), key=used.__getitem__)
        used[rank] += size
    return max(used)


def _capacity_ladder(tight: list[int], ceiling: list[int]) -> list[list[int]]:
    """Per-bucket shard capacities, geometric steps from the tight packing to the bucket."""
    ladder = []
    for k in range(CAPACITY_STEPS + 1):
        frac = k / CAPACITY_STEPS
        ladder.append([max(t, min(c, round_up(int(t * (c / t) ** frac), 64))) for t, c in zip(tight, ceiling)])
    return ladder


def _assign(work: list[_Work], items: _Items, dp_size: int, alpha: float) -> list[float]:
    """Choose per-bucket regions among greedy fills at each capacity step, scoring each by
    α · makespan / lower bound + (1 − α) · buffer elements / parameter elements.
    Returns the per-rank loads."""
    tight = [tight_capacity([items.sizes[i] for i in b.items], dp_size) for b in work]
    ceiling = [sum(items.sizes[i] for i in b.items) for b in work]
    bound = max(sum(items.costs) / dp_size, max(items.costs, default=0.0)) or 1.0
    numel = sum(items.sizes) or 1
    candidates = [_size_lpt(work, items, dp_size)]
    for caps in _capacity_ladder(tight, ceiling):
        for by_size in (False, True):
            regions = _greedy(work, items, dp_size, caps, by_size)
            if regions is not None:
                candidates.append(regions)

    def score(regions: list[list[list[int]]]) -> float:
        padded = sum(dp_size * max(sum(items.sizes[i] for i in r) for r in bucket) for bucket in regions)
        return alpha * max(_loads(regions, items, dp_size)) / bound + (1 - alpha) * padded / numel

    best = min(candidates, key=score)  # first of equals: the tighter packing
    for b, regions in zip(work, best):
        b.regions = regions
        b.used = [sum(items.sizes[i] for i in region) for region in regions]
        b.capacity = max(b.used)
    return _loads(best, items, dp_size)


def _loads(regions: list[list[list[int]]], items: _Items, dp_size: int) -> list[float]:
    loads = [0.0] * dp_size
    for bucket in regions:
        for rank, region in enumerate(bucket):
            loads[rank] += sum(items.costs[i] for i in region)
    return loads


def _size_lpt(work: list[_Work], items: _Items, dp_size: int) -> list[list[list[int]]]:
    """The tight packing itself per bucket, ties broken toward the less loaded rank."""
    loads = [0.0] * dp_size
    out = []
    for b in work:
        regions: list[list[int]] = [[] for _ in range(dp_size)]
        used = [0] * dp_size
        for i in sorted(b.items, key=lambda i: (-items.sizes[i], -items.costs[i], i)):
            rank = min(range(dp_size), key=lambda r: (used[r], loads[r], r))
            regions[rank].append(i)
            used[rank] += items.sizes[i]
            loads[rank] += items.costs[i]
        out.append(regions)
    return out


def _greedy(
    work: list[_Work], items: _Items, dp_size: int, caps: list[int], by_size: bool
) -> list[list[list[int]]] | None:
    """All matrices, costliest (or largest) first, onto the least-loaded rank with room in
    that matrix's bucket; ``None`` if one does not fit anywhere."""
    bucket_of = {i: k for k, b in enumerate(work) for i in b.items}
    regions: list[list[list[int]]] = [[[] for _ in range(dp_size)] for _ in work]
    used = [[0] * dp_size for _ in work]
    loads = [0.0] * dp_size
    if by_size:
        order = sorted(bucket_of, key=lambda i: (-items.sizes[i], -items.costs[i], i))
    else:
        order = sorted(bucket_of, key=lambda i: (-items.costs[i], -items.sizes[i], i))
    for i in order:
        k, size = bucket_of[i], items.sizes[i]
        fits = [r for r in range(dp_size) if used[k][r] + size <= caps[k]]
        if not fits:
            return None
        rank = min(fits, key=lambda r: (loads[r], used[k][r], r))
        regions[k][rank].append(i)
        used[k][rank] += size
        loads[rank] += items.costs[i]
    return regions


def _refine(work: list[_Work], items: _Items, loads: list[float]) -> None:
    """Move or swap matrices off the most loaded rank while that lowers the pair's maximum."""
    home = {i: b for b in work for i in b.items}
    for _ in range(MAX_REFINE_ROUNDS):
        top = max(range(len(loads)), key=lambda r: (loads[r], -r))
        if not _improve(top, work, home, items, loads):
            return


def _improve(top: int, work: list[_Work], home: dict[int, _Work], items: _Items, loads: list[float]) -> bool:
    mine = sorted((i for b in work for i in b.regions[top]), key=lambda i: -items.costs[i])
    others = sorted((r for r in range(len(loads)) if r != top), key=lambda r: (loads[r], r))
    limit = loads[top] * (1 - 1e-12)
    for i in mine:
        b, ci, si = home[i], items.costs[i], items.sizes[i]
        for t in others:
            if loads[t] + ci < limit and b.used[t] + si <= b.capacity:
                _move(b, i, top, t, items, loads)
                return True
            for j in b.regions[t]:
                cj, sj = items.costs[j], items.sizes[j]
                if cj >= ci or max(loads[top] - ci + cj, loads[t] - cj + ci) >= limit:
                    continue
                if b.used[t] - sj + si <= b.capacity and b.used[top] - si + sj <= b.capacity:
                    _move(b, i, top, t, items, loads)
                    _move(b, j, t, top, items, loads)
                    return True
    return False


def _move(b: _Work, i: int, src: int, dst: int, items: _Items, loads: list[float]) -> None:
    b.regions[src].remove(i)
    b.regions[dst].append(i)
    b.used[src] -= items.sizes[i]
    b.used[dst] += items.sizes[i]
    loads[src] -= items.costs[i]
    loads[dst] += items.costs[i]


def _layout(mats: list[ParamSpec], items: _Items, work: list[_Work], dp_size: int) -> BufferPlan:
    """Place each rank's matrices, in backprop order, at the front of its equal-size shard."""
    placements: list[Placement] = []
    buckets: list[Bucket] = []
    start = 0
    for index, b in enumerate(work):
        shard = round_up(max(_packed(mats, region) for region in b.regions), shard_divisor(dp_size))
        for rank, region in enumerate(b.regions):
            cursor = start + rank * shard
            for i in sorted(region):
                cursor = align_param_start(cursor)
                placements.append(
                    Placement(name=mats[i].name, start=cursor, end=cursor + mats[i].numel, bucket=index, host=rank, cost=items.costs[i])
                )
                cursor += mats[i].numel
        end = start + dp_size * shard
        bounds = tuple(start + r * shard for r in range(dp_size + 1))
        buckets.append(Bucket(start=start, end=end, numel_unpadded=sum(mats[i].numel for i in b.items), shard_bounds=bounds))
        start = end
    return BufferPlan(placements=tuple(placements), buckets=tuple(buckets))


def _packed(mats: list[ParamSpec], region: list[int]) -> int:
    cursor = 0
    for i in sorted(region):
        cursor = align_param_start(cursor) + mats[i].numel
    return cursor
