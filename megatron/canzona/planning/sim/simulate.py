"""One iteration of one pipeline stage under each strategy: the entry point :func:`simulate`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..comm import GRAM_REDUCE_BYTES, WireConfig
from ..cost import NS_OPTIMIZERS, OPTIMIZERS, Calibration, CostModel
from ..experts import split_experts
from ..memory import EARLY_COMPUTE_BYTES, STATE_BYTES
from ..geometry import default_bucket_size
from ..megatron_main import plan_megatron_main
from ..partition import DEFAULT_ALPHA, plan_zero1
from ..plan import Bucket, BufferPlan, CanzonaPlan, DPPlan
from ..planner import make_plan
from ..speculation import expected_rates
from ..specs import ParamSpec
from .cluster import ClusterSpec
from .iteration import BACKWARD_SHARE, BucketSync, Rider, overlap_backward, overlap_forward, reduced_at
from .layouts import (
    Buffers,
    Grid,
    RankOf,
    Seconds,
    Sharded,
    TaskBuilder,
    Work,
    adamw_elements,
    buffer_tasks,
    home_tasks,
    merge,
    plan_tasks,
    tp_sharded_tasks,
)
from .network import Topology
from .result import Segment, StrategyResult
from .step import (
    MOMENTUM_BYTES_PER_ELEMENT,
    EarlyCompute,
    SimTask,
    StepRun,
    gather_riders,
    run_adamw,
    run_host_groups,
    run_per_matrix,
)

STRATEGIES: tuple[str, ...] = (
    "canzona", "canzona_lean", "canzona_tp_sync", "sync", "megatron_layerwise", "megatron_tp_blockwise",
    "megatron_tp_distributed", "layer_sharded", "megatron_main", "zero1", "adamw",
)
"""Strategies :func:`simulate` knows (package docstring). To add one, write a builder that
returns a :class:`~.layouts.Work` and register it in :data:`BUILDERS`."""
INLINE_SECONDS = 1e6
"""``early_inline``: how long before the step its reduce-scatters and early compute are placed
(inside a backward that holds them all, whatever they take)."""
EXPERTS = "experts"
"""First element of an expert matrix bucket's key in the reductions (:func:`_bucket_syncs`)."""
NEEDS_LAYERWISE_PLAN = ("megatron_layerwise", "megatron_tp_blockwise", "megatron_tp_distributed", "layer_sharded")
TP_MODE_STRATEGIES = {"megatron_tp_blockwise": "blockwise", "megatron_tp_distributed": "distributed"}
"""Megatron's layer-wise Muon under another ``--muon-tp-mode`` than ``duplicated``
(``megatron_layerwise``), by strategy: ``blockwise`` is its default, each TP rank
orthogonalising its own slice of a TP-sharded matrix alone (another optimizer than the whole
matrix's); ``distributed`` computes the whole matrix's, the TP ranks together."""
INSTANCE_STRATEGIES = ("canzona", "canzona_lean", "canzona_tp_sync", "zero1", "adamw")
"""The strategies that run with several distributed-optimizer instances
(``--num-distributed-optimizer-instances``): Megatron's distributed optimizer under them. Its
layer-wise Muon refuses several instances, and the synchronous layout has no distributed optimizer."""
CANZONA_STRATEGIES = ("canzona", "canzona_lean", "canzona_tp_sync")
"""Canzona's own strategies: the ones that run its Newton-Schulz method."""


