"""A Frobenius norm whose bits do not depend on how the matrix is cut or summed.

A floating-point sum depends on its order: a matrix's squares summed per piece on the ranks that
hold its rows, then over those ranks, differ in their last bits from one device's sum of the whole
matrix, and so does every element divided by the norm. Here each square becomes an integer,
exactly, and integers add to the same total in any order: a piece's sum, the sum over the ranks
(an all-reduce of int64) and one device's sum of the whole matrix, in any chunks, are the same
bits. Newton-Schulz's input divided by this norm is then the same wherever it is divided.

How:

1. ``|x| < 2**e`` for the matrix's largest magnitude (:func:`largest_magnitude`; a maximum is exact
   in any order, so over ranks an all-reduce of ``MAX``);
2. each square, exact in fp64 (an fp32 square has 48 significant bits), is scaled by ``2**s``,
   ``s = 62 - 2e`` (:func:`square_shift`): below ``2**62``, exactly;
3. truncated to int64 (its floor) and split into a high word ``floor(v) >> 31`` and a low word
   ``floor(v) mod 2**31``, both below ``2**31``, each summed in int64: the sums of up to ``2**31``
   elements stay below ``2**62`` (:func:`square_sums`);
4. the total, ``high * 2**31 + low``, back in fp64, times ``2**-s``, its square root in fp64, then fp32
   (:func:`norm_from_sums`).

What step 3 drops is under ``2**-s`` per square, ``n * 2**-s`` for ``n`` elements, against a total of at
least ``max**2 >= 2**(60 - s)``: a relative error below ``n * 2**-60`` (``2**-33`` at ``2**27`` elements, a
Qwen3-8B fused fc1; ``2**-29`` at most), far below fp32's own ``2**-24``, which a sum of fp32 squares in
fp32 exceeds. Nothing depends on the matrix's size but that bound, so a rank needs only its pieces and
the maximum. The powers of two are built from their bits, so no ``pow`` rounds them. fp64 inputs are
refused: their squares are not exact in fp64.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

Reduce = Callable[[torch.Tensor, str], None]
"""Reduces a tensor in place over the ranks holding the other pieces: ``reduce(tensor, "max")``
(fp32) or ``reduce(tensor, "sum")`` (int64); every one of them calls it with the same shapes, in the
same order."""

SCALE_BITS = 62
"""Every square scaled by ``2**s`` (:func:`square_shift`) lies below ``2**SCALE_BITS``."""
LOW_BITS = 31
"""Bits of the low word; the high word has the other ``SCALE_BITS - LOW_BITS``."""
LOW_MASK = (1 << LOW_BITS) - 1
MAX_ELEMENTS = 2**31
"""Matrices of up to this many elements: both words' sums then stay below ``2**62``."""
CHUNK = 1 << 22
"""Elements scaled at a time (a workspace of an fp64 and an int64 buffer of this many, 64 MiB, made once
per call and reused for every chunk); the sum does not depend on it."""


def largest_magnitude(rows: torch.Tensor) -> torch.Tensor:
    """The largest ``|x|`` of each row of a ``(B, N)`` tensor, in fp32 (no ``abs`` copy)."""
    return torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg()).to(torch.float32)


