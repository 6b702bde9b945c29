#!/usr/bin/env python
"""Every GPU measurement the project needs, in one command, on a machine with torch and a CUDA
device and no network (`make gpu-check`).

    python tools/gpu_check.py                      # all steps; writes build/gpu-check/ and docs/gpu_check.md
    python tools/gpu_check.py --steps bench        # some of them
    python tools/gpu_check.py --out /tmp/gc        # elsewhere; docs/ is written only on CUDA

Steps, each a subprocess with its own time limit and log under ``--out``:

* ``environment``: torch, CUDA device, megatron-core, transformer-engine (used when
  installed, said when not), git revision;
* ``cuda_tests``: the tests marked ``gpu`` (NCCL, the optimizer's CUDA side stream);
* ``bench``: ``tools/bench_optim.py --device cuda``, Muon's standard and gram Newton-Schulz in
  bf16 on Qwen3 1.7B-32B shapes, batched, against the matmul rate measured in the same run;
  writes the calibration ``tools/calibrations/<gpu>-muon-bf16.json``;
* ``tp2dp2``: 4 processes with CUDA tensors and gloo collectives at TP 2 x DP 2 through
  ``pretrain_gpt.py --canzona`` (the CPU demo's model and data), losses compared with the
  same run on CPU;
* ``one_gpu``: one GPU, bf16, Qwen3-8B cut to a few layers on the demo data, with AdamW,
  Megatron's layer-wise Muon and Canzona's Muon: optimizer step and iteration time.

Without CUDA the CUDA parts are skipped, each with its reason and the command it would run,
and the rest runs small on CPU (``bench`` on qwen3-tiny in fp32, the recipes' ``DRY_RUN``),
so that a test keeps the plumbing working. Writes ``gpu_check.json`` (everything) and
``gpu_check.md`` (the table) under ``--out``; on CUDA the table also becomes the "Last
result" of docs/gpu_check.md, which README links to.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron.canzona.cli import ArgumentParser, at_least, positive
from megatron.canzona.curves import read_curve
from megatron.canzona.provenance import ROOT as ROOT_DIR
from megatron.canzona.provenance import git_revision, machine

ROOT = Path(ROOT_DIR)
CPU_DEMO = ROOT / "examples" / "qwen3" / "pretrain_qwen3_tiny_cpu.sh"
RECIPE_8B = ROOT / "examples" / "qwen3" / "pretrain_qwen3_8b.sh"
DEMO_DATA = ROOT / "data" / "demo"
BENCH_MODELS = ("qwen3-1.7b", "qwen3-8b", "qwen3-14b", "qwen3-32b")
IDLE_CLIP = ["--clip-grad", "1e9"]
"""A clip that never acts (the recipe's 1.0 acts in every iteration of these short runs)."""
RECIPE_VARIANTS = {
    "canzona_auto": ("canzona", ["--muon-ns-method", "auto"]),
    "canzona_no_early": ("canzona", ["--canzona-no-early-compute"]),
    "canzona_early": ("canzona", ["--canzona-early-compute", "on"]),
    "canzona_early_idle": ("canzona", ["--canzona-early-compute", "on", *IDLE_CLIP]),
    "canzona_no_early_idle": ("canzona", ["--canzona-no-early-compute", *IDLE_CLIP]),
}
"""A one-GPU variant that is a recipe ``VARIANT`` with more flags (else the variant is the recipe's)."""
ONE_GPU_VARIANTS = ("adamw", "layerwise", "canzona", "canzona_auto", "canzona_no_early")
"""Run in every round: Canzona's default (early compute ``auto``), with gram Newton-Schulz where
it is faster, and with early compute off, against Megatron's layer-wise Muon and AdamW."""
ONCE_VARIANTS = ("canzona_no_early_idle", "canzona_early_idle", "canzona_early")
"""Run once, after the rounds: the clip-idle pair, what committed early compute costs or saves
where it is forced (DP 1 has no reduce-scatter tail: ``auto`` leaves it off), and early compute
forced with the recipe's clip, which acts in every iteration (what the speculation policy costs)."""
ALL_VARIANTS = (*ONE_GPU_VARIANTS, *ONCE_VARIANTS)
RATIOS = (("canzona", "layerwise"), ("canzona_auto", "layerwise"), ("canzona_no_early", "layerwise"),
          ("canzona", "canzona_no_early"), ("canzona_early_idle", "canzona_no_early_idle"),
          ("canzona_early", "canzona_no_early"), ("canzona_early", "canzona"))
"""The ratios reported round by round (rounds both variants ran)."""
ONE_GPU_LAYERS = 4
"""Layers of the cut Qwen3-8B: its matrices are the full model's, a ninth of them."""
ONE_GPU_ROUNDS = 3
"""The variants run in turn this many times, so that drift hits them alike (paired rounds)."""
ONE_GPU_WARMUP = 3
"""Untimed first iterations of each run (the profiled one among them, in the first round)."""
ONE_GPU_TIMED = 10
"""Timed iterations of each run after the warm-up: 30 per variant over the rounds."""
PROFILED_ITERATION = 2
"""The iteration of each variant's first run that runs under torch.profiler (a warm-up one)."""
TP2DP2_ITERS = 10
EXPECTED_S = {"tp2dp2": 150.0, "cuda_tests": 40.0, "bench": 45.0, "overlap": 10.0}
"""About what each step after ``one_gpu`` took on an H100 (2026-11-27), for the budget."""
MIN_STEP_S = 30.0
"""Budget left under which a step is not started."""
LOSS_RTOL = 2e-3
"""Relative difference allowed between the CUDA and the CPU run's losses: fp32 matmuls and
reductions in another order, over 10 steps (the CPU runs agree bitwise with each other)."""


@dataclass
class Result:
    """What one step found."""

    status: str = "ran"
    """``ran``, ``skipped`` or ``failed``."""
    summary: str = ""
    """One line for the table."""
    details: dict[str, Any] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Context:
    out: Path
    python: str
    cuda: bool
    timeout_s: float
    publish: bool
    variants: tuple[str, ...] = ONE_GPU_VARIANTS
    """The ``one_gpu`` step's recipe variants, in this order."""
    once: tuple[str, ...] = ONCE_VARIANTS
    """Variants the ``one_gpu`` step runs once, after its rounds."""
    profile: bool = True
    """After the timed runs, one short run of each variant that profiles its iteration
    :data:`PROFILED_ITERATION` (apart: the iterations after a profiled one are the noisier for it on
    a host-bound GPU, 2026-11-28)."""
    rounds: int = ONE_GPU_ROUNDS
    timed: int = ONE_GPU_TIMED
    deadline: float = float("inf")
    """``time.monotonic()`` by which the whole check ends (``--budget``): later runs are left out."""
    reserve_s: float = 0.0
    """Seconds the steps after ``one_gpu`` are expected to take: its later rounds leave them that."""

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, command: list[str], result: Result, *, env: dict[str, str] | None = None,
            timeout_s: float | None = None) -> subprocess.CompletedProcess:
        """``command`` from the repository root, its output in ``<out>/<name>.log``; the command
        is recorded on ``result``; a non-zero exit raises ``RuntimeError`` naming the log."""
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()) + " " + shlex.join(command)
        result.commands.append(shown.strip())
        log = self.out / f"{name}.log"
        with log.open("w") as handle:
            done = subprocess.run(command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=handle,
                                  stderr=subprocess.STDOUT, timeout=timeout_s or self.timeout_s, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"exit {done.returncode}: {failure_line(log)} (log: {log})")
        return done


