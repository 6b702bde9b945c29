"""One iteration under fully sharded data parallelism: FSDP's own collectives, then each design's step.

    from megatron.canzona.planning.sim.fsdp import FSDP_STRATEGIES, simulate_fsdp

    result = simulate_fsdp(specs, strategy="canzona", cluster=cluster, dp_size=64, tp_size=1,
                           sharding="optim_grads_params", workload=Workload(global_batch=128),
                           early_compute=True)

The buckets are Megatron-FSDP's as it builds them (:func:`~megatron.canzona.planning.fsdp.fsdp_buckets`:
one per transformer layer under ``optim_grads_params``), sharded over the DP group (the expert
buckets over expert DP, one copy per EP rank). Every strategy pays the same forward and backward:

* **Per micro-batch.** Forward walks the buckets in forward order and backward in reverse, each
  bucket's share of a micro-batch's compute its parameters' matmul work. Under
  ``optim_grads_params`` a bucket is all-gathered (``param_bytes``) before its forward and again
  before its backward, the next one prefetched while the current one computes; its gradient is
  reduce-scattered (``grad_bytes``) after its backward, every micro-batch (``optim_grads`` too;
  ``optim`` only in the last micro-batch, as DDP). Under ``optim`` and ``optim_grads`` the
  parameters stay whole between steps, gathered once after the step, before the first forward of
  the next iteration needs them. The collectives run one at a time in the order they are issued
  (the links are one), compute beside them; compute waits for a bucket's gather.
* **Canzona's early gathers.** In the last micro-batch's backward, once every bucket holding a
  matrix of a micro-group has ended its final reduce-scatter, the group's gather (one fused
  all-to-all of its pieces to their hosts) is issued, on CUDA and on gloo alike, as the runtime's
  early gathers do under DDP. Its heaviest rank's inter-node seconds join the one queue right
  after that reduce-scatter (``step_gather``), delaying the collectives queued behind it by what
  the idle link does not absorb; a group whose pieces stay on their nodes rides nothing. Muon's
  (and AdaMuon's) gathers carry the Newton-Schulz input its holders make from their momentum and
  the clipped gradient, so they go early only in the iterations the speculation policy speculates
  that no clip acts, and the step gathers again where one acted (:func:`_speculative_step`);
  Shampoo's and SOAP's carry raw gradients, early whatever the clip. What the holders do to their
  pieces first is priced at memory speed (:func:`~.step.holder_prep`): Muon's source, under
  ``narrow_gathers`` their share of the exact norm and its two tiny all-reduces, made for each
  bucket as it reduces, on the gathers' side stream (beside backward, as the runtime's
  ``EarlyGathers`` makes them); then the packing, once the group's last bucket is in. Gathered in
  the step, all of it comes before each group's gather.
* **The step** starts once the last reduce-scatter ends, with what each design does with the shards:

  - ``canzona`` -- one host per matrix (:func:`~megatron.canzona.planning.planner.make_plan`,
    ``layout="fsdp"``), the update scattered back in pipelined micro-groups (gather k+1 | compute k
    | scatter k | apply k−1), as the runtime's ``bind_fsdp`` runs it, each group's gather already
    on its way from backward (above). With ``early_compute`` each host computes a gathered group
    once backward's compute is over, in FSDP's reduce-scatter tail, speculating that the clip does
    not act; the step then commits, scatters and applies (:func:`~.simulate.simulate`'s pricing:
    :class:`~.step.EarlyCompute`, the policy's shares at ``clip_rate``). The host's seconds include
    the momentum, which under FSDP its holders advance (a few hundred microseconds at most);
  - ``every_holder`` -- NVIDIA/Megatron-LM #4486: every rank holding a piece of a matrix
    all-gathers it whole and runs Newton-Schulz on it, one matrix at a time (TP shards too);
  - ``owner_uniform`` -- an owner per matrix over uniform per-parameter row shards (PyTorch
    FSDP2's geometry, :data:`~megatron.canzona.planning.fsdp.PER_PARAMETER`: torchtitan's
    DistMuon, microsoft/dion, FSDP-Canzona): every matrix lies in ``1/DP`` of its rows on every
    DP rank. Its owners and micro-groups are Canzona's planner's over that geometry, pipelined
    as ``canzona`` but gathered in the step, as torchtitan, Dion and FSDP-Canzona gather: the
    best this geometry allows (torchtitan and Dion pick owners round-robin);
  - ``adamw`` -- Megatron's AdamW on each rank's shard of every bucket.

  AdamW of the elementwise parameters runs on each rank's shard of them in every design.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ..comm import GRAM_REDUCE_BYTES, WireConfig
from ..cost import NS_OPTIMIZERS, OPTIMIZERS, Calibration, CostModel
from ..experts import split_experts
from ..fsdp import FSDP_LAYOUT, PER_PARAMETER, SHARDING_STRATEGIES, FsdpBucket, fsdp_buckets, fsdp_buffer
from ..memory import EARLY_COMPUTE_BYTES, HOLDER_MOMENTUM_OPTIMIZERS, STATE_BYTES, StateLayout
from ..partition import DEFAULT_ALPHA
from ..planner import make_plan
from ..speculation import SpeculationRates, expected_rates
from ..specs import ParamSpec, matrix_specs
from .cluster import ClusterSpec
from .iteration import BACKWARD_SHARE, Rider
from .layouts import Grid, RankOf, Seconds, Sharded, Work, merge, plan_tasks
from .network import Topology
from .result import Segment, StrategyResult
from .simulate import (CANZONA_STRATEGIES, EXPERTS, Workload, checked_grid, matmul_weight,
                       micro_batches, run_step, seconds_per_update, tp_sharded_seconds, work_riders)
from .step import EarlyCompute, SimTask, StepRun, holder_prep

FSDP_STRATEGIES: tuple[str, ...] = ("canzona", "every_holder", "owner_uniform", "adamw")
"""The designs :func:`simulate_fsdp` prices (module docstring)."""
FSDP_PEERS: tuple[str, ...] = ("every_holder", "owner_uniform")
"""The Muon designs under FSDP that Canzona's step is held against."""


