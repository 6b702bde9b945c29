"""Megatron's gradient norm without Apex or Transformer Engine, read once (registry row
``megatron.core.optimizer.clip_grads:l2_norm_impl``).

Upstream's local ``multi_tensor_l2norm`` stand-in builds a host tensor from the per-tensor
norms one ``float()`` at a time: a device synchronisation per parameter in every clipped step
(on the H100 without transformer-engine, Megatron's ``optimizer-clip-main-grad`` timer).
"""

from __future__ import annotations

import pytest
import torch

from canzona_patches.harness.host_syncs import count_host_syncs
from canzona_patches.integration.megatron_fixes import one_read_l2_norm

pytestmark = pytest.mark.quick


def _upstream(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Upstream's expression (megatron.core.utils.local_multi_tensor_l2_norm) on the CPU."""
    return torch.norm(torch.tensor([torch.norm(t) for t in tensors]))


def test_the_norm_is_upstreams_bitwise_with_no_read_per_tensor() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=generator) * scale
               for shape, scale in (((64, 96), 1e-3), ((7,), 3.0), ((33, 5), 1e2), ((1000,), 1e-6))]
    fallback = one_read_l2_norm(lambda *args: (_ for _ in ()).throw(AssertionError("not for one list")))
    with count_host_syncs() as reads:
        norm, per_tensor = fallback(2048 * 32, None, [tensors], False)
    assert reads == [] and per_tensor is None
    assert norm.shape == (1,) and norm.dtype == torch.float32
    assert torch.equal(norm[0], _upstream(tensors))
    with count_host_syncs() as reads:
        _upstream(tensors)
    assert len(reads) == len(tensors)  # what the fallback saves: one read per tensor


def test_per_tensor_norms_and_an_empty_list_stay_upstreams() -> None:
    calls = []

    def upstream(*args):
        calls.append(args)
        return "upstream"

    fallback = one_read_l2_norm(upstream)
    assert fallback(1, None, [[torch.ones(3)]], True) == "upstream"
    assert fallback(1, None, [[]], False) == "upstream"
    assert len(calls) == 2
