"""AdamW for elementwise parameters (and Adam moments reused by Shampoo's grafting)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from megatron.canzona.optim.common import OptimizerState, state_dtype_for
from megatron.canzona.optim.config import AdamWConfig


@dataclasses.dataclass
class AdamWState(OptimizerState):
    """First and second moments, same shape as the parameter."""

    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None

    @classmethod
    def create(
        cls, shape: torch.Size | tuple[int, ...], *, device: torch.device | str | None = None,
        grad_dtype: torch.dtype = torch.float32,
    ) -> AdamWState:
        """Zero moments for a parameter (or stack) of ``shape``."""
        dtype = state_dtype_for(grad_dtype)
        return cls(
            exp_avg=torch.zeros(shape, device=device, dtype=dtype),
            exp_avg_sq=torch.zeros(shape, device=device, dtype=dtype),
        )


def adam_direction(
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    betas: tuple[float, float],
    eps: float,
    step: int,
    correct_bias: bool = True,
) -> torch.Tensor:
    """Update both moments in place with ``grad`` and return ``m_hat / (sqrt(v_hat) + eps)``.

    ``step`` is the 1-based index of this update (used for bias correction).
    """
    beta1, beta2 = betas
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.lerp_(grad.square(), 1 - beta2)
    bias1 = 1 - beta1**step if correct_bias else 1.0
    bias2 = 1 - beta2**step if correct_bias else 1.0
    return (exp_avg / bias1) / ((exp_avg_sq / bias2).sqrt() + eps)


@torch.no_grad()
def adamw_update(grad: torch.Tensor, state: AdamWState, config: AdamWConfig) -> torch.Tensor:
    """One AdamW step on any shape; returns the direction (apply with ``apply_update``)."""
    assert state.exp_avg is not None and state.exp_avg_sq is not None
    step = state.step + 1
    direction = adam_direction(
        grad.to(state.exp_avg.dtype), state.exp_avg, state.exp_avg_sq,
        betas=config.betas, eps=config.eps, step=step,
    )
    state.step = step
    return direction


@torch.no_grad()
def adamw_foreach(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], states: Sequence[AdamWState], config: AdamWConfig,
    *, lr: float, weight_decay: float,
) -> None:
    """AdamW on many parameters at once with torch's multi-tensor (``foreach``) operations.

    The arithmetic of :func:`adamw_update` followed by ``apply_update`` on each parameter, in
    the same order (bitwise equal on CPU, where the multi-tensor operations loop per tensor);
    on CUDA a handful of fused kernels replace several launches per parameter. Parameters are
    grouped by step, since bias correction depends on it."""
    by_step: dict[int, list[int]] = {}
    for i, state in enumerate(states):
        assert state.exp_avg is not None and state.exp_avg_sq is not None
        by_step.setdefault(state.step + 1, []).append(i)
    beta1, beta2 = config.betas
    for step, members in by_step.items():
        m = [states[i].exp_avg for i in members]
        v = [states[i].exp_avg_sq for i in members]
        g = [grads[i].to(states[i].exp_avg.dtype) for i in members]  # type: ignore[union-attr]
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_lerp_(v, torch._foreach_mul(g, g), 1 - beta2)
        directions = torch._foreach_div(m, 1 - beta1**step)
        denominators = torch._foreach_div(v, 1 - beta2**step)
        torch._foreach_sqrt_(denominators)
        torch._foreach_add_(denominators, config.eps)
        torch._foreach_div_(directions, denominators)
        p = [params[i] for i in members]
        if weight_decay != 0.0:
            torch._foreach_add_(p, p, alpha=-lr * weight_decay)
        torch._foreach_add_(p, [d.to(x.dtype) for d, x in zip(directions, p)], alpha=-lr)
        for i in members:
            states[i].step = step
