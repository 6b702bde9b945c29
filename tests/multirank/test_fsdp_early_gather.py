"""Under Megatron-FSDP the host-group gathers go in backward, and are bitwise the step's own.

Each micro-group's gather is issued once every bucket group holding one of its matrices has
reduce-scattered for the last micro-batch (``canzona_patches.integration.fsdp_gathers.attach_fsdp``):
on gloo, where Megatron-FSDP's reduce-scatters are synchronous, from inside backward, so every
gather of every step here is issued before Megatron's loop that ends backward.

* Shampoo and SOAP keep their state on the hosts: the gathers carry the raw gradients, which the
  hosts scale as the holders would (the clip acting here at every step).
* Muon and NorMuon keep their momentum on the holders: the gathers carry the Newton-Schulz input,
  made from a copy of the momentum, speculating that no clip acts; where one acts, the step gathers
  again.

Against the same run gathering in the step (``--canzona-no-early-gather``), in the planner's
micro-groups and (:data:`ONE_GROUP`) in one (``--canzona-fsdp-micro-groups one``), over 4 steps at DP 2
(``optim_grads_params``, ``optim``; two micro-batches a step, so ``optim_grads_params``
reduce-scatters twice a step and only the second is gathered), TP 2 x DP 2 (``optim_grads``) and
EP 2 x DP 2 (a dense and an expert optimizer, the experts reduced over expert-DP 2):
losses, gradient norms, parameters and optimizer state agree bit for bit, with the clip idle and
acting, with early compute (``--canzona-early-compute on``) committed and recomputed, and under
the speculation policy (``backoff``) while the clip acts at every step (the gathers then mostly
wait for the step). ``muon_narrow`` is Muon iterating in bf16 with ``--canzona-narrow-gathers`` (the
holders send each whole matrix's source divided by its norm, in bf16): early, computed early and in
the step, bitwise the same too (at DP 2; the replay test holds TP 2 x DP 2's narrow gathers), its
sources made and its norms taken as each bucket group reduces, none left for the gathers.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from megatron.canzona.runtime import LaunchConfig, launch

from canzona_patches.harness.tiny_gpt import TinyRun, train_tiny_gpt
from . import CPU_RANKS

pytestmark = CPU_RANKS

STEPS = 4
ACTING, IDLE = 1.0e-3, 1.0e9
"""Clips that act at every step of the tiny model, and never."""
LAUNCH_TIMEOUT_S = 300.0
LAYOUTS = {
    # name: (world size, TinyRun fields, optimizers)
    "dp2-optim_grads_params": (2, dict(fsdp="optim_grads_params"), ("muon", "normuon", "shampoo", "soap", "muon_narrow")),
    "dp2-optim": (2, dict(fsdp="optim"), ("muon", "soap")),
    "tp2_dp2-optim_grads": (4, dict(fsdp="optim_grads", tp_size=2), ("muon", "soap")),
    "ep2_dp2-optim_grads_params": (4, dict(fsdp="optim_grads_params", num_experts=4, ep_size=2), ("muon",)),
}
"""The layouts: at EP 2 a dense and an expert optimizer, the experts' buckets reduced over expert-DP 2."""
SPECULATIVE = ("muon", "normuon", "muon_narrow")
"""The optimizers whose holders keep the momentum (NorMuon's second moment is its hosts'): their
gathers carry its source, speculating."""
ONE_GROUP = {("muon", "dp2-optim_grads_params"), ("soap", "dp2-optim_grads_params"), ("muon", "tp2_dp2-optim_grads"),
             ("muon", "ep2_dp2-optim_grads_params")}
"""Where every matrix also goes in one micro-group (``--canzona-fsdp-micro-groups one``): a source
gathered speculatively and raw gradients, at DP 2, TP 2 x DP 2 and with the experts' optimizer (the
engine's one all-to-all is the same code for every optimizer)."""


NARROW = dict(optimizer="muon", muon_ns_dtype="bfloat16", narrow_gathers=True, split_qkv=False)
"""``muon_narrow``: QKV one matrix (``--canzona-no-split-qkv``), so that it goes narrow: at DP 2 it is
the matrix of each layer cut between the two shards (fc1, fc2 and the projection lie whole in one)."""


def _base(optimizer: str, layout: str, clip: float) -> TinyRun:
    run = TinyRun(lr=2e-3, num_steps=STEPS, layout="canzona", optimizer=optimizer, weight_decay=0.1, global_batch=8,
                  overlap_grad_reduce=True, clip_grad=clip, early_gather=False, split_gate_up=optimizer == "muon",
                  return_state=True, **LAYOUTS[layout][1])
    return replace(run, **NARROW) if optimizer == "muon_narrow" else run


def _variants(optimizer: str, layout: str) -> dict[str, TinyRun]:
    """Name -> run; ``<clip>-step`` gathers in the step, the others are compared with it."""
    runs = {}
    for clip, label in ((IDLE, "idle"), (ACTING, "acting")):
        base = _base(optimizer, layout, clip)
        runs[f"{label}-step"] = base
        if optimizer == "muon_narrow":  # early compute gathers early too
            runs[f"{label}-compute"] = replace(base, early_gather=True, early_compute=True)
            continue
        runs[f"{label}-early"] = replace(base, early_gather=True)
        if optimizer in SPECULATIVE:
            runs[f"{label}-compute"] = replace(base, early_gather=True, early_compute=True)
        if (optimizer, layout) in ONE_GROUP:  # every matrix in one micro-group: one gather a step
            runs[f"{label}-one"] = replace(base, early_gather=True, fsdp_micro_groups="one",
                                           early_compute=optimizer in SPECULATIVE)
    if optimizer in SPECULATIVE and optimizer != "muon_narrow":
        runs["acting-backoff"] = replace(runs["acting-early"], speculation="backoff")
    return runs


