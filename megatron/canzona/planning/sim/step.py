"""The optimizer step per rank: matrix tasks, their gathers and scatters, the updates, AdamW.

A :class:`SimTask` is one matrix update as the network sees it: the pieces its holders
have, who computes it (its host, or every holder), and how long the update takes. Three
ways to run the tasks of a step:

* :func:`run_host_groups` with ``pipelined=True`` -- Canzona's asynchronous micro-groups,
  in the order of ``_StepRun.run_async``: group k+1's gather is issued before
  group k computes and group k's scatter before group k−1 is applied. Collectives of the
  group run one at a time on the communication stream (G0, G1, S0, G2, S1, ...) and start
  when every rank has issued them; compute runs beside them.
* :func:`run_host_groups` with ``pipelined=False`` -- the same groups, each one gather,
  compute, scatter, apply, blocking (Canzona without overlap, ``--canzona-tp-mode sync``,
  Megatron-LM's ``layer_sharded``).
* :func:`run_per_matrix` -- synchronous compute matrix by matrix: each rank all-gathers a
  matrix's pieces from its other holders (a blocking ring) and computes it (Megatron's
  ``muon_tp_mode duplicated``, stock ZeRO-1, Moonlight's synchronous compute); a task with
  :attr:`SimTask.reductions` is computed by its holders together, each on its own piece, its Gram
  matrices all-reduced among them (``muon_tp_mode distributed``).

With ``reduced_at`` the pipelined groups' gathers go before the step as their buckets reduce;
with an :class:`EarlyCompute` too, each group is computed before the step once gathered and
backward is over (never beside backward's GEMMs: the runtime does not), and committed at the
step (:func:`_run_early`).

Elementwise costs are memory-bound: a matrix update's momentum reads the gradient and
reads and writes the fp32 momentum (:data:`MOMENTUM_BYTES_PER_ELEMENT`, formula costs
only: a calibration measured it with the update); applying an update reads the fp32
parameter and the update and writes the fp32 parameter and its bf16 copy
(:data:`APPLY_BYTES_PER_ELEMENT`); AdamW reads gradient, parameter and both moments and
writes all but the gradient, plus the bf16 copy (:data:`ADAMW_BYTES_PER_ELEMENT`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..comm import WireConfig
from ..memory import early_compute_groups
from .cluster import ClusterSpec
from .iteration import Rider
from .network import Flows, Topology
from .result import Segment

MOMENTUM_BYTES_PER_ELEMENT = 12
"""fp32 gradient read, fp32 momentum read and written."""
APPLY_BYTES_PER_ELEMENT = 14
"""fp32 parameter and update read, fp32 parameter and bf16 model copy written."""
COMMIT_BYTES_PER_ELEMENT = 20
"""Bytes per element of committing a Muon update computed early: its full gradient rebuilt from
the gather (read, write: 8) and the momentum advanced (read it and the gradient, write it: 12)."""
ADAMW_BYTES_PER_ELEMENT = 30
"""fp32 gradient, parameter and two moments read (16), parameter and moments written (12), bf16 copy (2)."""
PACK_BYTES_PER_ELEMENT = 8
"""A piece copied into a gather's buffer: read and written in fp32 (a narrow one, written in its
dtype, :data:`NARROW_PACK_BYTES_PER_ELEMENT`)."""
NARROW_PACK_BYTES_PER_ELEMENT = 6
"""A piece divided by its matrix's norm as it is written into the gather's buffer in bf16."""
SOURCE_BYTES_PER_ELEMENT = 40
"""Muon's Newton-Schulz input made from a piece by a holder that keeps the momentum
(``CanzonaOptimizer.speculative_sources``): the gradient and the momentum copied (16), the
momentum's and the source's lerps (24)."""
EXACT_NORM_BYTES_PER_ELEMENT = 100
"""A holder's share of a matrix's exact norm (:func:`~megatron.canzona.optim.exact_norm.norms_of_pieces`):
the largest magnitude (two reads, 8), the square scaled into fp64 (12), squared in place (16),
truncated to int64 (16), the high word shifted out and summed (24), the low word masked and
summed (24)."""


@dataclass(frozen=True)
class SimTask:
    """One matrix update: its pieces, who computes it and for how long."""

    name: str
    holders: tuple[tuple[int, int], ...]
    """``(rank, numel)`` of every piece of the matrix (each holder once)."""
    host: int | None
    """The rank computing the update; ``None``: every holder computes it (synchronous)."""
    seconds: float
    """Compute of the whole update on one rank."""
    group: int = 0
    """Micro-group (host groups run in increasing order)."""
    reduced_by: tuple[int, int] | None = None
    """``(model chunk, bucket)`` whose reduce-scatter delivers its gradients."""
    update_bytes: int | None = None
    """Bytes per element of its update on the wire when narrower than the wire's fp32 (a whole
    matrix's bf16 Muon direction: :func:`~megatron.canzona.planning.comm.narrow_update_bytes`)."""
    early_elements: int = 0
    """What computing it before the step keeps on its host: its state's staging copy and its
    direction, in fp32 elements (:func:`~megatron.canzona.planning.memory.early_compute_groups`)."""
    commit_elements: int = 0
    """Elements whose state its host advances when the step commits it, computed early (Muon's
    momentum: :data:`COMMIT_BYTES_PER_ELEMENT` each, before its scatter)."""
    reductions: int = 0
    """Its holders orthogonalise it together, each its own piece, with ``reductions`` all-reduces of
    its Gram matrix among them instead of a gather (Megatron's ``muon_tp_mode distributed``); then
    ``seconds`` is one holder's share (:func:`~megatron.canzona.planning.cost.sharded_ns_flops`)."""
    reduce_bytes: float = 0.0
    """Bytes of each of those all-reduces."""
    sharers: tuple[int, ...] = ()
    """The hosts computing it together, each its own shard and task (Canzona's
    ``--canzona-tp-together``): its host's compute then includes ``reductions`` all-reduces
    among them (over their link, in the compute's stream) and ``seconds`` is its share."""
    gather_bytes: int | None = None
    """Bytes per element of its pieces on the way to the host when narrower than the main
    gradients' (a projection only: :func:`~.layouts.plan_tasks`' ``narrow_gathers``)."""
    prep_bytes: int = 0
    """Memory traffic per element of each holder's work on its pieces before they can be packed
    (:func:`holder_prep`: Muon's source, the exact norm's share): gathered before the step, done as
    its bucket reduces (the runtime's ``EarlyGathers._prepare``); gathered in the step, before its
    group's gather."""
    pack_bytes: int = 0
    """Memory traffic per element of packing its pieces, before its group's gather goes (0: not priced)."""
    norm_reduces: int = 0
    """All-reduces of a few bytes among the group's ranks that its norm takes (2 for a narrow gather)."""

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.holders)


