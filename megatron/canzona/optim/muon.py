"""Muon: momentum orthogonalised by Newton-Schulz, scaled by the matrix shape.

Reproducing Megatron-Core 0.19.2's Muon (``TensorParallelMuon`` on emerging-optimizers
0.3.0) exactly, for one matrix or one split piece of a fused QKV:

====================================  =============================================
Megatron ``OptimizerConfig``          :class:`MuonConfig`
====================================  =============================================
``muon_momentum``                     ``momentum``
``muon_nesterov``                     ``nesterov`` (same form: ``G.lerp(M, momentum)``)
``muon_coefficient_type``             ``coefficients=EMERGING_OPTIMIZERS_COEFFICIENTS[...]``
``muon_num_ns_steps``                 ``num_ns_steps``
``muon_fp32_matmul_prec="medium"``    ``ns_dtype="bfloat16"`` (else ``"float32"``, which
                                      follows ``torch.get_float32_matmul_precision()``)
``muon_scale_mode``                   ``scale_mode`` (same names, same formulas; their
                                      ``spectral`` with factor 0.2 is our ``moonlight``)
``muon_extra_scale_factor``           ``extra_scale_factor``
``weight_decay`` (decoupled)          ``apply_update(..., weight_decay=...)``
``muon_split_qkv`` (default on)       group ``fused_layout=QKVLayout(...)``
====================================  =============================================

Their normalisation (``x / max(||x||_F, 1e-7)``), transpose rule (``m > n``), the scale
computed from the (split) matrix's own shape and the order "decay, then ``p -= lr*D``"
are the ones used here. Two differences remain: their momentum buffer has the
parameter's dtype (ours is fp32; identical for fp32 parameters) and their unbatched
path uses 2-D ``addmm`` where we use ``baddbmm`` (bf16 roundings may differ in the last
bit; fp32 agrees to ~1e-6).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megatron.canzona.optim.common import OptimizerState, Refresh, state_dtype_for
from megatron.canzona.optim.config import MuonConfig, resolve_dtype
from megatron.canzona.optim.newton_schulz import AllReduce, newton_schulz, newton_schulz_sharded
from megatron.canzona.planning.cost import ns_method_for


@dataclasses.dataclass
class MuonState(OptimizerState):
    """The momentum buffer, shape ``(..., m, n)``."""

    momentum: torch.Tensor | None = None

    @classmethod
    def create(
        cls, shape: torch.Size | tuple[int, ...], config: MuonConfig | None = None, *,
        device: torch.device | str | None = None, grad_dtype: torch.dtype = torch.float32,
    ) -> MuonState:
        """Zero momentum for a matrix (or stack of matrices) of ``shape``; the state does
        not depend on ``config``, which is accepted for a uniform signature."""
        return cls(momentum=torch.zeros(shape, device=device, dtype=state_dtype_for(grad_dtype)))


def muon_scale(rows: int, cols: int, mode: str, extra_scale_factor: float = 1.0) -> float:
    """Multiplier of the orthogonalised update of a ``rows x cols`` matrix.

    ``moonlight`` = 0.2 sqrt(max(m, n)) gives an update RMS close to AdamW's, so AdamW
    learning rates transfer; ``spectral``, ``shape_scaling`` and ``unit_rms_norm`` are
    emerging-optimizers' (and Megatron's) modes of the same names.
    """
    match mode:
        case "moonlight":
            scale = 0.2 * math.sqrt(max(rows, cols))
        case "spectral":
            scale = math.sqrt(max(rows, cols))
        case "shape_scaling":
            scale = math.sqrt(max(1.0, rows / cols))
        case "unit_rms_norm":
            scale = math.sqrt(rows / cols)
        case "none":
            scale = 1.0
        case _:
            raise ValueError(f"unknown Muon scale mode {mode!r}; see MuonConfig.scale_mode.")
    return scale * extra_scale_factor


@torch.no_grad()
def muon_update(
    grad: torch.Tensor, state: MuonState, config: MuonConfig, refresh: Refresh | None = None,
) -> torch.Tensor:
    """One Muon step for a matrix or a stack ``(..., m, n)``; returns the direction.

    ``refresh`` is accepted for a common signature; Muon has no preconditioner to refresh.

    ``M <- momentum*M + (1-momentum)*G``; the direction is
    ``scale * NS(M)`` (or ``NS((1-momentum)*G + momentum*M)`` with Nesterov).
    """
    assert state.momentum is not None
    grad = muon_advance(grad, state, config)
    return _direction(grad, state.momentum, config)


@torch.no_grad()
def muon_advance(grad: torch.Tensor, state: MuonState, config: MuonConfig) -> torch.Tensor:
    """Muon's state update alone: ``M <- momentum*M + (1-momentum)*G`` and the step count;
    returns ``grad`` in the momentum's dtype."""
    assert state.momentum is not None
    grad = grad.to(state.momentum.dtype)
    state.momentum.lerp_(grad, 1 - config.momentum)
    state.step += 1
    return grad


@torch.no_grad()
def muon_direction(
    grad: torch.Tensor, state: MuonState, config: MuonConfig, refresh: Refresh | None = None,
) -> torch.Tensor:
    """:func:`muon_update`'s direction without touching ``state``: the new momentum is made
    apart (the same ``lerp``, so the same values) and dropped. :func:`muon_advance` with the
    same gradient then gives the state :func:`muon_update` leaves: a step computed before it is
    known whether it is kept, and committed later."""
    assert state.momentum is not None
    grad = grad.to(state.momentum.dtype)
    return _direction(grad, state.momentum.lerp(grad, 1 - config.momentum), config)


