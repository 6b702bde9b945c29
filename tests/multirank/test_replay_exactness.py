"""Shampoo's and SOAP's distributed step equals the single-device math on the same gradients.

The training comparisons (``test_canzona_dp.py``, ``test_canzona_split.py``,
``tests/e2e/test_context_parallel.py``) feed each step's rounding into the next forward, and
Shampoo's inverse roots and SOAP's eigenbases amplify it: their bounds there are measured
spreads, and another CPU's BLAS rounds differently. Here nothing is fed back: after each
forward-backward every reduced gradient is replaced by one drawn from the parameter's name and
the step (``TinyRun.replay_grads``), so the distributed optimizer and
:class:`~megatron.canzona.optim.Shampoo` / :class:`~megatron.canzona.optim.SOAP` on one device
(``megatron/canzona/optim``, no runtime) see the same inputs. Over four steps (two
preconditioner refreshes) at DP 4 with matrices split across shards (the lean layout, gathered
to a host), at TP 2 x DP 2 in the whole layout (gathered over TP), at DP 4 in the whole
layout (Megatron-FSDP's: test_replay_fsdp.py), every matrix must end within
``MAX_ULPS`` of the one-device result: Shampoo bitwise,
SOAP within a few units in the last place (bitwise through two steps, the first eigenbasis
included; the runtime and the one-device class round differently after that).
Context parallelism adds nothing here: the optimizer's group is DP x CP, a DP 4 group to the plan.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.canzona.optim import MATRIX_OPTIMIZERS, GateUpLayout, QKVLayout, build_param_groups
from megatron.canzona.planning import CanzonaPlan
from megatron.canzona.runtime import LaunchConfig, launch

from canzona_patches.harness.tiny_gpt import (
    HIDDEN, NUM_HEADS, NUM_QUERY_GROUPS, TinyRun, canzona_config, replayed_grad_seed, train_tiny_gpts,
)
from .test_canzona_dp import SPLITS
from . import CPU_RANKS

pytestmark = [*CPU_RANKS, pytest.mark.quick]

LR = 2e-3
STEPS = 4
OPTIMIZERS = ("shampoo", "soap", "adamuon", "normuon")
REPLAY_SPLITS = SPLITS | {"adamuon": dict(split_qkv=True, split_gate_up=False),
                          "normuon": dict(split_qkv=True, split_gate_up=True)}
CASES = {
    "dp4_lean_split": dict(tp_size=1, canzona_layout="lean", bucket_size=20_000, alpha=1.0),
    "dp4_whole": dict(tp_size=1, canzona_layout="whole", bucket_size=10_000, overlap_grad_reduce=True),
    "tp2_dp2_whole": dict(tp_size=2, canzona_layout="whole", bucket_size=10_000, overlap_grad_reduce=True),
}
"""Case -> the TinyRun fields that make it (4 ranks each, one launch for all)."""
PER_HEAD = {"muon-heads": ("muon", "tp2_dp2_whole"), "muon-heads-lean": ("muon", "tp2_dp2_lean"),
            "normuon-heads": ("normuon", "tp2_dp2_whole"), "shampoo-heads": ("shampoo", "tp2_dp2_whole"),
            "soap-heads": ("soap", "tp2_dp2_whole")}
"""``--canzona-split-qkv-per-head``: name -> (optimizer, case). Each QKV weight is 8 matrices of
one head's 16 rows (4 query heads, 2 key, 2 value); at TP 2 each rank holds one KV group's heads,
gathered to the matrix's host and split there."""
HEAD_CASES = CASES | {"tp2_dp2_lean": dict(tp_size=2, canzona_layout="lean", bucket_size=20_000, alpha=1.0)}
INSTANCES = {"muon-instances": ("muon", "whole"), "muon-instances-lean": ("muon", "lean"),
             "normuon-instances": ("normuon", "whole"), "soap-instances": ("soap", "whole")}
