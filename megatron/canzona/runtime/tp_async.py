"""Canzona tensor parallelism: every TP-sharded matrix is updated once, on its host TP rank.

No tensor-parallel rank holds a whole matrix, yet Muon, Shampoo and SOAP need one. The
planner gives each matrix a *host* TP rank and packs the matrices into micro-groups
(:class:`~megatron.canzona.planning.plan.MicroGroup`); :class:`TPEngine` runs them. Per
micro-group:

1. **gather** -- one fused all-to-all sends every rank's gradient shards to their hosts,
   which reassemble the full matrices (:func:`full_from_shards`);
2. **compute** -- each host computes the full-matrix update directions of the matrices it
   hosts, through a :data:`HostCompute` callback (the single-device optimizer math,
   batched by shape; optimizer state lives only on the host, at full size);
3. **scatter** -- one fused all-to-all returns each rank its slice of every direction;
4. **apply** -- each rank applies its slices: ``p <- p - lr*wd*p - lr*D``.

In ``async`` mode the groups are pipelined (see :meth:`TPEngine._run_async`, the one
place that orders the stages): group k+1's gather is in flight while group k computes, and
group k's scatter while group k-1 is applied. On CUDA the host compute runs on a side
stream ordered by events, so NCCL and compute overlap too. The result equals the
synchronous computation; "async" is about execution, not staleness.

``sync`` mode is the baseline the paper compares against: every rank all-gathers every
matrix and computes every update redundantly, keeping its own slice. It computes the same
batches as the hosts do, so both modes give bit-identical parameters.

Collectives stay equal-sized (gloo rejects uneven all-to-all splits): the chunk a rank
sends to each peer is padded to the largest one in the micro-group, and the padding is
counted in :class:`StepStats`.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from megatron.canzona.optim.common import apply_update, state_dtype_for

TPMode = Literal["async", "sync"]
TP_MODES: tuple[str, ...] = ("async", "sync")

HostCompute = Callable[[Sequence[str], Sequence[torch.Tensor]], Sequence[torch.Tensor]]
"""``(names, full_grads) -> full_directions`` for the matrices one rank computes in one call
(one host's share of a micro-group); same order, same shapes."""


@dataclass(frozen=True, kw_only=True)
class ShardedMatrix:
    """Static facts of one TP-sharded matrix; every rank of the TP group holds the same list."""

    name: str
    """Parameter name; the key of the per-step :class:`MatrixShard` mapping."""
    local_shape: tuple[int, int]
    """Shape of one TP rank's shard."""
    tp_dim: int
    """Dimension split across TP ranks: 0 for column-parallel, 1 for row-parallel layers."""
    host: int
    """TP rank that computes the full-matrix update."""
    group: int
    """Micro-group index; groups run in increasing order."""
    stride: int = 1
    """Blocks per shard along ``tp_dim``: a shard is ``stride`` blocks, block j being the
    TP rank's piece of global block j. 2 for Megatron's fused SwiGLU fc1, whose shard is
    ``[gate_r; up_r]`` of the global ``[gate; up]``; 1 otherwise (a fused QKV shard holds
    whole query groups, so plain concatenation rebuilds the global layout)."""

    def __post_init__(self) -> None:
        if len(self.local_shape) != 2 or min(self.local_shape) < 1:
            raise ValueError(f"{self.name}: local_shape must be a positive 2-D shape, got {self.local_shape}")
        if self.tp_dim not in (0, 1):
            raise ValueError(f"{self.name}: tp_dim must be 0 or 1, got {self.tp_dim}")
        if self.stride < 1 or self.local_shape[self.tp_dim] % self.stride:
            raise ValueError(
                f"{self.name}: stride {self.stride} must divide dim {self.tp_dim} of {self.local_shape}"
            )

    @property
    def numel(self) -> int:
        return self.local_shape[0] * self.local_shape[1]

    def full_shape(self, tp_size: int) -> tuple[int, int]:
        """Shape of the whole matrix the host reassembles."""
        shape = list(self.local_shape)
        shape[self.tp_dim] *= tp_size
        return (shape[0], shape[1])


@dataclass(kw_only=True)
class MatrixShard:
    """This rank's tensors for one matrix in one step."""

    param: torch.Tensor
    """Local 2-D shard of the parameter, updated in place."""
    grad: torch.Tensor
    """Local 2-D shard of its gradient."""
    lr: float
    """Learning rate of the step."""
    weight_decay: float
    """Decoupled weight decay of the step."""


@dataclass
class StepStats:
    """What one :meth:`TPEngine.step` did on this rank."""

    computed: list[str] = field(default_factory=list)
    """Matrices whose full update this rank computed."""
    bytes_sent: int = 0
    """Bytes sent to other ranks of the TP group, padding included."""
    padding_bytes: int = 0
    """Part of ``bytes_sent`` that is padding for equal-sized collectives."""
    timeline: list[tuple[str, int, float, float]] = field(default_factory=list)
    """``(stage, group, start, end)`` in ``time.perf_counter`` seconds on the host; gather and
    scatter spans run from issuing the collective to the end of waiting for it. On CUDA,
    kernels run asynchronously: these are launch times unless the caller synchronizes."""


def full_from_shards(shards: Sequence[torch.Tensor], *, tp_dim: int, stride: int = 1) -> torch.Tensor:
    """The global matrix from every TP rank's shard, in TP rank order."""
    if stride == 1:
        return torch.cat(list(shards), dim=tp_dim)
    blocks = [shard.chunk(stride, dim=tp_dim) for shard in shards]
    return torch.cat([blocks[r][j] for j in range(stride) for r in range(len(shards))], dim=tp_dim)


def shard_of_full(full: torch.Tensor, *, tp_rank: int, tp_size: int, tp_dim: int, stride: int = 1) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of a global matrix (inverse of :func:`full_from_shards`)."""
    if stride == 1:
        return full.chunk(tp_size, dim=tp_dim)[tp_rank]
    blocks = full.chunk(stride, dim=tp_dim)
    return torch.cat([block.chunk(tp_size, dim=tp_dim)[tp_rank] for block in blocks], dim=tp_dim)


@dataclass(frozen=True)
class _GroupLayout:
    """Where each matrix of one micro-group sits in the fused collective buffers."""

    index: int
    by_host: tuple[tuple[ShardedMatrix, ...], ...]
    """Matrices per host TP rank, in plan order; a host's chunk holds them back to back."""
    offsets: Mapping[str, int]
    """Element offset of each matrix inside its host's chunk."""
    chunk_numel: int
    """Elements per peer in the all-to-alls: the largest host's share (others are padded)."""
    sync_offsets: Mapping[str, int]
    """Element offset of each matrix in a rank's contribution to the sync-mode all-gather."""

    @classmethod
    def build(cls, index: int, matrices: Sequence[ShardedMatrix], tp_size: int) -> _GroupLayout:
        by_host: list[list[ShardedMatrix]] = [[] for _ in range(tp_size)]
        offsets: dict[str, int] = {}
        for matrix in matrices:
            hosted = by_host[matrix.host]
            offsets[matrix.name] = sum(m.numel for m in hosted)
            hosted.append(matrix)
        chunk = max(sum(m.numel for m in hosted) for hosted in by_host)
        flat = [m for hosted in by_host for m in hosted]
        starts = itertools.accumulate((m.numel for m in flat), initial=0)
        sync_offsets = {m.name: start for m, start in zip(flat, starts)}
        return cls(index, tuple(tuple(h) for h in by_host), offsets, chunk, sync_offsets)

    def host_numel(self, host: int) -> int:
        return sum(m.numel for m in self.by_host[host])

    @property
    def in_host_order(self) -> tuple[ShardedMatrix, ...]:
        return tuple(m for hosted in self.by_host for m in hosted)


@dataclass
class _InFlight:
    """An issued all-to-all: the handle and the buffers it must keep alive."""

    work: dist.Work | None
    send: torch.Tensor
    recv: torch.Tensor
    issued: float


class _SideStream:
    """Runs host compute on a side CUDA stream, ordered by events; does nothing on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def compute(self, inputs: Sequence[torch.Tensor]) -> Iterator[None]:
        """Run the body on the side stream after the main stream's pending work on ``inputs``."""
        if self.stream is None:
            yield
            return
        main = torch.cuda.current_stream(inputs[0].device)
        self.stream.wait_stream(main)  # the gathered gradients were waited for on main
        for tensor in inputs:
            tensor.record_stream(self.stream)  # allocated on main, read on the side stream
        with torch.cuda.stream(self.stream):
            yield

    def hand_back(self, outputs: torch.Tensor) -> None:
        """Make the main stream wait for the side stream's work producing ``outputs``."""
        if self.stream is None:
            return
        done = torch.cuda.Event()
        done.record(self.stream)
        main = torch.cuda.current_stream(outputs.device)
        main.wait_event(done)
        outputs.record_stream(main)  # allocated on the side stream, consumed on main


class TPEngine:
    """Gather, host compute, scatter and apply of TP-sharded matrices, per micro-group.

    Every rank of ``tp_group`` must build the engine from the same ``matrices`` (checked
    once, at construction) and call :meth:`step` together.
    """

    def __init__(
        self, matrices: Sequence[ShardedMatrix], *, tp_group: dist.ProcessGroup, mode: TPMode = "async"
    ) -> None:
        if mode not in TP_MODES:
            raise ValueError(f"TP mode must be one of {TP_MODES}, got {mode!r}")
        self.tp_group = tp_group
        self.mode: TPMode = mode
        self.tp_size = dist.get_world_size(tp_group)
        self.tp_rank = dist.get_rank(tp_group)
        self.matrices = tuple(matrices)
        names = [m.name for m in self.matrices]
        if len(set(names)) != len(names):
            raise ValueError("every TP-sharded matrix must appear once in the engine's schedule")
        bad = [m.name for m in self.matrices if not 0 <= m.host < self.tp_size]
        if bad:
            raise ValueError(f"host TP rank out of range [0, {self.tp_size}) for {bad[:3]}; re-plan for this TP size")
        indices = sorted({m.group for m in self.matrices})
        self.groups = tuple(
            _GroupLayout.build(k, [m for m in self.matrices if m.group == k], self.tp_size) for k in indices
        )
        self._check_same_schedule()
        self.last_stats = StepStats()

    def computes(self, matrix: ShardedMatrix) -> bool:
        """Whether this rank computes (and keeps optimizer state for) ``matrix``."""
        return self.mode == "sync" or matrix.host == self.tp_rank

    def _check_same_schedule(self) -> None:
        digest = hashlib.sha256(repr(self.matrices).encode()).hexdigest()
        seen: list[str | None] = [None] * self.tp_size
        dist.all_gather_object(seen, digest, group=self.tp_group)
        if len(set(seen)) != 1:
            raise RuntimeError("TP ranks built different Canzona TP schedules; every TP rank must use the same plan")

    # One step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, shards: Mapping[str, MatrixShard], compute: HostCompute) -> StepStats:
        """Update every matrix of the schedule; ``shards`` maps each name to this rank's tensors."""
        missing = [m.name for m in self.matrices if m.name not in shards]
        if missing:
            raise ValueError(f"no shard given for {missing[:3]}; every TP rank must step every scheduled matrix")
        self._shards = shards
        self._compute = compute
        self._stats = StepStats()
        if self.groups:
            grad = shards[self.matrices[0].name].grad
            self._grad_dtype = grad.dtype
            self._update_dtype = state_dtype_for(grad.dtype)
            self._streams = _SideStream(grad.device)
            (self._run_async if self.mode == "async" else self._run_sync)()
        self.last_stats, stats = self._stats, self._stats
        del self._shards, self._compute
        return stats

    def _run_async(self) -> None:
        """The pipeline, in one place: gather k+1 | compute k | scatter k | apply k-1."""
        next_gather = self._start_gather(self.groups[0])
        pending: tuple[_GroupLayout, _InFlight] | None = None  # group k-1's scatter
        for k, group in enumerate(self.groups):
            gather = next_gather
            if k + 1 < len(self.groups):
                next_gather = self._start_gather(self.groups[k + 1])  # in flight during compute k
            full_grads = self._finish_gather(group, gather)
            send = self._host_compute(group, full_grads)
            scatter = self._start_scatter(group, send)  # in flight while group k-1 is applied
            if pending is not None:
                self._apply_scattered(*pending)
            pending = (group, scatter)
        assert pending is not None
        self._apply_scattered(*pending)

    def _run_sync(self) -> None:
        """Baseline: all-gather each group, compute every host's batch on every rank, apply."""
        for group in self.groups:
            start = time.perf_counter()
            gathered = self._all_gather(group)
            self._stats.timeline.append(("gather", group.index, start, time.perf_counter()))
            for host, hosted in enumerate(group.by_host):
                if not hosted:
                    continue
                full_grads = [self._full_from_rows(gathered, m, group.sync_offsets[m.name]) for m in hosted]
                start = time.perf_counter()
                directions = self._checked_compute(hosted, full_grads)
                self._stats.timeline.append(("compute", group.index, start, time.perf_counter()))
                start = time.perf_counter()
                for matrix, direction in zip(hosted, directions):
                    piece = shard_of_full(direction, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                          tp_dim=matrix.tp_dim, stride=matrix.stride)
                    self._apply(matrix, piece)
                self._stats.timeline.append(("apply", group.index, start, time.perf_counter()))

    # Stages ---------------------------------------------------------------------------
    def _start_gather(self, group: _GroupLayout) -> _InFlight:
        """Pack this rank's gradient shards by host and issue the gather all-to-all."""
        send = self._new_buffer(group, self._grad_dtype)
        for host, hosted in enumerate(group.by_host):
            for matrix in hosted:
                start = group.offsets[matrix.name]
                send[host, start : start + matrix.numel].copy_(self._shards[matrix.name].grad.reshape(-1))
        self._count_padding(group, send, to_host=True)
        return self._all_to_all(send)

    def _finish_gather(self, group: _GroupLayout, inflight: _InFlight) -> list[torch.Tensor]:
        """Wait for the gather; the full gradients of the matrices this rank hosts."""
        self._wait(inflight, "gather", group.index)
        hosted = group.by_host[self.tp_rank]
        return [self._full_from_rows(inflight.recv, m, group.offsets[m.name]) for m in hosted]

    def _host_compute(self, group: _GroupLayout, full_grads: list[torch.Tensor]) -> torch.Tensor:
        """Directions of the hosted matrices, cut per destination rank into a send buffer."""
        hosted = group.by_host[self.tp_rank]
        start = time.perf_counter()
        if not hosted:
            send = self._new_buffer(group, self._update_dtype)
        else:
            with self._streams.compute(full_grads):
                send = self._new_buffer(group, self._update_dtype)
                directions = self._checked_compute(hosted, full_grads)
                for matrix, direction in zip(hosted, directions):
                    offset = group.offsets[matrix.name]
                    for rank in range(self.tp_size):
                        piece = shard_of_full(direction, tp_rank=rank, tp_size=self.tp_size,
                                              tp_dim=matrix.tp_dim, stride=matrix.stride)
                        send[rank, offset : offset + matrix.numel].copy_(piece.reshape(-1))
            self._streams.hand_back(send)
        self._stats.timeline.append(("compute", group.index, start, time.perf_counter()))
        return send

    def _start_scatter(self, group: _GroupLayout, send: torch.Tensor) -> _InFlight:
        self._count_padding(group, send, to_host=False)
        return self._all_to_all(send)

    def _apply_scattered(self, group: _GroupLayout, inflight: _InFlight) -> None:
        """Wait for the scatter and apply every received slice to this rank's shards."""
        self._wait(inflight, "scatter", group.index)
        start = time.perf_counter()
        for host, hosted in enumerate(group.by_host):
            for matrix in hosted:
                offset = group.offsets[matrix.name]
                self._apply(matrix, inflight.recv[host, offset : offset + matrix.numel].view(matrix.local_shape))
        self._stats.timeline.append(("apply", group.index, start, time.perf_counter()))

    # Helpers --------------------------------------------------------------------------
    def _checked_compute(
        self, hosted: Sequence[ShardedMatrix], full_grads: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        directions = list(self._compute([m.name for m in hosted], full_grads))
        if len(directions) != len(hosted) or any(d.shape != g.shape for d, g in zip(directions, full_grads)):
            raise RuntimeError("the host compute callback must return one full-shape direction per gradient")
        self._stats.computed.extend(m.name for m in hosted)
        return [d.to(self._update_dtype) for d in directions]

    def _apply(self, matrix: ShardedMatrix, piece: torch.Tensor) -> None:
        shard = self._shards[matrix.name]
        apply_update(shard.param, piece, lr=shard.lr, weight_decay=shard.weight_decay)

    def _full_from_rows(
        self, rows: torch.Tensor | Sequence[torch.Tensor], matrix: ShardedMatrix, offset: int
    ) -> torch.Tensor:
        """Reassemble ``matrix`` from row r = rank r's contribution, at ``offset`` in each row."""
        shards = [rows[r][offset : offset + matrix.numel].view(matrix.local_shape) for r in range(self.tp_size)]
        return full_from_shards(shards, tp_dim=matrix.tp_dim, stride=matrix.stride)

    def _new_buffer(self, group: _GroupLayout, dtype: torch.dtype) -> torch.Tensor:
        device = self._shards[self.matrices[0].name].grad.device
        return torch.zeros(self.tp_size, group.chunk_numel, dtype=dtype, device=device)

    def _all_to_all(self, send: torch.Tensor) -> _InFlight:
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.tp_group, async_op=True)
        return _InFlight(work, send, recv, time.perf_counter())

    def _wait(self, inflight: _InFlight, stage: str, index: int) -> None:
        if inflight.work is not None:
            inflight.work.wait()
        self._stats.timeline.append((stage, index, inflight.issued, time.perf_counter()))

    def _count_padding(self, group: _GroupLayout, send: torch.Tensor, *, to_host: bool) -> None:
        """Bytes this rank sends to its peers, and how many of them are padding."""
        peers = [r for r in range(self.tp_size) if r != self.tp_rank]
        real = sum(group.host_numel(r) for r in peers) if to_host else len(peers) * group.host_numel(self.tp_rank)
        item = send.element_size()
        self._stats.bytes_sent += len(peers) * group.chunk_numel * item
        self._stats.padding_bytes += (len(peers) * group.chunk_numel - real) * item

    def _all_gather(self, group: _GroupLayout) -> list[torch.Tensor]:
        """Every rank's gradient shards of the group (equal sizes: shards share one shape)."""
        local = torch.cat([self._shards[m.name].grad.reshape(-1) for m in group.in_host_order])
        gathered = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(gathered, local, group=self.tp_group)
        self._stats.bytes_sent += (self.tp_size - 1) * local.numel() * local.element_size()
        return gathered
