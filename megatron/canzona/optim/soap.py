"""SOAP (Vyas et al. 2024, arXiv 2409.11321): Adam in the eigenbasis of Shampoo's statistics.

Per step ``t`` (1-based) for ``G`` of shape ``(m, n)``:

1. ``L <- b L + (1-b) G G^T``, ``R <- b R + (1-b) G^T G``;
2. at ``t = 1`` the bases ``Q_L``, ``Q_R`` are the eigenvectors of ``L``, ``R`` (eigh,
   largest eigenvalue first); at ``t = 1 + k f`` they are refreshed: the columns of the
   old basis are re-ordered by the approximate eigenvalues ``diag(Q^T L Q)`` (the Adam
   second moment is permuted the same way, as in the paper's code), then one
   power-iteration step ``Q <- QR(L Q)`` (or a fresh eigh with ``refresh="eigh"``); the
   first moment is rotated from the old basis into the new one;
3. Adam in the rotated space: ``G' = Q_L^T G Q_R``, moments ``M'``, ``V'``, direction
   ``Q_L (M_hat' / (sqrt(V_hat') + eps)) Q_R^T``.

A side longer than ``max_precond_dim`` keeps the identity basis and no statistic.

Ordering: statistics take the current gradient *before* the refresh and the projection,
as in emerging-optimizers (the SOAP that Megatron-Core 0.19.2 uses), so step 1 is already
a preconditioned step. The paper's reference code instead skips step 1 and updates the
statistics after the parameter update. With ``precondition_frequency=1`` and
``refresh="eigh"`` this is exactly Adam in the current exact eigenbasis.

Numerics: at step 1 the statistics are exactly ``G G^T`` and ``G^T G``, so ``G'`` is
diagonal up to the rounding of the eigenvectors, and Adam's ``G' / (|G'| + eps)`` turns
that rounding into O(1) entries when it exceeds ``eps`` (fp32 eigh and gradient entries
above ~0.1). emerging-optimizers behaves identically; learning-rate warm-up makes the
first step negligible. Rank-deficient statistics (non-square matrices, early steps) have
arbitrary null-space eigenvectors, so results that differ only in rounding can re-order
the second moment differently at the next refresh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megatron.canzona.optim.adamw import adam_direction
from megatron.canzona.optim.common import KroneckerState, Refresh, keep_failed, refresh_members, robust_eigh
from megatron.canzona.optim.config import SOAPConfig, resolve_dtype


@dataclasses.dataclass
class SOAPState(KroneckerState):
    """Statistics and eigenbases per side (``None`` for a side past ``max_precond_dim``)
    and Adam's moments in the rotated space, shape ``(..., m, n)``."""

    basis_left: torch.Tensor | None = None
    basis_right: torch.Tensor | None = None

    @classmethod
    def fresh(cls, lead: tuple[int, ...], rows: int, cols: int, config: SOAPConfig, zeros: Callable) -> SOAPState:
        """Zero statistics and moments and identity bases; none for a side past ``max_precond_dim``."""

        def square(size: int, identity: bool) -> torch.Tensor | None:
            if size > config.max_precond_dim:
                return None
            matrix = zeros(*lead, size, size)
            if identity:
                matrix.diagonal(dim1=-2, dim2=-1).fill_(1.0)
            return matrix

        return cls(
            left=square(rows, False), right=square(cols, False),
            basis_left=square(rows, True), basis_right=square(cols, True),
            exp_avg=zeros(*lead, rows, cols), exp_avg_sq=zeros(*lead, rows, cols),
        )


def rotate(
    x: torch.Tensor, basis_left: torch.Tensor | None, basis_right: torch.Tensor | None
) -> torch.Tensor:
    """Into the eigenbasis: ``Q_L^T x Q_R`` (a missing side is the identity)."""
    if basis_left is not None:
        x = basis_left.mT @ x
    return x @ basis_right if basis_right is not None else x


def rotate_back(
    x: torch.Tensor, basis_left: torch.Tensor | None, basis_right: torch.Tensor | None
) -> torch.Tensor:
    """Out of the eigenbasis: ``Q_L x Q_R^T`` (a missing side is the identity)."""
    if basis_left is not None:
        x = basis_left @ x
    return x @ basis_right.mT if basis_right is not None else x


