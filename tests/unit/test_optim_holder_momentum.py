"""Muon's momentum kept by the ranks holding a matrix's elements (``momentum_on_holders``, what
the Canzona optimizer does under Megatron-FSDP): each holder advances its slice of the momentum
and writes the Newton-Schulz input over its slice of the gradient (``muon_source_``), the host
computes the rest from the gathered input (``from_source_fn``) and keeps no momentum. Over several
steps the directions and the momentum are bitwise the one-matrix update's, for Muon (with and
without Nesterov) and AdaMuon/NorMuon, whatever the cuts between holders (not on row boundaries),
also for a stack of matrices as the hosts batch them."""

from __future__ import annotations

import pytest
import torch

from megatron.canzona.optim import MATRIX_OPTIMIZERS, AdaptiveMuonConfig, MuonConfig
from megatron.canzona.optim.muon import muon_source_

pytestmark = pytest.mark.quick

CUTS = (0, 37, 200, 384)
"""Three holders of a 24 x 16 matrix's elements, cut mid-row."""
CONFIGS = {
    "muon": MuonConfig(ns_dtype="float32"),
    "muon-no-nesterov": MuonConfig(ns_dtype="float32", nesterov=False),
    "adamuon": AdaptiveMuonConfig(ns_dtype="float32", moment2_method="adamuon"),
    "normuon": AdaptiveMuonConfig(ns_dtype="float32", moment2_method="normuon"),
}


@pytest.mark.parametrize("stack", [None, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_holders_momentum_gives_the_one_matrix_update_bit_for_bit(name: str, stack: int | None) -> None:
    config = CONFIGS[name]
    kind = MATRIX_OPTIMIZERS["adaptive_muon" if isinstance(config, AdaptiveMuonConfig) else "muon"]
    shape = (24, 16) if stack is None else (stack, 24, 16)
    generator = torch.Generator().manual_seed(7)
    whole = kind.state_type.create(shape, config)
    host = kind.source_state_type.create(shape, config)
    assert "momentum" not in host.tensors()  # the host keeps no momentum
    holders = torch.zeros(shape).reshape(-1, 384)  # each matrix's momentum, cut among its holders
    for _ in range(3):
        grad = torch.randn(shape, generator=generator)
        want = kind.update_fn(grad.clone(), whole, config)
        source = grad.clone().reshape(-1, 384)
        for lo, hi in zip(CUTS, CUTS[1:]):
            out = muon_source_(source[:, lo:hi], holders[:, lo:hi], config)
            assert out.data_ptr() == source[:, lo:hi].data_ptr()  # in place: nothing allocated
        got = kind.from_source_fn(source.reshape(shape), host, config)
        assert torch.equal(got, want)
        assert torch.equal(holders.reshape(shape), whole.momentum)
        assert host.step == whole.step
        if "moment2" in host.tensors():
            assert torch.equal(host.moment2, whole.moment2)


def test_a_gradient_of_another_dtype_is_copied_not_written() -> None:
    grad = torch.randn(4, 4, dtype=torch.bfloat16)
    momentum = torch.zeros(4, 4)
    source = muon_source_(grad, momentum, MuonConfig())
    assert source.dtype == torch.float32 and source.data_ptr() != grad.data_ptr()


def test_the_memory_model_knows_which_optimizers_keep_the_momentum_on_the_holders() -> None:
    """planning (torch-free) names them itself; it must name the ones the optimizers define."""
    from megatron.canzona.planning.memory import HOLDER_MOMENTUM_OPTIMIZERS

    assert {name for name, kind in MATRIX_OPTIMIZERS.items() if kind.from_source_fn is not None} == \
        set(HOLDER_MOMENTUM_OPTIMIZERS)
