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
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron.canzona.curves import read_curve
from megatron.canzona.provenance import ROOT as ROOT_DIR
from megatron.canzona.provenance import git_revision, machine

ROOT = Path(ROOT_DIR)
CPU_DEMO = ROOT / "examples" / "qwen3" / "pretrain_qwen3_tiny_cpu.sh"
RECIPE_8B = ROOT / "examples" / "qwen3" / "pretrain_qwen3_8b.sh"
DEMO_DATA = ROOT / "data" / "demo"
BENCH_MODELS = ("qwen3-1.7b", "qwen3-8b", "qwen3-14b", "qwen3-32b")
ONE_GPU_VARIANTS = ("adamw", "layerwise", "canzona")
ONE_GPU_LAYERS = 4
"""Layers of the cut Qwen3-8B: its matrices are the full model's, a ninth of them."""
TP2DP2_ITERS = 10
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


TP2DP2_PROBES = (
    ("tp2dp2_cuda_late", "--canzona-no-early-gather", {}, ["--canzona-no-early-gather"]),
    ("tp2dp2_cuda_lean", "--canzona-layout lean (equal shards)", {}, ["--canzona-layout", "lean"]),
    ("tp2dp2_cuda_sync", "--canzona-tp-mode sync", {}, ["--canzona-tp-mode", "sync"]),
    ("tp2dp2_cuda_layerwise", "Megatron's layer-wise Muon", {"CANZONA": "0"}, []),
    ("tp2dp2_cuda_adamw", "AdamW", {"OPTIMIZER": "adam", "CANZONA": "0"}, []),
)
"""Run only when the CUDA run fails, as (name, what, environment, flags): the same job with less
of Canzona in it, which tells where it broke without another device session."""


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


def step_tp2dp2(ctx: Context, result: Result) -> None:
    cpu = demo_run(ctx, "tp2dp2_cpu", result, cuda=False)
    try:
        gpu = demo_run(ctx, "tp2dp2_cuda", result, cuda=True)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        probes = {}
        for name, what, env_extra, flags in TP2DP2_PROBES:
            try:
                demo_run(ctx, name, result, cuda=True, env_extra=env_extra, flags=flags)
                probes[what] = "ran"
            except (RuntimeError, subprocess.TimeoutExpired) as probe_error:
                probes[what] = "failed: " + str(probe_error).splitlines()[0][:200]
        result.details["probes"] = probes
        raise RuntimeError(f"{str(error).splitlines()[0]}; with less of Canzona: "
                           + "; ".join(f"{what} {outcome.split(':')[0]}" for what, outcome in probes.items())) from error
    common = sorted(set(cpu) & set(gpu))
    if not common:
        raise RuntimeError("the CPU and CUDA runs logged no common iteration")
    worst = max(abs(gpu[i] - cpu[i]) / abs(cpu[i]) for i in common)
    result.details = {"iterations": common, "cpu": [cpu[i] for i in common], "cuda": [gpu[i] for i in common],
                      "max_relative_difference": worst, "tolerance": LOSS_RTOL}
    if worst > LOSS_RTOL:
        raise RuntimeError(f"CUDA and CPU losses differ by {worst:.2e} (relative), more than {LOSS_RTOL:.0e}")
    result.summary = f"{len(common)} iterations, losses within {worst:.1e} of the CPU run's (allowed {LOSS_RTOL:.0e})"


def one_gpu_env(ctx: Context, variant: str) -> dict[str, str]:
    return {"PYTHON": ctx.python, "VARIANT": variant, "NPROC_PER_NODE": "1", "TP": "1", "PRECISION": "bf16",
            "SEQ_LENGTH": "2048", "GLOBAL_BATCH": "8", "MICRO_BATCH": "1", "TRAIN_ITERS": "20", "WARMUP_ITERS": "2",
            "LOG_INTERVAL": "5", "EVAL_INTERVAL": "1000", "EVAL_ITERS": "1", "CKPT_DIR": "none",
            "TOKENIZER_TYPE": "SentencePieceTokenizer", "TOKENIZER_MODEL": str(DEMO_DATA / "tokenizer.model"),
            "DATA_PATH": str(DEMO_DATA / "demo_text_document"), "LOG_DIR": str(ctx.out / f"one_gpu_{variant}"),
            "MASTER_PORT": "29563"}


def step_one_gpu(ctx: Context, result: Result) -> None:
    te = transformer_engine()
    # Megatron's level-1 timers (one barrier each on one GPU) say where an iteration's time goes
    extra = ["--num-layers", str(ONE_GPU_LAYERS), "--transformer-impl", "transformer_engine" if te else "local",
             "--timing-log-level", "1"]
    rows = {}
    for variant in ctx.variants:
        env = one_gpu_env(ctx, variant)
        if not ctx.cuda:  # the recipe's command only
            ctx.run(f"one_gpu_{variant}", ["bash", str(RECIPE_8B), *extra], result, env={**env, "DRY_RUN": "1"})
            continue
        if not (DEMO_DATA / "demo_text_document.idx").is_file():
            ctx.run("demo_data", [ctx.python, "tools/prepare_demo_data.py", "--output-dir", str(DEMO_DATA)], result)
        ctx.run(f"one_gpu_{variant}", ["bash", str(RECIPE_8B), *extra], result, env=env)
        rows[variant] = {**one_gpu_row(Path(env["LOG_DIR"]) / "metrics.jsonl"),
                         "timers_ms": megatron_timers(ctx.out / f"one_gpu_{variant}.log")}
    one_gpu_result(rows, te, result)


