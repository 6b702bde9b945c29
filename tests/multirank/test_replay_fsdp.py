"""Under Megatron-FSDP the Canzona step equals the single-device math on the same gradients
(test_replay_exactness.py's replay: after each forward-backward every rank's elements of a gradient
drawn from the parameter's name and the step are written into the gradient shard Megatron-FSDP
attached to its optimizer parameter). DP 4 in ``optim_grads_params`` and TP 2 x DP 2 in
``optim_grads``, Muon's momentum kept on the holders (Muon, AdaMuon, NorMuon), Shampoo and SOAP with
their state on the hosts: every matrix within ``MAX_ULPS`` of the one-device result. Measured:
Muon, AdaMuon, NorMuon 0 ulp (bitwise), Shampoo 0.125, SOAP 4.19, the same as the distributed
optimizer's layouts on the same machine.

With ``--canzona-tp-together all`` (TP 2 x DP 2, ``optim_grads``, Muon) fc1, fc2 and the attention
projection are computed by their two TP ranks together, each its own shard, their Gram matrices
summed over the TP group: not bitwise (the sums run in another order), every matrix within
:data:`TOGETHER_MAX_ULPS` of the one-device result.

With ``--canzona-narrow-gathers`` (Muon iterating in bf16, DP 4 ``optim_grads_params`` and TP 2 x DP 2
``optim_grads``) each whole matrix's holders send its Newton-Schulz input divided by its exact norm
(summed in integers), in bf16: bitwise the one-device math with ``MuonConfig.exact_norm``, as the same
run with fp32 gathers is bitwise the one-device math with torch's norm; the two norms' maths differ by
at most :data:`NARROW_SHARE` of what iterating in bf16 instead of fp32 changes; each rank sends exactly
the bytes the bf16 pieces save fewer."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from megatron.canzona.planning import CanzonaPlan
from megatron.canzona.planning.schedule import plan_schedule
from megatron.canzona.runtime import LaunchConfig, launch

from canzona_patches.harness.tiny_gpt import train_tiny_gpts
from .test_replay_exactness import LAUNCH_TIMEOUT_S, _run, check_against_one_device, one_device, ulps
from . import CPU_RANKS

pytestmark = [*CPU_RANKS]

OPTIMIZERS = ("muon", "shampoo", "soap", "adamuon", "normuon")
CASES = {
    "dp4_fsdp_optim_grads_params": dict(tp_size=1, fsdp="optim_grads_params", overlap_grad_reduce=True),
    "tp2_dp2_fsdp_optim_grads": dict(tp_size=2, fsdp="optim_grads", overlap_grad_reduce=True),
}
"""Case -> the TinyRun fields that make it (4 ranks each, one launch for all)."""
TOGETHER = ("tp2_dp2_fsdp_together", dict(tp_size=2, fsdp="optim_grads", overlap_grad_reduce=True, tp_together="all"))
"""Muon's case with the TP-sharded matrices computed by their TP ranks together."""
TOGETHER_MAX_ULPS = 64
"""Measured: 6 ulp (Newton-Schulz in fp32, the Gram matrices summed over 2 ranks in fp32)."""
NARROW = {f"{case}_bf16{suffix}": {**fields, "muon_ns_dtype": "bfloat16", "narrow_gathers": narrow}
          for case, fields in CASES.items() for suffix, narrow in (("", False), ("_narrow", True))}
"""Muon iterating in bf16 under each case, its gathers in fp32 and narrow (``--canzona-narrow-gathers``)."""
NARROW_SHARE = 0.5
"""Bound on the largest difference the exact norm makes to the one-device math (against torch's), as a
share of the largest difference between the one-device math iterating in bf16 and in fp32."""


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str], list[dict]]:
    cases = [(optimizer, case) for optimizer in OPTIMIZERS for case in CASES] + [("muon", TOGETHER[0])]
    cases += [("muon", case) for case in NARROW]
    every = CASES | dict([TOGETHER]) | NARROW
    per_rank = launch(train_tiny_gpts, LaunchConfig(world_size=4, timeout_s=LAUNCH_TIMEOUT_S),
                      [_run(*key, cases=every) for key in cases])
    return {key: [rank[i] for rank in per_rank] for i, key in enumerate(cases)}


