"""Host groups: every matrix updated once, by one host rank, whatever the axes that shard it.

Megatron cuts a matrix twice: tensor parallelism gives each TP rank a slice (its *local*
matrix), and the distributed optimizer's equal DP shards may cut that local matrix again
into flat ranges on several DP ranks. Muon, Shampoo and SOAP need the whole matrix. The
plan gives each matrix one *host* (DP rank, TP rank); :class:`HostGroupEngine` runs it.
Per micro-group:

1. **gather** -- one all-to-all over the DP × TP group sends every piece (a DP shard of a
   TP shard) to its host, which reassembles the full matrix;
2. **compute** -- each host computes the full-matrix update directions of the matrices it
   hosts, through a :data:`HostCompute` callback (the single-device math, batched by shape;
   optimizer state lives only on the host, at full size);
3. **scatter** -- one all-to-all returns each piece's slice of the direction;
4. **apply** -- each rank applies its slices: ``p <- p - lr*wd*p - lr*D``.

A matrix whole in its host's DP shard and not TP-sharded needs no communication at all; a
micro-group in which nothing moves issues no collective. Only real elements go on the wire
(the all-to-alls have uneven splits, zero for peers with nothing to exchange), and each
piece moves once each way.

In ``async`` mode the groups are pipelined (:meth:`_StepRun.run_async` is the one
place that orders the stages): group k+1's gather is in flight while group k computes, and
group k's scatter while group k-1 is applied. On CUDA the host compute runs on a side
stream ordered by events, so NCCL and compute overlap too. The result equals the
synchronous computation; "async" is about execution, not staleness.

``sync`` mode is the baseline the paper compares against: every rank holding a piece of a
matrix gathers all of its pieces and computes the update itself (synchronous compute),
keeping its own slice; it batches the same matrices as their host does.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from megatron.canzona.optim.common import apply_update, state_dtype_for
from megatron.canzona.optim.exact_norm import norms_of_pieces
from megatron.canzona.planning.memory import fp32_elements
from megatron.canzona.planning.schedule import Coord, Task
from megatron.canzona.runtime.state_io import Placement, _local_view, flat_range_boxes, to_global_boxes

Mode = Literal["async", "sync"]
MODES: tuple[str, ...] = ("async", "sync")

HostCompute = Callable[[Sequence[str], Sequence[torch.Tensor]], Sequence[torch.Tensor]]
"""``(keys, full_grads) -> full_directions`` for the matrices one rank computes in one call
(one host's share of a micro-group); same order, same shapes."""


@dataclass(frozen=True, kw_only=True)
class MatrixTask:
    """A task of the schedule (:class:`~megatron.canzona.planning.schedule.Task`) with the
    shape of its local tensor: what the engine needs to cut and reassemble it. Every rank of
    the group holds the same list."""

    task: Task
    """Who holds which pieces, who computes, in which micro-group (the plan's schedule)."""
    local_shape: tuple[int, int]
    """Shape of one TP rank's tensor (the whole matrix when not TP-sharded)."""
    tp_dim: int | None
    """Dimension split across TP ranks (0 column-parallel, 1 row-parallel); ``None`` exactly
    when the task is not TP-sharded (it is then TP rank ``column``'s copy)."""
    stride: int = 1
    """Blocks per TP shard along ``tp_dim``: block j of a shard is its TP rank's piece of
    global block j (2 for Megatron's fused SwiGLU fc1, ``[gate_r; up_r]``)."""
    update_dtype: torch.dtype | None = None
    """A narrower dtype in which the host's direction of this task is exact, unscaled (Muon's
    Newton-Schulz output of one whole matrix, iterated in bf16): the scatter carries it in this
    dtype, and every rank multiplies its slice by :attr:`update_scale` before applying it, the
    product the host's math would have made. ``None``: the direction is final and moves in the
    update dtype (fp32)."""
    update_scale: float = 1.0
    """The factor of a narrow direction (:attr:`update_dtype`)."""
    gather_dtype: torch.dtype | None = None
    """A narrower dtype in which the holders send their pieces to the host, each first divided by
    the whole matrix's Frobenius norm, floored at :attr:`gather_floor` (the engine sums the norm
    from the holders' squares in integers, two all-reduces per micro-group): Muon's Newton-Schulz
    input as its first iteration takes it, for pieces that are that input already (the holders keep
    the momentum: Megatron-FSDP). The host's full matrix is then that normalised input, in this
    dtype: bit for bit what one device makes with Muon's ``exact_norm``
    (:func:`~megatron.canzona.optim.exact_norm.frobenius_norm`). ``None``: the pieces move in the
    update dtype as they are."""
    gather_floor: float = 1e-7
    """The least norm a narrow gather divides by (:attr:`gather_dtype`; Muon's ``eps``)."""
    together: int | None = None
    """For TP rank :attr:`column`'s shard of a TP-sharded matrix its TP ranks compute together
    (the schedule's :attr:`~megatron.canzona.planning.schedule.Task.together`), the matrix's TP
    dimension: its host's Newton-Schulz sums the Gram matrices with its TP peers', and the matrix
    is :meth:`matrix_shape`; ``None``: computed alone."""

    def __post_init__(self) -> None:
        key = self.task.key
        if len(self.local_shape) != 2 or min(self.local_shape) < 1:
            raise ValueError(f"{key}: local_shape must be a positive 2-D shape, got {self.local_shape}")
        if self.tp_dim not in (0, 1, None):
            raise ValueError(f"{key}: tp_dim must be 0, 1 or None, got {self.tp_dim}")
        if (self.tp_dim is not None) != self.task.tp_sharded:
            raise ValueError(f"{key}: tp_dim {self.tp_dim} disagrees with the schedule (TP-sharded: "
                             f"{self.task.tp_sharded}); re-plan with the model's tensor-parallel layout")
        if self.tp_dim is not None and (self.stride < 1 or self.local_shape[self.tp_dim] % self.stride):
            raise ValueError(f"{key}: stride {self.stride} must divide dim {self.tp_dim} of {self.local_shape}")
        if self.task.numel != self.numel:
            raise ValueError(f"{key}: pieces cover {self.task.numel} of {self.numel} elements")
        if self.task.host is None:
            raise ValueError(f"{key}: the engine needs a host per task (its mode decides who computes)")
        if self.update_dtype is not None and (self.update_dtype.itemsize >= 4 or self.task.is_local()):
            raise ValueError(f"{key}: a narrow update dtype must be under 4 bytes and for a task that moves")
        if self.gather_dtype is not None and (self.gather_dtype != self.update_dtype or self.together is not None):
            raise ValueError(f"{key}: a narrow gather is for a task whose direction is narrow in the same dtype "
                             f"({self.update_dtype}), computed by one host")
        if (self.together is not None) != self.task.together or self.together not in (0, 1, None) \
                or (self.together is not None and self.tp_dim is not None):
            raise ValueError(f"{key}: computed together {self.together} disagrees with the schedule "
                             f"({self.task.together}), or is not one TP rank's shard (TP dim {self.tp_dim})")

    @property
    def key(self) -> str:
        return self.task.key

    @property
    def pieces(self) -> tuple[tuple[int, int, int], ...]:
        return self.task.pieces

    @property
    def host(self) -> Coord:
        return self.task.host  # type: ignore[return-value]

    @property
    def group(self) -> int:
        return self.task.group

    @property
    def column(self) -> int:
        """The TP rank whose copy this is, for a matrix that is not TP-sharded."""
        return self.task.column

    @property
    def numel(self) -> int:
        return self.local_shape[0] * self.local_shape[1]

    def holders(self, tp_size: int) -> list[tuple[Coord, int, int]]:
        """``((dp_rank, tp_rank), lo, hi)`` of every piece, in a fixed order."""
        return self.task.holders(tp_size)

    def full_shape(self, tp_size: int) -> tuple[int, int]:
        """Shape of the whole matrix the host reassembles."""
        if self.tp_dim is None:
            return self.local_shape
        shape = list(self.local_shape)
        shape[self.tp_dim] *= tp_size
        return (shape[0], shape[1])

    def is_local(self) -> bool:
        """Whether the host holds the whole matrix itself (nothing to move)."""
        return self.task.is_local()

    def matrix_shape(self, tp_size: int) -> tuple[int, int]:
        """Shape of the matrix whose update this is: :meth:`full_shape`, or for a shard computed
        :attr:`together`, the whole TP-sharded matrix's (what its Muon scale is taken of)."""
        if self.together is None:
            return self.full_shape(tp_size)
        shape = list(self.local_shape)
        shape[self.together] *= tp_size
        return (shape[0], shape[1])


@dataclass(kw_only=True)
class LocalPiece:
    """This rank's part of one matrix in one step: a flat range of its local tensor."""

    param: torch.Tensor
    """Flat (1-D) parameter elements ``[lo, hi)``, updated in place."""
    grad: torch.Tensor
    """Their gradient, same shape."""
    lr: float
    """Learning rate of the step."""
    weight_decay: float
    """Decoupled weight decay of the step."""


@dataclass(frozen=True, kw_only=True)
class StepFactors:
    """What one step knows of the raw gradients gathered before it (:meth:`HostGroupEngine.prestart`)."""

    scale: tuple[float | torch.Tensor, ...] = ()
    """The factors, in order, that turned those raw gradients into the step's (the loss scale's
    inverse, the clip's factor): each received raw piece is multiplied by them."""
    commit_early: bool = False
    """The groups computed before the step had every factor (no clip acted): their directions
    are the step's own."""


@dataclass
class StepStats:
    """What one :meth:`HostGroupEngine.step` did on this rank."""

    computed: list[str] = field(default_factory=list)
    """Tasks whose full update this rank computed."""
    early: int = 0
    """Micro-groups whose directions were computed before the step and used (committed)."""
    recomputed: int = 0
    """Micro-groups computed before the step whose results the step discarded and computed again."""
    regathered: int = 0
    """Micro-groups gathered speculatively before the step that the step gathered again (a clip acted)."""
    bytes_sent: int = 0
    """Bytes sent to other ranks (real elements only)."""
    timeline: list[tuple[str, int, float, float]] = field(default_factory=list)
    """``(stage, group, start, end)`` in ``time.perf_counter`` seconds on the host; gather and
    scatter spans run from issuing the collective to the end of waiting for it. On CUDA,
    kernels run asynchronously: these are launch times unless the caller synchronizes."""


@dataclass(frozen=True)
class _Copy:
    """How a flat piece maps into the full matrix: per box, the view of the piece and the
    slices of the full matrix."""

    boxes: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[slice, ...]], ...]
    placement: Placement

    def into_full(self, flat: torch.Tensor, full: torch.Tensor) -> None:
        for offset, size, where in self.boxes:
            full[where].copy_(_local_view(flat, self.placement, (offset, size)))

    def from_full(self, full: torch.Tensor, flat: torch.Tensor) -> None:
        for offset, size, where in self.boxes:
            _local_view(flat, self.placement, (offset, size)).copy_(full[where])