def strategy_ns_method(strategy: str, ns_method: str) -> str:
    """The Newton-Schulz method ``strategy`` runs: Canzona's ``ns_method`` (``--muon-ns-method``),
    Megatron's standard one for every other strategy."""
    return ns_method if strategy in CANZONA_STRATEGIES else "standard"


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one iteration trains, for forward/backward and the overlap of the bucket collectives."""

    global_batch: int
    """Sequences per iteration over all DP ranks."""
    micro_batch: int = 1
    """Sequences per micro-batch."""
    seq_length: int = 4096
    """Tokens per sequence."""
    flops_per_token: float | None = None
    """Forward and backward FLOPs per token on one GPU of the stage; ``None``: from the specs
    (:func:`stage_flops_per_token`)."""
    expert_activity: float = 1.0
    """Fraction of a GPU's local expert parameters an average token uses: top-k · EP / experts."""
    context_parallel: int = 1
    """CP ranks each sequence is cut over (``--context-parallel-size``): the DP group
    :func:`simulate` is given is DP × CP (Megatron's DDP reduces over it), a GPU holds
    ``seq_length / context_parallel`` tokens of each sequence, and its queries still attend
    over the whole sequence (the keys and values are gathered; that traffic overlaps the
    attention and is not modelled)."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch", "seq_length", "context_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{name} must be a positive integer, got {value!r}")
        if not 0 < self.expert_activity <= 1:
            raise ValueError(f"Workload.expert_activity must lie in (0, 1], got {self.expert_activity}")

    def microbatches(self, dp_size: int) -> int:
        """Micro-batches per iteration on a GPU whose DP × CP group has ``dp_size`` ranks."""
        if dp_size % self.context_parallel:
            raise ValueError(f"the DP x CP group of {dp_size} ranks is not a multiple of CP {self.context_parallel}")
        dp_size //= self.context_parallel
        per_step = dp_size * self.micro_batch
        if self.global_batch % per_step:
            fix = -(-self.global_batch // per_step) * per_step
            raise ValueError(
                f"global batch {self.global_batch} is not a multiple of DP {dp_size} x micro batch "
                f"{self.micro_batch} = {per_step}; pass --global-batch {fix} (or a smaller --micro-batch)"
            )
        return self.global_batch // per_step


def matmul_weight(spec: ParamSpec, expert_activity: float = 1.0) -> float:
    """A parameter's share of forward/backward matmul work per token on its GPU (local
    elements; norms count too, being negligible; the input embedding is a lookup)."""
    if spec.name.endswith("word_embeddings.weight"):
        return 0.0
    return spec.numel * (expert_activity if spec.is_expert else 1.0)


def stage_flops_per_token(specs: Sequence[ParamSpec], seq_length: int, expert_activity: float = 1.0) -> float:
    """Forward and backward FLOPs per token on one GPU of the stage: 6 per local matmul
    parameter, plus causal attention 6 · seq · (query width) per layer (QKᵀ and AV, half
    of the positions); a stage without an output layer but with the embedding computes
    its logits with the (tied) embedding."""
    flops = 6.0 * sum(matmul_weight(s, expert_activity) for s in specs)
    flops += sum(6.0 * seq_length * s.local_shape[1] for s in specs if s.name.endswith("linear_proj.weight"))
    names = {s.name for s in specs}
    if not any(n.endswith("output_layer.weight") for n in names):
        flops += sum(6.0 * s.numel for s in specs if s.name.endswith("word_embeddings.weight"))
    return flops


@dataclass(frozen=True)
class _Context:
    specs: list[ParamSpec]
    grid: Grid
    seconds: Seconds
    cost_model: CostModel
    bucket_size: int | None
    plan: CanzonaPlan | DPPlan | None
    expert_plan: DPPlan | None
    wire: WireConfig
    overlap: bool
    alpha: float
    instances: int = 1
    """Distributed-optimizer instances: :attr:`grid` is one instance's ranks (its DP group the
    intra-instance one), and every instance does the same."""
    tp_modes: Mapping[str, Sharded] = dataclasses.field(default_factory=dict)
    """One TP rank's share of a TP-sharded parameter by Megatron's ``muon_tp_mode``
    (:func:`tp_sharded_seconds`); empty for an optimizer without Newton-Schulz."""
    tp_together: str = "off"
    """Canzona's ``--canzona-tp-together`` (:data:`~..balance.TP_TOGETHER`)."""
    together: Sharded | None = None
    """One TP rank's share of a matrix its TP ranks compute together in Canzona's step."""

    @property
    def dp_size(self) -> int:
        """The whole DP (x CP) group: every instance's ranks."""
        return self.grid.dp_size * self.instances

    @property
    def dense(self) -> list[ParamSpec]:
        return split_experts(self.specs)[0]

    @property
    def experts(self) -> list[ParamSpec]:
        return split_experts(self.specs)[1]

    def buckets_for(self, dp_size: int) -> int:
        return default_bucket_size(dp_size) if self.bucket_size is None else self.bucket_size


def _canzona(ctx: _Context, synchronous: bool = False, layout: str = "whole") -> Work:
    g = ctx.grid
    plan = ctx.plan
    if plan is None:
        plan = make_plan(ctx.specs, dp_size=g.dp_size, tp_size=g.tp_size, cost_model=ctx.cost_model, alpha=ctx.alpha,
                         bucket_size=ctx.bucket_size, wire=ctx.wire, ep_size=g.ep_size, expert_tp_size=g.expert_tp_size,
                         layout=layout, tp_together=ctx.tp_together)
    if not isinstance(plan, CanzonaPlan):
        raise TypeError(f"canzona needs a CanzonaPlan (make_plan(...)), got {type(plan).__name__}")
    mode = "blocking" if synchronous or not ctx.overlap else "pipelined"
    work = Work(mode=mode, dense=plan_tasks(plan, ctx.dense, ctx.seconds, g.rank, synchronous=synchronous,
                                            cost_model=ctx.cost_model, shared=ctx.together))
    # As the runtime: every micro-group's gather (none at expert TP 1 in the whole layout) goes
    # as its buckets reduce, the dense ones' and the experts'.
    work.early_gather = mode == "pipelined"
    work.adamw = adamw_elements(_elementwise(plan.layouts), g.rank, g.tp_size)
    work.reduced.append(Buffers(_reduced(plan.layouts), g.dp_group()))
    if plan.experts is not None:
        ex = plan.experts
        for e in range(g.ep_size):
            rank = _expert_rank(g, e)
            work.experts.append((g.expert_members(e), plan_tasks(ex, ctx.experts, ctx.seconds, rank,
                                                                  synchronous=synchronous, cost_model=ctx.cost_model,
                                                                  shared=ctx.together)))
            work.adamw = merge(work.adamw, adamw_elements(_elementwise(ex.layouts), rank, ex.tp_size))
        work.reduced.append(Buffers(_reduced(ex.layouts), g.expert_dp_group()))
    return work


def _expert_rank(g: Grid, ep_rank: int) -> RankOf:
    return lambda d, t: g.expert_rank(d, t, ep_rank)


def _elementwise(layouts: Sequence[DPPlan]) -> list[BufferPlan]:
    return [dp.elementwise for dp in layouts if dp.elementwise is not None]


def _reduced(layouts: Sequence[DPPlan]) -> list[tuple[int, BufferPlan]]:
    out = []
    for chunk, dp in enumerate(layouts):
        out.append((chunk, dp.matrix))
        if dp.elementwise is not None:
            out.append((chunk, dp.elementwise))
    return out


