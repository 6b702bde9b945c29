"""Cross-check against NVIDIA's emerging-optimizers 0.3.0 (what Megatron-Core 0.19.2 runs).

Test-only dependency (requirements-test.txt); skipped when it is not installed.
Everything here runs their CPU code paths: the functional ``newton_schulz``, their
``Muon`` optimizer and their ``SOAP`` optimizer with ``torch.compile`` disabled (their
Adam helper is compiled, which only costs start-up time on CPU).
"""

from __future__ import annotations

import pytest
import torch

eo_muon_utils = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers.muon_utils")
from emerging_optimizers.orthogonalized_optimizers.muon import Muon as EOMuon  # noqa: E402
from emerging_optimizers.soap.soap import SOAP as EOSOAP  # noqa: E402
from emerging_optimizers.utils import fp32_matmul_precision  # noqa: E402

from megatron.canzona.optim import (  # noqa: E402
    EMERGING_OPTIMIZERS_COEFFICIENTS,
    NS_COEFFICIENTS,
    SOAP,
    Muon,
    MuonConfig,
    SOAPConfig,
    newton_schulz,
)

# Newton-Schulz: same normalisation, transpose rule, coefficients and batched kernels
# (baddbmm) on the same input -- seen bitwise equal in fp32 and bf16 on CPU.
NS_ATOL = 1e-6
# Muon optimizer, 5 steps, relative error of the parameter displacement: their 2-D path
# uses addmm where ours uses baddbmm, so the last bits differ (seen <6e-7 in fp32 and bf16).
MUON_RTOL = 1e-5
# SOAP optimizer, 6 steps, same quantity: same operations in the same order (seen bitwise).
SOAP_RTOL = 1e-5

MEGATRON_PRECISION = {"float32": "highest", "bfloat16": "medium"}


@pytest.fixture(autouse=True)
def _no_torch_compile():
    with torch._dynamo.config.patch(disable=True):
        yield


@pytest.mark.quick
def test_coefficient_tables_match():
    for theirs, ours in EMERGING_OPTIMIZERS_COEFFICIENTS.items():
        schedule = NS_COEFFICIENTS[ours]
        assert list(schedule.coefficients) == eo_muon_utils._COEFFICIENT_SETS[theirs]
        ten = list(schedule.iterate(10))
        mode = "repeat_last" if theirs == "polar_express" else "cycle"
        assert ten == list(eo_muon_utils.get_coefficient_iterator(10, schedule.coefficients, mode))


@pytest.mark.parametrize("shape", [(3, 32, 48), (3, 48, 32), (2, 40, 40)])
@pytest.mark.parametrize("theirs", ["simple", "quintic", "polar_express"])
@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
@pytest.mark.quick
def test_newton_schulz(shape, theirs, ns_dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    with fp32_matmul_precision(MEGATRON_PRECISION[ns_dtype]):
        expected = eo_muon_utils.newton_schulz(x, 5, theirs)
    got = newton_schulz(
        x, num_steps=5, coefficients=EMERGING_OPTIMIZERS_COEFFICIENTS[theirs],
        dtype=torch.float32 if ns_dtype == "float32" else torch.bfloat16,
    )
    assert torch.allclose(got, expected, rtol=0, atol=NS_ATOL)


def displacement_error(ours: torch.Tensor, theirs: torch.Tensor, start: torch.Tensor) -> float:
    return float((ours - theirs).norm() / (theirs - start).norm())


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("their_scale", "extra", "our_scale"),
    [("spectral", 0.2, "moonlight"), ("spectral", 1.0, "spectral"),
     ("shape_scaling", 1.0, "shape_scaling"), ("unit_rms_norm", 1.0, "unit_rms_norm")],
)
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.quick
def test_muon_optimizer(shape, ns_dtype, their_scale, extra, our_scale, nesterov):
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(5)]
    theirs, ours = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    their_opt = EOMuon(
        [theirs], lr=0.01, momentum=0.95, weight_decay=0.1, nesterov=nesterov,
        fp32_matmul_prec=MEGATRON_PRECISION[ns_dtype], coefficient_type="simple",
        scale_mode=their_scale, extra_scale_factor=extra,
    )
    our_opt = Muon([ours], lr=0.01, weight_decay=0.1, config=MuonConfig(
        momentum=0.95, nesterov=nesterov, coefficients=EMERGING_OPTIMIZERS_COEFFICIENTS["simple"],
        ns_dtype=ns_dtype, scale_mode=our_scale,
    ))
    for g in grads:
        theirs.grad, ours.grad = g.clone(), g.clone()
        their_opt.step()
        our_opt.step()
    assert displacement_error(ours.detach(), theirs.detach(), start) < MUON_RTOL


