#!/usr/bin/env python
"""Save and load time and bytes of Canzona checkpoints, against the time of a training step.

    python tools/bench_checkpoint.py                               # tiny GPT, Muon, DP 1, 2 and 4
    python tools/bench_checkpoint.py --optimizer soap --dp 2,4 --layers 4 --hidden 256 --json ckpt.json

Each DP size is one gloo launch (one process and one torch thread per rank) of the tiny
Qwen3-like GPT of ``canzona_patches/harness/tiny_gpt.py`` with the Canzona optimizer. Per launch:
``--warmup`` untimed steps, ``--steps`` timed training steps (forward, backward, optimizer
step), then ``--repeats`` saves (``torch_dist``, staged and committed atomically, as
``pretrain_gpt.py --save`` writes them) and as many loads of the last one; and, when the first
DP size's checkpoint exists, loads of it too (resharded to this DP size). A time is the
slowest rank's, after a barrier; medians are reported, and the first save apart (it also
validates the sharding across ranks). Bytes are the checkpoint directory's files, split into
model weights and optimizer state (Canzona's name-keyed tensors) by the checkpoint index.

Prints a table and one JSON object (``--json FILE`` also writes it) with the configuration,
the git revision and the machine. The machine may be shared: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megatron.canzona.cli import ArgumentParser, at_least, positive
from megatron.canzona.planning import OPTIMIZERS
from megatron.canzona.runtime import LaunchConfig, launch
from megatron.canzona.provenance import git_revision, machine
from canzona_patches.harness.tiny_gpt import TinyRun

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, kw_only=True)
class BenchJob:
    """What every rank of one launch does."""

    run: TinyRun
    warmup: int
    steps: int
    repeats: int
    save_dir: str
    reshard_dir: str | None
    """A checkpoint saved at another DP size, loaded (and timed) after this launch's own."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", default="1,2,4", help="comma-separated data-parallel sizes (one launch each)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="muon")
    parser.add_argument("--layers", type=at_least(1), default=2, help="transformer layers (tiny GPT: 2)")
    parser.add_argument("--hidden", type=at_least(1), default=64, help="hidden size, 4 heads (tiny GPT: 64)")
    parser.add_argument("--ffn-hidden", type=at_least(1), default=None, help="SwiGLU size (default 2 * hidden)")
    parser.add_argument("--warmup", type=at_least(0), default=2, help="untimed training steps")
    parser.add_argument("--steps", type=at_least(1), default=5, help="timed training steps")
    parser.add_argument("--repeats", type=at_least(1), default=3, help="saves and loads per launch")
    parser.add_argument("--timeout", type=positive, default=600.0, help="seconds before a hung launch fails")
    parser.add_argument("--dir", help="where checkpoints go (default: a temporary directory, removed)")
    parser.add_argument("--json", metavar="FILE", help="also write the JSON result here")
    args = parser.parse_args(argv)
    try:
        args.dp_sizes = [int(d) for d in args.dp.split(",")]
    except ValueError:
        parser.error(f"--dp {args.dp!r}: expected comma-separated integers such as 1,2,4")
    if any(d < 1 for d in args.dp_sizes) or args.steps < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--dp sizes, --steps and --repeats must be at least 1 and --warmup at least 0")
    if args.hidden % 4:
        parser.error(f"--hidden {args.hidden} must be a multiple of the 4 attention heads")
    args.ffn_hidden = args.ffn_hidden or 2 * args.hidden
    return args


def bench_rank(job: BenchJob) -> dict:
    """Rank body: train, time steps, saves and loads; return times (slowest rank) and bytes."""
    import torch
    import torch.distributed as dist

    from canzona_patches.emulation.cpu import enable_cpu_mode
    from megatron.core import parallel_state
    from canzona_patches.harness.tiny_checkpoint import load_checkpoint, save_checkpoint
    from canzona_patches.harness.tiny_gpt import build, train_step

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=job.run.tp_size)
    try:
        model, ddp_model, optimizer, _ = build(job.run)

        def timed(action) -> float:
            dist.barrier()
            began = time.perf_counter()
            action()
            seconds = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            return float(seconds)

        step = iter(range(job.warmup + job.steps))
        for _ in range(job.warmup):
            train_step(job.run, ddp_model, optimizer, next(step))
        step_s = [timed(lambda: train_step(job.run, ddp_model, optimizer, next(step))) for _ in range(job.steps)]
        save_s = [timed(lambda i=i: save_checkpoint(job.save_dir, i + 1, model, optimizer)) for i in range(job.repeats)]
        load_s = [timed(lambda: load_checkpoint(job.save_dir, model, optimizer)) for _ in range(job.repeats)]
        reshard_s = [
            timed(lambda: load_checkpoint(job.reshard_dir, model, optimizer)) for _ in range(job.repeats)
        ] if job.reshard_dir else []
        return {"step_s": step_s, "save_s": save_s, "load_s": load_s, "reshard_load_s": reshard_s,
                "bytes": checkpoint_bytes(Path(job.save_dir) / f"iter_{job.repeats:07d}")}
    finally:
        parallel_state.destroy_model_parallel()


