"""The MoE block of a Qwen3 MoE layer as parameter descriptions with Megatron-Core naming.

Registration order inside ``decoder.layers.L.mlp``: the router, then the experts
(Qwen3 MoE has no shared expert). The router ``(num_experts, h)`` is replicated on every
rank, all-reduced over data parallel like any dense weight, and optimized by AdamW
(``elementwise``): its rows are per-expert logits, not a linear map to orthogonalize.

Experts: every expert-parallel (EP) rank holds ``num_experts / ep_size`` *local* experts
(names count them from 0 on every EP rank, so every EP rank holds the same names and
shapes), each a fused gate/up ``linear_fc1`` ``(2 f, h)`` split by rows and a
``linear_fc2`` ``(h, f)`` split by columns over the expert TP group. Megatron-Core 0.19.2
marks them expert-parallel (``allreduce = False``: their own DDP buffers, reduced over the
expert-data-parallel group) when ``ep_size > 1`` or the expert TP size differs from the TP
size (``ColumnParallelLinear``'s ``use_expert_pgs``); otherwise they are ordinary dense
parameters in the dense buffer.

Layouts (:data:`EXPERT_LAYOUTS`), by the module holding the local experts:

* ``sequential``: ``SequentialMLP``, ``experts.local_experts.J.linear_fc1.weight`` then
  ``...J.linear_fc2.weight``, expert by expert;
* ``grouped``: transformer-engine's ``TEGroupedMLP`` (``GroupedLinear``): every
  ``experts.linear_fc1.weightJ``, then every ``experts.linear_fc2.weightJ``, same shapes;
* ``stacked``: the legacy ``GroupedMLP`` (Megatron-Core before 0.19; the official Canzona
  release): ``experts.weight1`` ``(h, E_local · 2f)`` and ``experts.weight2``
  ``(E_local · f, h)``, memory of E_local contiguous per-expert matrices (views
  ``(E_local, h, 2f)`` and ``(E_local, f, h)``): one parameter each, whose ``blocks`` are
  its experts, each optimized as its own matrix (``fused="experts"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .specs import ParamSpec

if TYPE_CHECKING:
    from .qwen3 import Qwen3Config

EXPERT_LAYOUTS: tuple[str, ...] = ("sequential", "grouped", "stacked")
"""Megatron modules holding an MoE layer's local experts (module docstring)."""


def experts_are_parallel(*, tp_size: int, ep_size: int, expert_tp_size: int) -> bool:
    """Whether Megatron-Core puts expert weights in expert buffers (expert-data-parallel)."""
    return ep_size > 1 or expert_tp_size != tp_size


def check_experts(cfg: Qwen3Config, *, ep_size: int, expert_tp_size: int, expert_layout: str) -> None:
    """ValueError, with the fix, for expert parallel sizes the model cannot take."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    for name, flag, value in (("ep_size", "--ep", ep_size), ("expert_tp_size", "--etp", expert_tp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}; pass {flag} 1 or more")
    if not cfg.is_moe:
        if ep_size > 1 or expert_tp_size > 1:
            raise ValueError(f"{cfg.name} is dense (no experts); use expert-parallel size 1 (drop --ep) or choose an MoE model")
        return
    if cfg.num_experts % ep_size:
        raise ValueError(
            f"{cfg.name}: {cfg.num_experts} experts do not split over ep_size={ep_size}; "
            f"choose an expert-parallel size that divides {cfg.num_experts}"
        )
    if cfg.moe_ffn_hidden_size % expert_tp_size:
        raise ValueError(
            f"{cfg.name}: moe_ffn_hidden_size={cfg.moe_ffn_hidden_size} is not divisible by "
            f"expert_tp_size={expert_tp_size}; choose an expert TP size that divides it"
        )


def moe_rows(cfg: Qwen3Config, prefix: str, *, tp_size: int, ep_size: int, expert_tp_size: int,
             split_gate_up: bool, layout: str) -> list[ParamSpec]:
    """The router and the local experts of one MoE layer (``prefix`` ends in ``mlp.``), in
    registration order, before dtype and backprop order are set."""
    h, f = cfg.hidden_size, cfg.moe_ffn_hidden_size
    local = cfg.num_experts // ep_size
    router = ParamSpec(name=prefix + "router.weight", global_shape=(cfg.num_experts, h), tp_size=tp_size,
                       family="elementwise")
    common = dict(tp_size=expert_tp_size,
                  is_expert=experts_are_parallel(tp_size=tp_size, ep_size=ep_size, expert_tp_size=expert_tp_size))
    gate_up = ((f, h), (f, h)) if split_gate_up else ()
    if layout == "stacked":
        return [
            router,
            ParamSpec(name=prefix + "experts.weight1", global_shape=(h, local * 2 * f), tp_dim=1,
                      blocks=((h, 2 * f),) * local, fused="experts", **common),  # type: ignore[arg-type]
            ParamSpec(name=prefix + "experts.weight2", global_shape=(local * f, h), tp_dim=0,
                      blocks=((f, h),) * local, fused="experts", **common),  # type: ignore[arg-type]
        ]

    def fc1(name: str) -> ParamSpec:
        return ParamSpec(name=name, global_shape=(2 * f, h), tp_dim=0, blocks=gate_up, fused="gate_up",
                         **common)  # type: ignore[arg-type]

    def fc2(name: str) -> ParamSpec:
        return ParamSpec(name=name, global_shape=(h, f), tp_dim=1, **common)  # type: ignore[arg-type]

    experts = prefix + "experts."
    if layout == "grouped":
        return ([router] + [fc1(f"{experts}linear_fc1.weight{j}") for j in range(local)]
                + [fc2(f"{experts}linear_fc2.weight{j}") for j in range(local)])
    rows = [router]
    for j in range(local):
        rows += [fc1(f"{experts}local_experts.{j}.linear_fc1.weight"),
                 fc2(f"{experts}local_experts.{j}.linear_fc2.weight")]
    return rows