@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_fsdp_step_equals_one_device_math(results, optimizer: str, case: str) -> None:
    check_against_one_device(results[(optimizer, case)], _run(optimizer, case, CASES), optimizer, case)


@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
def test_matrices_computed_by_their_tp_ranks_together_equal_one_device_math(results) -> None:
    name, fields = TOGETHER
    per_rank = results[("muon", name)]
    run = _run("muon", name, dict([TOGETHER]))
    computed = collections.Counter(n for result in per_rank for n in result["updated"])
    shared = {n.split(".")[-2] for n, ranks in computed.items() if ranks == 2}  # each of its two TP ranks
    assert shared == {"linear_fc1", "linear_fc2", "linear_proj"}, computed
    assert all(ranks == 1 for n, ranks in computed.items() if n.split(".")[-2] not in shared), computed
    initial = per_rank[0]["initial_params"]
    expected = one_device(run, initial)
    worst = max(ulps(result["params"][n], value) for result in per_rank for n, value in expected.items())
    print(f"\n[replay] muon {name}: largest difference {worst:.3g} ulp (bound {TOGETHER_MAX_ULPS})", flush=True)
    assert 0 < worst <= TOGETHER_MAX_ULPS


def _largest(per_rank: list[dict], expected: dict) -> float:
    return max(float((result["params"][n] - value).abs().max()) for result in per_rank for n, value in expected.items())


@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize("case", list(CASES))
def test_narrow_gathers_are_bitwise_one_device_math_with_the_exact_norm(results, case: str) -> None:
    wide, narrow = results[("muon", f"{case}_bf16")], results[("muon", f"{case}_bf16_narrow")]
    run = _run("muon", f"{case}_bf16_narrow", NARROW)
    initial = narrow[0]["initial_params"]
    expected = one_device(run, initial)  # with MuonConfig.exact_norm, as the narrow run
    with_torch_norm = one_device(dataclasses.replace(run, narrow_gathers=False), initial)
    assert _largest(wide, with_torch_norm) == 0.0  # fp32 gathers, torch's norm on the host: bitwise
    assert _largest(narrow, expected) == 0.0  # bf16 gathers divided by the exact norm on the holders: bitwise
    in_fp32 = one_device(dataclasses.replace(run, muon_ns_dtype="float32", narrow_gathers=False), initial)
    bf16_rounding = max(float((in_fp32[n] - value).abs().max()) for n, value in with_torch_norm.items())
    norms = _largest([{"params": expected}], with_torch_norm)
    print(f"\n[replay] muon {case}, narrow gathers: bitwise; the exact norm against torch's moves the matrices by "
          f"{norms:.3g}, {norms / bf16_rounding:.3f} of bf16's own ({bf16_rounding:.3g}; bound {NARROW_SHARE})", flush=True)
    assert norms <= NARROW_SHARE * bf16_rounding
    # the bytes: every piece of a whole matrix that goes to its host goes in bf16, rounded up to fp32 words
    plan = CanzonaPlan.from_json(narrow[0]["plan"])
    saved = collections.Counter()
    for task in plan_schedule(plan).tasks:
        if task.name.endswith("linear_qkv.weight") or task.is_local():  # Q, K and V: three norms, fp32
            continue
        for holder, lo, hi in task.holders(plan.tp_size):
            if holder != task.host:
                saved[holder] += 4 * (hi - lo) - 4 * -(-2 * (hi - lo) // 4)
    assert sum(saved.values()) > 0
    for w, n in zip(wide, narrow):
        assert w["host_coord"] == n["host_coord"]
        assert w["tp_stats"]["bytes_sent"] - n["tp_stats"]["bytes_sent"] == saved[tuple(n["host_coord"])], n["host_coord"]