def one_gpu_row(metrics: Path) -> dict[str, Any]:
    """One variant's optimizer step and iteration time (the mean of the logged intervals of the
    run's second half, after warm-up) and its loss by iteration."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    late = records[len(records) // 2:]
    return {"optimizer_step_ms": sum(r["optimizer_step_ms"] for r in late) / len(late),
            "iteration_ms": sum(r["iteration_ms"] for r in late) / len(late),
            "loss": read_losses(metrics)}


TIMER_LINE = re.compile(r"^\s+([\w-]+) \.*: \(?([\d.]+)(?:, ([\d.]+)\))?\s*$")


def megatron_timers(log: Path) -> dict[str, float]:
    """The last timer report in a Megatron log (``--timing-log-level``): milliseconds per
    iteration by timer, the slowest rank's."""
    timers: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        if "time across ranks (ms):" in line:
            timers = {}
        elif (found := TIMER_LINE.match(line)) is not None:
            timers[found.group(1)] = float(found.group(3) or found.group(2))
    return timers


def one_gpu_result(rows: dict[str, dict[str, Any]], te: str | None, result: Result) -> None:
    """The step's details and summary from its variants' rows; Canzona's and Megatron's
    layer-wise Muon compute the same updates, so their losses are compared too."""
    result.details = {"layers": ONE_GPU_LAYERS, "transformer_engine": te, "variants": rows}
    parts = [f"{v}: step {r['optimizer_step_ms']:.1f} ms, iteration {r['iteration_ms']:.0f} ms" for v, r in rows.items()]
    if {"canzona", "layerwise"} <= set(rows):
        ours, theirs = rows["canzona"]["loss"], rows["layerwise"]["loss"]
        worst = max(abs(ours[i] - theirs[i]) / abs(theirs[i]) for i in set(ours) & set(theirs))
        result.details["canzona_vs_layerwise_loss"] = worst
        parts.append(f"canzona's losses within {worst:.1e} of layerwise's")
    result.summary = "; ".join(parts)


def skipped_commands(ctx: Context, name: str) -> list[str]:
    """What a step without a CPU form would run (recorded when it is skipped)."""
    commands = {"cuda_tests": [(cuda_tests_command(ctx), {})],
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
    Step("cuda_tests", "CUDA tests (`pytest -m gpu`)", True, False, step_cuda_tests),
    Step("bench", "Newton-Schulz, standard vs gram, bf16 (`tools/bench_optim.py`)", True, True, step_bench),
    Step("one_gpu", f"one GPU, bf16, Qwen3-8B cut to {ONE_GPU_LAYERS} layers", True, True, step_one_gpu),
    Step("tp2dp2", "TP 2 x DP 2, CUDA tensors + gloo, against CPU", True, False, step_tp2dp2),
)


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
    variants = report["steps"].get("one_gpu", {}).get("details", {}).get("variants", {})
    timed = {v: r["timers_ms"] for v, r in variants.items() if r.get("timers_ms")}
    if timed:
        names = list(dict.fromkeys(name for timers in timed.values() for name in timers))
        lines += ["", "| Megatron timer, ms per iteration | " + " | ".join(timed) + " |", "|---" * (len(timed) + 1) + "|"]
        lines += [f"| {name} | " + " | ".join(f"{t[name]:.1f}" if name in t else "–" for t in timed.values()) + " |"
                  for name in names]
    return "\n".join(lines) + "\n"


LAST_RESULT = "## Last result\n"


def publish(table: str) -> Path:
    """``table`` in docs/gpu_check.md, in place of what its "Last result" section held."""
    page = ROOT / "docs" / "gpu_check.md"
    text = page.read_text()
    page.write_text(text[:text.index(LAST_RESULT) + len(LAST_RESULT)] + "\n" + table)
    return page


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--steps", nargs="+", choices=[s.name for s in STEPS], default=[s.name for s in STEPS])
    p.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-check", help="logs, gpu_check.json and gpu_check.md")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each command may take")
    p.add_argument("--variants", nargs="+", choices=ONE_GPU_VARIANTS, default=list(ONE_GPU_VARIANTS),
                   help="the one_gpu step's recipe variants, run in this order")
    p.add_argument("--python", default=sys.executable, help="interpreter of the steps' commands (default: this one)")
    p.add_argument("--keep", type=Path, metavar="GPU_CHECK_JSON",
                   help="an earlier run's gpu_check.json: its steps that this run does not run are kept in the "
                        "report (marked with their date), so a short device session can finish what an earlier one began")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out=args.out, python=args.python, cuda=cuda, timeout_s=args.timeout, publish=cuda,
                  variants=tuple(args.variants))
    report: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "command": shlex.join(["tools/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
                              "cuda": cuda, "steps": {}}
    steps = [s for s in STEPS if s.name in args.steps or s.name == "environment"]
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
        written.append(publish(table))
    print("[gpu-check] wrote " + ", ".join(str(p) for p in written), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