@dataclass(frozen=True)
class FsdpUnit:
    """One bucket as the iteration sees it: its share of compute and its collectives."""

    label: str
    share: float
    """Fraction of a micro-batch's forward and backward compute spent on its parameters."""
    gather: float
    """Seconds of its parameter all-gather."""
    reduce: float
    """Seconds of its gradient reduce-scatter."""
    key: Hashable | None = None
    """The plan's key of a bucket holding a matrix (a task's ``reduced_by``: ``(chunk, bucket)``,
    ``(EXPERTS, chunk, bucket)`` for an expert one), under which its final reduce-scatter's end
    is reported; ``None``: no matrix in it."""


STEP_GATHER = "step_gather"
"""Kind of a micro-group's early gather on the collectives' queue (:func:`fsdp_phases`)."""


@dataclass(frozen=True)
class FsdpPhases:
    """Forward and backward of every micro-batch with FSDP's collectives beside them."""

    compute: float
    """Forward and backward compute of every micro-batch."""
    backward_end: float
    """When the last backward ends (compute plus every wait on a gather)."""
    reduced: float
    """When the last reduce-scatter ends: the step's start."""
    gather_seconds: float
    reduce_seconds: float
    segments: list[Segment]
    """Of one rank (every rank of the group does the same)."""
    reduced_at: dict[Hashable, float] = field(default_factory=dict)
    """Each keyed unit's final reduce-scatter's end, from the step's start (``<= 0``)."""
    ride_seconds: float = 0.0
    """Link seconds the early gathers took on the queue."""

    @property
    def gather_exposed(self) -> float:
        """Compute waiting for the gathers."""
        return self.backward_end - self.compute

    @property
    def reduce_exposed(self) -> float:
        """The reduce-scatters' tail after the last backward."""
        return self.reduced - self.backward_end