"""``--num-distributed-optimizer-instances 2`` at DP 4: name -> (optimizer, layout). Each instance of
2 DP ranks plans, hosts and steps every matrix; the replayed gradients are the same on every rank."""
MATRIX_SUFFIXES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
MAX_ULPS = {"muon": 1, "shampoo": 1, "soap": 16, "adamuon": 1, "normuon": 1}
MAX_ULPS |= {name: MAX_ULPS[optimizer] for name, (optimizer, _) in (PER_HEAD | INSTANCES).items()}
MAX_ULPS["soap-heads"] = 40
"""Largest difference allowed per optimizer, in units in the last place of the largest element of
the one-device matrix (``ulps``). Measured (`pytest -s` prints it), the same in every case and
layout, under one machine's default code paths (AVX-512, MKL), MKL_CBWR=COMPATIBLE,
MKL_CBWR=AVX2, ATEN_CPU_CAPABILITY=default and ATEN_CPU_CAPABILITY=avx2: Shampoo 0 (bitwise)
but 0.25 under ATen's scalar kernels (default); SOAP 2, 2.5, 6.4, 6.5 and 2. Per-head SOAP (8
16-row blocks a QKV weight, each with its own eigenbases) rounds further: 11 there, 16.2 on
another machine's CPU (where plain SOAP reads 4.2). The bounds are about 2.5 times the largest:
rounding, where a lost or misrouted update moves a matrix by ~lr (10^5 ulp)."""
LAUNCH_TIMEOUT_S = 300.0


def _run(optimizer: str, case: str, cases: dict = CASES) -> TinyRun:
    if optimizer in INSTANCES:
        optimizer, layout = INSTANCES[optimizer]
        return TinyRun(lr=LR, num_steps=STEPS, layout="canzona", optimizer=optimizer, weight_decay=0.1,
                       global_batch=8, early_gather=False, replay_grads=True, instances=2, tp_size=1,
                       canzona_layout=layout, bucket_size=10_000 if layout == "whole" else 20_000,
                       overlap_grad_reduce=True, **REPLAY_SPLITS.get(optimizer, SPLITS["muon"]))
    if optimizer in PER_HEAD:
        optimizer, case = PER_HEAD[optimizer]
        return TinyRun(lr=LR, num_steps=STEPS, layout="canzona", optimizer=optimizer, weight_decay=0.1,
                       global_batch=8, early_gather=False, replay_grads=True, split_qkv_per_head=True,
                       **HEAD_CASES[case])
    return TinyRun(lr=LR, num_steps=STEPS, layout="canzona", optimizer=optimizer, weight_decay=0.1,
                   global_batch=8, early_gather=False, replay_grads=True, **REPLAY_SPLITS[optimizer], **cases[case])


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str], list[dict]]:
    """(optimizer, case) -> per-rank results of one 4-rank launch."""
    cases = [(optimizer, case) for optimizer in OPTIMIZERS for case in CASES]
    cases += [(name, "") for name in (*PER_HEAD, *INSTANCES)]
    per_rank = launch(train_tiny_gpts, LaunchConfig(world_size=4, timeout_s=LAUNCH_TIMEOUT_S),
                      [_run(*key) for key in cases])
    return {key: [rank[i] for rank in per_rank] for i, key in enumerate(cases)}


