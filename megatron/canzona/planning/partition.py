"""Data-parallel layouts of the matrix buffer that Canzona is measured against, and the
checks every planner shares.

Every strategy lays matrix parameters out in backprop order into buckets. ``zero1`` and
``eq1`` use the stock layout (parameters back to back, dp_size equal chunks per bucket);
Canzona's own layout is :mod:`megatron.canzona.planning.balance`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from .cost import CostModel
from .geometry import (
    align_param_start,
    bucket_end_divisor,
    default_bucket_size,
    round_up,
    stock_bucket_ranges,
)
from .plan import Bucket, BufferPlan, DPPlan, Placement
from .specs import ParamSpec, elementwise_specs, matrix_specs

DEFAULT_ALPHA = 0.5
"""Default balance knob: relative compute imbalance and relative padding weigh the same."""


def check_inputs(dp_size: int, alpha: float | None = None, bucket_size: int | None = None) -> None:
    """Validate user-facing planner arguments with messages that say how to fix them."""
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be a positive integer, got {dp_size!r}; pass --dp 1 or more")
    if alpha is not None and not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}; 0 favours equal chunks, 1 equal compute")
    if bucket_size is not None and bucket_size < 1:
        raise ValueError(f"bucket size must be a positive number of elements, got {bucket_size}")


def check_tp_size(tp_size: int) -> None:
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}; pass --tp 1 or more")


# --------------------------------------------------------------------------- stock layouts


def _stock_buffer(
    mats: Sequence[ParamSpec], costs: Sequence[float], dp_size: int, bucket_size: int | None, owner_rule: str
) -> tuple[BufferPlan, list[float]]:
    """Stock contiguous layout; owners by ``zero1`` (chunk containment) or ``eq1`` (start in range)."""
    placements: list[Placement] = []
    buckets: list[Bucket] = []
    loads = [0.0] * dp_size
    cursor = 0
    for first, last in stock_bucket_ranges([s.numel for s in mats], bucket_size):
        start, spans = cursor, []
        for spec in mats[first:last]:
            cursor = align_param_start(cursor)
            spans.append((cursor, cursor + spec.numel))
            cursor += spec.numel
        end = start + round_up(cursor - start, bucket_end_divisor(dp_size))
        chunk = (end - start) // dp_size
        owners = []
        for spec, cost, (s, e) in zip(mats[first:last], costs[first:last], spans):
            lo, hi = (s - start) // chunk, (e - 1 - start) // chunk
            if owner_rule == "eq1":
                lo = hi = lo
            for rank in range(lo, hi + 1):
                loads[rank] += cost
            owners.append(lo)
            placements.append(Placement(name=spec.name, start=s, end=e, bucket=len(buckets), host=lo if lo == hi else None, cost=cost))
        if owner_rule == "eq1":
            bounds = _start_in_range_bounds(start, end, spans, owners, dp_size)
        else:
            bounds = tuple(start + r * chunk for r in range(dp_size + 1))
        buckets.append(Bucket(start=start, end=end, numel_unpadded=sum(e - s for s, e in spans), shard_bounds=bounds))
        cursor = end
    return BufferPlan(placements=tuple(placements), buckets=tuple(buckets)), loads


def _start_in_range_bounds(
    start: int, end: int, spans: list[tuple[int, int]], owners: list[int], dp_size: int
) -> tuple[int, ...]:
    """Eq. (1) shards: rank r's shard ends where its last owned parameter ends."""
    last_end = {}
    for (_, e), owner in zip(spans, owners):
        last_end[owner] = e
    bounds = [start]
    for rank in range(dp_size - 1):
        bounds.append(last_end.get(rank, bounds[-1]))
    bounds.append(end)
    return tuple(bounds)


def plan_zero1(
    specs: Sequence[ParamSpec], *, dp_size: int, cost_model: CostModel, bucket_size: int | None = None
) -> DPPlan:
    """Stock ZeRO-1: contiguous equal chunks; matrices straddling a boundary are split and
    their update is computed by every rank holding a piece (synchronous compute)."""
    return _stock_plan("zero1", specs, dp_size, cost_model, bucket_size)


def plan_eq1(
    specs: Sequence[ParamSpec], *, dp_size: int, cost_model: CostModel, bucket_size: int | None = None
) -> DPPlan:
    """Canzona Eq. (1): rank r owns a matrix if its start falls in [r·S, (r+1)·S); shards are
    then of variable size (non-uniform collectives)."""
    return _stock_plan("eq1", specs, dp_size, cost_model, bucket_size)


def _stock_plan(strategy: str, specs, dp_size, cost_model, bucket_size) -> DPPlan:
    check_inputs(dp_size, bucket_size=bucket_size)
    bucket_size = default_bucket_size(dp_size) if bucket_size is None else bucket_size
    mats = matrix_specs(specs)
    costs = [cost_model.cost(s) for s in mats]
    matrix, loads = _stock_buffer(mats, costs, dp_size, bucket_size, strategy)
    return DPPlan(
        strategy=strategy, dp_size=dp_size, alpha=None, cost_kind=cost_model.kind, bucket_size=bucket_size,
        matrix=matrix, elementwise=elementwise_buffer(specs, dp_size, bucket_size), loads=tuple(loads),
    )


def elementwise_buffer(specs: Sequence[ParamSpec], dp_size: int, bucket_size: int | None) -> BufferPlan | None:
    """AdamW parameters keep the ordinary contiguous ZeRO-1 layout in their own buffer."""
    elems = elementwise_specs(specs)
    if not elems:
        return None
    buffer, _ = _stock_buffer(elems, [0.0] * len(elems), dp_size, bucket_size, "zero1")
    return buffer
