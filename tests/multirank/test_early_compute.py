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
