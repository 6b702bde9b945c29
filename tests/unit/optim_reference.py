"""Shared helpers for the optimizer tests that compare against NumPy float64 references."""

from __future__ import annotations

import numpy as np
import torch


def make_grads(shape: tuple[int, ...], num: int, seed: int = 0) -> list[torch.Tensor]:
    """``num`` float64 Gaussian gradients of ``shape``, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, dtype=torch.float64, generator=gen) for _ in range(num)]


def max_rel_err(got: list[torch.Tensor], expected: list[np.ndarray]) -> float:
    """Largest relative Frobenius error of ``got`` against the reference arrays."""
    return max(
        float(np.linalg.norm(g.double().numpy() - e) / np.linalg.norm(e)) for g, e in zip(got, expected)
    )



def batched_and_looped(update, state_type, config, grads: list[torch.Tensor]):
    """Per step of ``grads`` (each a stack ``(k, m, n)``): the update of the whole stack, and
    the same update applied to each member on its own, stacked. States in the grads' dtype."""
    shape, dtype = grads[0].shape, grads[0].dtype
    batched_state = state_type.create(shape, config, grad_dtype=dtype)
    looped_states = [state_type.create(shape[1:], config, grad_dtype=dtype) for _ in range(shape[0])]
    for g in grads:
        batched = update(g, batched_state, config)
        yield batched, torch.stack([update(g[i], s, config) for i, s in enumerate(looped_states)])


def batched_minus_looped(update, state_type, config, shape: tuple[int, ...], steps: int, seed: int) -> float:
    """Largest relative Frobenius difference of :func:`batched_and_looped` over ``steps``
    fp32 Gaussian gradients of ``shape`` and the members of the stack."""
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(shape, generator=gen) for _ in range(steps)]
    return max(
        float((torch.linalg.matrix_norm(batched - looped) / torch.linalg.matrix_norm(looped)).max())
        for batched, looped in batched_and_looped(update, state_type, config, grads)
    )
