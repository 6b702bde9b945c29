"""Plans are data: frozen dataclasses consumed by the runtime, the CLI and the tests."""

from __future__ import annotations

from dataclasses import dataclass

from . import serde
from .grid import dense_to_expert


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one parameter lives in a data-parallel buffer."""

    name: str
    """Parameter name."""
    start: int
    """First buffer element of the parameter."""
    end: int
    """One past its last element (start + local numel)."""
    bucket: int
    """Index of the bucket holding it."""
    host: int | None
    """DP rank whose shard holds the whole parameter; ``None`` when it lies across shards."""
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
    def numel(self) -> int:
        return self.end - self.start

    @property
    def uniform(self) -> bool:
        """Whether every shard has the same size (what stock NCCL/gloo collectives need)."""
        sizes = {b - a for a, b in zip(self.shard_bounds, self.shard_bounds[1:])}
        return len(sizes) == 1

    @property
    def largest_shard(self) -> int:
        """Elements of the largest DP shard."""
        return max(b - a for a, b in zip(self.shard_bounds, self.shard_bounds[1:]))


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

    def placement(self, name: str) -> Placement:
        for p in self.placements:
            if p.name == name:
                return p
        raise KeyError(f"{name} is not in this buffer")

    def pieces(self, placement: Placement) -> tuple[tuple[int, int, int], ...]:
        """``(dp_rank, lo, hi)`` per DP shard holding part of the parameter: its elements
        ``[lo, hi)`` (flattened local tensor) sit in ``dp_rank``'s shard."""
        bounds = self.buckets[placement.bucket].shard_bounds
        out = []
        for rank, (a, b) in enumerate(zip(bounds, bounds[1:])):
            lo, hi = max(a, placement.start), min(b, placement.end)
            if lo < hi:
                out.append((rank, lo - placement.start, hi - placement.start))
        return tuple(out)


@dataclass(frozen=True, kw_only=True)
class DPPlan:
    """Data-parallel layout of one model chunk's buffers, and who computes each matrix there."""

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
    """Optimizer compute per DP rank (summed over its TP ranks)."""

    def owners(self) -> dict[str, int | None]:
        """DP rank holding each matrix whole (``None``: split across DP shards)."""
        return {p.name: p.host for p in self.matrix.placements}

    def to_json(self) -> str:
        return serde.dumps(self)

    @classmethod
    def from_json(cls, text: str) -> DPPlan:
        return serde.loads(cls, text)


@dataclass(frozen=True, kw_only=True)
class Host:
    """The one rank that computes a matrix's update, and when."""

    name: str
    """Parameter name (unique within its chunk)."""
    chunk: int = 0
    """Model chunk (virtual pipeline stage) holding the parameter."""
    dp_rank: int
    """DP rank of the host."""
    tp_rank: int | None
    """TP rank of the host; ``None`` for a matrix every TP rank holds whole (not TP-sharded):
    then each TP rank computes it for its own copy, on its DP rank ``dp_rank``."""
    group: int
    """Micro-group; groups run in increasing order, each one gather, compute, scatter."""
    cost: float
    """Cost of the update in the plan's cost unit."""
    part: int = 0
    """Which part of a parameter hosted in parts (gate and up with ``--canzona-split-gate-up``)."""
    span: tuple[int, int] | None = None
    """Elements ``[lo, hi)`` of the flattened local tensor this part covers; ``None``: the
    whole parameter."""
    together: bool = False
    """A TP-sharded matrix its TP ranks compute together (``tp_rank`` ``None``): each TP rank of
    DP rank ``dp_rank`` gathers its own shard and computes it, the shards' Newton-Schulz summing
    their Gram matrices among them (``--canzona-tp-together``); ``cost`` is each one's share."""


@dataclass(frozen=True, kw_only=True)
class CanzonaPlan:
    """The whole plan of one pipeline stage: buffer layouts and a host per matrix.

    Every matrix is computed once, by its host (DP rank, TP rank). A matrix that lies whole
    in its host's DP shard and is not TP-sharded needs no communication; any other gathers
    its pieces (DP shards x TP shards) to the host and gets its update slices back.

    With expert parallelism the expert buffers have a plan of their own (``experts``) of the
    same kind, over expert DP x expert TP; every EP rank holds the same local expert names
    and runs the same expert plan (:mod:`~megatron.canzona.planning.grid` maps GPUs).
    """

    layouts: tuple[DPPlan, ...]
    """One data-parallel layout per model chunk."""
    tp_size: int
    """Tensor-parallel group size."""
    hosts: tuple[Host, ...]
    """One entry per matrix (per part of one hosted in parts) of every chunk, by micro-group
    then cost (largest first)."""
    budget: float
    """Largest cost one host takes in one micro-group (a single larger matrix goes alone)."""
    experts: CanzonaPlan | None = None
    """Plan of the expert-parallel buffers over expert DP (its ``dp_size``) x expert TP (its
    ``tp_size``); ``None`` without expert-parallel parameters."""
    ep_size: int = 1
    """Expert-parallel size the plan was made for."""
    layout: str = "lean"
    """DP layout of the matrix buffers: ``whole`` (variable-size shards, every matrix whole
    in one DP rank's shard, uneven collectives) or ``lean`` (equal shards, a matrix may lie
    across shards); :data:`~megatron.canzona.planning.balance.LAYOUTS`."""

    @property
    def dp(self) -> DPPlan:
        """The layout of a single-chunk plan."""
        if len(self.layouts) != 1:
            raise ValueError(f"this plan has {len(self.layouts)} model chunks; use plan.layouts[chunk]")
        return self.layouts[0]

    @property
    def dp_size(self) -> int:
        return self.layouts[0].dp_size

    @property
    def num_groups(self) -> int:
        return 1 + max((h.group for h in self.hosts), default=-1)

    def host(self, name: str, chunk: int = 0, part: int = 0) -> Host:
        for h in self.hosts:
            if h.name == name and h.chunk == chunk and h.part == part:
                return h
        raise KeyError(f"no matrix {name} in chunk {chunk} of this plan")

    def compute_rank(self, name: str, chunk: int = 0) -> tuple[int, int]:
        """The (dp_rank, tp_rank) that computes ``name``'s update (TP rank 0 for a matrix
        every TP rank holds whole, which each TP rank computes for itself)."""
        h = self.host(name, chunk)
        return h.dp_rank, 0 if h.tp_rank is None else h.tp_rank

    def rank_loads(self) -> list[list[float]]:
        """Compute per [dp_rank][tp_rank]."""
        loads = [[0.0] * self.tp_size for _ in range(self.dp_size)]
        for h in self.hosts:
            for t in range(self.tp_size) if h.tp_rank is None else (h.tp_rank,):
                loads[h.dp_rank][t] += h.cost
        return loads

    def combined_loads(self) -> list[float]:
        """Dense plus expert compute per GPU of the stage, index ``dp_rank * tp_size + tp_rank``."""
        dense = [load for row in self.rank_loads() for load in row]
        if self.experts is None:
            return dense
        expert = self.experts.rank_loads()
        coords = dense_to_expert(dp_size=self.dp_size, tp_size=self.tp_size, ep_size=self.ep_size,
                                 expert_tp_size=self.experts.tp_size)
        return [load + expert[edp][etp] for load, (edp, etp) in zip(dense, coords)]

    def to_json(self) -> str:
        return serde.dumps(self)

    @classmethod
    def from_json(cls, text: str) -> CanzonaPlan:
        return serde.loads(cls, text)
