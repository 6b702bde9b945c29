#!/usr/bin/env python
"""Train the demo's qwen3-tiny with AdamW, Muon, NorMuon, Shampoo and SOAP on the same tokens; compare.

    python tools/compare_optimizers.py                     # the four runs (`make compare`)
    python tools/compare_optimizers.py --iters 40 --runs adam muon --output /tmp/quick.png
    python tools/compare_optimizers.py --no-train          # re-plot and re-tabulate the last runs

Every run is ``examples/qwen3/pretrain_qwen3_tiny_cpu.sh`` (the model, data, batch, schedule
and TP 1 x DP 4 on 4 gloo processes of ``make demo``), so the runs see the same batches in
the same order and differ only in the optimizer of the matrices; embeddings, output layer
and vectors take AdamW in every run. All use one learning rate, 3e-3 (the demo's), with
20 warm-up iterations and a cosine decay to 3e-4:

* ``adam``: Megatron's distributed AdamW (beta2 0.95, weight decay 0.1);
* ``muon``: ``--canzona`` Muon scaled by 0.2 sqrt(max(m, n)) (``--muon-scale-mode spectral
  --muon-extra-scale-factor 0.2``, the recipes' setting): the update's RMS is then about
  AdamW's (typically 0.2 to 0.4), so AdamW's learning rate and weight decay carry over;
  with Megatron's default factor 1 the update's RMS is about 1, several times AdamW's step
  at the same ``--lr``;
* ``shampoo``: ``--canzona`` Shampoo grafted to Adam's per-matrix update norm, which is why
  it takes Adam's learning rate;
* ``soap``: ``--canzona`` SOAP, Adam in Shampoo's eigenbasis, again Adam's learning rate;
* ``normuon``: ``--optimizer adaptive_muon --adaptive-muon-moment2-method normuon``, Muon's scale;
* ``muon_per_head``: Muon with ``--canzona-split-qkv-per-head`` (every head's query, key and value
  block its own matrix; ``muon`` splits Q, K and V only);
* ``muon_qk_clip``: Muon with ``--qk-clip --qk-clip-threshold 3``, under the demo's largest logits
  (3.6-3.8 in its first 30 iterations), so the clip acts; the demo's Qwen3 has QK norms, which
  undo the scaling in the forward, so only the weights' scale and their gradients change;
* ``muon_gram``: Muon with ``--muon-ns-method gram``, and ``muon_seed``: Muon with another
  ``--seed`` (other initial weights, other data order), the run-to-run noise gram's gap to
  Muon is held against (the runs are otherwise deterministic).

Shampoo's and SOAP's other hyperparameters are the flags' defaults. Validation loss is
Megatron's, every ``--eval-interval`` iterations over ``--eval-iters`` batches (20 batches
of 16 cover about the whole validation split); it is read from each run's log. Training
loss and time per iteration come from ``--canzona-metrics-file``; the time axis is
Megatron's training time (evaluation excluded, start-up excluded).

Writes ``OUT_DIR/<run>/{train.log,metrics.jsonl,console.txt,run.json}``, the figure (``--output``) and
``OUT_DIR/summary.json`` (configuration, git revision, machine, results), and prints a
Markdown table with each run's final losses and times, and ratios to AdamW.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron.canzona.cli import ArgumentParser, at_least
from megatron.canzona.curves import LossCurve, read_curve, save_figure
from megatron.canzona.provenance import git_revision, machine

ROOT = Path(__file__).resolve().parents[1]

DEMO_SCRIPT = ROOT / "examples" / "qwen3" / "pretrain_qwen3_tiny_cpu.sh"
LEARNING_RATE_TEXT = "3e-3"
LEARNING_RATE = float(LEARNING_RATE_TEXT)
"""One learning rate for every run: the demo's; see the module docstring for why it fits all four."""
GLOBAL_BATCH, SEQ_LENGTH = 16, 128
"""The demo script's ``--global-batch-size`` and ``--seq-length`` (for the token count)."""

