"""What one rank holds, predicted from the plan alone.

For a (DP rank, TP rank) of a pipeline stage: the parameter and gradient buffers and their
buckets, the fp32 main parameters (copies of its shard, for bf16/fp16 parameters), the
optimizer state by kind, and the temporaries of the host-group step. With expert
parallelism (``plan.experts``) the same quantities of the rank's expert buffers follow from
the expert plan at the rank's expert coordinate (:mod:`~megatron.canzona.planning.grid`),
in ``RankMemory.experts``. ``tools/dry_run.py``
builds the real rank (Megatron's model, DDP and the Canzona optimizer, on the meta device)
and checks every number here against what was actually allocated.

State kinds (the fields of ``megatron.canzona.optim``'s state classes): ``momentum`` (Muon),
``statistics`` (Shampoo's and SOAP's L and R), ``roots`` (Shampoo's inverse roots),
``eigenbases`` (SOAP's), ``moments`` (Adam moments inside Shampoo's grafting and SOAP's
rotated space, one per matrix element) and ``adam_moments`` (AdamW of the elementwise
parameters).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .comm import NARROW_DTYPE_BYTES
from .cost import OPTIMIZERS, CostModel
from .fsdp import FsdpBucket, fsdp_buckets
from .grid import expert_coordinates
from .plan import BufferPlan, CanzonaPlan
from .schedule import plan_schedule
from .specs import ParamSpec

FIELD_KINDS: dict[str, str] = {
    "momentum": "momentum",
    "left": "statistics", "right": "statistics",
    "left_root": "roots", "right_root": "roots",
    "basis_left": "eigenbases", "basis_right": "eigenbases",
    "exp_avg": "moments", "exp_avg_sq": "moments", "moment2": "moments",
}
"""State field name -> kind, for every matrix optimizer's state."""
STATE_KINDS: tuple[str, ...] = ("momentum", "statistics", "roots", "eigenbases", "moments", "adam_moments")
EARLY_COMPUTE_BYTES = 2 << 30
"""Default bound on what early compute keeps per rank and optimizer: the directions of the
matrices it computes early and (Shampoo, SOAP) the staging copy of their state
(``--canzona-early-compute-budget``). Allocated after backward's last kernels are queued, it
reuses what the last micro-batch's activations held; 2 GiB keeps Qwen3-30B-A3B's experts on 64
GPUs (1.8 GB of fp32 directions a rank) early."""
STATE_BYTES = 4
"""Optimizer state and main parameters are fp32."""