def failure_line(log: Path) -> str:
    """What a failed command's log says went wrong: its last line naming an error or a signal
    (torchrun's closing ``ChildFailedError`` names neither), else its last lines."""
    lines = log.read_text(errors="replace").strip().splitlines()
    named = [line.strip() for line in lines if re.search(r"Error\b|error:|Signal \d+|SIG[A-Z]+ ", line)
             and "ChildFailedError" not in line]
    return named[-1] if named else " / ".join(lines[-3:]) or "no output"


def transformer_engine() -> str | None:
    """transformer-engine's version, or ``None`` when it is not installed."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        return importlib.metadata.version("transformer_engine")
    except importlib.metadata.PackageNotFoundError:
        return "installed"


def gpu_slug() -> str:
    """The device's name for file names: ``h100``, ``h200``, ... (``cpu`` without CUDA)."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    found = re.search(r"\b([a-z]\d{2,4}[a-z]?)\b", name)
    return found.group(1) if found else re.sub(r"\W+", "-", name).strip("-")


# --- Steps ------------------------------------------------------------------------------------


def step_environment(ctx: Context, result: Result) -> None:
    te = transformer_engine()
    try:
        megatron = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        megatron = None
    device = torch.cuda.get_device_name(0) if ctx.cuda else "none"
    result.details = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device,
                      "megatron_core": megatron, "transformer_engine": te, "git": git_revision(),
                      "machine": machine(torch.device("cuda" if ctx.cuda else "cpu"))}
    result.summary = (f"{device}, torch {torch.__version__}, megatron-core {megatron or 'missing'}, "
                      + (f"transformer-engine {te}" if te else "no transformer-engine (Megatron's local layers)"))


def cuda_tests_command(ctx: Context) -> list[str]:
    return [ctx.python, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]


def step_cuda_tests(ctx: Context, result: Result) -> None:
    ctx.run("cuda_tests", cuda_tests_command(ctx), result)
    log = (ctx.out / "cuda_tests.log").read_text()
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|deselected)", log)}
    result.details = counts
    result.summary = ", ".join(f"{v} {k}" for k, v in counts.items() if k != "deselected")


def step_bench(ctx: Context, result: Result) -> None:
    report = ctx.out / "bench_optim.json"
    # Without CUDA, small and in fp32 (CPU bf16 matmuls are emulated, a thousand times slower).
    dtype = "bfloat16" if ctx.cuda else "float32"
    calibration = ((ROOT / "tools" / "calibrations" if ctx.publish else ctx.out)
                   / f"{gpu_slug()}-muon-{'bf16' if ctx.cuda else 'fp32'}.json")
    sizes = (["--device", "cuda", "--models", *BENCH_MODELS, "--stack", "4"] if ctx.cuda else
             ["--device", "cpu", "--models", "qwen3-tiny", "--shrink", "1", "--stack", "2", "--repeats", "1",
              "--warmup", "0", "--matmul-size", "256"])
    ctx.run("bench", [ctx.python, "tools/bench_optim.py", "--optimizer", "muon", *sizes, "--ns-dtype", dtype,
                      "--muon-ns-method", "standard", "gram", "--json", str(report), "--calibrate", str(calibration)],
            result)
    data = json.loads(report.read_text())
    rate = data["matmul_flops_per_s"][dtype]
    standard = [r for r in data["rows"] if r.get("ns_method") == "standard"]
    methods = []
    by_key = {(r["model"], r["matrix"], r["ns_method"]): r for r in data["rows"] if "ns_method" in r}
    for r in standard:
        gram = by_key.get((r["model"], r["matrix"], "gram"))
        methods.append({"model": r["model"], "matrix": r["matrix"], "shape": f"{r['m']}x{r['n']}",
                        "standard_ms": 1e3 * r["batched_s"], "gram_ms": 1e3 * gram["batched_s"] if gram else None,
                        "gram_over_standard": gram["batched_s"] / r["batched_s"] if gram else None,
                        "standard_fraction_of_matmul_rate": r["fraction_of_matmul_rate"]})
    best = max(m["standard_fraction_of_matmul_rate"] for m in methods)
    fc1 = [m["gram_over_standard"] for m in methods if m["matrix"] == "fc1" and m["gram_over_standard"]]
    result.details = {"matmul_flops_per_s": rate, "rows": methods, "calibration": str(calibration.relative_to(ROOT)
                      if calibration.is_relative_to(ROOT) else calibration)}
    result.summary = (f"{dtype} matmul {rate / 1e12:.3g} TFLOP/s; standard Newton-Schulz up to {100 * best:.0f}% of "
                      f"it; gram/standard on fc1 {min(fc1):.2f}-{max(fc1):.2f}")


