"""Canzona's α-balanced plan of one pipeline stage: lean layouts, one host per matrix, micro-groups.

1. **Buckets** are Megatron's: contiguous in backprop order, near the bucket size
   (:func:`~megatron.canzona.planning.geometry.lean_bucket_ranges`), equal shards. The
   whole layout cuts them as Megatron does
   (:func:`~megatron.canzona.planning.geometry.stock_bucket_ranges`), a bucket closing later
   where that lets its matrices lie whole in equal shards
   (:func:`~megatron.canzona.planning.whole.whole_bucket_ranges`).
2. **Layouts.** Each bucket is filled at a ladder of shard widths
   (:func:`~megatron.canzona.planning.lean.shard_ladder`): the tightest width splits the
   most matrices across shards; wider ones pad more and keep more matrices whole. A whole
   matrix is pinned to the DP rank whose shard holds it, so each width is also filled with
   homes: list scheduling of all matrices over DP ranks says where each one belongs, and a
   shard takes whole only what is at home there (the rest is split, hosted freely).
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
With ``base_loads`` (the expert work each GPU already has, :mod:`~megatron.canzona.planning.experts`)
they start from it: homes and hosts fill around it, while the lower bound that scales
compute against bytes stays this plan's own, so only what the plan adds trades against
bytes (a uniform base leaves the plan unchanged).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from .comm import WireConfig, collective_bytes, narrow_bytes
from .cost import CostModel, tp_sides
from .fsdp import FSDP_LAYOUT, fsdp_buckets, fsdp_buffer
from .geometry import default_bucket_size, lean_bucket_ranges
from .hosts import HostItem, assign_hosts, default_budget, schedule_groups
from .lean import balanced_homes, lean_buffer, shard_ladder
from .memory import StateLayout, fsdp_host_elements
from .partition import DEFAULT_ALPHA, check_inputs, check_tp_size, elementwise_buffer
from .plan import BufferPlan, CanzonaPlan, DPPlan, Host
from .schedule import within
from .specs import ParamSpec, matrix_specs
from .whole import even_shards, whole_buffer, whole_bucket_ranges, whole_owners

LAYOUTS: tuple[str, ...] = ("whole", "lean")
"""DP layouts of the matrix buffers: ``whole`` (:mod:`~megatron.canzona.planning.whole`:
variable-size shards cut at parameter boundaries, nothing split, uneven collectives) and
``lean`` (:mod:`~megatron.canzona.planning.lean`: Megatron's equal shards, matrices split
where that saves padding, their pieces gathered to a host in the step)."""


TP_TOGETHER: tuple[str, ...] = ("off", "auto", "all")
"""Which TP-sharded matrices their TP ranks compute together, each on its own shard, instead of
one host gathering them (``--canzona-tp-together``): ``off``, none; ``auto``, each whose update
alone costs more than the stage's mean per GPU (it would set the step's floor); ``all``, every
one that may be (:func:`computed_together`)."""


def computed_together(spec: ParamSpec, cost_model: CostModel, mean_load: float, mode: str) -> bool:
    """Whether ``spec``'s TP ranks compute its update together (:data:`TP_TOGETHER`): Muon, a
    TP-sharded parameter that is one matrix (not split into Q/K/V or hosted in parts) whose
    TP-split side is its long one (else the Gram matrix summed among them is the long side's
    square), and, for ``auto``, whose whole update costs more than ``mean_load``."""
    if mode not in TP_TOGETHER:
        raise ValueError(f"unknown --canzona-tp-together {mode!r}; choose one of {', '.join(TP_TOGETHER)}")
    if mode == "off" or cost_model.kind != "muon" or not spec.tp_sharded or len(spec.matrices) != 1 \
            or len(spec.parts) != 1:
        return False
    split, other = tp_sides(spec, *spec.matrices[0])
    if split < other:
        return False
    return mode == "all" or cost_model.cost(spec) > mean_load


MAX_PADDING = 0.05
"""Padding, as a fraction of the matrix buffers' parameter elements, above which a lean fill
is never taken. Padding costs memory on every GPU (the parameter and gradient buffers), which
the byte objective does not see: at expert DP 2 a bucket of 2 + 3 expert matrices
(Qwen3-235B-A22B) pads 14% to stay whole, to save 0.3% of the bytes a rank sends."""


@dataclass(frozen=True)
class _Stage:
    """The matrices of one pipeline stage (per chunk, in backprop order) and how plans of
    them are scored."""

    mats: list[list[ParamSpec]]
    costs: list[list[float]]
    parts: list[list[list[float]]]
    """Per matrix, the cost of each part hosted apart (one part for most: its whole cost)."""
    dp_size: int
    tp_size: int
    alpha: float
    wire: WireConfig
    bound: float
    """Lower bound of the busiest GPU's compute: max(total / (DP · TP), largest matrix)."""
    byte_scale: float
    """Bytes of the stage's matrix buffers at the wire dtypes: what a rank's bytes compare to."""
    base: tuple[float, ...]
    """Compute each GPU (index dp_rank * tp_size + tp_rank) has before this plan's."""
    cost_model: CostModel
    """What the costs came from; also says which updates go narrower than fp32
    (:func:`~megatron.canzona.planning.comm.narrow_bytes`)."""
    together: frozenset[tuple[int, str]] = frozenset()
    """``(chunk, name)`` of the TP-sharded matrices their TP ranks compute together
    (:func:`computed_together`): their cost is each TP rank's share, and every TP rank of their
    DP rank computes one, as for a matrix every TP rank holds whole."""
    narrow_gathers: bool = False
    """The holders send each matrix whose update goes narrow in that dtype too
    (``--canzona-narrow-gathers``; :func:`~megatron.canzona.planning.comm.narrow_gather_bytes`)."""

    @classmethod
    def of(cls, mats: list[list[ParamSpec]], cost_model: CostModel, *, dp_size: int, tp_size: int, alpha: float,
           wire: WireConfig, base: tuple[float, ...] = (), together: str = "off", narrow_gathers: bool = False) -> _Stage:
        costs = [[cost_model.cost(s) for s in chunk] for chunk in mats]
        parts = [[cost_model.part_costs(s) for s in chunk] for chunk in mats]
        mean = sum(c * (1 if s.tp_sharded else tp_size) for chunk, chunk_costs in zip(mats, costs)
                   for s, c in zip(chunk, chunk_costs)) / (dp_size * tp_size)
        shared = set()
        for k, chunk in enumerate(mats):
            for i, s in enumerate(chunk):
                if computed_together(s, cost_model, mean, together):
                    shared.add((k, s.name))
                    costs[k][i] = cost_model.shared_cost(s)
                    parts[k][i] = [costs[k][i]]
        flat = [(s, c, (k, s.name) in shared) for k, (chunk, chunk_costs) in enumerate(zip(mats, costs))
                for s, c in zip(chunk, chunk_costs)]
        work = sum(c * (1 if s.tp_sharded and not t else tp_size) for s, c, t in flat)
        largest = max((c for chunk in parts for part_costs in chunk for c in part_costs), default=0.0)
        bound = max(work / (dp_size * tp_size), largest) or 1.0
        byte_scale = sum(s.numel for s, _, _ in flat) * (wire.grad_bytes + wire.param_bytes) + 1.0
        return cls(mats, costs, parts, dp_size, tp_size, alpha, wire, bound, byte_scale,
                   base or (0.0,) * (dp_size * tp_size), cost_model, frozenset(shared), narrow_gathers)

    def alone(self, chunk: int, spec: ParamSpec) -> bool:
        """Whether one TP rank computes ``spec`` (TP-sharded, not computed together)."""
        return spec.tp_sharded and (chunk, spec.name) not in self.together

    def dp_base(self) -> list[float]:
        """Base compute per DP rank, its TP ranks summed."""
        return [sum(self.base[d * self.tp_size:(d + 1) * self.tp_size]) for d in range(self.dp_size)]

    def row_costs(self) -> list[float]:
        """What each matrix costs the DP rank holding it whole (every TP rank's copy counts)."""
        return [c * (1 if self.alone(k, s) else self.tp_size) for k, (chunk, costs) in enumerate(zip(self.mats, self.costs))
                for s, c in zip(chunk, costs)]

    def hosts(self, buffers: list[BufferPlan], prefer_holders: bool = False, state: StateLayout | None = None,
              base_state: Sequence[int] | None = None) \
            -> tuple[float, list[HostItem], list[tuple[int, int | None]], list[float]]:
        """Hosts for the layouts ``buffers`` and the plan's score (lower is better); ``prefer_holders``:
        a split matrix is hosted by a rank holding some of it; ``state``: the optimizer whose
        state hosts keep under Megatron-FSDP, balanced as well as compute (``balance_state``)
        around the state each GPU already keeps (``base_state``)."""
        items = _host_items(buffers, self.mats, self.parts, self.cost_model, state, self.together, self.narrow_gathers)
        rs, ag, messages = collective_bytes(buffers, self.dp_size, self.wire)
        hosts, ranks = assign_hosts(
            items, dp_size=self.dp_size, tp_size=self.tp_size, alpha=self.alpha, wire=self.wire, base_bytes=rs + ag,
            byte_scale=self.byte_scale, load_scale=self.bound, base_loads=self.base, prefer_holders=prefer_holders,
            balance_state=state is not None, base_state=base_state,
        )
        latency = self.wire.latency_bytes
        busiest_wire = max(b + latency * (m + messages) for b, m in zip(ranks.bytes, ranks.messages))
        score = self.alpha * max(ranks.load) / self.bound + (1 - self.alpha) * busiest_wire / self.byte_scale
        return score, items, hosts, ranks.load


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
    base_loads: Sequence[Sequence[float]] | None = None,
    layout: str = "lean",
    fsdp_strategy: str = "optim_grads_params",
    fsdp_bucket_size: int | None = None,
    state: StateLayout | None = None,
    base_state: Sequence[Sequence[int]] | None = None,
    tp_together: str = "off",
    narrow_gathers: bool = False,
) -> CanzonaPlan:
    """The Canzona plan of the parameters ``specs`` (one pipeline stage, any model chunks),
    its matrix buffers laid out ``layout`` (:data:`LAYOUTS`), or Megatron-FSDP's (``fsdp``:
    its buckets of ``fsdp_strategy`` and ``fsdp_bucket_size``, :mod:`~megatron.canzona.planning.fsdp`).
    ``state``: the optimizer's state layout; under ``fsdp`` the hosts keep its state
    (:func:`~megatron.canzona.planning.memory.fsdp_host_elements`) and balance it within a
    small compute slack (:func:`~megatron.canzona.planning.hosts.assign_hosts`); ``None``, or
    any other layout (whose hosts keep state in the distributed optimizer's shards): compute alone.
    ``base_state[dp_rank][tp_rank]``: state elements each GPU already keeps as a host (its expert
    matrices'), which the hosts fill around.

    ``base_loads[dp_rank][tp_rank]``: compute each GPU already has (its expert work); homes
    and hosts fill around it. The plan's loads and budget count this plan's work only.

    ``tp_together`` (:data:`TP_TOGETHER`): the TP-sharded matrices whose TP ranks compute them
    together, each its own shard's task on one DP rank (:attr:`Host.together`). ``narrow_gathers``:
    the hosts are chosen with the narrow matrices' pieces priced at their narrow bytes
    (``--canzona-narrow-gathers``)."""
    check_inputs(dp_size, alpha, bucket_size)
    check_tp_size(tp_size)
    check_layout(layout)
    base = _flat_base(base_loads, dp_size, tp_size)
    bucket_size = default_bucket_size(dp_size) if bucket_size is None else bucket_size
    chunks = sorted({s.chunk for s in specs})
    if chunks != list(range(len(chunks))):
        raise ValueError(f"model chunks must be numbered 0, 1, ...; got {chunks}")
    mats = [matrix_specs([s for s in specs if s.chunk == c]) for c in chunks]
    stage = _Stage.of(mats, cost_model, dp_size=dp_size, tp_size=tp_size, alpha=alpha, wire=wire or WireConfig(),
                      base=base, together=tp_together, narrow_gathers=narrow_gathers)
    # The whole layout pads nothing, so it keeps Megatron's own bucket rule (a bucket closing
    # later only where that makes its shards equal): its last bucket closes where AdamW's would.
    if layout == "whole":
        buffers = _whole_fill(stage, [whole_bucket_ranges([s.numel for s in chunk], bucket_size, dp_size)
                                      for chunk in mats])
        _, items, hosts, loads = stage.hosts(buffers)
    elif layout == FSDP_LAYOUT:  # Megatron-FSDP's own buckets and shards, as it builds them: hosts only
        buffers = [fsdp_buffer(fsdp_buckets([s for s in specs if s.chunk == c], dp_size=dp_size, strategy=fsdp_strategy,
                                            bucket_size=fsdp_bucket_size), chunk, chunk_costs)
                   for c, chunk, chunk_costs in zip(chunks, mats, stage.costs)]
        kept = None if base_state is None else [int(x) for x in _flat_base(base_state, dp_size, tp_size, "base_state")]
        _, items, hosts, loads = stage.hosts(buffers, prefer_holders=True, state=state, base_state=kept)
    else:
        ranges = [lean_bucket_ranges([s.numel for s in chunk], bucket_size) for chunk in mats]
        _, buffers, items, hosts, loads = _best_fill(stage, ranges)
    loads = [load - b for load, b in zip(loads, stage.base)]  # this plan's own work
    plan = _assemble(
        specs, mats, buffers, items, hosts, loads, dp_size=dp_size, tp_size=tp_size, cost_model=cost_model,
        alpha=alpha, bucket_size=bucket_size, budget=budget,
    )
    return dataclasses.replace(plan, layout=layout)


