"""pretrain_gpt.py as a user runs it: torchrun on CPU with gloo, a tiny Qwen3, real text.

Each multi-process run has a deadline (a hang fails the test). On 2 cores a run of 20
iterations takes ~20 s, most of it importing Megatron in every rank.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .support import ROOT, DemoData, launch_ranks, run_cases, run_with_deadline, torchrun

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 240
NUM_ITERS = 20
LOG_INTERVAL = 5
MIN_LOSS_DROP = 0.3  # ln(512) = 6.24 at the start; 20 AdamW steps at lr 3e-3 reach ~5.6

QWEN3_TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--kv-channels", "16", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
    "--qk-layernorm", "--disable-bias-linear", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--untie-embeddings-and-output-weights",
    "--seq-length", "64", "--max-position-embeddings", "64",
]


def pretrain_args(data: DemoData, tmp_path: Path, *extra: str) -> list[str]:
    """A complete tiny run: AdamW, 20 iterations, a log line every 5, metrics to tmp_path."""
    return [
        *QWEN3_TINY,
        "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(NUM_ITERS),
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "3",
        "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--log-interval", str(LOG_INTERVAL), "--eval-interval", "10", "--eval-iters", "1",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(data.tokenizer_model),
        "--data-path", data.data_prefix, "--split", "80,10,10",
        "--data-cache-path", str(tmp_path / "cache"), "--num-workers", "0",
        "--canzona-metrics-file", str(tmp_path / "metrics.jsonl"),
        *extra,
    ]


def read_metrics(path: Path) -> list[dict]:
    assert path.is_file(), f"no metrics file at {path}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_training(result: subprocess.CompletedProcess, metrics_path: Path, *, dp_size: int,
                   tp_size: int) -> list[dict]:
    """Exit 0, one metrics line per log interval (and iteration 1), falling loss."""
    assert result.returncode == 0, result.stdout[-6000:]
    metrics = read_metrics(metrics_path)
    assert [m["iteration"] for m in metrics] == [1, *range(LOG_INTERVAL, NUM_ITERS + 1, LOG_INTERVAL)]
    for m in metrics:
        assert (m["dp_size"], m["tp_size"]) == (dp_size, tp_size)
        assert m["optimizer_step_ms"] > 0 and m["tokens_per_s"] > 0 and m["learning_rate"] > 0
        assert m["grad_norm"] > 0 and 0 < m["progress"] <= 1
    losses = [m["lm_loss"] for m in metrics]
    assert losses[-1] < losses[0] - MIN_LOSS_DROP, f"loss did not fall: {losses}"
    assert metrics[-1]["consumed_samples"] == NUM_ITERS * 8
    return metrics


def test_dp2_trains_logs_and_writes_metrics(demo_data: DemoData, tmp_path: Path) -> None:
    args = pretrain_args(demo_data, tmp_path, "--optimizer", "adam", "--use-distributed-optimizer",
                         "--overlap-grad-reduce", "--overlap-param-gather")
    result = launch_ranks(2, "pretrain_gpt.py", *args, timeout_s=RUN_TIMEOUT_S)
    check_training(result, tmp_path / "metrics.jsonl", dp_size=2, tp_size=1)
    # Ranks share one pipe, so a line may be cut by another rank's output: count and search
    # the whole output rather than lines.
    out = result.stdout
    assert out.count("consumed samples:") == 5 and out.count("[canzona] iteration") == 5, out[-6000:]
    for field in ("lm loss:", "grad norm:", "learning rate:", "optimizer step (ms):",
                  "throughput (tokens/s):", "progress: 100.0%", "validation loss at iteration 20"):
        assert field in out, f"{field!r} missing:\n{out[-6000:]}"


def test_tp2_trains(demo_data: DemoData, tmp_path: Path) -> None:
    args = pretrain_args(demo_data, tmp_path, "--optimizer", "adam", "--tensor-model-parallel-size", "2",
                         "--use-distributed-optimizer")
    result = launch_ranks(2, "pretrain_gpt.py", *args, timeout_s=RUN_TIMEOUT_S)
    check_training(result, tmp_path / "metrics.jsonl", dp_size=1, tp_size=2)


CANZONA_RUNS = {
    # Muon in bf16 with fp32 main weights and both overlaps; Shampoo and SOAP in fp32.
    "muon_bf16_overlap": ["--optimizer", "muon", "--bf16", "--overlap-grad-reduce", "--overlap-param-gather"],
    "shampoo": ["--optimizer", "shampoo", "--shampoo-precondition-frequency", "5"],
    "soap": ["--optimizer", "soap", "--soap-precondition-frequency", "5"],
}


@pytest.mark.parametrize("run", CANZONA_RUNS)
def test_canzona_dp2_trains(demo_data: DemoData, tmp_path: Path, run: str) -> None:
    """pretrain_gpt.py --canzona for real: the α-balanced layout, the Canzona optimizer, DP 2."""
    args = pretrain_args(demo_data, tmp_path, *CANZONA_RUNS[run], "--canzona", "--use-distributed-optimizer",
                         "--canzona-alpha", "0.25")
    result = launch_ranks(2, "pretrain_gpt.py", *args, timeout_s=RUN_TIMEOUT_S)
    metrics = check_training(result, tmp_path / "metrics.jsonl", dp_size=2, tp_size=1)
    assert metrics[-1]["canzona"] and metrics[-1]["optimizer"] == CANZONA_RUNS[run][1]
    assert "number of skipped iterations:   0" in result.stdout
    # The layout auto chose and the plan are logged once, with their projection and balance.
    assert re.search(r"\[canzona\] layout auto -> (whole|lean) \(projected on cpu-gloo-local\): whole step [0-9.]+ ms, "
                     r"iteration [0-9.]+ ms \| lean step", result.stdout), result.stdout[-4000:]
    assert result.stdout.count("[canzona] plan:") == 1, result.stdout[-4000:]


def test_canzona_tp2_dp2_trains(demo_data: DemoData, tmp_path: Path) -> None:
    """The README's main job in small: Muon with --canzona at TP 2 x DP 2 (4 processes), logging to
    TensorBoard and to W&B (offline) as Megatron users do; Newton-Schulz on the Gram matrix; one
    iteration profiled by owner (``--canzona-profile-iteration``)."""
    args = pretrain_args(demo_data, tmp_path, "--optimizer", "muon", "--canzona", "--use-distributed-optimizer",
                         "--muon-ns-method", "gram", "--canzona-profile-iteration", str(PROFILED),
                         "--canzona-profile-file", str(tmp_path / "profile.json"),
                         "--tensor-model-parallel-size", "2", "--overlap-grad-reduce", "--overlap-param-gather",
                         "--tensorboard-dir", str(tmp_path / "tb"), "--tensorboard-log-interval", "1",
                         "--wandb-project", "canzona-test", "--wandb-exp-name", "tp2-dp2",
                         "--wandb-save-dir", str(tmp_path / "wandb"))
    result = launch_ranks(4, "pretrain_gpt.py", *args, timeout_s=RUN_TIMEOUT_S,
                               env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    metrics = check_training(result, tmp_path / "metrics.jsonl", dp_size=2, tp_size=2)
    assert metrics[-1]["canzona"] and "number of skipped iterations:   0" in result.stdout
    assert "DP x TP makespan / lower bound" in result.stdout, result.stdout[-4000:]
    check_tensorboard(tmp_path / "tb", metrics)
    runs = list((tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0, "no offline W&B run"
    assert b"canzona/optimizer step ms" in runs[0].read_bytes()
    check_profile(json.loads((tmp_path / "profile.json").read_text()), result.stdout)


PROFILED = 12
"""The iteration the TP 2 x DP 2 run profiles (as the log numbers it)."""


def check_profile(profile: dict, stdout: str) -> None:
    """The profiled iteration's summary: its phases, every owner, Canzona's hooks at work (the
    early gathers and uneven collectives run at TP 2 x DP 2), no host sync counted on CPU."""
    assert f"profile of iteration {PROFILED} (cpu;" in stdout
    assert profile["iteration"] == PROFILED - 1 and profile["device"] == "cpu"
    assert set(profile["phases_ms"]) == {"forward_backward", "optimizer_step"}
    assert 0 < profile["phases_ms"]["optimizer_step"] < profile["wall_ms"]
    owners = profile["owners"]
    assert list(owners) == ["model", "Megatron DDP", "Canzona hooks", "optimizer", "Megatron timers", "other"]
    for owner in ("model", "Megatron DDP", "Canzona hooks", "optimizer"):
        assert owners[owner]["cpu_ms"] > 0, (owner, owners)
    assert all(row["gpu_ms"] == 0 and row["host_syncs"] == 0 for row in owners.values())
    assert any("canzona_patches/" in frame for frame, _, _ in profile["top_frames"]["Canzona hooks"])
    assert profile["gpu_idle_in_forward_backward_ms"] is None
    assert any(name == "aten::mm" for name, *_ in profile["top_ops_outside_step"])


def check_tensorboard(directory: Path, metrics: list[dict]) -> None:
    """Megatron's scalars and Canzona's, read back from the event file the last rank wrote."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm"} <= tags, tags
    logged = {m["iteration"]: m for m in metrics}
    step_ms = {e.step: e.value for e in events.Scalars("canzona/optimizer step ms")}
    assert sorted(step_ms) == sorted(logged)
    for iteration, value in step_ms.items():
        assert value == pytest.approx(logged[iteration]["optimizer_step_ms"], rel=1e-6)
    balance = [e.value for e in events.Scalars("canzona/plan makespan over lower bound")]
    assert balance and all(value >= 1.0 for value in balance)
    assert all(e.value > 0 for e in events.Scalars("canzona/bytes sent per rank per step"))
    assert len(events.Scalars("lm loss")) == NUM_ITERS


