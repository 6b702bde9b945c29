"""Canzona's α-balanced plan of one pipeline stage: lean layouts, one host per matrix, micro-groups.

1. **Buckets** are Megatron's: contiguous in backprop order, near the bucket size
   (:func:`~megatron.canzona.planning.geometry.lean_bucket_ranges`), equal shards.
2. **Layouts.** Each bucket is filled at a ladder of shard widths
   (:func:`~megatron.canzona.planning.lean.shard_ladder`): the tightest width splits the
   most matrices across shards; wider ones pad more and keep more matrices whole.
3. **Hosts.** At each width, every matrix gets one host (DP rank, TP rank) over all ranks
   together (:func:`~megatron.canzona.planning.hosts.assign_hosts`).
4. **Choice.** The width whose plan minimises

       α · makespan / lower bound + (1 − α) · bytes of the busiest rank / buffer bytes

   wins, the makespan and the lower bound taken over all DP × TP ranks and the bytes being
   everything a rank sends in the step, padding and host groups included (plus
   ``WireConfig.latency_bytes`` per message). α = 1 favours equal compute, α = 0 the fewest
   bytes moved.
5. **Micro-groups** order each host's work into pipelined groups
   (:func:`~megatron.canzona.planning.hosts.schedule_groups`).

Loads carry across buckets and across the model chunks of a stage (virtual pipeline).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .comm import WireConfig, buffer_bytes_per_rank, collective_bytes
from .cost import CostModel
from .geometry import default_bucket_size, lean_bucket_ranges
from .hosts import HostItem, assign_hosts, default_budget, schedule_groups
from .lean import lean_buffer, shard_ladder
from .partition import DEFAULT_ALPHA, check_inputs, check_tp_size, elementwise_buffer
from .plan import BufferPlan, CanzonaPlan, DPPlan, Host
from .specs import ParamSpec, matrix_specs


def plan_canzona(
    specs: Sequence[ParamSpec],
    *,
    dp_size: int,
    tp_size: int = 1,
    cost_model: CostModel,
    alpha: float = DEFAULT_ALPHA,
    bucket_size: int | None = None,
    wire: WireConfig | None = None,
    budget: float | None = None,
) -> CanzonaPlan:
    """The Canzona plan of the parameters ``specs`` (one pipeline stage, any model chunks)."""
    check_inputs(dp_size, alpha, bucket_size)
    check_tp_size(tp_size)
    bucket_size = default_bucket_size(dp_size) if bucket_size is None else bucket_size
    wire = wire or WireConfig()
    chunks = sorted({s.chunk for s in specs})
    if chunks != list(range(len(chunks))):
        raise ValueError(f"model chunks must be numbered 0, 1, ...; got {chunks}")
    mats = [matrix_specs([s for s in specs if s.chunk == c]) for c in chunks]
    costs = [[cost_model.cost(s) for s in chunk] for chunk in mats]
    ranges = [lean_bucket_ranges([s.numel for s in chunk], bucket_size) for chunk in mats]
    ladders = [[shard_ladder([s.numel for s in chunk[a:b]], dp_size) for a, b in r] for chunk, r in zip(mats, ranges)]
    flat = [(s, c) for chunk, chunk_costs in zip(mats, costs) for s, c in zip(chunk, chunk_costs)]
    work = [c * (1 if s.tp_sharded else tp_size) for s, c in flat]
    bound = max(sum(work) / (dp_size * tp_size), max((c for _, c in flat), default=0.0)) or 1.0
    byte_scale = sum(s.numel for s, _ in flat) * (wire.grad_bytes + wire.param_bytes) + 1.0

    best = None
    levels = max((len(ladder) for chunk in ladders for ladder in chunk), default=1)
    for level in range(levels):
        buffers = [
            lean_buffer(chunk, chunk_costs, r, [ladder[min(level, len(ladder) - 1)] for ladder in chunk_ladders], dp_size)
            for chunk, chunk_costs, r, chunk_ladders in zip(mats, costs, ranges, ladders)
        ]
        items = _host_items(buffers, mats)
        rs, ag, messages = collective_bytes(buffers, dp_size, wire)
        hosts, ranks = assign_hosts(
            items, dp_size=dp_size, tp_size=tp_size, alpha=alpha, wire=wire, base_bytes=rs + ag,
            byte_scale=byte_scale, load_scale=bound,
        )
        busiest_wire = max(b + wire.latency_bytes * (m + messages) for b, m in zip(ranks.bytes, ranks.messages))
        score = alpha * max(ranks.load) / bound + (1 - alpha) * busiest_wire / byte_scale
        if best is None or score < best[0]:
            best = (score, buffers, items, hosts, ranks.load)
    assert best is not None
    _, buffers, items, hosts, loads = best
    return _assemble(
        specs, mats, buffers, items, hosts, loads, dp_size=dp_size, tp_size=tp_size, cost_model=cost_model,
        alpha=alpha, bucket_size=bucket_size, budget=budget,
    )


def plan_hosts(
    plan: DPPlan, specs: Sequence[ParamSpec], *, tp_size: int, cost_model: CostModel, alpha: float = DEFAULT_ALPHA,
    wire: WireConfig | None = None,
) -> CanzonaPlan:
    """Hosts and micro-groups for a given single-chunk layout (``eq1``'s, for comparison)."""
    wire = wire or WireConfig()
    mats = [matrix_specs(specs)]
    buffers = [plan.matrix]
    items = _host_items(buffers, mats)
    flat = [(s, cost_model.cost(s)) for s in mats[0]]
    bound = max(sum(c * (1 if s.tp_sharded else tp_size) for s, c in flat) / (plan.dp_size * tp_size),
                max((c for _, c in flat), default=0.0)) or 1.0
    rs, ag, _ = collective_bytes(buffers, plan.dp_size, wire)
    hosts, ranks = assign_hosts(
        items, dp_size=plan.dp_size, tp_size=tp_size, alpha=alpha, wire=wire, base_bytes=rs + ag,
        byte_scale=sum(s.numel for s, _ in flat) * (wire.grad_bytes + wire.param_bytes) + 1.0, load_scale=bound,
    )
    full = _assemble(specs, mats, buffers, items, hosts, ranks.load, dp_size=plan.dp_size, tp_size=tp_size,
                     cost_model=cost_model, alpha=alpha, bucket_size=plan.bucket_size or 0, budget=None)
    layout = dataclasses.replace(plan, loads=full.layouts[0].loads)
    return dataclasses.replace(full, layouts=(layout,))


def _host_items(buffers: list[BufferPlan], mats: list[list[ParamSpec]]) -> list[HostItem]:
    """Every matrix of every chunk, in chunk then buffer order."""
    items = []
    for buffer, chunk in zip(buffers, mats):
        sharded = {s.name: s.tp_sharded for s in chunk}
        for p in buffer.placements:
            items.append(HostItem(
                cost=p.cost, dp_rank=p.host, tp_sharded=sharded[p.name],
                pieces=tuple((d, hi - lo) for d, lo, hi in buffer.pieces(p)),
            ))
    return items


def _assemble(
    specs: Sequence[ParamSpec], mats: list[list[ParamSpec]], buffers: list[BufferPlan], items: list[HostItem],
    hosts: list[tuple[int, int | None]], loads: list[float], *, dp_size: int, tp_size: int,
    cost_model: CostModel, alpha: float, bucket_size: int, budget: float | None,
) -> CanzonaPlan:
    names = [(chunk, p.name) for chunk, buffer in enumerate(buffers) for p in buffer.placements]
    costs = [item.cost for item in items]
    # A matrix every TP rank computes is grouped with TP rank 0's work of its DP rank.
    host_rank = [d * tp_size + (t or 0) for d, t in hosts]
    user_budget = budget is not None
    budget = default_budget(loads, costs) if budget is None else budget
    local = [item.dp_rank is not None and not item.tp_sharded for item in items]
    groups = schedule_groups(costs, host_rank, budget=budget, at_least_two=not user_budget, local=local)
    entries = [
        Host(name=name, chunk=chunk, dp_rank=d, tp_rank=t, group=g, cost=c)
        for (chunk, name), (d, t), g, c in zip(names, hosts, groups, costs)
    ]
    entries.sort(key=lambda h: (h.group, -h.cost, h.chunk, h.name))
    layouts = []
    for chunk, buffer in enumerate(buffers):
        chunk_loads = [0.0] * dp_size
        for h in entries:
            if h.chunk == chunk:
                chunk_loads[h.dp_rank] += h.cost * (tp_size if h.tp_rank is None else 1)
        layouts.append(DPPlan(
            strategy="canzona", dp_size=dp_size, alpha=alpha, cost_kind=cost_model.kind, bucket_size=bucket_size,
            matrix=buffer, elementwise=elementwise_buffer([s for s in specs if s.chunk == chunk], dp_size, bucket_size),
            loads=tuple(chunk_loads),
        ))
    return CanzonaPlan(layouts=tuple(layouts), tp_size=tp_size, hosts=tuple(entries), budget=budget)


def matrix_buffer_bytes(plan: CanzonaPlan, wire: WireConfig) -> float:
    """Reduce-scatter plus all-gather bytes per rank of the plan's matrix buffers."""
    return buffer_bytes_per_rank([dp.matrix for dp in plan.layouts], plan.dp_size, wire)