def checkpoint_bytes(path: Path) -> dict[str, int]:
    """Bytes of a ``torch_dist`` checkpoint: files on disk, and tensor data by owner."""
    from torch.distributed.checkpoint import FileSystemReader

    from canzona_patches.checkpoints.state import STATE_PREFIX

    by_owner = {"model": 0, "optimizer": 0, "other": 0}
    for index, info in FileSystemReader(str(path)).read_metadata().storage_data.items():
        owner = "optimizer" if index.fqn.startswith(STATE_PREFIX) else "model" if index.fqn.startswith(
            ("decoder.", "embedding.", "output_layer.")) else "other"
        by_owner[owner] += info.length
    files = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return {"files": files, **by_owner}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_"))
    run = TinyRun(layout="canzona", optimizer=args.optimizer, num_layers=args.layers, hidden=args.hidden,
                  ffn_hidden=args.ffn_hidden, num_steps=args.warmup + args.steps, lr=1e-3, weight_decay=0.1)
    print(f"bench_checkpoint: {args.optimizer}, {args.layers} layers, hidden {args.hidden}, ffn {args.ffn_hidden}; "
          f"DP {args.dp}; {args.steps} timed steps, {args.repeats} saves and loads per DP size ...", flush=True)
    started = time.perf_counter()
    rows = {}
    first_dir: str | None = None
    try:
        for dp in args.dp_sizes:
            save_dir = str(root / f"dp{dp}")
            job = BenchJob(run=run, warmup=args.warmup, steps=args.steps, repeats=args.repeats,
                           save_dir=save_dir, reshard_dir=first_dir)
            result = launch(bench_rank, LaunchConfig(world_size=dp, timeout_s=args.timeout), job)[0]
            rows[dp] = summarize(result, resharded_from=args.dp_sizes[0] if first_dir else None)
            first_dir = first_dir or save_dir
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    report = {
        "config": {"optimizer": args.optimizer, "layers": args.layers, "hidden": args.hidden,
                   "ffn_hidden": args.ffn_hidden, "dp_sizes": args.dp_sizes, "timed_steps": args.steps,
                   "repeats": args.repeats, "format": "torch_dist, staged + atomic commit"},
        "git_revision": git_revision(),
        "machine": {**machine(), "device": "cpu (gloo)"},
        "by_dp": rows,
        "wall_seconds": time.perf_counter() - started,
    }
    print_table(rows)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def summarize(result: dict, *, resharded_from: int | None) -> dict:
    step = statistics.median(result["step_s"])
    save = statistics.median(result["save_s"][1:] or result["save_s"])
    load = statistics.median(result["load_s"])
    row = {
        "step_ms": 1e3 * step, "first_save_ms": 1e3 * result["save_s"][0], "save_ms": 1e3 * save,
        "load_ms": 1e3 * load, "save_over_step": save / step, "load_over_step": load / step,
        "bytes": result["bytes"],
    }
    if result["reshard_load_s"]:
        row["resharded_from_dp"] = resharded_from
        row["reshard_load_ms"] = 1e3 * statistics.median(result["reshard_load_s"])
    return row


def print_table(rows: dict[int, dict]) -> None:
    header = (f"{'DP':>3} {'step ms':>8} {'save ms':>8} {'1st save':>9} {'load ms':>8} {'reshard':>8} "
              f"{'save/step':>9} {'load/step':>9} {'bytes':>10} {'optim B':>10} {'model B':>10}")
    print(header)
    for dp, row in rows.items():
        reshard = f"{row['reshard_load_ms']:>8.1f}" if "reshard_load_ms" in row else f"{'-':>8}"
        b = row["bytes"]
        print(f"{dp:>3} {row['step_ms']:>8.1f} {row['save_ms']:>8.1f} {row['first_save_ms']:>9.1f} "
              f"{row['load_ms']:>8.1f} {reshard} {row['save_over_step']:>9.2f} {row['load_over_step']:>9.2f} "
              f"{b['files']:>10,} {b['optimizer']:>10,} {b['model']:>10,}")
    print("reshard: load of the first DP size's checkpoint at this DP size; save excludes the first save")


if __name__ == "__main__":
    sys.exit(main())