def test_canzona_buckets_smaller_than_a_matrix_split_it_across_shards(demo_data: DemoData, tmp_path: Path) -> None:
    """The lean layout: buckets of 1,000 elements are smaller than every matrix of qwen3-tiny,
    so each matrix lies across both DP shards and one host rank computes it (α = 1: balance
    first)."""
    args = pretrain_args(demo_data, tmp_path, "--optimizer", "muon", "--canzona", "--use-distributed-optimizer",
                         "--overlap-grad-reduce", "--ddp-bucket-size", "1000", "--canzona-alpha", "1.0",
                         "--canzona-layout", "lean")
    result = launch_ranks(2, "pretrain_gpt.py", *args, timeout_s=RUN_TIMEOUT_S)
    check_training(result, tmp_path / "metrics.jsonl", dp_size=2, tp_size=1)
    assert "number of skipped iterations:   0" in result.stdout
    plan = re.search(r"\[canzona\] plan: lean layout, (\d+) matrices .*?, (\d+) bucket\(s\), (\d+) split across DP shards",
                     result.stdout)
    assert plan is not None, result.stdout[-4000:]
    matrices, buckets, split = map(int, plan.groups())
    assert buckets == matrices and split == matrices


@pytest.mark.quick
def test_canzona_with_virtual_pipeline_stages(demo_data: DemoData, tmp_path: Path) -> None:
    """PP 2 with two model chunks per stage (4 layers, one per virtual stage): each stage's
    chunks are planned together, one bucket per chunk, and the run trains and saves."""
    args = pretrain_args(demo_data, tmp_path, "--optimizer", "muon", "--canzona", "--use-distributed-optimizer",
                         "--pipeline-model-parallel-size", "2", "--num-layers", "4",
                         "--num-layers-per-virtual-pipeline-stage", "1",
                         "--save", str(tmp_path / "ckpt"), "--save-interval", str(NUM_ITERS))
    result = launch_ranks(2, "pretrain_gpt.py", *args, timeout_s=RUN_TIMEOUT_S)
    check_training(result, tmp_path / "metrics.jsonl", dp_size=1, tp_size=1)
    plans = re.findall(r"\[canzona\] stage (\d) plan: \w+ layout, (\d+) matrices over DP 1 x TP 1, (\d+) bucket\(s\)",
                       result.stdout)
    assert sorted(plans) == [("0", "8", "2"), ("1", "8", "2")], result.stdout[-4000:]  # each stage: 2 chunks of 1 layer
    assert (tmp_path / "ckpt" / f"iter_{NUM_ITERS:07d}").is_dir()