def _direction(grad: torch.Tensor, momentum: torch.Tensor, config: MuonConfig) -> torch.Tensor:
    """``scale * NS(M)`` (or of ``G.lerp(M, momentum)`` with Nesterov) for the new momentum ``M``."""
    source = grad.lerp(momentum, config.momentum) if config.nesterov else momentum
    return _scaled(orthogonalized(source, config), config)


def orthogonalized(source: torch.Tensor, config: MuonConfig) -> torch.Tensor:
    """Newton-Schulz of Muon's ``source`` (a matrix or a stack), in ``source``'s dtype."""
    return newton_schulz(
        source, num_steps=config.num_ns_steps, coefficients=config.coefficients, dtype=resolve_dtype(config.ns_dtype),
        eps=config.eps, method=config.ns_method, measured=config.ns_measured, exact_norm=config.exact_norm,
    ).to(source.dtype)


def _scaled(orthogonal: torch.Tensor, config: MuonConfig) -> torch.Tensor:
    rows, cols = orthogonal.shape[-2:]
    return orthogonal * muon_scale(rows, cols, config.scale_mode, config.extra_scale_factor)


# --------------------------------------------------------------------------- momentum on the holders


@torch.no_grad()
def muon_source_(grad: torch.Tensor, momentum: torch.Tensor, config: MuonConfig) -> torch.Tensor:
    """Muon's elementwise part, on any slice of a matrix and its momentum (the ranks holding the
    rows of a matrix whose host computes the rest: Megatron-FSDP's shards): ``M <- momentum*M +
    (1-momentum)*G`` in place, and the Newton-Schulz input (``G.lerp(M, momentum)`` with Nesterov,
    else ``M``) written over ``grad`` (a copy of it where its dtype is not the momentum's), which
    is returned. The same operations as :func:`muon_update` on the whole matrix, so the same bits."""
    source = grad if grad.dtype == momentum.dtype else grad.to(momentum.dtype)
    momentum.lerp_(source, 1 - config.momentum)
    return source.lerp_(momentum, config.momentum) if config.nesterov else source.copy_(momentum)


@dataclasses.dataclass
class MuonSourceState(OptimizerState):
    """Muon's state on a host whose holders keep the momentum (:func:`muon_source_`): the step."""

    @classmethod
    def create(
        cls, shape: torch.Size | tuple[int, ...], config: MuonConfig | None = None, *,
        device: torch.device | str | None = None, grad_dtype: torch.dtype = torch.float32,
    ) -> MuonSourceState:
        return cls()


@torch.no_grad()
def muon_from_source(
    source: torch.Tensor, state: MuonSourceState, config: MuonConfig, refresh: Refresh | None = None,
) -> torch.Tensor:
    """:func:`muon_update`'s direction from the Newton-Schulz input its holders made
    (:func:`muon_source_`), on a host that keeps no momentum."""
    state.step += 1
    return _scaled(orthogonalized(source, config), config)


@torch.no_grad()
def muon_from_normalized(
    source: torch.Tensor, state: MuonSourceState, config: MuonConfig, refresh: Refresh | None = None,
) -> torch.Tensor:
    """:func:`muon_from_source` of a source its holders normalised, in the Newton-Schulz dtype
    (each piece divided by the whole matrix's Frobenius norm, floored at ``config.eps``, then
    cast: a narrow gather). Returns the direction in fp32."""
    state.step += 1
    orthogonal = newton_schulz(
        source, num_steps=config.num_ns_steps, coefficients=config.coefficients, dtype=resolve_dtype(config.ns_dtype),
        eps=config.eps, method=config.ns_method, measured=config.ns_measured, normalized=True,
    )
    return _scaled(orthogonal, config)


@torch.no_grad()
def muon_from_source_sharded(
    source: torch.Tensor, state: MuonSourceState, config: MuonConfig, refresh: Refresh | None = None, *,
    all_reduce: AllReduce, split_dim: int, shape: tuple[int, int],
) -> torch.Tensor:
    """:func:`muon_from_source` of one shard (or a stack of shards) of ``shape``-sized matrices whose
    side ``split_dim`` is cut among ranks that call this together, each with its shard: their
    Newton-Schulz sums the shards' Gram matrices with ``all_reduce``
    (:func:`~megatron.canzona.optim.newton_schulz.newton_schulz_sharded`; equal to the whole
    matrix's to rounding), by the method the config takes for ``shape``, and the direction is
    scaled by ``shape``'s :func:`muon_scale`. Returns this rank's shard of the direction."""
    state.step += 1
    method = ns_method_for(*shape, config.num_ns_steps, config.ns_method, config.ns_dtype, config.ns_measured)
    orthogonal = newton_schulz_sharded(
        source, all_reduce=all_reduce, split_dim=split_dim, num_steps=config.num_ns_steps,
        coefficients=config.coefficients, dtype=resolve_dtype(config.ns_dtype), eps=config.eps, method=method,
        exact_norm=config.exact_norm,
    ).to(source.dtype)
    return orthogonal * muon_scale(*shape, config.scale_mode, config.extra_scale_factor)