def _copy_plan(task: MatrixTask, tp_rank: int, lo: int, hi: int, tp_size: int) -> _Copy:
    placement = Placement(
        local_shape=task.local_shape, flat_start=lo, flat_end=hi, tp_dim=task.tp_dim,
        tp_stride=task.stride if task.tp_dim is not None else 1, tp_rank=tp_rank if task.tp_dim is not None else 0,
        tp_size=tp_size if task.tp_dim is not None else 1,
    )
    boxes = []
    for box in flat_range_boxes(task.local_shape, lo, hi):
        for (offset, size), (global_offset, _) in to_global_boxes(box, placement):
            where = tuple(slice(o, o + s) for o, s in zip(global_offset, size))
            boxes.append((offset, size, where))
    return _Copy(tuple(boxes), placement)


@dataclass(frozen=True)
class _Segment:
    """One piece in a fused all-to-all buffer."""

    task: MatrixTask
    holder: Coord
    lo: int
    hi: int
    offset: int
    """Element offset in the buffer."""


@dataclass
class _Exchange:
    """One micro-group's all-to-all layout on this rank: what it sends and receives, by peer."""

    index: int
    tasks: tuple[MatrixTask, ...]
    computed: tuple[tuple[MatrixTask, ...], ...]
    """The batches this rank computes: its hosted tasks (async), or, in sync mode, per host
    the tasks of that host it holds a piece of."""
    outgoing: list[_Segment] = field(default_factory=list)
    """My pieces, to the ranks that compute them (scatter: their updates come back here)."""
    incoming: list[_Segment] = field(default_factory=list)
    """Other ranks' pieces of what I compute (scatter: their updates go back there)."""
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    moves: bool = False
    """Whether any rank of the group exchanges anything in this micro-group."""
    narrow: bool = False
    """Whether a task of the group scatters its direction in a narrow dtype: the scatter then
    runs on bytes (:class:`_ByteLayout`)."""
    normalized: dict[str, int] = field(default_factory=dict)
    """The tasks of the group gathered narrow (:attr:`MatrixTask.gather_dtype`), by key, with
    their index in the group's vector of norms; the gather then runs on bytes."""
    floor: float = 0.0
    """Their :attr:`MatrixTask.gather_floor` (one value: the optimizer's)."""