VALIDATION_LINE = re.compile(r"validation loss at iteration\s+(\d+)\s*\|\s*lm loss value:\s*([-+0-9.eEnaif]+)")
"""Megatron's evaluation line during training; the end-of-training lines ("at iteration N on
validation set", "... on test set") do not match, as the number is followed by text."""


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One optimizer's run of the demo script."""

    label: str
    """Legend and table name."""
    optimizer: str
    """``--optimizer`` (the script's ``OPTIMIZER``)."""
    canzona: bool
    """Pass ``--canzona`` (the script's ``CANZONA=1``)."""
    flags: tuple[str, ...] = ()
    """Flags of this run besides the shared ones."""


RUNS: dict[str, RunSpec] = {
    "adam": RunSpec(label="AdamW", optimizer="adam", canzona=False),
    "muon": RunSpec(label="Muon", optimizer="muon", canzona=True,
                    flags=("--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "0.2")),
    "muon_gram": RunSpec(label="Muon, gram Newton-Schulz", optimizer="muon", canzona=True,
                         flags=("--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "0.2",
                                "--muon-ns-method", "gram")),
    "muon_seed": RunSpec(label="Muon, seed 1235", optimizer="muon", canzona=True,
                         flags=("--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "0.2", "--seed", "1235")),
    "muon_per_head": RunSpec(label="Muon, per-head Q/K/V", optimizer="muon", canzona=True,
                             flags=("--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "0.2",
                                    "--canzona-split-qkv-per-head")),
    "normuon": RunSpec(label="NorMuon", optimizer="adaptive_muon", canzona=True,
                       flags=("--adaptive-muon-moment2-method", "normuon", "--muon-scale-mode", "spectral",
                              "--muon-extra-scale-factor", "0.2")),
    "muon_qk_clip": RunSpec(label="Muon, QK-clip at 3", optimizer="muon", canzona=True,
                            flags=("--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "0.2",
                                   "--qk-clip", "--qk-clip-threshold", "3")),
    "shampoo": RunSpec(label="Shampoo", optimizer="shampoo", canzona=True),
    "soap": RunSpec(label="SOAP", optimizer="soap", canzona=True),
}
"""The compared runs, in plotting order. To add one, add an entry; its key names its directory."""


@dataclass(frozen=True)
class RunResult:
    """What one finished run logged."""

    name: str
    """Key in :data:`RUNS` (the run's directory name)."""
    label: str
    """Legend and table name."""
    train: LossCurve
    """Training loss per log interval (``tools/plot_loss.py``'s reading of the metrics file)."""
    train_seconds: list[float]
    """Training seconds elapsed at each of ``train.iterations``."""
    valid_iterations: list[int]
    """Iterations with a validation loss, increasing."""
    valid_losses: list[float]
    """Validation loss at each of ``valid_iterations``."""
    optimizer_step_ms: float
    """Mean time of one ``optimizer.step()`` (slowest rank), over the logged iterations."""
    wall_s: float | None
    """Seconds the whole run took (start-up, training, evaluation), if it was timed."""

    def valid_seconds(self) -> list[float]:
        """Training seconds elapsed at each validation point (interpolated between log points)."""
        return [interpolate(self.train.iterations, self.train_seconds, i) for i in self.valid_iterations]


def interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through ``(0, 0)`` and the points; held flat past the last."""
    previous_x, previous_y = 0, 0.0
    for point_x, point_y in zip(xs, ys):
        if x <= point_x:
            share = (x - previous_x) / (point_x - previous_x) if point_x > previous_x else 1.0
            return previous_y + share * (point_y - previous_y)
        previous_x, previous_y = point_x, point_y
    return previous_y


# --- Reading a run --------------------------------------------------------------------------


def read_validation(log_path: Path) -> dict[int, float]:
    """Validation losses by iteration from a training log; a later line for the same iteration wins."""
    losses: dict[int, float] = {}
    for match in VALIDATION_LINE.finditer(log_path.read_text(errors="replace")):
        losses[int(match.group(1))] = float(match.group(2))
    return losses


def read_timing(metrics_path: Path) -> tuple[dict[int, float], float]:
    """Training seconds elapsed at each logged iteration, and the mean optimizer-step time (ms).

    Each line's ``iteration_ms`` averages the iterations since the last line that reset the
    interval sums. Every line resets except a run's first line when it falls off the log
    interval (Megatron prints iteration 1 without resetting), so the line after it covers
    iterations from the start again.
    """
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("iteration_ms") is not None]
    if not records:
        raise ValueError(f"{metrics_path} has no iteration_ms values; pass a file written by "
                         "pretrain_gpt.py --canzona-metrics-file")
    iterations = [int(r["iteration"]) for r in records]
    log_interval = math.gcd(*iterations[1:]) if len(iterations) > 1 else iterations[0]
    elapsed: dict[int, float] = {}
    start, start_seconds = 0, 0.0
    step_ms = step_iterations = 0.0
    for index, (iteration, record) in enumerate(zip(iterations, records)):
        seconds = start_seconds + record["iteration_ms"] * (iteration - start) / 1000.0
        elapsed[iteration] = seconds
        if index > 0 or iteration % log_interval == 0:
            covered = iteration - start
            step_ms += record.get("optimizer_step_ms", 0.0) * covered
            step_iterations += covered
            start, start_seconds = iteration, seconds
    return elapsed, step_ms / step_iterations if step_iterations else float("nan")


def read_run(name: str, run_dir: Path, label: str | None = None) -> RunResult:
    """Read ``run_dir``'s ``metrics.jsonl``, ``train.log`` and (if present) ``run.json``."""
    metrics, log = run_dir / "metrics.jsonl", run_dir / "train.log"
    missing = [str(p) for p in (metrics, log) if not p.is_file()]
    if missing:
        raise ValueError(f"run {name!r} has no {', '.join(missing)}; train it first (drop --no-train)")
    train = read_curve(metrics, label or name)
    elapsed, step_ms = read_timing(metrics)
    validation = read_validation(log)
    if not validation:
        raise ValueError(f"{log} has no 'validation loss at iteration N' lines; train with --eval-interval")
    info_path = run_dir / "run.json"
    wall_s = json.loads(info_path.read_text()).get("wall_s") if info_path.is_file() else None
    valid_iterations = sorted(validation)
    return RunResult(
        name=name, label=train.label,
        train=train, train_seconds=[elapsed.get(i, math.nan) for i in train.iterations],
        valid_iterations=valid_iterations, valid_losses=[validation[i] for i in valid_iterations],
        optimizer_step_ms=step_ms, wall_s=wall_s,
    )


# --- Running --------------------------------------------------------------------------------


def run_command(spec: RunSpec, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The demo script's command line and environment for one run."""
    env = {
        "PYTHON": sys.executable, "OPTIMIZER": spec.optimizer, "CANZONA": "1" if spec.canzona else "0",
        "ITERS": str(args.iters), "TP": "1", "NPROC": "4", "MASTER_PORT": str(args.master_port),
    }
    flags = [
        "--lr", LEARNING_RATE_TEXT,
        "--eval-interval", str(args.eval_interval), "--eval-iters", str(args.eval_iters),
        "--log-interval", str(args.log_interval),
        # One index cache for all runs: the runs read the same samples.
        "--data-cache-path", str(args.out_dir / "cache"),
        *spec.flags,
    ]
    return ["bash", str(DEMO_SCRIPT), *flags], env


def train(name: str, spec: RunSpec, args: argparse.Namespace) -> None:
    """Run one optimizer through the demo script; raise ``RuntimeError`` if it fails."""
    run_dir = args.out_dir / name
    run_dir.mkdir(parents=True, exist_ok=True)
    command, env = run_command(spec, args)
    env["OUT_DIR"] = str(run_dir)
    begin = time.perf_counter()
    with (run_dir / "console.txt").open("w") as console:
        status = subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, stdout=console,
                                stderr=subprocess.STDOUT).returncode
    wall_s = time.perf_counter() - begin
    shown = " ".join(f"{k}={v}" for k, v in env.items() if k != "PYTHON") + " " + " ".join(command[1:])
    (run_dir / "run.json").write_text(json.dumps({"wall_s": wall_s, "command": shown}, indent=1) + "\n")
    if status != 0:
        raise RuntimeError(f"run {name!r} failed (exit {status}); see {run_dir / 'train.log'}")


# --- Reporting ------------------------------------------------------------------------------


def plot_runs(results: list[RunResult], output: Path, title: str) -> None:
    """2 x 2 figure: training (top) and validation (bottom) loss against iteration (left) and
    training time (right)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey="row")
    for result in results:
        valid_seconds = result.valid_seconds()
        axes[0][0].plot(result.train.iterations, result.train.losses, linewidth=1.2, label=result.label)
        axes[0][1].plot(result.train_seconds, result.train.losses, linewidth=1.2, label=result.label)
        axes[1][0].plot(result.valid_iterations, result.valid_losses, marker="o", markersize=3, label=result.label)
        axes[1][1].plot(valid_seconds, result.valid_losses, marker="o", markersize=3, label=result.label)
    top = _zoom_top(results)
    for row, name in enumerate(("training loss (mean over log interval)", "validation loss")):
        axes[row][0].set_ylabel(name)
        axes[row][0].set_ylim(top=top)
    for column, name in enumerate(("iteration", "training time (s, evaluation excluded)")):
        axes[1][column].set_xlabel(name)
    for axis in axes.flat:
        axis.grid(True, alpha=0.3)
    axes[0][0].legend()
    figure.suptitle(title)
    save_figure(figure, output, dpi=100)


def _zoom_top(results: list[RunResult]) -> float:
    """Upper y limit that leaves out the first tenth of training, where every run starts at
    ln(vocabulary) and the differences are not visible."""
    last = max(r.train.iterations[-1] for r in results)
    late = [loss for r in results for i, loss in zip(r.train.iterations, r.train.losses) if i >= last / 10]
    late += [loss for r in results for i, loss in zip(r.valid_iterations, r.valid_losses) if i >= last / 10]
    return max(late) + 0.1 if late else max(max(r.train.losses) for r in results)


def summarize(results: list[RunResult]) -> list[dict[str, float | str | int | None]]:
    """One row per run: final losses, times, and ratios to the first run (AdamW)."""
    rows = []
    base = results[0]
    target = base.valid_losses[-1]
    for result in results:
        seconds = result.train_seconds[-1]
        reached = [i for i, loss in zip(result.valid_iterations, result.valid_losses) if loss <= target]
        rows.append({
            "run": result.name, "optimizer": result.label,
            "iterations": result.train.iterations[-1],
            "final_valid_loss": result.valid_losses[-1], "valid_iteration": result.valid_iterations[-1],
            "best_valid_loss": min(result.valid_losses),
            # The first validation at or below the first run's final one, same schedule.
            "reaches_first_final_at": reached[0] if reached else None,
            "final_train_loss": result.train.losses[-1],
            "train_s": seconds, "train_s_vs_first": seconds / base.train_seconds[-1],
            "optimizer_step_ms": result.optimizer_step_ms, "wall_s": result.wall_s,
        })
    return rows


def markdown_table(rows: list[dict], lr: str = LEARNING_RATE_TEXT) -> str:
    """The summary rows as a Markdown table (ratios against the first row)."""
    first = rows[0]["optimizer"]
    lines = [
        f"| optimizer | lr | final validation loss | {first}'s final reached at | final training loss "
        f"| training time (s) | time vs {first} | optimizer step (ms) | run wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        wall = "–" if row["wall_s"] is None else f"{row['wall_s']:.0f}"
        reached = "–" if row["reaches_first_final_at"] is None else f"iteration {row['reaches_first_final_at']}"
        lines.append(
            f"| {row['optimizer']} | {lr} | {row['final_valid_loss']:.3f} (iteration {row['valid_iteration']}) "
            f"| {reached} | {row['final_train_loss']:.3f} | {row['train_s']:.1f} | {row['train_s_vs_first']:.2f}x "
            f"| {row['optimizer_step_ms']:.1f} | {wall} |"
        )
    return "\n".join(lines)


def curve_gap(a: RunResult, b: RunResult) -> dict[str, float]:
    """How far apart two runs' validation curves are: the mean and largest absolute
    difference over the evaluations both made, and the difference of the final ones."""
    b_losses = dict(zip(b.valid_iterations, b.valid_losses))
    gaps = [abs(loss - b_losses[i]) for i, loss in zip(a.valid_iterations, a.valid_losses) if i in b_losses]
    return {"mean_abs": sum(gaps) / len(gaps), "max_abs": max(gaps), "final": a.valid_losses[-1] - b.valid_losses[-1]}


NOISE_PAIRS = (("muon_gram", "muon"), ("muon_seed", "muon"))
"""Pairs whose curve gap is printed: gram against standard Newton-Schulz, and the run-to-run
noise it is held against (the same Muon run with another seed, so other initial weights and
another data order; the runs are otherwise deterministic)."""


def noise_lines(results: list[RunResult]) -> list[str]:
    """One line per pair of :data:`NOISE_PAIRS` that ran: the validation curves' gap."""
    by_name = {r.name: r for r in results}
    lines = []
    for a, b in NOISE_PAIRS:
        if a in by_name and b in by_name:
            gap = curve_gap(by_name[a], by_name[b])
            lines.append(f"{by_name[a].label} against {by_name[b].label}: validation loss differs by "
                         f"{gap['mean_abs']:.4f} on average (at most {gap['max_abs']:.4f}) over the evaluations, "
                         f"{gap['final']:+.4f} at the end")
    return lines


def load_average() -> float | None:
    """The 1-minute load average (other jobs on a shared machine slow every run down)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


# --- Command line ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS),
                        help="which optimizers, in this order (default: all; the first is the ratios' base)")
    parser.add_argument("--iters", type=at_least(1), default=360,
                        help="training iterations of every run (default 360: about one pass over the training split)")
    parser.add_argument("--eval-interval", type=at_least(1), default=20, help="iterations between validations")
    parser.add_argument("--eval-iters", type=at_least(0), default=20, help="batches per validation")
    parser.add_argument("--log-interval", type=at_least(1), default=5, help="iterations per training-loss point")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "build" / "compare", help="runs' directory")
    parser.add_argument("--output", type=Path, default=None, help="PNG (default: OUT_DIR/compare_optimizers.png)")
    parser.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", 29517)),
                        help="torchrun's port (default: $MASTER_PORT or 29517)")
    parser.add_argument("--no-train", action="store_true", help="only read the runs in OUT_DIR, plot, tabulate")
    args = parser.parse_args(argv)
    if args.iters <= 20:
        parser.error(f"--iters {args.iters}: the demo warms up for 20 iterations; pass more than 20")
    args.out_dir = args.out_dir.resolve()
    args.output = args.output or args.out_dir / "compare_optimizers.png"
    return args


def main(argv: list[str] | None = None) -> int:
    """Train (unless ``--no-train``), plot, print the table; 2 with a one-line error on failure."""
    args = parse_args(argv)
    begin, load_at_start = time.perf_counter(), load_average()
    results = []
    try:
        for number, name in enumerate(args.runs, start=1):
            if not args.no_train:
                print(f"[{number}/{len(args.runs)}] {RUNS[name].label}: {args.iters} iterations ...", flush=True)
                train(name, RUNS[name], args)
            results.append(read_run(name, args.out_dir / name, RUNS[name].label))
            print(f"      validation loss {results[-1].valid_losses[-1]:.3f} at iteration "
                  f"{results[-1].valid_iterations[-1]}, training {results[-1].train_seconds[-1]:.0f} s", flush=True)
    except (RuntimeError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    tokens = args.iters * GLOBAL_BATCH * SEQ_LENGTH
    title = (f"qwen3-tiny on the demo corpus: {args.iters} iterations, {tokens / 1e3:.0f}k tokens, "
             f"lr {LEARNING_RATE_TEXT}, TP 1 x DP 4 on CPU")
    plot_runs(results, args.output, title)
    rows = summarize(results)
    summary = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "learning_rate": LEARNING_RATE, "tokens": tokens, "machine": {**machine(), "git_revision": git_revision(), "cpu_count": os.cpu_count()},
               "runs": {name: asdict(RUNS[name]) for name in args.runs}, "results": rows, "gaps": noise_lines(results),
               "total_s": None if args.no_train else time.perf_counter() - begin,
               "load_average": {"start": load_at_start, "end": load_average()}}
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print()
    print(markdown_table(rows))
    print()
    for line in noise_lines(results):
        print(line)
    if summary["total_s"] is not None:
        loads = " to ".join("?" if load is None else f"{load:.1f}" for load in summary["load_average"].values())
        print(f"total wall time: {summary['total_s']:.0f} s on {os.cpu_count()} CPUs "
              f"(1-minute load average {loads} from start to end)")
    print(f"wrote {args.output} and {args.out_dir / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
