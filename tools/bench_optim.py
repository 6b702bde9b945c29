#!/usr/bin/env python
"""Seconds per matrix update of Muon, Shampoo, SOAP and AdamW on Qwen3-shaped matrices,
batched (one call on a stack of same-shape matrices) against looped (one call each).

    python tools/bench_optim.py                                   # CPU default, < 2 min on 2 cores
    python tools/bench_optim.py --device cuda --models qwen3-1.7b qwen3-8b --stack 8 --repeats 10
    python tools/bench_optim.py --models qwen3-tiny --shrink 1 --stack 16 --repeats 5  # small matrices
    python tools/bench_optim.py --optimizer muon --json bench.json --calibration-dir calib/
    python tools/bench_optim.py --optimizer muon --tiny-gpt 384 --ns-dtype float32 --threads 1 \
        --calibrate tools/calibrations/cpu-tiny-gpt-muon.json   # what tools/validate_simulate.py uses
    python tools/bench_optim.py --optimizer muon --models qwen3-32b --ns-dtype float32 \
        --muon-ns-method standard gram                           # gram against standard, per shape
    python tools/bench_optim.py --optimizer muon --exact-norm-cost  # the exact norm against torch's and the step

Shapes are the TP=1 matrices of each layer: fused QKV, attention output projection, fused
gate/up (fc1) and fc2; ``--shrink k`` divides every dimension by k (keeps aspect ratios)
so that CPU runs stay short. ``--tiny-gpt HIDDEN`` adds the Muon matrices of
tools/bench_step.py's tiny GPT (Q, K, V split as it splits them; never shrunk). Shampoo
and SOAP recompute their preconditioner every ``f`` steps; their steady-state time is
measured as ``plain + (refresh - plain) / f`` from a plain step and a refresh step timed
separately. FLOPs come from the project's cost model (megatron.canzona.planning.cost). The
matmul rate of the device is measured first, in every Newton-Schulz dtype of the run, and
Muon's rate is reported as a fraction of it. ``--muon-ns-method standard gram`` (and
several ``--ns-dtype``) times each Newton-Schulz method and dtype on the same matrices and
ends with a table of gram's time over standard's per shape, and the method ``auto`` picks.

``--calibrate FILE`` writes one calibration holding seconds per (optimizer, shape, dtype):
the first optimizer measured is the file's top level, a planning.cost.Calibration JSON
(``{"optimizer", "timings": [{"m", "n", "seconds"}]}``, what
megatron.canzona.planning.sim.load_calibration and tools/simulate.py read); every one is
under ``"optimizers"``; Muon's of each Newton-Schulz method measured under ``"muon_methods"``,
with ``auto`` (each shape's time of the method auto picks) where standard and gram both ran, so
``tools/simulate.py --muon-ns-method auto --calibration FILE`` projects from measured times;
``"measured"`` says when, where and how. ``seconds`` is the
batched time per matrix (as ``--calibration-dir``); ``looped_seconds`` the one-call-each.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron.canzona.cli import ArgumentParser, at_least
from megatron.canzona.optim import (
    AdamWConfig,
    AdamWState,
    MuonConfig,
    MuonState,
    ShampooConfig,
    ShampooState,
    SOAPConfig,
    SOAPState,
    adamw_update,
    muon_update,
    shampoo_update,
    soap_update,
)
from megatron.canzona.planning import OPTIMIZERS as MATRIX_OPTIMIZER_NAMES
from megatron.canzona.planning import Calibration, get_qwen3_config
from megatron.canzona.optim.exact_norm import frobenius_norm
from megatron.canzona.provenance import git_revision, machine
from megatron.canzona.planning.cost import (
    ADAMW_FLOPS_PER_ELEMENT,
    NS_METHODS,
    muon_flops,
    ns_method_for,
    shampoo_flops,
    soap_flops,
)

OPTIMIZERS = (*MATRIX_OPTIMIZER_NAMES, "adamw")


@dataclass(frozen=True)
class Kind:
    """How to build state, run and cost one optimizer."""

    config: Any
    state: Callable[[tuple[int, ...], torch.device], Any]
    update: Callable[[torch.Tensor, Any, Any], torch.Tensor]
    flops: Callable[[int, int], float]
    refresh_every: int  # 0: no periodic refresh


def muon_variants(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(Newton-Schulz method, dtype) pairs Muon is timed with, in the order given."""
    return [(method, dtype) for dtype in args.ns_dtype for method in args.muon_ns_method]


