"""Staged updates (what early compute runs before the step): the state stays as it was until
they are committed, a commit is bitwise the unstaged update, a discard leaves the state
untouched. Shampoo and SOAP update a staging copy of their state, made once (the state and
its copy swap at each commit); Muon keeps no copy: its momentum advances at the commit, from
the gradients given again."""

from __future__ import annotations

import pytest
import torch

from megatron.canzona.optim.common import apply_update
from megatron.canzona.optim.split import merge_pieces, split_pieces

from test_optim_stacks_and_refresh import OPTIMIZERS, Stack, backward
from megatron.canzona.optim import build_param_groups

pytestmark = pytest.mark.quick

STEPS = 5
"""Shampoo's and SOAP's preconditioners refresh every 2 steps: at steps 1, 3 and 5."""


class WithLone(Stack):
    """The stack of same-shape matrices (one batch) and a matrix of its own shape (alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.lone = torch.nn.Linear(8, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lone(super().forward(x))


def _grads(optimizer) -> dict:
    """The matrices' gradient pieces by bucket member ``(id(param), piece)``: what a commit takes."""
    out = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and optimizer._is_matrix(group, param):
                for i, piece in enumerate(split_pieces(param.grad, group["fused_layout"])):
                    out[(id(param), i)] = piece
    return out


def _matrix_step(optimizer, *, staged: bool):
    """The matrix part of ``optimizer.step()``, its updates ``staged`` or not; returns a
    function applying the directions (after a commit, for staged ones)."""
    applies = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None and optimizer._is_matrix(group, p)]
        jobs = []
        for param in params:
            pieces = split_pieces(param.grad, group["fused_layout"])
            optimizer._declare(param, len(pieces))
            jobs.extend((param, i, piece) for i, piece in enumerate(pieces))
        directions = optimizer._run_jobs(jobs, group["config"], staged=staged)
        for param in params:
            count = len(optimizer.state[param]["pieces"])
            update = merge_pieces([directions[(id(param), i)] for i in range(count)], group["fused_layout"])
            applies.append((param, update, group["lr"], group["weight_decay"]))

    def apply() -> None:
        for param, update, lr, wd in applies:
            apply_update(param, update, lr=lr, weight_decay=wd)

    return apply


def _state(optimizer, model) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        for i, piece in enumerate(optimizer.state[param]["pieces"]):
            for field, value in piece.items():
                out[f"{name}.{i}.{field}"] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def _pointers(optimizer, model) -> dict[str, int]:
    return {f"{name}.{field}": value.data_ptr() for name, param in model.named_parameters()
            for field, value in optimizer.state[param]["pieces"][0].items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_staged_updates_commit_bitwise_and_discard_without_a_trace(name):
    cls, config = OPTIMIZERS[name]
    models = [WithLone() for _ in range(2)]
    optimizers = [cls(build_param_groups(m.named_parameters()), lr=1e-2, config=config) for m in models]
    reference, staged = optimizers
    seen: dict[str, set[int]] = {}
    for step in range(STEPS):
        for model in models:
            backward(model, torch.Generator().manual_seed(step))
        _matrix_step(reference, staged=False)()
        if step:  # a staged update that is dropped (a clipped or skipped step) changes nothing
            before = _state(staged, models[1])
            _matrix_step(staged, staged=True)
            assert staged.staged_count > 0
            staged.discard_staged()
            assert _same_state(_state(staged, models[1]), before)
        apply = _matrix_step(staged, staged=True)
        if step:
            assert _same_state(_state(staged, models[1]), before), "a staged update must not touch the state"
        staged.commit_staged(_grads(staged))
        assert staged.staged_count == 0
        apply()
        assert _same_state(_state(staged, models[1]), _state(reference, models[0])), step
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p, q), step
        for key, pointer in _pointers(staged, models[1]).items():
            seen.setdefault(key, set()).add(pointer)
    # A stack's state and one staging copy, swapped at each commit: nothing allocated per step;
    # Muon's momentum never moves (no copy). (A lone SOAP matrix's refresh makes new bases,
    # staged or not.)
    stacked = max(len(pointers) for key, pointers in seen.items() if key.startswith("layers."))
    assert stacked == (1 if name == "muon" else 2)
    if name == "muon":
        with pytest.raises(RuntimeError, match="pass grads"):
            _matrix_step(staged, staged=True)
            staged.commit_staged()


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
