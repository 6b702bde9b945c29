"""Early compute (``--canzona-early-compute``) is bitwise the step's own compute.

Each micro-group's matrix updates are computed where its early gather lands, on staging
copies of the optimizer state; the step commits them when the clip did not act, computes them
again when it did, and drops them on inf/NaN. Against the same run computing in the step (the
early gathers on in both), over 6 steps of Muon, Shampoo and SOAP at DP 2, TP 2 x DP 2 and
DP 3 x TP 2, parameters, optimizer state and losses must agree bit for bit through:

* steps whose updates are committed (0, 1, 3, 5), Shampoo's and SOAP's preconditioner
  refreshes among them (every 2 steps here);
* a NaN step (2), skipped;
* a step (4) whose clip acts only because rank 0's gradients were made 100 times larger:
  every other rank computed its matrices from gradients that alone would not be clipped,
  and must compute them again.

The early compute runs as CUDA runs it, from the reduce-scatters' dispatch inside backward
(on gloo each waits for its reduce-scatter there, so the host computes inside backward), and
once (Muon, TP 2 x DP 2) when the buckets finish reducing, gloo's default moment; and once
(Muon, TP 2 x DP 2) with a memory budget that holds one of the three micro-groups: the first
to become ready is computed early, the others in the step; and once (Muon, TP 2 x DP 2) with the
dense buckets without a matrix reduced after the matrices' (``--canzona-matrices-reduce-first``);
and once (Muon, TP 2 x DP 2) with Newton-Schulz in bf16, where the directions of whole matrices
that move are kept in bf16 until the step scatters them.

At DP 2 a step over ``grad_norm_skip_threshold`` (Megatron-Core's chained optimizers' rule, here
for every Canzona optimizer) is skipped and drops what was computed early, with early compute
on, off and ``auto``, and changes nothing: a run skipping step 2 for inf/NaN and step 4 for the
threshold ends bitwise where one skipping step 2 for the threshold and step 4 for inf/NaN does.

The speculation policy (the default, ``backoff``) over 50 iterations at DP 2: with the clip acting
in every iteration at most 15% of the steps recompute; with it never acting every step commits;
bitwise the run computing in the step either way.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron.canzona.runtime import LaunchConfig, launch

from .test_canzona_tp import SPLITS
from canzona_patches.harness.tiny_gpt import TinyRun, train_tiny_gpts
from . import CPU_RANKS

pytestmark = CPU_RANKS

STEPS = 6
CLIP = 3.0
"""Above the tiny model's gradient norms (about 1.35), below the norm of the step whose
gradients rank 0 makes 100 times larger."""
NAN_STEP, BIG_STEP = 2, 4
OUTCOMES = {"committed": 4, "recomputed": 1, "skipped": 1}
THRESHOLD = 30.0
"""Above every norm of the tiny model's steps (about 1.35 before the clip) but the one whose
gradients rank 0 makes 100 times larger."""
POLICY_STEPS = 50
ACTING, IDLE = 1.0e-3, 1.0e9
"""Clips that act in every iteration of the tiny model, and never."""
OPTIMIZERS = ("muon", "shampoo", "soap")
SHAPES = {2: (1, "dp2"), 4: (2, "tp2_dp2"), 6: (2, "dp3_tp2")}
BUDGET = 40_000
"""Bytes: one micro-group's directions on a rank of the tiny model at TP 2 x DP 2 (Muon keeps no
staging copy of its state: its momentum advances at the commit)."""
"""World size -> (TP size, case)."""
LAUNCH_TIMEOUT_S = 300.0
TEST_TIMEOUT_S = 4 * LAUNCH_TIMEOUT_S


def _run(optimizer: str, tp_size: int, world_size: int, **overrides) -> TinyRun:
    split_qkv, split_gate_up = SPLITS[optimizer]["split"]
    fields = dict(
        tp_size=tp_size, lr=2e-3, num_steps=STEPS, layout="canzona", optimizer=optimizer, weight_decay=0.1,
        global_batch=12 if world_size % 3 == 0 else 8, bucket_size=10_000, overlap_grad_reduce=True,
        canzona_layout="whole", split_qkv=split_qkv, split_gate_up=split_gate_up, clip_grad=CLIP,
        nan_grad_at_step=NAN_STEP, big_grad_at_step=BIG_STEP, return_state=True,
    )
    return TinyRun(**{**fields, **overrides})


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str, str], list[dict]]:
    """(optimizer, case, "early" | "finish" | "step") -> per-rank results; one launch per world size."""
    out = {}
    for world_size, (tp_size, case) in SHAPES.items():
        runs, names = [], []
        for optimizer in OPTIMIZERS:
            base = _run(optimizer, tp_size, world_size)
            runs += [replace(base, early_compute=True, early_gather_at_dispatch=True), base]
            names += [(optimizer, case, "early"), (optimizer, case, "step")]
        if case == "tp2_dp2":
            runs.append(replace(_run("muon", tp_size, world_size), early_compute=True))
            runs.append(replace(runs[0], early_compute_bytes=BUDGET))
            # buckets small enough that the output layer (4096 elements a TP rank; the tiny GPT does not
            # tie it to the embedding) is one alone, ready first in backward: held behind the matrices'
            runs += [replace(runs[0], matrices_first=True, bucket_size=4_000), replace(runs[1], bucket_size=4_000)]
            # Newton-Schulz in bf16: the directions of whole matrices that move are kept in bf16 to the step
            runs += [replace(runs[0], muon_ns_dtype="bfloat16"), replace(runs[1], muon_ns_dtype="bfloat16")]
            names += [("muon", case, "finish"), ("muon", case, "budget"), ("muon", case, "first"),
                      ("muon", case, "first_step"), ("muon", case, "bf16"), ("muon", case, "bf16_step")]
        if case == "dp2":
            threshold = replace(_run("muon", tp_size, world_size), grad_norm_skip_threshold=THRESHOLD)
            swapped = replace(threshold, nan_grad_at_step=BIG_STEP, big_grad_at_step=NAN_STEP)
            for mode in (True, False, "auto"):
                runs += [replace(threshold, early_compute=mode, early_gather_at_dispatch=True)]
                names += [("threshold", mode)]
            runs.append(swapped)
            names.append(("threshold", "swapped"))
            for clip in (ACTING, IDLE):
                policy = replace(_run("muon", tp_size, world_size), num_steps=POLICY_STEPS, clip_grad=clip,
                                 nan_grad_at_step=None, big_grad_at_step=None, speculation="backoff")
                runs += [replace(policy, early_compute=True, early_gather_at_dispatch=True), policy]
                names += [("policy", clip, "early"), ("policy", clip, "step")]
        per_rank = launch(train_tiny_gpts, LaunchConfig(world_size=world_size, timeout_s=LAUNCH_TIMEOUT_S), runs)
        for i, name in enumerate(names):
            out[name] = [rank[i] for rank in per_rank]
    return out


CASES = [(o, case) for _, case in SHAPES.values() for o in OPTIMIZERS]


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize(("optimizer", "case"), CASES)
def test_early_compute_is_bitwise_the_steps_own(results, optimizer: str, case: str) -> None:
    variants = ["early"]
    if (optimizer, case, "finish") in results:
        variants += ["finish", "budget", "first", "bf16"]
    for variant in variants:
        baseline = results[(optimizer, case, {"first": "first_step", "bf16": "bf16_step"}.get(variant, "step"))]
        for rank, (early, step) in enumerate(zip(results[(optimizer, case, variant)], baseline)):
            where = f"{optimizer} {case} {variant} rank {rank}"
            assert early["early_computed"] > 0 and not step["early_computed"], where
            # gathered in backward from the reduce-scatters' dispatch, computed once backward is over;
            # at finish (gloo's default) every gather is issued after it
            after = early["early_computed_after_backward"]
            assert (after > 0) if variant != "finish" else (after == 0), (where, after)
            if variant == "budget":  # one micro-group a step of the three, the others computed in the step
                assert early["early_computed"] == STEPS < results[(optimizer, case, "early")][rank]["early_computed"]
            # the output layer's and the norms' reduce-scatters held behind the matrices' in every
            # iteration after the first (the first dispatches all in Megatron's loop after backward)
            if variant == "first":
                assert early["reduces_held"] >= STEPS - 1, (where, early["reduces_held"])
            else:
                assert early["reduces_held"] is None, (where, early["reduces_held"])
            assert early["early_steps"] == [OUTCOMES] and step["early_steps"] == [{}], (where, early["early_steps"])
            assert early["skipped_steps"] == step["skipped_steps"] == [NAN_STEP], where
            norms = step["grad_norms"]
            assert norms[BIG_STEP] > CLIP and all(n < CLIP for i, n in enumerate(norms) if i not in (NAN_STEP, BIG_STEP))
            assert _same(early["losses"], step["losses"]) and _same(early["grad_norms"], norms), where
            for name, expected in step["params"].items():
                assert torch.equal(early["params"][name], expected), (where, name)
            assert early["state"].keys() == step["state"].keys(), where
            for path, expected in step["state"].items():
                assert torch.equal(early["state"][path], expected), (where, path)


def _same(a: list[float], b: list[float]) -> bool:
    """Equal lists of floats, NaN equal to NaN."""
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))


def _check_choices() -> tuple[str | None, str | None]:
    """check_same_choices over the world: the same values on both ranks, then a reduce order of
    the rank's own; the error's text of each, if any."""
    import torch.distributed as dist

    from canzona_patches.integration.setup import check_same_choices

    out = []
    for first in (1, dist.get_rank()):
        try:
            check_same_choices({"--canzona-layout auto": 0, "--canzona-matrices-reduce-first": first},
                               group=dist.group.WORLD)
            out.append(None)
        except RuntimeError as error:
            out.append(str(error))
    return out[0], out[1]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S)
def test_ranks_that_projected_different_choices_stop_in_one_line() -> None:
    """Each rank projects the layout and the reduce order for itself; should two disagree (nodes
    of different sizes), every rank stops with a line naming the flag rather than ordering its
    collectives differently."""
    results = launch(_check_choices, LaunchConfig(world_size=2, timeout_s=LAUNCH_TIMEOUT_S))
    for same, differ in results:
        assert same is None and differ is not None, results
        assert "--canzona-matrices-reduce-first" in differ and "layout" not in differ, differ


def _bitwise(a: dict, b: dict, where: str) -> None:
    """Losses, norms, parameters and optimizer state the same bit for bit."""
    assert _same(a["losses"], b["losses"]) and _same(a["grad_norms"], b["grad_norms"]), where
    for name, expected in b["params"].items():
        assert torch.equal(a["params"][name], expected), (where, name)
    assert a["state"].keys() == b["state"].keys(), where
    for path, expected in b["state"].items():
        assert torch.equal(a["state"][path], expected), (where, path)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_step_over_the_skip_threshold_changes_nothing_and_drops_what_was_computed_early(results) -> None:
    for rank, (on, off, auto, swapped) in enumerate(zip(*(results[("threshold", m)] for m in (True, False, "auto",
                                                                                             "swapped")))):
        where = f"rank {rank}"
        assert on["skipped_steps"] == off["skipped_steps"] == [NAN_STEP, BIG_STEP], where
        assert on["grad_norms"][BIG_STEP] > THRESHOLD > max(n for i, n in enumerate(on["grad_norms"]) if i != BIG_STEP
                                                            and n == n)
        assert on["early_steps"] == [{"committed": 4, "skipped": 2}], (where, on["early_steps"])
        assert off["early_steps"] == auto["early_steps"] == [{}], where  # auto: gloo computes in the step
        _bitwise(on, off, where)
        _bitwise(auto, off, where)
        # skipped for inf/NaN at 2 and the threshold at 4, or the other way round: the same run
        assert swapped["skipped_steps"] == [NAN_STEP, BIG_STEP], where
        assert _same(on["losses"], swapped["losses"]), where
        for name, expected in swapped["params"].items():
            assert torch.equal(on["params"][name], expected), (where, name)
        for path, expected in swapped["state"].items():
            assert torch.equal(on["state"][path], expected), (where, path)


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("clip", [ACTING, IDLE], ids=["clip_acting", "clip_idle"])
def test_the_speculation_policy_recomputes_little_and_commits_when_the_clip_is_idle(results, clip: float) -> None:
    for rank, (early, step) in enumerate(zip(results[("policy", clip, "early")], results[("policy", clip, "step")])):
        where = f"rank {rank}"
        norms = step["grad_norms"]
        assert all((n > clip) == (clip == ACTING) for n in norms), where
        (outcomes,) = early["early_steps"]
        assert sum(outcomes.values()) == POLICY_STEPS, (where, outcomes)
        if clip == ACTING:  # tries at 1, 4, 9, 18 and 35: 10%
            assert outcomes == {"recomputed": 5, "not speculated": POLICY_STEPS - 5}, (where, outcomes)
            assert outcomes["recomputed"] <= 0.15 * POLICY_STEPS
        else:
            assert outcomes == {"committed": POLICY_STEPS}, (where, outcomes)
        _bitwise(early, step, where)