def read_losses(metrics: Path) -> dict[int, float]:
    """Loss by iteration from a ``--canzona-metrics-file`` (read as the loss plots read it)."""
    curve = read_curve(metrics)
    return dict(zip(curve.iterations, curve.losses))


TP2DP2_CONFIGS = (
    ("blocking collectives", {"OVERLAP_GRAD_REDUCE": "0"}),
    ("param gather in the step", {"OVERLAP_PARAM_GATHER": "0"}),
    ("overlapped param gather", {}),
)
"""The TP 2 x DP 2 job's configurations on CUDA tensors over gloo, as (what, environment), the
likeliest to run first: every collective blocking; the gradients' reduce-scatters overlapped with
backward (and Canzona's early gathers with them); the parameter all-gathers overlapped with the
next forward too. On the H100 (torch 2.11) Megatron's own job died in the last two (2026-11-27);
the CPU run uses the first's."""
TP2DP2_BASELINE = {"OPTIMIZER": "adam", "CANZONA": "0"}
"""Megatron's own job (AdamW, its distributed optimizer): run where Canzona's fails, to say whose
the crash is."""


def demo_command(ctx: Context, name: str, *, cuda: bool, env_extra: dict[str, str] | None = None,
                 flags: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The CPU demo at TP 2 x DP 2 for a few iterations: on CPU, or with the GPU visible."""
    env = {**(env_extra or {}), "PYTHON": ctx.python, "TP": "2", "NPROC": "4", "ITERS": str(TP2DP2_ITERS), "OUT_DIR": str(ctx.out / name),
           "MASTER_PORT": "29561" if cuda else "29562",
           "CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # Megatron requires it for TP > 1 on a GPU before Blackwell
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    # Megatron's local layers on both (the CPU run's only choice), so the runs differ in device alone.
    return ["bash", str(CPU_DEMO), "--log-interval", "1", "--eval-interval", "1000",
            "--lr-warmup-iters", str(TP2DP2_ITERS // 5), "--transformer-impl", "local", *(flags or [])], env


def demo_run(ctx: Context, name: str, result: Result, *, cuda: bool, env_extra: dict[str, str] | None = None,
             flags: list[str] | None = None) -> dict[int, float]:
    command, env = demo_command(ctx, name, cuda=cuda, env_extra=env_extra, flags=flags)
    try:
        ctx.run(name, command, result, env=env)
    except RuntimeError as error:  # the demo prints only progress lines: the cause is in its train.log
        train_log = ctx.out / name / "train.log"
        if train_log.is_file():
            raise RuntimeError(f"{failure_line(train_log)} (log: {train_log})") from error
        raise
    return read_losses(ctx.out / name / "metrics.jsonl")


def attempt(ctx: Context, name: str, result: Result, env_extra: dict[str, str]) -> tuple[dict[int, float] | None, str]:
    """One CUDA run of the demo: its losses and ``ran``, or ``None`` and ``failed: <line>``."""
    try:
        return demo_run(ctx, name, result, cuda=True, env_extra=env_extra), "ran"
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return None, "failed: " + str(error).splitlines()[0][:200]


def step_tp2dp2(ctx: Context, result: Result) -> None:
    """Canzona's job with CUDA tensors against the CPU run, in each configuration in turn; where
    Canzona's fails, Megatron's own (AdamW) in the same configuration says whose the crash is."""
    cpu = demo_run(ctx, "tp2dp2_cpu", result, cuda=False, env_extra=dict(TP2DP2_CONFIGS[0][1]))
    configs: dict[str, dict[str, str]] = {}
    matched: tuple[str, dict[int, float]] | None = None
    for number, (what, env_extra) in enumerate(TP2DP2_CONFIGS):
        if number and ctx.left_s() < 120:
            configs[what] = {"canzona": "not run: out of the time budget"}
            continue
        losses, outcome = attempt(ctx, f"tp2dp2_cuda_{number}", result, env_extra)
        configs[what] = {"canzona": outcome}
        if losses is None:
            _, baseline = attempt(ctx, f"tp2dp2_cuda_{number}_adamw", result, {**env_extra, **TP2DP2_BASELINE})
            configs[what]["megatron_adamw"] = baseline
            configs[what]["crash"] = ("the environment's: Megatron's own job fails there too"
                                      if baseline.startswith("failed") else "Canzona's: Megatron's own job runs there")
        elif matched is None:
            matched = (what, losses)
    result.details["configurations"] = configs
    crashes = "; ".join(f"{what}: Canzona {c['canzona'].split(':')[0]}" + (f", crash {c['crash']}" if "crash" in c else "")
                        for what, c in configs.items())
    if matched is None:
        raise RuntimeError(f"no configuration ran Canzona's job on CUDA ({crashes})")
    what, gpu = matched
    common = sorted(set(cpu) & set(gpu))
    if not common:
        raise RuntimeError("the CPU and CUDA runs logged no common iteration")
    worst = max(abs(gpu[i] - cpu[i]) / abs(cpu[i]) for i in common)
    result.details.update({"configuration": what, "iterations": common, "cpu": [cpu[i] for i in common],
                           "cuda": [gpu[i] for i in common], "max_relative_difference": worst,
                           "tolerance": LOSS_RTOL})
    if worst > LOSS_RTOL:
        raise RuntimeError(f"CUDA and CPU losses differ by {worst:.2e} (relative), more than {LOSS_RTOL:.0e}")
    result.summary = (f"{what}: {len(common)} iterations, losses within {worst:.1e} of the CPU run's "
                      f"(allowed {LOSS_RTOL:.0e}); {crashes}")


def one_gpu_env(ctx: Context, variant: str, log_dir: Path, iterations: int | None = None) -> dict[str, str]:
    """The recipe's settings for one run of ``variant`` (``iterations``: default the warm-up and the timed ones)."""
    return {"PYTHON": ctx.python, "VARIANT": RECIPE_VARIANTS.get(variant, (variant,))[0], "NPROC_PER_NODE": "1",
            "TP": "1", "PRECISION": "bf16", "SEQ_LENGTH": "2048", "GLOBAL_BATCH": "8", "MICRO_BATCH": "1",
            "TRAIN_ITERS": str(iterations or ONE_GPU_WARMUP + ctx.timed), "WARMUP_ITERS": "2", "LOG_INTERVAL": "1",
            "EVAL_INTERVAL": "1000", "EVAL_ITERS": "1", "CKPT_DIR": "none",
            "TOKENIZER_TYPE": "SentencePieceTokenizer", "TOKENIZER_MODEL": str(DEMO_DATA / "tokenizer.model"),
            "DATA_PATH": str(DEMO_DATA / "demo_text_document"), "LOG_DIR": str(log_dir), "MASTER_PORT": "29563",
            # Megatron-Core logs its timer reports through `logging` at INFO
            "MEGATRON_LOGGING_LEVEL": "20"}


def one_gpu_flags(variant: str, *, profile: Path | None) -> list[str]:
    """The recipe's extra flags: the cut model, Megatron's level-1 timers (a device wait at
    each phase's ends, alike for every variant), the variant's own, and the profiled iteration."""
    flags = ["--num-layers", str(ONE_GPU_LAYERS), "--transformer-impl", "transformer_engine" if transformer_engine()
             else "local", "--timing-log-level", "1", *RECIPE_VARIANTS.get(variant, ("", []))[1]]
    if profile is not None:
        flags += ["--canzona-profile-iteration", str(PROFILED_ITERATION), "--canzona-profile-file", str(profile)]
    return flags


def step_one_gpu(ctx: Context, result: Result) -> None:
    """Every variant in turn, round after round: per run the timed iterations' step and
    iteration times; the first round also profiles one iteration of each."""
    if not ctx.cuda:  # the recipe's command only
        for variant in (*ctx.variants, *ctx.once):
            env = one_gpu_env(ctx, variant, ctx.out / f"one_gpu_{variant}")
            ctx.run(f"one_gpu_{variant}", ["bash", str(RECIPE_8B), *one_gpu_flags(variant, profile=None)], result,
                    env={**env, "DRY_RUN": "1"})
        return
    if not (DEMO_DATA / "demo_text_document.idx").is_file():
        ctx.run("demo_data", [ctx.python, "tools/prepare_demo_data.py", "--output-dir", str(DEMO_DATA)], result)
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in (*ctx.variants, *ctx.once)}
    profiles: dict[str, Any] = {}
    run_s = 0.0
    schedule = [(k, ctx.variants) for k in range(ctx.rounds)] + [(0, ctx.once)] * bool(ctx.once)
    for index, (round_index, variants) in enumerate(schedule):
        if index and ctx.left_s() < run_s * len(variants) + ctx.reserve_s:  # keep time for the later steps
            break
        for variant in variants:
            name = f"one_gpu_{variant}_r{round_index + 1}"
            begin = time.monotonic()
            ctx.run(name, ["bash", str(RECIPE_8B), *one_gpu_flags(variant, profile=None)], result,
                    env=one_gpu_env(ctx, variant, ctx.out / name))
            run_s = max(run_s, time.monotonic() - begin)
            runs[variant].append(read_run(ctx.out / name))
    for variant in (v for v in runs if runs[v] and ctx.profile):
        if ctx.left_s() < run_s + ctx.reserve_s:
            break
        profile = ctx.out / f"profile_{variant}.json"
        name = f"one_gpu_{variant}_profile"
        ctx.run(name, ["bash", str(RECIPE_8B), *one_gpu_flags(variant, profile=profile)], result,
                env=one_gpu_env(ctx, variant, ctx.out / name, iterations=PROFILED_ITERATION + 1))
        if profile.is_file():
            profiles[variant] = json.loads(profile.read_text())
    one_gpu_result(runs, profiles, transformer_engine(), result)


