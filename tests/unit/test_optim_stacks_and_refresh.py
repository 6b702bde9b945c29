"""Stacked optimizer state, staggered preconditioner refreshes and eigendecompositions that fail.

* Same-shape matrices are updated in one batched call on a stacked state whose members'
  state dicts hold views of it: no step stacks (copies) state, and the tensors stay put.
* Shampoo and SOAP refresh each matrix at step 1 and then at ``1 + o + k f``, ``o`` from its
  name, so not every matrix refreshes in the same step; the optimizers follow exactly the
  schedule of :func:`refresh_due` with :func:`refresh_offset`.
* An eigendecomposition that does not converge is retried in fp64 with a diagonal shift; a
  matrix for which that fails too keeps its previous preconditioner, and the optimizer logs
  its name instead of raising (a raise on one rank would leave the others in a collective).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.canzona.optim import (
    SOAP,
    AdaptiveMuon,
    AdaptiveMuonConfig,
    Muon,
    MuonConfig,
    Shampoo,
    ShampooConfig,
    SOAPConfig,
    SOAPState,
    build_param_groups,
    soap_update,
)
from megatron.canzona.optim.common import Refresh, refresh_due, refresh_offset, robust_eigh

pytestmark = pytest.mark.quick

OPTIMIZERS = {
    "muon": (Muon, MuonConfig(ns_dtype="float32")),
    "shampoo": (Shampoo, ShampooConfig(eps=1e-4, precondition_frequency=2)),
    "soap": (SOAP, SOAPConfig(precondition_frequency=2, refresh="eigh")),
    "adamuon": (AdaptiveMuon, AdaptiveMuonConfig(ns_dtype="float32")),
    "normuon": (AdaptiveMuon, AdaptiveMuonConfig(ns_dtype="float32", moment2_method="normuon")),
}
WIDTH, LAYERS = 8, 6


class Stack(torch.nn.Module):
    """``LAYERS`` same-shape hidden matrices: one batch of the optimizers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def backward(model: torch.nn.Module, gen: torch.Generator) -> None:
    model.zero_grad()
    model(torch.randn(16, WIDTH, generator=gen)).square().mean().backward()


