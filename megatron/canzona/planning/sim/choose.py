"""``--canzona-layout auto``: the DP layout projected faster,
``--canzona-matrices-reduce-first``'s default: the reduce order projected faster, and
``--canzona-fsdp-micro-groups auto``: the micro-groups projected faster under Megatron-FSDP, by
the projection ``tools/simulate.py`` prints."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..comm import WireConfig
from ..memory import EARLY_COMPUTE_BYTES
from ..plan import CanzonaPlan
from ..specs import ParamSpec
from .cluster import ClusterSpec
from .fsdp import simulate_fsdp
from .result import StrategyResult
from .simulate import Workload, simulate

ONE_GROUP_BUDGET = math.inf
"""The planner's budget that puts every matrix in one micro-group (each host one run)."""


def project_plan(specs: Sequence[ParamSpec], plan: CanzonaPlan, *, instances: int = 1, **kwargs) -> StrategyResult:
    """The projected iteration of ``plan`` of one pipeline stage (``specs``) at its own parallel
    sizes: :func:`~.simulate.simulate` with ``kwargs`` (cluster, optimizer, wire, workload, ...);
    ``instances``: the plan is one of that many distributed-optimizer instances'."""
    return simulate(specs, strategy="canzona", dp_size=plan.dp_size * instances, tp_size=plan.tp_size,
                    ep_size=plan.ep_size, expert_tp_size=plan.experts.tp_size if plan.experts is not None else 1,
                    plan=plan, instances=instances, **kwargs)


def project_layouts(
    specs: Sequence[ParamSpec], plans: Mapping[str, CanzonaPlan], *, cluster: ClusterSpec, optimizer: str,
    wire: WireConfig | None = None, workload: Workload | None = None, ns_method: str = "standard",
    early_compute: bool = False, early_compute_bytes: int | None = EARLY_COMPUTE_BYTES,
    matrices_first: bool | None = False, instances: int = 1,
) -> dict[str, StrategyResult]:
    """The projected iteration of each layout's plan of one pipeline stage (``specs``), Muon's
    Newton-Schulz by ``ns_method``, as the run will take it: with ``early_compute`` (within
    ``early_compute_bytes`` per rank) and the reduce order ``matrices_first`` (``None``: the one
    :func:`project_reduce_orders` projects faster, as its default picks it)."""
    common = dict(cluster=cluster, optimizer=optimizer, wire=wire, workload=workload, ns_method=ns_method,
                  instances=instances)
    out = {}
    for name, plan in plans.items():
        if early_compute and matrices_first is None:
            orders = project_reduce_orders(specs, plan, early_compute_bytes=early_compute_bytes, **common)
            out[name] = orders[faster_order(orders)]
        else:
            out[name] = project_plan(specs, plan, early_compute=early_compute, early_compute_bytes=early_compute_bytes,
                                     matrices_first=bool(matrices_first), **common)
    return out


def project_reduce_orders(
    specs: Sequence[ParamSpec], plan: CanzonaPlan, *, cluster: ClusterSpec, optimizer: str,
    wire: WireConfig | None = None, workload: Workload | None = None, ns_method: str = "standard",
    early_compute_bytes: int | None = EARLY_COMPUTE_BYTES, instances: int = 1,
) -> dict[bool, StrategyResult]:
    """The projected iteration of ``plan`` with early compute (within ``early_compute_bytes`` per
    rank), its dense buckets without a matrix reduced in backward order (``False``) and after the
    matrices (``True``)."""
    return {first: project_plan(specs, plan, cluster=cluster, optimizer=optimizer, wire=wire, workload=workload,
                                ns_method=ns_method, early_compute=True, early_compute_bytes=early_compute_bytes,
                                matrices_first=first, instances=instances)
            for first in (False, True)}


def faster_order(results: Mapping[bool, StrategyResult]) -> bool:
    """Whether the matrices go first: only where that iteration is projected strictly shorter."""
    return results[True].iteration_seconds < results[False].iteration_seconds


