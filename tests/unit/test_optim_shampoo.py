"""Shampoo against a float64 reference built on an explicit eigendecomposition."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from optim_reference import batched_and_looped, batched_minus_looped, make_grads, max_rel_err

from megatron.canzona.optim import ShampooConfig, ShampooState, inverse_root, shampoo_update

pytestmark = pytest.mark.quick

# Relative Frobenius error of each update direction against the reference.
# fp64 end to end: rounding in eigh and the root (seen <2e-12).
SHAMPOO_RTOL_FP64 = 1e-10
# fp32 state, fp64 roots: statistics rounded to fp32 (6e-8 relative) and then raised to
# the -1/4 power where eigenvalues near eps amplify it by up to eps^(-1/4) (seen <1e-4).
SHAMPOO_RTOL_FP32 = 5e-4
# The inverse root alone, fp64, well-conditioned SPD input (seen <1e-14).
ROOT_RTOL_FP64 = 1e-11


def np_inverse_root(stat: np.ndarray, eps: float, root: int, relative: bool, diagonal: bool) -> np.ndarray:
    """(S + eps)^(-1/r) from numpy's eigendecomposition (elementwise for a diagonal S)."""
    if diagonal:
        values = np.maximum(stat, 0.0)
        return (values + (eps * values.max() if relative else eps)) ** (-1.0 / root)
    values, vectors = np.linalg.eigh(0.5 * (stat + stat.T))
    values = np.maximum(values, 0.0)
    values = values + (eps * values.max() if relative else eps)
    return (vectors * values ** (-1.0 / root)) @ vectors.T


def reference_shampoo(grads: list[np.ndarray], cfg: ShampooConfig) -> list[np.ndarray]:
    """Directions of Shampoo with Adam grafting, one loop iteration per step."""
    rows, cols = grads[0].shape
    diag_left, diag_right = rows > cfg.max_precond_dim, cols > cfg.max_precond_dim
    left = np.zeros(rows) if diag_left else np.zeros((rows, rows))
    right = np.zeros(cols) if diag_right else np.zeros((cols, cols))
    m1, v = np.zeros((rows, cols)), np.zeros((rows, cols))
    relative = cfg.eps_mode == "relative"
    directions = []
    for t, g in enumerate(grads, start=1):
        new_left = (g * g).sum(1) if diag_left else g @ g.T
        new_right = (g * g).sum(0) if diag_right else g.T @ g
        if cfg.statistics == "sum":
            left, right = left + new_left, right + new_right
        else:
            b = cfg.shampoo_beta
            left, right = b * left + (1 - b) * new_left, b * right + (1 - b) * new_right
        if (t - 1) % cfg.precondition_frequency == 0:
            p_left = np_inverse_root(left, cfg.eps, cfg.inverse_root, relative, diag_left)
            p_right = np_inverse_root(right, cfg.eps, cfg.inverse_root, relative, diag_right)
        m1 = cfg.momentum * m1 + (1 - cfg.momentum) * g
        v = cfg.graft_beta2 * v + (1 - cfg.graft_beta2) * g * g
        m_hat = m1 / (1 - cfg.momentum**t)
        s = (p_left[:, None] * m_hat) if diag_left else p_left @ m_hat
        s = (s * p_right[None, :]) if diag_right else s @ p_right
        if cfg.grafting == "adam":
            adam = m_hat / (np.sqrt(v / (1 - cfg.graft_beta2**t)) + cfg.graft_eps)
            s = s * np.linalg.norm(adam) / np.linalg.norm(s)
        directions.append(s)
    return directions


def run_shampoo(grads: list[torch.Tensor], cfg: ShampooConfig) -> list[torch.Tensor]:
    state = ShampooState.create(grads[0].shape, cfg, grad_dtype=grads[0].dtype)
    return [shampoo_update(g, state, cfg) for g in grads]


