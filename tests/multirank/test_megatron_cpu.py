"""Megatron-Core DDP + DistributedOptimizer on CPU/gloo match a single process, DP x TP.

Every case trains the same tiny GPT (``tiny_gpt.py``) on the same global batches with the
stock fp32 Adam DistributedOptimizer, and must end with the parameters, losses and grad
norms of the TP1 x DP1 reference. Cases with one world size share one launch: starting
processes and importing Megatron costs more than the training.
"""

from collections.abc import Callable

import pytest
import torch

from megatron.canzona.runtime import LaunchConfig, launch

from canzona_patches.harness.tiny_gpt import TinyRun, train_tiny_gpts

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU/gloo tests of the CUDA->CPU redirect"
)

LR = 1e-3
# Adam moves an element by about lr per step whatever the gradient's scale, and by
# lr * delta / eps at most when fp32 reordering (DP reduce-scatter, TP partial sums)
# perturbs a gradient by delta. Measured worst case over 3 steps here: 9e-8 (DP2) and
# 3.7e-6 (TP2 x DP2, an element whose gradient is ~eps). 0.02 * lr leaves 5x headroom
# over that and stays 50x below one Adam step, which is what a lost, doubled or misrouted
# gradient shard would change an element by.
PARAM_ATOL = 0.02 * LR
# Adam hides the gradient's scale, so scale bugs (say, summing instead of averaging over
# DP) show in the grad norm only. Measured agreement: 1e-7 relative.
GRAD_NORM_RTOL = 1e-5
LOSS_RTOL = 1e-5  # forward of the same tokens; measured agreement ~1e-7
# A 4-rank launch of two runs takes ~45 s on 2 cores; a rank stuck in a collective fails
# the launch after this. A test may trigger the reference launch and its own.
LAUNCH_TIMEOUT_S = 150.0
TEST_TIMEOUT_S = 2 * LAUNCH_TIMEOUT_S + 30
BUCKET = 20_000  # elements: ~5 buckets for the ~90k-element model, so overlap has work

REFERENCE = TinyRun(lr=LR)
# lr = 0 leaves the weights as initialized: shows use_cpu_initialization's TP-independence.
INIT_ONLY = TinyRun(lr=0.0, num_steps=1)
CASES: dict[str, tuple[int, TinyRun]] = {
    "dp2": (2, TinyRun(lr=LR)),
    "dp2_layer_wise_layout": (
        2,
        TinyRun(lr=LR, layout="layer_wise", overlap_grad_reduce=True, bucket_size=BUCKET),
    ),
    "tp2_dp2": (4, TinyRun(lr=LR, tp_size=2, overlap_grad_reduce=True, bucket_size=BUCKET)),
}
INIT_CASES = {"tp2_dp2_init_only": (4, TinyRun(lr=0.0, num_steps=1, tp_size=2))}
CUSTOM_LAYOUT_CASES = [name for name, (_, run) in CASES.items() if run.layout != "megatron"]


def _launch(world_size: int, runs: list[TinyRun]) -> list[list[dict]]:
    """Per run, per rank results of one launch of ``world_size`` ranks."""
    config = LaunchConfig(world_size=world_size, timeout_s=LAUNCH_TIMEOUT_S)
    per_rank = launch(train_tiny_gpts, config, runs)
    return [[rank_results[i] for rank_results in per_rank] for i in range(len(runs))]


@pytest.fixture(scope="module")
def single_process() -> dict[str, dict]:
    trained, initialized = _launch(1, [REFERENCE, INIT_ONLY])
    return {"trained": trained[0], "initialized": initialized[0]}


@pytest.fixture(scope="module")
def reference(single_process: dict[str, dict]) -> dict:
    return single_process["trained"]


@pytest.fixture(scope="module")
def outcome() -> Callable[[str], list[dict]]:
    """Results of a case by name; all cases of one world size run in one launch."""
    by_world: dict[int, dict[str, list[dict]]] = {}

    cases = CASES | INIT_CASES

    def results_of(name: str) -> list[dict]:
        world_size = cases[name][0]
        if world_size not in by_world:
            names = [n for n, (w, _) in cases.items() if w == world_size]
            runs = _launch(world_size, [cases[n][1] for n in names])
            by_world[world_size] = dict(zip(names, runs))
        return by_world[world_size][name]

    return results_of


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_reference_trains(reference: dict) -> None:
    assert len(reference["params"]) == 19  # embedding, 2 x 8 per layer, final norm, output
    assert all(torch.isfinite(p).all() for p in reference["params"].values())
    assert all(norm > 0 for norm in reference["grad_norms"])


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_initial_weights_do_not_depend_on_tp(single_process: dict[str, dict], outcome) -> None:
    # use_cpu_initialization draws each full master weight on CPU and keeps this rank's slice.
    expected = single_process["initialized"]["params"]
    for result in outcome("tp2_dp2_init_only"):
        assert all(torch.equal(result["params"][name], expected[name]) for name in expected)


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process(case: str, reference: dict, outcome) -> None:
    for rank, result in enumerate(outcome(case)):
        assert result["params"].keys() == reference["params"].keys()
        for name, expected in reference["params"].items():
            actual = result["params"][name]
            assert actual.shape == expected.shape, f"rank {rank}: {name}"
            torch.testing.assert_close(
                actual, expected, rtol=0, atol=PARAM_ATOL, msg=lambda m: f"rank {rank} {name}: {m}"
            )
        torch.testing.assert_close(
            result["grad_norms"], reference["grad_norms"], rtol=GRAD_NORM_RTOL, atol=0
        )
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=LOSS_RTOL, atol=0)


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("case", CUSTOM_LAYOUT_CASES)
def test_custom_layouts_give_every_rank_whole_params(case: str, outcome) -> None:
    assert all(result["whole_params_owned"] for result in outcome(case))


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_megatron_default_layout_splits_some_param(outcome) -> None:
    # The contrast that makes the custom-layout cases meaningful: with TP2 x DP2 the default
    # byte-level layout cuts at least one parameter between two DP ranks.
    assert not all(result["whole_params_owned"] for result in outcome("tp2_dp2"))