@pytest.mark.parametrize("shape", [(24, 24), (16, 40), (40, 16)])
@pytest.mark.parametrize("use_eigh", [False, True])
@pytest.mark.parametrize("correct_shampoo_beta_bias", [False, True])
@pytest.mark.quick
def test_soap_optimizer(shape, use_eigh, correct_shampoo_beta_bias):
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(shape, generator=gen)
    # Realistically small gradients (see the note on step 1 in megatron/canzona/optim/soap.py).
    grads = [1e-3 * torch.randn(shape, generator=gen) for _ in range(6)]
    theirs, ours = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    their_opt = EOSOAP(
        [theirs], lr=0.01, betas=(0.9, 0.95), shampoo_beta=0.95, eps=1e-8, weight_decay=0.1,
        use_eigh=use_eigh, fp32_matmul_prec="highest", qr_fp32_matmul_prec="highest",
        correct_shampoo_beta_bias=correct_shampoo_beta_bias,
    )
    # emerging-optimizers refreshes the eigenbasis every step (no frequency parameter).
    our_opt = SOAP([ours], lr=0.01, weight_decay=0.1, config=SOAPConfig(
        betas=(0.9, 0.95), shampoo_beta=0.95, eps=1e-8, precondition_frequency=1,
        refresh="eigh" if use_eigh else "qr", correct_shampoo_beta_bias=correct_shampoo_beta_bias,
    ))
    for g in grads:
        theirs.grad, ours.grad = g.clone(), g.clone()
        their_opt.step()
        our_opt.step()
    assert displacement_error(ours.detach(), theirs.detach(), start) < SOAP_RTOL


ADAPTIVE_SHAPES = [(352, 64), (64, 176), (64, 64), (32, 64)]
"""Qwen3-tiny's fc1, fc2, Q and proj, and K: the aspect ratios of Qwen3's matrices, small."""


@pytest.mark.parametrize("shape", ADAPTIVE_SHAPES)
@pytest.mark.parametrize("method", ["adamuon", "normuon"])
@pytest.mark.parametrize(("ns_dtype", "nesterov"), [("float32", False), ("float32", True), ("bfloat16", False)])
def test_adaptive_muon_optimizer(shape, method, ns_dtype, nesterov):
    """AdaMuon and NorMuon (``--optimizer adaptive_muon``): bitwise emerging-optimizers' AdaptiveMuon over 4
    steps, parameters and both moments, with Megatron's defaults (spectral scale, its "quintic" schedule)."""
    from emerging_optimizers.orthogonalized_optimizers.adaptive_muon import AdaptiveMuon as EOAdaptiveMuon

    from megatron.canzona.optim import AdaptiveMuon, AdaptiveMuonConfig

    gen = torch.Generator().manual_seed(2)
    start = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(4)]
    theirs, ours = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    their_opt = EOAdaptiveMuon([theirs], lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=nesterov,
                               fp32_matmul_prec=MEGATRON_PRECISION[ns_dtype], moment2_method=method)
    our_opt = AdaptiveMuon([ours], lr=0.02, weight_decay=0.1, config=AdaptiveMuonConfig(
        nesterov=nesterov, coefficients=EMERGING_OPTIMIZERS_COEFFICIENTS["quintic"], ns_dtype=ns_dtype,
        scale_mode="spectral", moment2_method=method))
    for g in grads:
        theirs.grad, ours.grad = g.clone(), g.clone()
        with fp32_matmul_precision(MEGATRON_PRECISION[ns_dtype]):
            their_opt.step()
        our_opt.step()
    assert torch.equal(ours.detach(), theirs.detach())
    (state,) = our_opt.state[ours]["pieces"]
    assert torch.equal(state["momentum"], their_opt.state[theirs]["momentum_buffer"])
    assert torch.equal(state["moment2"], their_opt.state[theirs]["moment2_buffer"])