def check_layout(layout: str) -> None:
    if layout not in (*LAYOUTS, FSDP_LAYOUT):
        raise ValueError(f"unknown Canzona layout {layout!r}; choose one of {', '.join(LAYOUTS)} (or {FSDP_LAYOUT})")


def _whole_fill(stage: _Stage, ranges: list[list[tuple[int, int]]]) -> list[BufferPlan]:
    """Every chunk's buffer in the whole layout, owners chosen over the whole stage."""
    flat = [s for chunk in stage.mats for s in chunk]
    even, k = [], 0
    for chunk, chunk_ranges in zip(stage.mats, ranges):
        for a, b in chunk_ranges:
            shards = even_shards([s.numel for s in chunk[a:b]], stage.dp_size)
            if shards is not None:
                even.append([[k + a + i for i in shard] for shard in shards])
        k += len(chunk)
    owners = whole_owners(
        [c for chunk in stage.costs for c in chunk], [s.numel for s in flat],
        [stage.alone(k, s) for k, chunk in enumerate(stage.mats) for s in chunk],
        dp_size=stage.dp_size, tp_size=stage.tp_size, alpha=stage.alpha, bound=stage.bound, base=stage.base,
        parts=[p for chunk in stage.parts for p in chunk], even=even,
    )
    buffers, k = [], 0
    for chunk, chunk_costs, chunk_ranges in zip(stage.mats, stage.costs, ranges):
        buffers.append(whole_buffer(chunk, chunk_costs, chunk_ranges, owners[k:k + len(chunk)], stage.dp_size))
        k += len(chunk)
    return buffers


