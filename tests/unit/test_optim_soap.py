"""SOAP against a float64 reference: Adam run in the exact eigenbasis of the statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from optim_reference import batched_and_looped, batched_minus_looped, make_grads, max_rel_err

from megatron.canzona.optim import AdamWConfig, AdamWState, SOAPConfig, SOAPState, adamw_update, soap_update

pytestmark = pytest.mark.quick

# Adam's eps matters for the comparisons: at step 1 the statistics are exactly G G^T and
# G^T G, so the rotated gradient Q_L^T G Q_R is diagonal; its off-diagonal entries are
# rounding noise of the eigenvectors (~1e-7 |G| with fp32 eigh, ~1e-15 |G| with fp64)
# that Adam divides by (|noise| + eps). Two correct implementations therefore differ by
# about noise/eps per entry. The tight comparisons use TEST_EPS to keep this far below
# the tolerance. (With the default eps = 1e-8, fp32 eigh and O(1) gradients the
# off-diagonal entries of step 1 are O(1) noise, in emerging-optimizers' SOAP as here;
# real gradients are far smaller and learning-rate warm-up makes step 1 negligible.)
TEST_EPS = 1e-4
# fp64 end to end with TEST_EPS: noise/eps ~ 1e-11 per entry at step 1 (seen <6e-10).
SOAP_RTOL_FP64 = 1e-8
# fp64 with the default eps = 1e-8: noise/eps ~ 1e-7 per entry (seen <2e-6).
SOAP_RTOL_FP64_DEFAULT_EPS = 1e-5
# fp32 state and eigh with eps = 1e-2: noise/eps ~ 1e-5 per entry, plus fp32 eigenvectors
# of eigenvalues a few percent apart (seen <2e-3).
FP32_EPS = 1e-2
SOAP_RTOL_FP32 = 5e-3


def reference_soap(grads: list[np.ndarray], cfg: SOAPConfig) -> list[np.ndarray]:
    """Paper formulation with eigh refreshes: M kept in the original space, V in the
    eigenbasis and re-ordered by the approximate eigenvalues when the basis changes."""
    rows, cols = grads[0].shape
    dense_left, dense_right = rows <= cfg.max_precond_dim, cols <= cfg.max_precond_dim
    left, right = np.zeros((rows, rows)), np.zeros((cols, cols))
    q_left, q_right = np.eye(rows), np.eye(cols)
    m, v = np.zeros((rows, cols)), np.zeros((rows, cols))
    (beta1, beta2), directions = cfg.betas, []
    for t, g in enumerate(grads, start=1):
        beta = cfg.shampoo_beta
        if cfg.correct_shampoo_beta_bias:
            beta = 1 - (1 - beta) / (1 - beta**t)
        left = beta * left + (1 - beta) * g @ g.T
        right = beta * right + (1 - beta) * g.T @ g
        if (t - 1) % cfg.precondition_frequency == 0:
            if t > 1 and dense_left:
                order = np.argsort(-np.diag(q_left.T @ left @ q_left), kind="stable")
                v = v[order, :]
            if t > 1 and dense_right:
                order = np.argsort(-np.diag(q_right.T @ right @ q_right), kind="stable")
                v = v[:, order]
            if dense_left:
                q_left = np.linalg.eigh(left)[1][:, ::-1]
            if dense_right:
                q_right = np.linalg.eigh(right)[1][:, ::-1]
        m = beta1 * m + (1 - beta1) * g
        g_rot, m_rot = q_left.T @ g @ q_right, q_left.T @ m @ q_right
        v = beta2 * v + (1 - beta2) * g_rot**2
        adam = (m_rot / (1 - beta1**t)) / (np.sqrt(v / (1 - beta2**t)) + cfg.eps)
        directions.append(q_left @ adam @ q_right.T)
    return directions


def run_soap(grads: list[torch.Tensor], cfg: SOAPConfig) -> list[torch.Tensor]:
    state = SOAPState.create(grads[0].shape, cfg, grad_dtype=grads[0].dtype)
    return [soap_update(g, state, cfg) for g in grads]


EXACT = SOAPConfig(precondition_frequency=1, refresh="eigh", eigh_dtype="float64", eps=TEST_EPS)


@pytest.mark.parametrize("shape", [(12, 12), (20, 20)])
def test_frequency_one_is_adam_in_the_exact_eigenbasis(shape):
    grads = make_grads(shape, 8)
    expected = reference_soap([g.numpy() for g in grads], EXACT)
    assert max_rel_err(run_soap(grads, EXACT), expected) < SOAP_RTOL_FP64


@pytest.mark.parametrize("shape", [(16, 10), (10, 16)])
def test_rectangular_rotations(shape):
    # A non-square G leaves one statistic rank-deficient at step 1, so that eigenbasis is
    # arbitrary inside the null space, and the next refresh re-orders V by approximate
    # eigenvalues *of those arbitrary vectors*: two correct implementations then place V's
    # columns differently. beta2 = 0 (V = current G'^2) removes that memory and leaves
    # every rotation and moment of the rectangular case exactly defined.
    cfg = SOAPConfig(precondition_frequency=1, refresh="eigh", eigh_dtype="float64",
                     eps=TEST_EPS, betas=(0.9, 0.0))
    grads = make_grads(shape, 8)
    expected = reference_soap([g.numpy() for g in grads], cfg)
    assert max_rel_err(run_soap(grads, cfg), expected) < SOAP_RTOL_FP64


def test_frequency_one_with_the_default_eps():
    cfg = SOAPConfig(precondition_frequency=1, refresh="eigh", eigh_dtype="float64")
    grads = make_grads((12, 12), 6)
    expected = reference_soap([g.numpy() for g in grads], cfg)
    assert max_rel_err(run_soap(grads, cfg), expected) < SOAP_RTOL_FP64_DEFAULT_EPS


def test_eigh_refresh_every_three_steps_and_bias_corrected_statistics():
    cfg = SOAPConfig(precondition_frequency=3, refresh="eigh", eigh_dtype="float64",
                     correct_shampoo_beta_bias=True, shampoo_beta=0.9, eps=TEST_EPS)
    grads = make_grads((14, 14), 9, seed=1)
    expected = reference_soap([g.numpy() for g in grads], cfg)
    assert max_rel_err(run_soap(grads, cfg), expected) < SOAP_RTOL_FP64


def test_fp32_state_within_documented_tolerance():
    cfg = SOAPConfig(precondition_frequency=1, refresh="eigh", eps=FP32_EPS)
    grads = make_grads((16, 16), 6, seed=2)
    expected = reference_soap([g.numpy() for g in grads], cfg)
    got = run_soap([g.float() for g in grads], cfg)
    assert all(d.dtype == torch.float32 for d in got)
    assert max_rel_err(got, expected) < SOAP_RTOL_FP32


def test_both_sides_past_max_precond_dim_is_plain_adam():
    cfg = SOAPConfig(max_precond_dim=4)
    grads = make_grads((6, 9), 5)
    state = AdamWState.create((6, 9), grad_dtype=torch.float64)
    adam = [adamw_update(g, state, AdamWConfig(betas=cfg.betas, eps=cfg.eps)) for g in grads]
    soap = run_soap(grads, cfg)
    assert SOAPState.create((6, 9), cfg).basis_left is None
    assert all(torch.allclose(a, s, rtol=1e-14, atol=0) for a, s in zip(adam, soap))


@pytest.mark.parametrize("shape", [(12, 30), (30, 12)])
def test_one_side_past_max_precond_dim_rotates_only_the_other(shape):
    cfg = SOAPConfig(max_precond_dim=20, precondition_frequency=1, refresh="eigh",
                     eigh_dtype="float64", eps=TEST_EPS)
    grads = make_grads(shape, 6)
    expected = reference_soap([g.numpy() for g in grads], cfg)
    assert max_rel_err(run_soap(grads, cfg), expected) < SOAP_RTOL_FP64


def test_qr_refresh_keeps_an_orthonormal_basis_that_converges_to_the_eigenbasis():
    cfg = SOAPConfig(precondition_frequency=1, refresh="qr", shampoo_beta=0.9)
    gen = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(8, 8, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(24, 8, generator=gen))
    grad = u @ torch.diag(torch.logspace(0.5, -0.5, 8)) @ v.T  # separated singular values
    state = SOAPState.create((8, 24), cfg)
    # Start from a basis unrelated to L: one eigh at step 1 would make this trivial.
    soap_update(torch.randn(8, 24, generator=gen), state, cfg)
    for _ in range(80):
        soap_update(grad, state, cfg)
    q = state.basis_left
    assert torch.allclose(q.mT @ q, torch.eye(8), atol=1e-5)
    # Orthogonal iteration converges to the eigenvectors of L: Q^T L Q becomes diagonal.
    conj = q.mT @ state.left @ q
    off_diagonal = conj - torch.diag(torch.diagonal(conj))
    assert off_diagonal.norm() / conj.norm() < 1e-3


def test_first_step_uses_eigh_even_with_qr_refresh():
    grads = make_grads((10, 10), 1)
    qr_cfg = SOAPConfig(refresh="qr", eigh_dtype="float64", eps=TEST_EPS)
    assert max_rel_err(run_soap(grads, qr_cfg), reference_soap([grads[0].numpy()], EXACT)) < SOAP_RTOL_FP64


@settings(max_examples=15, deadline=None)
@given(size=st.integers(2, 16), extra=st.integers(0, 8), stack=st.integers(2, 4),
       refresh=st.sampled_from(["qr", "eigh"]), seed=st.integers(0, 999))
def test_batched_equals_looped(size, extra, stack, refresh, seed):
    # fp64 with fp64 eigh: rounding differences between batched and single kernels stay
    # ~1e-16 and Adam amplifies them by at most 1/eps (see the note on eps above).
    # Square matrices, or a wide one whose long side is past max_precond_dim: every rotated
    # side then has a full-rank statistic from step 1. (With a rank-deficient side the
    # null-space eigenvectors are arbitrary and kernels with different rounding pick
    # different ones; see test_rectangular_rotations.)
    rows, cols = size, size + extra
    cfg = SOAPConfig(precondition_frequency=2, refresh=refresh, max_precond_dim=size, eigh_dtype="float64")
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(stack, rows, cols, generator=gen, dtype=torch.float64) for _ in range(5)]
    for batched, looped in batched_and_looped(soap_update, SOAPState, cfg, grads):
        assert torch.allclose(batched, looped, rtol=SOAP_RTOL_FP64_DEFAULT_EPS, atol=SOAP_RTOL_FP64_DEFAULT_EPS)


@pytest.mark.parametrize("shape", [(3, 16, 16), (4, 8, 24)])
def test_batched_equals_looped_in_fp32(shape):
    cfg = SOAPConfig(precondition_frequency=2, max_precond_dim=16, eps=FP32_EPS)
    assert batched_minus_looped(soap_update, SOAPState, cfg, shape, steps=5, seed=4) < SOAP_RTOL_FP32


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"betas": (0.9, 1.0)}, "betas"), ({"precondition_frequency": 0}, "precondition_frequency"),
     ({"refresh": "svd"}, "refresh"), ({"power_iter_steps": 0}, "power_iter_steps"),
     ({"betas": (0.9,)}, "pair")],
)
def test_config_errors_say_how_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SOAPConfig(**kwargs)