def read_run(folder: Path) -> dict[str, Any]:
    """One one-GPU run from what it left: its ``LOG_DIR`` (the metrics) and the log beside it
    (Megatron's timers, medians after the warm-up)."""
    return {**one_gpu_run(folder / "metrics.jsonl"),
            "timers_ms": megatron_timers(folder.with_suffix(".log"), skip=ONE_GPU_WARMUP)}


EARLY_OUTCOMES = ("committed", "recomputed", "skipped", "not speculated")


def early_counts(metrics: Path) -> dict[str, int] | None:
    """A run's early-compute outcomes over all its iterations (``None``: it computed nothing early)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    early = [r["early_compute"] for r in records if r.get("early_compute")]
    if not early:
        return None
    return {k: sum(e.get(k, 0) for e in early) for k in EARLY_OUTCOMES}


def one_gpu_run(metrics: Path) -> dict[str, Any]:
    """One run's timed iterations (after :data:`ONE_GPU_WARMUP`): step and iteration time each
    (``--log-interval 1``: one metrics line per iteration), and the loss by iteration."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    timed = [r for r in records if r["iteration"] > ONE_GPU_WARMUP]
    if not timed:
        raise RuntimeError(f"{metrics} holds no iteration after the {ONE_GPU_WARMUP} warm-up ones")
    return {"optimizer_step_ms": [r["optimizer_step_ms"] for r in timed],
            "iteration_ms": [r["iteration_ms"] for r in timed], "loss": read_losses(metrics),
            "early_compute": early_counts(metrics)}


