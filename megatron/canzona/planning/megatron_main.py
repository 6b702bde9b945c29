"""Megatron-LM main's layer-wise (Muon) layout, after 0.19.2, modelled for comparison.

It is the layout Megatron users pick today but is not on the package registry, so it is
restated here from how its source behaves (read at NVIDIA/Megatron-LM d98e8a6; not
imported, not copied):

* buckets are contiguous runs of parameters in backprop order. Once a bucket holds at least
  max(bucket size, 0.9 · DP · its largest parameter) elements, it closes before the next
  parameter unless that one still fits in the padding of the shards it has (estimated by
  dealing element counts, in backprop order, to the emptiest shard);
* inside a bucket, parameters go largest Newton-Schulz cost first (max(m, n) · min(m, n)²
  of the local matrix) onto the DP shard with the least cost so far, the costs carried
  across buckets, among the shards that stay within 1.3 × the bucket's mean shard size
  (:data:`NUMEL_SLACK`; when none does, onto the emptiest shard);
* every shard of a bucket is padded to the largest one (64-element parameter alignment, the
  shard size rounded to Megatron's shard divisor), so the stock equal-shard reduce-scatter
  and all-gather run, the latter overlapped with the next forward;
* under TP every TP rank computes each matrix (``muon_tp_mode duplicated``, its default).
"""

from __future__ import annotations

from collections.abc import Sequence

from .cost import CostModel
from .geometry import align_param_start, default_bucket_size, round_up, shard_divisor
from .partition import check_inputs, elementwise_buffer
from .plan import Bucket, BufferPlan, DPPlan, Placement
from .specs import ParamSpec, matrix_specs

PADDING_FLOOR = 0.9
"""A bucket holds at least this fraction of DP times its largest parameter."""
NUMEL_SLACK = 0.3
"""A shard takes a parameter only while it stays within (1 + this) × the bucket's mean shard."""


def newton_schulz_cost(spec: ParamSpec) -> float:
    """max(m, n) · min(m, n)² of the local (TP-sharded) matrix: what the layout balances."""
    m, n = spec.local_shape
    return max(m, n) * min(m, n) ** 2


def main_bucket_ranges(numels: Sequence[int], dp_size: int, bucket_size: int) -> list[tuple[int, int]]:
    """Index ranges [i, j) of parameters (backprop order) per bucket: a bucket past its floor
    closes unless the next parameter fits in its current shard padding."""
    divisor = shard_divisor(dp_size)
    ranges: list[tuple[int, int]] = []
    first, total, largest = 0, 0, 0
    fill = [0] * dp_size
    for i, numel in enumerate(numels):
        if i > first and total >= max(bucket_size, int(dp_size * largest * PADDING_FLOOR)):
            width = round_up(max(fill), divisor)
            if align_param_start(min(fill)) + numel > width:  # it would grow the bucket: close it
                ranges.append((first, i))
                first, total, largest, fill = i, 0, 0, [0] * dp_size
        emptiest = min(range(dp_size), key=lambda r: (fill[r], r))
        fill[emptiest] = align_param_start(fill[emptiest]) + numel
        total, largest = total + numel, max(largest, numel)
    if first < len(numels):
        ranges.append((first, len(numels)))
    return ranges


def plan_megatron_main(
    specs: Sequence[ParamSpec], *, dp_size: int, cost_model: CostModel, bucket_size: int | None = None
) -> DPPlan:
    """The layout of the matrix buffer (module docstring), as a DPPlan whose loads are the
    ``cost_model``'s (what the step costs), while the shards were balanced by Newton-Schulz cost."""
    check_inputs(dp_size, bucket_size=bucket_size)
    bucket_size = default_bucket_size(dp_size) if bucket_size is None else bucket_size
    mats = matrix_specs(specs)
    divisor = shard_divisor(dp_size)
    balance = [0.0] * dp_size
    loads = [0.0] * dp_size
    placements: list[Placement] = []
    buckets: list[Bucket] = []
    offset = 0
    for index, (first, last) in enumerate(main_bucket_ranges([s.numel for s in mats], dp_size, bucket_size)):
        members = sorted(range(first, last), key=lambda i: (-newton_schulz_cost(mats[i]), i))
        shards: list[list[int]] = [[] for _ in range(dp_size)]
        fill = [0] * dp_size
        cap = sum(mats[i].numel for i in members) / dp_size * (1 + NUMEL_SLACK)
        for i in members:
            fits = [r for r in range(dp_size) if align_param_start(fill[r]) + mats[i].numel <= cap]
            rank = (min(fits, key=lambda r: (balance[r], r)) if fits
                    else min(range(dp_size), key=lambda r: (fill[r], r)))
            shards[rank].append(i)
            balance[rank] += newton_schulz_cost(mats[i])
            fill[rank] = align_param_start(fill[rank]) + mats[i].numel
        width = round_up(max(max(fill), 1), divisor)
        for rank, held in enumerate(shards):
            cursor = offset + rank * width
            for i in held:
                start = align_param_start(cursor)
                cursor = start + mats[i].numel
                cost = cost_model.cost(mats[i])
                loads[rank] += cost
                placements.append(Placement(name=mats[i].name, start=start, end=cursor, bucket=index, host=rank,
                                            cost=cost))
        end = offset + dp_size * width
        buckets.append(Bucket(start=offset, end=end, numel_unpadded=sum(s.numel for s in mats[first:last]),
                              shard_bounds=tuple(offset + r * width for r in range(dp_size + 1))))
        offset = end
    placements.sort(key=lambda p: p.start)
    return DPPlan(
        strategy="megatron_main", dp_size=dp_size, alpha=None, cost_kind=cost_model.kind, bucket_size=bucket_size,
        matrix=BufferPlan(placements=tuple(placements), buckets=tuple(buckets)),
        elementwise=elementwise_buffer(specs, dp_size, bucket_size), loads=tuple(loads),
    )
