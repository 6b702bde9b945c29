"""The schedule of one optimizer step: a plan expanded once into matrix tasks.

A :class:`Task` is one matrix update as every consumer sees it: which DP shards hold its
pieces, on which TP ranks, who computes it (its host, or every holder for synchronous
compute), in which micro-group, and which bucket's reduce-scatter must finish before it
may start. The runtime engine (through the binding, which only attaches local tensor
shapes), the traffic metrics, the memory model, the simulator and the dry run all read
these tasks; nothing else expands a plan into matrices.

Whether a matrix is TP-sharded is the plan's decision (a host's ``tp_rank`` is ``None``
exactly for a matrix every TP rank holds whole); a matrix every TP rank holds whole is one
task per TP rank (its ``column``), each computed on that TP rank of its DP host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .plan import BufferPlan, CanzonaPlan, Placement
from .specs import ParamSpec

Coord = tuple[int, int]
"""``(dp_rank, tp_rank)``."""


@dataclass(frozen=True, kw_only=True)
class Task:
    """One matrix update of a step."""

    key: str
    """Unique name (:func:`task_key`)."""
    name: str
    """Parameter name within its chunk."""
    chunk: int = 0
    """Model chunk holding the parameter."""
    pieces: tuple[tuple[int, int, int], ...]
    """``(dp_rank, lo, hi)``: elements ``[lo, hi)`` of the flattened local (per TP rank)
    tensor sit in ``dp_rank``'s shard; together they cover it once, in order."""
    tp_sharded: bool
    """Whether TP ranks hold different slices (every TP rank holds a piece of the task)."""
    column: int = 0
    """The TP rank whose copy this task is, for a matrix that is not TP-sharded."""
    host: Coord | None
    """The rank computing the update; ``None``: every holder computes it (synchronous)."""
    group: int = 0
    """Micro-group; groups run in increasing order."""
    bucket: int = 0
    """Bucket of the chunk's matrix buffer holding the parameter: the task may start once
    that bucket's gradients are reduced."""
    part: int = 0
    """Which part of its parameter, for one hosted in parts (gate and up)."""
    span: tuple[int, int] | None = None
    """Elements ``[lo, hi)`` of the parameter's flattened local tensor this task covers
    (``pieces`` count from ``lo``); ``None``: the whole parameter."""
    cost: float = 0.0
    """Cost of the update in the plan's cost unit."""
    together: bool = False
    """TP rank ``column``'s shard of a TP-sharded matrix its TP ranks compute together
    (:attr:`~megatron.canzona.planning.plan.Host.together`): its host computes with theirs."""

    def __post_init__(self) -> None:
        cursor = 0
        for _, lo, hi in self.pieces:
            if lo != cursor or hi <= lo:
                raise ValueError(f"{self.key}: pieces must cover the local tensor in order, got {self.pieces}")
            cursor = hi
        if self.host is not None and not self.tp_sharded and self.host[1] != self.column:
            raise ValueError(f"{self.key}: the host of TP rank {self.column}'s copy must be on TP rank {self.column}")

    @property
    def numel(self) -> int:
        """Elements of the local (per TP rank) tensor."""
        return self.pieces[-1][2] if self.pieces else 0

    def holders(self, tp_size: int) -> list[tuple[Coord, int, int]]:
        """``((dp_rank, tp_rank), lo, hi)`` of every piece, in a fixed order (DP shard, then TP rank)."""
        columns = range(tp_size) if self.tp_sharded else (self.column,)
        return [((d, t), lo, hi) for d, lo, hi in self.pieces for t in columns]

    def is_local(self) -> bool:
        """Whether the host holds the whole matrix itself (nothing moves)."""
        return (self.host is not None and not self.tp_sharded and len(self.pieces) == 1
                and self.pieces[0][0] == self.host[0])

    def full_numel(self, tp_size: int) -> int:
        """Elements of the whole matrix its host reassembles."""
        return self.numel * (tp_size if self.tp_sharded else 1)


