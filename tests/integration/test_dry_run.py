"""tools/dry_run.py: one full-size rank built on the meta device agrees with its plan.

Each run builds a real Megatron-Core GPTModel stage of Qwen3 for one rank of a 256-GPU job,
Megatron's DDP with the Canzona layout and the Canzona optimizer, under torch's fake
process-group backend, in a few seconds and without storage; the buffers, buckets, main
parameters, optimizer state by kind and step temporaries DDP and the optimizer actually
allocated must be the ones the planner predicts. One MoE rank adds the expert-parallel
buffers and the chained expert optimizer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron.canzona.planning.memory import EARLY_COMPUTE_BYTES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 240
# Peak bytes of the optimizer step (steady state + host-group buffers + the largest stacked
# compute batch) over the steady-state bytes of the rank; measured 1.10-1.25 on these cases.
PEAK_FACTOR = 1.3


def dry_run(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "tools/dry_run.py", *args] if code is None else [sys.executable, "-c", code, *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=TIMEOUT_S,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ["PYTHONPATH"]])})


EARLY_STATE = "early compute: staging copy of the matrix state"
EARLY_DIRECTIONS = "early compute: directions (alive from backward)"
STEADY = ("parameter buffers", "gradient buffers", "fp32 main parameters", EARLY_STATE)
"""What a rank holds between steps, besides the optimizer state."""

CASES = {
    # The cases: 144 matrices for 256 GPUs, and Qwen3-32B's recipe on 256 GPUs.
    "qwen3-8b tp2 dp128": ("--model", "qwen3-8b", "--tp", "2", "--dp", "128"),
    "qwen3-32b tp8 dp32": ("--model", "qwen3-32b", "--tp", "8", "--dp", "32", "--rank", "13"),
    # The 32K-token recipe on 64 GPUs: the plan and the optimizer over DP 8 x CP 4.
    "qwen3-8b tp2 dp8 cp4": ("--model", "qwen3-8b", "--tp", "2", "--dp", "8", "--cp", "4", "--rank", "13"),
    # SOAP's statistics and eigenbases; the last pipeline stage (output layer) at PP 2.
    "qwen3-8b tp2 dp8 pp2 soap": ("--model", "qwen3-8b", "--tp", "2", "--dp", "8", "--pp", "2", "--rank", "31",
                                  "--optimizer", "soap", "--grad-reduce-in-fp32"),
}


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("case", list(CASES))
def test_a_full_size_rank_is_what_the_plan_predicts(case):
    out = dry_run(*CASES[case], "--json")
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    report = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {row["quantity"]: row for row in report["rows"]}
    assert report["agree"] and all(row["ok"] for row in rows.values())
    assert report["config"]["device"] == "meta"
    assert rows["parameter buffers"]["measured"] > 0 and rows["fp32 main parameters"]["measured"] > 0
    buckets = report["buckets"]
    assert len(buckets) > 2, "buckets near the bucket size, not one for the whole model"
    state = sum(row["measured"] for name, row in rows.items() if name.startswith("optimizer state"))
    assert state > 0
    memory = report["memory"]
    steady = sum(rows[name]["bytes"] for name in STEADY)
    assert memory["steady_bytes"] == steady + 4 * state
    early = rows[EARLY_STATE]["bytes"] + rows[EARLY_DIRECTIONS]["bytes"]
    assert early <= EARLY_COMPUTE_BYTES, "early compute keeps at most its budget (2 GiB by default)"
    if "soap" not in case:  # Muon: no staging copy (its momentum advances at the commit), every group early
        assert rows[EARLY_STATE]["measured"] == 0
        # a direction per momentum element, in fp32 elements: a whole matrix that moves (TP-sharded
        # here) keeps it in bf16 (the recipes' Newton-Schulz dtype), a split QKV's parts in fp32
        directions, momentum = rows[EARLY_DIRECTIONS]["measured"], rows["optimizer state: momentum"]["measured"]
        assert momentum // 2 <= directions <= momentum
        assert directions == (momentum if case == "qwen3-32b tp8 dp32" else momentum // 2), (directions, momentum)
    assert memory["steady_bytes"] < memory["peak_bytes"] <= PEAK_FACTOR * memory["steady_bytes"]
    if "soap" in case:
        assert rows["optimizer state: eigenbases"]["measured"] > 0
        assert rows["grad dtype bytes"]["measured"] == 4
    else:
        assert rows["optimizer state: momentum"]["measured"] > 0


MOE_CASE = ("--model", "qwen3-30b-a3b", "--ep", "8", "--dp", "32", "--rank", "27", "--layout", "lean")
"""Qwen3-30B-A3B at EP 8 x expert DP 4 (32 GPUs): rank 27 is EP rank 3, expert DP rank 3,
holding 16 local experts in each of 48 layers (3.6 G expert elements). The lean layout at
expert DP 4, because in the whole layout (or the lean one at expert DP 2) every expert lies
whole in its host's shard and the expert host-group step has nothing to gather: its buffers,
which this case checks against the prediction, would all be empty. The build costs about
9 s of CPU."""


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_full_size_moe_rank_is_what_the_plan_predicts():
    out = dry_run(*MOE_CASE, "--json")
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    report = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {row["quantity"]: row for row in report["rows"]}
    assert report["agree"] and all(row["ok"] for row in rows.values())
    c = report["config"]
    assert (c["ep"], c["expert_dp"], c["ep_rank"], c["expert_dp_rank"]) == (8, 4, 3, 3)
    parts = ("parameter buffers", "gradient buffers", "matrix buffer buckets", "parameter elements in this rank's shards",
             "fp32 main parameters", "largest temporary buffer of the step", "host-group buffers alive at once",
             "largest host-compute batch (stacked grads)")
    for name in parts:
        assert rows[name]["measured"] > 0 and rows["expert " + name]["measured"] > 0, name
    # 48 layers x 16 local experts x (gate/up + down) 3 x 2048 x 768, unpadded, in the expert buffers.
    assert rows["expert parameter buffers"]["measured"] >= 48 * 16 * 3 * 2048 * 768
    assert len(report["expert_buckets"]) == rows["expert matrix buffer buckets"]["measured"] > 2
    state = sum(row["measured"] for name, row in rows.items() if name.startswith("optimizer state"))
    steady = sum(rows[prefix + name]["bytes"] for prefix in ("", "expert ") for name in STEADY)
    memory = report["memory"]
    assert memory["steady_bytes"] == steady + 4 * state
    assert memory["steady_bytes"] < memory["peak_bytes"] <= PEAK_FACTOR * memory["steady_bytes"]


ETP_CASE = ("--model", "qwen3-30b-a3b", "--tp", "2", "--ep", "8", "--dp", "16", "--etp", "2", "--rank", "5")
"""Qwen3-30B-A3B at TP 2 x EP 8 x expert TP 2 (32 GPUs, expert DP 2): each expert matrix sharded over
expert TP, hosted over expert DP x expert TP (Megatron's default expert TP, the TP size)."""


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_full_size_rank_at_expert_tp_2_is_what_the_plan_predicts():
    out = dry_run(*ETP_CASE, "--json")
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    report = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {row["quantity"]: row for row in report["rows"]}
    assert report["agree"] and all(row["ok"] for row in rows.values())
    c = report["config"]
    assert (c["ep"], c["expert_dp"]) == (8, 2)
    # the expert matrices are gathered over expert TP to their hosts: the host-group buffers hold them
    assert rows["expert host-group buffers alive at once"]["measured"] > 0
    # 48 layers x 16 local experts x (gate/up + down) 3 x 2048 x 768, halved by expert TP 2
    assert rows["expert parameter buffers"]["measured"] >= 48 * 16 * 3 * 2048 * 768 // 2


def test_the_table_names_every_quantity():
    out = dry_run("--model", "qwen3-tiny", "--dp", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    for label in ("parameter buffers", "gradient buffers", "fp32 main parameters", "optimizer state: momentum",
                  "optimizer state: adam moments", "largest temporary buffer of the step",
                  "largest host-compute batch", "peak"):
        assert label in out.stdout
    assert "every number agrees with the plan" in out.stdout


DISAGREE = """
import sys
sys.path.insert(0, "tools")
import dry_run
real = dry_run.predict
def off_by_one(*args):
    predicted = real(*args)
    predicted["state_elements"]["adam_moments"] += 1
    return predicted
dry_run.predict = off_by_one
sys.exit(dry_run.main(sys.argv[1:]))
"""


def test_a_disagreement_exits_non_zero_and_names_the_quantity():
    out = dry_run("--model", "qwen3-tiny", "--dp", "2", code=DISAGREE)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "DISAGREE with the plan: optimizer state: adam moments" in out.stdout


@pytest.mark.parametrize("args,hint", [
    (("--rank", "8", "--dp", "4"), "outside the world"),
    (("--model", "gpt-9"), "choose one of"),
    (("--model", "qwen3-235b-a22b", "--pp", "8", "--ep", "8", "--dp", "8"), "--decoder-first-pipeline-num-layers 11"),
    (("--model", "qwen3-30b-a3b", "--ep", "16", "--dp", "8"), "choose --ep"),
])
def test_bad_input_is_one_line_with_the_fix(args, hint):
    out = dry_run(*args)
    assert out.returncode == 2
    assert hint in out.stderr


FSDP_CASES = {
    # docs/fsdp.md's cases: Qwen3-8B at FSDP 64 and 256, Qwen3-32B at TP 4 x FSDP 64.
    "qwen3-8b fsdp64": ("--model", "qwen3-8b", "--dp", "64", "--rank", "5"),
    "qwen3-8b fsdp256 optim": ("--model", "qwen3-8b", "--dp", "256", "--rank", "17",
                               "--data-parallel-sharding-strategy", "optim"),
    "qwen3-32b tp4 fsdp64 soap": ("--model", "qwen3-32b", "--tp", "4", "--dp", "64", "--rank", "13",
                                  "--optimizer", "soap", "--data-parallel-sharding-strategy", "optim_grads"),
    # the planner's micro-groups (a CPU run's)
    "qwen3-8b fsdp64 budget": ("--model", "qwen3-8b", "--dp", "64", "--rank", "5", "--fsdp-micro-groups", "budget"),
}


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("case", list(FSDP_CASES))
def test_a_full_size_megatron_fsdp_rank_is_predicted_from_its_plan(case):
    """``--fsdp``: the rank's part of Megatron-FSDP's buffers under the strategy (weights whole
    except under optim_grads_params, gradients whole under optim, fp32 main weights always a
    shard), its optimizer state and the host-group buffers of the step, from the plan of the real
    model built on meta; the prediction is held to CPU runs by tests/e2e/test_canzona_fsdp.py (test_dry_runs_fsdp_prediction_is_what_every_rank_measured)."""
    out = dry_run("--fsdp", *FSDP_CASES[case], "--json")
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    report = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {row["quantity"]: row for row in report["rows"]}
    c = report["config"]
    assert report["agree"] and report["catalog"]["ok"] and c["fsdp"] and not report["measured"]
    # micro-groups as a CUDA run takes them (auto: as projected on the cluster; docs/fsdp.md), or as given
    given = "--fsdp-micro-groups" in FSDP_CASES[case]
    assert c["micro_groups"] == ("budget" if given else "auto"), c
    if given:
        assert c["num_groups"] > 1, c
    strategy = c["strategy"]
    buckets = report["bucket_geometry"]
    dp = int(FSDP_CASES[case][FSDP_CASES[case].index("--dp") + 1])
    assert all(b["dp_size"] == dp and b["size"] % (dp * b["chunk"]) == 0 for b in buckets)
    whole, shard = sum(b["size"] for b in buckets), sum(b["size"] // dp for b in buckets)
    assert rows["fp32 main weights"]["predicted"] == shard and rows["fp32 main weights"]["held"] == "shard"
    assert rows["model weights"]["predicted"] == (shard if strategy == "optim_grads_params" else whole)
    assert rows["gradients"]["predicted"] == (whole if strategy == "optim" else shard)
    assert rows["buckets"]["predicted"] == len(buckets) == len(report["buckets"])
    held = rows["parameter elements in this rank's shards"]["predicted"]
    assert 0 < held <= shard
    state = {name.removeprefix("optimizer state: "): row["predicted"] for name, row in rows.items()
             if name.startswith("optimizer state: ")}
    if c["optimizer"] == "muon":  # every element held: its momentum (a matrix's) or two AdamW moments
        assert state["momentum"] + state["adam moments"] // 2 == held
        assert state["statistics"] == state["eigenbases"] == 0
    else:  # SOAP: everything on the hosts (this rank hosts some), no momentum
        assert state["momentum"] == 0 and min(state["statistics"], state["eigenbases"], state["moments"]) > 0
    assert rows["host-group buffers alive at once"]["predicted"] >= rows["largest temporary buffer of the step"]["predicted"] > 0
    memory = report["memory"]
    assert memory["steady_bytes"] == sum(row["bytes"] for name, row in rows.items()
                                         if name in ("model weights", "fp32 main weights", "gradients")
                                         or name.startswith("optimizer state: "))
    assert memory["peak_bytes"] > memory["steady_bytes"]


def test_every_ranks_fsdp_state_covers_the_model_once():
    """``--fsdp --every-rank``: under Muon each matrix element's momentum is on the one rank holding
    it, so the ranks' momentum adds up to the matrix elements and their AdamW moments to twice the
    rest; the table names the busiest rank."""
    out = dry_run("--fsdp", "--model", "qwen3-tiny", "--dp", "4", "--every-rank", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and all(r["experts"] is None for r in ranks)
    items = sum(b["size"] for b in report["bucket_geometry"])  # padded; the held elements are fewer
    momentum = sum(r["dense"]["momentum"] for r in ranks)
    adam = sum(r["dense"]["adam_moments"] for r in ranks)
    # qwen3-tiny: 2 layers of QKV 128x64, proj 64x64, fc1 352x64, fc2 64x176 (the matrices); the rest AdamW
    assert momentum == 2 * (128 * 64 + 64 * 64 + 352 * 64 + 64 * 176)
    assert momentum + adam // 2 <= items
    table = dry_run("--fsdp", "--model", "qwen3-tiny", "--dp", "4", "--every-rank")
    assert "optimizer state over the stage's 4 ranks: busiest" in table.stdout
    assert "predicted from the plan" in table.stdout


@pytest.mark.parametrize("args,hint", [
    (("--fsdp", "--pp", "2", "--dp", "4"), "--fsdp with --pp 2: megatron-core 0.19.2's Megatron-FSDP"),
    (("--fsdp", "--layout", "lean"), "under --fsdp the buckets and shards are Megatron-FSDP's: drop --layout"),
    (("--data-parallel-sharding-strategy", "optim"), "add --fsdp"),
    (("--fsdp-micro-groups", "one"), "--fsdp-micro-groups describes Megatron-FSDP: add --fsdp"),
    (("--tp-together", "auto"), "--tp-together describes Megatron-FSDP: add --fsdp"),
    (("--fsdp", "--tp-together", "all", "--dp", "2"), "it needs --optimizer muon and --tp above 1"),
    (("--narrow-gathers",), "--narrow-gathers describes Megatron-FSDP: add --fsdp"),
    (("--fsdp", "--narrow-gathers", "--optimizer", "soap", "--dp", "2"), "it needs --optimizer muon: add it"),
    (("--fsdp", "--narrow-gathers", "--muon-fp32-matmul-prec", "high", "--dp", "2"),
     "it needs Newton-Schulz in bf16: drop --muon-fp32-matmul-prec high, or --narrow-gathers"),
    (("--fsdp", "--model", "qwen3-moe-tiny", "--ep", "2", "--etp", "2", "--tp", "2", "--dp", "2"),
     "needs --expert-tensor-parallel-size 1"),
])
def test_fsdp_refusals_are_one_line_with_the_fix(args, hint):
    out = dry_run(*args)
    assert out.returncode == 2
    assert hint in out.stderr and "Traceback" not in out.stderr
    assert len([line for line in out.stderr.splitlines() if "error:" in line]) == 1


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_matrices_computed_together_shrink_the_hosts_buffers_to_their_shards():
    """``--tp-together auto`` at Qwen3-32B TP 4 x FSDP 64: fc1 and fc2 of every layer (128 matrices)
    computed by their TP ranks together, each rank's host-group buffers holding its own shard's, so
    fewer than with one host per matrix on the same rank."""
    args = ("--fsdp", "--model", "qwen3-32b", "--tp", "4", "--dp", "64", "--rank", "13", "--json")
    reports = {}
    for together in ("off", "auto"):
        out = dry_run(*args, "--tp-together", together)
        assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
        reports[together] = json.loads(out.stdout.strip().splitlines()[-1])
    assert [reports[t]["config"]["computed_together"] for t in ("off", "auto")] == [0, 128]
    buffers = {t: {row["quantity"]: row["predicted"] for row in r["rows"]}["host-group buffers alive at once"]
               for t, r in reports.items()}
    assert buffers["auto"] < buffers["off"], buffers
    assert reports["auto"]["agree"] and reports["auto"]["memory"]["peak_bytes"] < reports["off"]["memory"]["peak_bytes"]
