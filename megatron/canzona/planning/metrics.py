"""Quality of a plan: compute balance, padding, split matrices."""

from __future__ import annotations

from collections.abc import Sequence

from .cost import CostModel
from .plan import CanzonaPlan, DPPlan
from .specs import ParamSpec, matrix_specs


def lower_bound(specs: Sequence[ParamSpec], cost_model: CostModel, num_ranks: int) -> float:
    """No plan's makespan beats max(total / num_ranks, largest single matrix)."""
    costs = [cost_model.cost(s) for s in matrix_specs(specs)]
    return max(sum(costs) / num_ranks, max(costs, default=0.0))


def makespan_over_lower_bound(plan: DPPlan, bound: float) -> float:
    return max(plan.loads) / bound if bound > 0 else 1.0


def padding_overhead(plan: DPPlan) -> float:
    """Matrix-buffer elements over parameter elements, minus one."""
    return plan.matrix.numel / plan.matrix.param_numel - 1.0


def split_params(plan: DPPlan) -> int:
    """Matrices that no single DP rank holds whole."""
    return sum(p.host is None for p in plan.matrix.placements)


def summarize(plan: DPPlan, bound: float) -> dict:
    """The per-strategy record printed by ``tools/plan.py --json``."""
    return {
        "makespan_over_lower_bound": makespan_over_lower_bound(plan, bound),
        "padding_overhead": padding_overhead(plan),
        "split_params": split_params(plan),
        "num_buckets": len(plan.matrix.buckets),
        "uniform_collectives": all(b.uniform for b in plan.matrix.buckets),
        "loads": list(plan.loads),
    }


def tp_summary(plan: CanzonaPlan) -> dict:
    """Micro-group statistics over every DP rank's TP schedule."""
    tp_size = plan.tp[0].tp_size if plan.tp else 1
    rank_loads = [load for tp in plan.tp for load in tp.rank_loads]
    costs = [p.cost for p in plan.dp.matrix.placements]
    bound = max(sum(costs) / max(len(rank_loads), 1), max(costs, default=0.0))
    busiest = max(range(len(plan.tp)), key=lambda r: sum(plan.tp[r].rank_loads))
    groups = plan.tp[busiest].groups
    return {
        "tp_size": tp_size,
        "budget": plan.tp[busiest].budget,
        "max_groups_per_dp_rank": max(len(tp.groups) for tp in plan.tp),
        "dp_x_tp_lower_bound": bound,
        "dp_x_tp_makespan_over_lower_bound": max(rank_loads) / bound if bound > 0 else 1.0,
        "busiest_dp_rank": busiest,
        "busiest_group_slot_loads": [list(g.slot_loads) for g in groups],
    }
