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
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from megatron.canzona.optim.exact_norm import frobenius_norm, norms_of_pieces
from megatron.canzona.planning.cost import gram_runs, ns_method_for

Coefficients = tuple[float, float, float]
AllReduce = Callable[..., None]
"""Sums a tensor in place over the ranks that share a matrix (:func:`newton_schulz_sharded`):
every one of them calls it with the same shapes, in the same order. With the exact norm it is also
called as ``all_reduce(tensor, "max")`` and ``all_reduce(tensor, "sum")``
(:data:`~megatron.canzona.optim.exact_norm.Reduce`)."""
Gram = Callable[[torch.Tensor], torch.Tensor]
"""``X -> X Xᵀ`` of a ``(k, n, m)`` stack: the local product, or its sum over the ranks sharing X."""


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


def load_schedules(path: Path) -> dict[str, NSSchedule]:
    """The schedules of a TOML file of tables ``name = {coefficients, after_last, source,
    safety_factor?}`` (``ns_coefficients.toml`` describes the fields)."""
    with open(path, "rb") as f:
        tables = tomllib.load(f)
    schedules = {}
    for name, table in tables.items():
        triples = [(float(a), float(b), float(c)) for a, b, c in table["coefficients"]]
        factor = table.get("safety_factor")
        if factor is not None:
            triples[:-1] = [(a / factor, b / factor**3, c / factor**5) for a, b, c in triples[:-1]]
        schedules[name] = NSSchedule(tuple(triples), table["after_last"], table["source"])
    return schedules


