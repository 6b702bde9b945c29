#!/usr/bin/env python
"""Optimizer-step time of Canzona against synchronous compute and Megatron's layer-wise Muon.

    python tools/bench_step.py                          # DP 2 on gloo, one thread per rank
    python tools/bench_step.py --dp 4 --layers 4 --hidden 512 --steps 8 --rounds 4 --json step.json
    python tools/bench_step.py --tp 2 --dp 1 --gantt step_tp2.png    # tensor parallelism

Every variant trains the same Qwen3-like GPT (QK-norm, SwiGLU, GQA) with Megatron-Core's
DDP on gloo, one process and one torch thread per DP rank, and times ``optimizer.step()``
(after a barrier) on every rank; a step's time is the slowest rank's. Variants:

* ``canzona`` -- ``--optimizer muon --canzona``: the Canzona plan's layout, each matrix's
  Muon run once by its host (gathered first when ``--bucket-size`` splits it across DP
  shards), then the stock parameter all-gather;
* ``sync`` -- synchronous compute: gradients all-reduced, every rank runs Muon on every
  matrix (the same math, no distributed optimizer);
* ``megatron`` -- Megatron-Core's own ``LayerWiseDistributedOptimizer`` Muon configured to
  the same math (fp32 Newton-Schulz, quintic coefficients, spectral scale, split QKV).

With ``--tp 2`` (or more) the variants are ``canzona`` (async: each matrix computed once on
a host TP rank, fused all-to-alls in pipelined micro-groups), ``sync`` (``--canzona-tp-mode
sync``: every TP rank gathers and computes every matrix) and ``megatron`` (``muon_tp_mode
duplicated``, Megatron's exact-math TP mode: every TP rank all-gathers and computes). Bytes
per step and rank on the TP group are measured for Canzona's two modes and computed from the
shapes for Megatron's all-gathers (at TP 1, Canzona's host-group bytes: non-zero only for
matrices split across DP shards). ``--gantt FILE.png`` draws one async step per rank.

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

from megatron.canzona.planning import CanzonaPlan  # noqa: E402
from megatron.canzona.runtime import LaunchConfig, launch  # noqa: E402
from tests.multirank.tiny_gpt import TinyRun, train_tiny_gpts  # noqa: E402

DP_VARIANTS = {"canzona": ("muon", "async"), "sync": ("sync_muon", "async"), "megatron": ("megatron_muon", "async")}
TP_VARIANTS = {"canzona": ("muon", "async"), "sync": ("muon", "sync"), "megatron": ("megatron_muon", "async")}
STAGE_COLOURS = {"gather": "tab:blue", "compute": "tab:orange", "scatter": "tab:green", "apply": "tab:red"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (processes = dp * tp)")
    parser.add_argument("--gantt", metavar="FILE.png", help="with --tp > 1: timeline of one async step")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers")
    parser.add_argument("--hidden", type=int, default=384, help="hidden size (4 heads, 2 query groups)")
    parser.add_argument("--ffn-hidden", type=int, default=None, help="SwiGLU size (default: 8/3 hidden)")
    parser.add_argument("--bucket-size", type=int, default=None,
                        help="DDP bucket size in elements (small buckets split matrices across DP shards)")
    parser.add_argument("--alpha", type=float, default=0.5, help="Canzona planner balance knob")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="variants run in turn this many times, so load drift hits them alike")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a hung launch fails")
    parser.add_argument("--json", metavar="FILE", help="also write the JSON result here")
    args = parser.parse_args(argv)
    if args.dp < 1 or args.tp < 1:
        parser.error(f"--dp {args.dp} and --tp {args.tp} must be at least 1")
    if args.gantt and args.tp == 1:
        parser.error("--gantt draws the TP pipeline: add --tp 2")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1 and --warmup at least 0")
    if args.hidden % 4:
        parser.error(f"--hidden {args.hidden} must be a multiple of the 4 attention heads")
    # 8/3 hidden, rounded to a multiple of 64 so it splits over TP ranks.
    args.ffn_hidden = args.ffn_hidden or max(64, round(8 * args.hidden / 3 / 64) * 64)
    return args


def variants(args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    return TP_VARIANTS if args.tp > 1 else DP_VARIANTS


def runs_for(args: argparse.Namespace) -> list[TinyRun]:
    global_batch = 2 * args.dp  # one micro-batch of 2 sequences per rank: the step dominates
    return [
        TinyRun(
            optimizer=optimizer, tp_mode=tp_mode, tp_size=args.tp,
            layout="canzona" if optimizer == "muon" else "megatron",
            num_steps=args.warmup + args.steps, global_batch=global_batch, micro_batch=2,
            lr=1e-3, weight_decay=0.1, num_layers=args.layers, hidden=args.hidden,
            ffn_hidden=args.ffn_hidden, bucket_size=args.bucket_size, alpha=args.alpha,
        )
        for _ in range(args.rounds)
        for optimizer, tp_mode in variants(args).values()
    ]


def step_times(per_rank: list[dict], warmup: int) -> list[float]:
    """Per timed step, the slowest rank's ``optimizer.step()`` seconds."""
    return [max(steps) for steps in zip(*(r["step_seconds"] for r in per_rank))][warmup:]