TIMER_LINE = re.compile(r"^\s+([\w-]+) \.*: \(?([\d.]+)(?:, ([\d.]+)\))?\s*$")


def megatron_timers(log: Path, *, skip: int = 0) -> dict[str, float]:
    """Megatron's timer reports in a log (``--timing-log-level``), one per logged iteration: the
    median over the reports after the first ``skip`` of each timer's milliseconds (the slowest
    rank's); with one report, that report."""
    reports: list[dict[str, float]] = []
    for line in log.read_text(errors="replace").splitlines():
        if "time across ranks (ms):" in line:
            reports.append({})
        elif reports and (found := TIMER_LINE.match(line)) is not None:
            reports[-1][found.group(1)] = float(found.group(3) or found.group(2))
    kept = reports[skip:] or reports[-1:]
    names = list(dict.fromkeys(name for report in kept for name in report))
    return {name: statistics.median(r[name] for r in kept if name in r) for name in names}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def one_gpu_result(runs: dict[str, list[dict[str, Any]]], profiles: dict[str, Any], te: str | None,
                   result: Result) -> None:
    """Per variant the medians over every timed iteration and the spread of its rounds' medians;
    Canzona against Megatron's layer-wise Muon round by round (the k-th runs of the two ran
    minutes apart at most); their losses (the same updates) against each other."""
    variants: dict[str, Any] = {}
    for variant, rounds in runs.items():
        if not rounds:
            continue
        row: dict[str, Any] = {"rounds": len(rounds), "loss": rounds[0]["loss"], "timers_ms": rounds[0]["timers_ms"],
                               "forward_backward_ms_rounds": [r["timers_ms"].get("forward-backward") for r in rounds],
                               "early_compute_rounds": [r.get("early_compute") for r in rounds]}
        for key in ("optimizer_step_ms", "iteration_ms"):
            row[key] = statistics.median(t for r in rounds for t in r[key])
            row[f"{key}_rounds"] = [statistics.median(r[key]) for r in rounds]
        if variant in profiles:
            row["profile"] = profiles[variant]
        variants[variant] = row
    result.details = {"layers": ONE_GPU_LAYERS, "transformer_engine": te, "warmup": ONE_GPU_WARMUP,
                      "timed_per_round": next((len(r[0]["iteration_ms"]) for r in runs.values() if r), 0),
                      "variants": variants, "ratios": {}}
    parts = [f"{v}: step {r['optimizer_step_ms']:.1f} ms, iteration {r['iteration_ms']:.0f} ms" for v, r in variants.items()]
    for ours, theirs in RATIOS:
        if ours not in variants or theirs not in variants:
            continue
        keys = ["optimizer_step_ms", "iteration_ms"]
        fb = [(a, b) for a, b in zip(variants[ours]["forward_backward_ms_rounds"], variants[theirs]["forward_backward_ms_rounds"])
              if a is not None and b is not None]
        ratios = {key: spread([a / b for a, b in zip(variants[ours][f"{key}_rounds"], variants[theirs][f"{key}_rounds"])])
                  for key in keys}
        if fb:
            ratios["forward_backward_ms"] = spread([a / b for a, b in fb])
        rounds = min(len(variants[ours]["iteration_ms_rounds"]), len(variants[theirs]["iteration_ms_rounds"]))
        result.details["ratios"][f"{ours}/{theirs}"] = ratios
        parts.append(f"{ours}/{theirs}: step {ratios['optimizer_step_ms']['median']:.3f}, iteration "
                     f"{ratios['iteration_ms']['median']:.3f} ({ratios['iteration_ms']['min']:.3f}-"
                     f"{ratios['iteration_ms']['max']:.3f} over {rounds} rounds)"
                     + (f", forward-backward {ratios['forward_backward_ms']['median']:.3f}" if fb else ""))
    if "layerwise" in variants:
        if "canzona" in variants:
            ours, theirs = variants["canzona"]["loss"], variants["layerwise"]["loss"]
            worst = max(abs(ours[i] - theirs[i]) / abs(theirs[i]) for i in set(ours) & set(theirs))
            result.details["canzona_vs_layerwise_loss"] = worst
            parts.append(f"canzona's losses within {worst:.1e} of layerwise's")
    syncs = {v: forward_backward_syncs(p) for v, p in profiles.items()}
    if syncs:
        result.details["forward_backward_host_syncs"] = syncs
        parts.append("host syncs in the profiled forward-backward: " + ", ".join(f"{v} {n}" for v, n in syncs.items()))
    result.summary = "; ".join(parts)


