"""Pieces shared by the update functions: state containers, stacking, applying an update.

Conventions every update function follows:

* ``grad`` has shape ``(..., m, n)``; leading dimensions are a stack of independent
  same-shape matrices and a single matrix has none. Elementwise optimizers accept any shape.
* The state is a small mutable dataclass of tensors with the same leading dimensions,
  updated in place; ``step`` counts completed updates and is shared by the whole stack.
* The function returns a *direction* ``D`` in the state dtype; the caller applies
  ``p <- p - lr*wd*p - lr*D`` with :func:`apply_update` (decoupled weight decay).
* State is fp32 whatever the gradient dtype (bf16 parameters included), except that
  fp64 gradients get fp64 state so that the math can be checked against fp64 references.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Self, TypeVar

import torch


def state_dtype_for(grad_dtype: torch.dtype) -> torch.dtype:
    """Dtype of optimizer state for gradients of ``grad_dtype``: fp32, or fp64 for fp64."""
    return torch.float64 if grad_dtype == torch.float64 else torch.float32


def refresh_due(step: int, frequency: int) -> bool:
    """Whether the 1-based ``step`` recomputes a preconditioner: steps 1, 1+f, 1+2f, ..."""
    return (step - 1) % frequency == 0


@dataclasses.dataclass
class OptimizerState:
    """Base of the per-optimizer state dataclasses; ``None`` marks an absent tensor."""

    step: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for ``torch.optim.Optimizer.state`` (absent tensors omitted)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: value for name, value in values.items() if value is not None}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Self:
        """Inverse of :meth:`as_dict`; the tensors are shared, not copied."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise ValueError(
                f"{cls.__name__} has no fields {sorted(unknown)}; was this state saved by "
                "another optimizer?"
            )
        return cls(**values)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The present tensor fields, by name."""
        return {k: v for k, v in self.as_dict().items() if isinstance(v, torch.Tensor)}


StateT = TypeVar("StateT", bound=OptimizerState)


def stack_states(states: list[StateT]) -> StateT:
    """Stack same-structure states along a new leading dimension (copies the tensors)."""
    first = states[0]
    if any(s.step != first.step for s in states):
        raise ValueError("stack_states needs states at the same step; bucket them by step first.")
    fields: dict[str, Any] = {"step": first.step}
    for name in first.tensors():
        fields[name] = torch.stack([getattr(s, name) for s in states])
    return type(first).from_dict(fields)


def unstack_into(stacked: StateT, states: list[StateT]) -> None:
    """Copy a stacked state back into the per-item states it was built from."""
    for index, state in enumerate(states):
        for name, value in stacked.tensors().items():
            getattr(state, name).copy_(value[index])
        state.step = stacked.step


@torch.no_grad()
def apply_update(param: torch.Tensor, direction: torch.Tensor, *, lr: float, weight_decay: float) -> None:
    """``p <- p - lr*wd*p - lr*direction``, in place, in the parameter's dtype.

    The weight-decay term is applied first and as ``p.add_(p, alpha=-lr*wd)``, the
    same operations in the same order as emerging-optimizers' decoupled weight decay
    (which Megatron-Core's Muon uses), so both round identically.
    """
    if weight_decay != 0.0:
        param.add_(param, alpha=-lr * weight_decay)
    param.add_(direction.to(param.dtype), alpha=-lr)


def symmetric_eigh(matrix: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues and eigenvectors of symmetric ``(..., k, k)``, largest first, in ``dtype``.

    The input is symmetrised first because a Gram matrix accumulated in floating point
    is symmetric only up to rounding, and ``eigh`` reads one triangle.
    """
    work = matrix.to(dtype)
    work = 0.5 * (work + work.mT)
    values, vectors = torch.linalg.eigh(work)
    return values.flip(-1), vectors.flip(-1)