def muon_kind(method: str, ns_dtype: str) -> Kind:
    config = MuonConfig(ns_dtype=ns_dtype, ns_method=method)
    return Kind(config, lambda s, d: MuonState.create(s, device=d), muon_update,
                lambda m, n: muon_flops(m, n, config.num_ns_steps, method, ns_dtype), 0)


def make_kinds(args: argparse.Namespace) -> dict[str, Kind]:
    shampoo = ShampooConfig(precondition_frequency=args.precondition_frequency)
    soap = SOAPConfig(precondition_frequency=args.precondition_frequency)
    adamw = AdamWConfig()
    f = args.precondition_frequency
    return {
        "muon": muon_kind(*muon_variants(args)[0]),
        "shampoo": Kind(
            shampoo, lambda s, d: ShampooState.create(s, shampoo, device=d), shampoo_update,
            lambda m, n: shampoo_flops(m, n, precond_every=f, max_precond_dim=shampoo.max_precond_dim), f,
        ),
        "soap": Kind(
            soap, lambda s, d: SOAPState.create(s, soap, device=d), soap_update,
            lambda m, n: soap_flops(m, n, precond_every=f, max_precond_dim=soap.max_precond_dim), f,
        ),
        "adamw": Kind(
            adamw, lambda s, d: AdamWState.create(s, device=d), adamw_update,
            lambda m, n: ADAMW_FLOPS_PER_ELEMENT * m * n, 0,
        ),
    }


