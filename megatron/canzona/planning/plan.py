"""Plans are data: frozen dataclasses consumed by the runtime, the CLI and the tests."""

from __future__ import annotations

from dataclasses import dataclass

from . import serde


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one parameter lives in a data-parallel buffer and which rank updates it."""

    name: str
    """Parameter name."""
    start: int
    """First buffer element of the parameter."""
    end: int
    """One past its last element (start + local numel)."""
    bucket: int
    """Index of the bucket holding it."""
    host: int | None
    """DP rank that owns the whole parameter; ``None`` when the layout splits it."""
    cost: float
    """Cost of its optimizer update in the plan's cost unit."""


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """A contiguous buffer range reduce-scattered as one collective."""

    start: int
    """First element of the bucket in the buffer."""
    end: int
    """One past the last element, padding included."""
    numel_unpadded: int
    """Sum of parameter elements in the bucket."""
    shard_bounds: tuple[int, ...]
    """dp_size + 1 offsets: rank r's shard is [shard_bounds[r], shard_bounds[r + 1])."""

    @property
    def uniform(self) -> bool:
        """Whether every shard has the same size (what stock NCCL/gloo collectives need)."""
        sizes = {b - a for a, b in zip(self.shard_bounds, self.shard_bounds[1:])}
        return len(sizes) == 1


@dataclass(frozen=True, kw_only=True)
class BufferPlan:
    """Layout of one contiguous buffer: parameters in buffer order and their buckets."""

    placements: tuple[Placement, ...]
    """Parameters in buffer order."""
    buckets: tuple[Bucket, ...]
    """Buckets in buffer (and backprop) order."""

    @property
    def numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0

    @property
    def param_numel(self) -> int:
        return sum(p.end - p.start for p in self.placements)


@dataclass(frozen=True, kw_only=True)
class DPPlan:
    """Data-parallel plan: who updates each matrix and how the matrix buffer is laid out."""

    strategy: str
    """``canzona``, ``eq1``, ``megatron_layerwise`` or ``zero1``."""
    dp_size: int
    """Data-parallel group size."""
    alpha: float | None
    """Balance knob the plan was made with (``canzona`` only)."""
    cost_kind: str
    """Cost model used for the loads."""
    bucket_size: int | None
    """Bucket size in elements the plan was made with."""
    matrix: BufferPlan
    """Buffer of matrix-optimizer parameters."""
    elementwise: BufferPlan | None = None
    """Buffer of elementwise (AdamW) parameters, stock contiguous layout."""
    loads: tuple[float, ...] = ()
    """Optimizer compute per DP rank (a split matrix counts on every rank holding a piece)."""

    def owners(self) -> dict[str, int | None]:
        return {p.name: p.host for p in self.matrix.placements}

    def to_json(self) -> str:
        return serde.dumps(self)

    @classmethod
    def from_json(cls, text: str) -> DPPlan:
        return serde.loads(cls, text)


@dataclass(frozen=True, kw_only=True)
class MicroGroup:
    """Matrices whose gather, host compute and scatter run together on a TP group."""

    names: tuple[str, ...]
    """Parameters in the group, largest cost first."""
    hosts: tuple[int, ...]
    """TP rank that computes each parameter's full-matrix update."""
    slot_loads: tuple[float, ...]
    """Compute each TP rank does for this group."""


@dataclass(frozen=True, kw_only=True)
class TPPlan:
    """Tensor-parallel schedule of the matrices one DP rank owns."""

    tp_size: int
    """Tensor-parallel group size."""
    budget: float
    """Largest per-slot load a micro-group may carry (a bigger single matrix gets its own)."""
    groups: tuple[MicroGroup, ...]
    """Micro-groups in execution order."""

    @property
    def rank_loads(self) -> tuple[float, ...]:
        return tuple(sum(g.slot_loads[r] for g in self.groups) for r in range(self.tp_size))

    def hosts(self) -> dict[str, int]:
        return {n: h for g in self.groups for n, h in zip(g.names, g.hosts)}


@dataclass(frozen=True, kw_only=True)
class CanzonaPlan:
    """The whole plan: the DP layout, and per DP rank the TP micro-group schedule."""

    dp: DPPlan
    """Data-parallel plan (identical on every TP rank: local shapes match)."""
    tp: tuple[TPPlan, ...]
    """One schedule per DP rank, over the matrices that rank owns."""

    def compute_rank(self, name: str) -> tuple[int, int]:
        """The single (dp_rank, tp_rank) that computes ``name``'s update."""
        dp_rank = self.dp.owners()[name]
        if dp_rank is None:
            raise ValueError(f"{name} is split across DP ranks by the {self.dp.strategy} layout")
        return dp_rank, self.tp[dp_rank].hosts()[name]

    def to_json(self) -> str:
        return serde.dumps(self)

    @classmethod
    def from_json(cls, text: str) -> CanzonaPlan:
        return serde.loads(cls, text)