@dataclass(frozen=True, kw_only=True)
class StateLayout:
    """Which state tensors a matrix optimizer keeps (``megatron.canzona.optim``'s configs)."""

    optimizer: str
    """``muon``, ``shampoo``, ``soap`` or ``adaptive_muon``."""
    moment2_method: str = "adamuon"
    """``adaptive_muon``: an elementwise second moment (``adamuon``) or one per row or column
    of the longer side (``normuon``)."""
    max_precond_dim: int = 10000
    """Shampoo: sides above it keep a diagonal (length-d) statistic; SOAP: no rotation."""
    grafting: bool = True
    """Shampoo: Adam grafting keeps a second moment."""
    ns_dtype: str = "float32"
    """Muon's Newton-Schulz dtype: a narrower one (bf16) gives a whole matrix that moves its
    direction exactly in it, and early compute keeps it so (:meth:`direction_elements`)."""

    @classmethod
    def of(cls, optimizer: str, matrix: object) -> StateLayout:
        """The layout of ``optimizer`` under its matrix config (``megatron.canzona.optim``'s)."""
        return cls(optimizer=optimizer, max_precond_dim=getattr(matrix, "max_precond_dim", 10000),
                   grafting=getattr(matrix, "grafting", "adam") == "adam", ns_dtype=getattr(matrix, "ns_dtype", "float32"),
                   moment2_method=getattr(matrix, "moment2_method", "adamuon"))

    @classmethod
    def of_cost(cls, cost_model: CostModel) -> StateLayout:
        """The layout of the optimizer ``cost_model`` prices, at its other defaults (``numel``:
        Muon's), for the tools that know the optimizer by its cost model only."""
        return cls(optimizer=cost_model.kind if cost_model.kind in OPTIMIZERS else "muon",
                   max_precond_dim=cost_model.max_precond_dim, ns_dtype=cost_model.ns_dtype)

    @property
    def staged(self) -> bool:
        """Whether early compute keeps a staging copy of the state (Muon advances its momentum
        at the commit instead, from the gradients gathered again)."""
        return self.optimizer != "muon"

    def direction_elements(self, rows: int, cols: int, *, narrow: bool) -> int:
        """fp32 elements of the direction early compute keeps of a ``rows x cols`` matrix;
        ``narrow``: a whole matrix that moves (its update goes in the Newton-Schulz dtype,
        :func:`~.comm.narrow_bytes`)."""
        size = NARROW_DTYPE_BYTES.get(self.ns_dtype) if narrow and self.optimizer == "muon" else None
        return rows * cols if size is None else fp32_elements(rows * cols, size)

    def numel(self, rows: int, cols: int) -> dict[str, int]:
        """Elements per state kind of one ``rows x cols`` matrix."""
        out = dict.fromkeys(STATE_KINDS, 0)
        if self.optimizer in ("muon", "adaptive_muon"):
            out["momentum"] = rows * cols
            if self.optimizer == "adaptive_muon":
                out["moments"] = rows * cols if self.moment2_method == "adamuon" else max(rows, cols)
        elif self.optimizer == "shampoo":
            for d in (rows, cols):
                side = d if d > self.max_precond_dim else d * d
                out["statistics"] += side
                out["roots"] += side
            out["moments"] = rows * cols * (2 if self.grafting else 1)
        elif self.optimizer == "soap":
            for d in (rows, cols):
                if d <= self.max_precond_dim:
                    out["statistics"] += d * d
                    out["eigenbases"] += d * d
            out["moments"] = 2 * rows * cols
        else:
            raise ValueError(f"unknown matrix optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        return out


@dataclass(frozen=True)
class RankMemory:
    """One rank's predicted memory, in elements (bytes follow from the dtypes)."""

    param_buffer_elements: int
    """Parameter buffers (every chunk, matrix and elementwise), padding included; Megatron's
    DDP keeps a gradient buffer of the same size."""
    bucket_elements: tuple[int, ...]
    """Every bucket's size, matrix buffers first, then elementwise, chunk by chunk."""
    shard_elements: int
    """Parameter elements in this rank's shards (what its optimizer steps): with bf16
    parameters, also the elements of its fp32 main parameters."""
    state_elements: dict[str, int]
    """Optimizer state by kind."""
    largest_temporary_elements: int
    """The largest single tensor the host-group step allocates."""
    step_temporary_elements: int
    """The most elements of host-group buffers alive at once (a group's, with the next
    group's gather in flight)."""
    compute_batch_elements: int = 0
    """Full-matrix elements of the largest host-compute batch: at most what stacking its
    same-shape gradients copies (the update functions' own working set comes on top)."""
    early_gather_elements: int = 0
    """Send and receive buffers of every micro-group's gather, alive at once from the
    buckets' reductions (in backward, beside the activations) to the step when the gathers
    go early (``canzona_patches.integration.early_gather``)."""
    early_state_elements: int = 0
    """With early compute: the staging copy of the state of the matrices this rank computes
    early (:func:`early_compute_groups`), made once and swapped with the state at each step
    that commits it: the size of that state (none for Muon, whose momentum advances at the
    commit: :attr:`StateLayout.staged`)."""
    early_direction_elements: int = 0
    """With early compute: the full direction of every matrix this rank computes early, alive
    from its computation (in backward or the reduce-scatters after it) to the step."""
    early_source_elements: int = 0
    """Where the holders keep Muon's momentum (Megatron-FSDP) and gather early: Muon's source of
    every piece this rank holds, an fp32 copy made as its bucket reduces
    (``canzona_patches.integration.early_gather.EarlyGathers._prepare``), alive to its micro-group's
    gather (with early compute, to the step): at most this many at once, in iterations that
    speculate."""
    experts: RankMemory | None = None
    """The same for the rank's expert-parallel buffers and the expert optimizer (a second
    one, stepped after the dense one); ``None`` without expert parallelism."""


def fp32_elements(numel: int, itemsize: int) -> int:
    """fp32 elements (:data:`STATE_BYTES` each) that ``numel`` elements of ``itemsize`` bytes take."""
    return -(-numel * itemsize // STATE_BYTES)


def early_compute_groups(groups: Iterable[tuple[int, int, int]], budget_elements: int) -> frozenset[int]:
    """The micro-groups a rank computes early: ``groups`` are ``(ready, group, elements)``,
    ``ready`` the last bucket the group's matrices reduce in (buckets reduce in index order,
    the model's last layers first) and ``elements`` what computing its matrices on this rank
    early keeps (their staging state and directions). In the order they become ready, as long
    as all of them fit in ``budget_elements``: the groups with the most of backward and of the
    reduce-scatters' tail to hide in; the others are computed in the step. (Whole groups: a
    group's matrices are batched as the step batches them, so what it computes is bitwise the
    step's.)"""
    chosen, used = set(), 0
    for _, group, elements in sorted(groups):
        if used + elements > budget_elements:
            break
        used += elements
        chosen.add(group)
    return frozenset(chosen)


def rank_memory(
    plan: CanzonaPlan, specs: Sequence[ParamSpec], *, dp_rank: int, tp_rank: int, state: StateLayout,
    early_compute_bytes: int = EARLY_COMPUTE_BYTES, narrow_gathers: Mapping[str, int] | None = None,
    holder_sources: bool = False,
) -> RankMemory:
    """Predicted memory of rank ``(dp_rank, tp_rank)`` under ``plan`` (async mode), its
    expert buffers included (``experts``) when the plan has an expert plan; early compute
    bounded by ``early_compute_bytes``; ``narrow_gathers``: bytes per element of the tasks whose host
    gathers the matrix narrower (``--canzona-narrow-gathers``: :func:`~.comm.narrow_gather_bytes`);
    ``holder_sources``: the holders make Muon's sources before the step
    (:attr:`RankMemory.early_source_elements`)."""
    experts = None
    if plan.experts is not None:
        expert_dp_rank, _, expert_tp_rank = expert_coordinates(
            dp_rank, tp_rank, tp_size=plan.tp_size, ep_size=plan.ep_size, expert_tp_size=plan.experts.tp_size)
        # Every EP rank holds the same local expert names, so the EP coordinate does not matter.
        experts = rank_memory(plan.experts, specs, dp_rank=expert_dp_rank, tp_rank=expert_tp_rank, state=state,
                              early_compute_bytes=early_compute_bytes, narrow_gathers=narrow_gathers,
                              holder_sources=holder_sources)
    by_name = {(s.chunk, s.name): s for s in specs}
    buffers = [(c, dp.matrix) for c, dp in enumerate(plan.layouts)]
    buffers += [(c, dp.elementwise) for c, dp in enumerate(plan.layouts) if dp.elementwise is not None]
    kinds = dict.fromkeys(STATE_KINDS, 0)
    for h in plan.hosts:
        if h.dp_rank == dp_rank and h.tp_rank in (tp_rank, None):
            for rows, cols in by_name[(h.chunk, h.name)].part_matrices(h.part):
                for kind, numel in state.numel(rows, cols).items():
                    kinds[kind] += numel
    staged = _early_compute(plan, by_name, (dp_rank, tp_rank), state, early_compute_bytes)
    for _, buffer in buffers[len(plan.layouts):]:
        kinds["adam_moments"] += 2 * _shard_numel(buffer, dp_rank)
    largest, step, early = _temporaries(plan, dp_rank, tp_rank, narrow_gathers)
    return RankMemory(
        param_buffer_elements=sum(buffer.numel for _, buffer in buffers),
        bucket_elements=tuple(b.numel for _, buffer in buffers for b in buffer.buckets),
        shard_elements=sum(_shard_numel(buffer, dp_rank) for _, buffer in buffers),
        state_elements=kinds,
        largest_temporary_elements=largest,
        step_temporary_elements=step,
        compute_batch_elements=_largest_batch(plan, dp_rank, tp_rank),
        early_gather_elements=early,
        early_state_elements=staged[0],
        early_direction_elements=staged[1],
        early_source_elements=_held_elements(plan, dp_rank, tp_rank) if holder_sources else 0,
        experts=experts,
    )


HOLDER_MOMENTUM_OPTIMIZERS = ("muon", "adaptive_muon")
"""The optimizers whose momentum the ranks holding a matrix's elements keep under Megatron-FSDP
(``CanzonaOptimizer(momentum_on_holders=True)``); the rest of their state is their host's."""


def fsdp_host_numel(state: StateLayout, rows: int, cols: int) -> dict[str, int]:
    """Elements per state kind the host of a ``rows x cols`` matrix keeps under Megatron-FSDP:
    :meth:`StateLayout.numel` but the momentum its holders keep (:data:`HOLDER_MOMENTUM_OPTIMIZERS`)."""
    kinds = state.numel(rows, cols)
    if state.optimizer in HOLDER_MOMENTUM_OPTIMIZERS:
        kinds["momentum"] = 0
    return kinds


def keeps_host_state(state: StateLayout) -> bool:
    """Whether a host keeps any state of its matrices under Megatron-FSDP (Muon: none, its
    momentum is its holders')."""
    return any(fsdp_host_numel(state, 2, 3).values())


def fsdp_host_elements(state: StateLayout, spec: ParamSpec, part: int = 0) -> int:
    """State elements the host of part ``part`` of ``spec`` keeps under Megatron-FSDP (all kinds)."""
    return sum(sum(fsdp_host_numel(state, rows, cols).values()) for rows, cols in spec.part_matrices(part))


def fsdp_host_state(plan: CanzonaPlan, specs: Sequence[ParamSpec], state: StateLayout) -> list[list[int]]:
    """``[dp_rank][tp_rank]``: state elements each rank keeps as a host under Megatron-FSDP
    (``plan``'s own hosts: the dense or the expert ones, ``specs`` holding theirs)."""
    by_name = {(s.chunk, s.name): s for s in specs}
    kept = [[0] * plan.tp_size for _ in range(plan.dp_size)]
    for h in plan.hosts:
        elements = fsdp_host_elements(state, by_name[(h.chunk, h.name)], h.part)
        for t in range(plan.tp_size) if h.tp_rank is None else (h.tp_rank,):
            kept[h.dp_rank][t] += elements
    return kept


def fsdp_state_elements(plan: CanzonaPlan, specs: Sequence[ParamSpec], *, dp_rank: int, tp_rank: int,
                        state: StateLayout, strategy: str = "optim_grads_params",
                        bucket_size: int | None = None,
                        buckets: dict[int, Sequence[FsdpBucket]] | None = None,
                        experts: bool = False) -> dict[str, int]:
    """Optimizer state by kind of rank ``(dp_rank, tp_rank)`` under Megatron-FSDP (``plan`` of the
    ``fsdp`` layout, made over the buckets of ``strategy`` and ``bucket_size``): Muon's momentum
    (Muon's, AdaMuon's) in FSDP's shard layout, one element per matrix element this rank holds;
    AdamW's two moments per elementwise element it holds; the rest of each matrix's state
    (AdaMuon's second moment, Shampoo's and SOAP's everything) on its host. ``buckets``: each
    chunk's :func:`~megatron.canzona.planning.fsdp.fsdp_buckets`, where the caller has them
    (every rank's are the same).

    ``experts``: the expert optimizer's instead (``plan.experts``, the expert buckets over the
    expert-data-parallel group, ``(dp_rank, tp_rank)`` that group's rank and expert TP rank); a
    rank of an expert-parallel run holds the sum of the two."""
    if experts and plan.experts is None:
        raise ValueError("experts=True needs a plan with experts (plan.experts)")
    plan = plan.experts if experts else plan
    specs = [s for s in specs if s.is_expert == experts]
    by_name = {(s.chunk, s.name): s for s in specs}
    kinds = dict.fromkeys(STATE_KINDS, 0)
    holders = state.optimizer in HOLDER_MOMENTUM_OPTIMIZERS
    for h in plan.hosts:
        if h.dp_rank == dp_rank and h.tp_rank in (tp_rank, None):
            for rows, cols in by_name[(h.chunk, h.name)].part_matrices(h.part):
                for kind, numel in fsdp_host_numel(state, rows, cols).items():
                    kinds[kind] += numel
    family = {(s.chunk, s.name): s.family for s in specs}
    if buckets is None:
        buckets = {chunk: fsdp_buckets([s for s in specs if s.chunk == chunk], dp_size=plan.dp_size, strategy=strategy,
                                       bucket_size=bucket_size) for chunk in sorted({s.chunk for s in specs})}
    for chunk, chunk_buckets in buckets.items():
        for bucket in chunk_buckets:
            for item in bucket.items:
                if (chunk, item.name) not in family:  # the other optimizer's (dense, or experts)
                    continue
                held = sum(hi - lo for rank, lo, hi in bucket.pieces(item) if rank == dp_rank)
                if family[(chunk, item.name)] != "matrix":
                    kinds["adam_moments"] += 2 * held
                elif holders:
                    kinds["momentum"] += held
    return kinds


def _early_compute(plan: CanzonaPlan, by_name: dict, me: tuple[int, int], state: StateLayout,
                   budget_bytes: int) -> tuple[int, int]:
    """(staging state, direction) elements of the micro-groups rank ``me`` computes early
    (:func:`early_compute_groups`)."""
    ready: dict[int, int] = {}
    mine: dict[int, list[int]] = {}  # group -> (staging state, directions) of its matrices on this rank
    for task in plan_schedule(plan).tasks:
        ready[task.group] = max(ready.get(task.group, 0), task.bucket)
        counts = mine.setdefault(task.group, [0, 0])
        if task.host == me:
            matrices = by_name[(task.chunk, task.name)].part_matrices(task.part)
            narrow = len(matrices) == 1 and not task.is_local()
            for rows, cols in matrices:
                counts[0] += sum(state.numel(rows, cols).values()) if state.staged else 0
                counts[1] += state.direction_elements(rows, cols, narrow=narrow)
    chosen = early_compute_groups(((ready[g], g, sum(c)) for g, c in mine.items()), budget_bytes // STATE_BYTES)
    return sum(mine[g][0] for g in chosen), sum(mine[g][1] for g in chosen)


def _largest_batch(plan: CanzonaPlan, dp_rank: int, tp_rank: int) -> int:
    """Full-matrix elements of the largest micro-group this rank computes."""
    groups: dict[int, int] = {}
    for task in plan_schedule(plan).tasks:
        if task.host == (dp_rank, tp_rank):
            groups[task.group] = groups.get(task.group, 0) + task.full_numel(plan.tp_size)
    return max(groups.values(), default=0)


def _shard_numel(buffer: BufferPlan, dp_rank: int) -> int:
    """Parameter elements inside ``dp_rank``'s shard of every bucket."""
    total = 0
    for p in buffer.placements:
        bounds = buffer.buckets[p.bucket].shard_bounds
        total += max(0, min(p.end, bounds[dp_rank + 1]) - max(p.start, bounds[dp_rank]))
    return total


def _held_elements(plan: CanzonaPlan, dp_rank: int, tp_rank: int) -> int:
    """Elements of every matrix piece rank ``(dp_rank, tp_rank)`` holds (its copy of a matrix every
    TP rank holds)."""
    held = 0
    for task in plan_schedule(plan).tasks:
        if task.column != tp_rank and not task.tp_sharded:
            continue  # another TP rank's copy
        held += sum(hi - lo for coord, lo, hi in task.holders(plan.tp_size) if coord == (dp_rank, tp_rank))
    return held


def _temporaries(plan: CanzonaPlan, dp_rank: int, tp_rank: int,
                 narrow_gathers: Mapping[str, int] | None = None) -> tuple[int, int, int]:
    """(largest single temporary, most alive at once, every gather's buffers) of the
    host-group step, in elements (a matrix of ``narrow_gathers`` gathered in bf16)."""
    me = (dp_rank, tp_rank)
    groups: dict[int, dict[str, int]] = {}
    largest = 0
    for task in plan_schedule(plan).tasks:
        if task.column != tp_rank and not task.tp_sharded:
            continue  # another TP rank's copy
        g = groups.setdefault(task.group, {"send": 0, "recv": 0, "full": 0})
        for coord, lo, hi in task.holders(plan.tp_size):
            if coord == me and task.host != me:
                g["send"] += hi - lo
            if task.host == me and coord != me:
                g["recv"] += hi - lo
        if task.host == me and not task.is_local():
            full = task.full_numel(plan.tp_size)
            narrow = (narrow_gathers or {}).get(task.key)
            gathered = full if narrow is None else fp32_elements(full, narrow)
            g["full"] += gathered + full  # the gathered gradient (or normalised input) and the direction
            largest = max(largest, full)
    order = sorted(groups)
    step = 0
    for k, index in enumerate(order):
        g = groups[index]
        largest = max(largest, g["send"], g["recv"])
        alive = g["send"] + g["recv"] + g["full"]  # all-to-all buffers (the scatter reuses the gather's), matrices
        if k + 1 < len(order):
            alive += groups[order[k + 1]]["send"] + groups[order[k + 1]]["recv"]
        step = max(step, alive)
    return largest, step, sum(g["send"] + g["recv"] for g in groups.values())