BAD_INPUTS = {
    "adam": (["--canzona", "--optimizer", "adam", "--use-distributed-optimizer"],
             "--canzona needs a matrix optimizer: pass --optimizer muon|shampoo|soap"),
    "sgd": (["--canzona", "--optimizer", "sgd", "--use-distributed-optimizer"],
            "--canzona needs a matrix optimizer: pass --optimizer muon|shampoo|soap"),
    "megatron_fsdp_no_shard": (["--canzona", "--optimizer", "muon", "--use-megatron-fsdp",
                                "--data-parallel-sharding-strategy", "no_shard"],
                               "pass optim, optim_grads or optim_grads_params, or --use-distributed-optimizer"),
    "megatron_fsdp_layout": (["--canzona", "--optimizer", "muon", "--use-megatron-fsdp", "--canzona-layout", "whole"],
                             "the buckets and shards are Megatron-FSDP's: drop --canzona-layout"),
    "torch_fsdp2": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer", "--use-torch-fsdp2"],
                    "use --use-megatron-fsdp, or --use-distributed-optimizer"),
    "cpu_offload": (["--canzona", "--optimizer", "soap", "--use-distributed-optimizer", "--optimizer-cpu-offload"],
                    "drop --optimizer-cpu-offload"),
    "unknown_optimizer": (["--optimizer", "lamb"], "choose from"),
    "shampoo_without_canzona": (["--optimizer", "shampoo"], "add --canzona"),
    "qk_clip_alpha": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer", "--qk-clip",
                       "--qk-clip-alpha", "1.5"], "--qk-clip-alpha must be between 0.0 and 1.0 when using --qk-clip"),
    "qk_clip_threshold": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer", "--qk-clip",
                           "--qk-clip-threshold", "0"], "--qk-clip-threshold must be greater than 0"),
    "qk_clip_mla": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer", "--qk-clip",
                     "--multi-latent-attention"], "multi-latent attention (--multi-latent-attention) gives no logits"),
    "qk_clip_without_canzona": (["--qk-clip"], "--qk-clip without --canzona is Megatron-Core's"),
    "no_distributed_optimizer": (["--canzona", "--optimizer", "muon"], "add --use-distributed-optimizer"),
    "context_parallel_odd_sequence": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer",
                                       "--context-parallel-size", "2", "--seq-length", "66",
                                       "--max-position-embeddings", "66"], "pick a multiple of 4"),
    "context_parallel_window": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer",
                                 "--context-parallel-size", "2", "--window-size", "16,0"],
                                "--window-size needs transformer-engine's: install it, or drop it"),
    "no_gloo": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer", "--disable-gloo-process-groups"],
                "drop --disable-gloo-process-groups"),
    "unknown_layout": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer", "--canzona-layout", "wide"],
                       "argument --canzona-layout: invalid choice: 'wide'"),
    "cluster_missing_a_field": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer", "--canzona-cluster",
                                 "tests/e2e/cluster_without_gpu.toml"],
                                "--canzona-cluster: cluster_without_gpu.toml: missing [gpu] table"),
    "unknown_cluster": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer", "--canzona-cluster",
                         "h200-ib"], "is neither a file nor a preset; choose one of"),
    "cluster_without_auto": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer", "--canzona-layout",
                              "whole", "--canzona-cluster", "h100-ib400"], "only serves --canzona-layout auto"),
    "early_compute_without_early_gathers": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer",
                                             "--canzona-early-compute", "--canzona-no-early-gather"],
                                            "drop --canzona-no-early-gather, or --canzona-early-compute"),
    "negative_early_compute_budget": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer",
                                       "--canzona-early-compute-budget", "-1"], "must be 0 or more GiB"),
    "matrices_first_without_early_compute": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer",
                                              "--canzona-matrices-reduce-first", "--canzona-no-early-compute"],
                                             "drop --canzona-no-early-compute, or --canzona-matrices-reduce-first"),
    "matrices_first_without_overlap": (["--canzona", "--optimizer", "muon", "--use-distributed-optimizer",
                                        "--canzona-matrices-reduce-first"],
                                       "add --overlap-grad-reduce, or drop --canzona-matrices-reduce-first"),
}