def square_shift(largest: torch.Tensor) -> torch.Tensor:
    """The int64 ``s`` of each matrix, from its largest magnitude (one value per matrix, the same on
    every rank holding a piece of it)."""
    exponent = torch.frexp(largest.to(torch.float32)).exponent.to(torch.int64)  # |x| < 2**exponent
    return SCALE_BITS - 2 * exponent


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0**exponent`` in fp64, exact: its bits written (exponents within fp64's normal range)."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def square_sums(rows: torch.Tensor, shift: torch.Tensor, *, chunk: int = CHUNK) -> torch.Tensor:
    """``(B, 2)`` int64: each row's squares scaled by ``2**shift[row]``, summed exactly as a high and a
    low word. ``rows``: ``(B, N)``, fp32 or narrower (a matrix, a stack of them flattened, or
    pieces of one); the sums of pieces add up to the whole's, in any order and any chunks.

    ``shift`` is even (:func:`square_shift`), so each element times ``2**(shift/2)`` is exact in fp64
    and its square is the scaled square, exactly; truncated to int64 (below ``2**62``) it is its floor,
    whose top bits above 31 are the high word and the rest the low: five passes over the chunk, in a
    workspace made once per call."""
    if rows.dtype == torch.float64:
        raise ValueError("an exact norm squares fp32 (or narrower) elements; fp64 squares are not exact in fp64")
    count, numel = rows.shape
    half = _pow2(torch.div(shift.reshape(count, 1), 2, rounding_mode="floor"))
    out = torch.zeros(count, 2, dtype=torch.int64, device=rows.device)
    step = max(1, chunk // max(count, 1))
    width = min(step, numel)
    # one workspace for every chunk (a fresh tensor per pass costs a CPU its pages' first touch each time)
    squares = torch.empty(count, width, dtype=torch.float64, device=rows.device)
    floors = torch.empty(count, width, dtype=torch.int64, device=rows.device)
    for start in range(0, numel, step):
        n = min(step, numel - start)
        scaled, floor = squares[:, :n], floors[:, :n]
        torch.mul(rows[:, start : start + n], half, out=scaled).square_()  # fp64 product: exact
        floor.copy_(scaled)  # below 2**62: truncated to its floor
        top = scaled.view(torch.int64)  # the squares are in the floors now: their room takes the high words
        out[:, 0] += torch.bitwise_right_shift(floor, LOW_BITS, out=top).sum(dim=1)
        out[:, 1] += floor.bitwise_and_(LOW_MASK).sum(dim=1)
    return out


def norm_from_sums(sums: torch.Tensor, shift: torch.Tensor, floor: float) -> torch.Tensor:
    """The fp32 norms of matrices from their :func:`square_sums` (over every piece) and
    :func:`square_shift`, floored at ``floor``."""
    total = sums[..., 0].to(torch.float64).mul(2.0**LOW_BITS).add_(sums[..., 1].to(torch.float64))
    return total.mul_(_pow2(-shift)).sqrt_().to(torch.float32).clamp_min_(floor)


def frobenius_norm(stack: torch.Tensor, floor: float) -> torch.Tensor:
    """The norm of each trailing ``(m, n)`` matrix of ``stack``, floored at ``floor``: shaped
    ``(..., 1, 1)``, fp32, the same bits as :func:`norm_from_sums` of any cut of it into pieces."""
    *lead, rows, cols = stack.shape
    if rows * cols > MAX_ELEMENTS:
        raise ValueError(f"an exact norm sums at most {MAX_ELEMENTS} elements, got a {rows} x {cols} matrix")
    flat = stack.reshape(-1, rows * cols)
    shift = square_shift(largest_magnitude(flat))
    return norm_from_sums(square_sums(flat, shift), shift, floor).view(*lead, 1, 1)


def norms_of_pieces(pieces: Iterable[tuple[int, torch.Tensor]], count: int, floor: float, *,
                    reduce: Reduce | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """The fp32 norms of ``count`` matrices, each cut into pieces among ranks, from this rank's
    ``pieces`` (``(matrix index, piece)``, any shape), floored at ``floor``: the largest magnitudes
    taken over the ranks by ``reduce(..., "max")``, the integer sums summed by ``reduce(..., "sum")``
    (``None``: this rank holds every piece). The same bits as :func:`frobenius_norm` of each whole
    matrix; two collectives of ``count`` values (no host synchronisation)."""
    pieces = [(index, piece.reshape(1, -1)) for index, piece in pieces if piece.numel()]
    largest = torch.zeros(count, dtype=torch.float32, device=device)
    for index, flat in pieces:
        torch.maximum(largest[index : index + 1], largest_magnitude(flat), out=largest[index : index + 1])
    if reduce is not None:
        reduce(largest, "max")
    shift = square_shift(largest)
    sums = torch.zeros(count, 2, dtype=torch.int64, device=device)
    for index, flat in pieces:
        sums[index] += square_sums(flat, shift[index : index + 1])[0]
    if reduce is not None:
        reduce(sums, "sum")
    return norm_from_sums(sums, shift, floor)
