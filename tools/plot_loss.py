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
import sys
from pathlib import Path

from megatron.canzona.cli import ArgumentParser
from megatron.canzona.curves import plot_curves, read_curve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
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