@dataclass(frozen=True)
class Schedule:
    """Every task of one plan, and the order in which their buckets become ready."""

    tasks: tuple[Task, ...]
    tp_size: int
    dp_size: int

    def by_bucket(self) -> dict[tuple[int, int], list[Task]]:
        """``(chunk, bucket) -> tasks`` whose gradients that bucket's reduce-scatter delivers."""
        out: dict[tuple[int, int], list[Task]] = {}
        for task in self.tasks:
            out.setdefault((task.chunk, task.bucket), []).append(task)
        return out


def task_key(name: str, chunk: int, num_chunks: int, column: int | None = None, part: int | None = None) -> str:
    """Unique task name: the parameter name, with its chunk when there are several, its part
    when it is hosted in parts, and the TP rank for one TP rank's copy of a matrix that is
    not TP-sharded (TP > 1)."""
    key = name if num_chunks == 1 else f"chunk{chunk}.{name}"
    key = key if part is None else f"{key}#part{part}"
    return key if column is None else f"{key}@tp{column}"


def _columns(tp_sharded: bool, tp_size: int) -> list[int | None]:
    """``None`` for a TP-sharded matrix (one task); else one column per TP rank."""
    return [None] if tp_sharded or tp_size == 1 else list(range(tp_size))


def plan_schedule(plan: CanzonaPlan, *, synchronous: bool = False) -> Schedule:
    """The host-group tasks of ``plan`` in its micro-groups (``synchronous``: every holder
    computes, ``--canzona-tp-mode sync``)."""
    tasks = []
    chunks = len(plan.layouts)
    for h in plan.hosts:
        buffer = plan.layouts[h.chunk].matrix
        placement = buffer.placement(h.name)
        sharded = h.tp_rank is not None and plan.tp_size > 1
        pieces = buffer.pieces(placement)
        if h.span is not None:
            pieces = within(pieces, *h.span)
        for column in _columns(sharded, plan.tp_size):
            host = None if synchronous else (h.dp_rank, h.tp_rank if sharded else (column or 0))
            key = task_key(h.name, h.chunk, chunks, column, None if h.span is None else h.part)
            tasks.append(Task(key=key, name=h.name, chunk=h.chunk, pieces=pieces, tp_sharded=sharded,
                              column=column or 0, host=host, group=h.group, bucket=placement.bucket, cost=h.cost,
                              part=h.part, span=h.span, together=h.together))
    return Schedule(tuple(tasks), plan.tp_size, plan.dp_size)


def within(pieces: Sequence[tuple[int, int, int]], lo: int, hi: int) -> tuple[tuple[int, int, int], ...]:
    """``(dp_rank, start, end)`` of the pieces' overlap with ``[lo, hi)``, counted from ``lo``."""
    out = []
    for d, a, b in pieces:
        start, end = max(a, lo), min(b, hi)
        if start < end:
            out.append((d, start - lo, end - lo))
    return tuple(out)


def buffer_schedule(buffers: Sequence[BufferPlan], specs: Sequence[ParamSpec], tp_size: int) -> Schedule:
    """Synchronous compute of every matrix of ``buffers`` (one per chunk) by all its holders:
    the DP layouts without hosts (stock ZeRO-1, Megatron's layer-wise optimizer)."""
    sharded = _sharded(specs)
    tasks = []
    for chunk, buffer in enumerate(buffers):
        for p in buffer.placements:
            tp_sharded = sharded[(chunk, p.name)]
            for column in _columns(tp_sharded, tp_size):
                tasks.append(_task(buffer, p, chunk, len(buffers), tp_sharded, column, None))
    dp_size = len(buffers[0].buckets[0].shard_bounds) - 1 if buffers and buffers[0].buckets else 1
    return Schedule(tuple(tasks), tp_size, dp_size)


def _task(buffer: BufferPlan, p: Placement, chunk: int, chunks: int, tp_sharded: bool, column: int | None,
          host: Coord | None) -> Task:
    return Task(key=task_key(p.name, chunk, chunks, column), name=p.name, chunk=chunk, pieces=buffer.pieces(p),
                tp_sharded=tp_sharded, column=column or 0, host=host, bucket=p.bucket, cost=p.cost)


def _sharded(specs: Sequence[ParamSpec]) -> Mapping[tuple[int, str], bool]:
    return {(s.chunk, s.name): s.tp_sharded for s in specs}
