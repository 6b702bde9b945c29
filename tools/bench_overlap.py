#!/usr/bin/env python
"""How much of Newton-Schulz on a side CUDA stream hides beside a GEMM load like backward's.

    python tools/bench_overlap.py                       # Qwen3-8B's fc2 beside 8192^3 bf16 products
    python tools/bench_overlap.py --shape 5120 25600 --json overlap.json

Three timings on one GPU, each the median of ``--repeats`` after a warm-up: the GEMM load alone
on the main stream (``gemm``), Newton-Schulz alone on a side stream (``ns``), and both at once
(``both``, the side stream started with the load). What the step's early compute can expect
(tools/simulate.py's side-stream efficiency):

* ``hidden = (gemm + ns - both) / ns``: the fraction of Newton-Schulz's time that disappears
  beside the load (1: it runs free in the load's gaps; 0: the two serialise);
* ``load_slowdown = both / gemm``: what the load pays for it.

Without CUDA it prints why and exits 0 (there is nothing to overlap on one CPU stream).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from megatron.canzona.cli import ArgumentParser, at_least
from megatron.canzona.optim.newton_schulz import newton_schulz
from megatron.canzona.provenance import git_revision, machine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=at_least(1), nargs=2, default=(4096, 12288), metavar=("M", "N"),
                   help="the Newton-Schulz matrix (default: Qwen3-8B's fc2)")
    p.add_argument("--stack", type=at_least(1), default=4, help="matrices of that shape per Newton-Schulz call")
    p.add_argument("--gemm", type=at_least(1), default=8192, help="side of the square bf16 products of the load")
    p.add_argument("--load-products", type=at_least(1), default=24, help="products in the load")
    p.add_argument("--repeats", type=at_least(1), default=5)
    p.add_argument("--json", help="also write the result here")
    return p.parse_args(argv)


def timed(run, repeats: int) -> float:
    """Median milliseconds of ``run()`` (device idle before each, events around it)."""
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_overlap: no CUDA device; nothing to overlap on the CPU")
        return 0
    device = torch.device("cuda")
    side = torch.cuda.Stream()
    a = torch.randn(args.gemm, args.gemm, device=device, dtype=torch.bfloat16)
    b = torch.randn(args.gemm, args.gemm, device=device, dtype=torch.bfloat16)
    x = torch.randn(args.stack, *args.shape, device=device)

    def load() -> None:
        for _ in range(args.load_products):
            torch.mm(a, b)

    def ns() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            newton_schulz(x, dtype=torch.bfloat16)
        torch.cuda.current_stream().wait_stream(side)

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            newton_schulz(x, dtype=torch.bfloat16)
        load()
        torch.cuda.current_stream().wait_stream(side)

    gemm_ms, ns_ms, both_ms = timed(load, args.repeats), timed(ns, args.repeats), timed(both, args.repeats)
    result = {"shape": list(args.shape), "stack": args.stack, "gemm_side": args.gemm, "load_products": args.load_products,
              "gemm_ms": gemm_ms, "ns_ms": ns_ms, "both_ms": both_ms,
              "hidden": (gemm_ms + ns_ms - both_ms) / ns_ms, "load_slowdown": both_ms / gemm_ms,
              "git_revision": git_revision(), "machine": machine(device)}
    print(f"load {gemm_ms:.2f} ms, Newton-Schulz {ns_ms:.2f} ms, both {both_ms:.2f} ms: "
          f"{100 * result['hidden']:.0f}% of Newton-Schulz hidden beside the load")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as stream:
            stream.write(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
