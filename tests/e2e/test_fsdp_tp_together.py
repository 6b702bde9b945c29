"""``--canzona-tp-together`` through ``pretrain_gpt.py``: Muon under Megatron-FSDP at TP 2 x DP 2
(``optim_grads_params``, the early gathers and early compute on, Newton-Schulz in fp32 as the
exactness tests run it), fc1, fc2 and the attention projection computed by their two TP ranks
together, each gathering its own shard, their Gram matrices summed over the TP group; against the
same run with one host per matrix. The first loss is bitwise (nothing updated yet), the others within
the tolerances the FSDP comparisons use (``test_canzona_fsdp.py``: 1e-5 of the largest loss, gradient
norms 1e-4): the sums run in another order, nothing else differs (the norm is the exact one either
way). In bf16 the Gram sums' rounding flips bf16 roundings of the iteration from step to step, which
four steps amplify to the tolerances' size (1.4e-4 in the fourth gradient norm once). In fp32 the two
runs' losses agree to the bit here; that each TP rank computes its shard is held by
tests/multirank/test_replay_fsdp.py (the ranks that updated each matrix), and the start-up line names
the matrices. tests/multirank/test_replay_fsdp.py holds the step to one device's math.
A checkpoint of the run with one host per matrix resumes with the matrices computed together (the
state is the holders' momentum either way, the same checkpoint)."""

from __future__ import annotations

import pytest

from .support import DemoData
from .test_canzona_fsdp import FP32_NS, GRAD_NORM_RTOL, LOSS_RTOL, TP2
from .test_megatron_fsdp import FSDP, ITERS
from .test_megatron_fsdp import _train as train

pytestmark = pytest.mark.slow

FLAGS = ("--canzona", "--optimizer", "muon", *FSDP, *TP2, "--data-parallel-sharding-strategy", "optim_grads_params",
         "--canzona-early-compute", "on", *FP32_NS)


@pytest.fixture(scope="module")
def runs(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("tp_together")
    out = {together: train(demo_data, root / together, 4, *FLAGS, "--canzona-tp-together", together,
                           *(("--save", str(root / "off" / "ckpt"), "--save-interval", "2") if together == "off" else ()))
           for together in ("off", "all")}
    out["resumed"] = train(demo_data, root / "resumed", 4, *FLAGS, "--canzona-tp-together", "all",
                           "--load", str(root / "off" / "ckpt"), "--ckpt-step", "2")
    return out


def test_matrices_computed_by_their_tp_ranks_together_train_as_one_host_does(runs: dict) -> None:
    alone, together = runs["off"]["metrics"], runs["all"]["metrics"]
    assert sorted(alone) == sorted(together) == list(range(1, ITERS + 1))
    assert together[1]["lm_loss"] == alone[1]["lm_loss"]
    largest = max(m["lm_loss"] for m in alone.values())
    for iteration in range(2, ITERS + 1):
        assert together[iteration]["lm_loss"] == pytest.approx(alone[iteration]["lm_loss"], abs=LOSS_RTOL["muon"] * largest)
        assert together[iteration]["grad_norm"] == pytest.approx(alone[iteration]["grad_norm"], rel=GRAD_NORM_RTOL)
    lines = [line for line in runs["all"]["stdout"].splitlines() if line.startswith("[canzona] TP together")]
    assert len(lines) == 1 and "matrices computed by their 2 TP ranks together" in lines[0], lines
    assert "(linear_fc1, linear_fc2, linear_proj)" in lines[0], lines[0]
    assert "[canzona] TP together" not in runs["off"]["stdout"]


def test_a_checkpoint_of_one_host_per_matrix_resumes_with_the_matrices_computed_together(runs: dict) -> None:
    resumed, together = runs["resumed"]["metrics"], runs["all"]["metrics"]
    assert sorted(resumed) == [3, 4], sorted(resumed)
    largest = max(m["lm_loss"] for m in together.values())
    for iteration in (3, 4):
        assert resumed[iteration]["lm_loss"] == pytest.approx(together[iteration]["lm_loss"], abs=LOSS_RTOL["muon"] * largest)
