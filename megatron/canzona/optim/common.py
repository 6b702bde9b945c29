"""Pieces shared by the update functions: state containers, refresh schedules, applying an update.

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
import functools
import logging
import zlib
from collections.abc import Callable
from typing import Any, Self

import torch

EIGH_RETRY_SHIFT = 1e-6
"""A failed eigendecomposition is retried in fp64 on ``S + shift * mean(|diag S|) * I``
(the shift is taken off the eigenvalues again; the eigenvectors are those of ``S``)."""


def state_dtype_for(grad_dtype: torch.dtype) -> torch.dtype:
    """Dtype of optimizer state for gradients of ``grad_dtype``: fp32, or fp64 for fp64."""
    return torch.float64 if grad_dtype == torch.float64 else torch.float32


def refresh_due(step: int, frequency: int, offset: int = 0) -> bool:
    """Whether the 1-based ``step`` recomputes a preconditioner: step 1, then steps
    ``1 + offset + k f`` (``k >= 0``); with ``offset = 0`` steps 1, 1+f, 1+2f, ..."""
    return step == 1 or (step - 1 - offset) % frequency == 0


def refresh_offset(name: str, frequency: int) -> int:
    """The step offset of a matrix's preconditioner refreshes, in ``[0, frequency)``.

    It depends on the matrix's name only, so every layout (any DP, TP, PP, a single device,
    a resharded resume) refreshes a matrix in the same steps, while different matrices
    spread their refreshes over the ``frequency`` steps instead of all refreshing at once.
    """
    return zlib.crc32(name.encode()) % frequency


@dataclasses.dataclass
class Refresh:
    """Which members of a stack recompute their preconditioner in this step.

    ``due`` has one flag per member of the leading (stack) dimension, or one flag for a
    single matrix. The update function appends to ``failed`` the members whose
    eigendecomposition failed even on retry; those keep their previous preconditioner.
    """

    due: tuple[bool, ...]
    failed: list[int] = dataclasses.field(default_factory=list)


def refresh_parts(refresh: Refresh | None, step: int, frequency: int, stacked: bool) -> list[slice | None]:
    """The parts of a state to refresh at ``step``: ``None`` for the whole state, else runs of
    consecutive stack members (a caller that orders a stack by refresh offset gets one run).
    Without ``refresh`` every member follows :func:`refresh_due` with offset 0."""
    if refresh is None:
        return [None] if refresh_due(step, frequency) else []
    if all(refresh.due):
        return [None]
    if not stacked or not any(refresh.due):
        return []
    parts, start = [], None
    for index, due in enumerate((*refresh.due, False)):
        if due and start is None:
            start = index
        elif not due and start is not None:
            parts.append(slice(start, index))
            start = None
    return parts


def report_failures(refresh: Refresh | None, members: list[int], step: int) -> None:
    """Hand the members whose refresh failed to the caller's ``refresh`` (which names them),
    or log them when there is none."""
    if not members:
        return
    if refresh is not None:
        refresh.failed.extend(members)
        return
    logging.getLogger("megatron.canzona.optim").warning(
        "step %d: the eigendecomposition of stack members %s did not converge, also in fp64 with a "
        "diagonal shift; they keep their previous preconditioner", step, members,
    )


def part_start(part: slice | None) -> int:
    """First stack member of a part of :func:`refresh_parts`."""
    return 0 if part is None else part.start


def refresh_members(
    state: OptimizerState, refresh: Refresh | None, step: int, frequency: int, *, stacked: bool,
    recompute: Callable[[Any], list[int]],
) -> None:
    """Run ``recompute`` on each part of ``state`` due at ``step`` (as views of the stack,
    with the tensors it replaced copied back) and hand the members it reports failed, as
    indices of the whole stack, to ``refresh`` (or the log)."""
    for part in refresh_parts(refresh, step, frequency, stacked=stacked):
        sub = state.select(part)
        failed = recompute(sub)
        state.write_back(part, sub)
        report_failures(refresh, [part_start(part) + index for index in failed], step)


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

    def select(self, part: slice | None) -> Self:
        """Members ``part`` of a stacked state as views (``None``: this state itself)."""
        if part is None:
            return self
        return type(self).from_dict({**self.as_dict(), **{k: v[part] for k, v in self.tensors().items()}})

    def write_back(self, part: slice | None, sub: OptimizerState) -> None:
        """Copy the tensors that an update replaced in ``sub = self.select(part)`` into this
        state (views that were updated in place need nothing)."""
        if part is None:
            return
        for name, value in sub.tensors().items():
            target = getattr(self, name)[part]
            if value.data_ptr() != target.data_ptr():  # replaced, not updated in place
                target.copy_(value)


@dataclasses.dataclass
class KroneckerState(OptimizerState):
    """Base of the states with a statistic per side of a ``(..., m, n)`` matrix, ``left``
    ``(..., m, m)`` and ``right`` ``(..., n, n)`` (or smaller, per optimizer), and Adam's
    moments of the matrix's shape."""

    left: torch.Tensor | None = None
    right: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None

    @classmethod
    def create(
        cls, shape: torch.Size | tuple[int, ...], config: Any, *,
        device: torch.device | str | None = None, grad_dtype: torch.dtype = torch.float32,
    ) -> Self:
        """The state of a fresh matrix (or stack) of ``shape``, in :func:`state_dtype_for`."""
        *lead, rows, cols = shape
        dtype = state_dtype_for(grad_dtype)
        return cls.fresh(tuple(lead), rows, cols, config, functools.partial(torch.zeros, device=device, dtype=dtype))

    @classmethod
    def fresh(cls, lead: tuple[int, ...], rows: int, cols: int, config: Any, zeros: Callable[..., torch.Tensor]) -> Self:
        """Each optimizer's fresh state for a stack ``lead`` of ``(rows, cols)`` matrices;
        ``zeros(*dims)`` makes a tensor on the state's device and dtype."""
        raise NotImplementedError


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