FORWARD_BACKWARD_OWNERS = ("model", "Megatron DDP", "Canzona hooks")
"""The owners whose work runs in forward-backward (canzona_patches/integration/profile.py)."""


def forward_backward_syncs(profile: dict[str, Any]) -> int:
    """Host synchronisations the profiled iteration made outside the optimizer step and the
    timers: what Canzona must not add to Megatron's own (the GPU's form of the CPU test
    tests/multirank/test_host_syncs.py)."""
    return sum(profile["owners"][owner]["host_syncs"] for owner in FORWARD_BACKWARD_OWNERS)


OVERLAP_WORK = ("ns", "prep")
"""What ``tools/bench_overlap.py`` puts on the side stream, each in turn: Newton-Schulz, and the holders'
work on their pieces under Megatron-FSDP."""


def overlap_commands(ctx: Context) -> list[list[str]]:
    return [[ctx.python, "tools/bench_overlap.py", "--work", work, "--json", str(ctx.out / f"overlap_{work}.json")]
            for work in OVERLAP_WORK]


def step_overlap(ctx: Context, result: Result) -> None:
    """Newton-Schulz on a side stream beside a GEMM load: what early compute would cost beside backward
    (why it runs only after backward); then the holders' work on each bucket's pieces under
    Megatron-FSDP, which does run beside backward, against what the projection prices it at."""
    for work, command in zip(OVERLAP_WORK, overlap_commands(ctx)):
        ctx.run(f"overlap_{work}", command, result)
    result.details = {work: json.loads((ctx.out / f"overlap_{work}.json").read_text()) for work in OVERLAP_WORK}
    ns, prep = result.details["ns"], result.details["prep"]
    result.summary = (f"Newton-Schulz {tuple(ns['shape'])} x{ns['stack']} {ns['side_ms']:.1f} ms beside {ns['gemm_ms']:.1f} ms "
                      f"of bf16 products: {100 * ns['hidden']:.0f}% hidden, the products {ns['load_slowdown']:.2f}x as long; "
                      f"the holders' work on {prep['buckets']} buckets {prep['side_ms']:.2f} ms (priced "
                      f"{prep['priced_ms']:.2f}): {100 * prep['hidden']:.0f}% hidden, the products "
                      f"{prep['load_slowdown']:.2f}x as long")


def skipped_commands(ctx: Context, name: str) -> list[str]:
    """What a step without a CPU form would run (recorded when it is skipped)."""
    commands = {"cuda_tests": [(cuda_tests_command(ctx), {})], "overlap": [(c, {}) for c in overlap_commands(ctx)],
                "tp2dp2": [demo_command(ctx, f"tp2dp2_{d}", cuda=d == "cuda") for d in ("cpu", "cuda")]}[name]
    return [(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(c)).strip()
            for c, env in commands]


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    needs_cuda: bool
    """Skipped without CUDA (a step that also has a CPU form runs that instead)."""
    cpu_form: bool
    run: Callable[[Context, Result], None]


STEPS = (
    Step("environment", "environment", False, True, step_environment),
    Step("one_gpu", f"one GPU, bf16, Qwen3-8B cut to {ONE_GPU_LAYERS} layers, paired rounds", True, True, step_one_gpu),
    Step("tp2dp2", "TP 2 x DP 2, CUDA tensors + gloo, against CPU", True, False, step_tp2dp2),
    Step("cuda_tests", "CUDA tests (`pytest -m gpu`)", True, False, step_cuda_tests),
    Step("bench", "Newton-Schulz, standard vs gram, bf16 (`tools/bench_optim.py`)", True, True, step_bench),
    Step("overlap", "Newton-Schulz, then the holders' work, on a side stream beside GEMMs (`tools/bench_overlap.py`)",
         True, False, step_overlap),
)
"""In the order they run: what answers the most first, so a short budget (``--budget``) drops the rest."""


# --- Report -----------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    env = report["steps"]["environment"]["details"]
    lines = [f"GPU check of {report['date']} on {env.get('device', '?')} (git {env.get('git', '?')}), "
             f"`{report['command']}`:", "", "| step | status | result | seconds |", "|---|---|---|---|"]
    for step in STEPS:
        r = report["steps"].get(step.name)
        if r is not None:
            kept = f" (run of {r['kept_from']})" if r.get("kept_from") else ""
            lines.append(f"| {step.title} | {r['status']}{kept} | {r['summary'] or '–'} | {r['seconds']:.0f} |")
    bench = report["steps"].get("bench", {}).get("details", {}).get("rows")
    if bench:
        lines += ["", "| model | matrix | shape | standard (ms) | gram (ms) | gram / standard | standard, of the bf16 matmul rate |",
                  "|---|---|---|---|---|---|---|"]
        for r in bench:
            gram = "–" if r["gram_ms"] is None else f"{r['gram_ms']:.3g}"
            ratio = "–" if r["gram_over_standard"] is None else f"{r['gram_over_standard']:.2f}"
            lines.append(f"| {r['model']} | {r['matrix']} | {r['shape']} | {r['standard_ms']:.3g} | {gram} | {ratio} "
                         f"| {100 * r['standard_fraction_of_matmul_rate']:.0f}% |")
    one_gpu = report["steps"].get("one_gpu", {}).get("details", {})
    variants = one_gpu.get("variants", {})
    lines += one_gpu_tables(one_gpu)
    timed = {v: r["timers_ms"] for v, r in variants.items() if r.get("timers_ms")}
    if timed:
        names = list(dict.fromkeys(name for timers in timed.values() for name in timers))
        lines += ["", "| Megatron timer, ms per iteration | " + " | ".join(timed) + " |", "|---" * (len(timed) + 1) + "|"]
        lines += [f"| {name} | " + " | ".join(f"{t[name]:.1f}" if name in t else "–" for t in timed.values()) + " |"
                  for name in names]
    return "\n".join(lines) + "\n"


