"""Newton-Schulz against its definition: a polynomial applied to the singular values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from megatron.canzona.optim import NS_COEFFICIENTS, newton_schulz, singular_value_band
from megatron.canzona.optim.newton_schulz import spectrum_matrix
from megatron.canzona.planning.cost import AUTO_GRAM_FLOP_RATIO, AUTO_GRAM_MIN_SIDE, gram_runs, ns_flops, ns_method_for

pytestmark = pytest.mark.quick

# Relative Frobenius error of newton_schulz against the float64 SVD reference.
# fp64: only rounding of ~5 GEMM chains on O(1) entries (seen: <1e-14).
NS_RTOL_FP64 = 1e-12
# fp32: unit roundoff 6e-8 grown over 15 dependent GEMMs of width <= 100 (seen: <3e-6).
NS_RTOL_FP32 = 1e-5
# bf16: unit roundoff 4e-3 per GEMM output, 15 GEMMs (seen over 10 seeds: quintic sets
# <2e-2; Polar Express <9e-2, its first polynomial has coefficients up to 23 which
# amplify the rounding of s^3 and s^5).
NS_RTOL_BF16 = 4e-2
NS_RTOL_BF16_POLAR_EXPRESS = 0.15
# Absolute slack on the singular-value band: fp32 rounding (seen <1e-5); bf16 rounding of
# O(1) singular values through 5 steps (seen <0.03).
BAND_SLACK_FP32 = 1e-4
# bf16 rounding compounds through the iteration: the slack grows with the step count.
BAND_SLACK_BF16_PER_STEP = 0.03  # worst seen over 1500 random cases: 0.021

SHAPES = [(32, 48), (48, 32), (40, 40), (8, 100), (100, 8)]
COEFFICIENTS = ["quintic", "quintic_schedule", "polar_express", "polar_express_4dp", "cubic"]


def reference_newton_schulz(g: np.ndarray, coefficients: str, num_steps: int) -> np.ndarray:
    """NS(G) = U p_k(S / ||G||_F) V^T in float64, from the SVD of G."""
    u, s, vt = np.linalg.svd(np.asarray(g, dtype=np.float64), full_matrices=False)
    s = s / np.linalg.norm(g)
    for a, b, c in NS_COEFFICIENTS[coefficients].iterate(num_steps):
        s = a * s + b * s**3 + c * s**5
    return (u * s) @ vt


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("coefficients", COEFFICIENTS)
@pytest.mark.parametrize(
    ("dtype", "rtol"),
    [(torch.float64, NS_RTOL_FP64), (torch.float32, NS_RTOL_FP32), (torch.bfloat16, NS_RTOL_BF16)],
)
def test_matches_svd_reference(shape, coefficients, dtype, rtol):
    if dtype == torch.bfloat16 and coefficients.startswith("polar_express"):
        rtol = NS_RTOL_BF16_POLAR_EXPRESS
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = reference_newton_schulz(x.numpy(), coefficients, 5)
    got = newton_schulz(x, num_steps=5, coefficients=coefficients, dtype=dtype).double().numpy()
    assert rel_err(got, expected) < rtol


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(2, 40),
    cols=st.integers(2, 40),
    coefficients=st.sampled_from(["quintic", "quintic_schedule", "polar_express"]),
    num_steps=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_singular_values_stay_in_the_documented_band(rows, cols, coefficients, num_steps, seed):
    x = torch.randn(rows, cols, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    s_in = torch.linalg.svdvals(x) / torch.linalg.matrix_norm(x)
    low, high = singular_value_band(
        coefficients, num_steps, lower=max(float(s_in.min()), 1e-12), upper=float(s_in.max())
    )
    for dtype, slack in ((torch.float32, BAND_SLACK_FP32), (torch.bfloat16, BAND_SLACK_BF16_PER_STEP * num_steps)):
        out = newton_schulz(x, num_steps=num_steps, coefficients=coefficients, dtype=dtype)
        s_out = torch.linalg.svdvals(out.double())
        assert low - slack <= float(s_out.min()) and float(s_out.max()) <= high + slack


def test_documented_bands_for_five_steps():
    # The numbers quoted in the docs: inputs with normalised singular values in
    # [1e-3, 1] (condition number up to 1000).
    assert singular_value_band("quintic", 5) == pytest.approx((0.4705, 1.2024), abs=1e-4)
    assert singular_value_band("polar_express", 5) == pytest.approx((0.8462, 1.1236), abs=1e-4)
    assert singular_value_band("quintic", 5, lower=1e-2) == pytest.approx((0.6818, 1.1344), abs=1e-4)


@pytest.mark.parametrize("shape", [(32, 48), (48, 32), (40, 40), (16, 96)])
@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_orthogonal_input_stays_nearly_orthogonal(shape, coefficients, method):
    q, _ = torch.linalg.qr(torch.randn(max(shape), min(shape), generator=torch.Generator().manual_seed(1)))
    q = q if shape[0] >= shape[1] else q.T
    # Every normalised singular value equals 1/sqrt(min(m, n)); NS maps them all alike.
    s0 = 1.0 / min(shape) ** 0.5
    low, high = singular_value_band(coefficients, 5, lower=s0, upper=s0)
    out = newton_schulz(q, num_steps=5, coefficients=coefficients, dtype=torch.float32, method=method)
    s_out = torch.linalg.svdvals(out)
    assert float(s_out.min()) == pytest.approx(low, abs=BAND_SLACK_FP32)
    assert float(s_out.max()) == pytest.approx(high, abs=BAND_SLACK_FP32)
    # Same direction as the input: out = c * q up to rounding.
    scale = float(s_out.mean())
    assert torch.linalg.matrix_norm(out - scale * q) / torch.linalg.matrix_norm(out) < 1e-4
    # Polar Express after 8 steps is orthogonal to within its design tolerance.
    if coefficients == "polar_express":
        out8 = newton_schulz(q, num_steps=8, coefficients=coefficients, dtype=torch.float32, method=method)
        gram = out8 @ out8.mT if shape[0] <= shape[1] else out8.mT @ out8
        assert torch.allclose(gram, torch.eye(min(shape)), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_batched_equals_looped(dtype, shape):
    x = torch.randn(5, *shape, generator=torch.Generator().manual_seed(2))
    batched = newton_schulz(x, dtype=dtype)
    looped = torch.stack([newton_schulz(x[i], dtype=dtype) for i in range(5)])
    # Same kernels on every slice: identical up to at most last-bit differences.
    assert torch.allclose(batched, looped, rtol=0, atol=1e-6)


def test_extra_leading_dims_and_zero_input():
    x = torch.randn(2, 3, 8, 12, generator=torch.Generator().manual_seed(3))
    out = newton_schulz(x, dtype=torch.float32)
    assert out.shape == x.shape
    assert torch.allclose(out[1, 2], newton_schulz(x[1, 2], dtype=torch.float32), atol=1e-6)
    # eps keeps an all-zero gradient at zero instead of producing NaNs.
    assert torch.equal(newton_schulz(torch.zeros(4, 6)), torch.zeros(4, 6))


def test_cubic_in_bf16_on_wide_matrices():
    # Regression: torch 2.14's CPU bf16 baddbmm ignores alpha=0 for k > 16, which used to
    # turn the cubic (c = 0) into a divergent iteration.
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(4))
    out = newton_schulz(x, num_steps=5, coefficients="cubic", dtype=torch.bfloat16)
    expected = reference_newton_schulz(x.double().numpy(), "cubic", 5)
    assert rel_err(out.double().numpy(), expected) < NS_RTOL_BF16


def test_rejects_vectors():
    with pytest.raises(ValueError, match="needs a"):
        newton_schulz(torch.ones(5))


# --- Gram Newton-Schulz (method="gram") and the choice between the two ("auto")

# Band slack of gram: fp32 (seen <1.6e-3 over the inputs below, Polar Express on the
# ill-conditioned 16 x 160: the accumulated polynomial Q multiplies the smallest singular
# values by up to ~1000, and its fp32 rounding with them; standard <2e-5); bf16 with its
# restarts every 2 steps (seen <0.07, standard <0.06).
GRAM_BAND_SLACK_FP32 = 5e-3
GRAM_BAND_SLACK_BF16 = 0.15
# fp64: gram and standard evaluate the same polynomial in a different order (seen <1e-12).
GRAM_FP64_ATOL = 1e-10
ASPECTS = [(24, 24), (16, 32), (16, 80), (16, 160), (160, 16)]


@pytest.mark.parametrize("coefficients", COEFFICIENTS)
@pytest.mark.parametrize("shape", ASPECTS)
@pytest.mark.parametrize("kind", ["random", "ill", "rank_deficient"])
def test_gram_equals_standard_in_fp64(coefficients, shape, kind):
    x = spectrum_matrix(*shape, kind, seed=1)
    gram = newton_schulz(x, coefficients=coefficients, dtype=torch.float64, method="gram")
    standard = newton_schulz(x, coefficients=coefficients, dtype=torch.float64, method="standard")
    assert float((gram - standard).abs().max()) < GRAM_FP64_ATOL


@pytest.mark.parametrize("coefficients", ["quintic", "quintic_schedule", "polar_express", "polar_express_4dp"])
@pytest.mark.parametrize("shape", ASPECTS)
@pytest.mark.parametrize("kind", ["random", "ill", "rank_deficient"])
@pytest.mark.parametrize(("dtype", "slack"), [(torch.float32, GRAM_BAND_SLACK_FP32), (torch.bfloat16, GRAM_BAND_SLACK_BF16)])
def test_gram_singular_values_stay_in_the_band(coefficients, shape, kind, dtype, slack):
    x = spectrum_matrix(*shape, kind, seed=2)
    s_in = torch.linalg.svdvals(x) / torch.linalg.matrix_norm(x)
    nonzero = s_in[s_in > 1e-10]
    low, high = singular_value_band(coefficients, 5, lower=float(nonzero.min()), upper=float(nonzero.max()))
    out = newton_schulz(x, coefficients=coefficients, dtype=dtype, method="gram")
    s_all = torch.linalg.svdvals(out.double())
    s_out, s_null = s_all[: len(nonzero)], s_all[len(nonzero):]
    assert low - slack <= float(s_out.min()) and float(s_out.max()) <= high + slack
    # A zero singular value grows no more than with standard Newton-Schulz (in bf16 both lift
    # the rounding noise of the null space, up to 0.3, as the polynomial does small values).
    standard = newton_schulz(x, coefficients=coefficients, dtype=dtype, method="standard")
    standard_null = torch.linalg.svdvals(standard.double())[len(nonzero):]
    assert float(torch.cat([s_null, torch.zeros(1)]).max()) <= float(torch.cat([standard_null, torch.zeros(1)]).max()) + slack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gram_batched_equals_looped(dtype):
    x = torch.randn(5, 16, 80, generator=torch.Generator().manual_seed(2))
    batched = newton_schulz(x, dtype=dtype, method="gram")
    looped = torch.stack([newton_schulz(x[i], dtype=dtype, method="gram") for i in range(5)])
    assert torch.allclose(batched, looped, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(24, 24), (24, 40), (16, 160), (160, 16), (4, 16, 160)])
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_the_cost_model_counts_the_flops_each_method_runs(dtype, shape, method):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    with FlopCounterMode(display=False) as counter:
        newton_schulz(x, dtype=dtype, method=method)
    stack = shape[0] if len(shape) == 3 else 1
    expected = stack * ns_flops(shape[-2], shape[-1], 5, method, str(dtype).removeprefix("torch."))
    assert counter.get_total_flops() == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(512, 512), (512, 1024), (256, 1280), (256, 2560), (2560, 256), (64, 640)])
def test_auto_picks_gram_where_it_saves_a_fifth_of_the_flops_on_a_large_matrix(dtype, shape):
    picked = ns_method_for(*shape, 5, "auto", dtype)
    ratio = ns_flops(*shape, 5, "gram", dtype) / ns_flops(*shape, 5, "standard", dtype)
    assert (picked == "gram") == (ratio <= AUTO_GRAM_FLOP_RATIO and min(shape) >= AUTO_GRAM_MIN_SIDE)
    if shape in ((512, 512), (512, 1024), (64, 640)):
        assert picked == "standard"  # square, nearly square, or small: gram costs more
    if shape in ((256, 2560), (2560, 256)):
        assert picked == "gram"


@pytest.mark.parametrize("shape", [(16, 160), (256, 1280)])
def test_auto_runs_the_method_the_cost_model_picks(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    picked = ns_method_for(*shape, 5, "auto", "float32")
    assert torch.equal(newton_schulz(x, dtype=torch.float32, method="auto"),
                       newton_schulz(x, dtype=torch.float32, method=picked))


def test_unknown_method_names_the_choices():
    with pytest.raises(ValueError, match="standard"):
        newton_schulz(torch.ones(4, 6), method="fast")


def test_gram_restarts_by_dtype():
    assert gram_runs(5, "float32") == [5] and gram_runs(8, "float32") == [5, 3]
    assert gram_runs(5, "bfloat16") == [2, 2, 1] and gram_runs(5, "float64") == [5]


@pytest.mark.parametrize("coefficients", ["quintic", "quintic_schedule", "polar_express"])
@pytest.mark.parametrize(("dtype", "slack"), [(torch.float32, GRAM_BAND_SLACK_FP32), (torch.bfloat16, 2 * GRAM_BAND_SLACK_BF16)])
def test_gram_restarts_keep_eight_steps_in_the_band(coefficients, dtype, slack):
    # Without a restart, 8 fp32 steps leave the band by up to 7.7 (the composed polynomial's slope
    # amplifies the iterated Gram matrix's rounding); bf16 restarts every 2 (standard: <0.4).
    x = spectrum_matrix(32, 160, "ill", seed=0)
    s_in = torch.linalg.svdvals(x) / torch.linalg.matrix_norm(x)
    low, high = singular_value_band(coefficients, 8, lower=float(s_in.min()), upper=float(s_in.max()))
    s_out = torch.linalg.svdvals(newton_schulz(x, num_steps=8, coefficients=coefficients, dtype=dtype, method="gram").double())
    assert low - slack <= float(s_out.min()) and float(s_out.max()) <= high + slack


def test_auto_takes_the_measured_method_per_shape():
    """MuonConfig.ns_measured reaches Newton-Schulz: a shape measured faster with gram runs gram
    under ``auto`` (the same values as ``method="gram"``), another keeps the FLOP rule."""
    import torch

    from megatron.canzona.optim.newton_schulz import newton_schulz

    x = torch.randn(2, 64, 192, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    measured = ((64, 192, "gram"),)
    gram = newton_schulz(x, dtype=torch.float64, method="gram")
    standard = newton_schulz(x, dtype=torch.float64, method="standard")
    assert torch.equal(newton_schulz(x, dtype=torch.float64, method="auto", measured=measured), gram)
    assert torch.equal(newton_schulz(x, dtype=torch.float64, method="auto"), standard)  # short side < 256
    assert not torch.equal(gram, standard)