NS_COEFFICIENTS: dict[str, NSSchedule] = load_schedules(Path(__file__).with_name("ns_coefficients.toml"))
"""Registry of Newton-Schulz coefficient schedules, by name.

The schedules are data, in ``ns_coefficients.toml`` beside this module. How to add one: a table
there, or ``NS_COEFFICIENTS["name"] = NSSchedule(coefficients=((a, b, c), ...),
after_last="cycle" | "repeat_last", source="where the numbers come from")`` before building a
:class:`~megatron.canzona.optim.config.MuonConfig` that names it; then check its
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
    measured: tuple[tuple[int, int, str], ...] = (),
    normalized: bool = False,
    exact_norm: bool = False,
) -> torch.Tensor:
    """Approximately orthogonalise each trailing ``(m, n)`` matrix of ``x``.

    Leading dimensions are a stack of independent matrices, computed in one batched
    matmul per product. The input is normalised by its Frobenius norm (floored at
    ``eps``) in at least fp32, transposed when ``m > n`` so that the Gram matrix is the
    small ``min(m, n)`` square, then iterated in ``dtype``: on the matrix (``method``
    ``"standard"``), on its Gram matrix (``"gram"``, :func:`gram_iterations`), or by the one
    the cost model finds cheaper for the shape (``"auto"``,
    :func:`~megatron.canzona.planning.cost.ns_method_for`). ``gram_restart_every`` overrides
    the dtype's restart interval of gram (for measuring it: ``tools/ns_band.py``); ``measured``
    gives ``auto`` the faster method of measured shapes (:attr:`MuonConfig.ns_measured`).
    ``normalized``: ``x`` is that normalised input already, in ``dtype`` (its holders divided
    their pieces by the whole matrix's norm: a narrow gather), iterated as it is. ``exact_norm``:
    the norm summed in integers (:func:`~megatron.canzona.optim.exact_norm.frobenius_norm`), the
    same bits as its holders' sum of their pieces.

    Returns:
        A tensor of the same shape in ``float32`` (``float64`` when ``dtype`` is float64).
    """
    if x.ndim < 2:
        raise ValueError(f"newton_schulz needs a (..., m, n) tensor, got shape {tuple(x.shape)}.")
    schedule = NS_COEFFICIENTS[coefficients]
    dtype_name = str(dtype).removeprefix("torch.")
    method = ns_method_for(x.shape[-2], x.shape[-1], num_steps, method, dtype_name, measured)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    transpose = x.shape[-2] > x.shape[-1]
    if transpose:
        x = x.mT
    rows, cols = x.shape[-2:]
    if normalized:
        if x.dtype != dtype:
            raise ValueError(f"a normalised Newton-Schulz input must be in the iteration's dtype {dtype}, got {x.dtype}")
        X = x.reshape(-1, rows, cols)
    else:
        stack = x.to(out_dtype).reshape(-1, rows, cols)
        norm = (frobenius_norm(stack, eps) if exact_norm
                else torch.linalg.matrix_norm(stack, keepdim=True).clamp_min(eps))
        X = (stack / norm).to(dtype)
    steps = list(schedule.iterate(num_steps))
    if method == "gram":
        X = gram_iterations(X, steps, gram_runs(num_steps, dtype_name, gram_restart_every))
    else:
        X = _standard_iterations(X, steps)
    out = X.to(out_dtype).reshape(*x.shape[:-2], rows, cols)
    return out.mT if transpose else out


def newton_schulz_sharded(
    x: torch.Tensor,
    *,
    all_reduce: AllReduce,
    split_dim: int,
    num_steps: int = 5,
    coefficients: str = "quintic",
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
    method: str = "standard",
    exact_norm: bool = False,
) -> torch.Tensor:
    """:func:`newton_schulz` of a matrix (or stack) whose side ``split_dim`` (-2: rows, -1:
    columns) is cut among ranks, each calling this with its slice ``x`` and the same arguments;
    returns this rank's slice of the result.

    Newton-Schulz multiplies on the left by polynomials of ``X Xᵀ`` (equally, on the right by
    ones of ``Xᵀ X``), so with the cut side as ``X``'s columns the Gram matrix is the sum of the
    slices' own and each rank updates its own columns. Per step (``standard``) or per run between
    restarts (``gram``) that sum is one ``all_reduce`` of an ``n × n`` matrix, ``n`` the uncut
    side, reduced in fp32 (fp64 for fp64) from the slices' products in ``dtype``; the Frobenius
    norm is one more, of a scalar per matrix. The cut side should be the long one: the products on
    the ``n``-square run on every rank (:func:`~megatron.canzona.planning.cost.sharded_ns_flops`).
    ``method`` is ``standard`` or ``gram``, the same on every rank (``auto`` would decide per
    slice). The sums run in another order than one device's products, so the result equals
    :func:`newton_schulz` of the whole matrix to rounding, not bit for bit. ``exact_norm``: the norm
    summed in integers over the slices (two collectives instead of one), bit for bit one device's.
    """
    if x.ndim < 2:
        raise ValueError(f"newton_schulz_sharded needs a (..., m, n) tensor, got shape {tuple(x.shape)}.")
    if split_dim not in (-2, -1, x.ndim - 2, x.ndim - 1):
        raise ValueError(f"split_dim must name one of the last two dimensions (-2: rows, -1: columns), got {split_dim}")
    if method not in ("standard", "gram"):
        raise ValueError(f"a sharded Newton-Schulz runs 'standard' or 'gram' on every rank, got {method!r}")
    schedule = NS_COEFFICIENTS[coefficients]
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    transpose = split_dim in (-2, x.ndim - 2)  # rows cut: iterate on the transpose, whose columns are cut
    if transpose:
        x = x.mT
    rows, cols = x.shape[-2:]
    stack = x.to(out_dtype).reshape(-1, rows, cols)
    if exact_norm:
        norm = norms_of_pieces(enumerate(stack), len(stack), eps, reduce=all_reduce, device=stack.device).view(-1, 1, 1)
    else:
        squares = stack.square().sum(dim=(-2, -1), keepdim=True)
        all_reduce(squares)
        norm = squares.sqrt().clamp_min(eps)
    X = (stack / norm).to(dtype)

    def gram(X: torch.Tensor) -> torch.Tensor:
        total = torch.bmm(X, X.mT).to(out_dtype)
        all_reduce(total)
        return total.to(dtype)

    steps = list(schedule.iterate(num_steps))
    if method == "gram":
        X = gram_iterations(X, steps, gram_runs(num_steps, str(dtype).removeprefix("torch.")), gram)
    else:
        X = _standard_iterations(X, steps, gram)
    out = X.to(out_dtype).reshape(*x.shape[:-2], rows, cols)
    return out.mT if transpose else out


def _local_gram(X: torch.Tensor) -> torch.Tensor:
    return torch.bmm(X, X.mT)


def _polynomial(gram: torch.Tensor, b: float, c: float) -> torch.Tensor:
    """``b A + c A²`` of a stack of Gram matrices, one batched product."""
    if c != 0.0:
        return torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
    # torch 2.14's CPU bf16 baddbmm with alpha=0 returns garbage for k > 16.
    return gram * b


def _standard_iterations(X: torch.Tensor, steps: list[Coefficients], gram: Gram = _local_gram) -> torch.Tensor:
    for a, b, c in steps:
        # The same three batched GEMMs whether the stack holds one matrix or many, so a
        # batched call reproduces the looped result kernel for kernel.
        X = torch.baddbmm(X, _polynomial(gram(X), b, c), X, beta=a, alpha=1.0)
    return X


def _symmetric(matrix: torch.Tensor) -> torch.Tensor:
    """``(M + Mᵀ) / 2``: what is symmetric in exact arithmetic stays so after rounding."""
    return torch.add(matrix, matrix.mT).mul_(0.5)


def gram_iterations(X: torch.Tensor, steps: list[Coefficients], runs: list[int],
                    gram_of: Gram = _local_gram) -> torch.Tensor:
    """Newton-Schulz on the Gram matrix of the ``(k, n, m)`` stack ``X`` (``n <= m``).

    Every iterate is a polynomial in the first Gram matrix times the input,
    ``X_j = Q_j X_0``, and ``Q_j`` commutes with every Gram matrix ``A_j = X_j X_jᵀ``. So a
    step ``X -> (a I + b A + c A²) X`` is, with ``P = a I + b A + c A²``, the n×n updates
    ``Q <- P Q`` and ``A <- P A P``, and ``X_0`` is multiplied by ``Q`` once at the end of a
    run. Between ``runs`` of steps (reduced precision,
    :data:`~megatron.canzona.planning.cost.GRAM_RESTART_EVERY`) the iterate is formed and its Gram
    matrix taken again, which bounds the growth of ``Q`` and so its rounding. ``A`` and ``Q``
    are symmetrised after each product. ``gram_of`` forms each run's first Gram matrix.
    """
    start = 0
    for length in runs:
        run, start = steps[start:start + length], start + length
        gram = _symmetric(gram_of(X))
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
