"""Mixture of experts under Canzona equals single-device math, and its checkpoints reshard
across expert-parallel sizes.

The tiny MoE GPT (``tiny_gpt.py`` with 4 experts of FFN 32, top-2, the all-to-all
dispatcher and an auxiliary load-balancing loss) trains a few steps with Muon, Shampoo and
SOAP at EP 2 x DP 2 (expert-DP 2) and at EP 2 with TP 2 (expert TP 1, expert-DP 2), and once
in a single process (EP 1: Megatron makes experts ordinary dense parameters there). The
distributed runs must end with the single process's parameters (SOAP within twice what EP 1 x
DP 4 differs by: see YARDSTICK), every matrix -- each expert of each layer by its global
index -- computed exactly once per step over all ranks.

A Muon run at EP 2 x DP 2 saves after step 2 and resumes at EP 4 (expert-DP 1) and at EP 1
(one process): both must continue to the uninterrupted run's parameters.

Two launches (4 ranks, then 1): starting processes and importing Megatron costs more than
the training.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron.canzona.runtime import LaunchConfig, launch

from canzona_patches.harness import tiny_gpt
from canzona_patches.harness.tiny_checkpoint import ResumeJob, run_resume_job
from canzona_patches.harness.tiny_gpt import TinyRun
from . import CPU_RANKS

pytestmark = CPU_RANKS

LR = 2e-3
STEPS = 4  # Shampoo and SOAP (frequency 2) refresh their preconditioners twice
HALF = 2
OPTIMIZERS = ("muon", "shampoo", "soap")
# Tolerances of the dense TP test (tests/multirank/test_canzona_tp.py, where they are
# derived): a lost, doubled or misrouted update moves a whole matrix by ~lr per step.
MATRIX_ATOL = {"muon": 1e-3 * LR, "shampoo": 1e-3 * LR, "soap": 0.5 * LR}
ELEMENTWISE_ATOL = {"muon": 0.01 * LR, "shampoo": 0.01 * LR, "soap": 0.25 * LR}
MEAN_ATOL = {"muon": 1e-4 * LR, "shampoo": 1e-4 * LR, "soap": 0.05 * LR}
LOSS_RTOL = {"muon": 1e-5, "shampoo": 1e-5, "soap": 5e-5}  # SOAP: measured up to 1.1e-5 (see YARDSTICK)
GRAD_NORM_RTOL = {"muon": 1e-5, "shampoo": 1e-5, "soap": 1e-3}
# SOAP's eigenbases of rank-deficient statistics (an expert's gradient has the rank of the
# tokens routed to it) are picked by rounding, so the reduce order alone moves its results:
# EP 1 x DP 4, with no expert parallelism, differs from one process by 2.5e-3 (1.2 lr) at
# most, 4.8e-4 on average, and 3.5e-6 in the loss -- as much as EP 2 x DP 2 (4.6e-3 on one
# embedding element, whose sign-like first Adam steps flip: 2.3 lr; 4.7e-4, 1.1e-5) and EP 2
# with TP 2 (2.3e-3, 4.8e-4, 8.3e-6), measured. For SOAP that run is the yardstick: the
# largest difference may be MAX_FACTOR times its own, the mean REORDER_FACTOR times. A lost or
# doubled expert update moves a whole matrix by ~lr per step: a mean of 2e-3, twice the bound.
YARDSTICK = ("soap",)
REORDER_FACTOR = 2.0
MAX_FACTOR = 3.0
MATRIX_SUFFIXES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
LAYOUTS = {"ep2_dp2": dict(tp_size=1, ep_size=2), "ep2_tp2": dict(tp_size=2, ep_size=2),
           "ep2_tp2_etp2": dict(tp_size=2, ep_size=2, expert_tp_size=2)}
"""``ep2_tp2_etp2``: Megatron's default expert TP (the TP size): each expert matrix TP-sharded over
the expert-TP group, hosted over expert-DP 1 x expert-TP 2."""
LAUNCH_TIMEOUT_S = 420.0
TEST_TIMEOUT_S = 2 * LAUNCH_TIMEOUT_S


def _run(optimizer: str, **sizes: int) -> TinyRun:
    # Clipping at 1.0 (the norms are ~1.5): every update depends on the global gradient norm.
    return TinyRun(lr=LR, num_steps=STEPS, layout="canzona", optimizer=optimizer, weight_decay=0.1, num_experts=4,
                   split_qkv=optimizer != "soap", clip_grad=1.0, **sizes)


def moe_jobs(jobs: list[TinyRun | ResumeJob]) -> list[dict[str, Any]]:
    """Rank body: plain runs and checkpoint jobs in order, each result with the global rank."""
    results = []
    for job in jobs:
        result = run_resume_job(job) if isinstance(job, ResumeJob) else tiny_gpt.train_tiny_gpt(job)
        # threads alive after the job: a run whose model outlived it kept its groups' gloo threads
        results.append({**result, "rank": dist.get_rank(), "threads": len(os.listdir("/proc/self/task"))})
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[str, str], list[dict]]:
    """(optimizer or job, layout) -> per-rank results."""
    root = tmp_path_factory.mktemp("moe_checkpoints")
    saved = _run("muon", tp_size=1, ep_size=2)
    four = [(opt, name, _run(opt, **sizes)) for name, sizes in LAYOUTS.items() for opt in OPTIMIZERS]
    four += [(opt, "dp4", _run(opt)) for opt in YARDSTICK]  # EP 1 x DP 4: the reduce order alone
    early = replace(_run("muon", tp_size=2, ep_size=2), nan_grad_at_step=1, return_state=True)
    four += [("early_on", "ep2_tp2", early), ("early_off", "ep2_tp2", replace(early, early_gather=False))]
    computed = replace(early, clip_grad=3.0, big_grad_at_step=STEPS - 1)  # the clip acts at the last step only
    four += [("compute_early", "ep2_tp2", replace(computed, early_compute=True, early_gather_at_dispatch=True)),
             ("compute_in_step", "ep2_tp2", computed)]
    at_etp2 = replace(computed, expert_tp_size=2)  # the experts' pieces gathered over expert TP in backward
    four += [("compute_early", "ep2_tp2_etp2", replace(at_etp2, early_compute=True, early_gather_at_dispatch=True)),
             ("compute_in_step", "ep2_tp2_etp2", at_etp2)]
    # the step whose clip acts is over grad_norm_skip_threshold instead: Megatron's chained step skips it
    threshold = replace(computed, grad_norm_skip_threshold=30.0)
    four += [("threshold_early", "ep2_tp2", replace(threshold, early_compute=True, early_gather_at_dispatch=True)),
             ("threshold_in_step", "ep2_tp2", threshold),
             ("threshold_swapped", "ep2_tp2", replace(threshold, nan_grad_at_step=STEPS - 1, big_grad_at_step=1))]
    four += [("saved", "ep2_dp2", ResumeJob(run=saved, save_dir=str(root), save_after=(HALF,))),
             ("resumed", "ep4", ResumeJob(run=replace(saved, ep_size=4), load_dir=str(root))),
             # expert TP 1 -> 2 (and TP 1 -> 2), and a save at expert TP 2 resumed at expert TP 1
             ("resumed", "ep2_tp2_etp2", ResumeJob(run=_run("muon", **LAYOUTS["ep2_tp2_etp2"]), load_dir=str(root)))]
    etp2 = _run("muon", **LAYOUTS["ep2_tp2_etp2"])
    four += [("saved", "ep2_tp2_etp2", ResumeJob(run=etp2, save_dir=str(root / "etp2"), save_after=(HALF,))),
             ("resumed", "ep2_tp2_etp1", ResumeJob(run=replace(etp2, expert_tp_size=1), load_dir=str(root / "etp2")))]
    one = [(opt, "single", _run(opt)) for opt in OPTIMIZERS]
    one += [("resumed", "ep1", ResumeJob(run=replace(saved, ep_size=1), load_dir=str(root))),
            # saved at TP 2 x EP 2 x expert TP 2, resumed in one process (EP 1, expert TP 1)
            ("resumed", "etp2_to_ep1", ResumeJob(run=replace(etp2, tp_size=1, ep_size=1, expert_tp_size=None),
                                                 load_dir=str(root / "etp2")))]
    out = {}
    for world_size, cases in ((4, four), (1, one)):
        per_rank = launch(moe_jobs, LaunchConfig(world_size=world_size, timeout_s=LAUNCH_TIMEOUT_S),
                          [job for _, _, job in cases])
        for i, (key, layout, _) in enumerate(cases):
            out[(key, layout)] = [rank[i] for rank in per_rank]
    return out


def _union(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The whole model: dense parameters (the same on every rank) and every rank's experts."""
    params: dict[str, torch.Tensor] = {}
    for result in per_rank:
        params.update(result["params"])
    return params