def fsdp_phases(units: Sequence[FsdpUnit], *, micro: float, count: int, sharding: str,
                riders: Sequence[Rider] = ()) -> FsdpPhases:
    """The micro-batches of one iteration over ``units`` (forward order) under ``sharding``
    (module docstring): every gather and reduce-scatter on one queue, compute beside it. A rider
    (an early gather, keyed by :attr:`FsdpUnit.key`) joins the queue when the last of its units'
    final reduce-scatters ends; riders sent by one reduce-scatter add their loads per rank and
    take their heaviest rank's seconds. The step starts when the last reduce-scatter ends: a
    rider queued after it is the step's own gather."""
    if sharding not in SHARDING_STRATEGIES:
        raise ValueError(f"sharding must be one of {', '.join(SHARDING_STRATEGIES)}, got {sharding!r}")
    clock = comm_free = settled = 0.0
    seconds_of = {"param_gather": 0.0, "grad_reduce": 0.0, STEP_GATHER: 0.0}
    segments: list[Segment] = []
    ends: dict[Hashable, float] = {}
    waiting = _Waiting(riders)

    def collective(at: float, seconds: float, kind: str, label: str) -> float:
        nonlocal comm_free, settled
        if seconds <= 0:
            return at
        start = max(comm_free, at)
        comm_free = start + seconds
        segments.append(Segment(0, "comm", kind, start, comm_free, label))
        seconds_of[kind] += seconds
        if kind != STEP_GATHER:
            settled = comm_free
        return comm_free

    def final_reduce(unit: FsdpUnit) -> None:
        end = collective(clock, unit.reduce, "grad_reduce", unit.label)
        if unit.key is not None:
            ends[unit.key] = end
            collective(end, waiting.release(unit.key), STEP_GATHER, unit.label)

    def compute(seconds: float, label: str) -> None:
        nonlocal clock
        if seconds > 0:
            segments.append(Segment(0, "compute", "forward_backward", clock, clock + seconds, label))
            clock += seconds

    def walk(order: Sequence[FsdpUnit], share: float, gathers: bool, reduces: bool, final: bool = False) -> None:
        nonlocal clock
        ready = {0: collective(clock, order[0].gather, "param_gather", order[0].label)} if gathers and order else {}
        for i, unit in enumerate(order):
            if gathers:
                clock = max(clock, ready[i])
                if i + 1 < len(order):  # the next bucket's gather is in flight while this one computes
                    ready[i + 1] = collective(clock, order[i + 1].gather, "param_gather", order[i + 1].label)
            compute(share * micro * unit.share, unit.label)
            if reduces and final:
                final_reduce(unit)
            elif reduces:
                collective(clock, unit.reduce, "grad_reduce", unit.label)

    every_micro_batch = sharding == "optim_grads_params"
    for mb in range(count):
        walk(units, 1.0 - BACKWARD_SHARE, gathers=every_micro_batch or mb == 0, reduces=False)
        walk(units[::-1], BACKWARD_SHARE, gathers=every_micro_batch, reduces=sharding != "optim" or mb == count - 1,
             final=mb == count - 1)
    step = max(clock, settled)
    return FsdpPhases(compute=count * micro, backward_end=clock, reduced=step,
                      gather_seconds=seconds_of["param_gather"], reduce_seconds=seconds_of["grad_reduce"],
                      segments=segments, reduced_at={key: end - step for key, end in ends.items()},
                      ride_seconds=seconds_of[STEP_GATHER])


