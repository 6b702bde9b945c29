"""The exact Frobenius norm (``optim/exact_norm.py``): the same bits however the matrix is cut into
pieces, summed in whatever order and chunks; within one fp32 rounding of the fp64 norm; and
Newton-Schulz of pieces each divided by it (a narrow gather) bitwise Newton-Schulz of the whole
matrix with ``exact_norm``."""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron.canzona.optim.exact_norm import (
    _pow2,
    frobenius_norm,
    largest_magnitude,
    norm_from_sums,
    norms_of_pieces,
    square_shift,
    square_sums,
)
from megatron.canzona.optim.newton_schulz import newton_schulz

pytestmark = pytest.mark.quick

EPS = 1e-7


def awkward(rows: int, cols: int, seed: int) -> torch.Tensor:
    """An fp32 matrix spanning many binades: Gaussian entries at scales 1e-30 to 1e6, an outlier,
    exact zeros and subnormals."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator)
    x *= torch.pow(10.0, torch.randint(-30, 7, (rows, cols), generator=generator).float())
    x.view(-1)[:: 7] = 0.0
    x.view(-1)[3] = 1e-44  # subnormal
    x.view(-1)[5] = -3e6
    return x


def pieces_sum(flat: torch.Tensor, cuts: list[int], shift: torch.Tensor) -> torch.Tensor:
    parts = [square_sums(flat[:, a:b], shift, chunk=1 + (a % 97)) for a, b in zip(cuts, cuts[1:])]
    random.Random(len(cuts)).shuffle(parts)
    total = torch.zeros_like(parts[0])
    for part in parts:
        total += part
    return total


@pytest.mark.parametrize("seed", range(4))
def test_any_cut_in_any_order_and_chunks_sums_to_the_same_bits(seed: int) -> None:
    x = awkward(37, 53, seed)
    flat = x.reshape(1, -1)
    shift = square_shift(largest_magnitude(flat))
    whole = square_sums(flat, shift)
    rng = random.Random(seed)
    for _ in range(5):
        cuts = sorted({0, x.numel(), *(rng.randrange(1, x.numel()) for _ in range(rng.randrange(1, 12)))})
        assert torch.equal(pieces_sum(flat, cuts, shift), whole)
    assert torch.equal(square_sums(flat, shift, chunk=5), whole)
    # the largest magnitude over the pieces is the whole's (a maximum, exact in any order)
    largest = torch.stack([largest_magnitude(flat[:, a:b]) for a, b in zip(cuts, cuts[1:])]).amax()
    assert torch.equal(largest, largest_magnitude(flat)[0])
    assert torch.equal(norm_from_sums(whole, shift, EPS).view(1, 1, 1), frobenius_norm(x.unsqueeze(0), EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_within_one_fp32_rounding_of_the_fp64_norm(dtype: torch.dtype) -> None:
    for seed in range(6):
        x = (awkward(29, 41, seed) if seed % 2 else torch.randn(3, 64, 48, generator=torch.Generator().manual_seed(seed))).to(dtype)
        got = frobenius_norm(x, EPS)
        want = torch.linalg.matrix_norm(x.to(torch.float64), keepdim=True)
        # rounding the fp64 norm to fp32: half an ulp; the dropped low bits: below n * 2**-60 relative
        assert ((got.double() - want).abs() / want).max() <= 2.0**-24 + 2.0**-40, seed


def test_a_matrix_of_zeros_takes_the_floor_and_sizes_are_bounded() -> None:
    assert frobenius_norm(torch.zeros(2, 4, 5), EPS).flatten().tolist() == [pytest.approx(EPS)] * 2
    tiny = torch.full((3, 3), 1e-40)
    assert frobenius_norm(tiny, 0.0).item() == pytest.approx(3e-40, rel=1e-6)
    with pytest.raises(ValueError, match="at most 2147483648 elements"):
        frobenius_norm(torch.empty(2**16, 2**15 + 1, device="meta"), EPS)
    with pytest.raises(ValueError, match="fp64 squares are not exact"):
        square_sums(torch.ones(1, 4, dtype=torch.float64), torch.zeros(1, dtype=torch.int64))


def test_powers_of_two_are_exact_over_the_range_used() -> None:
    exponents = torch.arange(-1022, 1024)
    assert _pow2(exponents).tolist() == [math.ldexp(1.0, e) for e in range(-1022, 1024)]


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_newton_schulz_of_pieces_divided_by_it_is_the_whole_matrixs(shape: tuple[int, int]) -> None:
    """What a narrow gather does: each holder divides its rows (any cut of the flattened matrix) by the
    norm made from every piece's sums, rounds to bf16; the host iterates the matrix as it is."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    flat = x.reshape(-1)
    cuts = [0, 100, 101, 517, flat.numel()]
    pieces = [flat[a:b] for a, b in zip(cuts, cuts[1:])]
    largest = torch.stack([largest_magnitude(p.view(1, -1))[0] for p in pieces]).amax().view(1)
    shift = square_shift(largest)
    sums = sum(square_sums(p.view(1, -1), shift) for p in pieces)
    norm = norm_from_sums(sums, shift, EPS)
    sent = torch.cat([torch.div(p, norm, out=torch.empty(p.shape, dtype=torch.bfloat16)) for p in pieces])
    narrow = newton_schulz(sent.view(shape), normalized=True)
    assert torch.equal(narrow, newton_schulz(x, exact_norm=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_exact_norm_is_the_same_bits_on_cuda() -> None:
    """Integer sums and IEEE fp64 steps: a GPU's norm of a matrix, whole or in pieces, is the CPU's."""
    x = awkward(301, 517, 7)
    want = frobenius_norm(x.unsqueeze(0), EPS).flatten()
    assert torch.equal(frobenius_norm(x.cuda().unsqueeze(0), EPS).flatten().cpu(), want)
    flat = x.cuda().reshape(-1)
    pieces = [(0, flat[a:b]) for a, b in ((0, 1000), (1000, 99_999), (99_999, flat.numel()))]
    assert torch.equal(norms_of_pieces(pieces, 1, EPS, device="cuda").cpu(), want)