class StepRun:
    """Per-rank clocks, busy time, bytes sent and timeline of one optimizer step."""

    def __init__(self, members: Sequence[int], starts: Mapping[int, float], cluster: ClusterSpec,
                 wire: WireConfig, *, slowdown: float = 1.0) -> None:
        self.members = list(members)
        self.topology = Topology(cluster)
        self.cluster, self.wire, self.slowdown = cluster, wire, slowdown
        self.clock = {r: float(starts.get(r, 0.0)) for r in self.members}
        self.busy = {r: 0.0 for r in self.members}
        self.sent = {r: 0.0 for r in self.members}
        self.segments: list[Segment] = []
        self.comm_free = 0.0

    def work(self, rank: int, seconds: float, kind: str, label: str = "") -> None:
        """``rank`` computes for ``seconds`` (scaled by compute contention)."""
        seconds *= self.slowdown
        if seconds <= 0:
            return
        start = self.clock[rank]
        self.clock[rank] = start + seconds
        self.busy[rank] += seconds
        self.segments.append(Segment(rank, "compute", kind, start, start + seconds, label))

    def elementwise_seconds(self, numel: float, bytes_per_element: int) -> float:
        return numel * bytes_per_element / self.cluster.gpu.memory_bytes_per_s

    def collective(self, flows: Flows, issue: Mapping[int, float], kind: str, label: str = "") -> float | None:
        """Schedule one all-to-all over every member, issued at ``issue[rank]``; its end, or
        ``None`` when nothing moves (the runtime then issues no collective)."""
        duration = self.topology.alltoall(flows)
        if flows.empty:
            return None
        start = max(self.comm_free, max(issue[r] for r in self.members))
        end = start + duration
        self.comm_free = end
        for r in self.members:
            self.sent[r] += flows.sent(r)
            self.segments.append(Segment(r, "comm", kind, start, end, label))
        return end

    def wait(self, rank: int, until: float | None) -> None:
        if until is not None and until > self.clock[rank]:
            self.clock[rank] = until

    @property
    def end(self) -> float:
        return max(self.clock.values(), default=0.0)