def reduce_order_line(results: Mapping[bool, StrategyResult], cluster: ClusterSpec) -> tuple[bool, str]:
    """:func:`faster_order`, and one log line saying so."""
    first = faster_order(results)
    line = (f"[canzona] matrices reduce first: {'on' if first else 'off'} (projected on {cluster.name}: iteration "
            f"{1e3 * results[True].iteration_seconds:.1f} ms with, {1e3 * results[False].iteration_seconds:.1f} ms "
            "without)")
    return first, line


def faster_layout(results: Mapping[str, StrategyResult]) -> str:
    """The layout of the shorter projected iteration, then the shorter step; the first one
    named on a tie. Never one projected slower on both."""
    names = list(results)
    return min(names, key=lambda n: (results[n].iteration_seconds, results[n].optimizer_step_seconds, names.index(n)))


def layout_line(choice: str, results: Mapping[str, StrategyResult], cluster: ClusterSpec, *,
                iteration: bool) -> str:
    """One log line: the choice and every layout's projected step (and iteration)."""
    parts = []
    for name, r in results.items():
        text = f"{name} step {1e3 * r.optimizer_step_seconds:.2f} ms"
        if iteration:
            text += f", iteration {1e3 * r.iteration_seconds:.1f} ms"
        parts.append(text)
    return f"[canzona] layout auto -> {choice} (projected on {cluster.name}): " + " | ".join(parts)


def project_fsdp_groups(specs: Sequence[ParamSpec], *, cluster: ClusterSpec,
                        **kwargs) -> dict[str, tuple[StrategyResult, StrategyResult]]:
    """Canzona's projected iteration under Megatron-FSDP (:func:`~.fsdp.simulate_fsdp` with
    ``kwargs``) in one micro-group (``one``) and in the planner's default ones (``budget``), each
    with the clip idle and with it acting every iteration (``clip_rate`` 0 and 1).

    Under Megatron-FSDP every group's gather goes during backward, all of them before the step
    (the early gathers), on a link FSDP's own collectives keep busy. One fused all-to-all holds
    that link for its busiest rank's bytes; the default groups, cut per host by cost, hold it for
    the sum of each group's busiest rank, and FSDP's geometry makes those differ: every layer's
    bucket is cut at the same offsets, so a rank's shard lies in the same matrix of every layer,
    and a group of the large matrices loads the ranks holding them and their hosts only. Where
    the step gathers itself (Muon when the clip acts) the groups pipeline it, which one group
    cannot."""
    return {name: tuple(simulate_fsdp(specs, strategy="canzona", cluster=cluster, clip_rate=rate,
                                      tp_budget=ONE_GROUP_BUDGET if name == "one" else None, **kwargs)
                        for rate in (0.0, 1.0))
            for name in ("one", "budget")}


def faster_fsdp_groups(results: Mapping[str, Sequence[StrategyResult]]) -> str:
    """``one`` where its slower iteration, of the clip idle and the clip acting every iteration, is
    strictly shorter than the budget's, else ``budget``: how often the clip acts is not known before
    the run, so the choice whose worse case is better (a choice that wins only while the clip stays
    idle loses the run whose clip acts)."""
    def worst(name: str) -> float:
        return max(r.iteration_seconds for r in results[name])
    return "one" if worst("one") < worst("budget") else "budget"


def fsdp_groups_line(choice: str, results: Mapping[str, Sequence[StrategyResult]], cluster: ClusterSpec) -> str:
    """One log line: the micro-groups ``auto`` took and the projected iterations."""
    def both(name: str) -> str:
        idle, acting = results[name]
        return f"{1e3 * idle.iteration_seconds:.1f} / {1e3 * acting.iteration_seconds:.1f} ms"
    groups = results["budget"][0].details.get("num_groups", 0)
    return (f"[canzona] micro-groups under Megatron-FSDP: {choice} (projected on {cluster.name}, iteration with the "
            f"clip idle / acting every iteration: {both('one')} in one group, {both('budget')} in the planner's "
            f"{groups})")