def _best_fill(stage: _Stage, ranges: list[list[tuple[int, int]]]) -> tuple:
    """``(score, buffers, items, hosts, loads)`` of the best-scored fill of every width level,
    free and pinned to homes, among those padding at most :data:`MAX_PADDING` (the tightest
    width always qualifies but for alignment). Padding is never bought, not even for balance:
    it costs every GPU memory and bucket bytes for good, and a layout that keeps every matrix
    whole without padding is the whole layout's (a 3-layer model with one matrix per bucket
    at DP 4 padded 300% here to keep each whole)."""
    mats, dp_size = stage.mats, stage.dp_size
    ladders = [[shard_ladder([s.numel for s in chunk[a:b]], dp_size) for a, b in r] for chunk, r in zip(mats, ranges)]
    homes = iter(balanced_homes(stage.row_costs(), dp_size, stage.dp_base()))
    chunk_homes = [[next(homes) for _ in chunk] for chunk in mats]
    best: dict[bool, tuple] = {}  # by whether the fill pads more than MAX_PADDING
    levels = max((len(ladder) for chunk in ladders for ladder in chunk), default=1)
    for level, pinned in itertools.product(range(levels), (False, True)):
        # Pinned: a matrix is whole only on the DP rank list scheduling gives it, so whole
        # matrices cannot unbalance the plan (more of them are split instead).
        buffers = [
            lean_buffer(chunk, chunk_costs, r, [ladder[min(level, len(ladder) - 1)] for ladder in chunk_ladders],
                        dp_size, homes=home if pinned else None)
            for chunk, chunk_costs, r, chunk_ladders, home in zip(mats, stage.costs, ranges, ladders, chunk_homes)
        ]
        numel, params = sum(b.numel for b in buffers), sum(b.param_numel for b in buffers)
        padded = numel > (1 + MAX_PADDING) * params
        score, items, hosts, loads = stage.hosts(buffers)
        if padded not in best or score < best[padded][0]:
            best[padded] = (score, buffers, items, hosts, loads)
    return best[False] if False in best else best[True]


