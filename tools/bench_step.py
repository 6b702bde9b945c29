#!/usr/bin/env python
"""Optimizer-step time of Canzona against synchronous compute and Megatron's layer-wise Muon.

    python tools/bench_step.py                          # DP 2 on gloo, one thread per rank
    python tools/bench_step.py --dp 4 --layers 4 --hidden 512 --steps 8 --rounds 4 --json step.json

Every variant trains the same Qwen3-like GPT (QK-norm, SwiGLU, GQA) with Megatron-Core's
DDP on gloo, one process and one torch thread per DP rank, and times ``optimizer.step()``
(after a barrier) on every rank; a step's time is the slowest rank's. Variants:

* ``canzona`` -- ``--optimizer muon --canzona``: α-balanced layout, each rank runs Muon on
  the matrices it owns, then the stock parameter all-gather;
* ``sync`` -- synchronous compute: gradients all-reduced, every rank runs Muon on every
  matrix (the same math, no distributed optimizer);
* ``megatron`` -- Megatron-Core's own ``LayerWiseDistributedOptimizer`` Muon configured to
  the same math (fp32 Newton-Schulz, quintic coefficients, spectral scale, split QKV).

Prints the median step time of each variant, the ratios to ``sync`` and the ideal
``1/DP``, and a JSON object (``--json FILE`` to also write it). Ratios from one run only:
the machine is shared and absolute times drift between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.canzona.runtime import LaunchConfig, launch  # noqa: E402
from tests.multirank.tiny_gpt import TinyRun, train_tiny_gpts  # noqa: E402

VARIANTS = {"canzona": "muon", "sync": "sync_muon", "megatron": "megatron_muon"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks (processes)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers")
    parser.add_argument("--hidden", type=int, default=384, help="hidden size (4 heads, 2 query groups)")
    parser.add_argument("--ffn-hidden", type=int, default=None, help="SwiGLU size (default: 8/3 hidden)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="variants run in turn this many times, so load drift hits them alike")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a hung launch fails")
    parser.add_argument("--json", metavar="FILE", help="also write the JSON result here")
    args = parser.parse_args(argv)
    if args.dp < 1:
        parser.error(f"--dp {args.dp} must be at least 1")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1 and --warmup at least 0")
    if args.hidden % 4:
        parser.error(f"--hidden {args.hidden} must be a multiple of the 4 attention heads")
    args.ffn_hidden = args.ffn_hidden or 8 * args.hidden // 3
    return args


def runs_for(args: argparse.Namespace) -> list[TinyRun]:
    global_batch = 2 * args.dp  # one micro-batch of 2 sequences per rank: the step dominates
    return [
        TinyRun(
            optimizer=optimizer, layout="canzona" if optimizer == "muon" else "megatron",
            num_steps=args.warmup + args.steps, global_batch=global_batch, micro_batch=2,
            lr=1e-3, weight_decay=0.1, num_layers=args.layers, hidden=args.hidden,
            ffn_hidden=args.ffn_hidden,
        )
        for _ in range(args.rounds)
        for optimizer in VARIANTS.values()
    ]


def step_times(per_rank: list[dict], warmup: int) -> list[float]:
    """Per timed step, the slowest rank's ``optimizer.step()`` seconds."""
    return [max(steps) for steps in zip(*(r["step_seconds"] for r in per_rank))][warmup:]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = runs_for(args)
    print(f"bench_step: DP {args.dp} on gloo, {args.layers} layers, hidden {args.hidden}, "
          f"ffn {args.ffn_hidden}; {args.rounds} rounds of {args.warmup} + {args.steps} steps per variant ...",
          flush=True)
    start = time.perf_counter()
    per_rank = launch(train_tiny_gpts, LaunchConfig(world_size=args.dp, timeout_s=args.timeout), runs)
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for i in range(len(runs)):
        name = list(VARIANTS)[i % len(VARIANTS)]
        results[name] += step_times([rank[i] for rank in per_rank], args.warmup)
    medians = {name: statistics.median(times) for name, times in results.items()}
    sync = medians["sync"]
    report = {
        "dp_size": args.dp,
        "model": {"layers": args.layers, "hidden": args.hidden, "ffn_hidden": args.ffn_hidden},
        "timed_steps_per_variant": args.rounds * args.steps,
        "median_step_ms": {name: 1e3 * m for name, m in medians.items()},
        "ratio_to_sync": {name: m / sync for name, m in medians.items()},
        "ideal_ratio_to_sync": 1.0 / args.dp,
        "canzona_speedup_over_megatron": medians["megatron"] / medians["canzona"],
        "wall_seconds": time.perf_counter() - start,
    }
    print(f"{'variant':<10} {'median step (ms)':>17} {'/ sync':>8}")
    for name in VARIANTS:
        print(f"{name:<10} {1e3 * medians[name]:>17.2f} {medians[name] / sync:>8.3f}")
    print(f"ideal canzona / sync = 1/DP = {1 / args.dp:.3f}; "
          f"canzona is {report['canzona_speedup_over_megatron']:.2f}x faster than Megatron's layer-wise Muon")
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as stream:
            stream.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