def megatron_duplicated_bytes(params: dict, args: argparse.Namespace) -> float:
    """Mean bytes a rank sends per step in Megatron's duplicated TP mode: every TP rank
    all-gathers each TP-sharded matrix of its DP rank (fp32, (tp-1) shards each)."""
    sharded = [p for n, p in params.items() if n.endswith(TP_SHARDED_SUFFIXES)]
    total = sum(p.numel() // args.tp * 4 * (args.tp - 1) * args.tp for p in sharded)
    return total / (args.dp * args.tp)


TP_SHARDED_SUFFIXES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


def draw_gantt(per_rank: list[dict], path: str) -> None:
    """One async step: per rank one lane per stage (gather, compute, scatter, apply), each bar
    a micro-group, so communication in flight can be seen beside compute."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = [r["tp_stats"]["timeline"] for r in per_rank]
    origin = min(start for timeline in timelines for _, _, start, _ in timeline)
    lanes = list(STAGE_COLOURS)
    rows = len(lanes) + 1  # a blank lane between ranks
    fig, ax = plt.subplots(figsize=(11, 0.6 + 0.35 * rows * len(timelines)))
    for rank, timeline in enumerate(timelines):
        for stage, group, start, end in timeline:
            y = rank * rows + lanes.index(stage)
            ax.barh(y, 1e3 * (end - start), left=1e3 * (start - origin), height=0.8,
                    color=STAGE_COLOURS[stage], edgecolor="black", linewidth=0.4)
            ax.text(1e3 * (start - origin), y, f" {group}", va="center", fontsize=6)
    ax.set_yticks([r * rows + i for r in range(len(timelines)) for i in range(len(lanes))],
                  [f"rank {r} {lane}" for r in range(len(timelines)) for lane in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first collective (bar label: micro-group)")
    ax.set_title("Canzona TP async optimizer step (gather/scatter spans: issue to completion)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = runs_for(args)
    print(f"bench_step: TP {args.tp} x DP {args.dp} on gloo, {args.layers} layers, hidden {args.hidden}, "
          f"ffn {args.ffn_hidden}; {args.rounds} rounds of {args.warmup} + {args.steps} steps per variant ...",
          flush=True)
    start = time.perf_counter()
    world = args.dp * args.tp
    per_rank = launch(train_tiny_gpts, LaunchConfig(world_size=world, timeout_s=args.timeout), runs)
    names = list(variants(args))
    results: dict[str, list[float]] = {name: [] for name in names}
    last: dict[str, list[dict]] = {}
    for i in range(len(runs)):
        name = names[i % len(names)]
        last[name] = [rank[i] for rank in per_rank]
        results[name] += step_times(last[name], args.warmup)
    medians = {name: statistics.median(times) for name, times in results.items()}
    sync = medians["sync"]
    report = {
        "dp_size": args.dp,
        "tp_size": args.tp,
        "model": {"layers": args.layers, "hidden": args.hidden, "ffn_hidden": args.ffn_hidden},
        "timed_steps_per_variant": args.rounds * args.steps,
        "median_step_ms": {name: 1e3 * m for name, m in medians.items()},
        "ratio_to_sync": {name: m / sync for name, m in medians.items()},
        "ideal_ratio_to_sync": 1.0 / world,
        "canzona_speedup_over_megatron": medians["megatron"] / medians["canzona"],
        "wall_seconds": time.perf_counter() - start,
    }
    plan = CanzonaPlan.from_json(last["canzona"][0]["plan"])
    report["split_matrices"] = sum(p.host is None for p in plan.dp.matrix.placements)
    host_names = ("canzona", "sync") if args.tp > 1 else ("canzona",)
    report["host_group_bytes_per_rank_step"] = {
        name: sum(r["tp_stats"]["bytes_sent"] for r in last[name]) / world for name in host_names
    }
    if args.tp > 1:
        report["host_group_bytes_per_rank_step"]["megatron"] = megatron_duplicated_bytes(last["canzona"][0]["params"], args)
    print(f"{'variant':<10} {'median step (ms)':>17} {'/ sync':>8} {'host-group bytes/rank':>22}")
    for name in names:
        sent = report["host_group_bytes_per_rank_step"].get(name)
        print(f"{name:<10} {1e3 * medians[name]:>17.2f} {medians[name] / sync:>8.3f} "
              f"{'' if sent is None else f'{sent:,.0f}':>22}")
    print(f"ideal canzona / sync = 1/(DP*TP) = {1 / world:.3f} (compute only); "
          f"canzona is {report['canzona_speedup_over_megatron']:.2f}x faster than Megatron's layer-wise Muon")
    if args.gantt:
        draw_gantt(last["canzona"], args.gantt)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as stream:
            stream.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