def _by_group(tasks: Iterable[SimTask]) -> list[list[SimTask]]:
    groups: dict[int, list[SimTask]] = {}
    for task in tasks:
        groups.setdefault(task.group, []).append(task)
    return [groups[k] for k in sorted(groups)]


def _gather(run: StepRun, tasks: Sequence[SimTask]) -> Flows:
    return _gather_flows(run.topology, run.wire, tasks)


def holder_prep(*, holder_momentum: bool, narrow: bool) -> dict[str, int]:
    """:class:`SimTask`'s ``prep_bytes``, ``pack_bytes`` and ``norm_reduces`` of a matrix whose holders
    make Muon's source (they keep the momentum: :data:`SOURCE_BYTES_PER_ELEMENT`) and, sending it
    narrow, take their share of its exact norm (:data:`EXACT_NORM_BYTES_PER_ELEMENT`)."""
    return dict(prep_bytes=(SOURCE_BYTES_PER_ELEMENT if holder_momentum else 0)
                + (EXACT_NORM_BYTES_PER_ELEMENT if narrow else 0),
                pack_bytes=NARROW_PACK_BYTES_PER_ELEMENT if narrow else PACK_BYTES_PER_ELEMENT,
                norm_reduces=2 if narrow else 0)


def _holder_seconds(run: StepRun, tasks: Iterable[SimTask], field: str) -> dict[int, float]:
    """Per rank, the seconds of its elementwise work ``field`` (``prep_bytes``, ``pack_bytes``) on
    its pieces of the ``tasks`` that move (a host's own piece too; a matrix whole on its host is its
    host's compute)."""
    traffic: dict[int, float] = {}
    for task in tasks:
        size = getattr(task, field)
        if size and task.host is not None and any(r != task.host for r, _ in task.holders):
            for r, n in task.holders:
                traffic[r] = traffic.get(r, 0.0) + n * size
    return {r: run.elementwise_seconds(nbytes, 1) for r, nbytes in traffic.items()}


def _norm_reduces(run: StepRun, tasks: Iterable[SimTask]) -> float:
    """The latency of the tiny all-reduces of ``tasks``' norms (a tree over the group's ranks)."""
    count = max((t.norm_reduces for t in tasks), default=0)
    if not count:
        return 0.0
    link = run.cluster.link(run.topology.spans_nodes(run.members))
    return count * link.latency_s * max(1, math.ceil(math.log2(max(len(run.members), 2))))


