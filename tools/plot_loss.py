#!/usr/bin/env python
"""Plot training-loss curves from ``pretrain_gpt.py --canzona-metrics-file`` JSON lines.

    python tools/plot_loss.py runs/adam.jsonl --output loss.png
    python tools/plot_loss.py runs/adam.jsonl runs/muon.jsonl --label AdamW --label Muon \
        --output adam_vs_muon.png --title "qwen3-tiny, DP 4"

Each file is one run (one JSON object per log interval, with ``iteration`` and
``lm_loss``); several files are drawn on the same axes. A run's label is its ``--label``
(in file order) or else the file name without suffix. Lines without a loss (a rank that
logs no loss) are skipped. Prints each run's first and last logged loss.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LossCurve:
    """One run's logged losses."""

    label: str
    """Legend text."""
    iterations: list[int]
    """Iteration of each logged point, increasing."""
    losses: list[float]
    """Mean ``lm loss`` of the log interval ending at that iteration."""


def read_curve(path: Path, label: str | None = None) -> LossCurve:
    """Read a metrics file; raise ``ValueError`` if it holds no loss at all."""
    points: dict[int, float] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number} is not JSON ({error.msg}); pass files written by "
                             "pretrain_gpt.py --canzona-metrics-file") from error
        if record.get("lm_loss") is not None:
            # A restarted run appends again; its later lines win.
            points[int(record["iteration"])] = float(record["lm_loss"])
    if not points:
        raise ValueError(f"{path} has no lm_loss values; pass a file written by "
                         "pretrain_gpt.py --canzona-metrics-file")
    iterations = sorted(points)
    return LossCurve(label or path.stem, iterations, [points[i] for i in iterations])


def plot_curves(curves: list[LossCurve], output: Path, title: str | None = None) -> None:
    """Draw every curve (loss against iteration) into one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for curve in curves:
        axes.plot(curve.iterations, curve.losses, marker="o", markersize=2.5, linewidth=1.4,
                  label=curve.label)
    axes.set_xlabel("iteration")
    axes.set_ylabel("lm loss (mean over log interval)")
    axes.set_title(title or "training loss")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=120)
    plt.close(figure)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", type=Path, help="metrics files (JSON lines), one per run")
    parser.add_argument("--label", action="append", default=[],
                        help="legend label of the next file, in order (default: file name)")
    parser.add_argument("--output", type=Path, default=Path("loss.png"), help="PNG to write (default: loss.png)")
    parser.add_argument("--title", default=None, help="plot title")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the tool; return the exit status (2 with a one-line error for bad input)."""
    args = parse_args(argv)
    if len(args.label) > len(args.metrics):
        print(f"error: {len(args.label)} --label values for {len(args.metrics)} files; "
              "pass at most one --label per file", file=sys.stderr)
        return 2
    labels = args.label + [None] * (len(args.metrics) - len(args.label))
    try:
        missing = [str(p) for p in args.metrics if not p.is_file()]
        if missing:
            raise ValueError(f"no such metrics file: {', '.join(missing)}")
        curves = [read_curve(path, label) for path, label in zip(args.metrics, labels)]
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    plot_curves(curves, args.output, args.title)
    for curve in curves:
        print(f"{curve.label}: lm loss {curve.losses[0]:.3f} at iteration {curve.iterations[0]} -> "
              f"{curve.losses[-1]:.3f} at iteration {curve.iterations[-1]}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