def one_device(run: TinyRun, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The matrices after ``run.num_steps`` steps of the optimizer's single-device class on
    the replayed gradients, split (Q/K/V, gate/up) and named as the distributed run splits them."""
    params = {name: torch.nn.Parameter(value.clone()) for name, value in initial.items()
              if name.endswith(MATRIX_SUFFIXES)}
    qkv = QKVLayout(num_query_groups=NUM_QUERY_GROUPS, heads_per_group=NUM_HEADS // NUM_QUERY_GROUPS,
                    head_dim=HIDDEN // NUM_HEADS, split_heads=run.split_qkv_per_head) if run.split_qkv else None
    groups = build_param_groups(params.items(), qkv_layout=qkv,
                                gate_up_layout=GateUpLayout() if run.split_gate_up else None)
    optimizer = MATRIX_OPTIMIZERS.get(run.optimizer, MATRIX_OPTIMIZERS["adaptive_muon"])(groups, lr=run.lr, weight_decay=run.weight_decay,
                                                 config=canzona_config(run).matrix)
    for step in range(run.num_steps):
        for name, param in params.items():
            generator = torch.Generator().manual_seed(replayed_grad_seed(name, run.seed, step))
            param.grad = 0.02 * torch.randn(param.shape, generator=generator)
        optimizer.step()
    return {name: param.detach() for name, param in params.items()}


def ulps(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |got - expected| in units in the last place of ``expected``'s largest magnitude
    (an element near zero would count the rounding of the sums that made it many times over)."""
    top = expected.abs().max()
    return float((got - expected).abs().max() / (torch.nextafter(top, torch.tensor(float("inf"))) - top))


@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_distributed_step_equals_one_device_math(results, optimizer: str, case: str) -> None:
    check_against_one_device(results[(optimizer, case)], _run(optimizer, case), optimizer, case)


@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize("name", list(PER_HEAD))
def test_per_head_matrices_equal_one_device_math(results, name: str) -> None:
    """``--canzona-split-qkv-per-head`` at TP 2 x DP 2 (heads split over the TP ranks), in both layouts:
    every matrix within the optimizer's bound of the one-device class stepping each head apart."""
    run = _run(name, "")
    assert run.split_qkv_per_head and run.split_qkv
    check_against_one_device(results[(name, "")], run, name, PER_HEAD[name][1])
    # the heads are stepped apart: Q, K and V stepped whole land far from what the run computed
    initial = results[(name, "")][0]["initial_params"]
    whole_qkv = one_device(dataclasses.replace(run, split_qkv_per_head=False), initial)
    for key, value in whole_qkv.items():
        if key.endswith("linear_qkv.weight"):
            apart = ulps(results[(name, "")][0]["params"][key], value)
            assert apart > 1000 * MAX_ULPS[name], f"{key}: {apart:.3g} ulp from Q, K and V stepped whole"


@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize("name", list(INSTANCES))
def test_two_optimizer_instances_equal_one_device_math(results, name: str) -> None:
    """DP 4 as 2 distributed-optimizer instances of DP 2 (Megatron's gradient all-reduce across
    them, then the replayed gradients): every rank's matrices within the optimizer's bound of the
    one-device class, each instance having planned and stepped over its own 2 ranks."""
    run = _run(name, "")
    assert run.instances == 2
    per_rank = results[(name, "")]
    check_against_one_device(per_rank, run, name, f"2 instances x DP 2, {INSTANCES[name][1]}")
    assert {CanzonaPlan.from_json(rank["plan"]).dp_size for rank in per_rank} == {2}


def check_against_one_device(per_rank: list[dict], run: TinyRun, optimizer: str, case: str) -> None:
    """Every rank's matrices after the run within ``MAX_ULPS`` of :func:`one_device`'s."""
    initial = per_rank[0]["initial_params"]
    expected = one_device(run, initial)
    assert len(expected) == 4 * 2, sorted(expected)  # four matrices in each of two layers
    computed = sorted(name for result in per_rank for name in result["updated"])
    # each matrix is computed once per distributed-optimizer instance
    assert len(computed) == run.instances * len({n.split("#")[0] for n in computed}) or run.split_gate_up, computed
    worst = {}
    for rank, result in enumerate(per_rank):
        assert result["initial_params"].keys() == initial.keys()
        for name, value in expected.items():
            assert not torch.equal(value, initial[name]), f"{name} did not move"
            worst[name] = max(worst.get(name, 0.0), ulps(result["params"][name], value))
    print(f"\n[replay] {optimizer} {case}: largest difference {max(worst.values()):.3g} ulp "
          f"(bound {MAX_ULPS[optimizer]})", flush=True)
    for name, seen in worst.items():
        assert seen <= MAX_ULPS[optimizer], \
            f"{optimizer} {case} {name}: {seen:.3g} ulp from one device (allowed {MAX_ULPS[optimizer]})"
