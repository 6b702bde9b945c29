"""Shampoo for matrices, with Adam grafting, on one matrix or a stack of them.

Per step, for ``G`` of shape ``(m, n)`` (``t`` is the 1-based step):

* statistics ``L <- b L + (1-b) G G^T`` and ``R <- b R + (1-b) G^T G`` (or plain sums);
  a side longer than ``max_precond_dim`` keeps only the diagonal (row or column sums of
  ``G*G``) and is preconditioned elementwise;
* at steps 1, 1+f, 1+2f, ... the inverse roots ``P_L = (L + eps)^(-1/r)`` and
  ``P_R = (R + eps)^(-1/r)`` are recomputed from an eigendecomposition in ``root_dtype``
  (negative eigenvalues from rounding are clamped to 0 before ``eps`` is added); the
  optimizers stagger these steps per matrix (a :class:`~megatron.canzona.optim.common.Refresh`
  says which members of a stack refresh). An eigendecomposition that fails is retried in
  fp64 with a diagonal shift; a matrix for which that fails too keeps its previous roots;
* first moment ``M <- mu M + (1-mu) G``, bias-corrected to ``M_hat``;
* direction ``S = P_L M_hat P_R``; with Adam grafting it is rescaled per matrix to
  ``||A||_F`` where ``A = M_hat / (sqrt(V_hat) + graft_eps)`` is Adam's direction from the
  same first moment and ``V <- b2 V + (1-b2) G*G``. Grafting is what makes the step size
  independent of the statistics' scale, so the statistics need no bias correction.

``eps`` is absolute by default (``lambda + eps``); ``eps_mode="relative"`` adds
``eps * lambda_max`` of each matrix, which does not depend on the gradient scale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megatron.canzona.optim.adamw import adam_direction
from megatron.canzona.optim.common import KroneckerState, Refresh, keep_failed, refresh_members, robust_eigh
from megatron.canzona.optim.config import ShampooConfig, resolve_dtype


@dataclasses.dataclass
class ShampooState(KroneckerState):
    """Statistics, their inverse roots, and the (grafting) Adam moments.

    ``left``/``left_root`` are ``(..., m, m)``, or ``(..., m)`` when ``m`` exceeds
    ``max_precond_dim`` (diagonal fallback); likewise ``right`` with ``n``; ``exp_avg_sq``
    only with Adam grafting.
    """

    left_root: torch.Tensor | None = None
    right_root: torch.Tensor | None = None

    @classmethod
    def fresh(cls, lead: tuple[int, ...], rows: int, cols: int, config: ShampooConfig, zeros: Callable) -> ShampooState:
        """Zero statistics, roots and moments; a side past ``max_precond_dim`` is a diagonal."""

        def side(size: int) -> torch.Tensor:
            return zeros(*lead, size) if size > config.max_precond_dim else zeros(*lead, size, size)

        return cls(
            left=side(rows), right=side(cols), left_root=side(rows), right_root=side(cols),
            exp_avg=zeros(*lead, rows, cols), exp_avg_sq=zeros(*lead, rows, cols) if config.grafting == "adam" else None,
        )


def _accumulate(statistic: torch.Tensor, grad: torch.Tensor, config: ShampooConfig) -> None:
    """Fold ``grad grad^T`` (rows side; pass ``grad.mT`` for columns) into ``statistic``."""
    is_diagonal = statistic.ndim == grad.ndim - 1
    outer = grad.square().sum(-1) if is_diagonal else grad @ grad.mT
    if config.statistics == "sum":
        statistic.add_(outer)
    else:
        statistic.lerp_(outer, 1 - config.shampoo_beta)


def _regularised(values: torch.Tensor, config: ShampooConfig) -> torch.Tensor:
    values = values.clamp_min(0.0)
    if config.eps_mode == "relative":
        return values + config.eps * values.amax(-1, keepdim=True)
    return values + config.eps


def inverse_root(
    statistic: torch.Tensor, config: ShampooConfig, *, diagonal: bool,
    previous: torch.Tensor | None = None, failed: list[int] | None = None,
) -> torch.Tensor:
    """``(statistic + eps)^(-1/r)``: of a dense ``(..., k, k)`` statistic through its
    eigendecomposition, or elementwise of a diagonal ``(..., k)`` one.

    Members whose eigendecomposition fails (:func:`~megatron.canzona.optim.common.robust_eigh`)
    take ``previous`` (zeros without it) and their flat indices are appended to ``failed``."""
    exponent = -1.0 / config.inverse_root
    work_dtype = resolve_dtype(config.root_dtype)
    if diagonal:
        return _regularised(statistic.to(work_dtype), config).pow(exponent).to(statistic.dtype)
    values, vectors, broken = robust_eigh(statistic, work_dtype)
    powered = _regularised(values, config).pow(exponent)
    root = ((vectors * powered.unsqueeze(-2)) @ vectors.mT).to(statistic.dtype)
    if failed is not None:
        failed.extend(broken)
    return keep_failed(root, torch.zeros_like(root) if previous is None else previous, broken)


def _refresh_roots(state: ShampooState, config: ShampooConfig, ndim: int) -> list[int]:
    """Recompute both inverse roots in place; the flat members whose roots were kept."""
    assert state.left is not None and state.right is not None
    assert state.left_root is not None and state.right_root is not None
    failed: list[int] = []
    for statistic, root in ((state.left, state.left_root), (state.right, state.right_root)):
        # A statistic with one dimension fewer than the gradient is a diagonal fallback.
        root.copy_(inverse_root(statistic, config, diagonal=statistic.ndim < ndim, previous=root, failed=failed))
    return sorted(set(failed))


def _precondition(
    direction: torch.Tensor, left_root: torch.Tensor, right_root: torch.Tensor
) -> torch.Tensor:
    if left_root.ndim == direction.ndim - 1:
        direction = left_root.unsqueeze(-1) * direction
    else:
        direction = left_root @ direction
    if right_root.ndim == direction.ndim - 1:
        return direction * right_root.unsqueeze(-2)
    return direction @ right_root


@torch.no_grad()
def shampoo_update(
    grad: torch.Tensor, state: ShampooState, config: ShampooConfig, refresh: Refresh | None = None,
) -> torch.Tensor:
    """One Shampoo step for a matrix or a stack ``(..., m, n)``; returns the direction.

    ``refresh`` says which stack members recompute their roots this step (default: all of
    them at steps 1, 1+f, ...); members whose roots could not be computed are added to its
    ``failed`` and keep their previous roots."""
    assert state.left is not None and state.right is not None and state.exp_avg is not None
    assert state.left_root is not None and state.right_root is not None
    grad = grad.to(state.exp_avg.dtype)
    step = state.step + 1
    _accumulate(state.left, grad, config)
    _accumulate(state.right, grad.mT, config)
    refresh_members(
        state, refresh, step, config.precondition_frequency, stacked=grad.ndim > 2,
        recompute=lambda part: _refresh_roots(part, config, grad.ndim),
    )
    beta1 = config.momentum
    if config.grafting == "adam":
        assert state.exp_avg_sq is not None
        graft = adam_direction(
            grad, state.exp_avg, state.exp_avg_sq,
            betas=(beta1, config.graft_beta2), eps=config.graft_eps, step=step,
        )
    else:
        state.exp_avg.lerp_(grad, 1 - beta1)
    first_moment = state.exp_avg / (1 - beta1**step)
    direction = _precondition(first_moment, state.left_root, state.right_root)
    if config.grafting == "adam":
        tiny = torch.finfo(direction.dtype).tiny
        ratio = torch.linalg.matrix_norm(graft, keepdim=True) / torch.linalg.matrix_norm(
            direction, keepdim=True
        ).clamp_min(tiny)
        direction = direction * ratio
    state.step = step
    return direction