MEGATRON_BASE = [*QWEN3_TINY, "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10",
                 "--lr", "1e-3", "--eval-interval", "5", "--mock-data", "--tokenizer-type", "NullTokenizer",
                 "--vocab-size", "64"]
"""A command line every check passes (the data never read: each case stops at the flags)."""
MEGATRON_CHECKS = {
    # name: (flags over MEGATRON_BASE, the job's world size, what the line must say)
    "world_size": (["--tensor-model-parallel-size", "2"], 3,
                   "start a multiple of TP x PP x CP = 2 processes (torchrun --nproc-per-node x --nnodes)"),
    "world_size_with_cp": (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"], 6,
                           "start a multiple of TP x PP x CP = 4 processes"),
    "layers_by_pipeline": (["--pipeline-model-parallel-size", "2", "--num-layers", "3"], 2,
                           "--decoder-first-pipeline-num-layers"),
    "positions_below_sequence": (["--max-position-embeddings", "32"], 1,
                                 "raise --max-position-embeddings (now 32) to at least --seq-length 64"),
    "micro_batch_zero": (["--micro-batch-size", "0"], 1, "--micro-batch-size must be 1 or more"),
}
"""Megatron's own ``validate_args`` asserts a command line can reach (a table of flags: each
case trips one), which pretrain_gpt.py answers in one line naming the flags and the fix."""