def _differences(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The largest element and the largest mean absolute difference over all tensors."""
    diffs = [(actual[name] - value).abs() for name, value in expected.items()]
    return max(float(d.max()) for d in diffs), max(float(d.mean()) for d in diffs)


def _assert_params_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], optimizer: str,
                         where: str, yardstick: tuple[float, float] = (0.0, 0.0)) -> None:
    assert sorted(actual) == sorted(expected), f"{where}: parameter names differ"
    for name, value in expected.items():
        max_atol = (MATRIX_ATOL if name.endswith(MATRIX_SUFFIXES) else ELEMENTWISE_ATOL)[optimizer]
        max_atol = max(max_atol, MAX_FACTOR * yardstick[0])
        torch.testing.assert_close(actual[name], value, rtol=0, atol=max_atol, msg=lambda m: f"{where} {name}: {m}")
        mean = float((actual[name] - value).abs().mean())
        mean_atol = max(MEAN_ATOL[optimizer], REORDER_FACTOR * yardstick[1])
        assert mean <= mean_atol, f"{where} {name}: mean absolute difference {mean:.3g} (allowed {mean_atol:.3g})"


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_moe_equals_single_process(results, optimizer: str, layout: str) -> None:
    (reference,) = results[(optimizer, "single")]
    yardstick = (0.0, 0.0)
    if optimizer in YARDSTICK:
        yardstick = _differences(results[(optimizer, "dp4")][0]["params"], reference["params"])
    per_rank = results[(optimizer, layout)]
    for result in per_rank:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=LOSS_RTOL[optimizer], atol=0)
        # The global gradient norm clipping uses: dense shards over DP, each expert's over its
        # expert-DP group, every expert counted once over the EP ranks.
        torch.testing.assert_close(result["grad_norms"], reference["grad_norms"], rtol=GRAD_NORM_RTOL[optimizer], atol=0)
    _assert_params_close(_union(per_rank), reference["params"], optimizer, f"{optimizer} {layout}", yardstick)


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_expert_matrix_is_computed_once_per_step(results, optimizer: str, layout: str) -> None:
    (reference,) = results[(optimizer, "single")]
    matrices = sorted(name for name in reference["params"] if name.endswith(MATRIX_SUFFIXES))
    assert sum(".experts.local_experts." in name for name in matrices) == 2 * 4 * 2  # layers x experts x fc1/fc2
    per_rank = results[(optimizer, layout)]
    computed = sorted(name for result in per_rank for name in result["updated"])
    assert computed == matrices
    experts_by_rank = [{n for n in result["updated"] if ".experts." in n} for result in per_rank]
    assert sum(bool(e) for e in experts_by_rank) == len(per_rank), "every rank should host some experts"


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("saved, layout", [("ep2_dp2", "ep2_tp2_etp2"), ("ep2_tp2_etp2", "ep2_tp2_etp1"),
                                           ("ep2_tp2_etp2", "etp2_to_ep1")])
def test_resume_across_expert_tensor_parallel_sizes(results, saved: str, layout: str) -> None:
    """Expert TP 1 -> 2 (saved at EP 2 x DP 2), 2 -> 1 (saved at TP 2 x EP 2 x expert TP 2), and that
    save resumed in one process (EP 1, every expert a dense parameter): the expert matrices' state
    resharded over expert TP and EP, each run continuing to the straight run."""
    straight = _union(results[("muon", saved)])
    resumed_ranks = results[("resumed", layout)]
    assert all(r["start"] == HALF for r in resumed_ranks)
    for result in resumed_ranks:
        torch.testing.assert_close(result["losses"], results[("muon", saved)][0]["losses"][HALF:],
                                   rtol=LOSS_RTOL["muon"], atol=0)
    _assert_params_close(_union(resumed_ranks), straight, "muon", f"saved at {saved}, resumed at {layout}")


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("layout", ["ep4", "ep1"])
def test_resume_across_expert_parallel_sizes(results, layout: str) -> None:
    straight = _union(results[("muon", "ep2_dp2")])
    resumed_ranks = results[("resumed", layout)]
    assert all(r["start"] == HALF for r in resumed_ranks)
    (saved_losses,) = {tuple(r["losses"]) for r in results[("saved", "ep2_dp2")]}
    torch.testing.assert_close(list(saved_losses), results[("muon", "ep2_dp2")][0]["losses"], rtol=0, atol=0)
    for result in resumed_ranks:
        torch.testing.assert_close(result["losses"], results[("muon", "ep2_dp2")][0]["losses"][HALF:],
                                   rtol=LOSS_RTOL["muon"], atol=0)
    _assert_params_close(_union(resumed_ranks), straight, "muon", f"resumed at {layout}")



@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_finished_run_leaves_nothing_running_for_the_next(results) -> None:
    """24 runs on each of 4 ranks, one after another: every run's model, optimizer and process groups
    go with it (``tiny_gpt.model_parallel``), so the ranks' thread count after the last run is the
    first run's (it grew by about 60 gloo threads a run when the models outlived their runs)."""
    first = results[("muon", "ep2_dp2")]
    last = results[("resumed", "ep2_tp2_etp1")]
    for before, after in zip(first, last):
        assert after["threads"] <= before["threads"] + 8, (before["threads"], after["threads"])


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expert_buffers_take_the_whole_layout(results, layout: str) -> None:
    """Over expert DP, as the dense buffers over DP: every expert matrix whole in its owner's
    shard, shards cut at parameter boundaries (so the expert step moves nothing over expert DP)."""
    from megatron.canzona.planning import CanzonaPlan

    plan = CanzonaPlan.from_json(results[("muon", layout)][0]["plan"])
    assert plan.layout == "whole" and plan.experts is not None and plan.experts.layout == "whole"
    for buffer in (dp.matrix for dp in plan.experts.layouts):
        assert buffer.placements and all(p.host is not None for p in buffer.placements)
        for p in buffer.placements:
            bounds = buffer.buckets[p.bucket].shard_bounds
            assert bounds[p.host] <= p.start and p.end <= bounds[p.host + 1], p.name


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_gathers_issued_as_buckets_reduce_with_experts_are_bitwise_the_steps_own(results) -> None:
    """Chained with the expert optimizer, the dense one's early gathers take the joint clip
    factor (Megatron clips both by one norm) and are dropped on the skipped NaN step:
    parameters and both optimizers' state equal the run gathering in the step, bit for bit."""
    from .test_canzona_whole import _assert_bitwise_with_skip_and_clip

    for on, off in zip(results[("early_on", "ep2_tp2")], results[("early_off", "ep2_tp2")]):
        assert on["early_gathers"] > 0 and off["early_gathers"] is None
        assert any(k.startswith("1/") for k in on["state"]), "the expert optimizer's state is compared too"
        _assert_bitwise_with_skip_and_clip(on, off, skipped=(1,), clip=1.0)


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("layout", ["ep2_tp2", "ep2_tp2_etp2"])
def test_early_compute_with_experts_is_bitwise_the_steps_own(results, layout: str) -> None:
    """Both optimizers' matrices computed where their early gathers land (in backward), then
    committed (steps 0 and 2), dropped (the NaN step 1) and computed again (step 3, whose clip
    acts because rank 0's gradients were made 100 times larger): bitwise the run computing
    them in the step, the expert optimizer's state included; at expert TP 2 too, where the
    experts' pieces are gathered over expert TP as their buckets reduce."""
    from .test_early_compute import _same

    for early, step in zip(results[("compute_early", layout)], results[("compute_in_step", layout)]):
        # the dense optimizer's and the expert optimizer's, decided together
        assert early["early_steps"] == 2 * [{"committed": 2, "skipped": 1, "recomputed": 1}], early["early_steps"]
        assert step["grad_norms"][STEPS - 1] > 3.0 > max(step["grad_norms"][0], step["grad_norms"][2])
        assert _same(early["losses"], step["losses"]) and _same(early["grad_norms"], step["grad_norms"])
        for name, expected in step["params"].items():
            assert torch.equal(early["params"][name], expected), name
        assert any(k.startswith("1/") for k in step["state"]), "the expert optimizer's state is compared too"
        for path, expected in step["state"].items():
            assert torch.equal(early["state"][path], expected), path


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_chained_step_over_the_skip_threshold_changes_nothing_and_drops_what_was_computed_early(results) -> None:
    """Megatron's chained step skips a step whose joint norm is over ``grad_norm_skip_threshold``
    before either optimizer steps: both drop what they computed early (counted as skipped), and the
    run is bitwise the one computing in the step, and the one skipping the same two steps for the
    other reasons (inf/NaN at the last, the threshold at step 1)."""
    from .test_early_compute import _bitwise, _same

    for early, step, swapped in zip(*(results[(k, "ep2_tp2")] for k in ("threshold_early", "threshold_in_step",
                                                                            "threshold_swapped"))):
        assert early["skipped_steps"] == step["skipped_steps"] == swapped["skipped_steps"] == [1, STEPS - 1]
        assert early["early_steps"] == 2 * [{"committed": 2, "skipped": 2}], early["early_steps"]
        assert step["grad_norms"][STEPS - 1] > 30.0
        _bitwise(early, step, "threshold")
        assert _same(early["losses"], swapped["losses"])
        for name, expected in swapped["params"].items():
            assert torch.equal(early["params"][name], expected), name
        for path, expected in swapped["state"].items():
            assert torch.equal(early["state"][path], expected), path
