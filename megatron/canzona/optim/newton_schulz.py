"""Newton-Schulz orthogonalisation with selectable odd-polynomial coefficient schedules.

One Newton-Schulz step maps ``X -> a X + (b A + c A^2) X`` with ``A = X X^T``. On the
singular values this is the scalar polynomial ``p(s) = a s + b s^3 + c s^5``, applied to
each one independently, so the whole iteration is characterised by what the composed
polynomial does on ``(0, 1]`` (the input is first divided by its Frobenius norm, which
bounds every singular value by 1). :func:`singular_value_band` computes that image, which
is the band the singular values of the output fall in.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from megatron.canzona.planning.cost import gram_runs, ns_method_for

Coefficients = tuple[float, float, float]


@dataclass(frozen=True)
class NSSchedule:
    """A per-iteration list of ``(a, b, c)`` and what to do after the list runs out."""

    coefficients: tuple[Coefficients, ...]
    after_last: Literal["cycle", "repeat_last"]
    source: str

    def iterate(self, num_steps: int) -> Iterator[Coefficients]:
        """Yield the ``(a, b, c)`` of each of ``num_steps`` iterations."""
        if self.after_last == "cycle":
            base: Iterator[Coefficients] = itertools.cycle(self.coefficients)
        else:
            base = itertools.chain(self.coefficients, itertools.repeat(self.coefficients[-1]))
        return itertools.islice(base, num_steps)


def _polar_express() -> tuple[Coefficients, ...]:
    # Amsel et al. 2025 (arXiv 2505.16932), Algorithm 1, degree 5, l = 1e-3: the
    # published optimal polynomials. The paper divides each polynomial but the last by
    # 1.01 evaluated at s = 1.01 (a/1.01, b/1.01^3, c/1.01^5) so that rounding errors
    # that push a singular value slightly above 1 cannot blow up; we apply it here.
    published = (
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
        (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
        (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    )
    safe = tuple((a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in published)
    return safe + ((1.875, -1.25, 0.375),)


NS_COEFFICIENTS: dict[str, NSSchedule] = {
    "quintic": NSSchedule(
        coefficients=((3.4445, -4.7750, 2.0315),),
        after_last="cycle",
        source="Keller Jordan's Muon; emerging-optimizers calls it 'simple'",
    ),
    "quintic_schedule": NSSchedule(
        coefficients=(
            (4.0848, -6.8946, 2.9270),
            (3.9505, -6.3029, 2.6377),
            (3.7418, -5.5913, 2.3037),
            (2.8769, -3.1427, 1.2046),
            (2.8366, -3.0525, 1.2012),
        ),
        after_last="cycle",
        source="per-step tuned quintics (modded-nanogpt); emerging-optimizers calls it 'quintic'",
    ),
    "polar_express": NSSchedule(
        coefficients=_polar_express(),
        after_last="repeat_last",
        source="Polar Express, Amsel et al. 2025, with the paper's 1.01 safety factor",
    ),
    "polar_express_4dp": NSSchedule(
        # The table emerging-optimizers 0.3.0 (hence Megatron-Core 0.19.2) ships: the
        # values above to 4 decimals, except a = 8.2051 where rounding gives 8.2052.
        coefficients=(
            (8.2051, -22.9019, 16.4607),
            (4.0664, -2.8612, 0.5184),
            (3.9096, -2.8234, 0.5250),
            (3.2856, -2.4153, 0.4853),
            (2.2779, -1.6198, 0.3985),
            (1.8726, -1.2307, 0.3585),
            (1.8564, -1.2132, 0.3568),
            (1.8750, -1.2500, 0.3750),
        ),
        after_last="repeat_last",
        source="Polar Express as emerging-optimizers 0.3.0 ships it (for matching Megatron)",
    ),
    "cubic": NSSchedule(
        coefficients=((1.5, -0.5, 0.0),),
        after_last="cycle",
        source="classical cubic Newton-Schulz; converges to U V^T, slowly for small s",
    ),
}
"""Registry of Newton-Schulz coefficient schedules, by name.