def robust_eigh(matrix: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """:func:`symmetric_eigh` that does not raise: ``(values, vectors, failed)``.

    When the (batched) eigendecomposition fails to converge, each member is retried alone
    in fp64 with a diagonal shift (:data:`EIGH_RETRY_SHIFT`). Members that fail even so are
    listed in ``failed`` (flat indices over the leading dimensions) and get zero values and
    identity vectors, which the caller must not use: it keeps the previous preconditioner.
    """
    try:
        values, vectors = symmetric_eigh(matrix, dtype)
        return values, vectors, []
    except torch.linalg.LinAlgError:
        pass
    size = matrix.shape[-1]
    flat = matrix.reshape(-1, size, size)
    eye = torch.eye(size, dtype=torch.float64, device=matrix.device)
    values = torch.zeros(flat.shape[:-1], dtype=dtype, device=matrix.device)
    vectors = eye.to(dtype).expand_as(flat).clone()
    failed = []
    for index, member in enumerate(flat):
        work = member.to(torch.float64)
        work = 0.5 * (work + work.mT)
        shift = EIGH_RETRY_SHIFT * work.diagonal().abs().mean().clamp_min(torch.finfo(torch.float64).tiny)
        try:
            member_values, member_vectors = torch.linalg.eigh(work + shift * eye)
        except torch.linalg.LinAlgError:
            failed.append(index)
            continue
        values[index] = (member_values - shift).flip(-1).to(dtype)
        vectors[index] = member_vectors.flip(-1).to(dtype)
    return values.reshape(matrix.shape[:-1]), vectors.reshape(matrix.shape), failed


def keep_failed(new: torch.Tensor, previous: torch.Tensor, failed: list[int]) -> torch.Tensor:
    """``new`` (shape ``(..., k, k)``) with the flat members ``failed`` taken from ``previous``."""
    if not failed:
        return new
    out = new.reshape(-1, *new.shape[-2:]).clone()
    old = previous.reshape(-1, *previous.shape[-2:])
    for index in failed:
        out[index] = old[index]
    return out.reshape(new.shape)
