#!/usr/bin/env python
"""How far Newton-Schulz's output singular values leave the band their polynomial promises,
per method (standard, gram), dtype and coefficient schedule.

    python tools/ns_band.py                                  # 5 steps, the project's schedules (~20 s)
    python tools/ns_band.py --steps 8 --dtypes float32       # longer runs
    python tools/ns_band.py --schedules quintic --restart-every 2 3 5   # gram's restart choice

For each input, normalised singular values in ``[lo, hi]`` must come out in
``singular_value_band(schedule, steps, lower=lo, upper=hi)``; the number printed is the worst
excess over that band (0 or below: inside it) over Gaussian, ill-conditioned (singular values
1 to 1e-4) and rank-deficient (half zero) inputs of aspect ratios 1 to 10, several seeds.
``--restart-every`` times gram with other run lengths than its default
(megatron.canzona.planning.cost.GRAM_RESTART_EVERY); this is how the default was chosen.
"""

from __future__ import annotations

import argparse

import torch

from megatron.canzona.cli import ArgumentParser, at_least
from megatron.canzona.optim.newton_schulz import NS_COEFFICIENTS, SPECTRUM_KINDS, newton_schulz, singular_value_band
from megatron.canzona.optim.newton_schulz import spectrum_matrix
from megatron.canzona.planning.cost import gram_runs

SHAPES = ((48, 48), (32, 64), (32, 160), (24, 240), (240, 24))


def worst_excess(schedule: str, steps: int, dtype: torch.dtype, method: str, restart_every: int | None,
                 seeds: int) -> float:
    worst = float("-inf")
    for kind in SPECTRUM_KINDS:
        for rows, cols in SHAPES:
            for seed in range(seeds):
                x = spectrum_matrix(rows, cols, kind, seed)
                s_in = torch.linalg.svdvals(x) / torch.linalg.matrix_norm(x)
                nonzero = s_in[s_in > 1e-10]
                low, high = singular_value_band(schedule, steps, lower=float(nonzero.min()), upper=float(nonzero.max()))
                out = newton_schulz(x, num_steps=steps, coefficients=schedule, dtype=dtype, method=method,
                                    gram_restart_every=restart_every).double()
                if not torch.isfinite(out).all():
                    return float("inf")
                s_out = torch.linalg.svdvals(out)[: len(nonzero)]
                worst = max(worst, low - float(s_out.min()), float(s_out.max()) - high)
    return worst


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--steps", type=at_least(1), default=5, help="Newton-Schulz iterations")
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    p.add_argument("--schedules", nargs="+", choices=sorted(NS_COEFFICIENTS),
                   default=["quintic", "quintic_schedule", "polar_express", "polar_express_4dp"])
    p.add_argument("--restart-every", nargs="+", type=at_least(1), default=[],
                   help="also time gram restarting every k steps, for each k given")
    p.add_argument("--seeds", type=at_least(1), default=3, help="inputs of each kind and shape")
    args = p.parse_args(argv)
    if args.steps < 1 or any(k < 1 for k in args.restart_every):
        p.error("--steps and --restart-every take positive integers")
    columns = [("standard", None), ("gram", None), *(("gram", k) for k in args.restart_every)]
    names = [f"{m}" if k is None else f"gram, restart every {k}" for m, k in columns]
    print(f"worst excess of the output singular values over the band, {args.steps} steps "
          f"(gram's default runs: " + ", ".join(f"{d} {gram_runs(args.steps, d)}" for d in args.dtypes) + ")")
    print("| schedule | dtype | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for schedule in args.schedules:
        for name in args.dtypes:
            dtype = getattr(torch, name)
            cells = [worst_excess(schedule, args.steps, dtype, m, k, args.seeds) for m, k in columns]
            print(f"| {schedule} | {name} | " + " | ".join(f"{c:.2g}" for c in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
