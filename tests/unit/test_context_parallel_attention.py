"""CPU context-parallel attention (canzona_patches/emulation/context_parallel.py) against
full-sequence causal attention in one process: every CP rank's queries over the keys of all
ranks, in Megatron's zigzag layout, give the full sequence's outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from canzona_patches.emulation.context_parallel import causal_attention, zigzag_positions

pytestmark = pytest.mark.quick


def test_zigzag_positions_are_megatrons_chunks() -> None:
    """2 CP ranks, 8 tokens in 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2."""
    assert zigzag_positions(0, 2, 4).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(1, 2, 4).tolist() == [2, 3, 4, 5]
    every = torch.cat([zigzag_positions(r, 4, 4) for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))  # each position on exactly one rank
    with pytest.raises(ValueError, match="two chunks of equal length"):
        zigzag_positions(0, 2, 3)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_cp_attention_forward_and_backward_equal_full_sequence_attention(cp_size: int) -> None:
    """Outputs and the gradients of queries, keys and values (each rank's contributions summed,
    as the gather's backward sums them) match torch's causal scaled-dot-product attention over
    the whole sequence, in float64 to 1e-12."""
    torch.manual_seed(0)
    seq, batch, heads, dim = 16, 2, 3, 8
    scale = dim ** -0.5
    q, k, v = (torch.randn(seq, batch, heads, dim, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(seq, batch, heads * dim, dtype=torch.float64)

    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, scale=scale)
    ref = ref.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), (q, k, v))

    local = seq // cp_size
    key_positions = torch.cat([zigzag_positions(r, cp_size, local) for r in range(cp_size)])
    out = torch.empty_like(ref)
    total = 0.0
    for rank in range(cp_size):
        mine = zigzag_positions(rank, cp_size, local)
        part = causal_attention(q[mine], k[key_positions], v[key_positions], mine, key_positions, scale)
        out[mine] = part.detach()
        total = total + (part * grad_out[mine]).sum()
    grads = torch.autograd.grad(total, (q, k, v))

    torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-12)
    for got, want, name in zip(grads, ref_grads, "qkv"):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=f"gradient of {name}")