def _dp_layout_work(ctx: _Context, dense: DPPlan, experts: DPPlan | None, mode: str, tasks_of: TaskBuilder) -> Work:
    """Work of a strategy on DP layouts: ``tasks_of(buffer, specs, rank, tp_size)`` gives the tasks."""
    g = ctx.grid
    work = Work(mode=mode, dense=tasks_of(dense.matrix, ctx.dense, g.rank, g.tp_size))
    work.adamw = adamw_elements(_elementwise([dense]), g.rank, g.tp_size)
    work.reduced.append(Buffers(_reduced([dense]), g.dp_group()))
    if experts is not None:
        for e in range(g.ep_size):
            rank = _expert_rank(g, e)
            work.experts.append((g.expert_members(e), tasks_of(experts.matrix, ctx.experts, rank, g.expert_tp_size)))
            work.adamw = merge(work.adamw, adamw_elements(_elementwise([experts]), rank, g.expert_tp_size))
        work.reduced.append(Buffers(_reduced([experts]), g.expert_dp_group()))
    return work


def _costed(builder, seconds: Seconds) -> TaskBuilder:
    """``builder(buffer, specs, seconds, rank, tp_size)`` with the update costs bound."""
    return lambda buffer, specs, rank, tp_size: builder(buffer, specs, seconds, rank, tp_size)


def _zero1(ctx: _Context, dp_size: int, specs: list[ParamSpec]) -> DPPlan | None:
    if not specs:
        return None
    return plan_zero1(specs, dp_size=dp_size, cost_model=ctx.cost_model, bucket_size=ctx.buckets_for(dp_size))


def _zero1_work(ctx: _Context) -> Work:
    g = ctx.grid
    dense = _zero1(ctx, g.dp_size, ctx.dense)
    assert dense is not None
    tasks = _costed(buffer_tasks, ctx.seconds)
    return _dp_layout_work(ctx, dense, _zero1(ctx, g.expert_dp_size, ctx.experts), "per_matrix", tasks)


def _layerwise_work(ctx: _Context, sharded: bool, tp_mode: str = "duplicated") -> Work:
    if not isinstance(ctx.plan, DPPlan) or (ctx.experts and not isinstance(ctx.expert_plan, DPPlan)):
        raise ValueError(
            "megatron_layerwise and layer_sharded run Megatron-Core's layer-wise layout: pass plan= (and expert_plan= "
            "for MoE) from canzona_patches.integration.layerwise_baseline.plan_megatron_layerwise(specs, dp_size=..., cost_model=...)"
        )
    if sharded:
        return _dp_layout_work(ctx, ctx.plan, ctx.expert_plan, "blocking", _costed(home_tasks, ctx.seconds))
    if tp_mode != "duplicated":
        if tp_mode not in ctx.tp_modes:
            raise ValueError(f"--muon-tp-mode {tp_mode} is Megatron's Muon's: the optimizer must be one of "
                             f"{', '.join(NS_OPTIMIZERS)}, not {ctx.cost_model.kind}")
        sharded_seconds = ctx.tp_modes[tp_mode]
        return _dp_layout_work(ctx, ctx.plan, ctx.expert_plan, "per_matrix",
                               lambda buffer, specs, rank, tp_size: tp_sharded_tasks(
                                   buffer, specs, ctx.seconds, rank, tp_size, sharded_seconds))
    return _dp_layout_work(ctx, ctx.plan, ctx.expert_plan, "per_matrix", _costed(buffer_tasks, ctx.seconds))


def _megatron_main_work(ctx: _Context) -> Work:
    """Megatron-LM main's layer-wise layout (:mod:`..megatron_main`), ``muon_tp_mode duplicated``."""
    g = ctx.grid
    dense = plan_megatron_main(ctx.dense, dp_size=g.dp_size, cost_model=ctx.cost_model,
                               bucket_size=ctx.buckets_for(g.dp_size))
    experts = (plan_megatron_main(ctx.experts, dp_size=g.expert_dp_size, cost_model=ctx.cost_model,
                                  bucket_size=ctx.buckets_for(g.dp_size)) if ctx.experts else None)
    return _dp_layout_work(ctx, dense, experts, "per_matrix", _costed(buffer_tasks, ctx.seconds))


def _sync_work(ctx: _Context) -> Work:
    """Moonlight's synchronous compute: gradients all-reduced over DP (stock buckets), every
    DP rank holds every local tensor whole (a DP-1 layout) and computes every matrix, every
    TP rank gathering the TP shards; AdamW on every local element. Every DP rank does the
    same, so only DP rank 0's (and expert DP rank 0's) ranks are run."""
    g = ctx.grid
    work = Work(mode="per_matrix", all_reduce=True)
    dense_rank: RankOf = lambda _, t: g.rank(0, t)  # noqa: E731
    expert_ranks: list[RankOf] = [lambda _, t, e=e: g.expert_rank(0, t, e) for e in range(g.ep_size)]
    for specs, dp_size, tp_size, ranks, group in (
            (ctx.dense, g.dp_size, g.tp_size, [dense_rank], g.dp_group()),
            (ctx.experts, g.expert_dp_size, g.expert_tp_size, expert_ranks, g.expert_dp_group())):
        whole, reduced = _zero1(ctx, 1, specs), _zero1(ctx, dp_size, specs)
        if whole is None or reduced is None:
            continue
        for rank in ranks:
            work.dense += buffer_tasks(whole.matrix, specs, ctx.seconds, rank, tp_size)
            work.adamw = merge(work.adamw, adamw_elements(_elementwise([whole]), rank, tp_size))
        work.reduced.append(Buffers(_reduced([reduced]), group))
    return work


