"""Canzona data parallelism on Megatron-Core equals single-device math.

The tiny GPT (``tiny_gpt.py``) trains a few steps with the Canzona optimizer (Muon,
Shampoo, SOAP) on the same global batches at DP 1, 2 and 4; every DP size must end with the
parameters of the DP 1 run. Each DP rank owns each matrix whole, so the only difference
between the runs is the order in which gradient shards are summed by the reduce-scatter.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron.canzona.planning import CanzonaPlan
from megatron.canzona.runtime import LaunchConfig, launch

from canzona_patches.harness.tiny_gpt import TinyRun, planned_tasks, train_tiny_gpts
from . import CPU_RANKS

pytestmark = CPU_RANKS

LR = 2e-3
STEPS = 4
# The runs differ only in the order the reduce-scatter sums gradient shards (fp32, relative
# ~1e-7). Every optimizer here normalises its update, so an element moves by about lr per
# step; a lost, doubled or misrouted matrix update moves elements by ~lr.
# Muon and Shampoo (relative eps 1e-4): measured worst difference 1.4e-7 after 4 steps;
# 1e-3 * lr = 2e-6 leaves >10x headroom.
# SOAP runs Adam in the eigenbasis of G Gᵀ and Gᵀ G, so rounding is amplified wherever the
# basis is ill-determined: at step 1 the rotated gradient is diagonal and Adam turns its
# off-diagonal rounding noise into sign(noise) unless eps dominates it, and inside a
# degenerate eigenspace (rank-deficient statistics, e.g. the short side of a non-square
# gradient from few tokens) the basis is picked by rounding and Adam is not rotation
# invariant. The SOAP case therefore uses eps 1e-4, keeps QKV fused and rotates only sides
# <= 64 (all full rank here). Measured worst difference then: 1.2e-4 (an embedding row whose
# AdamW step is sign-like); 0.1 * lr still flags any lost or doubled update.
PARAM_ATOL = {"muon": 1e-3 * LR, "shampoo": 1e-3 * LR, "soap": 0.1 * LR}
LAUNCH_TIMEOUT_S = 240.0
TEST_TIMEOUT_S = 3 * LAUNCH_TIMEOUT_S
OPTIMIZERS = ("muon", "shampoo", "soap")
BASELINES = ("megatron_muon", "sync_muon")
"""Run at DP 2 beside Canzona's Muon: Megatron-Core's layer-wise Muon, and synchronous
compute (gradients all-reduced, every rank updating every matrix)."""


SPLITS = {  # exercise both fused layouts: Q/K/V and gate/up
    "muon": dict(split_qkv=True, split_gate_up=False),
    "shampoo": dict(split_qkv=True, split_gate_up=True),
    "soap": dict(split_qkv=False, split_gate_up=False),
}


INSTANCE_OPTIMIZERS = ("muon", "soap")
"""Trained at DP 4 as 2 distributed-optimizer instances too (``--num-distributed-optimizer-instances 2``)."""
BUCKET = 10_000
"""Elements per DDP bucket (with overlapped gradient reduction, which Megatron needs to honour
it): six buckets, fc1 (16384 elements) larger than one, so the whole layout's shards are of
unequal sizes and some are empty (checked below)."""


def _run(optimizer: str) -> TinyRun:
    if optimizer in BASELINES:  # the math of Canzona's muon run, computed another way
        return TinyRun(lr=LR, num_steps=STEPS, optimizer=optimizer, weight_decay=0.1, **SPLITS["muon"])
    return TinyRun(lr=LR, num_steps=STEPS, layout="canzona", optimizer=optimizer, weight_decay=0.1,
                   bucket_size=BUCKET, overlap_grad_reduce=True, canzona_layout="whole", **SPLITS[optimizer])


def _launch(world_size: int, runs: list[TinyRun]) -> list[list[dict]]:
    per_rank = launch(train_tiny_gpts, LaunchConfig(world_size=world_size, timeout_s=LAUNCH_TIMEOUT_S), runs)
    return [[rank[i] for rank in per_rank] for i in range(len(runs))]


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, int], list[dict]]:
    """(optimizer, dp_size) -> per-rank results; one launch per DP size."""
    out = {}
    for dp in (1, 2, 4):
        names = OPTIMIZERS + (BASELINES if dp == 2 else ())
        runs = [_run(opt) for opt in names]
        if dp == 2:  # the same Muon run with a NaN gradient at its last step, and one step shorter
            names += ("muon_nan_last", "muon_short")
            runs += [replace(_run("muon"), nan_grad_at_step=STEPS - 1), replace(_run("muon"), num_steps=STEPS - 1)]
        if dp == 4:  # DP 4 as 2 distributed-optimizer instances of DP 2
            names += tuple(f"{opt}_instances" for opt in INSTANCE_OPTIMIZERS)
            runs += [replace(_run(opt), instances=2) for opt in INSTANCE_OPTIMIZERS]
        for opt, per_rank in zip(names, _launch(dp, runs)):
            out[(opt, dp)] = per_rank
    return out


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dp", [2, 4])
def test_dp_equals_single_process(results, optimizer: str, dp: int) -> None:
    (reference,) = results[(optimizer, 1)]
    share = {"loss": max(abs(a - b) / abs(b) / 1e-4 for result in results[(optimizer, dp)]
                         for a, b in zip(result["losses"], reference["losses"])),
             "max": max(float((result["params"][name] - expected).abs().max()) / PARAM_ATOL[optimizer]
                        for result in results[(optimizer, dp)] for name, expected in reference["params"].items())}
    print(f"\n[share] dp {optimizer} dp {dp}: {share}", flush=True)  # the largest share of each bound (`pytest -s`)
    for rank, result in enumerate(results[(optimizer, dp)]):
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-4)
        for name, expected in reference["params"].items():
            torch.testing.assert_close(
                result["params"][name], expected, rtol=0, atol=PARAM_ATOL[optimizer],
                msg=lambda m: f"{optimizer} dp{dp} rank {rank} {name}: {m}",
            )


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("optimizer", INSTANCE_OPTIMIZERS)
def test_two_optimizer_instances_train_as_one_process(results, optimizer: str) -> None:
    """DP 4 as 2 instances of DP 2: each instance's reduce-scatter over its 2 ranks, Megatron's
    all-reduce of the shards across the instances, each instance's plan and step over its ranks;
    the DP 1 run's losses and parameters within the DP bounds, and every matrix updated once per
    instance."""
    (reference,) = results[(optimizer, 1)]
    per_rank = results[(f"{optimizer}_instances", 4)]
    plan = CanzonaPlan.from_json(per_rank[0]["plan"])
    assert plan.dp_size == 2
    for rank, result in enumerate(per_rank):
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-4)
        for name, expected in reference["params"].items():
            torch.testing.assert_close(result["params"][name], expected, rtol=0, atol=PARAM_ATOL[optimizer],
                                       msg=lambda m: f"{optimizer} 2 instances rank {rank} {name}: {m}")
    for instance in (per_rank[:2], per_rank[2:]):
        assert sorted(n for result in instance for n in result["updated"]) == sorted(planned_tasks(plan))


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_every_matrix_is_updated_exactly_once(results, optimizer: str, dp: int) -> None:
    per_rank = results[(optimizer, dp)]
    updated = [name for result in per_rank for name in result["updated"]]
    matrices = [n for n in per_rank[0]["params"] if n.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight"))]
    plan = CanzonaPlan.from_json(per_rank[0]["plan"])
    tasks = planned_tasks(plan)
    assert sorted({n.split("#")[0] for n in tasks}) == sorted(matrices)
    assert sorted(updated) == sorted(tasks)  # gate and up hosted apart with --canzona-split-gate-up
    # Whole in one shard where the plan says so: a plan that would pad more than 5% to keep
    # every matrix whole splits some across shards instead (their hosts gather them).
    split = [p.name for layout in plan.layouts for p in layout.matrix.placements if p.host is None]
    assert all(result["whole_params_owned"] for result in per_rank) == (not split), split
    if dp > 1:
        assert sum(bool(result["updated"]) for result in per_rank) > 1, "work should be spread over ranks"
        # The whole layout: nothing split, shards of unequal sizes, some empty (uneven collectives ran).
        assert plan.layout == "whole" and not split
        sizes = [b - a for layout in plan.layouts for bucket in layout.matrix.buckets
                 for a, b in zip(bucket.shard_bounds, bucket.shard_bounds[1:])]
        assert len(set(sizes)) > 2 and 0 in sizes, sizes


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("baseline", BASELINES)
def test_muon_equals_the_baselines(results, baseline: str) -> None:
    """``megatron_muon``: Megatron-Core's LayerWiseDistributedOptimizer Muon configured to the
    same math (tiny_gpt.MEGATRON_MUON: fp32 Newton-Schulz, the fixed quintic Megatron calls
    "simple", spectral scale, split QKV; Adam for the rest). ``sync_muon``: every rank
    updates every matrix. Both train to Canzona's parameters at DP 2; measured worst
    difference after 4 steps: 2.4e-7 (Megatron) and 0 (synchronous)."""
    for rank, (ours, theirs) in enumerate(zip(results[("muon", 2)], results[(baseline, 2)])):
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5)
        for name, expected in theirs["params"].items():
            torch.testing.assert_close(
                ours["params"][name], expected, rtol=0, atol=PARAM_ATOL["muon"],
                msg=lambda m: f"{baseline} rank {rank} {name}: {m}",
            )


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_grad_norm_does_not_depend_on_dp(results, optimizer: str) -> None:
    """Global-norm clipping sees every gradient element once whatever the layout."""
    (reference,) = results[(optimizer, 1)]
    for dp in (2, 4):
        for result in results[(optimizer, dp)]:
            assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_nan_gradient_on_one_rank_skips_the_step_everywhere(results) -> None:
    """Without a loss scaler, CanzonaDistributedOptimizer checks gradients itself: a NaN on
    rank 0 only makes every rank skip the step, leaving parameters and state untouched."""
    for nan_run, short_run in zip(results[("muon_nan_last", 2)], results[("muon_short", 2)]):
        assert nan_run["skipped_steps"] == [STEPS - 1] and short_run["skipped_steps"] == []
        for name, expected in short_run["params"].items():
            assert torch.equal(nan_run["params"][name], expected), name
