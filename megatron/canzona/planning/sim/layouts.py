"""What each strategy asks of the network and the ranks, read off the plans it runs.

Every builder returns a :class:`Work`: the matrix tasks of the dense buffers (stage ranks)
and of the expert buffers (per EP rank, mapped to stage ranks), how they run, AdamW's
elements per rank, and the buffers whose buckets are reduced and gathered over DP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..comm import narrow_gather_bytes, narrow_update_bytes
from ..cost import CostModel
from ..memory import StateLayout
from ..plan import BufferPlan, CanzonaPlan
from ..schedule import Schedule, buffer_schedule, plan_schedule
from ..specs import ParamSpec
from .step import SimTask

Seconds = Callable[..., float]
"""``(spec, part=None) -> seconds`` of one whole update of a parameter's matrices (of one of
its parts hosted apart) on one rank."""
RankOf = Callable[[int, int], int]
"""Stage rank of a ``(dp_rank, tp_rank)`` of a plan's grid."""
Sharded = Callable[[ParamSpec], tuple[float, int, float]]
"""``spec -> (seconds, all-reduces, bytes of each)`` of one TP rank's share of a TP-sharded
parameter (:func:`~.simulate.tp_sharded_seconds`): with all-reduces, its TP ranks orthogonalise
each matrix together (Megatron's ``muon_tp_mode distributed``, Canzona's ``--canzona-tp-together``);
without, each its own slice alone (``blockwise``)."""


TaskBuilder = Callable[[BufferPlan, list[ParamSpec], RankOf, int], list[SimTask]]
"""``(matrix buffer, its specs, rank of (dp, tp), TP size) -> tasks`` of a DP layout."""


@dataclass(frozen=True)
class Grid:
    """The ranks of one pipeline stage: dense DP x TP, and expert DP x EP x expert TP."""

    dp_size: int
    tp_size: int
    ep_size: int = 1
    expert_tp_size: int = 1

    @property
    def size(self) -> int:
        return self.dp_size * self.tp_size

    @property
    def expert_dp_size(self) -> int:
        return self.size // (self.ep_size * self.expert_tp_size)

    def rank(self, dp_rank: int, tp_rank: int) -> int:
        return dp_rank * self.tp_size + tp_rank

    def expert_rank(self, edp_rank: int, etp_rank: int, ep_rank: int) -> int:
        """Stage rank of an expert coordinate (Megatron's etp-ep-dp order, expert TP fastest)."""
        return etp_rank + self.expert_tp_size * (ep_rank + self.ep_size * edp_rank)

    def dp_group(self) -> list[int]:
        return [self.rank(d, 0) for d in range(self.dp_size)]

    def expert_dp_group(self) -> list[int]:
        return [self.expert_rank(e, 0, 0) for e in range(self.expert_dp_size)]

    def expert_members(self, ep_rank: int) -> list[int]:
        return [self.expert_rank(e, t, ep_rank) for e in range(self.expert_dp_size) for t in range(self.expert_tp_size)]


@dataclass
class Buffers:
    """DP-reduced buffers of one kind (dense or expert) and the group reducing them."""

    buffers: list[tuple[int, BufferPlan]]
    """``(model chunk, buffer)``."""
    group: list[int]
    """Stage ranks of one DP group reducing them (every DP group does the same)."""


@dataclass
class Work:
    """Everything one strategy does in an iteration besides forward and backward."""

    mode: str
    """``pipelined``, ``blocking`` or ``per_matrix`` (:mod:`.step`)."""
    dense: list[SimTask] = field(default_factory=list)
    experts: list[tuple[list[int], list[SimTask]]] = field(default_factory=list)
    """Per EP rank: its expert group's stage ranks and its tasks."""
    adamw: dict[int, float] = field(default_factory=dict)
    """Elementwise elements each rank updates with AdamW."""
    reduced: list[Buffers] = field(default_factory=list)
    """Buffers whose gradients are reduced (and parameters gathered) bucket by bucket."""
    all_reduce: bool = False
    """Gradients all-reduced (synchronous compute): no parameter all-gather."""
    early_gather: bool = False
    """The dense tasks' gathers go before the step, as their buckets reduce (Canzona async)."""


def _spec_map(specs: Sequence[ParamSpec]) -> dict[tuple[int, str], ParamSpec]:
    return {(s.chunk, s.name): s for s in specs}


def sim_tasks(schedule: Schedule, specs: Sequence[ParamSpec], seconds: Seconds, rank: RankOf,
              narrow: Mapping[str, int] | None = None, state: StateLayout | None = None,
              shared: Sharded | None = None) -> list[SimTask]:
    """The schedule's tasks (:mod:`..schedule`) on the stage's ranks, each with its update's
    seconds (and, in ``narrow``, its update's bytes per element on the wire; with ``state``,
    what computing it early keeps): what the simulator runs. A task of a matrix its TP ranks
    compute together (:attr:`~..schedule.Task.together`) costs its host ``shared(spec)``: its
    share and the all-reduces among the TP ranks of its DP rank."""
    by_key = _spec_map(specs)
    narrow = narrow or {}
    out = []
    for t in schedule.tasks:
        spec = by_key[(t.chunk, t.name)]
        matrices = spec.part_matrices(t.part)
        early = 0 if state is None else sum(
            sum(state.numel(rows, cols).values()) * state.staged
            + state.direction_elements(rows, cols, narrow=t.key in narrow) for rows, cols in matrices)
        advanced = 0 if state is None or state.staged else sum(rows * cols for rows, cols in matrices)
        if t.together:  # its share of the matrix: early, advanced and the work per TP rank
            if shared is None or t.host is None:
                raise ValueError(f"{t.key}: a matrix its TP ranks compute together needs their shared cost (shared=)")
            share, reductions, each = shared(spec)
            early, advanced = early // schedule.tp_size, advanced // schedule.tp_size
            sharers = tuple(rank(t.host[0], c) for c in range(schedule.tp_size))
        else:
            share, reductions, each, sharers = seconds(spec) if t.span is None else seconds(spec, t.part), 0, 0.0, ()
        out.append(SimTask(t.name, tuple((rank(*coord), hi - lo) for coord, lo, hi in t.holders(schedule.tp_size)),
                           None if t.host is None else rank(*t.host), share, t.group,
                           (t.chunk, t.bucket), narrow.get(t.key), early, advanced, reductions=reductions,
                           reduce_bytes=each, sharers=sharers))
    return out


