"""Which parameters get a matrix optimizer, and how fused matrices split into real ones.

Fused layouts split a ``(..., rows, cols)`` tensor into the matrices the optimizer
should treat separately and merge per-piece updates back into the fused layout:

* :class:`QKVLayout`: Megatron's ``linear_qkv.weight`` rows are grouped by KV group, each
  group holding its query heads, then one key head, then one value head. Split gives
  Q, K, V (or every head on its own with ``split_heads=True``). A full matrix gathered
  from tensor-parallel shards along the rows keeps this layout.
* :class:`GateUpLayout`: a SwiGLU ``linear_fc1.weight`` stacks ``[gate; up]`` per
  tensor-parallel partition; split gives the gate and the up projection.
* :class:`ExpertStackLayout`: the legacy ``GroupedMLP``'s stacked expert weights; split
  gives one matrix per expert.

Routing is by rules evaluated in order (see :func:`classify_parameter`); the defaults
send embeddings, the output layer, norms, biases and every non-2-D tensor to AdamW.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch


class FusedLayout(Protocol):
    """A fused matrix made of several matrices along its rows."""

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The component matrices of ``x`` of shape ``(..., rows, cols)``."""
        ...

    def merge(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`split`."""
        ...


def _check_rows(layout: str, x: torch.Tensor, expected: int) -> None:
    if x.ndim < 2 or x.shape[-2] != expected:
        raise ValueError(
            f"{layout} expects (..., {expected}, cols), got shape {tuple(x.shape)}; check the "
            "head counts / partitions given to the layout against the model config."
        )


@dataclass(frozen=True, kw_only=True)
class QKVLayout:
    """Megatron's fused QKV rows: per KV group, ``heads_per_group`` query heads, K, V."""

    num_query_groups: int
    """Number of KV groups held by this tensor (all of them for a full matrix)."""
    heads_per_group: int
    """Query heads per KV group (num_attention_heads // num_query_groups)."""
    head_dim: int
    """Rows per head (kv_channels)."""
    split_heads: bool = False
    """Split every head into its own matrix instead of one Q, one K and one V."""

    def __post_init__(self) -> None:
        for name in ("num_query_groups", "heads_per_group", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"QKVLayout.{name} must be >= 1, got {getattr(self, name)}.")

    @property
    def rows(self) -> int:
        """Rows of the fused tensor."""
        return self.num_query_groups * (self.heads_per_group + 2) * self.head_dim

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[Q, K, V]``, or every Q head then every K head then every V head."""
        _check_rows("QKVLayout", x, self.rows)
        *lead, _, cols = x.shape
        groups, per_group, dim = self.num_query_groups, self.heads_per_group, self.head_dim
        grouped = x.reshape(*lead, groups, (per_group + 2) * dim, cols)
        q, k, v = grouped.split([per_group * dim, dim, dim], dim=-2)
        if not self.split_heads:
            return [t.reshape(*lead, -1, cols) for t in (q, k, v)]
        heads = [t.reshape(*lead, -1, dim, cols) for t in (q, k, v)]
        return [head for t in heads for head in t.unbind(-3)]

    def merge(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`split`."""
        groups, per_group, dim = self.num_query_groups, self.heads_per_group, self.head_dim
        *lead, _, cols = pieces[0].shape
        if self.split_heads:
            num_q = groups * per_group
            heads = (pieces[:num_q], pieces[num_q : num_q + groups], pieces[num_q + groups :])
            q, k, v = (torch.stack(list(h), dim=-3) for h in heads)
        else:
            q, k, v = pieces
        parts = [
            t.reshape(*lead, groups, rows, cols)
            for t, rows in ((q, per_group * dim), (k, dim), (v, dim))
        ]
        return torch.cat(parts, dim=-2).reshape(*lead, self.rows, cols)


@dataclass(frozen=True, kw_only=True)
class GateUpLayout:
    """A SwiGLU fc1: ``num_partitions`` blocks of ``[gate_i; up_i]`` along the rows."""

    num_partitions: int = 1
    """Tensor-parallel shards concatenated in this tensor (1 for an unsharded model)."""

    def __post_init__(self) -> None:
        if self.num_partitions < 1:
            raise ValueError(f"GateUpLayout.num_partitions must be >= 1, got {self.num_partitions}.")

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[gate, up]``, each ``(..., rows // 2, cols)``."""
        if x.ndim < 2 or x.shape[-2] % (2 * self.num_partitions) != 0:
            raise ValueError(
                f"GateUpLayout(num_partitions={self.num_partitions}) cannot split shape "
                f"{tuple(x.shape)}: rows must be a multiple of 2 * num_partitions."
            )
        *lead, rows, cols = x.shape
        blocks = x.reshape(*lead, self.num_partitions, 2, rows // (2 * self.num_partitions), cols)
        return [blocks.select(-3, i).reshape(*lead, rows // 2, cols) for i in (0, 1)]

    def merge(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`split`."""
        gate, up = pieces
        *lead, half, cols = gate.shape
        block = half // self.num_partitions
        parts = [t.reshape(*lead, self.num_partitions, 1, block, cols) for t in (gate, up)]
        return torch.cat(parts, dim=-3).reshape(*lead, 2 * half, cols)


@dataclass(frozen=True, kw_only=True)
class ExpertStackLayout:
    """Megatron's legacy ``GroupedMLP`` weights: ``num_experts`` matrices of shape
    ``expert_shape`` one after another in memory (``weight1`` of shape ``(h, E * fc1)`` holds
    E ``(h, fc1)`` matrices, ``weight2`` of shape ``(E * fc2, h)`` E ``(fc2, h)`` ones)."""

    num_experts: int
    """Local experts stacked in the tensor."""
    expert_shape: tuple[int, int]
    """One expert's matrix, as ``GroupedMLP``'s forward views it."""
    shape: tuple[int, int]
    """Shape of the stacked parameter."""

    def __post_init__(self) -> None:
        rows, cols = self.expert_shape
        if self.num_experts < 1 or self.num_experts * rows * cols != self.shape[0] * self.shape[1]:
            raise ValueError(
                f"ExpertStackLayout: {self.num_experts} experts of {self.expert_shape} do not fill {self.shape}")

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One matrix per expert (views of ``x``)."""
        return list(x.reshape(self.num_experts, *self.expert_shape).unbind(0))

    def merge(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`split`."""
        return torch.stack(list(pieces)).reshape(self.shape)


def split_pieces(x: torch.Tensor, layout: FusedLayout | None) -> list[torch.Tensor]:
    """``layout.split(x)``, or ``[x]`` for an unfused matrix."""
    return [x] if layout is None else layout.split(x)


def merge_pieces(pieces: Sequence[torch.Tensor], layout: FusedLayout | None) -> torch.Tensor:
    """Inverse of :func:`split_pieces`."""
    return pieces[0] if layout is None else layout.merge(pieces)


ParamKind = Literal["matrix", "adamw"]


@dataclass(frozen=True, kw_only=True)
class ParamRouting:
    """Rules deciding which parameters a matrix optimizer handles (regexes, ``re.search``)."""

    adamw_patterns: tuple[str, ...] = (r"embed", r"output_layer", r"lm_head", r"norm", r"bias$")
    """Names sent to AdamW: embeddings, output layer, norms and biases by default."""
    matrix_patterns: tuple[str, ...] = ()
    """Names forced onto the matrix optimizer (2-D only); checked before ``adamw_patterns``."""
    qkv_patterns: tuple[str, ...] = (r"linear_qkv\.weight$",)
    """Names of fused QKV weights, split with the ``qkv_layout`` given to build_param_groups."""
    gate_up_patterns: tuple[str, ...] = (r"linear_fc1\.weight$",)
    """Names of fused gate/up weights, split with the ``gate_up_layout`` given."""
    respect_megatron_attributes: bool = True
    """Send tensors with ``is_embedding_or_output_parameter=True`` (set by Megatron) to AdamW."""
    no_weight_decay_for_vectors: bool = True
    """Put AdamW tensors with fewer than 2 dims (norms, biases) in a group with weight decay 0."""


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(re.search(pattern, name) for pattern in patterns)


def classify_parameter(name: str, param: torch.Tensor, routing: ParamRouting) -> ParamKind:
    """``"matrix"`` or ``"adamw"``, by the first rule that applies:

    1. not 2-D -> adamw; 2. Megatron's embedding/output attribute -> adamw;
    3. ``matrix_patterns`` -> matrix; 4. ``adamw_patterns`` -> adamw; 5. otherwise matrix.
    """
    if param.ndim != 2:
        return "adamw"
    if routing.respect_megatron_attributes and getattr(param, "is_embedding_or_output_parameter", False):
        return "adamw"
    if _matches(name, routing.matrix_patterns):
        return "matrix"
    if _matches(name, routing.adamw_patterns):
        return "adamw"
    return "matrix"


def build_param_groups(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
    *,
    routing: ParamRouting | None = None,
    qkv_layout: QKVLayout | None = None,
    gate_up_layout: GateUpLayout | None = None,
) -> list[dict[str, Any]]:
    """Parameter groups for :class:`~megatron.canzona.optim.optimizers.Muon` and friends.

    Returns groups named ``matrix``, ``qkv``, ``gate_up``, ``adamw`` and ``adamw_no_decay``
    (empty ones dropped); each carries ``matrix``, ``fused_layout`` and the parameters'
    ``names`` (which stagger preconditioner refreshes per matrix) and may be
    given its own ``lr``/``weight_decay`` before being passed to the optimizer. A fused
    weight whose layout is not given stays one matrix.
    """
    routing = routing or ParamRouting()
    buckets: dict[str, list[torch.nn.Parameter]] = {
        "matrix": [], "qkv": [], "gate_up": [], "adamw": [], "adamw_no_decay": []
    }
    names: dict[str, list[str]] = {key: [] for key in buckets}
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        if classify_parameter(name, param, routing) == "adamw":
            vector = param.ndim < 2 and routing.no_weight_decay_for_vectors
            bucket = "adamw_no_decay" if vector else "adamw"
        elif qkv_layout is not None and _matches(name, routing.qkv_patterns):
            bucket = "qkv"
        elif gate_up_layout is not None and _matches(name, routing.gate_up_patterns):
            bucket = "gate_up"
        else:
            bucket = "matrix"
        buckets[bucket].append(param)
        names[bucket].append(name)
    layouts: dict[str, FusedLayout | None] = {"qkv": qkv_layout, "gate_up": gate_up_layout}
    groups = []
    for group_name, params in buckets.items():
        if not params:
            continue
        group: dict[str, Any] = {
            "params": params, "names": names[group_name], "name": group_name,
            "matrix": not group_name.startswith("adamw"),
            "fused_layout": layouts.get(group_name),
        }
        if group_name == "adamw_no_decay":
            group["weight_decay"] = 0.0
        groups.append(group)
    return groups
