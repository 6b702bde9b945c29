"""AdaMuon and NorMuon: Muon whose orthogonalised momentum is normalised by a second moment.

The single-device math of emerging-optimizers 0.3.0's ``AdaptiveMuon`` (what Megatron-Core
0.19.2's ``--optimizer adaptive_muon`` wraps), for one matrix or a stack ``(..., m, n)``:

1. ``M <- momentum*M + (1-momentum)*G`` (Muon's momentum; Nesterov as in Muon);
2. ``O = NS(M)``, Newton-Schulz *without* Muon's shape scale;
3. a second moment ``V`` of ``O``, an EMA with ``beta2``:

   * ``adamuon``: elementwise, ``V <- lerp(V, O**2)``, the update ``O / (sqrt(V) + eps)``
     (AdamW's division, arXiv 2507.11005);
   * ``normuon``: per row (a matrix at least as tall as wide) or per column, ``V <- lerp(V,
     mean(O**2))`` over the longer side, the update ``O * rsqrt(max(V, eps))`` rescaled to
     ``O``'s Frobenius norm (arXiv 2510.05491);

4. Muon's shape scale, then the extra factor, on the update.

A fused matrix split into pieces (Q, K and V; gate and up) takes each piece as a matrix of its
own, its second moment included, as Canzona's Muon does; Megatron's ``TensorParallelAdaptiveMuon``
would normalise the fused matrix whole, but in 0.19.2 it stops at its first step (it never sets
the ``scale_mode`` that ``AdaptiveMuon._apply_muon_scale`` reads).

The state is Muon's momentum and ``V`` (fp32, beside it); the step advances both, so computing a
step before it is known to be kept (early compute) uses a staging copy of the state, as Shampoo
and SOAP do.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal

import torch

from megatron.canzona.optim.common import OptimizerState, Refresh, state_dtype_for
from megatron.canzona.optim.config import MuonConfig
from megatron.canzona.optim.muon import MuonState, muon_advance, muon_scale, orthogonalized

Moment2Method = Literal["adamuon", "normuon"]
MOMENT2_METHODS: tuple[str, ...] = typing.get_args(Moment2Method)


@dataclass(frozen=True, kw_only=True)
class AdaptiveMuonConfig(MuonConfig):
    """Muon's settings, and its second moment's (Megatron's ``adaptive_muon_*`` fields)."""

    moment2_method: Moment2Method = "adamuon"
    """``adamuon``: an elementwise second moment; ``normuon``: one per row or column."""
    beta2: float = 0.95
    """EMA coefficient of the second moment."""
    moment2_eps: float = 1e-8
    """``adamuon``: added to ``sqrt(V)``; ``normuon``: the floor of ``V`` and of the norm matched."""


def moment2_shape(shape: torch.Size | tuple[int, ...], method: str) -> tuple[int, ...]:
    """The second moment's shape for a gradient of ``shape`` (``(..., m, n)``): the same
    (``adamuon``), or with the longer side averaged away (``normuon``)."""
    out = list(shape)
    if method == "normuon":
        out[-1 if out[-2] >= out[-1] else -2] = 1
    return tuple(out)


@dataclasses.dataclass
class AdaptiveMuonState(MuonState):
    """Muon's momentum and the second moment of the orthogonalised update."""

    moment2: torch.Tensor | None = None

    @classmethod
    def create(
        cls, shape: torch.Size | tuple[int, ...], config: AdaptiveMuonConfig | None = None, *,
        device: torch.device | str | None = None, grad_dtype: torch.dtype = torch.float32,
    ) -> AdaptiveMuonState:
        """Zero state for a matrix (or stack) of ``shape``."""
        config = config or AdaptiveMuonConfig()
        momentum = MuonState.create(shape, device=device, grad_dtype=grad_dtype).momentum
        assert momentum is not None
        return cls(momentum=momentum, moment2=momentum.new_zeros(moment2_shape(shape, config.moment2_method)))


def adaptive_muon_update(
    grad: torch.Tensor, state: AdaptiveMuonState, config: AdaptiveMuonConfig, refresh: Refresh | None = None,
) -> torch.Tensor:
    """One AdaMuon or NorMuon step (module docstring); returns the direction. ``refresh`` is
    accepted for a common signature; nothing is refreshed."""
    assert state.momentum is not None and state.moment2 is not None
    grad = muon_advance(grad, state, config)
    source = grad.lerp(state.momentum, config.momentum) if config.nesterov else state.momentum
    return _from_source(source, state.moment2, config)


def _from_source(source: torch.Tensor, moment2: torch.Tensor, config: AdaptiveMuonConfig) -> torch.Tensor:
    """Steps 2-4 on Muon's Newton-Schulz input, ``moment2`` advanced in place."""
    update = normalized(orthogonalized(source, config), moment2, config)
    rows, cols = source.shape[-2:]
    # emerging-optimizers multiplies the shape scale, then the extra factor, in that order
    return update * muon_scale(rows, cols, config.scale_mode) * config.extra_scale_factor


@dataclasses.dataclass
class AdaptiveMuonSourceState(OptimizerState):
    """AdaMuon's or NorMuon's state on a host whose holders keep Muon's momentum
    (:func:`~megatron.canzona.optim.muon.muon_source_`): the second moment."""

    moment2: torch.Tensor | None = None

    @classmethod
    def create(
        cls, shape: torch.Size | tuple[int, ...], config: AdaptiveMuonConfig | None = None, *,
        device: torch.device | str | None = None, grad_dtype: torch.dtype = torch.float32,
    ) -> AdaptiveMuonSourceState:
        config = config or AdaptiveMuonConfig()
        return cls(moment2=torch.zeros(moment2_shape(shape, config.moment2_method), device=device,
                                       dtype=state_dtype_for(grad_dtype)))


@torch.no_grad()
def adaptive_muon_from_source(
    source: torch.Tensor, state: AdaptiveMuonSourceState, config: AdaptiveMuonConfig, refresh: Refresh | None = None,
) -> torch.Tensor:
    """:func:`adaptive_muon_update`'s direction from the Newton-Schulz input the holders made, on
    a host that keeps only the second moment."""
    assert state.moment2 is not None
    state.step += 1
    return _from_source(source, state.moment2, config)


def normalized(orthogonal: torch.Tensor, moment2: torch.Tensor, config: AdaptiveMuonConfig) -> torch.Tensor:
    """Advance the second moment ``moment2`` in place with ``orthogonal`` and return the
    normalised update (module docstring, step 3)."""
    eps = config.moment2_eps
    if config.moment2_method == "adamuon":
        moment2.lerp_(orthogonal.square(), 1 - config.beta2)
        return orthogonal / (moment2.sqrt() + eps)
    rows, cols = orthogonal.shape[-2:]
    moment2.lerp_(orthogonal.square().mean(dim=-1 if rows >= cols else -2, keepdim=True), 1 - config.beta2)
    update = orthogonal * moment2.clamp_min(eps).rsqrt()
    # keep the orthogonalised update's Frobenius norm (each matrix of a stack its own)
    norms = torch.linalg.vector_norm(orthogonal, dim=(-2, -1), keepdim=True)
    return update * (norms / torch.linalg.vector_norm(update, dim=(-2, -1), keepdim=True).clamp_min(eps))