def _prep(run: StepRun, tasks: Sequence[SimTask]) -> dict[int, float]:
    """Per rank, the seconds of its work on its pieces of ``tasks`` before their gather can be issued
    in the step: sources, norms and packing (:attr:`SimTask.prep_bytes`, :attr:`SimTask.pack_bytes`)."""
    prep, pack = _holder_seconds(run, tasks, "prep_bytes"), _holder_seconds(run, tasks, "pack_bytes")
    reduces = _norm_reduces(run, tasks)
    return {r: prep.get(r, 0.0) + pack.get(r, 0.0) + reduces for r in set(prep) | set(pack)}


def _prepare(run: StepRun, k: int, tasks: Sequence[SimTask]) -> None:
    """Each rank's work on its pieces of group ``k`` before its gather, in the step."""
    for r, seconds in _prep(run, tasks).items():
        run.work(r, seconds, "prep", str(k))


def _gather_flows(topology: Topology, wire: WireConfig, tasks: Sequence[SimTask]) -> Flows:
    """Pieces to their host (fp32 main gradients), or to every other holder (synchronous)."""
    transfers = []
    for task in tasks:
        size = task.gather_bytes or wire.main_grad_bytes
        targets = [task.host] if task.host is not None else [r for r, _ in task.holders]
        transfers += [(r, t, n * size) for r, n in task.holders for t in targets if t != r]
    return topology.flows(transfers)


def gather_riders(topology: Topology, wire: WireConfig, tasks: Sequence[SimTask],
                  key: Callable[[tuple[int, int]], Any] = lambda reduced_by: reduced_by) -> list[Rider]:
    """Each micro-group's early gather as traffic on the inter-node links that the reductions
    still to come share (:class:`~.iteration.Rider`), keyed by ``key(task.reduced_by)``; a
    group that waits for the step, or moves nothing between nodes, rides nothing."""
    riders = []
    for group in _by_group(tasks):
        if any(t.reduced_by is None for t in group):
            continue
        flows = _gather_flows(topology, wire, group)
        loads = topology.inter_node_seconds(flows) if flows.out_inter or flows.in_inter else {}
        if loads:
            riders.append(Rider(frozenset(key(t.reduced_by) for t in group), loads))
    return riders


def _scatter(run: StepRun, tasks: Sequence[SimTask]) -> Flows:
    """Each holder's slice of the update back from the host (fp32, or the task's narrower size)."""
    return run.topology.flows((t.host, r, n * (t.update_bytes or run.wire.update_bytes))
                              for t in tasks if t.host is not None for r, n in t.holders)


def _compute(run: StepRun, tasks: Sequence[SimTask]) -> dict[int, float]:
    seconds: dict[int, float] = {}
    for task in tasks:
        extra = 0.0
        if task.sharers and task.host is not None:  # a ring reduce-scatter and all-gather per all-reduce
            extra = 2 * task.reductions * run.topology.ring(task.reduce_bytes, task.sharers)
            run.sent[task.host] += 2 * task.reductions * task.reduce_bytes * (len(task.sharers) - 1) / len(task.sharers)
        for r in [task.host] if task.host is not None else [r for r, _ in task.holders]:
            seconds[r] = seconds.get(r, 0.0) + task.seconds + extra
    return seconds


def _apply(run: StepRun, tasks: Sequence[SimTask]) -> dict[int, float]:
    numel: dict[int, float] = {}
    for task in tasks:
        for r, n in task.holders:
            numel[r] = numel.get(r, 0.0) + n
    return {r: run.elementwise_seconds(n, APPLY_BYTES_PER_ELEMENT) for r, n in numel.items()}


@dataclass(frozen=True, kw_only=True)
class EarlyCompute:
    """Micro-groups computed before the step, once their gradients are on their hosts and
    backward is over (speculating that the clip does not act: the step commits what they
    computed). The runtime computes nothing beside backward's GEMMs, which a second compute
    stream slows more than it hides (``tools/bench_overlap.py``: 3% hidden on an H100): a group
    gathered during backward waits for backward's kernels to be queued
    (``EarlyGathers.on_finishing``), then runs in the reduce-scatters' exposed tail."""

    backward_end: float
    """When backward ends, from the step's start (``<= 0``): no group is computed early before
    it; the compute units are free after it, through the reduce-scatters' exposed tail."""
    budget_elements: int | None = None
    """What early compute may keep per rank (``--canzona-early-compute-budget``, in fp32
    elements): each rank computes early only the groups that fit, as the runtime picks them;
    ``None``: every group."""


