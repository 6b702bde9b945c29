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
