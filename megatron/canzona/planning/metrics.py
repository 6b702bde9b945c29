"""Quality of a plan: compute balance, padding, buckets, and the bytes each rank sends.

Every strategy is scored the same way (``tools/plan.py --json`` prints these records):

* ``makespan_over_lower_bound``: the optimizer compute of the busiest GPU, a (DP, TP) rank,
  over max(total / (dp_size · tp_size), largest matrix); a strategy that computes a
  TP-sharded matrix on every TP rank (synchronous compute) pays it on each. At TP 1 it is
  the DP ranks' balance;
* ``dp_makespan_over_lower_bound``: the busiest DP rank's compute, its TP ranks summed,
  over max(total / dp_size, largest matrix): how evenly the DP layout spreads the work;
* ``padding_overhead``: matrix-buffer elements over parameter elements, minus one;
* ``num_buckets`` and ``largest_bucket_elements`` of the matrix buffer;
* ``comm_bytes_per_rank``: what the busiest rank sends in one step for gradients and
  parameters (:mod:`megatron.canzona.planning.comm`): reduce-scatter and all-gather of
  both buffers, host-group gathers and scatters, synchronous-compute gathers.

Expert-parallel parameters are never counted in this record. With expert buffers the record
gains ``experts`` (the same fields for the expert buffers, over expert DP x expert TP),
``combined_makespan_over_lower_bound`` (per GPU of the stage: its dense plus its expert
compute, over max(all of it / GPUs, largest matrix); every EP rank computes its own local
experts) and ``combined_gpu_loads``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .comm import RankTraffic, WireConfig, narrow_gather_bytes, narrow_update_bytes, shared_grams, traffic
from .cost import CostModel
from .grid import dense_to_expert
from .plan import BufferPlan, CanzonaPlan, DPPlan
from .schedule import Task, buffer_schedule, plan_schedule
from .specs import ParamSpec, matrix_specs


def lower_bound(specs: Sequence[ParamSpec], cost_model: CostModel, num_ranks: int) -> float:
    """No plan's makespan beats max(total / num_ranks, largest single matrix)."""
    costs = [cost_model.cost(s) for s in matrix_specs(specs)]
    return max(sum(costs) / num_ranks, max(costs, default=0.0))


def makespan_over_lower_bound(loads: Sequence[float], bound: float) -> float:
    return max(loads, default=0.0) / bound if bound > 0 else 1.0


def padding_overhead(buffers: Sequence[BufferPlan]) -> float:
    """Matrix-buffer elements over parameter elements, minus one."""
    numel = sum(b.numel for b in buffers)
    params = sum(b.param_numel for b in buffers)
    return numel / params - 1.0 if params else 0.0


def split_params(buffers: Sequence[BufferPlan]) -> int:
    """Matrices that no single DP rank holds whole."""
    return sum(p.host is None for b in buffers for p in b.placements)


def summarize_canzona(plan: CanzonaPlan, specs: Sequence[ParamSpec], cost_model: CostModel, wire: WireConfig, *,
                      narrow_gathers: bool = False) -> dict:
    """The record of a stage's Canzona plan, one host per matrix; ``specs`` are the stage's
    (expert-parallel ones are scored against ``plan.experts``, never in the dense record);
    ``narrow_gathers``: the run's ``--canzona-narrow-gathers`` (:func:`~.comm.narrow_gather_bytes`)."""
    dense = [s for s in specs if not s.is_expert]
    record = summarize_plan(plan, dense, cost_model, wire, narrow_gathers=narrow_gathers)
    if plan.experts is None:
        return record
    experts = [s for s in specs if s.is_expert]
    expert_record = summarize_plan(plan.experts, experts, cost_model, wire, narrow_gathers=narrow_gathers)
    return with_experts(record, expert_record, specs, cost_model,
                        dp_size=plan.dp_size, tp_size=plan.tp_size, ep_size=plan.ep_size,
                        expert_tp_size=plan.experts.tp_size)


def summarize_plan(plan: CanzonaPlan, specs: Sequence[ParamSpec], cost_model: CostModel, wire: WireConfig, *,
                   narrow_gathers: bool = False) -> dict:
    """The record of ``plan``'s own buffers, ``specs`` being what it was made of (dense or
    expert); :func:`summarize_canzona` is the record of a whole stage."""
    rank_loads = [load for row in plan.rank_loads() for load in row]
    dp_loads = [sum(row) for row in plan.rank_loads()]
    return _summary([dp.matrix for dp in plan.layouts], _elementwise(plan.layouts), dp_loads, rank_loads,
                    plan_schedule(plan).tasks, specs, cost_model, wire, plan.dp_size, plan.tp_size, narrow_gathers)


