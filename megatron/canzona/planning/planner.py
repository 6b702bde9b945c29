"""One call from parameter descriptions to the whole Canzona plan (DP layout + TP groups)."""

from __future__ import annotations

from collections.abc import Sequence

from .balance import plan_canzona
from .cost import CostModel
from .microgroups import schedule_microgroups
from .partition import DEFAULT_ALPHA
from .plan import CanzonaPlan, DPPlan, TPPlan
from .specs import ParamSpec


def make_plan(
    specs: Sequence[ParamSpec],
    *,
    dp_size: int,
    tp_size: int = 1,
    cost_model: CostModel | None = None,
    alpha: float = DEFAULT_ALPHA,
    bucket_size: int | None = None,
    tp_budget: float | None = None,
) -> CanzonaPlan:
    """α-balanced DP ownership, then micro-groups over each DP rank's matrices.

    Each matrix's update is computed once: by its DP owner's TP group, on the host TP rank.
    """
    cost_model = cost_model or CostModel()
    dp = plan_canzona(specs, dp_size=dp_size, cost_model=cost_model, alpha=alpha, bucket_size=bucket_size)
    return CanzonaPlan(dp=dp, tp=tp_schedules(dp, tp_size=tp_size, budget=tp_budget))


def tp_schedules(dp: DPPlan, *, tp_size: int, budget: float | None = None) -> tuple[TPPlan, ...]:
    """One micro-group schedule per DP rank over the matrices it owns."""
    owned: list[list[tuple[str, float]]] = [[] for _ in range(dp.dp_size)]
    for p in dp.matrix.placements:
        if p.host is None:
            raise ValueError(f"{p.name} is split across DP ranks; TP schedules need whole-matrix owners")
        owned[p.host].append((p.name, p.cost))
    return tuple(
        schedule_microgroups([n for n, _ in items], [c for _, c in items], tp_size=tp_size, budget=budget)
        for items in owned
    )