class StackedElements(TorchDispatchMode):
    """Counts the elements every ``stack``/``cat`` in its scope produces."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.stack.default, torch.ops.aten.cat.default):
            self.elements += out.numel()
        return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_step_stacks_the_gradients_only_and_state_stays_in_place(name):
    cls, config = OPTIMIZERS[name]
    model = Stack()
    optimizer = cls(build_param_groups(model.named_parameters()), lr=1e-2, config=config)
    gen = torch.Generator().manual_seed(1)
    backward(model, gen)
    optimizer.step()  # the first step makes the stacked state
    pieces = [optimizer.state[layer.weight]["pieces"][0] for layer in model.layers]
    fields = [k for k, v in pieces[0].items() if isinstance(v, torch.Tensor)]
    storages = {k: {p[k].untyped_storage().data_ptr() for p in pieces} for k in fields}
    assert all(len(ptrs) == 1 for ptrs in storages.values()), "one stacked storage per state field"
    where = {k: [p[k].data_ptr() for p in pieces] for k in fields}
    for _ in range(4):  # refresh steps included (f = 2)
        backward(model, gen)
        with StackedElements() as counter:
            optimizer.step()
        # Only the gradients are stacked; stacking the state as well would add every field.
        assert counter.elements == LAYERS * WIDTH * WIDTH
    pieces = [optimizer.state[layer.weight]["pieces"][0] for layer in model.layers]
    assert {k: [p[k].data_ptr() for p in pieces] for k in fields} == where
    assert all(p["step"] == 5 for p in pieces)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_loaded_state_is_adopted_into_a_new_stack(name):
    cls, config = OPTIMIZERS[name]
    gen_a, gen_b = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    model_a, model_b = Stack(), Stack()
    a = cls(build_param_groups(model_a.named_parameters()), lr=1e-2, config=config)
    b = cls(build_param_groups(model_b.named_parameters()), lr=1e-2, config=config)
    for _ in range(2):
        backward(model_a, gen_a)
        a.step()
        backward(model_b, gen_b)
        b.step()
    b.load_state_dict(a.state_dict())  # replaces b's state dicts: b re-stacks at its next step
    for _ in range(3):
        backward(model_a, gen_a)
        a.step()
        backward(model_b, gen_b)
        b.step()
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def refreshes(optimizer: torch.optim.Optimizer, model: Stack, steps: int) -> list[set[str]]:
    """Per step, the names of the matrices whose left inverse root changed."""
    gen = torch.Generator().manual_seed(3)
    names = {id(layer.weight): f"layers.{i}.weight" for i, layer in enumerate(model.layers)}
    seen, previous = [], {}
    for _ in range(steps):
        backward(model, gen)
        optimizer.step()
        changed = set()
        for layer in model.layers:
            root = optimizer.state[layer.weight]["pieces"][0]["left_root"].clone()
            if id(layer.weight) not in previous or not torch.equal(root, previous[id(layer.weight)]):
                changed.add(names[id(layer.weight)])
            previous[id(layer.weight)] = root
        seen.append(changed)
    return seen


def test_refreshes_are_staggered_by_name_and_follow_refresh_due():
    frequency, steps = 4, 9
    model = Stack()
    optimizer = Shampoo(build_param_groups(model.named_parameters()), lr=1e-2,
                        config=ShampooConfig(precondition_frequency=frequency))
    seen = refreshes(optimizer, model, steps)
    names = [f"layers.{i}.weight" for i in range(LAYERS)]
    offsets = {n: refresh_offset(n, frequency) for n in names}
    assert len(set(offsets.values())) > 1, "the names of this model spread over several offsets"
    for step, changed in enumerate(seen, start=1):
        assert changed == {n for n in names if refresh_due(step, frequency, offsets[n])}, step
    assert seen[0] == set(names)
    assert all(len(changed) < LAYERS for changed in seen[1:])
    # Every matrix refreshes once in each window of f steps after the first.
    for n in names:
        assert sum(n in changed for changed in seen[1:1 + frequency]) == 1


def test_without_stagger_every_matrix_refreshes_together():
    model = Stack()
    optimizer = Shampoo(build_param_groups(model.named_parameters()), lr=1e-2,
                        config=ShampooConfig(precondition_frequency=4, stagger_refresh=False))
    seen = refreshes(optimizer, model, 9)
    everything = {f"layers.{i}.weight" for i in range(LAYERS)}
    assert [step for step, changed in enumerate(seen, start=1) if changed] == [1, 5, 9]
    assert all(changed in (set(), everything) for changed in seen)


def test_a_failed_eigendecomposition_keeps_the_previous_root_and_names_the_matrix(caplog):
    model = Stack()
    optimizer = Shampoo(build_param_groups(model.named_parameters()), lr=1e-2,
                        config=ShampooConfig(precondition_frequency=1))
    gen = torch.Generator().manual_seed(4)
    backward(model, gen)
    optimizer.step()
    poisoned = model.layers[2].weight
    state = optimizer.state[poisoned]["pieces"][0]
    state["left"][0, 0] = float("nan")  # eigh on it fails, in fp32 and in fp64
    before = {id(layer.weight): optimizer.state[layer.weight]["pieces"][0]["left_root"].clone()
              for layer in model.layers}
    backward(model, gen)
    with caplog.at_level(logging.WARNING, logger="megatron.canzona.optim"):
        optimizer.step()  # does not raise
    for layer in model.layers:
        root = optimizer.state[layer.weight]["pieces"][0]["left_root"]
        assert torch.equal(root, before[id(layer.weight)]) == (layer.weight is poisoned)
    assert "layers.2.weight" in caplog.text and "keep their previous preconditioner" in caplog.text
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_soap_keeps_the_previous_basis_of_a_member_whose_eigh_fails():
    config = SOAPConfig(precondition_frequency=1, refresh="eigh")
    state = SOAPState.create((3, 6, 6), config)
    grad = torch.randn(3, 6, 6, generator=torch.Generator().manual_seed(5))
    state.left[1, 0, 0] = float("nan")
    refresh = Refresh((True, True, True))
    soap_update(grad, state, config, refresh)
    assert refresh.failed == [1]
    assert torch.equal(state.basis_left[1], torch.eye(6))  # the basis it had: the identity
    for member in (0, 2):
        q = state.basis_left[member]
        torch.testing.assert_close(q.mT @ q, torch.eye(6), rtol=0, atol=1e-5)
        assert not torch.equal(q, torch.eye(6))


def test_a_refresh_of_some_members_writes_into_the_stack():
    config = SOAPConfig(precondition_frequency=3, refresh="eigh")
    state = SOAPState.create((4, 5, 5), config)
    gen = torch.Generator().manual_seed(6)
    soap_update(torch.randn(4, 5, 5, generator=gen), state, config, Refresh((True,) * 4))
    before = state.basis_left.clone()
    storage = state.basis_left.data_ptr()
    soap_update(torch.randn(4, 5, 5, generator=gen), state, config, Refresh((False, True, True, False)))
    assert state.basis_left.data_ptr() == storage
    assert torch.equal(state.basis_left[0], before[0]) and torch.equal(state.basis_left[3], before[3])
    assert not torch.equal(state.basis_left[1], before[1]) and not torch.equal(state.basis_left[2], before[2])


def test_eigh_is_retried_in_fp64_when_it_fails(monkeypatch):
    a = torch.randn(2, 7, 7, generator=torch.Generator().manual_seed(7))
    matrix = a @ a.mT
    real = torch.linalg.eigh
    calls = []

    def fails_in_fp32(work, *args, **kwargs):  # a failure this machine's LAPACK never shows on demand
        calls.append(work.dtype)
        if work.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return real(work, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", fails_in_fp32)
    values, vectors, failed = robust_eigh(matrix, torch.float32)
    assert failed == [] and calls == [torch.float32, torch.float64, torch.float64]
    assert values.dtype == torch.float32 and vectors.dtype == torch.float32
    expected = real(matrix.double()).eigenvalues.flip(-1)
    torch.testing.assert_close(values.double(), expected, rtol=1e-5, atol=1e-4)
    rebuilt = vectors.double() @ torch.diag_embed(values.double()) @ vectors.double().mT
    torch.testing.assert_close(rebuilt, matrix.double(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_step_without_some_gradients_restacks_without_keeping_old_stacks(name):
    # fp64 end to end: the restacked run must equal the per-matrix loop to rounding (in fp32,
    # SOAP's Adam amplifies batched-vs-single eigh rounding of these rank-deficient 8x8s to 1e-5).
    cls, config = OPTIMIZERS[name]
    if name == "soap":
        config = SOAPConfig(precondition_frequency=2, refresh="eigh", eigh_dtype="float64")
    if name == "shampoo":
        config = ShampooConfig(eps=1e-4, precondition_frequency=2, root_dtype="float64")
    models = [Stack().double(), Stack().double()]
    batched, looped = (cls(build_param_groups(m.named_parameters()), lr=1e-2, config=config, batch_same_shape=b)
                       for m, b in zip(models, (True, False)))
    gens = [torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)]
    for step in range(4):
        for model, optimizer, gen in zip(models, (batched, looped), gens):
            model.zero_grad()
            model(torch.randn(16, WIDTH, generator=gen, dtype=torch.float64)).square().mean().backward()
            if step == 1:  # layers 1 and 4 sit out one step: their states fall behind the others'
                model.layers[1].weight.grad = model.layers[4].weight.grad = None
            optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    # Every stack kept is the storage of some matrix's live state: none lingers unreferenced.
    live = {v.untyped_storage().data_ptr() for layer in models[0].layers
            for v in batched.state[layer.weight]["pieces"][0].values() if isinstance(v, torch.Tensor)}
    kept = {t.untyped_storage().data_ptr() for stack in batched._stacks.values() for t in stack.tensors.values()}
    assert kept <= live
    assert len(batched._stacks) == 2  # layers at step 4 and layers at step 3