def run_host_groups(run: StepRun, tasks: Sequence[SimTask], *, pipelined: bool,
                    reduced_at: Mapping[tuple[int, int], float] | None = None,
                    early_compute: EarlyCompute | None = None,
                    calendar: dict[int, list[tuple[float, float]]] | None = None) -> None:
    """Micro-groups of host (or synchronous) tasks; see the module docstring. With
    ``reduced_at`` (``(chunk, bucket)`` -> when its reduce-scatter ends, from the step's
    start: negative in backward), each group's gather is issued before the step, once the
    buckets of its tasks are reduced (``canzona_patches.integration.early_gather``); with
    ``early_compute`` too, each group is computed once gathered and backward is over
    (:func:`_run_early`), in the time each rank's ``calendar`` (its busy spans, which this
    extends) leaves free."""
    groups = _by_group(tasks)
    if not groups:
        return
    compute = [_compute(run, g) for g in groups]
    apply = [_apply(run, g) for g in groups]
    if not pipelined:
        for k, group in enumerate(groups):
            _blocking_group(run, k, group, compute[k], apply[k])
        return
    early = _early_gathers(run, groups, reduced_at) if reduced_at is not None else None
    if early is not None and early_compute is not None:
        _run_early(run, groups, early, _group_ready(groups, reduced_at), compute, apply, early_compute,
                   {} if calendar is None else calendar)
        return

    def gather(k: int) -> float | None:
        if early is not None:
            return early[k]
        _prepare(run, k, groups[k])
        return run.collective(_gather(run, groups[k]), run.clock, "gather", str(k))

    gathers: list[float | None] = [gather(0)]
    scatters: list[float | None] = []
    for k in range(len(groups)):
        if k + 1 < len(groups):  # in flight while group k computes
            gathers.append(gather(k + 1))
        for r in run.members:
            run.wait(r, gathers[k])
            run.work(r, compute[k].get(r, 0.0), "compute", str(k))
        scatters.append(run.collective(_scatter(run, groups[k]), run.clock, "scatter", str(k)))
        if k:  # group k-1 is applied while group k's scatter is in flight
            _apply_group(run, k - 1, scatters[k - 1], apply[k - 1])
    _apply_group(run, len(groups) - 1, scatters[-1], apply[-1])


def _group_ready(groups: Sequence[Sequence[SimTask]], reduced_at: Mapping[tuple[int, int], float]) -> list[float]:
    """When each group's buckets are all reduced, from the step's start."""
    return [max((reduced_at.get(t.reduced_by, 0.0) if t.reduced_by is not None else 0.0 for t in g), default=0.0)
            for g in groups]