class _Waiting:
    """The riders not yet sent, each waiting for the final reduce-scatters of its keys."""

    def __init__(self, riders: Sequence[Rider]) -> None:
        self.riders = [(set(r.keys), r.loads) for r in riders if r.keys]

    def release(self, key: Hashable) -> float:
        """Link seconds of the riders whose last key is ``key``: their loads added per rank, the
        heaviest rank's (0 when none goes)."""
        load: dict[int, float] = {}
        for keys, loads in self.riders:
            keys.discard(key)
            if not keys:
                for r, seconds in loads.items():
                    load[r] = load.get(r, 0.0) + seconds
        self.riders = [(keys, loads) for keys, loads in self.riders if keys]
        return max(load.values(), default=0.0)


@dataclass(frozen=True)
class _Stage:
    specs: list[ParamSpec]
    grid: Grid
    seconds: Seconds
    cost_model: CostModel
    sharding: str
    bucket_size: int | None
    alpha: float
    wire: WireConfig
    budget: float | None = None
    """Canzona's ``tp_budget`` (:func:`~megatron.canzona.planning.planner.make_plan`): ``None`` the
    default micro-groups, ``math.inf`` one micro-group."""
    tp_together: str = "off"
    """Canzona's ``--canzona-tp-together`` (:data:`~megatron.canzona.planning.balance.TP_TOGETHER`)."""
    together: Sharded | None = None
    """One TP rank's share of a matrix its TP ranks compute together (``tp_together``)."""
    narrow_gathers: bool = False
    """Muon's whole matrices gathered in bf16 (``--canzona-narrow-gathers``: :func:`simulate_fsdp`)."""

    def buckets(self, specs: Sequence[ParamSpec], dp_size: int, geometry: str | None = None) -> tuple[FsdpBucket, ...]:
        """Megatron-FSDP's buckets of the stage's sharding (or of ``geometry``: :data:`PER_PARAMETER`)."""
        return fsdp_buckets(specs, dp_size=dp_size, strategy=geometry or self.sharding, bucket_size=self.bucket_size)

    def kinds(self) -> list[_Kind]:
        """The dense parameters, and (one copy per EP rank) the experts."""
        g = self.grid
        dense, experts = split_experts(self.specs)
        out = [_Kind(dense, g.dp_size, g.tp_size, g.dp_group(), [(g.rank, list(range(g.size)))])]
        if experts:
            copies: list[tuple[RankOf, list[int]]] = [(lambda d, t, e=e: g.expert_rank(d, t, e), g.expert_members(e))
                                                      for e in range(g.ep_size)]
            out.append(_Kind(experts, g.expert_dp_size, g.expert_tp_size, g.expert_dp_group(), copies))
        return out


@dataclass(frozen=True)
class _Kind:
    """Dense or expert parameters: their DP and TP sizes, one DP group reducing them, and per copy
    (one per EP rank for the experts) the stage rank of each (dp, tp) and its ranks."""

    specs: list[ParamSpec]
    dp: int
    tp: int
    group: list[int]
    copies: list[tuple[RankOf, list[int]]]


def shard_elements(buckets: Sequence[FsdpBucket], rank: RankOf, tp_size: int,
                   names: set[str] | None = None) -> dict[int, float]:
    """Elements of each rank's shards of ``buckets`` (of the parameters in ``names``; ``None``:
    all), every TP rank its own."""
    out: dict[int, float] = {}
    for bucket in buckets:
        for item in bucket.items:
            if names is not None and item.name not in names:
                continue
            for d, lo, hi in bucket.pieces(item):
                for t in range(tp_size):
                    out[rank(d, t)] = out.get(rank(d, t), 0.0) + (hi - lo)
    return out


def _elementwise_names(specs: Sequence[ParamSpec]) -> set[str]:
    return {s.name for s in specs if s.family != "matrix"}