@dataclass(frozen=True)
class _ByteLayout:
    """Byte offsets of an all-to-all's segments when some are narrow: each segment takes its
    elements at its own dtype's size, rounded up to the update dtype's size (so the fp32
    segments stay aligned). The gather sends ``outgoing`` and receives ``incoming``; the scatter
    the reverse."""

    outgoing: tuple[int, ...]
    """Byte offset of each of the exchange's ``outgoing`` segments (this rank's pieces)."""
    incoming: tuple[int, ...]
    """Byte offset of each ``incoming`` segment (other ranks' pieces of what this rank computes)."""
    outgoing_splits: list[int]
    """Bytes per peer of the outgoing segments (by each piece's host)."""
    incoming_splits: list[int]
    """Bytes per peer of the incoming segments (by each piece's holder)."""


@dataclass
class _InFlight:
    """An issued all-to-all: the handle and the buffers it must keep alive."""

    work: dist.Work | None
    send: torch.Tensor
    recv: torch.Tensor
    issued: float
    sent: int = 0
    """Bytes not yet counted in a step's stats (a gather issued before the step)."""
    waited: bool = False
    scaled: int = 0
    """How many of the step's scale factors :meth:`HostGroupEngine.precompute` applied to
    ``recv`` already (a prefix: the loss scale's inverse)."""
    speculative: bool = False
    """Gathered before the step from what the holders' pieces become when no clip acts
    (:meth:`HostGroupEngine.prestart`'s ``speculative``): the step's own only then."""
    norms: torch.Tensor | None = None
    """The Frobenius norms of the group's narrow-gathered matrices (:attr:`_Exchange.normalized`),
    which divided the pieces sent: the host divides its own by them too."""


@dataclass
class _Early:
    """A micro-group computed before the step (:meth:`HostGroupEngine.precompute`)."""

    directions: dict[str, torch.Tensor]
    """The full directions of the matrices this rank computes, by task key."""
    done: torch.cuda.Event | None = None
    """Recorded on the stream that computed them (CUDA)."""


def all_reduce_over(group: object) -> Callable[..., None]:
    """An in-place all-reduce over ``group``: ``reduce(tensor)`` or ``reduce(tensor, "sum")`` sums,
    ``reduce(tensor, "max")`` takes the maximum (the exact norm's
    :data:`~megatron.canzona.optim.exact_norm.Reduce`, and a sharded Newton-Schulz's all-reduce)."""
    def reduce(tensor: torch.Tensor, op: str = "sum") -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return reduce