How to add one: insert ``NS_COEFFICIENTS["name"] = NSSchedule(coefficients=((a, b, c), ...),
after_last="cycle" | "repeat_last", source="where the numbers come from")`` before building a
:class:`~megatron.canzona.optim.config.MuonConfig` that names it, then check its
:func:`singular_value_band` for the step count you intend to use.
"""

EMERGING_OPTIMIZERS_COEFFICIENTS: dict[str, str] = {
    "simple": "quintic",
    "quintic": "quintic_schedule",
    "polar_express": "polar_express_4dp",
}
"""Megatron-Core 0.19.2 / emerging-optimizers ``coefficient_type`` -> our registry key.

Megatron's ``--muon-coefficient-type quintic`` is *not* our ``"quintic"``: theirs is the
five-step tuned schedule, ours is the single (3.4445, -4.7750, 2.0315) triple they call
``"simple"``. Map through this dict when reproducing a Megatron run.
"""


def newton_schulz(
    x: torch.Tensor,
    *,
    num_steps: int = 5,
    coefficients: str = "quintic",
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
    method: str = "standard",
    gram_restart_every: int | None = None,
) -> torch.Tensor:
    """Approximately orthogonalise each trailing ``(m, n)`` matrix of ``x``.

    Leading dimensions are a stack of independent matrices, computed in one batched
    matmul per product. The input is normalised by its Frobenius norm (floored at
    ``eps``) in at least fp32, transposed when ``m > n`` so that the Gram matrix is the
    small ``min(m, n)`` square, then iterated in ``dtype``: on the matrix (``method``
    ``"standard"``), on its Gram matrix (``"gram"``, :func:`gram_iterations`), or by the one
    the cost model finds cheaper for the shape (``"auto"``,
    :func:`~megatron.canzona.planning.cost.ns_method_for`). ``gram_restart_every`` overrides
    the dtype's restart interval of gram (for measuring it: ``tools/ns_band.py``).

    Returns:
        A tensor of the same shape in ``float32`` (``float64`` when ``dtype`` is float64).
    """
    if x.ndim < 2:
        raise ValueError(f"newton_schulz needs a (..., m, n) tensor, got shape {tuple(x.shape)}.")
    schedule = NS_COEFFICIENTS[coefficients]
    dtype_name = str(dtype).removeprefix("torch.")
    method = ns_method_for(x.shape[-2], x.shape[-1], num_steps, method, dtype_name)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    transpose = x.shape[-2] > x.shape[-1]
    if transpose:
        x = x.mT
    rows, cols = x.shape[-2:]
    stack = x.to(out_dtype).reshape(-1, rows, cols)
    norm = torch.linalg.matrix_norm(stack, keepdim=True).clamp_min(eps)
    X = (stack / norm).to(dtype)
    steps = list(schedule.iterate(num_steps))
    if method == "gram":
        X = gram_iterations(X, steps, gram_runs(num_steps, dtype_name, gram_restart_every))
    else:
        X = _standard_iterations(X, steps)
    out = X.to(out_dtype).reshape(*x.shape[:-2], rows, cols)
    return out.mT if transpose else out


def _polynomial(gram: torch.Tensor, b: float, c: float) -> torch.Tensor:
    """``b A + c A²`` of a stack of Gram matrices, one batched product."""
    if c != 0.0:
        return torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
    # torch 2.14's CPU bf16 baddbmm with alpha=0 returns garbage for k > 16.
    return gram * b


def _standard_iterations(X: torch.Tensor, steps: list[Coefficients]) -> torch.Tensor:
    for a, b, c in steps:
        # The same three batched GEMMs whether the stack holds one matrix or many, so a
        # batched call reproduces the looped result kernel for kernel.
        X = torch.baddbmm(X, _polynomial(torch.bmm(X, X.mT), b, c), X, beta=a, alpha=1.0)
    return X


def _symmetric(matrix: torch.Tensor) -> torch.Tensor:
    """``(M + Mᵀ) / 2``: what is symmetric in exact arithmetic stays so after rounding."""
    return torch.add(matrix, matrix.mT).mul_(0.5)


def gram_iterations(X: torch.Tensor, steps: list[Coefficients], runs: list[int]) -> torch.Tensor:
    """Newton-Schulz on the Gram matrix of the ``(k, n, m)`` stack ``X`` (``n <= m``).

    Every iterate is a polynomial in the first Gram matrix times the input,
    ``X_j = Q_j X_0``, and ``Q_j`` commutes with every Gram matrix ``A_j = X_j X_jᵀ``. So a
    step ``X -> (a I + b A + c A²) X`` is, with ``P = a I + b A + c A²``, the n×n updates
    ``Q <- P Q`` and ``A <- P A P``, and ``X_0`` is multiplied by ``Q`` once at the end of a
    run. Between ``runs`` of steps (reduced precision,
    :data:`~megatron.canzona.planning.cost.GRAM_RESTART_EVERY`) the iterate is formed and its Gram
    matrix taken again, which bounds the growth of ``Q`` and so its rounding. ``A`` and ``Q``
    are symmetrised after each product.
    """
    start = 0
    for length in runs:
        run, start = steps[start:start + length], start + length
        gram = _symmetric(torch.bmm(X, X.mT))
        accumulated = None
        for index, (a, b, c) in enumerate(run):
            poly = _polynomial(gram, b, c)
            poly.diagonal(dim1=-2, dim2=-1).add_(a)
            accumulated = poly if accumulated is None else _symmetric(torch.bmm(poly, accumulated))
            if index + 1 < len(run):
                gram = _symmetric(torch.bmm(torch.bmm(poly, gram), poly))
        X = torch.bmm(accumulated, X)
    return X


SPECTRUM_KINDS: tuple[str, ...] = ("random", "ill", "rank_deficient")


def spectrum_matrix(rows: int, cols: int, kind: str, seed: int) -> torch.Tensor:
    """A float64 test input for Newton-Schulz: Gaussian (``random``), ill-conditioned
    (``ill``: singular values log-spaced from 1 down to 1e-4) or rank-deficient
    (``rank_deficient``: from 1 to 1e-2, the lower half zero), reproducible from ``seed``."""
    if kind not in SPECTRUM_KINDS:
        raise ValueError(f"unknown input kind {kind!r}; choose one of {SPECTRUM_KINDS}")
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randn(rows, cols, dtype=torch.float64, generator=gen)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, dtype=torch.float64, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(cols, k, dtype=torch.float64, generator=gen))
    s = torch.logspace(0, -4 if kind == "ill" else -2, k, dtype=torch.float64)
    if kind == "rank_deficient":
        s[k // 2:] = 0.0
    return (u * s) @ v.T


def singular_value_band(
    coefficients: str,
    num_steps: int,
    *,
    lower: float = 1e-3,
    upper: float = 1.0,
    num_points: int = 20001,
) -> tuple[float, float]:
    """Range of output singular values for normalised inputs in ``[lower, upper]``.

    Newton-Schulz applies the same scalar polynomial to every singular value, so the
    image of the interval under ``num_steps`` compositions is exact up to the grid (a
    log-spaced grid of ``num_points``; the composed polynomial is smooth on it).
    """
    if not 0 < lower <= upper:
        raise ValueError(f"need 0 < lower <= upper, got lower={lower}, upper={upper}.")
    s = torch.logspace(math.log10(lower), math.log10(upper), num_points, dtype=torch.float64)
    for a, b, c in NS_COEFFICIENTS[coefficients].iterate(num_steps):
        s = a * s + b * s**3 + c * s**5
    return float(s.min()), float(s.max())