def _canzona(stage: _Stage, geometry: str | None = None) -> Work:
    """Hosts and micro-groups of Canzona's planner over the shards of ``geometry`` (``None``:
    Megatron-FSDP's of the stage's sharding, each group gathered as its buckets reduce), pipelined."""
    g = stage.grid
    early_gather = geometry is None  # the runtime's early gathers hook Megatron-FSDP's own buckets
    geometry = geometry or stage.sharding
    plan = make_plan(stage.specs, dp_size=g.dp_size, tp_size=g.tp_size, cost_model=stage.cost_model,
                     alpha=stage.alpha, wire=stage.wire, ep_size=g.ep_size, expert_tp_size=g.expert_tp_size,
                     tp_budget=stage.budget if early_gather else None,
                     layout=FSDP_LAYOUT, fsdp_strategy=geometry, fsdp_bucket_size=stage.bucket_size,
                     state=StateLayout.of_cost(stage.cost_model),  # hosts keep the state, as the runtime plans them
                     tp_together=stage.tp_together if early_gather else "off",
                     narrow_gathers=stage.narrow_gathers and early_gather)
    narrow = stage.narrow_gathers and early_gather
    holder_momentum = stage.cost_model.kind in HOLDER_MOMENTUM_OPTIMIZERS

    def prepared(tasks: list[SimTask]) -> list[SimTask]:  # the holders' work before each gather
        return [dataclasses.replace(t, **holder_prep(holder_momentum=holder_momentum, narrow=t.gather_bytes is not None))
                for t in tasks]

    work = Work(mode="pipelined", dense=prepared(plan_tasks(plan, split_experts(stage.specs)[0], stage.seconds, g.rank,
                                                            cost_model=stage.cost_model, shared=stage.together,
                                                            narrow_gathers=narrow)),
                early_gather=early_gather)
    for k, kind in enumerate(stage.kinds()):
        buckets = stage.buckets(kind.specs, kind.dp, geometry)
        for rank, members in kind.copies:
            work.adamw = merge(work.adamw, shard_elements(buckets, rank, kind.tp, _elementwise_names(kind.specs)))
            if k:
                assert plan.experts is not None
                work.experts.append((members, prepared(plan_tasks(plan.experts, kind.specs, stage.seconds, rank,
                                                                  cost_model=stage.cost_model, shared=stage.together,
                                                                  narrow_gathers=narrow))))
    return work


def _every_holder(stage: _Stage) -> Work:
    """#4486: every holder of a piece gathers the matrix whole and computes it (``per_matrix``)."""
    work = Work(mode="per_matrix")
    for k, kind in enumerate(stage.kinds()):
        by_name = {s.name: s for s in kind.specs}
        buckets = stage.buckets(kind.specs, kind.dp)
        for rank, members in kind.copies:
            tasks = []
            for bucket in buckets:
                for item in bucket.items:
                    spec = by_name[item.name]
                    if spec.family != "matrix":
                        continue
                    pieces = bucket.pieces(item)
                    copies = [list(range(kind.tp))] if spec.tp_sharded else [[t] for t in range(kind.tp)]
                    for tps in copies:
                        holders = tuple((rank(d, t), hi - lo) for t in tps for d, lo, hi in pieces)
                        tasks.append(SimTask(item.name, holders, None, stage.seconds(spec)))
            if k:
                work.experts.append((members, tasks))
            else:
                work.dense = tasks
            work.adamw = merge(work.adamw, shard_elements(buckets, rank, kind.tp, _elementwise_names(kind.specs)))
    return work


def _adamw(stage: _Stage) -> Work:
    work = Work(mode="per_matrix")
    for kind in stage.kinds():
        buckets = stage.buckets(kind.specs, kind.dp)
        for rank, _ in kind.copies:
            work.adamw = merge(work.adamw, shard_elements(buckets, rank, kind.tp))
    return work


BUILDERS = {"canzona": _canzona, "every_holder": _every_holder,
            "owner_uniform": lambda stage: _canzona(stage, PER_PARAMETER), "adamw": _adamw}


