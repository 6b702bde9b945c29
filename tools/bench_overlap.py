#!/usr/bin/env python
"""How much of Newton-Schulz, or of the holders' work on their pieces, on a side CUDA stream hides
beside a GEMM load like backward's.

    python tools/bench_overlap.py                       # Qwen3-8B's fc2 beside 8192^3 bf16 products
    python tools/bench_overlap.py --shape 5120 25600 --json overlap.json
    python tools/bench_overlap.py --work prep           # Muon's sources, exact norms and bf16 packing

``--work prep`` puts on the side stream instead what Muon's holders do under Megatron-FSDP to each
bucket's pieces as it reduces (``EarlyGathers._prepare``, then the gather's packing): the Newton-Schulz
input made from the gradient and a copy of the momentum (``muon_source_``), the pieces' exact norm
(``norms_of_pieces``, without its two all-reduces of a few bytes) and the bf16 packing divided by it,
for ``--buckets`` buckets of ``--pieces`` pieces of ``--bucket-elements`` elements in all (default: a
rank's share of a Qwen3-8B layer at FSDP 64). It prints beside the measurement what
``tools/simulate.py --fsdp`` prices it at (``planning/sim/step.py: holder_prep``, at the ``h100-ib400``
preset's memory speed) and assumes it costs backward (nothing: ``load_slowdown`` says).

Three timings on one GPU, each the median of ``--repeats`` after a warm-up: the GEMM load alone
on the main stream (``gemm``), Newton-Schulz alone on a side stream (``side``), and both at once
(``both``, the side stream started with the load). What the step's early compute can expect
(tools/simulate.py's side-stream efficiency):

* ``hidden = (gemm + side - both) / side``: the fraction of Newton-Schulz's time that disappears
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
from megatron.canzona.optim.config import MuonConfig
from megatron.canzona.optim.exact_norm import norms_of_pieces
from megatron.canzona.optim.muon import muon_source_
from megatron.canzona.optim.newton_schulz import newton_schulz
from megatron.canzona.provenance import git_revision, machine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=at_least(1), nargs=2, default=(4096, 12288), metavar=("M", "N"),
                   help="the Newton-Schulz matrix (default: Qwen3-8B's fc2)")
    p.add_argument("--stack", type=at_least(1), default=4, help="matrices of that shape per Newton-Schulz call")
    p.add_argument("--gemm", type=at_least(1), default=8192, help="side of the square bf16 products of the load")
    p.add_argument("--load-products", type=at_least(1), default=24, help="products in the load")
    p.add_argument("--work", choices=("ns", "prep"), default="ns",
                   help="what runs on the side stream: Newton-Schulz (ns) or the holders' work on their pieces (prep)")
    p.add_argument("--buckets", type=at_least(1), default=8, help="with --work prep: buckets prepared")
    p.add_argument("--bucket-elements", type=at_least(1), default=DEFAULT_BUCKET_ELEMENTS,
                   help="with --work prep: a rank's elements of one bucket's matrices (default: Qwen3-8B's layer "
                   "at FSDP 64)")
    p.add_argument("--pieces", type=at_least(1), default=4, help="with --work prep: matrices per bucket")
    p.add_argument("--repeats", type=at_least(1), default=5)
    p.add_argument("--json", help="also write the result here")
    return p.parse_args(argv)


DEFAULT_BUCKET_ELEMENTS = 3_014_656
"""A rank's share of one Qwen3-8B layer's matrices at FSDP 64: (QKV 6144 + O 4096 + fc1 24576 + fc2 12288)
x 4096 / 64, rounded."""


def holder_work(buckets: int, elements: int, pieces: int, device: torch.device):
    """What Muon's holders do to ``buckets`` buckets of ``pieces`` pieces (``elements`` in all per
    bucket) before their gather under Megatron-FSDP, with the project's functions: each piece's
    Newton-Schulz input made from its gradient and a copy of its momentum, the bucket's exact
    norms, the pieces divided by them into a bf16 buffer. Returns the work (a callable, the same
    result each call: the gradients and momenta are copied, not advanced), the elements it
    touches and the buffer it writes."""
    config = MuonConfig()
    size = elements // pieces
    grads = [[torch.randn(size, device=device) for _ in range(pieces)] for _ in range(buckets)]
    momenta = [[torch.randn(size, device=device) for _ in range(pieces)] for _ in range(buckets)]
    packed = torch.empty(buckets * pieces * size, device=device, dtype=torch.bfloat16)

    def work() -> None:
        for b in range(buckets):
            sources = [muon_source_(g.clone(), m.clone(), config) for g, m in zip(grads[b], momenta[b])]
            norms = norms_of_pieces(enumerate(sources), pieces, 1e-7, device=device)
            for i, source in enumerate(sources):
                at = (b * pieces + i) * size
                torch.div(source, norms[i], out=source)
                packed[at : at + size].copy_(source)

    return work, buckets * pieces * size, packed


def priced_ms(numel: int) -> float:
    """What the projection prices the holders' work on ``numel`` elements at (source, exact norm,
    narrow packing at ``h100-ib400``'s memory speed)."""
    from megatron.canzona.planning.sim.cluster import load_cluster, preset_path
    from megatron.canzona.planning.sim.step import holder_prep

    prep = holder_prep(holder_momentum=True, narrow=True)
    gpu = load_cluster(preset_path("h100-ib400")).gpu
    return 1e3 * numel * (prep["prep_bytes"] + prep["pack_bytes"]) / gpu.memory_bytes_per_s


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
    if args.work == "prep":
        side_work, numel, _ = holder_work(args.buckets, args.bucket_elements, args.pieces, device)
        what, name = {"buckets": args.buckets, "bucket_elements": args.bucket_elements, "pieces": args.pieces,
                      "priced_ms": priced_ms(numel)}, "the holders' work"
    else:
        x = torch.randn(args.stack, *args.shape, device=device)

        def side_work() -> None:
            newton_schulz(x, dtype=torch.bfloat16)

        what, name = {"shape": list(args.shape), "stack": args.stack}, "Newton-Schulz"

    def load() -> None:
        for _ in range(args.load_products):
            torch.mm(a, b)

    def on_side(with_load: bool) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            side_work()
        if with_load:
            load()
        torch.cuda.current_stream().wait_stream(side)

    gemm_ms = timed(load, args.repeats)
    side_ms, both_ms = timed(lambda: on_side(False), args.repeats), timed(lambda: on_side(True), args.repeats)
    result = {"work": args.work, **what, "gemm_side": args.gemm, "load_products": args.load_products,
              "gemm_ms": gemm_ms, "side_ms": side_ms, "both_ms": both_ms,
              "hidden": (gemm_ms + side_ms - both_ms) / side_ms, "load_slowdown": both_ms / gemm_ms,
              "git_revision": git_revision(), "machine": machine(device)}
    priced = f" (the projection prices it at {what['priced_ms']:.2f} ms)" if "priced_ms" in what else ""
    print(f"load {gemm_ms:.2f} ms, {name} {side_ms:.2f} ms{priced}, both {both_ms:.2f} ms: "
          f"{100 * result['hidden']:.0f}% of {name} hidden beside the load, the load {result['load_slowdown']:.2f}x "
          "as long")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as stream:
            stream.write(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