def _adamw_work(ctx: _Context) -> Work:
    g = ctx.grid
    work = Work(mode="per_matrix")
    for specs, dp_size, tp_size, group, ranks in (
            (ctx.dense, g.dp_size, g.tp_size, g.dp_group(), [g.rank]),
            (ctx.experts, g.expert_dp_size, g.expert_tp_size, g.expert_dp_group(),
             [_expert_rank(g, e) for e in range(g.ep_size)])):
        plan = _zero1(ctx, dp_size, [dataclasses.replace(s, family="elementwise") for s in specs])
        if plan is None:
            continue
        for rank in ranks:
            work.adamw = merge(work.adamw, adamw_elements(_elementwise([plan]), rank, tp_size))
        work.reduced.append(Buffers(_reduced([plan]), group))
    return work


BUILDERS: dict[str, Callable[[_Context], Work]] = {
    "canzona": _canzona,
    "canzona_lean": lambda ctx: _canzona(ctx, layout="lean"),
    "canzona_tp_sync": lambda ctx: _canzona(ctx, synchronous=True),
    "sync": _sync_work,
    "megatron_layerwise": lambda ctx: _layerwise_work(ctx, sharded=False),
    **{name: (lambda ctx, mode=mode: _layerwise_work(ctx, sharded=False, tp_mode=mode))
       for name, mode in TP_MODE_STRATEGIES.items()},
    "layer_sharded": lambda ctx: _layerwise_work(ctx, sharded=True),
    "megatron_main": _megatron_main_work,
    "zero1": _zero1_work,
    "adamw": _adamw_work,
}
"""Strategy name -> builder of its :class:`~.layouts.Work`."""


def seconds_per_update(cost_model: CostModel, cluster: ClusterSpec) -> Seconds:
    """Seconds of one parameter's whole update (of one of its parts hosted apart) on one rank:
    the calibration's, or its FLOPs at the cluster's optimizer throughput plus its momentum at
    the memory bandwidth."""
    rate, memory = cluster.gpu.optimizer_flops_per_s, cluster.gpu.memory_bytes_per_s

    def seconds(spec: ParamSpec, part: int | None = None) -> float:
        if part is None or len(spec.parts) == 1:
            cost, numel = cost_model.cost(spec), spec.global_numel
        else:
            cost, numel = cost_model.part_costs(spec)[part], spec.global_numel // len(spec.parts)
        return cost if cost_model.calibration is not None else cost / rate + MOMENTUM_BYTES_PER_ELEMENT * numel / memory

    return seconds


