"""Megatron-FSDP's buffer geometry, restated as pure arithmetic.

Megatron-FSDP (Megatron-Core 0.19.2, ``megatron/core/distributed/fsdp/``) keeps each bucket of
parameters in one flat buffer, cut into ``dp_size`` equal shards; a rank holds its shard of the
weights, main weights and gradients (per sharding strategy). Where every byte of a matrix lies
decides who can host it and what its pieces cost to gather, so the planner, the simulator and
``tools/dry_run.py`` predict it here, and the runtime reads the same geometry from the buffers
Megatron-FSDP built (``canzona_patches/integration/fsdp_geometry.py``), each checked against the
other (``tests/e2e/test_megatron_fsdp.py``).

The rules, in registration order (``named_parameters``):

* **Buckets.** Parameters are grouped by (dtype, expert or not, FSDP unit); a parameter is an
  expert one by its name (``.experts.``, :func:`fsdp_expert`), at any EP size, and its bucket is
  sharded over the expert-data-parallel group where EP > 1 (the data-parallel one at EP 1, where
  the two are the same ranks). Under
  ``optim_grads_params`` each transformer layer is a unit: its parameters of one kind are one
  bucket. Parameters outside a unit (or every parameter, under ``optim`` and ``optim_grads``,
  which have no units) share a group per kind, closed into buckets of at least the suggested
  bucket size (``--ddp-bucket-size``), in order.
* **Rows.** Inside a bucket the parameters are taken widest row first (rows of the local, TP-sharded
  tensor; ties in registration order), and the bucket's *chunk* is the least common multiple of
  the row sizes that do not already tile it. Shard boundaries fall on multiples of the chunk, so
  they cut a parameter that spans them between whole rows.
* **Packing.** A parameter of at least one chunk starts where the previous one ended, its last
  partial chunk padded to a whole one; that padding is shared with the next parameter whose own
  partial chunk fits beside it (placed so that its partial chunk ends the shared one), and with
  parameters smaller than a chunk, in order. The small ones left over go at the end. The bucket is
  padded to a multiple of ``dp_size * chunk`` and cut into ``dp_size`` equal shards.

PyTorch FSDP2 (``fully_shard``, Megatron's ``--use-torch-fsdp2``) shards every parameter on its
own along its first dimension, ``ceil(rows / dp_size)`` rows a rank: :data:`PER_PARAMETER`, a
bucket per parameter whose chunk is its row. The runtime refuses it; the planner and the
simulator price it (``tools/simulate.py --fsdp``'s ``owner_uniform``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from megatron.canzona.planning.geometry import round_up
from megatron.canzona.planning.plan import Bucket, BufferPlan, Placement
from megatron.canzona.planning.specs import ParamSpec

FSDP_LAYOUT = "fsdp"
"""The layout name of a plan over Megatron-FSDP's buffers (``--use-megatron-fsdp``)."""
SHARDING_STRATEGIES: tuple[str, ...] = ("optim", "optim_grads", "optim_grads_params")
"""Megatron-FSDP's sharding strategies (``--data-parallel-sharding-strategy``) that shard a buffer."""
PER_PARAMETER = "per_parameter"
"""PyTorch FSDP2's geometry (module docstring), given as :func:`fsdp_buckets`' ``strategy``."""
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, kw_only=True)
class FsdpItem:
    """One parameter's place in its bucket."""

    name: str
    offset: int
    """First element in the bucket."""
    numel: int
    row: int
    """Elements per row of the local tensor (its trailing dimensions; 1 for a vector)."""

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True, kw_only=True)
class FsdpBucket:
    """One bucket: its items, its chunk, its padded size and its ``dp_size`` equal shards."""

    unit: int | None
    """The FSDP unit (transformer layer, in module order) it belongs to, or ``None``."""
    expert: bool
    dtype: str
    chunk: int
    size: int
    dp_size: int
    items: tuple[FsdpItem, ...]
    """In buffer order (by offset)."""

    @property
    def shard_size(self) -> int:
        return self.size // self.dp_size

    def pieces(self, item: FsdpItem) -> tuple[tuple[int, int, int], ...]:
        """``(rank, lo, hi)``: elements ``[lo, hi)`` of ``item`` (counted from its first) that
        rank holds, for every rank holding some."""
        shard = self.shard_size
        found = []
        for rank in range(item.offset // shard, (item.end - 1) // shard + 1):
            lo, hi = max(item.offset, rank * shard), min(item.end, (rank + 1) * shard)
            found.append((rank, lo - item.offset, hi - item.offset))
        return tuple(found)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> FsdpBucket:
        return cls(**{**data, "items": tuple(FsdpItem(**item) for item in data["items"])})


def fsdp_expert(name: str) -> bool:
    """Whether Megatron-FSDP puts a parameter in an expert bucket: by its name, whatever the EP
    size (at EP 1 the experts are dense parameters to Megatron's DDP and to the planner, yet in
    buckets of their own here)."""
    return ".experts." in name


def fsdp_unit(name: str) -> int | None:
    """The transformer layer a parameter belongs to by its name, or ``None`` (embedding, final
    norm, output layer)."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def chunk_size(shapes: Sequence[tuple[int, ...]]) -> int:
    """The chunk of a bucket whose parameters have local ``shapes``, widest row first."""
    chunk = 0
    for shape in shapes:
        numel, row = math.prod(shape), math.prod(shape[1:])
        if not chunk:
            chunk = row
        elif not (row == chunk or (chunk % row == 0 and numel % chunk == 0) or numel < chunk):
            chunk = math.lcm(chunk, row)
    return max(chunk, 1)


def pack(numels: Sequence[int], chunk: int) -> tuple[list[int], int]:
    """Each parameter's first element and the packed extent (before the bucket's end padding)."""
    offsets: list[int] = [0] * len(numels)
    regular = [i for i, n in enumerate(numels) if n >= chunk]
    small = [i for i, n in enumerate(numels) if n < chunk]
    cursor = 0
    while regular:
        first = regular.pop(0)
        offsets[first] = cursor
        tail = numels[first] % chunk
        if not tail:
            cursor += numels[first]
            continue
        gap, space = cursor + numels[first], chunk - tail
        cursor += (numels[first] // chunk + 1) * chunk
        partner = next((j for j in regular if numels[j] % chunk and tail + numels[j] % chunk <= chunk), None)
        if partner is not None:
            regular.remove(partner)
            head = numels[partner] % chunk
            offsets[partner], space = cursor - head, space - head
            cursor += numels[partner] // chunk * chunk
        for j in list(small):
            if numels[j] <= space:
                offsets[j], space, gap = gap, space - numels[j], gap + numels[j]
                small.remove(j)
    for j in small:
        offsets[j], cursor = cursor, cursor + numels[j]
    return offsets, cursor


def bucket_of(params: Sequence[ParamSpec], *, dp_size: int, unit: int | None, expert: bool) -> FsdpBucket:
    """The bucket Megatron-FSDP builds of ``params`` (registration order) at ``dp_size``."""
    ordered = sorted(params, key=lambda p: -math.prod(p.local_shape[1:]))  # stable: ties in registration order
    chunk = chunk_size([p.local_shape for p in ordered])
    offsets, extent = pack([p.numel for p in ordered], chunk)
    items = sorted((FsdpItem(name=p.name, offset=o, numel=p.numel, row=math.prod(p.local_shape[1:]))
                    for p, o in zip(ordered, offsets)), key=lambda item: item.offset)
    return FsdpBucket(unit=unit, expert=expert, dtype=ordered[0].dtype, chunk=chunk,
                      size=round_up(extent, dp_size * chunk), dp_size=dp_size, items=tuple(items))


def fsdp_buckets(specs: Iterable[ParamSpec], *, dp_size: int, strategy: str = "optim_grads_params",
                 bucket_size: int | None = None, expert_dp_size: int | None = None) -> tuple[FsdpBucket, ...]:
    """Megatron-FSDP's buckets of one model chunk's ``specs`` (any order: registration order is
    the reverse of :attr:`ParamSpec.order`), sharded over ``dp_size`` ranks (expert buckets over
    ``expert_dp_size``, default the same); ``bucket_size`` is ``--ddp-bucket-size`` (``None``:
    unbounded). ``strategy`` :data:`PER_PARAMETER`: PyTorch FSDP2's, a bucket per parameter."""
    if strategy not in (*SHARDING_STRATEGIES, PER_PARAMETER):
        raise ValueError(f"strategy must be one of {', '.join(SHARDING_STRATEGIES)} (or {PER_PARAMETER}), "
                         f"got {strategy!r}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if strategy == PER_PARAMETER:
        return tuple(bucket_of([spec], dp_size=(expert_dp_size or dp_size) if spec.is_expert else dp_size,
                               unit=fsdp_unit(spec.name), expert=fsdp_expert(spec.name))
                     for spec in sorted(specs, key=lambda s: -s.order))
    units = strategy == "optim_grads_params"
    groups: dict[tuple[str, bool, int | None], list[ParamSpec]] = {}
    for spec in sorted(specs, key=lambda s: -s.order):
        groups.setdefault((spec.dtype, fsdp_expert(spec.name), fsdp_unit(spec.name) if units else None), []).append(spec)
    buckets = []
    for (_, expert, unit), params in groups.items():
        size = (expert_dp_size or dp_size) if params[0].is_expert else dp_size
        for run in ([params] if unit is not None else _closed_at(params, bucket_size)):
            buckets.append(bucket_of(run, dp_size=size, unit=unit, expert=expert))
    return tuple(buckets)


def _closed_at(params: list[ParamSpec], bucket_size: int | None) -> list[list[ParamSpec]]:
    """Runs of ``params``, each closed once it holds ``bucket_size`` elements or more."""
    runs, run = [], []
    for spec in params:
        run.append(spec)
        if bucket_size and sum(p.numel for p in run) >= bucket_size:
            runs.append(run)
            run = []
    return [*runs, run] if run else runs


def fsdp_buffer(buckets: Sequence[FsdpBucket], mats: Sequence[ParamSpec], costs: Sequence[float]) -> BufferPlan:
    """The matrices of Megatron-FSDP's ``buckets`` as the planner's :class:`BufferPlan`: the
    buckets end to end in the order their gradients become ready in backward (a bucket is
    reduced once its last parameter's gradient is in: the last layer's first, the one holding
    the embedding last), each in its equal shards, every matrix of ``mats`` at its offset
    (``costs``: its update's). The elementwise parameters keep their room in the buckets and are
    not placed: AdamW updates them where they lie."""
    order_of = {s.name: s.order for s in mats}
    cost_of = {s.name: c for s, c in zip(mats, costs)}
    ready = sorted(buckets, key=lambda b: max((order_of.get(item.name, -1) for item in b.items), default=-1))
    placements: list[Placement] = []
    out: list[Bucket] = []
    offset = 0
    for index, bucket in enumerate(b for b in ready if any(item.name in cost_of for item in b.items)):
        shard = bucket.shard_size
        for item in bucket.items:
            if item.name not in cost_of:
                continue
            lo, hi = item.offset // shard, (item.end - 1) // shard
            placements.append(Placement(name=item.name, start=offset + item.offset, end=offset + item.end, bucket=index,
                                        host=lo if lo == hi else None, cost=cost_of[item.name]))
        out.append(Bucket(start=offset, end=offset + bucket.size, numel_unpadded=sum(item.numel for item in bucket.items),
                          shard_bounds=tuple(offset + r * shard for r in range(bucket.dp_size + 1))))
        offset += bucket.size
    return BufferPlan(placements=tuple(placements), buckets=tuple(out))