def qwen3_shapes(model: str, shrink: int) -> list[tuple[str, int, int]]:
    """(name, rows, cols) of the TP=1 matrices of one Qwen3 layer."""
    cfg = get_qwen3_config(model)
    hidden, ffn, heads = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads
    q_size = heads * cfg.kv_channels
    kv_size = cfg.num_query_groups * cfg.kv_channels
    shapes = [
        ("qkv", q_size + 2 * kv_size, hidden),
        ("proj", hidden, q_size),
        ("fc1", 2 * ffn, hidden),
        ("fc2", hidden, ffn),
    ]
    return [(name, max(1, m // shrink), max(1, n // shrink)) for name, m, n in shapes]


def tiny_gpt_shapes(hidden: int) -> list[tuple[str, int, int]]:
    """(name, rows, cols) of the Muon matrices of one layer of tools/bench_step.py's tiny GPT
    at ``hidden``: Q, K, V split (as bench_step's runs split them), proj, fused gate/up fc1
    and fc2, the SwiGLU size as bench_step derives it. Same shapes appear once."""
    from canzona_patches.harness.tiny_gpt import NUM_HEADS, NUM_QUERY_GROUPS, swiglu_ffn_hidden

    ffn = swiglu_ffn_hidden(hidden)
    head_dim = hidden // NUM_HEADS
    shapes = [
        ("q", NUM_HEADS * head_dim, hidden),
        ("kv", NUM_QUERY_GROUPS * head_dim, hidden),
        ("proj", hidden, NUM_HEADS * head_dim),
        ("fc1", 2 * ffn, hidden),
        ("fc2", hidden, ffn),
    ]
    seen: dict[tuple[int, int], str] = {}
    for name, m, n in shapes:
        seen[(m, n)] = f"{seen[(m, n)]}/{name}" if (m, n) in seen else name
    return [(name, m, n) for (m, n), name in seen.items()]


def shape_sources(args: argparse.Namespace) -> list[tuple[str, list[tuple[str, int, int]]]]:
    """(label, shapes) of every model measured: Qwen3 layers (shrunk), then tiny GPTs."""
    out = [(model, qwen3_shapes(model, args.shrink)) for model in args.models]
    return out + [(f"tiny-gpt-{h}", tiny_gpt_shapes(h)) for h in args.tiny_gpt]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_variant(kind: Kind, grads: torch.Tensor, batched: bool, args: argparse.Namespace) -> dict[str, float]:
    """Seconds per call of the whole stack: plain step, refresh step, steady-state mix."""
    device = grads.device
    stack = grads.shape[0]
    states = [kind.state(tuple(grads.shape), device)] if batched else [
        kind.state(tuple(grads.shape[1:]), device) for _ in range(stack)
    ]
    inputs = [grads] if batched else list(grads.unbind(0))

    def run(step_before: int) -> None:
        for state, grad in zip(states, inputs):
            state.step = step_before
            kind.update(grad, state, kind.config)

    run(0)  # step 1: the first eigendecompositions, not part of the steady state
    for _ in range(args.warmup):
        run(1)
    plain = median_seconds(lambda: run(1), args.repeats, device)  # step 2: no refresh for f > 1
    result = {"plain": plain, "steady": plain}
    if kind.refresh_every > 1:
        # Step f + 1 refreshes (steps 1, 1 + f, ...); amortise it over f steps.
        refresh = median_seconds(lambda: run(kind.refresh_every), args.repeats, device)
        result.update(refresh=refresh, steady=plain + (refresh - plain) / kind.refresh_every)
    return result


def measure_matmul_rate(device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 10) -> float:
    """Best square GEMM rate of this device in ``dtype``, FLOP/s (8192² on CUDA, 1024² on CPU)."""
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = min(median_seconds(lambda: a @ b, 1, device) for _ in range(repeats))
    return 2.0 * size**3 / best


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--optimizer", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    p.add_argument("--models", "--shapes", dest="models", nargs="+", default=None,
                   help="Qwen3 models whose layer shapes to use (default: qwen3-1.7b qwen3-8b)")
    p.add_argument("--tiny-gpt", nargs="+", type=at_least(1), default=[], metavar="HIDDEN",
                   help="also tools/bench_step.py's tiny GPT matrices at these hidden sizes (only these when "
                        "--models is not given)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="gradient dtype")
    p.add_argument("--ns-dtype", nargs="+", choices=("bfloat16", "float32"), default=["bfloat16"],
                   help="Muon Newton-Schulz dtype(s); several are timed in turn")
    p.add_argument("--muon-ns-method", nargs="+", choices=NS_METHODS, default=["standard"],
                   help="Muon Newton-Schulz method(s), the runtime's --muon-ns-method; several are timed in turn")
    p.add_argument("--stack", type=at_least(1), default=None, help="matrices per batched call (default: 4 on CPU, 8 on CUDA)")
    p.add_argument("--repeats", type=at_least(1), default=None, help="timed repeats, median reported (default: 3 CPU, 10 CUDA)")
    p.add_argument("--warmup", type=at_least(0), default=1, help="untimed plain steps before timing")
    p.add_argument("--shrink", type=at_least(1), default=None, help="divide every dimension by this (default: 8 on CPU, 1 on CUDA)")
    p.add_argument("--precondition-frequency", type=at_least(1), default=10, help="Shampoo/SOAP refresh every f steps")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--matmul-size", type=at_least(1), default=None,
                   help="side of the square GEMM the matmul rate is measured on (default: 8192 on CUDA, 1024 on CPU)")
    p.add_argument("--exact-norm-cost", action="store_true",
                   help="also time, per Muon shape, its Frobenius norm summed in integers (--canzona-exact-norm, "
                   "Megatron-FSDP's default) against torch's, and against Muon's whole update, in this run")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON ('-' for stdout only)")
    p.add_argument("--calibration-dir", metavar="DIR",
                   help="write <optimizer>.json calibrations (batched seconds per matrix) for tools/plan.py")
    p.add_argument("--calibrate", metavar="FILE",
                   help="write one calibration file, seconds per (optimizer, shape, dtype), for tools/simulate.py")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA build of torch and a visible GPU")
    if args.calibrate and not set(args.optimizer) - {"adamw"}:
        p.error("--calibrate needs a matrix optimizer: add --optimizer muon (or shampoo, soap)")
    if any(h < 4 or h % 4 for h in args.tiny_gpt):
        p.error(f"--tiny-gpt {args.tiny_gpt}: every hidden size must be a positive multiple of the 4 heads")
    if args.models is None:
        args.models = [] if args.tiny_gpt else (["qwen3-1.7b", "qwen3-8b"] if cuda else ["qwen3-1.7b"])
    args.stack = args.stack or (8 if cuda else 4)
    args.repeats = args.repeats or (10 if cuda else 3)
    args.shrink = args.shrink or (1 if cuda else 8)
    return args


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    kinds = make_kinds(args)
    report: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "git": git_revision(), "machine": machine(device),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "calibration_dir", "calibrate")},
        "optimizer_configs": {name: repr(kind.config) for name, kind in kinds.items() if name in args.optimizer},
        "rows": [],
    }
    report["matmul_flops_per_s"] = {}
    for ns_dtype in dict.fromkeys(["bfloat16", *args.ns_dtype] if device.type == "cuda" else args.ns_dtype):
        print(f"measuring the {ns_dtype} matmul rate ...", file=sys.stderr, flush=True)
        report["matmul_flops_per_s"][ns_dtype] = measure_matmul_rate(device, getattr(torch, ns_dtype), args.matmul_size)
    if "bfloat16" in report["matmul_flops_per_s"] and device.type == "cuda":
        report["bf16_matmul_peak_flops"] = report["matmul_flops_per_s"]["bfloat16"]
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, args.dtype)
    for model, shapes in shape_sources(args):
        for shape_name, m, n in shapes:
            grads = torch.randn(args.stack, m, n, device=device, generator=gen).to(dtype)
            for name in args.optimizer:
                for method, ns_dtype in muon_variants(args) if name == "muon" else [(None, None)]:
                    kind = muon_kind(method, ns_dtype) if name == "muon" else kinds[name]
                    label = f"{name} ({method}, {ns_dtype})" if name == "muon" else name
                    print(f"{model} {shape_name} {m}x{n} {label} ...", file=sys.stderr, flush=True)
                    row = bench_one(kind, name, model, shape_name, grads, args, report)
                    if name == "muon":
                        row.update(ns_method=method, ns_dtype=ns_dtype,
                                   ran=ns_method_for(m, n, kind.config.num_ns_steps, method, ns_dtype))
                        rate = report["matmul_flops_per_s"][ns_dtype]
                        row["fraction_of_matmul_rate"] = row["achieved_flops_per_s"] / rate
                        if args.exact_norm_cost:
                            row.update(norm_seconds(grads.float(), args))
                    report["rows"].append(row)
    return report