def tp_sharded_seconds(cost_model: CostModel, cluster: ClusterSpec, mode: str, reduce_dtype_bytes: int | None = None) -> Sharded:
    """One TP rank's share of a TP-sharded parameter under Megatron's ``--muon-tp-mode mode``:
    ``(seconds, all-reduces, bytes of each)``. ``blockwise``: Newton-Schulz of its own slice of
    each matrix, alone. ``distributed``: of the whole matrix, the TP ranks together, each on its
    slice of the TP-split side (:meth:`~..cost.CostModel.shared_cost`: by the model's method, which
    for Megatron's Muon is the standard one), the Gram matrices all-reduced in
    ``reduce_dtype_bytes`` per element (default the iteration's dtype, as Megatron's Muon; Canzona's
    ``--canzona-tp-together`` sums them in fp32). A calibration scales each matrix's FLOPs by its
    shape's measured seconds per FLOP."""
    if mode not in TP_MODE_STRATEGIES.values():
        raise ValueError(f"unknown --muon-tp-mode {mode!r}; choose one of {', '.join(TP_MODE_STRATEGIES.values())}")
    rate, memory = cluster.gpu.optimizer_flops_per_s, cluster.gpu.memory_bytes_per_s
    width = reduce_dtype_bytes or (2 if cost_model.ns_dtype in ("bfloat16", "float16") else 4)
    calibrated = cost_model.calibration is not None

    def seconds(spec: ParamSpec) -> tuple[float, int, float]:
        assert spec.tp_dim is not None
        shards = spec.tp_size
        if mode == "blockwise":
            total = 0.0
            for m, n in spec.matrices:
                local = (m // shards, n) if spec.tp_dim == 0 else (m, n // shards)
                total += cost_model.matrix_cost(*local) if calibrated else cost_model.flops(*local) / rate
            reductions, nbytes = 0, 0.0
        else:
            total = cost_model.shared_cost(spec) if calibrated else cost_model.shared_cost(spec) / rate
            sums = cost_model.shared_reductions(spec)
            reductions, nbytes = sum(c for c, _ in sums), float(sum(c * e * width for c, e in sums))
        if not calibrated:
            total += MOMENTUM_BYTES_PER_ELEMENT * spec.global_numel / shards / memory
        return total, reductions, nbytes / reductions if reductions else 0.0

    return seconds


def _check(strategy: str, dp_size: int, tp_size: int, ep_size: int, expert_tp_size: int, pp_size: int) -> Grid:
    if strategy not in BUILDERS:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of: {', '.join(STRATEGIES)}")
    return checked_grid(dp_size, tp_size, ep_size, expert_tp_size, pp_size)


def checked_grid(dp_size: int, tp_size: int = 1, ep_size: int = 1, expert_tp_size: int = 1, pp_size: int = 1) -> Grid:
    """The stage's :class:`~.layouts.Grid`, its sizes checked."""
    for name, value in (("dp_size", dp_size), ("tp_size", tp_size), ("ep_size", ep_size),
                        ("expert_tp_size", expert_tp_size), ("pp_size", pp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if (dp_size * tp_size) % (ep_size * expert_tp_size):
        raise ValueError(f"EP {ep_size} x expert TP {expert_tp_size} must divide DP {dp_size} x TP {tp_size}")
    return Grid(dp_size, tp_size, ep_size, expert_tp_size)


def micro_batches(workload: Workload, specs: Sequence[ParamSpec], dp_size: int, cluster: ClusterSpec,
                  slowdown: float) -> tuple[int, float, dict]:
    """``(micro-batches of the iteration, seconds of one's forward and backward on a GPU, details)``
    for a DP (x CP) group of ``dp_size`` ranks at the cluster's MFU."""
    count = workload.microbatches(dp_size)
    per_token = workload.flops_per_token
    if per_token is None:
        per_token = stage_flops_per_token(specs, workload.seq_length, workload.expert_activity)
    tokens = workload.micro_batch * workload.seq_length / workload.context_parallel
    micro = per_token * tokens / (cluster.gpu.bf16_tflops * 1e12 * cluster.mfu) * slowdown
    return count, micro, {"microbatches": count, "flops_per_token": per_token, "micro_batch_seconds": micro,
                          "mfu": cluster.mfu}


def simulate(
    specs: Sequence[ParamSpec],
    *,
    strategy: str,
    cluster: ClusterSpec,
    dp_size: int,
    tp_size: int = 1,
    ep_size: int = 1,
    expert_tp_size: int = 1,
    pp_size: int = 1,
    optimizer: str = "muon",
    calibration: Calibration | None = None,
    workload: Workload | None = None,
    plan: CanzonaPlan | DPPlan | None = None,
    expert_plan: DPPlan | None = None,
    wire: WireConfig | None = None,
    overlap: bool = True,
    alpha: float = DEFAULT_ALPHA,
    bucket_size: int | None = None,
    ns_method: str = "standard",
    early_compute: bool = False,
    clip_rate: float = 0.0,
    early_compute_bytes: int | None = EARLY_COMPUTE_BYTES,
    matrices_first: bool = False,
    early_inline: bool = False,
    instances: int = 1,
    tp_together: str = "off",
) -> StrategyResult:
    """One iteration of the pipeline stage whose parameters are ``specs`` (package docstring).

    ``ns_method`` is the Newton-Schulz of Canzona's Muon (``--muon-ns-method``), iterated in
    the cluster's ``optimizer_dtype``; the other strategies run Megatron's, standard.

    ``early_compute``: a strategy with early gathers also computes each micro-group before the
    step once gathered and backward is over (:class:`~.step.EarlyCompute`: in the reduce-scatters'
    exposed tail, never beside backward's GEMMs), speculating that the clip does not act. The
    clip acts in an iteration with probability ``clip_rate``; the step is priced as the runtime's
    policy decides (:func:`~..speculation.expected_rates`): ``committed · early step + (1 −
    committed) · step without early compute``, which a recomputed or not speculated iteration runs
    (what a recomputed one computed early ran in the tail, where the GPU was idle: it costs nothing
    more here). The shares go to ``details["speculation"]``, the timeline is a committed one's.
    Each rank computes early only the groups that fit ``early_compute_bytes`` (the runtime's budget; ``None``: all).

    ``matrices_first`` (``--canzona-matrices-reduce-first``, with early compute): the dense
    buckets without a matrix that become ready before the last dense matrix bucket (the output
    layer's, the norms') are reduced right after it, so the matrices land that much earlier in
    the reduce-scatters' tail and their early compute runs beside what remains of it.

    ``early_inline`` (with ``early_compute``; gloo with the gathers forced to the reduce-scatters'
    dispatch, as the tests and ``tools/bench_step.py --iteration``'s ``canzona_early`` run them):
    the host waits for each reduce-scatter where it dispatches it and computes each landed group
    there, so both lie inside the forward-backward (which ``workload`` then gives as measured, with
    them): no reduce-scatter tail is exposed, and the step starts with every group within the
    budget computed, leaving it their commit, scatter and apply.

    ``instances`` (``--num-distributed-optimizer-instances``): the DP (x CP) group of ``dp_size``
    ranks runs that many distributed optimizers, each over ``dp_size / instances`` consecutive DP
    ranks: the plan, the buckets' reduce-scatter and all-gather and the step are one instance's,
    every instance stepping the whole model; after each bucket's reduce-scatter its shards are
    all-reduced across the instances (:func:`instance_groups`). ``details["bytes"]`` says per rank
    and iteration what the bucket collectives send over which link (:func:`reduction_bytes`).

    ``tp_together`` (Canzona's strategies, :data:`~..balance.TP_TOGETHER`): the TP-sharded matrices
    whose TP ranks compute them together, each its shard, summing their Gram matrices over their
    link in fp32 (the runtime's ``--canzona-tp-together``, which runs under Megatron-FSDP only);
    ``off`` hosts every matrix on one rank."""
    if strategy in BUILDERS and instances != 1 and strategy not in INSTANCE_STRATEGIES:
        raise ValueError(f"{strategy} runs one optimizer instance (Megatron's layer-wise Muon refuses several; the "
                         f"synchronous layout has no distributed optimizer); instances with: {', '.join(INSTANCE_STRATEGIES)}")
    if not isinstance(instances, int) or instances < 1 or dp_size % instances:
        raise ValueError(f"DP x CP {dp_size} is not a multiple of {instances} distributed-optimizer instances: "
                         "pick a divisor of it for --num-distributed-optimizer-instances")
    grid = _check(strategy, dp_size // instances, tp_size, ep_size, expert_tp_size, pp_size)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    wire = wire or WireConfig()
    ns = {"ns_method": strategy_ns_method(strategy, ns_method), "ns_dtype": cluster.gpu.ns_dtype}
    planning_cost = CostModel(kind=optimizer, **ns)  # the runtime plans with the FLOP formulas
    timing_cost = CostModel(kind=optimizer, calibration=calibration, **ns) if calibration else planning_cost
    ns_optimizer = optimizer in NS_OPTIMIZERS
    ctx = _Context(list(specs), grid, seconds_per_update(timing_cost, cluster), planning_cost, bucket_size, plan,
                   expert_plan, wire, overlap, alpha, instances,
                   {mode: tp_sharded_seconds(timing_cost, cluster, mode) for mode in TP_MODE_STRATEGIES.values()}
                   if ns_optimizer else {}, tp_together,
                   tp_sharded_seconds(timing_cost, cluster, "distributed", GRAM_REDUCE_BYTES) if ns_optimizer else None)
    work = BUILDERS[strategy](ctx)
    slowdown = cluster.contention(grid.size * instances * pp_size)
    phases = _phases(ctx, work, cluster, workload, pp_size, slowdown,
                     matrices_first=matrices_first and early_compute and work.early_gather)
    reduced = None
    if work.early_gather:  # when each dense matrix bucket's reduce-scatter ends, from the step's start
        reduced = {key: at - phases.rs_exposed for key, at in phases.reduced_at.items()}
        if cluster.backend == "gloo":  # issued from Megatron's loop after backward
            reduced = {key: max(at, -phases.rs_exposed) for key, at in reduced.items()}
    if not 0.0 <= clip_rate <= 1.0:
        raise ValueError(f"clip_rate {clip_rate} must lie in [0, 1]: the chance that the clip acts in an iteration")
    budget = None if early_compute_bytes is None else early_compute_bytes // STATE_BYTES
    early = EarlyCompute(backward_end=-phases.rs_exposed, budget_elements=budget) \
        if early_compute and reduced is not None else None
    if early_inline and early is not None:  # all of it inside the (measured) backward, every bucket reduced then
        phases, reduced = dataclasses.replace(phases, rs_exposed=0.0), {key: -INLINE_SECONDS for key in reduced}
        early = EarlyCompute(backward_end=-INLINE_SECONDS, budget_elements=budget)
    step_end, run = run_step(work, grid, cluster, wire, slowdown, reduced, early)
    rates = expected_rates(clip_rate) if early is not None else None
    if rates is not None and rates.committed < 1.0:  # recomputed or not speculated: the step without early compute
        full = run_step(work, grid, cluster, wire, slowdown, reduced)[0]
        step_end = rates.committed * step_end + (1.0 - rates.committed) * full
    result = _assemble(strategy, ctx, work, phases, slowdown, step_end, run)
    result.details["bytes"] = reduction_bytes(ctx, work, Topology(cluster))
    if rates is not None:
        result.details.update(early_compute=True, clip_rate=clip_rate, speculation=dataclasses.asdict(rates),
                              early_compute_bytes=early_compute_bytes, matrices_first=matrices_first,
                              early_inline=early_inline)
    return result


def run_step(work: Work, grid: Grid, cluster: ClusterSpec, wire: WireConfig, slowdown: float,
              reduced_at: dict[tuple, float] | None = None,
              early: EarlyCompute | None = None) -> tuple[float, StepRun]:
    """Dense matrices, dense AdamW, then (a chained optimizer) the expert matrices per EP group.
    ``reduced_at``: when each matrix bucket's reduction ends (:func:`_bucket_syncs`' keys). With
    ``early``, the experts' micro-groups are computed early too, each rank's in the time its
    dense early compute and its dense step leave free (the runtime's two optimizers each have
    their own compute stream on the same GPU)."""
    run = StepRun(range(grid.size), {}, cluster, wire, slowdown=slowdown)
    dense_at = expert_at = None
    if reduced_at is not None:
        dense_at = {key: at for key, at in reduced_at.items() if key[0] != EXPERTS}
        expert_at = {key[1:]: at for key, at in reduced_at.items() if key[0] == EXPERTS}
    calendar: dict[int, list[tuple[float, float]]] = {}  # each rank's early compute, dense and experts
    if work.mode == "pipelined":
        run_host_groups(run, work.dense, pipelined=True, reduced_at=dense_at, early_compute=early, calendar=calendar)
    else:
        _run_tasks(run, work.mode, work.dense)
    run_adamw(run, work.adamw)
    for r, at in run.clock.items():  # the dense step's own work, before the experts' in the step
        calendar.setdefault(r, []).append((0.0, at))
    for members, tasks in work.experts:
        sub = StepRun(members, run.clock, cluster, wire, slowdown=slowdown)
        if work.mode == "pipelined":
            run_host_groups(sub, tasks, pipelined=True, reduced_at=expert_at, early_compute=early, calendar=calendar)
        else:
            _run_tasks(sub, work.mode, tasks)
        run.clock.update(sub.clock)
        for r in members:
            run.busy[r] += sub.busy[r]
            run.sent[r] += sub.sent[r]
        run.segments += sub.segments
    return run.end, run


def _run_tasks(run: StepRun, mode: str, tasks: Sequence[SimTask]) -> None:
    if mode == "per_matrix":
        run_per_matrix(run, tasks)
    else:
        run_host_groups(run, tasks, pipelined=mode == "pipelined")


def _bucket_syncs(ctx: _Context, work: Work, topology: Topology, workload: Workload | None) \
        -> tuple[list[BucketSync], list[BucketSync]]:
    """Gradient reductions and parameter all-gathers of every bucket, with their readiness; a
    dense matrix bucket's reduction is keyed ``(chunk, bucket)``, an expert one's
    ``(EXPERTS, chunk, bucket)``."""
    activity = workload.expert_activity if workload else 1.0
    weights = [(s.order, s.chunk, matmul_weight(s, activity), s.name) for s in ctx.specs]
    total = sum(w for _, _, w, _ in weights) or 1.0
    done, ready = 0.0, {}
    for _, chunk, w, name in sorted(weights):
        done += w
        ready[(chunk, name)] = done / total
    reduce, gather = [], []
    names = [{s.name for s in specs if s.family == "matrix"} for specs in (ctx.dense, ctx.experts)]
    for i, buffers in enumerate(work.reduced):
        for chunk, buffer in buffers.buffers:
            matrices = i < 2 and any(p.name in names[i] for p in buffer.placements)
            for k, bucket in enumerate(buffer.buckets):
                frac = max((ready.get((chunk, p.name), 1.0) for p in buffer.placements if p.bucket == k), default=1.0)
                rs = _bucket_seconds(topology, bucket, ctx.wire.grad_bytes, buffers.group)
                rs += _across_instances(topology, bucket, ctx.wire.grad_bytes, buffers.group, ctx)
                key = (chunk, k) if i == 0 else (EXPERTS, chunk, k)
                reduce.append(BucketSync(2 * rs if work.all_reduce else rs, frac, str(k),
                                         key=key if matrices else None))
                if not work.all_reduce:
                    gather.append(BucketSync(_bucket_seconds(topology, bucket, ctx.wire.param_bytes, buffers.group),
                                             frac, str(k)))
    return reduce, gather


def instance_groups(group: Sequence[int], grid: Grid, instances: int) -> list[list[int]]:
    """Megatron's inter-instance groups of one instance's DP group ``group``: instance ``i``'s
    ranks are the job's ``i``-th block of ``grid.size`` stage ranks (its DP ranks
    ``[i·d, (i+1)·d)``, TP fastest), so DP rank ``j`` of every instance forms one group."""
    return [[r + i * grid.size for i in range(instances)] for r in group]


def _across_instances(topology: Topology, bucket: Bucket, bytes_per_element: int, group: Sequence[int],
                      ctx: _Context) -> float:
    """With several instances, Megatron all-reduces each rank's reduce-scattered shard over the
    instances after the bucket's reduce-scatter (``start_grad_sync``; both on one stream): a ring
    all-reduce (a reduce-scatter and an all-gather) of the largest shard, every DP rank's group
    at once."""
    if ctx.instances == 1 or len(group) == 0:
        return 0.0
    inter = instance_groups(group, ctx.grid, ctx.instances)
    largest = _largest_shard(bucket, len(group))
    return 2 * max(topology.ring(largest * bytes_per_element, members) for members in inter)


def _largest_shard(bucket: Bucket, group_size: int) -> int:
    """Elements of a bucket's largest DP shard (its planned ones, else equal ones)."""
    if len(bucket.shard_bounds) == group_size + 1:
        return bucket.largest_shard
    return -(-bucket.numel // group_size)


def reduction_bytes(ctx: _Context, work: Work, topology: Topology) -> dict[str, float]:
    """Bytes one rank sends per iteration in the buckets' collectives, by link: the gradients'
    reduce-scatter over an instance's DP group, their all-reduce across instances, the
    parameters' all-gather (a ring sends ``(p − 1)/p`` of the buffer, a ring all-reduce across
    ``I`` instances ``2 (I − 1)/I`` of the rank's shard, the largest shard's rank counted; over
    the inter-node network where the group spans nodes)."""
    out = {"reduce_intra": 0.0, "reduce_inter": 0.0, "instances_inter": 0.0, "instances_intra": 0.0,
           "gather_intra": 0.0, "gather_inter": 0.0}
    for buffers in work.reduced:
        group = buffers.group
        p = len(group)
        link = "inter" if topology.spans_nodes(group) else "intra"
        across = instance_groups(group, ctx.grid, ctx.instances)
        across_link = "inter" if ctx.instances > 1 and topology.spans_nodes(across[0]) else "intra"
        for _, buffer in buffers.buffers:
            for bucket in buffer.buckets:
                ring = (p - 1) / p if p > 1 else 0.0
                out[f"reduce_{link}"] += ring * bucket.numel * ctx.wire.grad_bytes * (2 if work.all_reduce else 1)
                if not work.all_reduce:
                    out[f"gather_{link}"] += ring * bucket.numel * ctx.wire.param_bytes
                if ctx.instances > 1:
                    share = 2 * (ctx.instances - 1) / ctx.instances
                    out[f"instances_{across_link}"] += share * _largest_shard(bucket, p) * ctx.wire.grad_bytes
    return out


def matrices_reduced_first(reduce: list[BucketSync], dense: int | None = None) -> list[BucketSync]:
    """The reductions with the dense buckets that hold no matrix and become ready before the
    last dense matrix bucket held back until just after it (their order kept): the runtime's
    ``--canzona-matrices-reduce-first``. ``dense``: how many of ``reduce`` are the dense
    buffers' (listed first, on the DP group; the expert buffers' go on their own group);
    ``None``: all."""
    dense = len(reduce) if dense is None else dense
    last = max((b.ready for b in reduce[:dense] if b.key is not None), default=None)
    if last is None:
        return list(reduce)
    after = math.nextafter(last, math.inf)
    return [dataclasses.replace(b, ready=after) if i < dense and b.key is None and b.ready < last else b
            for i, b in enumerate(reduce)]


def _bucket_seconds(topology: Topology, bucket: Bucket, bytes_per_element: int, group: Sequence[int]) -> float:
    """One bucket's reduce-scatter (or all-gather): a ring over equal shards, a group of ring
    reduces (broadcasts) over shards of different sizes, as torch runs it on NCCL."""
    if bucket.uniform or len(bucket.shard_bounds) != len(group) + 1:
        return topology.ring(bucket.numel * bytes_per_element, group)
    bounds = bucket.shard_bounds
    return topology.grouped([(b - a) * bytes_per_element for a, b in zip(bounds, bounds[1:])], group)


@dataclass(frozen=True)
class _Phases:
    """Forward/backward and the bucket collectives around the step."""

    reduce: list[BucketSync]
    gather: list[BucketSync]
    micro: float
    fwd_bwd: float
    bubble: float
    ag_exposed: float
    rs_exposed: float
    segments: list[Segment]
    reduced_at: dict
    """``(chunk, bucket)`` of a dense matrix bucket -> its reduction's end, from backward's end."""
    details: dict

    @property
    def step_origin(self) -> float:
        return self.bubble + self.ag_exposed + self.fwd_bwd + self.rs_exposed


def _phases(ctx: _Context, work: Work, cluster: ClusterSpec, workload: Workload | None, pp_size: int,
            slowdown: float, matrices_first: bool = False) -> _Phases:
    reduce, gather = _bucket_syncs(ctx, work, Topology(cluster), workload)
    if matrices_first:
        reduce = matrices_reduced_first(reduce, sum(len(b.buckets) for _, b in work.reduced[0].buffers))
    micro = fwd_bwd = 0.0
    details: dict = {}
    if workload is not None:
        count, micro, details = micro_batches(workload, ctx.specs, ctx.dp_size, cluster, slowdown)
        fwd_bwd = count * micro
    bubble = (pp_size - 1) * micro
    backward = BACKWARD_SHARE * micro
    ag_exposed, ag_segments = overlap_forward(gather, micro - backward, origin=bubble)
    rs_origin = bubble + ag_exposed + fwd_bwd - backward
    riders = work_riders(work, Topology(cluster), ctx.wire) if cluster.backend != "gloo" else []
    rs_exposed, rs_segments = overlap_backward(reduce, backward, origin=rs_origin, riders=riders)
    return _Phases(reduce, gather, micro, fwd_bwd, bubble, ag_exposed, rs_exposed, ag_segments + rs_segments,
                   reduced_at(reduce, backward, riders), details)


def work_riders(work: Work, topology: Topology, wire: WireConfig) -> list[Rider]:
    """The early gathers of every micro-group, dense and expert (keyed as the buckets' reductions:
    experts under :data:`EXPERTS`), as traffic on the inter-node links the reduce-scatters still
    to come share; none for a design gathering in the step (under DDP, gloo issues them after
    backward instead)."""
    if not work.early_gather:
        return []
    riders = gather_riders(topology, wire, work.dense)
    for _, tasks in work.experts:
        riders += gather_riders(topology, wire, tasks, lambda reduced_by: (EXPERTS, *reduced_by))
    return riders


def _assemble(strategy: str, ctx: _Context, work: Work, phases: _Phases, slowdown: float, step_end: float,
              run: StepRun) -> StrategyResult:
    details: dict = {"mode": work.mode, "num_tasks": len(work.dense) + sum(len(t) for _, t in work.experts),
                     "num_groups": len({t.group for t in work.dense}), "compute_slowdown": slowdown,
                     "early_gather": work.early_gather, "instances": ctx.instances, **phases.details}
    step_origin = phases.step_origin
    busiest = max(run.busy.values(), default=0.0)
    timeline = _timeline(ctx.grid.size, phases.bubble, phases.fwd_bwd + phases.ag_exposed, phases.segments,
                         step_origin, run)
    return StrategyResult(
        strategy=strategy,
        optimizer_step_seconds=step_end,
        iteration_seconds=step_origin + step_end,
        exposed_comm_seconds=phases.ag_exposed + phases.rs_exposed + (step_end - busiest),
        forward_backward_seconds=phases.fwd_bwd,
        bubble_seconds=phases.bubble,
        grad_reduce_seconds=sum((b.seconds for b in phases.reduce), 0.0),
        grad_reduce_exposed_seconds=phases.rs_exposed,
        param_gather_seconds=sum((b.seconds for b in phases.gather), 0.0),
        param_gather_exposed_seconds=phases.ag_exposed,
        step_compute_seconds=busiest,
        step_comm_exposed_seconds=step_end - busiest,
        step_bytes_per_rank=max(run.sent.values(), default=0.0),
        details=details,
        timeline=timeline,
    )


def _timeline(size: int, bubble: float, fwd_bwd: float, bucket_segments: list[Segment], step_origin: float,
              run: StepRun) -> tuple[Segment, ...]:
    """Every rank's iteration: bubble, forward/backward, bucket collectives, the step."""
    out: list[Segment] = []
    for r in range(size):
        if bubble > 0:
            out.append(Segment(r, "compute", "bubble", 0.0, bubble))
        if fwd_bwd > 0:
            out.append(Segment(r, "compute", "forward_backward", bubble, bubble + fwd_bwd))
        out += [dataclasses.replace(s, rank=r) for s in bucket_segments]
    out += [dataclasses.replace(s, start=s.start + step_origin, end=s.end + step_origin) for s in run.segments]
    return tuple(out)
