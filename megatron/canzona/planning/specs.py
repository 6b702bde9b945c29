"""Parameter descriptions: the planner's only view of a model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Family = Literal["matrix", "elementwise"]
FAMILIES: tuple[str, ...] = ("matrix", "elementwise")
FUSED_LAYOUTS: tuple[str, ...] = ("qkv", "gate_up", "experts")
"""Fused layouts a parameter may have: Megatron's QKV, a gated fc1 (gate rows then up rows,
per TP shard), and the legacy ``GroupedMLP``'s stacked experts (``blocks`` are its experts)."""


def qkv_blocks(num_heads: int, num_query_groups: int, head_dim: int, cols: int, *,
               per_head: bool = False) -> tuple[tuple[int, int], ...]:
    """The matrices the optimizer makes of a fused QKV weight with ``cols`` columns: Q, K and V;
    or, ``per_head``, every query head, then every key head, then every value head, each
    ``(head_dim, cols)`` (the order of :class:`~megatron.canzona.optim.split.QKVLayout`)."""
    if per_head:
        return ((head_dim, cols),) * (num_heads + 2 * num_query_groups)
    return ((num_heads * head_dim, cols), (num_query_groups * head_dim, cols), (num_query_groups * head_dim, cols))


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """One parameter as the planner sees it: shapes, sharding, optimizer family and order."""

    name: str
    """Megatron's parameter name, e.g. ``decoder.layers.0.mlp.linear_fc1.weight``."""
    global_shape: tuple[int, ...]
    """Shape of the unsharded tensor."""
    tp_dim: int | None = None
    """Dimension split across tensor-parallel ranks, or ``None`` if replicated."""
    tp_size: int = 1
    """Tensor-parallel size the local shape is computed for."""
    dtype: str = "bfloat16"
    """Storage dtype name of the model parameter."""
    family: Family = "matrix"
    """``matrix`` for Muon/Shampoo/SOAP, ``elementwise`` for AdamW."""
    is_expert: bool = False
    """Whether the parameter belongs to an MoE expert (separate expert-DP group)."""
    order: int = 0
    """Position in backprop order: 0 is the first gradient produced by backward."""
    blocks: tuple[tuple[int, int], ...] = ()
    """Global shapes of the matrices the optimizer treats separately (split QKV, gate/up);
    empty means the whole parameter is one matrix."""
    fused: str | None = None
    """Fused layout of the tensor (one of :data:`FUSED_LAYOUTS`), needed to split and re-shard it."""
    chunk: int = 0
    """Model chunk (virtual pipeline stage) holding the parameter; each chunk has its own buffers."""

    def __post_init__(self) -> None:
        if any(d <= 0 for d in self.global_shape):
            raise ValueError(f"{self.name}: every dimension must be positive, got {self.global_shape}")
        if self.family not in FAMILIES:
            raise ValueError(f"{self.name}: family must be one of {FAMILIES}, got {self.family!r}")
        if self.family == "matrix" and len(self.global_shape) != 2:
            raise ValueError(f"{self.name}: a matrix parameter must be 2-D, got {self.global_shape}")
        if self.tp_size < 1:
            raise ValueError(f"{self.name}: tp_size must be >= 1, got {self.tp_size}")
        if self.tp_dim is not None and self.global_shape[self.tp_dim] % self.tp_size:
            raise ValueError(
                f"{self.name}: dim {self.tp_dim} of {self.global_shape} is not divisible by "
                f"tp_size={self.tp_size}; choose a tensor-parallel size that divides it"
            )
        if self.fused is not None and self.fused not in FUSED_LAYOUTS:
            raise ValueError(f"{self.name}: fused must be None or one of {FUSED_LAYOUTS}, got {self.fused!r}")
        for m, n in self.blocks:
            if m <= 0 or n <= 0:
                raise ValueError(f"{self.name}: block shapes must be positive, got {(m, n)}")

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the shard one tensor-parallel rank holds."""
        if self.tp_dim is None or self.tp_size == 1:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.tp_dim] //= self.tp_size
        return tuple(shape)

    @property
    def tp_sharded(self) -> bool:
        """Whether tensor-parallel ranks hold different slices (else each holds it whole)."""
        return self.tp_dim is not None and self.tp_size > 1

    @property
    def parts(self) -> tuple[tuple[int, int, tuple[int, int]], ...]:
        """The parts hosted apart, ``(lo, hi, (m, n))``: elements ``[lo, hi)`` of the flattened
        local tensor and the global shape of the matrix they rebuild. A gated fc1 split into
        gate and up (``blocks`` set, ``--canzona-split-gate-up``) has two: each TP shard is
        ``[gate_r; up_r]``, so each half is one contiguous range of every TP rank's tensor and
        the TP ranks' halves stack into the global gate (up). Every other parameter is one part."""
        if self.fused == "gate_up" and len(self.blocks) == 2:
            half = self.numel // 2
            return ((0, half, self.blocks[0]), (half, self.numel, self.blocks[1]))
        return ((0, self.numel, self.global_shape if len(self.global_shape) == 2 else (self.global_numel, 1)),)

    def part_matrices(self, part: int) -> tuple[tuple[int, int], ...]:
        """The matrices the optimizer computes for part ``part`` (:attr:`parts`)."""
        return self.matrices if len(self.parts) == 1 else (self.parts[part][2],)

    @property
    def numel(self) -> int:
        """Elements of the local shard: what occupies the data-parallel buffer."""
        return math.prod(self.local_shape)

    @property
    def global_numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def matrices(self) -> tuple[tuple[int, int], ...]:
        """The (m, n) matrices whose updates the optimizer computes for this parameter."""
        if self.blocks:
            return self.blocks
        assert len(self.global_shape) == 2, self.name
        return (self.global_shape,)  # type: ignore[return-value]

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "global_shape": list(self.global_shape),
            "local_shape": list(self.local_shape),
            "tp_dim": self.tp_dim,
            "tp_size": self.tp_size,
            "dtype": self.dtype,
            "family": self.family,
            "is_expert": self.is_expert,
            "order": self.order,
            "blocks": [list(b) for b in self.blocks],
            "fused": self.fused,
            "chunk": self.chunk,
        }

    @classmethod
    def from_dict(cls, data: dict) -> ParamSpec:
        fields = {k: v for k, v in data.items() if k != "local_shape"}
        fields["global_shape"] = tuple(fields["global_shape"])
        fields["blocks"] = tuple(tuple(b) for b in fields.get("blocks", ()))
        return cls(**fields)


def matrix_specs(specs: list[ParamSpec] | tuple[ParamSpec, ...]) -> list[ParamSpec]:
    """Matrix-family parameters in backprop order."""
    return sorted((s for s in specs if s.family == "matrix"), key=lambda s: s.order)


def elementwise_specs(specs: list[ParamSpec] | tuple[ParamSpec, ...]) -> list[ParamSpec]:
    """Elementwise-family parameters in backprop order."""
    return sorted((s for s in specs if s.family == "elementwise"), key=lambda s: s.order)
