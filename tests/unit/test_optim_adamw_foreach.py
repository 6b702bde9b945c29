"""Fused (foreach) AdamW is bit for bit the per-parameter AdamW it replaces."""

from __future__ import annotations

import pytest
import torch

from megatron.canzona.optim import AdamWConfig, AdamWState, adamw_foreach, adamw_update, apply_update

pytestmark = pytest.mark.quick

SHAPES = [(7,), (3, 5), (64,), (2, 3, 4), (1,)]


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_foreach_equals_the_per_parameter_loop(param_dtype, weight_decay):
    gen = torch.Generator().manual_seed(3)
    config = AdamWConfig(betas=(0.9, 0.95), eps=1e-8)
    looped = [torch.randn(s, generator=gen).to(param_dtype) for s in SHAPES]
    fused = [p.clone() for p in looped]
    loop_states = [AdamWState.create(p.shape, grad_dtype=torch.float32) for p in looped]
    fused_states = [AdamWState.create(p.shape, grad_dtype=torch.float32) for p in fused]
    fused_states[1].step = loop_states[1].step = 3  # resumed at another step: other bias correction
    for _ in range(4):
        grads = [torch.randn(s, generator=gen).to(param_dtype) for s in SHAPES]
        for p, g, state in zip(looped, grads, loop_states):
            apply_update(p, adamw_update(g, state, config), lr=1e-2, weight_decay=weight_decay)
        adamw_foreach(fused, grads, fused_states, config, lr=1e-2, weight_decay=weight_decay)
    for a, b, sa, sb in zip(looped, fused, loop_states, fused_states):
        assert torch.equal(a, b)
        assert torch.equal(sa.exp_avg, sb.exp_avg) and torch.equal(sa.exp_avg_sq, sb.exp_avg_sq)
        assert sa.step == sb.step