def plan_hosts(
    plan: DPPlan, specs: Sequence[ParamSpec], *, tp_size: int, cost_model: CostModel, alpha: float = DEFAULT_ALPHA,
    wire: WireConfig | None = None,
) -> CanzonaPlan:
    """Hosts and micro-groups for a given single-chunk layout (``eq1``'s, for comparison)."""
    mats = [matrix_specs(specs)]
    stage = _Stage.of(mats, cost_model, dp_size=plan.dp_size, tp_size=tp_size, alpha=alpha, wire=wire or WireConfig())
    _, items, hosts, loads = stage.hosts([plan.matrix])
    full = _assemble(specs, mats, [plan.matrix], items, hosts, loads, dp_size=plan.dp_size, tp_size=tp_size,
                     cost_model=cost_model, alpha=alpha, bucket_size=plan.bucket_size or 0, budget=None)
    layout = dataclasses.replace(plan, loads=full.layouts[0].loads)
    return dataclasses.replace(full, layouts=(layout,))


def _flat_base(base_loads: Sequence[Sequence[float]] | None, dp_size: int, tp_size: int,
               name: str = "base_loads") -> tuple[float, ...]:
    """``base_loads`` (or another per-GPU base, ``name``) as one value per GPU (index
    dp_rank * tp_size + tp_rank), checked."""
    if base_loads is None:
        return (0.0,) * (dp_size * tp_size)
    if len(base_loads) != dp_size or any(len(row) != tp_size for row in base_loads):
        raise ValueError(f"{name} must be dp_size x tp_size = {dp_size} x {tp_size} values, one per GPU")
    flat = tuple(float(load) for row in base_loads for load in row)
    if any(not load >= 0.0 or load == float("inf") for load in flat):
        raise ValueError(f"{name} must be finite and non-negative (what each GPU already has)")
    return flat