def test_megatrons_own_checks_fail_in_one_line() -> None:
    cases = {name: {"flags": [*MEGATRON_BASE, *flags], "env": {"WORLD_SIZE": str(world)}}
             for name, (flags, world, _) in MEGATRON_CHECKS.items()}
    results = run_cases(cases, timeout_s=RUN_TIMEOUT_S)
    for name, (_, _, expected) in MEGATRON_CHECKS.items():
        result = results[name]
        assert result["returncode"] == 2, f"{name}: exit {result['returncode']}\n{result['stderr'][-3000:]}"
        errors = [line for line in result["stderr"].splitlines() if "error:" in line]
        assert len(errors) == 1 and "Traceback" not in result["stderr"], f"{name}: {result['stderr'][-3000:]}"
        assert errors[0].startswith("pretrain_gpt.py: error: ") and expected in errors[0], f"{name}: {errors[0]}"


def test_a_layout_megatrons_parallel_state_refuses_is_one_line() -> None:
    """Sizes validate_args passes but the parallel-state set-up cannot lay out (3 expert-parallel
    ranks among 2 processes) fail there with a RuntimeError on every rank: one line instead."""
    flags = [*MEGATRON_BASE, "--num-experts", "6", "--expert-model-parallel-size", "3"]
    result = run_with_deadline(torchrun(2, "pretrain_gpt.py", *flags), timeout_s=RUN_TIMEOUT_S)
    assert result.returncode != 0
    errors = [line for line in result.stdout.splitlines() if "pretrain_gpt.py: error:" in line]
    assert len(errors) == 1, result.stdout[-4000:]
    assert "must be a multiple of expert TP x EP x PP = 3: change --expert-model-parallel-size (3)" in errors[0]
    assert "[rank0]: Traceback" not in result.stdout and "[rank1]: Traceback" not in result.stdout