def plan_bucket_index(buckets: Sequence[FsdpBucket], specs: Sequence[ParamSpec]) -> dict[int, int]:
    """Position in ``buckets`` (one model chunk's) -> the plan's index of that bucket
    (:attr:`~megatron.canzona.planning.plan.Placement.bucket`, as
    :func:`~megatron.canzona.planning.fsdp.fsdp_buffer` numbers them), for the buckets holding a
    matrix of ``specs``."""
    mats = matrix_specs(list(specs))
    index = {p.name: p.bucket for p in fsdp_buffer(buckets, mats, [0.0] * len(mats)).placements}
    return {i: index[item.name] for i, bucket in enumerate(buckets) for item in bucket.items if item.name in index}


def fsdp_units(stage: _Stage, topology: Topology, workload: Workload | None) -> list[FsdpUnit]:
    """Every bucket of the stage (dense, then experts: both walked as one), in forward order,
    with its share of compute, its collectives over its DP group (the experts' over expert DP)
    and, holding a matrix, the plan's key of it (:attr:`FsdpUnit.key`)."""
    activity = workload.expert_activity if workload else 1.0
    weights = {s.name: matmul_weight(s, activity) for s in stage.specs}
    order = {s.name: s.order for s in stage.specs}
    total = sum(weights.values()) or 1.0
    units = []
    for k, kind in enumerate(stage.kinds()):
        for chunk in sorted({s.chunk for s in kind.specs}):  # the planner's buckets are per model chunk
            specs = [s for s in kind.specs if s.chunk == chunk]
            buckets = stage.buckets(specs, kind.dp)
            planned = plan_bucket_index(buckets, specs)
            for index, bucket in enumerate(buckets):
                share = sum(weights[i.name] for i in bucket.items) / total
                gather = topology.ring(bucket.size * stage.wire.param_bytes, kind.group)
                reduce = topology.ring(bucket.size * stage.wire.grad_bytes, kind.group)
                first = max(order[i.name] for i in bucket.items)
                key = None if index not in planned else (*((EXPERTS,) if k else ()), chunk, planned[index])
                units.append((-first, FsdpUnit(f"{'e' if bucket.expert else ''}{index}", share, gather, reduce, key)))
    return [u for _, u in sorted(units, key=lambda pair: pair[0])]