def _host_items(buffers: list[BufferPlan], mats: list[list[ParamSpec]], parts: list[list[list[float]]],
                cost_model: CostModel, state: StateLayout | None = None,
                together: frozenset[tuple[int, str]] = frozenset(), narrow_gathers: bool = False) -> list[HostItem]:
    """Every matrix of every chunk (every part of one hosted in parts), in chunk then buffer order;
    one ``together`` is placed as a matrix every TP rank computes, at its shared cost; with
    ``narrow_gathers`` a narrow one's pieces go to its host at its update's bytes."""
    items = []
    for chunk, (buffer, specs, part_costs) in enumerate(zip(buffers, mats, parts)):
        by_name = {s.name: (s, c) for s, c in zip(specs, part_costs)}
        for p in buffer.placements:
            spec, costs = by_name[p.name]
            pieces = buffer.pieces(p)
            for k, ((lo, hi, _), cost) in enumerate(zip(spec.parts, costs)):
                span = None if len(costs) == 1 else (lo, hi)
                shared = (chunk, p.name) in together
                narrow = narrow_bytes(cost_model, spec, k)
                items.append(HostItem(
                    cost=cost if span or shared else p.cost, dp_rank=p.host, tp_sharded=spec.tp_sharded and not shared,
                    together=shared,
                    pieces=tuple((d, end - start) for d, start, end in within(pieces, lo, hi)),
                    chunk=chunk, name=p.name, part=k, span=span, bucket=p.bucket, update_bytes=narrow,
                    gather_bytes=narrow if narrow_gathers and not shared else None,
                    state=0 if state is None else fsdp_host_elements(state, spec, k),
                ))
    return items


def _assemble(
    specs: Sequence[ParamSpec], mats: list[list[ParamSpec]], buffers: list[BufferPlan], items: list[HostItem],
    hosts: list[tuple[int, int | None]], loads: list[float], *, dp_size: int, tp_size: int,
    cost_model: CostModel, alpha: float, bucket_size: int, budget: float | None,
) -> CanzonaPlan:
    costs = [item.cost for item in items]
    # A matrix every TP rank computes is grouped with TP rank 0's work of its DP rank.
    host_rank = [d * tp_size + (t or 0) for d, t in hosts]
    user_budget = budget is not None
    budget = default_budget(loads, costs) if budget is None else budget
    local = [item.dp_rank is not None and not item.tp_sharded for item in items]
    # Reduce order: the last model chunk's backward runs first, bucket 0 of a buffer first.
    ready = [(-item.chunk, item.bucket) for item in items]
    groups = schedule_groups(costs, host_rank, budget=budget, at_least_two=not user_budget, local=local, ready=ready)
    entries = [
        Host(name=item.name, chunk=item.chunk, dp_rank=d, tp_rank=t, group=g, cost=item.cost, part=item.part,
             span=item.span, together=item.together)
        for item, (d, t), g in zip(items, hosts, groups)
    ]
    entries.sort(key=lambda h: (h.group, -h.cost, h.chunk, h.name, h.part))
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