def _run_early(run: StepRun, groups: Sequence[Sequence[SimTask]], landed: Sequence[float | None],
               ready: Sequence[float], compute: Sequence[Mapping[int, float]], apply: Sequence[Mapping[int, float]],
               early: EarlyCompute, calendar: dict[int, list[tuple[float, float]]]) -> None:
    """Each host computes its groups in order, each once its gather has landed (or its buckets
    are reduced, where nothing moves) and backward has ended (:class:`EarlyCompute`: a group
    landed during backward waits for its end), in the first span its ``calendar`` leaves free; the
    updates are scattered and applied from the step's start, when the norm says the clip does
    not bind, one group's scatter in flight while the previous group is applied. Work before
    the step's start is not the step's."""
    done: list[dict[int, float]] = []
    free = {r: float("-inf") for r in run.members}
    allowed = _early_groups(groups, early.budget_elements)
    for k, at in enumerate(landed):
        start = max(ready[k] if at is None else at, early.backward_end)
        ends = {}
        for r in run.members:
            seconds = compute[k].get(r, 0.0) * run.slowdown
            # a group beyond the rank's budget is computed in the step, from its start
            begin = max(start if allowed is None or k in allowed.get(r, ()) else max(start, 0.0), free[r])
            if seconds <= 0:
                ends[r] = free[r] = max(free[r], start)
                continue
            begin, ends[r] = _place(calendar.setdefault(r, []), begin, seconds)
            free[r] = ends[r]
            run.segments.append(Segment(r, "compute", "compute", begin, ends[r], str(k)))
            run.busy[r] += max(0.0, ends[r] - max(begin, 0.0))
        done.append(ends)
    run.clock = {r: max(0.0, free[r], run.clock[r]) for r in run.members}
    run.comm_free = max(run.comm_free, 0.0)
    scatters: list[float | None] = []
    for k, group in enumerate(groups):
        issue = {r: max(0.0, done[k][r]) for r in run.members}
        for task in group:  # committing a state that advances at the commit, before the scatter
            if task.host is not None and task.commit_elements and (allowed is None or k in allowed.get(task.host, ())):
                issue[task.host] += run.elementwise_seconds(task.commit_elements, COMMIT_BYTES_PER_ELEMENT)
        scatters.append(run.collective(_scatter(run, group), issue, "scatter", str(k)))
        if k:
            _apply_group(run, k - 1, scatters[k - 1], apply[k - 1])
    _apply_group(run, len(groups) - 1, scatters[-1], apply[-1])


def _place(busy: list[tuple[float, float]], earliest: float, seconds: float) -> tuple[float, float]:
    """Where work of ``seconds`` first fits at or after ``earliest`` between the non-overlapping
    ``busy`` spans; it is added to them."""
    begin = earliest
    for start, end in sorted(busy):
        if end <= begin:
            continue
        if begin + seconds <= start:
            break
        begin = end
    span = (begin, begin + seconds)
    busy.append(span)
    return span


def _early_groups(groups: Sequence[Sequence[SimTask]], budget: int | None) -> dict[int, frozenset[int]] | None:
    """Per host, the groups (by position) it computes early within ``budget`` elements, as the
    runtime picks them (in the order their last bucket reduces); ``None``: every group."""
    if budget is None:
        return None
    ready = [max((t.reduced_by[1] for t in g if t.reduced_by is not None), default=0) for g in groups]
    kept: dict[int, dict[int, int]] = {}
    for k, group in enumerate(groups):
        for task in group:
            if task.host is not None:
                kept.setdefault(task.host, {}).setdefault(k, 0)
                kept[task.host][k] += task.early_elements
    return {r: early_compute_groups(((ready[k], k, mine.get(k, 0)) for k in range(len(groups))), budget)
            for r, mine in kept.items()}