CASES = [(optimizer, layout) for layout, (_, _, optimizers) in LAYOUTS.items() for optimizer in optimizers]


def _train(runs: list[TinyRun]) -> list[dict]:
    """Rank body: the runs in turn, each result with the threads alive after it (a run whose model
    outlived it kept its process groups' gloo threads)."""
    return [{**train_tiny_gpt(run), "threads": len(os.listdir("/proc/self/task"))} for run in runs]


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str, str], list[dict]]:
    """(optimizer, layout, variant) -> per-rank results; one launch per world size."""
    out = {}
    for world_size in sorted({world for world, _, _ in LAYOUTS.values()}):
        names, runs = [], []
        for optimizer, layout in CASES:
            if LAYOUTS[layout][0] == world_size:
                for variant, run in _variants(optimizer, layout).items():
                    names.append((optimizer, layout, variant))
                    runs.append(run)
        per_rank = launch(_train, LaunchConfig(world_size=world_size, timeout_s=LAUNCH_TIMEOUT_S), runs)
        out.update({name: [rank[i] for rank in per_rank] for i, name in enumerate(names)})
    return out


def _bitwise(a: dict, b: dict, where: str) -> None:
    assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"], where
    for name, expected in b["params"].items():
        assert torch.equal(a["params"][name], expected), (where, name)
    assert a["state"].keys() == b["state"].keys(), where
    for path, expected in b["state"].items():
        assert torch.equal(a["state"][path], expected), (where, path)


@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize(("optimizer", "fsdp"), CASES)
def test_gathers_in_backward_are_bitwise_the_steps(results, optimizer: str, fsdp: str) -> None:
    variants = _variants(optimizer, fsdp)
    for variant in variants:
        if variant.endswith("-step"):
            continue
        baseline = results[(optimizer, fsdp, variant.split("-")[0] + "-step")]
        for rank, (early, step) in enumerate(zip(results[(optimizer, fsdp, variant)], baseline)):
            where = f"{optimizer} {fsdp} {variant} rank {rank}"
            _bitwise(early, step, where)
            assert not step["early_gathers"], where
            issued, in_backward = early["early_gathers"], early["early_gathers_in_backward"]
            if variant == "acting-backoff":  # the policy speculates less after each miss
                always = results[(optimizer, fsdp, "acting-early")][rank]["early_gathers"]
                assert 0 < issued < always, (where, issued, always)
                continue
            # every micro-group of every step, each once: issued from the reduce-scatters, in backward
            assert issued > 0 and issued % STEPS == 0 and in_backward == issued, (where, issued, in_backward)
            if variant.endswith("one"):  # one gather a step per optimizer (the dense, the experts')
                budget = results[(optimizer, fsdp, variant.split("-")[0] + "-early")][rank]["early_gathers"]
                assert issued // STEPS <= 2 and issued <= budget, (where, issued, budget)
            if optimizer in SPECULATIVE:  # the sources of every piece, made in backward: the dry run's prediction
                momentum = sum(v.numel() for path, v in early["state"].items() if path.endswith("/momentum"))
                assert momentum > 0 and early["early_sources_made"] == momentum, (where, early["early_sources_made"])
            if optimizer == "muon_narrow":  # the norms were taken as each bucket group reduced
                assert sorted(early["planned_narrow"]["gathers"]) == [f"decoder.layers.{i}.self_attention.linear_qkv.weight"
                                                                    for i in range(2)], where
                ahead, at_gather = early["norms_ahead"], early["norms_at_gather"]
                assert ahead > 0 and ahead % STEPS == 0, (where, ahead)
                # none left for the gathers in backward; the step's own gathers (a clip acted) take theirs
                assert at_gather == (0 if variant.startswith("idle") else ahead), (where, ahead, at_gather)
            if variant.endswith("compute"):
                outcome = "committed" if variant.startswith("idle") else "recomputed"
                # one record per optimizer (the dense, and at EP 2 the experts')
                assert early["early_steps"] and all(part == {outcome: STEPS} for part in early["early_steps"]), \
                    (where, early["early_steps"])
    assert max(results[(optimizer, fsdp, "idle-step")][0]["grad_norms"]) < IDLE
    assert min(results[(optimizer, fsdp, "acting-step")][0]["grad_norms"]) > ACTING


@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
def test_a_finished_run_leaves_nothing_running_for_the_next(results) -> None:
    """The runs of a launch follow one another on the same ranks: the early gathers' tables hold
    their listeners and Megatron-FSDP's objects weakly, so each run's model, optimizer and process
    groups go with it, and the ranks' thread count after a layout's last run is its second run's."""
    for layout in LAYOUTS:
        names = [name for name in results if name[1] == layout]  # in run order
        # from its second run: a layout's first run on a launch leaves its process groups' pools (about 12 threads)
        first, last = results[names[1]], results[names[-1]]
        for before, after in zip(first, last):
            assert after["threads"] <= before["threads"] + 8, (layout, before["threads"], after["threads"])

