"""Under Megatron-FSDP the Canzona step equals the single-device math on the same gradients
(test_replay_exactness.py's replay: after each forward-backward every rank's elements of a gradient
drawn from the parameter's name and the step are written into the gradient shard Megatron-FSDP
attached to its optimizer parameter). DP 4 in ``optim_grads_params`` and TP 2 x DP 2 in
``optim_grads``, Muon's momentum kept on the holders (Muon, AdaMuon, NorMuon), Shampoo and SOAP with
their state on the hosts: every matrix within ``MAX_ULPS`` of the one-device result. Measured:
Muon, AdaMuon, NorMuon 0 ulp (bitwise), Shampoo 0.125, SOAP 4.19, the same as the distributed
optimizer's layouts on the same machine."""

from __future__ import annotations

import pytest

from megatron.canzona.runtime import LaunchConfig, launch

from canzona_patches.harness.tiny_gpt import train_tiny_gpts
from .test_replay_exactness import LAUNCH_TIMEOUT_S, _run, check_against_one_device
from . import CPU_RANKS

pytestmark = [*CPU_RANKS]

OPTIMIZERS = ("muon", "shampoo", "soap", "adamuon", "normuon")
CASES = {
    "dp4_fsdp_optim_grads_params": dict(tp_size=1, fsdp="optim_grads_params", overlap_grad_reduce=True),
    "tp2_dp2_fsdp_optim_grads": dict(tp_size=2, fsdp="optim_grads", overlap_grad_reduce=True),
}
"""Case -> the TinyRun fields that make it (4 ranks each, one launch for all)."""


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str], list[dict]]:
    cases = [(optimizer, case) for optimizer in OPTIMIZERS for case in CASES]
    per_rank = launch(train_tiny_gpts, LaunchConfig(world_size=4, timeout_s=LAUNCH_TIMEOUT_S),
                      [_run(*key, cases=CASES) for key in cases])
    return {key: [rank[i] for rank in per_rank] for i, key in enumerate(cases)}


@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_fsdp_step_equals_one_device_math(results, optimizer: str, case: str) -> None:
    check_against_one_device(results[(optimizer, case)], _run(optimizer, case, CASES), optimizer, case)