def _early_gathers(run: StepRun, groups: Sequence[Sequence[SimTask]],
                   reduced_at: Mapping[tuple[int, int], float]) -> list[float | None]:
    """Every group's gather issued as soon as its buckets are reduced and its holders have packed
    their pieces, in that order (the runtime issues a group when its last bucket reports), one at a
    time; their ends. Each rank's work on its pieces of a bucket (:attr:`SimTask.prep_bytes`: the
    sources, the norms and their all-reduces) runs on the gathers' side stream as the bucket
    reduces, in that order, beside backward (priced as hidden by it: no GPU has measured the
    contention); a group's packing (:attr:`SimTask.pack_bytes`) once its last bucket is in."""
    ready = _group_ready(groups, reduced_at)
    side = {r: float("-inf") for r in run.members}
    done: dict[int, dict[int, float]] = {}  # group -> rank -> its pieces made
    buckets: dict[tuple[int, int] | None, list[tuple[int, SimTask]]] = {}
    for k, group in enumerate(groups):
        for task in group:
            buckets.setdefault(task.reduced_by, []).append((k, task))
    for key in sorted(buckets, key=lambda b: (reduced_at.get(b, 0.0) if b is not None else 0.0, str(b))):
        at = reduced_at.get(key, 0.0) if key is not None else 0.0
        members = buckets[key]
        prep = _holder_seconds(run, (task for _, task in members), "prep_bytes")
        reduces = _norm_reduces(run, (task for _, task in members))
        for r in run.members:
            seconds = run.slowdown * prep.get(r, 0.0) + reduces
            start = max(side[r], at)
            side[r] = start + seconds
            if seconds > 0:
                run.segments.append(Segment(r, "compute", "prep", start, side[r], str(key)))
            for k, _ in members:
                done.setdefault(k, {})[r] = side[r]
    run.comm_free = min(ready, default=0.0)
    ends: list[float | None] = [None] * len(groups)
    for k in sorted(range(len(groups)), key=lambda k: (ready[k], k)):
        pack = _holder_seconds(run, groups[k], "pack_bytes")
        issue = {r: max(ready[k], done.get(k, {}).get(r, ready[k])) + run.slowdown * pack.get(r, 0.0)
                 for r in run.members}
        ends[k] = run.collective(_gather(run, groups[k]), issue, "gather", str(k))
    run.comm_free = max(run.comm_free, 0.0)
    return ends


def _blocking_group(run: StepRun, k: int, group: Sequence[SimTask], compute: Mapping[int, float],
                    apply: Mapping[int, float]) -> None:
    _prepare(run, k, group)
    gathered = run.collective(_gather(run, group), run.clock, "gather", str(k))
    for r in run.members:
        run.wait(r, gathered)
        run.work(r, compute.get(r, 0.0), "compute", str(k))
    scattered = run.collective(_scatter(run, group), run.clock, "scatter", str(k))
    _apply_group(run, k, scattered, apply)


def _apply_group(run: StepRun, k: int, scattered: float | None, apply: Mapping[int, float]) -> None:
    for r in run.members:
        run.wait(r, scattered)
        run.work(r, apply.get(r, 0.0), "apply", str(k))


def run_per_matrix(run: StepRun, tasks: Sequence[SimTask]) -> None:
    """Synchronous compute, one matrix at a time on each rank: a blocking ring all-gather of
    its pieces among its holders, then the whole update; then every piece is applied.
    Ranks are not coupled beyond that (holders of a matrix reach it in step)."""
    size = run.wire.main_grad_bytes
    applied: dict[int, float] = {}
    for task in tasks:
        ranks = [r for r, _ in task.holders]
        share = (len(ranks) - 1) / len(ranks)
        if task.reductions:  # a ring reduce-scatter and all-gather per all-reduce
            gather = 2 * task.reductions * run.topology.ring(task.reduce_bytes, ranks)
            sent, kind = 2 * task.reductions * task.reduce_bytes * share, "gram all-reduce"
        else:
            gather = run.topology.ring(task.numel * size, ranks)
            sent, kind = task.numel * size * share, "gather"
        for r, n in task.holders:
            if gather > 0:
                start = run.clock[r]
                run.clock[r] = start + gather
                run.sent[r] += sent
                run.segments.append(Segment(r, "comm", kind, start, start + gather, task.name))
            run.work(r, task.seconds, "compute", task.name)
            applied[r] = applied.get(r, 0.0) + n
    for r in run.members:
        run.work(r, run.elementwise_seconds(applied.get(r, 0.0), APPLY_BYTES_PER_ELEMENT), "apply")


def run_adamw(run: StepRun, numel: Mapping[int, float]) -> None:
    """AdamW on each rank's elementwise elements (its shard of the elementwise buffers)."""
    for r in run.members:
        run.work(r, run.elementwise_seconds(numel.get(r, 0.0), ADAMW_BYTES_PER_ELEMENT), "adamw")
