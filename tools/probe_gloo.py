#!/usr/bin/env python
"""Measure this machine as a simulator cluster: gloo collectives between local processes,
one core's fp32 matmul rate and memory bandwidth; write the cluster file.

    python tools/probe_gloo.py                  # 2 and 4 ranks -> megatron/canzona/planning/sim/clusters/cpu-gloo-local{-2,}.toml
    python tools/probe_gloo.py --ranks 8 --out /tmp/cpu8.toml --json probe.json

Ranks are started with megatron.canzona.runtime.launch (one torch thread each, as
tools/bench_step.py runs them) and time, after a barrier, the collectives the runtime and
Megatron's DDP issue: ``all_reduce``, ``reduce_scatter_tensor``, ``all_gather_into_tensor``,
``all_to_all_single`` over every rank, and a send/recv ping-pong between ranks 0 and 1, for
buffers from 4 KiB to 16 MiB; a call's time is its slowest rank's, the median over repeats.
Gloo on one box depends on how many processes share its cores (the schema has one link per
node), so each ``--ranks`` count gets its own file. Each collective is fitted to the
simulator's α-β form (megatron.canzona.planning.sim.network):

* ring reduce-scatter / all-gather of S bytes over p ranks: ``(p-1)·α + (p-1)/p·S / (B·ring_eff)``;
* all-to-all of S bytes per rank: ``α + (p-1)/p·S / (B·alltoall_eff)``;
* ping-pong, one way: ``α + S / B``.

B is the fastest of the three fitted bandwidths (so every efficiency is at most 1); the ring's
efficiency and α are the all-gather's, the ring inside an optimizer step (gloo's
reduce-scatter, slower, is named in a comment). Bandwidths come from buffers of 1 MiB and
more, latencies from the smaller ones. The matmul rate is a 1024² fp32 (and bf16) GEMM on
one thread, the memory bandwidth a 128 MiB fp32 copy (read + write) on one thread;
``compute_slots`` is the core count, so the simulator slows compute down when more ranks
than cores run at once.
Before measuring it waits (up to ``--max-wait`` s) until the 1-minute load average is
below ``--max-load``: other jobs on a 2-core box skew every number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import tomllib
import warnings
from collections.abc import Callable

import torch

from megatron.canzona.cli import ArgumentParser, at_least, non_negative, positive
from megatron.canzona.planning.sim import ClusterSpec
from megatron.canzona.planning.sim.cluster import preset_path
from megatron.canzona.provenance import wait_for_quiet
from megatron.canzona.runtime import LaunchConfig, launch

DEFAULT_OUT = preset_path("cpu-gloo-local")
DEFAULT_SIZES = tuple(4096 * 4**k for k in range(7))  # 4 KiB .. 16 MiB per rank
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "ping_pong")
LARGE_BYTES = 1 << 20
"""Sizes from here on set the bandwidth, smaller ones the latency."""


def _collective(kind: str, nbytes: int) -> Callable[[], None]:
    """One call of ``kind`` on a buffer of ``nbytes`` (the simulator's S) on this rank."""
    import torch.distributed as dist

    p, rank = dist.get_world_size(), dist.get_rank()
    numel = max(p, nbytes // 4 // p * p)
    full, shard = torch.ones(numel), torch.ones(numel // p)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, full)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, shard)
    if kind == "all_to_all":
        out = torch.empty(numel)
        return lambda: dist.all_to_all_single(out, full)
    assert kind == "ping_pong", kind
    if rank > 1:
        return lambda: None

    def ping_pong() -> None:  # rank 0 sends, rank 1 returns it: two one-way trips
        if rank == 0:
            dist.send(full, 1)
            dist.recv(full, 1)
        else:
            dist.recv(full, 0)
            dist.send(full, 0)
    return ping_pong


def probe_rank(sizes: list[int], repeats: int) -> dict[str, list[list[float]]]:
    """Rank body: per collective and size, this rank's seconds of each repeat."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch renames the *_tensor calls
    out: dict[str, list[list[float]]] = {}
    for kind in COLLECTIVES:
        out[kind] = []
        for nbytes in sizes:
            call = _collective(kind, nbytes)
            call()
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            out[kind].append(times)
    return out


def slowest_median(per_rank: list[dict[str, list[list[float]]]], kind: str, ranks: int) -> list[float]:
    """Per size, the median over repeats of the slowest rank's seconds (ping-pong: one way)."""
    members = per_rank[:2] if kind == "ping_pong" else per_rank[:ranks]
    out = []
    for k in range(len(members[0][kind])):
        slowest = [max(r[kind][k][i] for r in members) for i in range(len(members[0][kind][k]))]
        out.append(statistics.median(slowest) / (2 if kind == "ping_pong" else 1))
    return out


def fit(sizes: list[int], times: dict[str, list[float]], ranks: int) -> dict[str, dict[str, float]]:
    """α (s per step) and bandwidth (bytes/s) of each collective in the simulator's form: the
    bandwidth from a least-squares line through the sizes of 1 MiB and more (an optimizer
    step's collectives are megabytes), α the median of what is left of the small ones."""
    share = (ranks - 1) / ranks
    out = {}
    for kind, scale, steps in (("reduce_scatter", share, ranks - 1), ("all_gather", share, ranks - 1),
                               ("all_reduce", 2 * share, 2 * (ranks - 1)), ("all_to_all", share, 1),
                               ("ping_pong", 1.0, 1)):
        x, y = [scale * s for s in sizes], times[kind]
        big = [(xi, yi) for xi, yi, s in zip(x, y, sizes) if s >= LARGE_BYTES] or list(zip(x, y))[-2:]
        mx, my = statistics.mean(v for v, _ in big), statistics.mean(v for _, v in big)
        slope = sum((xi - mx) * (yi - my) for xi, yi in big) / sum((xi - mx) ** 2 for xi, _ in big)
        small = [yi - slope * xi for xi, yi, s in zip(x, y, sizes) if s < LARGE_BYTES] or [my - slope * mx]
        intercept = max(0.0, statistics.median(small))
        out[kind] = {"latency_s": intercept / steps, "bytes_per_s": 1.0 / slope, "intercept_s": intercept}
    return out


def matmul_flops_per_s(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """Best one-thread GEMM rate."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(repeats))
    return 2.0 * size**3 / best


def copy_bytes_per_s(numel: int = 32 << 20, repeats: int = 5) -> float:
    """Best one-thread fp32 copy rate, read plus write."""
    src, dst = torch.ones(numel), torch.empty(numel)
    dst.copy_(src)
    return 2 * 4 * numel / min(_seconds(lambda: dst.copy_(src)) for _ in range(repeats))


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(args: argparse.Namespace, ranks: int) -> dict:
    """Every probe at ``ranks`` processes; the report that a cluster file is written from."""
    loads = wait_for_quiet(args.max_load, args.max_wait)
    torch.set_num_threads(1)
    compute = {"fp32_flops_per_s": matmul_flops_per_s(torch.float32),
               "bf16_flops_per_s": matmul_flops_per_s(torch.bfloat16), "copy_bytes_per_s": copy_bytes_per_s()}
    sizes = list(args.sizes)
    per_rank = launch(probe_rank, LaunchConfig(world_size=ranks, timeout_s=args.timeout), sizes, args.repeats)
    times = {kind: slowest_median(per_rank, kind, ranks) for kind in COLLECTIVES}
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "ranks": ranks, "cores": os.cpu_count(), "repeats": args.repeats, "sizes_bytes": sizes,
        "load_average_1min": {"before": loads, "after": os.getloadavg()[0]},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "compute": compute, "seconds": times, "fit": fit(sizes, times, ranks),
    }


def out_path(out: str, ranks: int, largest: int) -> str:
    """The largest probe writes ``out``; smaller ones ``<out stem>-<ranks>.toml`` beside it."""
    if ranks == largest:
        return out
    stem, ext = os.path.splitext(out)
    return f"{stem}-{ranks}{ext or '.toml'}"


def cluster_toml(report: dict, name: str) -> str:
    """The simulator's cluster file, each number's measurement named in a comment."""
    f, c, p = report["fit"], report["compute"], report["ranks"]
    ring = f["all_gather"]["bytes_per_s"]  # the ring an optimizer step runs (gloo's reduce-scatter is slower)
    link = max(ring, f["all_to_all"]["bytes_per_s"], f["ping_pong"]["bytes_per_s"])
    alpha = f["all_gather"]["latency_s"]
    loads = report["load_average_1min"]
    how = (f"tools/probe_gloo.py, {report['date']}, {p} gloo processes on {report['cores']} cores "
           f"(1-min load {loads['before'][-1]:.2f} before, {loads['after']:.2f} after)")
    lines = [
        f"# This machine as a cluster: one node of {p} local gloo processes (TCP loopback), one torch",
        "# thread each, as tools/bench_step.py runs them. Every number below was MEASURED by",
        f"# {how};",
        f"# {report['machine']['processor']}, {report['machine']['platform']}, torch {report['machine']['torch']}.",
        "# Re-run the probe on another machine: these numbers are this box's, not a preset.",
        f'name = "{name}"',
        f"gpus_per_node = {p}                 # the probed processes, all on this machine",
        f"compute_slots = {report['cores']}                 # os.cpu_count(): ranks beyond it share cores",
        'backend = "gloo"                  # host-group gathers go when backward ends (a gloo wait blocks the host)',
        "",
        "[gpu]",
        f"bf16_tflops = {c['bf16_flops_per_s'] / 1e12:.6f}      # measured: best 1024^2 bf16 GEMM, one thread",
        f"fp32_tflops = {c['fp32_flops_per_s'] / 1e12:.6f}      # measured: best 1024^2 fp32 GEMM, one thread",
        f"memory_gb_per_s = {c['copy_bytes_per_s'] / 1e9:.3f}       # measured: 128 MiB fp32 copy (read + write)",
        "matmul_efficiency = 1.0           # the measured GEMM rate is the rate the updates reach",
        "memory_efficiency = 1.0           # the measured copy rate is the rate elementwise kernels reach",
        'optimizer_dtype = "fp32"          # tools/bench_step.py runs fp32 Newton-Schulz',
        "",
        "[training]",
        "mfu = 0.4                         # NOT measured (forward/backward is not probed); default",
        "",
        "[intra_node]",
        f"bandwidth_gb_per_s = {link / 1e9:.4f}     # measured: fastest of ring, all-to-all, ping-pong bandwidths",
        f"latency_us = {alpha * 1e6:.1f}                # measured: all-gather intercept / (p-1), buffers < 1 MiB",
        "",
        "[collectives]",
        f"ring_efficiency = {ring / link:.4f}         # measured: all-gather bus bandwidth "
        f"{ring / 1e9:.3f} GB/s / link (buffers >= 1 MiB)",
        f"alltoall_efficiency = {f['all_to_all']['bytes_per_s'] / link:.4f}     # measured: all-to-all "
        f"{f['all_to_all']['bytes_per_s'] / 1e9:.3f} GB/s / link",
        "# Also measured, not in the schema (one ring efficiency, one latency): reduce-scatter "
        f"{f['reduce_scatter']['bytes_per_s'] / 1e9:.3f} GB/s bus,",
        f"# {f['reduce_scatter']['latency_s'] * 1e6:.0f} us/step (slower than gloo's all-reduce); all-reduce "
        f"{f['all_reduce']['bytes_per_s'] / 1e9:.3f} GB/s bus; all-to-all intercept "
        f"{f['all_to_all']['intercept_s'] * 1e6:.0f} us;",
        f"# ping-pong one way {f['ping_pong']['latency_s'] * 1e6:.0f} us + S / "
        f"{f['ping_pong']['bytes_per_s'] / 1e9:.3f} GB/s.",
        "",
    ]
    return "\n".join(lines)


def print_report(report: dict) -> None:
    print(f"probe_gloo: {report['ranks']} gloo ranks on {report['cores']} cores, {report['date']}, "
          f"1-min load {report['load_average_1min']['before'][-1]:.2f} -> {report['load_average_1min']['after']:.2f}")
    print(f"{'bytes':>10} " + " ".join(f"{k + ' (ms)':>18}" for k in COLLECTIVES))
    for k, size in enumerate(report["sizes_bytes"]):
        print(f"{size:>10} " + " ".join(f"{1e3 * report['seconds'][c][k]:>18.3f}" for c in COLLECTIVES))
    for kind, v in report["fit"].items():
        print(f"fit {kind:<15} latency {v['latency_s'] * 1e6:8.1f} us/step   "
              f"bandwidth {v['bytes_per_s'] / 1e9:7.3f} GB/s")
    c = report["compute"]
    print(f"one thread: fp32 GEMM {c['fp32_flops_per_s'] / 1e9:.1f} GFLOP/s, bf16 GEMM "
          f"{c['bf16_flops_per_s'] / 1e9:.1f} GFLOP/s, copy {c['copy_bytes_per_s'] / 1e9:.2f} GB/s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=at_least(1), nargs="+", default=[2, 4],
                   help="gloo processes; one cluster file per count (gpus_per_node = the count)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="cluster file of the largest --ranks; smaller counts write <stem>-<ranks>.toml beside it")
    p.add_argument("--sizes", type=at_least(1), nargs="+", default=DEFAULT_SIZES, help="buffer bytes per rank")
    p.add_argument("--repeats", type=at_least(1), default=10, help="timed calls per size, median reported")
    p.add_argument("--max-load", type=non_negative, default=1.0, help="wait until the 1-minute load average is below this")
    p.add_argument("--max-wait", type=non_negative, default=900.0, help="seconds to wait for it at most")
    p.add_argument("--timeout", type=positive, default=600.0, help="seconds before a hung launch fails")
    p.add_argument("--json", metavar="FILE", help="also write the measurements as JSON")
    args = p.parse_args(argv)
    if min(args.ranks) < 2:
        p.error(f"--ranks {args.ranks}: a collective needs at least 2 ranks")
    if args.repeats < 1 or min(args.sizes) < 4 * max(args.ranks):
        p.error(f"--repeats must be >= 1 and every size >= {4 * max(args.ranks)} bytes (one fp32 per rank)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reports = []
    for ranks in sorted(set(args.ranks)):
        report = measure(args, ranks)
        print_report(report)
        path = out_path(args.out, ranks, max(args.ranks))
        text = cluster_toml(report, os.path.splitext(os.path.basename(path))[0])
        ClusterSpec.from_dict(tomllib.loads(text), source=path)  # the simulator must accept it
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")
        reports.append({**report, "cluster_file": path})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"probes": reports}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