def one_gpu_tables(one_gpu: dict[str, Any]) -> list[str]:
    """The paired rounds (medians, the spread of the rounds' medians, ratios to layer-wise
    Muon) and each variant's profiled iteration by owner."""
    variants = one_gpu.get("variants", {})
    if not variants:
        return []
    lines = ["", f"| variant | rounds | optimizer step, ms (median; rounds' medians) | iteration, ms (median; rounds' medians) |",
             "|---|---|---|---|"]
    for name, row in variants.items():
        cells = [f"{row[k]:.1f} ({', '.join(f'{x:.1f}' for x in row[k + '_rounds'])})" for k in ("optimizer_step_ms", "iteration_ms")]
        lines.append(f"| {name} | {row['rounds']} | " + " | ".join(cells) + " |")
    for pair, ratios in one_gpu.get("ratios", {}).items():
        lines.append(f"| {pair} | | {ratios['optimizer_step_ms']['median']:.3f} ({ratios['optimizer_step_ms']['min']:.3f}-"
                     f"{ratios['optimizer_step_ms']['max']:.3f}) | {ratios['iteration_ms']['median']:.3f} "
                     f"({ratios['iteration_ms']['min']:.3f}-{ratios['iteration_ms']['max']:.3f}) |")
    if any(row.get("forward_backward_ms_rounds") for row in variants.values()):
        lines += ["", "| variant | Megatron's forward-backward, ms (rounds) | early compute committed/recomputed/skipped/"
                  "not speculated (rounds) |", "|---|---|---|"]
        for name, row in variants.items():
            fb = ", ".join("–" if x is None else f"{x:.1f}" for x in row.get("forward_backward_ms_rounds", []))
            early = ", ".join("–" if e is None else "/".join(str(e[k]) for k in EARLY_OUTCOMES)
                              for e in row.get("early_compute_rounds", []))
            lines.append(f"| {name} | {fb} | {early} |")
    profiled = {name: row["profile"] for name, row in variants.items() if row.get("profile")}
    if profiled:
        owners = list(next(iter(profiled.values()))["owners"])
        lines += ["", "Profiled iteration (`--canzona-profile-iteration`; synchronised phases, Python stacks): "
                  "CPU / GPU ms by owner, host syncs", "",
                  "| owner | " + " | ".join(profiled) + " |", "|---" * (len(profiled) + 1) + "|"]
        for owner in owners:
            cells = [f"{p['owners'][owner]['cpu_ms']:.1f} / {p['owners'][owner]['gpu_ms']:.1f}, "
                     f"{p['owners'][owner]['host_syncs']}" for p in profiled.values()]
            lines.append(f"| {owner} | " + " | ".join(cells) + " |")
        lines.append("| GPU idle in forward-backward, ms | " + " | ".join(
            "–" if p["gpu_idle_in_forward_backward_ms"] is None else f"{p['gpu_idle_in_forward_backward_ms']:.1f}"
            for p in profiled.values()) + " |")
        lines.append("| forward-backward / step, ms | " + " | ".join(
            f"{p['phases_ms'].get('forward_backward', 0):.0f} / {p['phases_ms'].get('optimizer_step', 0):.0f}"
            for p in profiled.values()) + " |")
    return lines


LAST_RESULT = "## Last result\n"


def publish(table: str, report: dict[str, Any]) -> list[Path]:
    """``table`` in docs/gpu_check.md, in place of what its "Last result" section held, and the
    raw report beside it (docs/gpu_check.json)."""
    page = ROOT / "docs" / "gpu_check.md"
    text = page.read_text()
    page.write_text(text[:text.index(LAST_RESULT) + len(LAST_RESULT)] + "\n" + table)
    raw = ROOT / "docs" / "gpu_check.json"
    raw.write_text(json.dumps(report, indent=1) + "\n")
    return [page, raw]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--steps", nargs="+", choices=[s.name for s in STEPS], default=[s.name for s in STEPS])
    p.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-check", help="logs, gpu_check.json and gpu_check.md")
    p.add_argument("--timeout", type=positive, default=900.0, help="seconds each command may take")
    p.add_argument("--variants", nargs="+", choices=ALL_VARIANTS, default=list(ONE_GPU_VARIANTS),
                   help="the one_gpu step's recipe variants, run in this order in every round")
    p.add_argument("--once", nargs="*", choices=ALL_VARIANTS, default=list(ONCE_VARIANTS),
                   help="one_gpu: variants run once, after the rounds (default: the clip-idle pair, early compute "
                   "forced on and off, and early compute forced with the recipe's clip)")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="one_gpu: profile no iteration (by default, after the timed runs, one short run of each "
                   f"variant profiles its iteration {PROFILED_ITERATION})")
    p.add_argument("--rounds", type=at_least(1), default=ONE_GPU_ROUNDS, help="one_gpu: paired rounds of the variants")
    p.add_argument("--timed", type=at_least(1), default=ONE_GPU_TIMED, help="one_gpu: timed iterations per run, after the warm-up")
    p.add_argument("--budget", type=positive, default=None, metavar="SECONDS",
                   help="the whole check's time: one_gpu runs fewer rounds and later steps are skipped to end by then")
    p.add_argument("--merge", type=Path, nargs="+", metavar="OUT_DIR",
                   help="run nothing: report the one_gpu rounds that earlier runs left in these --out directories "
                        "as one paired set (the other steps from the first), e.g. after several short device calls")
    p.add_argument("--publish", action="store_true", help="with --merge: also write docs/gpu_check.md and .json")
    p.add_argument("--python", default=sys.executable, help="interpreter of the steps' commands (default: this one)")
    p.add_argument("--keep", type=Path, metavar="GPU_CHECK_JSON",
                   help="an earlier run's gpu_check.json: its steps that this run does not run are kept in the "
                        "report (marked with their date), so a short device session can finish what an earlier one began")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    return args