def _sort_basis(statistic: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Indices ordering the basis columns by descending ``diag(Q^T S Q)``, shape ``(..., k)``."""
    approx_eigenvalues = ((basis.mT @ statistic) * basis.mT).sum(-1)
    return torch.argsort(approx_eigenvalues, dim=-1, descending=True)


def _eigenbasis(statistic: torch.Tensor, previous: torch.Tensor, config: SOAPConfig, failed: list[int]) -> torch.Tensor:
    """Eigenvectors of ``statistic``, largest first; members whose eigendecomposition fails
    (also on retry) keep ``previous`` and are appended to ``failed``."""
    _, vectors, broken = robust_eigh(statistic, resolve_dtype(config.eigh_dtype))
    failed.extend(broken)
    return keep_failed(vectors.to(previous.dtype), previous, broken)


def _refresh_side(
    statistic: torch.Tensor, basis: torch.Tensor, exp_avg_sq: torch.Tensor, axis: int,
    config: SOAPConfig, first: bool, failed: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """New basis for one side and ``exp_avg_sq`` permuted along ``axis`` (-2 rows, -1 cols)."""
    if first:
        # The moments are still zero at step 1: nothing to re-order.
        return _eigenbasis(statistic, basis, config, failed), exp_avg_sq
    order = _sort_basis(statistic, basis)
    basis = torch.gather(basis, -1, order.unsqueeze(-2).expand_as(basis))
    index = order.unsqueeze(-1) if axis == -2 else order.unsqueeze(-2)
    exp_avg_sq = torch.gather(exp_avg_sq, axis, index.expand_as(exp_avg_sq))
    if config.refresh == "eigh":
        # A member that fails keeps its re-ordered basis, consistent with its permuted moment.
        return _eigenbasis(statistic, basis, config, failed), exp_avg_sq
    for _ in range(config.power_iter_steps):
        basis = torch.linalg.qr(statistic @ basis).Q
    return basis, exp_avg_sq


def _refresh(state: SOAPState, config: SOAPConfig, first: bool) -> list[int]:
    """Refresh the bases (replacing their tensors) and rotate the moments into them; the flat
    members whose eigendecomposition failed and kept their previous basis."""
    assert state.exp_avg is not None and state.exp_avg_sq is not None
    exp_avg = rotate_back(state.exp_avg, state.basis_left, state.basis_right)
    exp_avg_sq = state.exp_avg_sq
    failed: list[int] = []
    if state.left is not None and state.basis_left is not None:
        state.basis_left, exp_avg_sq = _refresh_side(
            state.left, state.basis_left, exp_avg_sq, -2, config, first, failed
        )
    if state.right is not None and state.basis_right is not None:
        state.basis_right, exp_avg_sq = _refresh_side(
            state.right, state.basis_right, exp_avg_sq, -1, config, first, failed
        )
    state.exp_avg.copy_(rotate(exp_avg, state.basis_left, state.basis_right))
    state.exp_avg_sq.copy_(exp_avg_sq)
    return sorted(set(failed))


@torch.no_grad()
def soap_update(
    grad: torch.Tensor, state: SOAPState, config: SOAPConfig, refresh: Refresh | None = None,
) -> torch.Tensor:
    """One SOAP step for a matrix or a stack ``(..., m, n)``; returns the direction.

    ``refresh`` says which stack members refresh their bases this step (default: all of them
    at steps 1, 1+f, ...). A refresh of the whole state replaces ``state.basis_left`` /
    ``basis_right`` by new tensors, one of some members writes into them; every other state
    tensor is updated in place. A member whose eigendecomposition fails (also in fp64 with a
    diagonal shift) keeps its previous basis and is added to ``refresh.failed``.
    """
    assert state.exp_avg is not None and state.exp_avg_sq is not None
    grad = grad.to(state.exp_avg.dtype)
    step = state.step + 1
    beta = config.shampoo_beta
    if config.correct_shampoo_beta_bias:
        beta = 1 - (1 - beta) / (1 - beta**step)
    if state.left is not None:
        state.left.lerp_(grad @ grad.mT, 1 - beta)
    if state.right is not None:
        state.right.lerp_(grad.mT @ grad, 1 - beta)
    refresh_members(
        state, refresh, step, config.precondition_frequency, stacked=grad.ndim > 2,
        recompute=lambda part: _refresh(part, config, first=step == 1),
    )
    rotated = rotate(grad, state.basis_left, state.basis_right)
    adam = adam_direction(
        rotated, state.exp_avg, state.exp_avg_sq,
        betas=config.betas, eps=config.eps, step=step, correct_bias=config.correct_bias,
    )
    state.step = step
    return rotate_back(adam, state.basis_left, state.basis_right)