def simulate_fsdp(
    specs: Sequence[ParamSpec],
    *,
    strategy: str,
    cluster: ClusterSpec,
    dp_size: int,
    tp_size: int = 1,
    ep_size: int = 1,
    expert_tp_size: int = 1,
    sharding: str = "optim_grads_params",
    optimizer: str = "muon",
    calibration: Calibration | None = None,
    workload: Workload | None = None,
    wire: WireConfig | None = None,
    bucket_size: int | None = None,
    alpha: float = DEFAULT_ALPHA,
    ns_method: str = "standard",
    early_compute: bool = False,
    clip_rate: float = 0.0,
    early_compute_bytes: int | None = EARLY_COMPUTE_BYTES,
    early_gather: bool = True,
    tp_budget: float | None = None,
    tp_together: str = "off",
    narrow_gathers: bool = False,
) -> StrategyResult:
    """One iteration of ``specs`` (one pipeline stage) under Megatron-FSDP's ``sharding`` with
    the design ``strategy`` (:data:`FSDP_STRATEGIES`, module docstring); ``bucket_size`` is
    ``--ddp-bucket-size`` (``None``: Megatron-FSDP's, unbounded); ``ns_method`` is Canzona's
    Newton-Schulz (the peers run the standard one); ``workload`` ``None``: no forward and backward
    (every collective of the micro-batch is then exposed). ``early_compute``, ``clip_rate`` and
    ``early_compute_bytes`` are :func:`~.simulate.simulate`'s (``canzona`` only: the other designs
    gather in the step); ``early_gather`` False: ``canzona`` gathers in the step too, and computes
    nothing early (the runtime's ``--canzona-no-early-gather``). ``tp_budget``: Canzona's
    micro-group budget over Megatron-FSDP's shards (``math.inf``: one micro-group,
    ``--canzona-fsdp-micro-groups one``). ``tp_together``: Canzona's TP-sharded matrices computed
    by their TP ranks together (:func:`~.simulate.simulate`'s; the runtime's ``--canzona-tp-together``).
    ``narrow_gathers`` (the runtime's ``--canzona-narrow-gathers``): Canzona's Muon gathers each
    whole matrix's Newton-Schulz input in bf16 (its holders divide their pieces by the matrix's exact
    norm first, their share of it and its two all-reduces priced with the sources: module
    docstring), half the gathers' bytes."""
    if strategy not in BUILDERS:
        raise ValueError(f"unknown FSDP strategy {strategy!r}; choose one of: {', '.join(FSDP_STRATEGIES)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if not 0.0 <= clip_rate <= 1.0:
        raise ValueError(f"clip_rate {clip_rate} must lie in [0, 1]: the chance that the clip acts in an iteration")
    grid = checked_grid(dp_size, tp_size, ep_size, expert_tp_size)
    wire = wire or WireConfig()
    method = ns_method if strategy in CANZONA_STRATEGIES else "standard"
    planning_cost = CostModel(kind=optimizer, ns_method=method, ns_dtype=cluster.gpu.ns_dtype)
    timing_cost = dataclasses.replace(planning_cost, calibration=calibration) if calibration else planning_cost
    together = tp_sharded_seconds(timing_cost, cluster, "distributed", GRAM_REDUCE_BYTES) \
        if optimizer in NS_OPTIMIZERS else None
    stage = _Stage(list(specs), grid, seconds_per_update(timing_cost, cluster), planning_cost, sharding, bucket_size,
                   alpha, wire, tp_budget, tp_together, together, narrow_gathers)
    work = BUILDERS[strategy](stage)
    work.early_gather = work.early_gather and early_gather
    slowdown = cluster.contention(grid.size)
    topology = Topology(cluster)
    count, micro, details = micro_batches(workload, stage.specs, dp_size, cluster, slowdown) if workload \
        else (1, 0.0, {})
    units = fsdp_units(stage, topology, workload)
    riders = work_riders(work, topology, wire)
    phases = fsdp_phases(units, micro=micro, count=count, sharding=sharding, riders=riders)
    early = _early(work, phases, early_compute, early_compute_bytes)
    origin = phases.reduced
    if work.early_gather and optimizer in HOLDER_MOMENTUM_OPTIMIZERS:  # the gathers carry Muon's source: speculative
        plain = fsdp_phases(units, micro=micro, count=count, sharding=sharding)
        step_end, origin, run, rates = _speculative_step(work, grid, cluster, wire, slowdown, phases, plain, early,
                                                         clip_rate)
    else:
        step_end, run, rates = _step(work, grid, cluster, wire, slowdown, phases, early, clip_rate)
    busiest = max(run.busy.values(), default=0.0)
    details.update(sharding=sharding, mode=work.mode, num_tasks=len(work.dense) + sum(len(t) for _, t in work.experts),
                   num_groups=len({t.group for t in work.dense}), buckets=len(units), compute_slowdown=slowdown,
                   early_gather=work.early_gather, early_gather_link_seconds=phases.ride_seconds)
    if rates is not None:
        details.update(early_compute=early is not None, clip_rate=clip_rate, speculation=dataclasses.asdict(rates),
                       early_compute_bytes=early_compute_bytes, speculative_gathers=origin is not phases.reduced)
    timeline = [dataclasses.replace(s, rank=r) for r in range(grid.size) for s in phases.segments]
    timeline += [dataclasses.replace(s, start=s.start + phases.reduced, end=s.end + phases.reduced)
                 for s in run.segments]
    return StrategyResult(
        strategy=strategy,
        optimizer_step_seconds=step_end,
        iteration_seconds=origin + step_end,
        exposed_comm_seconds=phases.gather_exposed + phases.reduce_exposed + (step_end - busiest),
        forward_backward_seconds=phases.compute,
        grad_reduce_seconds=phases.reduce_seconds,
        grad_reduce_exposed_seconds=phases.reduce_exposed,
        param_gather_seconds=phases.gather_seconds,
        param_gather_exposed_seconds=phases.gather_exposed,
        step_compute_seconds=busiest,
        step_comm_exposed_seconds=step_end - busiest,
        step_bytes_per_rank=max(run.sent.values(), default=0.0),
        details=details,
        timeline=tuple(timeline),
    )


def _speculative_step(work: Work, grid: Grid, cluster: ClusterSpec, wire: WireConfig, slowdown: float,
                      phases: FsdpPhases, plain: FsdpPhases, early: EarlyCompute | None,
                      clip_rate: float) -> tuple[float, float, StepRun, SpeculationRates]:
    """The step where the holders keep Muon's momentum, so the early gathers carry its source and
    hold only where no clip acts (``canzona_patches.integration.early_gather.EarlySources``), in
    the iterations the speculation policy picks at ``clip_rate``: committed, ``phases`` (the
    gathers riding the link) and the step from them (with ``early`` compute); recomputed, the same
    ``phases`` and the step gathering again; not speculated, ``plain`` (no gathers before the step)
    and the step gathering. Returns the expected step, the expected step start (the last
    reduce-scatter's end), the committed step's run and the shares."""
    rates = expected_rates(clip_rate)
    committed, run = run_step(work, grid, cluster, wire, slowdown, phases.reduced_at, early)
    in_step = run_step(work, grid, cluster, wire, slowdown)[0]
    step = rates.committed * committed + (1.0 - rates.committed) * in_step
    origin = (1.0 - rates.not_speculated) * phases.reduced + rates.not_speculated * plain.reduced
    return step, origin, run, rates


def _early(work: Work, phases: FsdpPhases, early_compute: bool, budget_bytes: int | None) -> EarlyCompute | None:
    """Early compute where the groups are gathered early: from backward's end on, through FSDP's
    reduce-scatter tail, each rank within ``budget_bytes`` (``None``: every group)."""
    if not (early_compute and work.early_gather):
        return None
    budget = None if budget_bytes is None else budget_bytes // STATE_BYTES
    return EarlyCompute(backward_end=phases.backward_end - phases.reduced, budget_elements=budget)


def _step(work: Work, grid: Grid, cluster: ClusterSpec, wire: WireConfig, slowdown: float, phases: FsdpPhases,
          early: EarlyCompute | None, clip_rate: float) -> tuple[float, StepRun, SpeculationRates | None]:
    """The step from the last reduce-scatter's end, each group gathered as its buckets reduced
    (a design gathering early); with ``early``, priced as :func:`~.simulate.simulate` prices it:
    ``committed · early step + (1 − committed) · step without early compute`` at ``clip_rate``
    (the timeline is a committed one's). Costs one :func:`~.simulate.run_step`, two with a clip
    that may act."""
    reduced = phases.reduced_at if work.early_gather else None
    if reduced is not None:
        keys = {t.reduced_by for t in work.dense} | {(EXPERTS, *t.reduced_by) for _, ts in work.experts for t in ts}
        assert keys <= reduced.keys(), f"plan buckets without a reported reduce-scatter: {keys - reduced.keys()}"
    step_end, run = run_step(work, grid, cluster, wire, slowdown, reduced, early)
    rates = expected_rates(clip_rate) if early is not None else None
    if rates is not None and rates.committed < 1.0:
        full = run_step(work, grid, cluster, wire, slowdown, reduced)[0]
        step_end = rates.committed * step_end + (1.0 - rates.committed) * full
    return step_end, run, rates