def merge_rounds(dirs: list[Path]) -> dict[str, Any]:
    """The report of ``dirs[0]`` (an earlier ``--out``) with its ``one_gpu`` step made of every
    round the runs in ``dirs`` left (``one_gpu_<variant>_r<k>/``), in order: rounds of the same
    code that several short device calls ran one after another, reported as one paired set."""
    reports = [json.loads((d / "gpu_check.json").read_text()) for d in dirs]
    report = reports[0]
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in ALL_VARIANTS}
    profiles: dict[str, Any] = {}
    for folder in dirs:
        for variant in ALL_VARIANTS:
            for metrics in sorted(folder.glob(f"one_gpu_{variant}_r*/metrics.jsonl"),
                                  key=lambda p: int(p.parent.name.rsplit("_r", 1)[1])):
                runs[variant].append(read_run(metrics.parent))
            profile = folder / f"profile_{variant}.json"
            if variant not in profiles and profile.is_file():
                profiles[variant] = json.loads(profile.read_text())
    steps = [r["steps"]["one_gpu"] for r in reports]
    result = Result(seconds=sum(step["seconds"] for step in steps), commands=[c for step in steps for c in step["commands"]])
    one_gpu_result({v: r for v, r in runs.items() if r}, profiles, steps[0]["details"].get("transformer_engine"), result)
    report["steps"]["one_gpu"] = vars(result)
    report["command"] += " (one_gpu: the rounds of " + ", ".join(r["command"] for r in reports) + ")"
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        report = merge_rounds(args.merge)
        table = markdown(report)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / "gpu_check.md").write_text(table)
        written = [args.out / "gpu_check.json", args.out / "gpu_check.md"] + (publish(table, report) if args.publish else [])
        print(table + "[gpu-check] wrote " + ", ".join(str(p) for p in written), flush=True)
        return 0
    cuda = torch.cuda.is_available()
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out=args.out, python=args.python, cuda=cuda, timeout_s=args.timeout, publish=cuda,
                  variants=tuple(args.variants), once=tuple(v for v in args.once if v not in args.variants),
                  rounds=args.rounds, timed=args.timed, profile=args.profile,
                  deadline=time.monotonic() + (args.budget if args.budget is not None else float("inf")))
    report: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "command": shlex.join(["tools/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
                              "cuda": cuda, "steps": {}}
    steps = [s for s in STEPS if s.name in args.steps or s.name == "environment"]
    ctx.reserve_s = sum(EXPECTED_S.get(s.name, 0.0) for s in steps)
    if args.keep:
        kept = json.loads(args.keep.read_text())
        for name, earlier in kept["steps"].items():
            if name not in {s.name for s in steps}:
                report["steps"][name] = {**earlier, "kept_from": earlier.get("kept_from", kept["date"])}
    failed = 0
    for number, step in enumerate(steps, start=1):
        result = Result()
        begin = time.perf_counter()
        if step.needs_cuda and not cuda and not step.cpu_form:
            result.status, result.summary = "skipped", "no CUDA device"
            result.commands = skipped_commands(ctx, step.name)
        elif step.name != "environment" and ctx.left_s() < MIN_STEP_S:
            result.status, result.summary = "skipped", f"out of the time budget (--budget {args.budget:.0f} s)"
        else:
            print(f"[gpu-check] {number}/{len(steps)} {step.title} ...", flush=True)
            try:
                step.run(ctx, result)
                if step.needs_cuda and not cuda:
                    result.status = "skipped"
                    result.summary = f"no CUDA device (its CPU form ran{': ' + result.summary if result.summary else ''})"
            except (RuntimeError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as error:
                result.status, result.summary = "failed", str(error).splitlines()[0][:300]
                failed += 1
        result.seconds = time.perf_counter() - begin
        report["steps"][step.name] = vars(result)
        print(f"[gpu-check] {step.name}: {result.status}: {result.summary}", flush=True)
        # after every step: a run stopped by its time limit keeps what it finished
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(report)
    (args.out / "gpu_check.md").write_text(table)
    written = [args.out / "gpu_check.json", args.out / "gpu_check.md"]
    if ctx.publish:
        written += publish(table, report)
    print("[gpu-check] wrote " + ", ".join(str(p) for p in written), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