def _checked(directions: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A host compute callback's directions, checked: one of each gradient's shape."""
    out = list(directions)
    if len(out) != len(grads) or any(d.shape != g.shape for d, g in zip(out, grads)):
        raise RuntimeError("the host compute callback must return one full-shape direction per gradient")
    return out


def _bytes(buffer: torch.Tensor, size: int) -> torch.Tensor:
    """The first ``size`` bytes of a 1-D buffer, as uint8."""
    return buffer.view(torch.uint8)[:size]


def direction_elements(numel: int, dtype: torch.dtype | None) -> int:
    """fp32 elements (4 bytes each) of a direction of ``numel`` elements kept in ``dtype``
    (``None``: fp32)."""
    return numel if dtype is None else fp32_elements(numel, dtype.itemsize)


def _scale_gathered(exchange: _Exchange, inflight: _InFlight, scale: Sequence[float | torch.Tensor]) -> None:
    """Multiply a gather's received pieces by the step's factors ``scale`` that their holders did
    not apply. A narrow gather carries Muon's input, made by the holders with every factor known,
    so none may remain."""
    if exchange.normalized and scale:
        raise RuntimeError(f"micro-group {exchange.index}: a narrow gather carries pieces already scaled; "
                           f"{len(scale)} factor(s) of the step remain")
    for factor in scale:
        inflight.recv.mul_(factor)
    inflight.scaled += len(scale)


def _typed(buffer: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of ``dtype`` at byte ``offset`` of a 1-D buffer (or its byte view)."""
    raw = buffer.view(torch.uint8)
    return raw[offset : offset + numel * dtype.itemsize].view(dtype)


class _SideStream:
    """Runs host compute on a side CUDA stream, ordered by events; does nothing on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def compute(self, inputs: Sequence[torch.Tensor]) -> Iterator[None]:
        """Run the body on the side stream after the main stream's pending work on ``inputs``."""
        if self.stream is None or not inputs:
            yield
            return
        main = torch.cuda.current_stream(inputs[0].device)
        self.stream.wait_stream(main)  # the gathered gradients were waited for on main
        for tensor in inputs:
            tensor.record_stream(self.stream)  # allocated on main, read on the side stream
        with torch.cuda.stream(self.stream):
            yield

    def hand_back(self, outputs: Sequence[torch.Tensor]) -> None:
        """Make the main stream wait for the side stream's work producing ``outputs``."""
        if self.stream is None or not outputs:
            return
        done = torch.cuda.Event()
        done.record(self.stream)
        main = torch.cuda.current_stream(outputs[0].device)
        main.wait_event(done)
        for tensor in outputs:
            tensor.record_stream(main)  # allocated on the side stream, consumed on main


class HostGroupEngine:
    """Gather, host compute, scatter and apply of every matrix, per micro-group.

    Every rank of ``group`` builds the engine from the same ``tasks`` (checked once, at
    construction: a collective) and calls :meth:`step` together. ``rank_of`` maps a
    ``(dp_rank, tp_rank)`` to its rank in ``group``.
    """

    def __init__(
        self, tasks: Sequence[MatrixTask], *, group: dist.ProcessGroup | None, rank_of: Mapping[Coord, int],
        coord: Coord, tp_size: int, mode: Mode = "async",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"host-group mode must be one of {MODES}, got {mode!r}")
        self.group, self.rank_of, self.coord, self.tp_size, self.mode = group, dict(rank_of), coord, tp_size, mode
        self.tasks = tuple(tasks)
        self._task_of = {t.key: t for t in self.tasks}
        keys = [t.key for t in self.tasks]
        if len(set(keys)) != len(keys):
            raise ValueError("every task must appear once in the engine's schedule")
        for task in self.tasks:
            for holder, _, _ in task.holders(tp_size) + [(task.host, 0, 0)]:
                if holder not in self.rank_of:
                    raise ValueError(f"{task.key}: rank {holder} (dp, tp) is not in the group; re-plan for this layout")
        self._mine: dict[str, list[tuple[int, int]]] = {}
        for task in self.tasks:
            held = [(lo, hi) for holder, lo, hi in task.holders(tp_size) if holder == coord]
            if held:
                self._mine[task.key] = held
        self._copies: dict[tuple[str, Coord, int], _Copy] = {}
        indices = sorted({t.group for t in self.tasks})
        self.exchanges = tuple(self._exchange(k, [t for t in self.tasks if t.group == k]) for k in indices)
        self._check_same_schedule()
        if mode == "sync" and any(t.update_dtype is not None for t in self.tasks):
            raise ValueError("sync mode computes every matrix on every holder: no task scatters a narrow direction")
        self._side: _SideStream | None = None
        self._layouts: dict[tuple[int, int, str], _ByteLayout] = {}
        self._staged: dict[int, _InFlight | None] = {}
        self._early: dict[int, _Early] = {}
        self._prenormed: dict[int, dict[str, torch.Tensor]] = {}
        """Norms :meth:`prenorm` took ahead of their group's gather, by group and task key."""
        self.norms_ahead = 0
        """Matrices whose norm :meth:`prenorm` took, so far (for tests and logs)."""
        self.norms_at_gather = 0
        """Matrices whose norm their gather took itself, so far."""
        self.last_stats = StepStats()

    # Static layout -----------------------------------------------------------------------
    def computes(self, task: MatrixTask) -> bool:
        """Whether this rank computes (and keeps optimizer state for) ``task``."""
        if self.mode == "async":
            return task.host == self.coord
        return task.key in self._mine

    def writes(self, task: MatrixTask) -> bool:
        """Whether this rank is the one that checkpoints ``task``'s state: its host, or in
        sync mode its first holder (every holder keeps a copy)."""
        if self.mode == "async":
            return task.host == self.coord
        return task.holders(self.tp_size)[0][0] == self.coord

    def holds(self, task: MatrixTask) -> list[tuple[int, int]]:
        """The ``(lo, hi)`` ranges of ``task`` this rank holds."""
        return self._mine.get(task.key, [])

    def _exchange(self, index: int, tasks: list[MatrixTask]) -> _Exchange:
        """This rank's all-to-all layout of one micro-group: segments by peer, in task order."""
        size = len(self.rank_of)
        outgoing: list[list[tuple[MatrixTask, Coord, int, int]]] = [[] for _ in range(size)]
        incoming: list[list[tuple[MatrixTask, Coord, int, int]]] = [[] for _ in range(size)]
        moves = False
        for task in tasks:
            holders = task.holders(self.tp_size)
            moves = moves or (len(holders) > 1 if self.mode == "sync" else any(h != task.host for h, _, _ in holders))
            for holder, computer, lo, hi in self._my_moves(task, holders):
                if holder == self.coord:
                    outgoing[self.rank_of[computer]].append((task, holder, lo, hi))
                else:
                    incoming[self.rank_of[holder]].append((task, holder, lo, hi))
            if self.computes(task) and not task.is_local():  # every piece goes in and out of the full matrix
                for holder, lo, hi in holders:
                    self._copies[(task.key, holder, lo)] = _copy_plan(task, holder[1], lo, hi, self.tp_size)
        normalized = [t for t in tasks if t.gather_dtype is not None and not t.is_local()]
        floors = {t.gather_floor for t in normalized}
        if len(floors) > 1:
            raise ValueError(f"micro-group {index}: its narrow gathers' norm floors differ ({sorted(floors)}); "
                             "one optimizer's tasks share one")
        exchange = _Exchange(index, tuple(tasks), self._batches(tasks), moves=moves,
                             narrow=moves and any(t.update_dtype is not None for t in tasks),
                             normalized={t.key: i for i, t in enumerate(normalized)},
                             floor=floors.pop() if floors else 0.0)
        for segments, by_peer, splits in ((exchange.outgoing, outgoing, exchange.send_splits),
                                          (exchange.incoming, incoming, exchange.recv_splits)):
            offset = 0
            for peer_items in by_peer:
                start = offset
                for task, holder, lo, hi in peer_items:
                    segments.append(_Segment(task, holder, lo, hi, offset))
                    offset += hi - lo
                splits.append(offset - start)
        return exchange

    def _my_moves(self, task: MatrixTask, holders: list[tuple[Coord, int, int]]) -> Iterator[tuple[Coord, Coord, int, int]]:
        """``(holder, computer, lo, hi)`` for every piece that this rank sends or receives: from
        the rank holding it to a rank computing the matrix (the host; in sync mode every
        holder)."""
        if self.mode == "async":
            for holder, lo, hi in holders:
                if holder != task.host and self.coord in (holder, task.host):
                    yield holder, task.host, lo, hi
            return
        if task.key not in self._mine:
            return
        for holder, lo, hi in holders:
            if holder != self.coord:
                yield holder, self.coord, lo, hi
                continue
            for other, _, _ in holders:
                if other != self.coord:
                    yield holder, other, lo, hi

    def temporaries(self) -> tuple[int, int]:
        """Elements of (the largest single buffer, the most buffers alive at once) one step
        allocates: the all-to-all buffers (the scatter reuses the gather's), and the full
        gradient (a narrow gather's in its dtype: that many bytes) and direction of every
        gathered matrix this rank computes (a group's, with the next group's gather issued)."""
        sizes = []
        largest = 0
        for exchange in self.exchanges:
            tasks = [task for batch in exchange.computed for task in batch if not task.is_local()]
            full_numel = [math.prod(task.full_shape(self.tp_size)) for task in tasks]
            gathered = sum(direction_elements(n, t.gather_dtype) for n, t in zip(full_numel, tasks))
            send, recv = sum(exchange.send_splits), sum(exchange.recv_splits)
            largest = max([largest, send, recv, *full_numel])
            sizes.append((send + recv, send + recv + gathered + sum(full_numel)))
        step = 0
        for k, (_, alive) in enumerate(sizes):
            step = max(step, alive + (sizes[k + 1][0] if k + 1 < len(sizes) else 0))
        return largest, step

    def early_temporaries(self) -> int:
        """Elements of every micro-group's gather buffers (send and receive): alive at once,
        from the buckets' reductions to the step, when :meth:`prestart` issues them all."""
        return sum(sum(e.send_splits) + sum(e.recv_splits) for e in self.exchanges if e.moves)

    def early_directions(self, groups: Collection[int]) -> int:
        """The full direction of every matrix this rank computes in micro-groups ``groups``,
        in fp32 elements (a narrow one, kept in its update dtype, counts that many bytes):
        alive at once, from their computation to the step, when :meth:`precompute` computes
        them."""
        return sum(direction_elements(math.prod(task.full_shape(self.tp_size)), task.update_dtype)
                   for e in self.exchanges if e.index in groups for batch in e.computed for task in batch)

    def compute_batches(self) -> list[tuple[str, ...]]:
        """The task keys of each host-compute callback this rank makes per step, in order."""
        return [tuple(t.key for t in batch) for exchange in self.exchanges for batch in exchange.computed]

    def _batches(self, tasks: list[MatrixTask]) -> tuple[tuple[MatrixTask, ...], ...]:
        if self.mode == "async":
            mine = tuple(t for t in tasks if t.host == self.coord)
            return (mine,) if mine else ()
        by_host: dict[Coord, list[MatrixTask]] = {}
        for task in tasks:
            if self.computes(task):
                by_host.setdefault(task.host, []).append(task)
        return tuple(tuple(batch) for _, batch in sorted(by_host.items()))

    def _check_same_schedule(self) -> None:
        digest = hashlib.sha256(repr((self.tasks, sorted(self.rank_of.items()), self.mode)).encode()).hexdigest()
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return
        seen: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(seen, digest, group=self.group)
        if len(set(seen)) != 1:
            raise RuntimeError("ranks built different Canzona host-group schedules; every rank must use the same plan")

    # Gathers issued before the step -----------------------------------------------------
    @torch.no_grad()
    def prenorm(self, index: int, keys: Collection[str], piece: Callable[[str, int], torch.Tensor],
                device: torch.device) -> None:
        """Take now the norms of micro-group ``index``'s narrow-gathered tasks among ``keys``, from
        this rank's pieces ``piece(key, lo)`` (those its gather will send: :meth:`prestart`'s), so
        that the gather divides by them without taking them itself: the same bits (each matrix's
        norm is its own). A collective: every rank of the group calls it with the same ``keys``
        in the same order (a bucket's matrices, as it reduces); two all-reduces of a few bytes per
        matrix, nothing when none of ``keys`` is gathered narrow."""
        exchange = self.exchanges[index]
        done = self._prenormed.setdefault(index, {})
        wanted = [key for key in exchange.normalized if key in keys and key not in done]
        if wanted:
            norms = self._norms_of(wanted, exchange.floor, piece, device)
            done.update((key, norms[i : i + 1]) for i, key in enumerate(wanted))
            self.norms_ahead += len(wanted)

    def _norms_of(self, keys: Sequence[str], floor: float, piece: Callable[[str, int], torch.Tensor],
                  device: torch.device) -> torch.Tensor:
        """The Frobenius norm of each matrix of ``keys``, floored, the same bits as one device's
        :func:`~megatron.canzona.optim.exact_norm.frobenius_norm` of the whole matrix
        (:func:`~megatron.canzona.optim.exact_norm.norms_of_pieces`): each rank's largest magnitude
        of its pieces, their maximum over the group, then each rank's pieces' squares summed in
        integers, summed over the group (int64: any order, the same total). Two all-reduces of a few
        bytes per matrix; on CUDA, stream-ordered: no host synchronisation."""
        shared = dist.is_initialized() and dist.get_world_size(self.group) > 1
        mine = ((index, piece(key, lo)) for index, key in enumerate(keys) for lo, _ in self._mine.get(key, ()))
        return norms_of_pieces(mine, len(keys), floor, device=device,
                               reduce=all_reduce_over(self.group) if shared else None)

    @torch.no_grad()
    def prestart(self, index: int, raw: Mapping[tuple[str, int], torch.Tensor], *, speculative: bool = False,
                 scaled: int = 0) -> None:
        """Issue micro-group ``index``'s gather now, before the step, from the raw gradient
        pieces ``raw`` (``(task key, lo)`` -> flat tensor of the gradient buffer's dtype, as
        reduced; clipping and loss scaling not yet applied). The host applies them to what it
        receives (:meth:`step`'s ``scale``), which equals the holders applying them first, bit
        for bit: a gather only copies, and an fp32 cast and a product are the same wherever
        they run. Every rank of the group must prestart the same micro-groups in the same order
        (a collective); :meth:`drop_staged` discards them (a skipped step).

        ``speculative``: ``raw`` are not the raw gradients but what the holders' pieces become
        at the step if no clip acts, made from them with the first ``scaled`` of its factors
        (Muon's source where the holders keep its momentum: ``CanzonaOptimizer.speculative_sources``):
        the step uses them only then, and otherwise gathers again from its own pieces."""
        if self.mode != "async":
            raise ValueError("only the async mode gathers to hosts before the step")
        if index in self._staged:
            raise ValueError(f"micro-group {index} is already gathering")
        exchange = self.exchanges[index]
        if not exchange.moves:
            self._staged[index] = None
            return
        first = next(iter(raw.values())) if raw else torch.empty(0)
        dtype = torch.float64 if first.dtype == torch.float64 else torch.float32  # the main gradients' dtype
        inflight = self._gather(None, exchange, lambda key, lo: raw[(key, lo)], dtype, first.device)
        inflight.speculative, inflight.scaled = speculative, scaled
        self._staged[index] = inflight

    @torch.no_grad()
    def precompute(self, index: int, raw: Mapping[tuple[str, int], torch.Tensor], compute: HostCompute,
                   scale: Sequence[float | torch.Tensor] = ()) -> None:
        """Compute micro-group ``index``'s directions now, before the step, from the gather
        :meth:`prestart` issued and this rank's own ``raw`` pieces, each multiplied by ``scale``
        (the loss scale's inverse: the first of the step's factors, known before it). ``compute``
        must leave the optimizer state as it was (a staged update). The step uses them when it
        is told its factors end there (:meth:`step`'s ``commit_early``: the clip did not bind),
        else computes the group again from the same gather with the remaining factors. A narrow
        task's direction (unscaled, exact in its update dtype: :func:`~.optimizer.narrow_updates`)
        is kept in that dtype until the step scatters or applies it, half the bytes of fp32 in bf16.

        On CUDA the caller runs this on a side stream: the gather's wait is a stream wait, and
        an event marks the end of the work for the step to wait on. No host synchronisation."""
        if index not in self._staged:
            raise ValueError(f"micro-group {index} was not gathered early (prestart it first)")
        if index in self._early:
            raise ValueError(f"micro-group {index} is already computed")
        exchange, inflight = self.exchanges[index], self._staged[index]
        dtype = state_dtype_for(next(iter(raw.values())).dtype) if raw else torch.float32
        device = next(iter(raw.values())).device if raw else torch.device("cpu")
        if inflight is not None:
            if inflight.work is not None:
                inflight.work.wait()  # CUDA: the current (side) stream waits, not the host
                inflight.work = None
            if inflight.recv.is_cuda:  # issued on another stream, read on this one
                current = torch.cuda.current_stream(inflight.recv.device)
                inflight.recv.record_stream(current)
                inflight.send.record_stream(current)
            _scale_gathered(exchange, inflight, scale)

        def own(key: str, lo: int) -> torch.Tensor:
            piece = raw[(key, lo)]
            if not scale:
                return piece if piece.dtype == dtype else piece.to(dtype)
            piece = piece.to(dtype, copy=True)
            for factor in scale:
                piece.mul_(factor)
            return piece

        full = self._full_grads(exchange, inflight, own, dtype, device)
        directions: dict[str, torch.Tensor] = {}
        for batch in exchange.computed:
            out = _checked(compute([t.key for t in batch], [full[t.key] for t in batch]), [full[t.key] for t in batch])
            # a narrow direction (unscaled, its values the Newton-Schulz dtype's) kept in that dtype
            directions.update((t.key, d.to(t.update_dtype or dtype)) for t, d in zip(batch, out))
        done = None
        if device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self._early[index] = _Early(directions, done)

    def drop_staged(self) -> None:
        """Discard every gather issued by :meth:`prestart` and every group :meth:`precompute`
        computed (their collectives complete first)."""
        for inflight in self._staged.values():
            if inflight is not None and inflight.work is not None:
                inflight.work.wait()
        self._staged.clear()
        self._early.clear()
        self._prenormed.clear()

    @property
    def staged(self) -> tuple[int, ...]:
        """Micro-groups whose gather :meth:`prestart` issued for the coming step."""
        return tuple(self._staged)

    @property
    def precomputed(self) -> tuple[int, ...]:
        """Micro-groups :meth:`precompute` computed for the coming step."""
        return tuple(self._early)

    # One step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, pieces: Mapping[tuple[str, int], LocalPiece], compute: HostCompute,
             factors: StepFactors | None = None,
             replay: Callable[[Sequence[str], Sequence[torch.Tensor]], None] | None = None) -> StepStats:
        """Update every task; ``pieces`` maps ``(task key, lo)`` to this rank's piece of it.
        ``factors`` (:class:`StepFactors`): what turned the raw gradients given to
        :meth:`prestart` into ``pieces``' gradients, and whether the groups :meth:`precompute`
        computed are this step's; else they are computed again here, with ``compute``. ``replay``: called per
        batch of a committed group with its full gradients, rebuilt from the same gather (an
        optimizer that advances its state at the commit). What the step needs lives in one
        :class:`_StepRun` made here; the engine keeps only what outlives a step."""
        missing = [(key, lo) for key, held in self._mine.items() for lo, _ in held if (key, lo) not in pieces]
        if missing:
            raise ValueError(f"no local piece given for {missing[:3]}; every rank must step every piece it holds")
        if self._staged and self.mode != "async":
            raise ValueError("only the async mode gathers to hosts before the step")
        grad = next(iter(pieces.values())).grad if pieces else None
        device = grad.device if grad is not None else torch.device("cpu")
        if self._side is None:
            self._side = _SideStream(device)
        run = _StepRun(self, pieces=pieces, compute=compute, factors=factors or StepFactors(), replay=replay,
                       device=device, update_dtype=state_dtype_for(grad.dtype if grad is not None else torch.float32))
        try:
            if self.exchanges:
                (run.run_async if self.mode == "async" else run.run_sync)()
        finally:
            self._staged.clear()
            self._early.clear()
            self._prenormed.clear()
        self.last_stats = run.stats
        return run.stats

    # Helpers -----------------------------------------------------------------------------
    def _full_grads(self, exchange: _Exchange, inflight: _InFlight | None, own: Callable[[str, int], torch.Tensor],
                    dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """The full gradient of every matrix this rank computes, from the gather's ``recv`` and
        this rank's pieces ``own(key, lo)`` (a local matrix's is used as it is)."""
        full: dict[str, torch.Tensor] = {}
        for batch in exchange.computed:
            for task in batch:
                if task.is_local():  # the host's own piece is the whole matrix
                    full[task.key] = own(task.key, 0).view(task.local_shape)
                    continue
                full[task.key] = torch.empty(task.full_shape(self.tp_size), dtype=task.gather_dtype or dtype,
                                             device=device)
        if exchange.normalized:
            assert inflight is not None and inflight.norms is not None
            norms = inflight.norms
            layout = self._layout(exchange, dtype, "gather")
            for seg, offset in zip(exchange.incoming, layout.incoming):
                source = _typed(inflight.recv, offset, seg.hi - seg.lo, seg.task.gather_dtype or dtype)
                self._copies[(seg.task.key, seg.holder, seg.lo)].into_full(source, full[seg.task.key])
        else:
            for seg in exchange.incoming:
                source = inflight.recv[seg.offset : seg.offset + seg.hi - seg.lo]  # type: ignore[union-attr]
                self._copies[(seg.task.key, seg.holder, seg.lo)].into_full(source, full[seg.task.key])
        for batch in exchange.computed:
            for task in batch:
                if task.is_local():
                    continue
                for lo, _ in self.holds(task):
                    piece = own(task.key, lo)
                    if task.key in exchange.normalized:  # as its holders sent theirs (the cast in the copy)
                        piece = piece.to(torch.float32) / norms[exchange.normalized[task.key]]
                    self._copies[(task.key, self.coord, lo)].into_full(piece, full[task.key])
        return full

    def _gather(self, stats: StepStats | None, exchange: _Exchange, piece: Callable[[str, int], torch.Tensor],
                dtype: torch.dtype, device: torch.device) -> _InFlight:
        """Pack this rank's pieces (``piece(key, lo)``) by destination and issue the group's
        gather; a narrow-gathered task's divided by its matrix's norm (:meth:`_norms`) and cast."""
        send = torch.empty(sum(exchange.send_splits), dtype=dtype, device=device)
        if not exchange.normalized:
            for seg in exchange.outgoing:
                send[seg.offset : seg.offset + seg.hi - seg.lo].copy_(piece(seg.task.key, seg.lo))
            return self._all_to_all(stats, send, exchange.recv_splits, exchange.send_splits)
        norms = self._norms(exchange, piece, device)
        layout = self._layout(exchange, dtype, "gather")
        for seg, offset in zip(exchange.outgoing, layout.outgoing):
            target = _typed(send, offset, seg.hi - seg.lo, seg.task.gather_dtype or dtype)
            value = piece(seg.task.key, seg.lo)
            if seg.task.key in exchange.normalized:  # divided in fp32, rounded as it is written (no temporary)
                torch.div(value.to(torch.float32), norms[exchange.normalized[seg.task.key]], out=target)
            else:
                target.copy_(value)
        recv = torch.empty(sum(exchange.recv_splits), dtype=dtype, device=device)  # the scatter reuses it whole
        inflight = self._all_to_all(stats, _bytes(send, sum(layout.outgoing_splits)), layout.incoming_splits,
                                    layout.outgoing_splits, recv=_bytes(recv, sum(layout.incoming_splits)))
        inflight.norms = norms
        return inflight

    def _norms(self, exchange: _Exchange, piece: Callable[[str, int], torch.Tensor],
               device: torch.device) -> torch.Tensor:
        """The norm of each narrow-gathered matrix of the group (:meth:`_norms_of`), in the order
        of :attr:`_Exchange.normalized`: those :meth:`prenorm` took, the rest taken now."""
        done = self._prenormed.pop(exchange.index, {})
        missing = [key for key in exchange.normalized if key not in done]
        self.norms_at_gather += len(missing)
        if len(missing) == len(exchange.normalized):
            return self._norms_of(missing, exchange.floor, piece, device)
        if missing:
            norms = self._norms_of(missing, exchange.floor, piece, device)
            done.update((key, norms[i : i + 1]) for i, key in enumerate(missing))
        return torch.cat([done[key] for key in exchange.normalized])

    def _layout(self, exchange: _Exchange, update_dtype: torch.dtype, stage: str) -> _ByteLayout:
        """The byte layout of a narrow exchange's ``gather`` (each segment in its task's
        :attr:`~MatrixTask.gather_dtype`) or ``scatter`` (in its
        :attr:`~MatrixTask.update_dtype`), at this step's update dtype (made once per exchange,
        dtype and stage). Segments keep the element layout's order, grouped by peer."""
        itemsize = update_dtype.itemsize
        key = (exchange.index, itemsize, stage)
        if key not in self._layouts:
            def place(segments: list[_Segment], peer_of: Callable[[_Segment], Coord]) -> tuple[tuple[int, ...], list[int]]:
                offsets, splits, offset = [], [0] * len(self.rank_of), 0
                for seg in segments:
                    narrow = seg.task.gather_dtype if stage == "gather" else seg.task.update_dtype
                    size = (seg.hi - seg.lo) * (narrow or update_dtype).itemsize
                    size = -(-size // itemsize) * itemsize
                    offsets.append(offset)
                    splits[self.rank_of[peer_of(seg)]] += size
                    offset += size
                return tuple(offsets), splits
            outgoing, outgoing_splits = place(exchange.outgoing, lambda seg: seg.task.host)  # mine, to (from) the host
            incoming, incoming_splits = place(exchange.incoming, lambda seg: seg.holder)  # theirs, from (to) each holder
            self._layouts[key] = _ByteLayout(outgoing, incoming, outgoing_splits, incoming_splits)
        return self._layouts[key]

    def _all_to_all(
        self, stats: StepStats | None, send: torch.Tensor, recv_splits: list[int], send_splits: list[int],
        recv: torch.Tensor | None = None,
    ) -> _InFlight:
        """Issue one all-to-all; its bytes count in ``stats`` (``None``: a gather issued before a
        step, counted by the step that waits for it)."""
        if recv is None:
            recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
        work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group, async_op=True)
        sent = (send.numel() - send_splits[self.rank_of[self.coord]]) * send.element_size()
        if stats is not None:
            stats.bytes_sent += sent
        return _InFlight(work, send, recv, time.perf_counter(), sent=0 if stats is not None else sent)


class _StepRun:
    """One :meth:`HostGroupEngine.step`: its inputs and what it records, and its stages
    (gather, compute, scatter, apply) in the order :meth:`run_async` gives them. Made per step,
    so the engine keeps no per-call state."""

    def __init__(self, engine: HostGroupEngine, *, pieces: Mapping[tuple[str, int], LocalPiece], compute: HostCompute,
                 factors: StepFactors, replay: Callable[[Sequence[str], Sequence[torch.Tensor]], None] | None,
                 device: torch.device, update_dtype: torch.dtype) -> None:
        self.engine, self.pieces, self.compute, self.factors, self.replay = engine, pieces, compute, factors, replay
        self.device, self.update_dtype = device, update_dtype
        self.stats = StepStats()

    def run_async(self) -> None:
        """The pipeline, in one place: gather k+1 | compute k | scatter k | apply k-1. A
        gather :meth:`prestart` issued is already in flight."""
        next_gather = self._gather_of(0)
        pending: tuple[_Exchange, _InFlight | None, dict[str, torch.Tensor]] | None = None
        for k, exchange in enumerate(self.engine.exchanges):
            gather, staged = next_gather
            if k + 1 < len(self.engine.exchanges):
                next_gather = self._gather_of(k + 1)  # in flight during compute k
            early = self.engine._early.get(k)
            if early is not None:  # computed before the step on a side stream: the main one waits
                if early.done is not None:
                    torch.cuda.current_stream(self.device).wait_event(early.done)
                    for tensor in early.directions.values():
                        tensor.record_stream(torch.cuda.current_stream(self.device))
            if staged and gather is not None:  # raw pieces: scale them as their holders did
                self._wait(gather, "gather", exchange.index)
                if gather.recv.is_cuda:  # allocated on the side stream that issued it, used here from now on
                    current = torch.cuda.current_stream(gather.recv.device)
                    gather.recv.record_stream(current)
                    gather.send.record_stream(current)
                if early is None or not self.factors.commit_early:
                    _scale_gathered(exchange, gather, self.factors.scale[gather.scaled:])
            if early is not None and self.factors.commit_early:
                directions = early.directions
                if self.replay is not None and exchange.computed:  # before the scatter reuses the gather
                    full_grads = self._finish_gather(exchange, gather)
                    for batch in exchange.computed:
                        self.replay([t.key for t in batch], [full_grads[t.key] for t in batch])
                self.stats.computed.extend(t.key for batch in exchange.computed for t in batch)
                self.stats.early += 1
            else:
                self.stats.recomputed += early is not None
                full_grads = self._finish_gather(exchange, gather)
                directions = self._host_compute(exchange, full_grads)
            scatter = self._start_scatter(exchange, directions, gather)  # in flight while group k-1 is applied
            if pending is not None:
                self._apply(*pending)
            pending = (exchange, scatter, directions)
        assert pending is not None
        self._apply(*pending)

    def run_sync(self) -> None:
        """Baseline: every holder gathers every piece of what it holds and computes it."""
        for exchange in self.engine.exchanges:
            full_grads = self._finish_gather(exchange, self._start_gather(exchange))
            directions = self._host_compute(exchange, full_grads)
            self._apply(exchange, None, directions)

    # Stages ------------------------------------------------------------------------------
    def _gather_of(self, index: int) -> tuple[_InFlight | None, bool]:
        """Micro-group ``index``'s gather and whether :meth:`prestart` issued it; a speculative
        one the clip made stale is waited for and issued again now, from the step's pieces."""
        staged = self.engine._staged
        if index in staged:
            inflight = staged[index]
            if inflight is None or not inflight.speculative or self.factors.commit_early:
                return inflight, True
            self._wait(inflight, "gather", index)
            self.stats.regathered += 1
        return self._start_gather(self.engine.exchanges[index]), False

    def _start_gather(self, exchange: _Exchange) -> _InFlight | None:
        """Pack my pieces by destination and issue the gather all-to-all."""
        if not exchange.moves:
            return None
        return self.engine._gather(self.stats, exchange, lambda key, lo: self.pieces[(key, lo)].grad,
                                   self.update_dtype, self.device)

    def _finish_gather(self, exchange: _Exchange, inflight: _InFlight | None) -> dict[str, torch.Tensor]:
        """Wait for the gather; the full gradient of every matrix this rank computes."""
        self._wait(inflight, "gather", exchange.index)
        return self.engine._full_grads(exchange, inflight, lambda key, lo: self.pieces[(key, lo)].grad,
                                       self.update_dtype, self.device)

    def _host_compute(self, exchange: _Exchange, full_grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Directions of the matrices this rank computes, one callback per batch."""
        directions: dict[str, torch.Tensor] = {}
        start = time.perf_counter()
        for batch in exchange.computed:
            grads = [full_grads[t.key] for t in batch]
            assert self.engine._side is not None
            with self.engine._side.compute(grads):
                out = [d.to(self.update_dtype) for d in _checked(self.compute([t.key for t in batch], grads), grads)]
            self.engine._side.hand_back(out)
            directions.update((t.key, d) for t, d in zip(batch, out))
            self.stats.computed.extend(t.key for t in batch)
        if exchange.computed:
            self.stats.timeline.append(("compute", exchange.index, start, time.perf_counter()))
        return directions

    def _start_scatter(
        self, exchange: _Exchange, directions: dict[str, torch.Tensor], gather: _InFlight | None
    ) -> _InFlight | None:
        """Pack every remote piece's slice of the directions and issue the scatter all-to-all.
        The gather's buffers are reused: the scatter sends what the gather received, in the
        same layout, and receives into what the gather sent."""
        if not exchange.moves:
            return None
        assert gather is not None
        send, recv = gather.recv, gather.send
        if exchange.narrow:
            layout = self.engine._layout(exchange, self.update_dtype, "scatter")
            for seg, offset in zip(exchange.incoming, layout.incoming):
                target = _typed(send, offset, seg.hi - seg.lo, seg.task.update_dtype or self.update_dtype)
                self.engine._copies[(seg.task.key, seg.holder, seg.lo)].from_full(directions[seg.task.key], target)
            return self.engine._all_to_all(self.stats, _bytes(send, sum(layout.incoming_splits)),
                                           layout.outgoing_splits, layout.incoming_splits,
                                           recv=_bytes(recv, sum(layout.outgoing_splits)))
        for seg in exchange.incoming:
            target = send[seg.offset : seg.offset + seg.hi - seg.lo]
            self.engine._copies[(seg.task.key, seg.holder, seg.lo)].from_full(directions[seg.task.key], target)
        return self.engine._all_to_all(self.stats, send, exchange.send_splits, exchange.recv_splits, recv=recv)

    def _apply(self, exchange: _Exchange, scatter: _InFlight | None, directions: dict[str, torch.Tensor]) -> None:
        """Apply my slice of every direction: received ones, then those computed here."""
        self._wait(scatter, "scatter", exchange.index)
        start = time.perf_counter()
        if scatter is not None and exchange.narrow:
            layout = self.engine._layout(exchange, self.update_dtype, "scatter")
            for seg, offset in zip(exchange.outgoing, layout.outgoing):
                received = _typed(scatter.recv, offset, seg.hi - seg.lo, seg.task.update_dtype or self.update_dtype)
                self._apply_piece(seg.task.key, seg.lo, received)
        elif scatter is not None:
            for seg in exchange.outgoing:
                self._apply_piece(seg.task.key, seg.lo, scatter.recv[seg.offset : seg.offset + seg.hi - seg.lo])
        for task in (t for batch in exchange.computed for t in batch):
            direction = directions[task.key]
            key = task.key
            if task.is_local():
                self._apply_piece(key, 0, direction.reshape(-1))
                continue
            for lo, hi in self.engine.holds(task):
                flat = torch.empty(hi - lo, dtype=self.update_dtype, device=self.device)
                self.engine._copies[(key, self.engine.coord, lo)].from_full(direction, flat)
                self._apply_piece(key, lo, flat)
        self.stats.timeline.append(("apply", exchange.index, start, time.perf_counter()))

    def _apply_piece(self, key: str, lo: int, update: torch.Tensor) -> None:
        """Apply a slice of ``key``'s direction (a narrow one: scaled first, in the update dtype)."""
        piece = self.pieces[(key, lo)]
        task = self.engine._task_of[key]
        if task.update_dtype is not None:
            update = update.to(self.update_dtype) * task.update_scale
        apply_update(piece.param, update, lr=piece.lr, weight_decay=piece.weight_decay)

    def _wait(self, inflight: _InFlight | None, stage: str, index: int) -> None:
        if inflight is None or inflight.waited:
            return
        if inflight.work is not None:
            inflight.work.wait()
        inflight.waited = True
        self.stats.bytes_sent += inflight.sent  # a gather issued before the step counts in it
        self.stats.timeline.append((stage, index, inflight.issued, time.perf_counter()))
