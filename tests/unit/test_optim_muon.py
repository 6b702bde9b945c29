"""Muon against a float64 reference written from the definition."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.canzona.optim import (
    NS_COEFFICIENTS,
    MuonConfig,
    MuonState,
    apply_update,
    muon_scale,
    muon_update,
)

pytestmark = pytest.mark.quick

# Relative error of the parameter displacement after 4 steps (|got - ref| / |ref - start|).
# fp64 state + fp64 Newton-Schulz: rounding only (seen <5e-15).
MUON_RTOL_FP64 = 1e-12
# fp32 Newton-Schulz: see test_optim_newton_schulz, <5e-6 per update (seen <2.5e-6).
MUON_RTOL_FP32 = 1e-5
# bf16 Newton-Schulz with the quintic, fp32 state: <2e-2 per update; the displacement
# averages over steps (seen <9e-3).
MUON_RTOL_BF16 = 2e-2

LR, WEIGHT_DECAY = 0.05, 0.1


def reference_muon(
    param: np.ndarray, grads: list[np.ndarray], *, momentum: float, nesterov: bool,
    coefficients: str, num_steps: int, scale: float,
) -> np.ndarray:
    """Loop over steps: M = mu M + (1-mu) G; D = scale * U p(S/|X|) V^T; p -= lr wd p + lr D."""
    p = param.astype(np.float64).copy()
    m = np.zeros_like(p)
    for g in grads:
        m = momentum * m + (1 - momentum) * g
        x = (1 - momentum) * g + momentum * m if nesterov else m
        u, s, vt = np.linalg.svd(x, full_matrices=False)
        s = s / np.linalg.norm(x)
        for a, b, c in NS_COEFFICIENTS[coefficients].iterate(num_steps):
            s = a * s + b * s**3 + c * s**5
        p = p - LR * WEIGHT_DECAY * p - LR * scale * (u * s) @ vt
    return p


def run_muon(param: torch.Tensor, grads: list[torch.Tensor], config: MuonConfig) -> torch.Tensor:
    p = param.clone()
    state = MuonState.create(p.shape, grad_dtype=grads[0].dtype)
    for g in grads:
        apply_update(p, muon_update(g, state, config), lr=LR, weight_decay=WEIGHT_DECAY)
    assert state.step == len(grads)
    return p


def problem(shape: tuple[int, ...], num_grads: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(shape, dtype=torch.float64, generator=gen).to(dtype)
    grads = [torch.randn(shape, dtype=torch.float64, generator=gen).to(dtype) for _ in range(num_grads)]
    return param, grads


def trajectory_error(got: torch.Tensor, expected: np.ndarray, start: torch.Tensor) -> float:
    moved = expected - start.double().numpy()
    return float(np.linalg.norm(got.double().numpy() - expected) / np.linalg.norm(moved))


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize(
    ("ns_dtype", "dtype", "rtol"),
    [("float64", torch.float64, MUON_RTOL_FP64), ("float32", torch.float32, MUON_RTOL_FP32),
     ("bfloat16", torch.float32, MUON_RTOL_BF16)],
)
def test_matches_float64_reference(shape, nesterov, ns_dtype, dtype, rtol):
    config = MuonConfig(nesterov=nesterov, ns_dtype=ns_dtype, momentum=0.9)
    param, grads = problem(shape, 4, dtype)
    got = run_muon(param, grads, config)
    expected = reference_muon(
        param.double().numpy(), [g.double().numpy() for g in grads], momentum=0.9,
        nesterov=nesterov, coefficients="quintic", num_steps=5,
        scale=0.2 * math.sqrt(max(shape)),
    )
    assert trajectory_error(got, expected, param) < rtol


@pytest.mark.parametrize("coefficients", ["polar_express", "quintic_schedule"])
def test_other_coefficients_and_step_counts(coefficients):
    config = MuonConfig(coefficients=coefficients, num_ns_steps=7, ns_dtype="float64")
    param, grads = problem((16, 28), 3, torch.float64)
    expected = reference_muon(
        param.numpy(), [g.numpy() for g in grads], momentum=0.95, nesterov=False,
        coefficients=coefficients, num_steps=7, scale=0.2 * math.sqrt(28),
    )
    assert trajectory_error(run_muon(param, grads, config), expected, param) < MUON_RTOL_FP64


def test_scale_modes_by_hand():
    # m = 12 rows, n = 3 columns.
    assert muon_scale(12, 3, "moonlight") == pytest.approx(0.2 * math.sqrt(12))
    assert muon_scale(12, 3, "spectral") == pytest.approx(math.sqrt(12))
    assert muon_scale(12, 3, "shape_scaling") == pytest.approx(2.0)
    assert muon_scale(3, 12, "shape_scaling") == pytest.approx(1.0)
    assert muon_scale(12, 3, "unit_rms_norm") == pytest.approx(2.0)
    assert muon_scale(3, 12, "unit_rms_norm") == pytest.approx(0.5)
    assert muon_scale(12, 3, "none", 3.0) == pytest.approx(3.0)
    assert muon_scale(12, 3, "spectral", 0.2) == pytest.approx(muon_scale(12, 3, "moonlight"))


def test_moonlight_scale_matches_adamw_update_rms():
    # The point of 0.2 sqrt(max(m, n)): an orthogonalised update has RMS 1/sqrt(max(m, n)),
    # so the scaled update has RMS 0.2 -- the typical RMS of an AdamW update.
    config = MuonConfig(ns_dtype="float32", coefficients="polar_express", num_ns_steps=8)
    grad = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    direction = muon_update(grad, MuonState.create(grad.shape), config)
    assert direction.square().mean().sqrt().item() == pytest.approx(0.2, rel=0.02)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(2, 32), cols=st.integers(2, 32), stack=st.integers(2, 4), seed=st.integers(0, 999))
def test_batched_equals_looped(rows, cols, stack, seed):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(stack, rows, cols, generator=gen) for _ in range(3)]
    # fp32 Newton-Schulz: a batched matmul and per-slice matmuls agree to rounding.
    # bf16: a single rounding flip in an early iteration is amplified by the quintic
    # polynomial, so slices agree only to bf16 resolution (measured worst ~5e-4).
    for ns_dtype, atol in (("float32", 1e-5), ("bfloat16", 2e-2)):
        config = MuonConfig(nesterov=True, ns_dtype=ns_dtype)
        batched_state = MuonState.create((stack, rows, cols))
        looped_states = [MuonState.create((rows, cols)) for _ in range(stack)]
        for g in grads:
            batched = muon_update(g, batched_state, config)
            looped = torch.stack([muon_update(g[i], s, config) for i, s in enumerate(looped_states)])
            assert torch.allclose(batched, looped, rtol=0, atol=atol), (ns_dtype, (batched - looped).abs().max())


def test_bf16_gradients_keep_fp32_state():
    config = MuonConfig()
    grad = torch.randn(8, 12).to(torch.bfloat16)
    state = MuonState.create(grad.shape, grad_dtype=grad.dtype)
    direction = muon_update(grad, state, config)
    assert state.momentum is not None and state.momentum.dtype == torch.float32
    assert direction.dtype == torch.float32
    param = torch.zeros(8, 12, dtype=torch.bfloat16)
    apply_update(param, direction, lr=1.0, weight_decay=0.0)
    assert param.dtype == torch.bfloat16


def test_decoupled_weight_decay_only_touches_the_parameter():
    param = torch.full((4, 6), 2.0)
    apply_update(param, torch.zeros(4, 6), lr=0.5, weight_decay=0.1)
    assert torch.allclose(param, torch.full((4, 6), 2.0 * (1 - 0.05)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"momentum": 1.0}, "momentum"), ({"num_ns_steps": 0}, "num_ns_steps"),
     ({"scale_mode": "rms"}, "scale_mode"), ({"coefficients": "septic"}, "NS_COEFFICIENTS"),
     ({"ns_dtype": "float16"}, "ns_dtype")],
)
def test_config_errors_say_how_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MuonConfig(**kwargs)