def plan_tasks(plan: CanzonaPlan, specs: Sequence[ParamSpec], seconds: Seconds, rank: RankOf,
               *, synchronous: bool = False, cost_model: CostModel | None = None,
               shared: Sharded | None = None, narrow_gathers: bool = False) -> list[SimTask]:
    """A task per host of ``plan`` (per TP rank for a matrix every TP rank holds), in its
    micro-group; ``synchronous``: computed by every holder (``--canzona-tp-mode sync``);
    ``cost_model``: the optimizer, whose whole matrices' bf16 Muon directions go back in bf16.
    ``narrow_gathers`` (the runtime's ``--canzona-narrow-gathers``): those matrices' pieces go to
    their host in bf16 too, Muon's input normalised by its holders (under Megatron-FSDP, whose
    holders keep the momentum), but for those their TP ranks compute together."""
    schedule = plan_schedule(plan, synchronous=synchronous)
    narrow = narrow_update_bytes(schedule.tasks, specs, cost_model) if cost_model is not None else None
    state = None
    if cost_model is not None:
        state = StateLayout.of_cost(cost_model)
    tasks = sim_tasks(schedule, specs, seconds, rank, narrow, state, shared)
    if narrow_gathers and cost_model is not None:
        gathers = narrow_gather_bytes(schedule.tasks, specs, cost_model)
        tasks = [dataclasses.replace(task, gather_bytes=gathers[t.key]) if t.key in gathers else task
                 for t, task in zip(schedule.tasks, tasks)]
    return tasks


def buffer_tasks(buffer: BufferPlan, specs: Sequence[ParamSpec], seconds: Seconds, rank: RankOf,
                 tp_size: int) -> list[SimTask]:
    """Synchronous tasks of a DP layout: every rank holding a piece computes the matrix
    (a matrix every TP rank holds whole: each TP rank its own copy)."""
    return sim_tasks(buffer_schedule([buffer], specs, tp_size), specs, seconds, rank)


def tp_sharded_tasks(buffer: BufferPlan, specs: Sequence[ParamSpec], seconds: Seconds, rank: RankOf,
                     tp_size: int, sharded: Sharded) -> list[SimTask]:
    """Megatron's layer-wise Muon under ``--muon-tp-mode blockwise`` or ``distributed``:
    :func:`buffer_tasks`, but no TP-sharded matrix is gathered: each TP rank holding one computes
    its share (``sharded``), alone or with its Gram matrices all-reduced among them."""
    by_key = _spec_map(specs)
    out: list[SimTask] = []
    for task in buffer_tasks(buffer, list(specs), seconds, rank, tp_size):
        assert task.reduced_by is not None
        spec = by_key[(task.reduced_by[0], task.name)]
        if not spec.tp_sharded:
            out.append(task)
            continue
        share, reductions, each = sharded(spec)
        if reductions:
            out.append(dataclasses.replace(task, seconds=share, reductions=reductions, reduce_bytes=each))
        else:
            out += [dataclasses.replace(task, holders=(holder,), seconds=share) for holder in task.holders]
    return out


def home_tasks(buffer: BufferPlan, specs: Sequence[ParamSpec], seconds: Seconds, rank: RankOf,
               tp_size: int) -> list[SimTask]:
    """Megatron-LM's ``layer_sharded``: each TP-sharded matrix of a DP rank's shard gets one
    home TP rank (costliest first onto the least-loaded TP rank of that DP rank); all in one
    blocking group."""
    tasks = buffer_tasks(buffer, specs, seconds, rank, tp_size)
    load: dict[int, float] = {}
    out = []
    for task in sorted(tasks, key=lambda t: -t.seconds):
        ranks = [r for r, _ in task.holders]
        if len(ranks) == 1:
            out.append(SimTask(task.name, task.holders, ranks[0], task.seconds))
            continue
        host = min(ranks, key=lambda r: (load.get(r, 0.0), r))
        load[host] = load.get(host, 0.0) + task.seconds
        out.append(SimTask(task.name, task.holders, host, task.seconds))
    return out


def adamw_elements(buffers: Sequence[BufferPlan], rank: RankOf, tp_size: int) -> dict[int, float]:
    """Real (unpadded) elementwise elements in each rank's shards (every TP rank has its own)."""
    out: dict[int, float] = {}
    for buffer in buffers:
        for p in buffer.placements:
            for d, lo, hi in buffer.pieces(p):
                for t in range(tp_size):
                    out[rank(d, t)] = out.get(rank(d, t), 0.0) + (hi - lo)
    return out


def merge(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    return {r: a.get(r, 0.0) + b.get(r, 0.0) for r in set(a) | set(b)}