# eps = 1e-4 (not the default 1e-12) because a non-square gradient leaves one statistic
# rank-deficient at step 1: its null-space eigenvalues are rounding noise (~1e-15) and
# with eps = 1e-12 the root (noise + eps)^(-1/4) of two correct implementations differs
# by ~1e-4 -- an ill-posed comparison, not an error. The default eps is checked on a
# full-rank square problem below.
EPS = 1e-4
CASES = {
    "default": ShampooConfig(eps=EPS),
    "refresh_every_3": ShampooConfig(eps=EPS, precondition_frequency=3),
    "sum_statistics": ShampooConfig(eps=EPS, statistics="sum", precondition_frequency=1),
    "relative_eps": ShampooConfig(eps=1e-5, eps_mode="relative", precondition_frequency=2),
    "no_grafting": ShampooConfig(eps=EPS, grafting="none", precondition_frequency=2),
    "root_2": ShampooConfig(eps=EPS, inverse_root=2, precondition_frequency=2),
    "diagonal_left": ShampooConfig(eps=EPS, max_precond_dim=20, precondition_frequency=2),
    "both_diagonal": ShampooConfig(eps=EPS, max_precond_dim=8, precondition_frequency=2),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("shape", [(24, 12), (12, 20), (16, 16)])
def test_matches_float64_reference(name, shape):
    cfg = dataclasses.replace(CASES[name], root_dtype="float64")  # fp64 math end to end
    grads = make_grads(shape, 7)
    expected = reference_shampoo([g.numpy() for g in grads], cfg)
    assert max_rel_err(run_shampoo(grads, cfg), expected) < SHAMPOO_RTOL_FP64


def test_default_eps_on_a_full_rank_problem():
    grads = make_grads((16, 16), 5, seed=3)
    cfg = ShampooConfig(root_dtype="float64")
    expected = reference_shampoo([g.numpy() for g in grads], cfg)
    assert max_rel_err(run_shampoo(grads, cfg), expected) < SHAMPOO_RTOL_FP64


@pytest.mark.parametrize("shape", [(24, 12), (12, 20), (16, 16)])
def test_fp32_state_within_documented_tolerance(shape):
    cfg = ShampooConfig(eps=EPS, precondition_frequency=2)
    grads = make_grads(shape, 6)
    expected = reference_shampoo([g.numpy() for g in grads], cfg)
    got = run_shampoo([g.float() for g in grads], cfg)
    assert all(d.dtype == torch.float32 for d in got)
    assert max_rel_err(got, expected) < SHAMPOO_RTOL_FP32


@pytest.mark.parametrize("root_dtype", ["float32", "float64"])
def test_inverse_root_against_explicit_eigendecomposition(root_dtype):
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(10, 30, dtype=torch.float64, generator=gen)
    stat = a @ a.T / 30  # SPD, eigenvalues roughly in [0.2, 3]
    cfg = ShampooConfig(eps=1e-6, root_dtype=root_dtype)
    got = inverse_root(stat, cfg, diagonal=False)
    expected = np_inverse_root(stat.numpy(), 1e-6, 4, relative=False, diagonal=False)
    rtol = ROOT_RTOL_FP64 if root_dtype == "float64" else 1e-5
    assert np.linalg.norm(got.numpy() - expected) / np.linalg.norm(expected) < rtol
    # Independent of the reference: P^4 (S + eps I) = I.
    p4 = torch.linalg.matrix_power(got, 4)
    eye = torch.eye(10, dtype=torch.float64)
    assert torch.allclose(p4 @ (stat + 1e-6 * eye), eye, atol=10 * rtol)


def test_roots_are_refreshed_only_every_k_steps():
    cfg = ShampooConfig(precondition_frequency=3)
    grads = make_grads((6, 5), 4)
    state = ShampooState.create((6, 5), cfg, grad_dtype=torch.float64)
    roots = []
    for g in grads:
        shampoo_update(g, state, cfg)
        roots.append(state.left_root.clone())
    assert torch.equal(roots[0], roots[1]) and torch.equal(roots[1], roots[2])
    assert not torch.equal(roots[2], roots[3])  # step 4 = 1 + 3


def test_diagonal_fallback_state_shapes():
    cfg = ShampooConfig(max_precond_dim=10)
    state = ShampooState.create((3, 12, 8), cfg)
    assert state.left.shape == (3, 12) and state.right.shape == (3, 8, 8)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(2, 20), cols=st.integers(2, 20), stack=st.integers(2, 4),
       max_dim=st.sampled_from([8, 10000]), seed=st.integers(0, 999))
def test_batched_equals_looped(rows, cols, stack, max_dim, seed):
    # fp64: checks the batching logic (stacked statistics, eigh, diagonal sides) free of
    # fp32 conditioning, which test_batched_equals_looped_in_fp32 covers separately.
    cfg = ShampooConfig(eps=EPS, precondition_frequency=2, max_precond_dim=max_dim, root_dtype="float64")
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(stack, rows, cols, generator=gen, dtype=torch.float64) for _ in range(4)]
    for batched, looped in batched_and_looped(shampoo_update, ShampooState, cfg, grads):
        assert torch.allclose(batched, looped, rtol=SHAMPOO_RTOL_FP64, atol=SHAMPOO_RTOL_FP64)


@pytest.mark.parametrize("shape", [(3, 16, 16), (4, 24, 12), (2, 12, 30)])
def test_batched_equals_looped_in_fp32(shape):
    # Batched and single fp32 GEMMs may round differently; the inverse root of eigenvalues
    # near eps amplifies that like any fp32 rounding (same bound as against the reference).
    cfg = ShampooConfig(eps=EPS, precondition_frequency=2, max_precond_dim=20)
    assert batched_minus_looped(shampoo_update, ShampooState, cfg, shape, steps=4, seed=5) < SHAMPOO_RTOL_FP32


def test_update_is_scale_invariant_with_grafting():
    # Grafting to Adam makes the direction independent of the gradient scale (up to eps).
    cfg = ShampooConfig(eps=1e-30, graft_eps=1e-30, root_dtype="float64")
    grads = make_grads((8, 8), 3)  # square: both statistics full rank from step 1
    a = run_shampoo(grads, cfg)
    b = run_shampoo([1e3 * g for g in grads], cfg)
    assert all(torch.allclose(x, y, rtol=1e-8) for x, y in zip(a, b))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"statistics": "max"}, "statistics"), ({"precondition_frequency": 0}, "precondition_frequency"),
     ({"eps_mode": "rel"}, "eps_mode"), ({"grafting": "sgd"}, "grafting"), ({"inverse_root": 0}, "inverse_root")],
)
def test_config_errors_say_how_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShampooConfig(**kwargs)


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ShampooConfig().eps = 1.0  # type: ignore[misc]