def norm_seconds(stack: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    """Seconds per matrix of a stack's Frobenius norms: torch's (one fp32 reduction) and the exact
    one (:func:`~megatron.canzona.optim.exact_norm.frobenius_norm`, as one device or a host takes it)."""
    count = stack.shape[0]
    torch_norm = median_seconds(lambda: torch.linalg.matrix_norm(stack, keepdim=True), args.repeats, stack.device)
    exact = median_seconds(lambda: frobenius_norm(stack, 1e-7), args.repeats, stack.device)
    return {"torch_norm_s": torch_norm / count, "exact_norm_s": exact / count}


def bench_one(kind: Kind, name: str, model: str, shape_name: str, grads: torch.Tensor,
              args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    stack, m, n = grads.shape
    looped = time_variant(kind, grads, batched=False, args=args)
    batched = time_variant(kind, grads, batched=True, args=args)
    flops = kind.flops(m, n)
    row = {
        "optimizer": name, "model": model, "matrix": shape_name, "m": m, "n": n, "stack": stack,
        "looped_s": looped["steady"] / stack, "batched_s": batched["steady"] / stack,
        "speedup": looped["steady"] / batched["steady"], "model_flops": flops,
        "achieved_flops_per_s": flops * stack / batched["steady"],
        "batched_plain_s": batched["plain"] / stack, "batched_refresh_s": batched.get("refresh", 0.0) / stack,
    }
    peak = report.get("bf16_matmul_peak_flops")
    if peak and name == "muon":
        row["fraction_of_bf16_peak"] = row["achieved_flops_per_s"] / peak
    return row


def format_report(report: dict[str, Any]) -> str:
    cfg, peak = report["config"], report.get("bf16_matmul_peak_flops")
    lines = [
        f"# {report['command']}",
        f"git {report['git']}  " + "  ".join(f"{k}={v}" for k, v in report["machine"].items()),
        f"models={cfg['models']} tiny_gpt={cfg['tiny_gpt']} shrink={cfg['shrink']} stack={cfg['stack']} "
        f"repeats={cfg['repeats']} "
        f"grad dtype={cfg['dtype']} muon ns_dtype={','.join(cfg['ns_dtype'])} "
        f"ns_method={','.join(cfg['muon_ns_method'])} "
        f"precondition_frequency={cfg['precondition_frequency']}",
    ]
    if peak:
        lines.append(f"bf16 matmul peak: {peak / 1e12:.1f} TFLOP/s")
    header = (f"{'optimizer':<8} {'model':<13} {'matrix':<7} {'shape':>11} {'stack':>5} {'looped s':>10} "
              f"{'batched s':>10} {'speedup':>7} {'GFLOP/upd':>10} {'GFLOP/s':>9}")
    header += f" {'of peak':>7}" if peak else ""
    lines += [header, "-" * len(header)]
    for r in report["rows"]:
        line = (f"{r['optimizer']:<8} {r['model']:<13} {r['matrix']:<7} {r['m']:>5}x{r['n']:<5} "
                f"{r['stack']:>5} {r['looped_s']:>10.4g} {r['batched_s']:>10.4g} {r['speedup']:>6.2f}x "
                f"{r['model_flops'] / 1e9:>10.3g} {r['achieved_flops_per_s'] / 1e9:>9.1f}")
        if "fraction_of_bf16_peak" in r:
            line += f" {100 * r['fraction_of_bf16_peak']:>6.1f}%"
        if "ns_method" in r:
            line += f"  {r['ns_method']}{'→' + r['ran'] if r['ns_method'] == 'auto' else ''}, {r['ns_dtype']}: " \
                    f"{100 * r['fraction_of_matmul_rate']:.0f}% of the {r['ns_dtype']} matmul rate"
        lines.append(line)
    lines.append("s = seconds per matrix update (steady state, refreshes amortised); "
                 "GFLOP/s = cost-model FLOPs / batched seconds")
    lines.append("matmul rate (square GEMM, this device): " + ", ".join(
        f"{dtype} {rate / 1e9:.1f} GFLOP/s" for dtype, rate in report.get("matmul_flops_per_s", {}).items()))
    lines += format_methods(report)
    lines += format_norms(report)
    return "\n".join(lines)


def format_norms(report: dict[str, Any]) -> list[str]:
    rows = [r for r in report["rows"] if "exact_norm_s" in r]
    if not rows:
        return []
    lines = ["", "Frobenius norm: summed in integers (exact) against torch's, and against Muon's update (one run)",
             f"{'model':<13} {'matrix':<7} {'shape':>11} {'torch s':>10} {'exact s':>10} {'exact/torch':>11} "
             f"{'exact/update':>12}"]
    for r in rows:
        lines.append(f"{r['model']:<13} {r['matrix']:<7} {r['m']:>5}x{r['n']:<5} {r['torch_norm_s']:>10.3g} "
                     f"{r['exact_norm_s']:>10.3g} {r['exact_norm_s'] / r['torch_norm_s']:>11.1f} "
                     f"{r['exact_norm_s'] / r['batched_s']:>12.3f}")
    return lines


def method_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per Muon shape and dtype timed with both methods: gram's batched time over standard's,
    the FLOP ratio of the cost model and the method ``auto`` picks."""
    muon = {(r["model"], r["matrix"], r["ns_dtype"], r["ns_method"]): r for r in report["rows"] if "ns_method" in r}
    out = []
    for (model, matrix, ns_dtype, method), standard in muon.items():
        gram = muon.get((model, matrix, ns_dtype, "gram"))
        if method != "standard" or gram is None:
            continue
        m, n = standard["m"], standard["n"]
        out.append({"model": model, "matrix": matrix, "m": m, "n": n, "ns_dtype": ns_dtype,
                    "standard_s": standard["batched_s"], "gram_s": gram["batched_s"],
                    "time_ratio": gram["batched_s"] / standard["batched_s"],
                    "flop_ratio": gram["model_flops"] / standard["model_flops"],
                    "auto": ns_method_for(m, n, 5, "auto", ns_dtype)})
    return out


def format_methods(report: dict[str, Any]) -> list[str]:
    rows = method_rows(report)
    if not rows:
        return []
    lines = ["", "Newton-Schulz: gram against standard (batched seconds per matrix, one run)",
             f"{'model':<13} {'matrix':<7} {'shape':>11} {'dtype':<9} {'standard s':>11} {'gram s':>10} "
             f"{'gram/std':>8} {'FLOPs':>6}  auto"]
    for r in rows:
        lines.append(f"{r['model']:<13} {r['matrix']:<7} {r['m']:>5}x{r['n']:<5} {r['ns_dtype']:<9} "
                     f"{r['standard_s']:>11.4g} {r['gram_s']:>10.4g} {r['time_ratio']:>8.2f} {r['flop_ratio']:>6.2f}  "
                     f"{r['auto']}")
    chosen = [r["time_ratio"] for r in rows if r["auto"] == "gram"]
    if chosen:
        lines.append(f"where auto picks gram: gram/standard {min(chosen):.2f} to {max(chosen):.2f}")
    return lines


def calibrated_rows(report: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The rows a calibration of ``name`` holds: Muon's of its first method and dtype."""
    cfg = report["config"]
    first = (cfg["muon_ns_method"][0], cfg["ns_dtype"][0])
    return [r for r in report["rows"] if r["optimizer"] == name
            and (name != "muon" or (r.get("ns_method"), r.get("ns_dtype")) == first)]


def write_calibrations(report: dict[str, Any], directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    for name in MATRIX_OPTIMIZER_NAMES:
        rows = calibrated_rows(report, name)
        if not rows:
            continue
        seconds = {(r["m"], r["n"]): r["batched_s"] for r in rows}
        method = report["config"]["muon_ns_method"][0] if name == "muon" else None
        with open(os.path.join(directory, f"{name}.json"), "w") as f:
            f.write(Calibration(optimizer=name, seconds=seconds, ns_method=method).to_json())


def muon_method_rows(report: dict[str, Any]) -> dict[str, dict[tuple[int, int], dict[str, Any]]]:
    """Muon's rows by Newton-Schulz method, in the run's first Newton-Schulz dtype, by shape. Where
    standard and gram were both measured, ``auto`` too: each shape's row of the method auto picks
    (what ``--muon-ns-method auto`` would time, from the same run)."""
    dtype = report["config"]["ns_dtype"][0]
    by_method: dict[str, dict[tuple[int, int], dict[str, Any]]] = {}
    for r in report["rows"]:
        if r["optimizer"] == "muon" and r.get("ns_dtype") == dtype:
            by_method.setdefault(r["ns_method"], {})[(r["m"], r["n"])] = r
    if {"standard", "gram"} <= set(by_method) and "auto" not in by_method:
        steps = MuonConfig().num_ns_steps
        by_method["auto"] = {(m, n): by_method[ns_method_for(m, n, steps, "auto", dtype)][(m, n)]
                             for m, n in by_method["standard"] if (m, n) in by_method["gram"]}
    return by_method


def calibration_document(report: dict[str, Any]) -> dict[str, Any]:
    """One calibration of every matrix optimizer measured (module docstring): the first is
    the top level, so that load_calibration reads it; all are under ``optimizers``, and Muon's
    of every Newton-Schulz method under ``muon_methods``."""
    cfg = report["config"]

    def entry(name: str, rows: dict[tuple[int, int], dict[str, Any]], method: str | None) -> dict[str, Any]:
        timings = [{"m": m, "n": n, "dtype": cfg["dtype"], "seconds": r["batched_s"], "looped_seconds": r["looped_s"],
                    "stack": r["stack"]} for (m, n), r in sorted(rows.items())]
        return {"optimizer": name, "dtype": cfg["dtype"], "ns_dtype": cfg["ns_dtype"][0] if name == "muon" else None,
                "ns_method": method, "timings": timings}

    entries: dict[str, Any] = {}
    for name in cfg["optimizer"]:
        rows = {(r["m"], r["n"]): r for r in calibrated_rows(report, name)}
        if name == "adamw" or not rows:
            continue
        entries[name] = entry(name, rows, cfg["muon_ns_method"][0] if name == "muon" else None)
    methods = {method: entry("muon", rows, method) for method, rows in muon_method_rows(report).items()}
    measured = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": report["command"], "git": report["git"], "machine": report["machine"],
                "repeats": cfg["repeats"], "warmup": cfg["warmup"],
                "precondition_frequency": cfg["precondition_frequency"]}
    return {**next(iter(entries.values())), "optimizers": entries, **({"muon_methods": methods} if methods else {}),
            "measured": measured}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run_benchmark(args)
    if args.json != "-":
        print(format_report(report))
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    if args.calibration_dir:
        write_calibrations(report, args.calibration_dir)
    if args.calibrate:
        os.makedirs(os.path.dirname(os.path.abspath(args.calibrate)), exist_ok=True)
        with open(args.calibrate, "w") as f:
            json.dump(calibration_document(report), f, indent=1)
            f.write("\n")
        print(f"wrote {args.calibrate}", file=sys.stderr)


if __name__ == "__main__":
    main()
