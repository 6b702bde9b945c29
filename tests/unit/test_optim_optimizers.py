"""The torch.optim front ends: routing, batching, param groups and checkpoints."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from megatron.canzona.optim import (
    SOAP,
    AdamWConfig,
    AdamWState,
    Muon,
    MuonConfig,
    MuonState,
    QKVLayout,
    Shampoo,
    ShampooConfig,
    SOAPConfig,
    adamw_update,
    apply_update,
    muon_update,
)

pytestmark = pytest.mark.quick

# AdamW against torch.optim.AdamW over 5 fp32 steps: the same formula evaluated in a
# different order (torch divides sqrt(v) by sqrt(bias2) first) (seen <3e-7).
ADAMW_RTOL = 1e-6
# Batched (stacked) vs per-matrix optimizer steps; fp32 Muon: identical kernels per slice.
BATCHED_ATOL_MUON = 1e-6
# Shampoo/SOAP in fp64 with fp64 eigh: rounding amplified at most by Adam's 1/eps.
BATCHED_ATOL_FP64 = 1e-7

OPTIMIZERS = {
    "muon": (Muon, MuonConfig(ns_dtype="float32")),
    "shampoo": (Shampoo, ShampooConfig(eps=1e-4, precondition_frequency=2)),
    "soap": (SOAP, SOAPConfig(precondition_frequency=2, eigh_dtype="float64")),
}


class Net(torch.nn.Module):
    """Three same-shape hidden matrices (one batch), odd shapes, biases and a norm."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, 12)
        self.hidden = torch.nn.ModuleList([torch.nn.Linear(12, 12, bias=False) for _ in range(3)])
        self.norm = torch.nn.LayerNorm(12)
        self.out = torch.nn.Linear(12, 4, bias=False)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(self.norm(x))


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(16, 6, generator=gen).to(dtype)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def test_adamw_matches_torch():
    model_a, model_b = Net(), Net()
    ours = Muon([{"params": list(model_a.parameters()), "matrix": False}], lr=1e-2, weight_decay=0.1,
                adamw_config=AdamWConfig(betas=(0.9, 0.95)))
    theirs = torch.optim.AdamW(model_b.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    train(model_a, ours, 5)
    train(model_b, theirs, 5)
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.allclose(a, b, rtol=ADAMW_RTOL, atol=ADAMW_RTOL)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_batched_equals_looped(name):
    cls, config = OPTIMIZERS[name]
    dtype = torch.float32 if name == "muon" else torch.float64
    model_a, model_b = Net(dtype), Net(dtype)
    train(model_a, cls(model_a.parameters(), lr=1e-2, config=config, batch_same_shape=True), 4)
    train(model_b, cls(model_b.parameters(), lr=1e-2, config=config, batch_same_shape=False), 4)
    atol = BATCHED_ATOL_MUON if name == "muon" else BATCHED_ATOL_FP64
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=atol)


def test_optimizer_is_the_update_function_plus_apply_update():
    param = torch.nn.Parameter(torch.randn(5, 7))
    reference = param.detach().clone()
    config = MuonConfig(nesterov=True)
    optimizer = Muon([param], lr=0.1, weight_decay=0.2, config=config)
    state = MuonState.create(param.shape)
    for seed in range(3):
        grad = torch.randn(5, 7, generator=torch.Generator().manual_seed(seed))
        param.grad = grad.clone()
        optimizer.step()
        apply_update(reference, muon_update(grad, state, config), lr=0.1, weight_decay=0.2)
    assert torch.equal(param.detach(), reference)


def test_split_qkv_equals_separate_q_k_v_parameters():
    layout = QKVLayout(num_query_groups=2, heads_per_group=2, head_dim=3)
    fused = torch.nn.Parameter(torch.randn(layout.rows, 5))
    separate = [torch.nn.Parameter(p.clone()) for p in layout.split(fused.detach())]
    opt_fused = Muon([{"params": [fused], "fused_layout": layout}], lr=0.1, config=MuonConfig(ns_dtype="float32"))
    opt_separate = Muon(separate, lr=0.1, config=MuonConfig(ns_dtype="float32"))
    for seed in range(3):
        grad = torch.randn(layout.rows, 5, generator=torch.Generator().manual_seed(seed))
        fused.grad = grad
        for p, g in zip(separate, layout.split(grad)):
            p.grad = g.clone()
        opt_fused.step()
        opt_separate.step()
    merged = layout.merge([p.detach() for p in separate])
    assert torch.allclose(fused.detach(), merged, rtol=0, atol=1e-6)
    assert len(opt_fused.state[fused]["pieces"]) == 3