def with_experts(
    dense: dict, experts: dict, specs: Sequence[ParamSpec], cost_model: CostModel, *, dp_size: int, tp_size: int,
    ep_size: int, expert_tp_size: int,
) -> dict:
    """The dense record with the expert buffers' record beside it and the combined balance."""
    coords = dense_to_expert(dp_size=dp_size, tp_size=tp_size, ep_size=ep_size, expert_tp_size=expert_tp_size)
    combined = [load + experts["gpu_loads"][edp * expert_tp_size + etp]
                for load, (edp, etp) in zip(dense["gpu_loads"], coords)]
    bound = combined_lower_bound(specs, cost_model, dp_size=dp_size, tp_size=tp_size, ep_size=ep_size,
                                 expert_tp_size=expert_tp_size)
    return {**dense, "experts": experts,
            "combined_makespan_over_lower_bound": makespan_over_lower_bound(combined, bound),
            "combined_gpu_loads": combined}


def combined_lower_bound(specs: Sequence[ParamSpec], cost_model: CostModel, *, dp_size: int, tp_size: int,
                         ep_size: int, expert_tp_size: int) -> float:
    """No GPU's dense plus expert compute beats max(all of it / GPUs, largest matrix): every EP
    rank computes its own local experts, and a matrix not TP-sharded is computed on every TP
    rank holding it."""
    total, largest = 0.0, 0.0
    for s in matrix_specs(specs):
        cost = cost_model.cost(s)
        copies = ep_size * (1 if s.tp_sharded else expert_tp_size) if s.is_expert else (1 if s.tp_sharded else tp_size)
        total, largest = total + cost * copies, max(largest, cost)
    return max(total / (dp_size * tp_size), largest)


def summarize_sync(plan: DPPlan, specs: Sequence[ParamSpec], cost_model: CostModel, wire: WireConfig,
                   tp_size: int) -> dict:
    """The record of a layout whose matrices are computed by every rank holding a piece
    (stock ZeRO-1; Megatron's layer-wise optimizer in ``muon_tp_mode duplicated``)."""
    rank_loads = [load for load in plan.loads for _ in range(tp_size)]
    tasks = buffer_schedule([plan.matrix], specs, tp_size).tasks
    return _summary([plan.matrix], _elementwise([plan]), list(plan.loads), rank_loads, tasks, specs, cost_model,
                    wire, plan.dp_size, tp_size)


def _elementwise(layouts: Sequence[DPPlan]) -> list[BufferPlan]:
    return [dp.elementwise for dp in layouts if dp.elementwise is not None]


def _summary(
    matrix: list[BufferPlan], elementwise: list[BufferPlan], dp_loads: list[float], rank_loads: list[float],
    tasks: Sequence[Task], specs: Sequence[ParamSpec], cost_model: CostModel, wire: WireConfig, dp_size: int, tp_size: int,
    narrow_gathers: bool = False,
) -> dict:
    bound = lower_bound(specs, cost_model, dp_size)
    costs = [cost_model.cost(s) * (1 if s.tp_sharded else tp_size) for s in matrix_specs(specs)]
    rank_bound = max(sum(costs) / (dp_size * tp_size), max((cost_model.cost(s) for s in matrix_specs(specs)), default=0.0))
    per_rank = traffic(matrix + elementwise, tasks, dp_size=dp_size, tp_size=tp_size, wire=wire,
                       narrow=narrow_update_bytes(tasks, specs, cost_model),
                       grams=shared_grams(tasks, specs, cost_model),
                       gathers=narrow_gather_bytes(tasks, specs, cost_model) if narrow_gathers else None)
    busiest: RankTraffic = max(per_rank, key=lambda r: r.total)
    buckets = [b for buffer in matrix for b in buffer.buckets]
    return {
        "makespan_over_lower_bound": makespan_over_lower_bound(rank_loads, rank_bound),
        "dp_makespan_over_lower_bound": makespan_over_lower_bound(dp_loads, bound),
        "padding_overhead": padding_overhead(matrix),
        "split_params": split_params(matrix),
        "num_buckets": len(buckets),
        "largest_bucket_elements": max((b.numel for b in buckets), default=0),
        "comm_bytes_per_rank": busiest.total,
        "comm_bytes_breakdown": busiest.as_dict(),
        "collective_bytes_per_rank": busiest.reduce_scatter + busiest.all_gather,
        "uniform_collectives": all(b.uniform for b in buckets),
        "loads": list(dp_loads),
        "gpu_loads": list(rank_loads),
    }