def check_one_line_error(name: str, returncode: int, stderr: str) -> None:
    expected = BAD_INPUTS[name][1]
    assert returncode == 2, f"{name}: exit {returncode}\n{stderr[-2000:]}"
    error_lines = [line for line in stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1, f"{name}: {error_lines}"
    assert stderr.rstrip().splitlines()[-1] == error_lines[0], f"{name}: the error is not the last line"
    assert error_lines[0].startswith("pretrain_gpt.py: error: ") and expected in error_lines[0], error_lines[0]
    assert "Traceback" not in stderr, f"{name}: {stderr[-2000:]}"


def test_bad_flags_fail_with_one_line_naming_the_fix() -> None:
    """Every case through pretrain_gpt.py as one rank forked after one import (support.run_cases),
    and one case as a plain command line beside it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = subprocess.Popen([sys.executable, "pretrain_gpt.py", *BAD_INPUTS["adam"][0]], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cases = {name: flags for name, (flags, _) in BAD_INPUTS.items()}
    results = run_cases(cases, timeout_s=RUN_TIMEOUT_S)
    try:
        _, cli_stderr = cli.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        cli.kill()
        pytest.fail(f"pretrain_gpt.py gave no answer in {RUN_TIMEOUT_S} s")
    check_one_line_error("adam", cli.returncode, cli_stderr)
    assert set(results) == set(BAD_INPUTS)
    for name, result in results.items():
        check_one_line_error(name, result["returncode"], result["stderr"])


@pytest.mark.alone
@pytest.mark.parametrize("name", ["adam", "unknown_layout"])
def test_a_start_up_error_is_printed_once_per_job(name: str) -> None:
    """Every rank parses the same flags and fails alike: rank 0 says it (Canzona's check, and
    argparse's own), the others exit quietly with the same code, and the line comes before
    torchrun's failure report."""
    result = run_with_deadline(torchrun(3, "pretrain_gpt.py", *BAD_INPUTS[name][0]), timeout_s=RUN_TIMEOUT_S)
    assert result.returncode != 0
    lines = result.stdout.splitlines()
    errors = [i for i, line in enumerate(lines) if "pretrain_gpt.py: error:" in line]
    assert len(errors) == 1 and BAD_INPUTS[name][1] in lines[errors[0]], result.stdout[-4000:]
    report = [i for i, line in enumerate(lines) if "ChildFailedError" in line or "Root Cause" in line]
    assert not report or errors[0] < report[0], result.stdout[-4000:]


def test_an_fp16_run_that_skips_every_iteration_says_so(demo_data: DemoData, tmp_path: Path) -> None:
    """--fp16 from Megatron's initial loss scale 2^32 overflows every iteration of a short run:
    each log line is followed by a warning naming --initial-loss-scale, and the run, having
    trained nothing, ends with one error line and a non-zero exit instead of exit 0."""
    args = pretrain_args(demo_data, tmp_path, "--optimizer", "adam", "--fp16", "--train-iters", "8",
                         "--lr-warmup-iters", "2")
    result = launch_ranks(1, "pretrain_gpt.py", *args, timeout_s=RUN_TIMEOUT_S)
    assert result.returncode != 0, result.stdout[-4000:]
    assert "[canzona] warning: all 5 iteration(s) so far were skipped" in result.stdout, result.stdout[-4000:]
    errors = [line for line in result.stdout.splitlines() if "pretrain_gpt.py: error:" in line]
    assert len(errors) == 1 and "all 8 iterations were skipped" in errors[0] and "--initial-loss-scale" in errors[0]


def test_a_split_without_documents_fails_instead_of_hanging(demo_data: DemoData, tmp_path: Path) -> None:
    """38 documents and --split 949,50,1 leave the test split empty (Megatron's GPTDataset would spin)."""
    args = pretrain_args(demo_data, tmp_path, "--optimizer", "adam")
    args[args.index("--split") + 1] = "949,50,1"
    result = launch_ranks(1, "pretrain_gpt.py", *args, timeout_s=RUN_TIMEOUT_S)
    assert result.returncode != 0
    assert "--split 949,50,1 leaves the test split" in result.stdout