def test_per_group_hyperparameters():
    a, b, c = (torch.nn.Parameter(torch.randn(4, 6)) for _ in range(3))
    bias = torch.nn.Parameter(torch.randn(6))
    start = [t.detach().clone() for t in (a, b, c, bias)]
    other = MuonConfig(momentum=0.5, scale_mode="spectral", ns_dtype="float32")
    optimizer = Muon(
        [{"params": [a]}, {"params": [b], "lr": 0.3, "config": other},
         {"params": [c], "matrix": False, "weight_decay": 0.5}, {"params": [bias], "lr": 0.2}],
        lr=0.1, weight_decay=0.0, config=MuonConfig(ns_dtype="float32"),
    )
    grads = [torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 6), torch.randn(6)]
    for p, g in zip((a, b, c, bias), grads):
        p.grad = g
    optimizer.step()
    expected = [t.clone() for t in start]
    base = MuonConfig(ns_dtype="float32")
    directions = [
        muon_update(grads[0], MuonState.create((4, 6)), base),
        muon_update(grads[1], MuonState.create((4, 6)), other),
        adamw_update(grads[2], AdamWState.create((4, 6)), AdamWConfig()),
        adamw_update(grads[3], AdamWState.create((6,)), AdamWConfig()),
    ]
    for e, d, lr, wd in zip(expected, directions, (0.1, 0.3, 0.1, 0.2), (0.0, 0.0, 0.5, 0.0)):
        apply_update(e, d, lr=lr, weight_decay=wd)
    for p, e in zip((a, b, c, bias), expected):
        assert torch.equal(p.detach(), e)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip(name, dtype):
    cls, config = OPTIMIZERS[name]
    model = Net(dtype)
    optimizer = cls(model.parameters(), lr=1e-2, config=config)
    train(model, optimizer, 3)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    clone = copy.deepcopy(model)
    restored = cls(clone.parameters(), lr=1.0, config=config)  # lr comes back from the checkpoint
    # Plain containers only: loads with torch.load's safe default (weights_only=True).
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert restored.param_groups[0]["lr"] == 1e-2
    assert restored.param_groups[0]["config"] == config
    for p in clone.parameters():
        for value in _tensors(restored.state[p]):
            assert value.dtype == torch.float32  # fp32 state even for bf16 parameters
    train(model, optimizer, 2, seed=7)
    train(clone, restored, 2, seed=7)
    for a, b in zip(model.parameters(), clone.parameters()):
        assert torch.equal(a, b)


def test_state_dict_keeps_fused_layouts_and_group_configs():
    layout = QKVLayout(num_query_groups=1, heads_per_group=2, head_dim=2)
    fused = torch.nn.Parameter(torch.randn(layout.rows, 3))
    config = MuonConfig(momentum=0.8)
    optimizer = Muon([{"params": [fused], "fused_layout": layout, "config": config}])
    fused.grad = torch.randn_like(fused)
    optimizer.step()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    restored = Muon([{"params": [fused], "fused_layout": None}])
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert restored.param_groups[0]["fused_layout"] == layout
    assert restored.param_groups[0]["config"] == config
    assert optimizer.param_groups[0]["config"] is config  # state_dict() did not touch the live groups


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list):
        return [t for v in value for t in _tensors(v)]
    return []


def test_closure_and_missing_gradients():
    used, unused = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3, 3))
    before = unused.detach().clone()
    optimizer = Muon([used, unused], lr=0.1)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = used.square().sum()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert loss is not None and loss.item() > 0
    assert torch.equal(unused.detach(), before) and unused not in optimizer.state


def test_group_errors_say_how_to_fix():
    with pytest.raises(TypeError, match="MuonConfig"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2))], config=SOAPConfig())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="matrix=False"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(3))], "matrix": True}])
    with pytest.raises(ValueError, match="fused_layout"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(3, 3))], "matrix": False,
               "fused_layout": QKVLayout(num_query_groups=1, heads_per_group=1, head_dim=1)}])
    with pytest.raises(ValueError, match="lr"):
        Shampoo([torch.nn.Parameter(torch.zeros(2, 2))], lr=-1.0)
