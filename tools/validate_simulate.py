#!/usr/bin/env python
"""Check the simulator where it can be measured: predicted against measured optimizer steps.

    python tools/probe_gloo.py                  # this box as clusters -> megatron/canzona/planning/sim/clusters/cpu-gloo-local{-2,}.toml
    python tools/bench_optim.py --optimizer muon --tiny-gpt 384 --ns-dtype float32 --threads 1 \\
        --calibrate tools/calibrations/cpu-tiny-gpt-muon.json
    python tools/validate_simulate.py --json validate.json       # ~8 min on 2 cores, waits for quiet first
    python tools/validate_simulate.py --reuse a.json b.json c.json  # predictions again; median of the runs
    python tools/validate_simulate.py --gb300-only               # the published-figure check alone
    python tools/validate_simulate.py --iteration --cases 2x1 2x2 --no-in-situ   # exposed optimizer time per iteration

Part 1 runs tools/bench_step.py (a subprocess per case: DP 2, DP 4, TP 2, TP 2 x DP 2 on
gloo) and predicts the same optimizer steps with megatron.canzona.planning.sim from the
probe's cluster files and the calibration (seconds per Muon update of each shape). What is
compared is what bench_step times, ``optimizer.step()`` without ``overlap_param_gather``:
the simulator's ``optimizer_step_seconds + param_gather_seconds``. bench_step's variants are
the simulator's strategies ``canzona``; ``sync`` at TP 1 (Moonlight's synchronous compute),
``canzona_tp_sync`` at TP > 1 (``--canzona-tp-mode sync``); ``megatron_layerwise``. It prints
predicted / measured per case and strategy, whether each lies within ±25% (``--tolerance``),
and whether the predicted ranking of the strategies is the measured one in every case.

A diagnostic column separates the compute term from the rest: bench_step at DP 1 (one
process, no communication) beside a second copy of itself (both cores busy, as in every
case) gives each variant's compute speed inside a real step over the calibration's; the
prediction redone at that speed leaves communication, overlap and core over-subscription
as what remains of the error (``--no-in-situ`` skips those two runs).

Part 2 checks the simulator against the one published measurement of Megatron-LM's
proposed layer-sharded Muon (NVIDIA/Megatron-LM issue #6676: optimizer step 632 -> 157 ms on
32 GB300, TP 2 x GTP 8 per weight, EP 8 x expert GTP 2, "production matrix shapes", model
not named) with the gb300-nvl72 preset: ``megatron_layerwise`` (duplicated) against
``layer_sharded``. GTP shards every weight further inside the TP group, so the 16-rank
TP x GTP domain is modelled as TP 16 (DP 2) and expert GTP as expert TP 2 (expert DP 2).

A benchmark, not a test: the machine is shared, so it waits (``--max-load``) until the
1-minute load average is low before every case, measures how many cores other processes
kept busy while the case ran (``/proc/stat`` less bench_step's own CPU time), re-runs a
case they disturbed (``--max-foreign``, ``--retries``) and reports both numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from megatron.canzona.cli import ArgumentParser, at_least, fraction, non_negative, positive
from megatron.canzona.planning import Calibration, CostModel, Qwen3Config, WireConfig, qwen3_specs
from megatron.canzona.planning.sim import ClusterSpec, StrategyResult, Workload, load_calibration, load_cluster, simulate
from megatron.canzona.planning.sim.cluster import PRESET_DIR
from megatron.canzona.planning.specs import ParamSpec
from megatron.canzona.provenance import ROOT, wait_for_quiet

CLUSTER_DIR = PRESET_DIR
DEFAULT_CLUSTERS = tuple(os.path.join(CLUSTER_DIR, f) for f in ("cpu-gloo-local-2.toml", "cpu-gloo-local.toml"))
"""tools/probe_gloo.py's files: 2 and 4 processes (a case takes the smallest that holds it)."""
DEFAULT_CALIBRATION = os.path.join(ROOT, "tools", "calibrations", "cpu-tiny-gpt-muon.json")
CASES = ((2, 1), (4, 1), (1, 2), (2, 2))
"""(DP, TP) of the measured cases."""
VARIANTS = ("canzona", "sync", "megatron")
"""bench_step's variants, in its order."""
EARLY = "canzona_early"
"""bench_step ``--iteration``'s ``canzona`` with early compute forced on gloo, validated with
``--iteration``. There each early gather is issued from the reduce-scatter's dispatch as on
NCCL, but the host waits for it there and computes a landed micro-group inside backward,
lengthening the measured forward-backward rather than beside it: it is predicted as the
simulator's early compute in that mode (``early_inline=True``: no reduce-scatter tail, every
group computed before the step, no memory bound)."""


def variants_for(iteration: bool) -> tuple[str, ...]:
    """The bench_step variants a run validates: :data:`EARLY` too with ``--iteration``."""
    return (*VARIANTS, EARLY) if iteration else VARIANTS
WIRE = WireConfig(param_bytes=4, grad_bytes=4)
"""bench_step's tiny GPT: fp32 parameters, gradients reduced in fp32."""
PUBLISHED = {"megatron_layerwise": 0.632, "layer_sharded": 0.157}
"""Megatron-LM issue #6676: optimizer step seconds, duplicated and layer-sharded Muon, 32 GB300."""
TIE = 0.01
"""Predicted steps closer than this are a tie: the simulator does not rank them."""
MIN_ROUNDS = 5
"""Paired rounds needed before the measurement orders two variants (all in one direction:
by chance with probability 2 / 2**5 = 6% for two equally fast variants)."""
GB300_MODELS = ("qwen3-235b-a22b", "qwen3-30b-a3b")
"""Models tried for #6676 (which names none); the first is the assumption (docs/projection.md: why)."""


def strategy_of(variant: str, tp_size: int) -> str:
    """The simulator's strategy for one of bench_step's variants."""
    if variant == "sync":
        return "sync" if tp_size == 1 else "canzona_tp_sync"
    return {"canzona": "canzona", EARLY: "canzona", "megatron": "megatron_layerwise"}[variant]


def tiny_gpt_specs(layers: int, hidden: int, ffn_hidden: int, tp_size: int) -> list[ParamSpec]:
    """What one rank of bench_step's tiny GPT holds (canzona_patches/harness/tiny_gpt.py): Qwen3's
    structure, 4 heads, 2 query groups, untied embeddings of its 128-token vocabulary, which
    Megatron's GPTModel takes unpadded; fp32 parameters; QKV split as its runs split it."""
    from canzona_patches.harness.tiny_gpt import NUM_HEADS, NUM_QUERY_GROUPS, SEQ_LEN, VOCAB

    cfg = Qwen3Config(name="bench-step-tiny-gpt", num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn_hidden,
                      num_attention_heads=NUM_HEADS, num_query_groups=NUM_QUERY_GROUPS,
                      kv_channels=hidden // NUM_HEADS, vocab_size=VOCAB, seq_length=SEQ_LEN)
    specs = qwen3_specs(cfg, tp_size=tp_size, split_qkv=True, dtype="float32")
    vocab_rows = ("embedding.word_embeddings.weight", "output_layer.weight")
    return [dataclasses.replace(s, global_shape=(VOCAB, hidden)) if s.name in vocab_rows else s for s in specs]


def layerwise_plans(specs: list[ParamSpec], dp_size: int, tp_size: int, ep_size: int = 1, expert_tp_size: int = 1,
                    bucket_size: int | None = None):
    """Megatron-Core's own layer-wise layouts (dense, expert), as tools/simulate.py builds them."""
    from canzona_patches.version import quiet_megatron_notices

    quiet_megatron_notices()
    from canzona_patches.integration.layerwise_baseline import plan_megatron_layerwise_stage

    return plan_megatron_layerwise_stage(specs, dp_size=dp_size, tp_size=tp_size, ep_size=ep_size,
                                         expert_tp_size=expert_tp_size, cost_model=CostModel(kind="muon"),
                                         bucket_size=bucket_size)


def timed_seconds(result: StrategyResult, variant: str = "canzona", iteration: bool = False) -> float:
    """What bench_step times: the step and the (not overlapped) parameter all-gather; with
    ``iteration`` (``bench_step --iteration``) the exposed optimizer time from the end of
    backward to the next forward, whose parameter all-gather overlaps that forward for the
    distributed optimizers (Canzona's) and runs inside Megatron's layer-wise step."""
    if not iteration:
        return result.optimizer_step_seconds + result.param_gather_seconds
    if variant == "megatron":
        return result.grad_reduce_exposed_seconds + result.optimizer_step_seconds + result.param_gather_seconds
    return result.exposed_optimizer_seconds


def iteration_workload(dp_size: int, forward_backward_s: float, cluster: ClusterSpec) -> Workload:
    """bench_step's iteration (one micro-batch of 2 sequences per DP rank) with the measured
    forward and backward: the simulator is checked on what the optimizer adds, not on MFU."""
    from canzona_patches.harness.tiny_gpt import SEQ_LEN

    tokens = 2 * SEQ_LEN
    per_token = forward_backward_s * cluster.gpu.bf16_tflops * 1e12 * cluster.mfu / tokens
    return Workload(global_batch=2 * dp_size, micro_batch=2, seq_length=SEQ_LEN, flops_per_token=per_token)


def at_speed(calibration: Calibration, cluster: ClusterSpec, factor: float) -> tuple[Calibration, ClusterSpec]:
    """The calibration and cluster with every compute term ``factor`` times slower."""
    seconds = {shape: t * factor for shape, t in calibration.seconds.items()}
    gpu = dataclasses.replace(cluster.gpu, memory_gb_per_s=cluster.gpu.memory_gb_per_s / factor)
    return Calibration(optimizer=calibration.optimizer, seconds=seconds), dataclasses.replace(cluster, gpu=gpu)


def predict_case(specs: list[ParamSpec], dp_size: int, tp_size: int, cluster: ClusterSpec, calibration: Calibration,
                 alpha: float, factors: dict[str, float] | None = None, *, bucket_size: int | None = None,
                 forward_backward: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """Per variant: the predicted timed seconds and the terms they are made of; with the FLOP
    formula instead of the calibration; and with compute at ``factors`` (the in-situ speed).
    ``forward_backward`` (seconds per variant, measured): predict ``bench_step --iteration``'s
    exposed optimizer time, the collectives overlapping a backward that long."""
    plans = layerwise_plans(specs, dp_size, tp_size, bucket_size=bucket_size)
    iteration = forward_backward is not None
    out = {}
    for variant in variants_for(iteration):
        strategy = strategy_of(variant, tp_size)
        kw = dict(strategy=strategy, dp_size=dp_size, tp_size=tp_size, optimizer="muon", wire=WIRE, alpha=alpha,
                  plan=plans[0] if strategy == "megatron_layerwise" else None, bucket_size=bucket_size,
                  workload=iteration_workload(dp_size, forward_backward[variant], cluster) if iteration else None)
        if variant == EARLY:
            kw.update(early_compute=True, early_compute_bytes=None, early_inline=True)
        r = simulate(specs, cluster=cluster, calibration=calibration, **kw)
        row: dict[str, Any] = {
            "strategy": strategy, "seconds": timed_seconds(r, variant, iteration),
            "step_compute_seconds": r.step_compute_seconds,
            "step_comm_exposed_seconds": r.step_comm_exposed_seconds, "param_gather_seconds": r.param_gather_seconds,
            "optimizer_step_seconds": r.optimizer_step_seconds, "compute_slowdown": r.details.get("compute_slowdown"),
            "grad_reduce_exposed_seconds": r.grad_reduce_exposed_seconds,
            "formula_seconds": timed_seconds(simulate(specs, cluster=cluster, calibration=None, **kw), variant, iteration),
        }
        if factors:
            cal, fast = at_speed(calibration, cluster, factors[variant])
            row["in_situ_seconds"] = timed_seconds(simulate(specs, cluster=fast, calibration=cal, **kw), variant,
                                                   iteration)
        out[variant] = row
    return out


def busy_cpu_seconds() -> float:
    """CPU seconds every core of the machine has spent busy since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished descendants (bench_step and its ranks)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench_step_once(dp_size: int, tp_size: int, args: argparse.Namespace, copies: int = 1) -> list[dict[str, Any]]:
    """tools/bench_step.py as ``copies`` concurrent subprocesses; their JSON reports, with the
    load before and the cores other processes kept busy meanwhile (all busy CPU time less
    bench_step's own)."""
    loads = wait_for_quiet(args.max_load, args.max_wait)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"step{k}.json") for k in range(copies)]
        cmds = [[sys.executable, os.path.join(ROOT, "tools", "bench_step.py"), "--dp", str(dp_size), "--tp",
                 str(tp_size), "--layers", str(args.layers), "--hidden", str(args.hidden), "--steps", str(args.steps),
                 "--rounds", str(args.rounds), "--warmup", str(args.warmup), *bench_step_extra(args), "--json", path]
                for path in paths]
        print(f"[validate] {copies} x {' '.join(cmds[0][1:-2])} (1-min load {loads[-1]:.2f})", file=sys.stderr,
              flush=True)
        busy, own, start = busy_cpu_seconds(), children_cpu_seconds(), time.monotonic()
        procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
                 for cmd in cmds]
        errors = [proc.communicate()[1] for proc in procs]
        wall = time.monotonic() - start
        foreign = max(0.0, (busy_cpu_seconds() - busy) - (children_cpu_seconds() - own)) / wall
        for proc, err in zip(procs, errors):
            if proc.returncode:
                raise RuntimeError(f"bench_step failed ({proc.returncode}):\n{err[-3000:]}")
        reports = []
        for path in paths:
            with open(path) as f:
                reports.append(json.load(f))
    for report in reports:
        report.update(load_average_1min_before=loads[-1], load_average_1min_waited=loads[:-1], foreign_cores=foreign)
    return reports


def bench_step_extra(args: argparse.Namespace) -> list[str]:
    """bench_step's flags for ``--iteration`` and ``--bucket-size``."""
    out = ["--iteration"] if args.iteration else []
    return out + (["--bucket-size", str(args.bucket_size)] if args.bucket_size else [])


def run_bench_step(dp_size: int, tp_size: int, args: argparse.Namespace, copies: int = 1) -> list[dict[str, Any]]:
    """bench_step for one case, run again (``--retries``) while other processes used more than
    ``--max-foreign`` cores during it; the cleanest run, with every attempt's medians."""
    runs = []
    for _ in range(1 + args.retries):
        runs.append(bench_step_once(dp_size, tp_size, args, copies))
        print(f"[validate] other processes used {runs[-1][0]['foreign_cores']:.2f} cores meanwhile", file=sys.stderr,
              flush=True)
        if runs[-1][0]["foreign_cores"] <= args.max_foreign:
            break
    best = min(runs, key=lambda r: r[0]["foreign_cores"])
    attempts = [{"foreign_cores": r[0]["foreign_cores"], "median_step_ms": [c["median_step_ms"] for c in r]}
                for r in runs]
    for report in best:
        report["attempts"] = attempts
    return best


def in_situ(args: argparse.Namespace, clusters: list[ClusterSpec], calibration: Calibration,
            reused: list[dict] | None) -> dict[str, Any]:
    """How much slower each variant computes inside bench_step than the calibration says: its
    DP 1 step (one process, no communication) alone, and beside a second copy (both cores
    busy, as in every validated case), over the simulator's DP 1 prediction (the median over
    reused runs)."""
    runs = reused or [{"solo": run_bench_step(1, 1, args)[0], "pair": run_bench_step(1, 1, args, copies=2)}]
    specs = tiny_gpt_specs(args.layers, args.hidden, args.ffn_hidden, 1)
    predicted = predict_case(specs, 1, 1, pick_cluster(clusters, 1), calibration, args.alpha)
    factors = {}
    for v in VARIANTS:
        base = 1e3 * predicted[v]["seconds"]
        factors[v] = {"solo": statistics.median(r["solo"]["median_step_ms"][v] / base for r in runs),
                      "pair": statistics.median(statistics.mean(c["median_step_ms"][v] for c in r["pair"]) / base
                                                for r in runs)}
    print("in-situ compute speed, bench_step at DP 1 over the prediction (alone; beside a second copy): "
          + ", ".join(f"{v} {f['solo']:.2f}; {f['pair']:.2f}" for v, f in factors.items()), flush=True)
    return {"runs": [{"solo": r["solo"], "pair": r["pair"]} for r in runs], "factors": factors}


def ranking(times: dict[str, float]) -> str:
    """Fastest first, ``<`` between strategies, ``≈`` within :data:`TIE` of each other."""
    names = sorted(times, key=times.__getitem__)
    out = names[0]
    for a, b in zip(names, names[1:]):
        out += f" {'≈' if times[b] / times[a] - 1 < TIE else '<'} {b}"
    return out


def step_seconds(runs: list[dict[str, Any]], variant: str) -> list[float]:
    """Every timed step of ``variant`` over bench_step reports (seconds); a report without
    per-round steps (older files) counts by its median."""
    out = []
    for r in runs:
        rounds = (r.get("round_step_ms") or {}).get(variant)
        out += [t / 1e3 for rnd in rounds for t in rnd] if rounds else [r["median_step_ms"][variant] / 1e3]
    return out


def round_medians(runs: list[dict[str, Any]], variant: str) -> list[float]:
    """The median step of ``variant`` in each round of each report (a report without rounds: one)."""
    out = []
    for r in runs:
        rounds = (r.get("round_step_ms") or {}).get(variant)
        out += [statistics.median(rnd) / 1e3 for rnd in rounds] if rounds else [r["median_step_ms"][variant] / 1e3]
    return out


def measured_order(a: list[float], b: list[float]) -> int:
    """+1 when ``b`` was slower than ``a`` in every one of at least :data:`MIN_ROUNDS` paired
    rounds, -1 when faster in every one, 0 when the rounds disagree (the measurement does not
    order them). Rounds pair up because bench_step runs the variants round by round."""
    if len(a) != len(b) or len(a) < MIN_ROUNDS:
        return 0
    signs = {(y > x) - (y < x) for x, y in zip(a, b)}
    return signs.pop() if len(signs) == 1 else 0


def pair_verdicts(predicted: dict[str, float], rounds: dict[str, list[float]]) -> dict[str, str]:
    """Per pair of strategies: ``right`` or ``wrong`` where the measurement orders them
    (:func:`measured_order`); ``tie`` where it does but the prediction is within :data:`TIE`
    (unranked: not right); ``unresolved`` where the measured rounds disagree."""
    out = {}
    for a, b in itertools.combinations(predicted, 2):
        gap = predicted[b] / predicted[a] - 1
        order = measured_order(rounds[a], rounds[b])
        if order == 0:
            out[f"{a}/{b}"] = "unresolved"
        elif abs(gap) < TIE:
            out[f"{a}/{b}"] = "tie"
        else:
            out[f"{a}/{b}"] = "right" if (gap > 0) == (order > 0) else "wrong"
    return out


def ranking_right(verdicts: dict[str, str]) -> bool:
    """No pair the measurement orders is predicted the other way round or tied."""
    return all(v in ("right", "unresolved") for v in verdicts.values())


def pick_cluster(clusters: list[ClusterSpec], world: int) -> ClusterSpec:
    """The probe measured with the fewest processes that still holds ``world`` ranks."""
    fits = [c for c in clusters if c.gpus_per_node >= world]
    if not fits:
        raise ValueError(f"no --clusters file holds {world} ranks on one node; run tools/probe_gloo.py --ranks {world}")
    return min(fits, key=lambda c: c.gpus_per_node)


def validate(args: argparse.Namespace, clusters: list[ClusterSpec], calibration: Calibration,
             factors: dict[str, float] | None, reused: dict | None) -> list[dict[str, Any]]:
    """Every case: measured (or reused) and predicted, ratios and verdicts."""
    rows = []
    for dp_size, tp_size in args.cases:
        runs = (reused or {}).get(f"{dp_size}x{tp_size}") or [run_bench_step(dp_size, tp_size, args)[0]]
        specs = tiny_gpt_specs(args.layers, args.hidden, args.ffn_hidden, tp_size)
        cluster = pick_cluster(clusters, dp_size * tp_size)
        variants = variants_for(args.iteration)
        forward_backward = ({v: statistics.median(r["median_forward_backward_ms"][v] for r in runs) / 1e3
                             for v in variants} if args.iteration else None)
        predicted = predict_case(specs, dp_size, tp_size, cluster, calibration, args.alpha, factors,
                                 bucket_size=args.bucket_size, forward_backward=forward_backward)
        row: dict[str, Any] = {"dp_size": dp_size, "tp_size": tp_size, "cluster": cluster.name, "variants": {},
                               "bench_steps": runs}
        rounds = {v: round_medians(runs, v) for v in variants}
        for variant in variants:
            each = [r["median_step_ms"][variant] / 1e3 for r in runs]
            m = statistics.median(step_seconds(runs, variant))
            p = predicted[variant]
            row["variants"][variant] = {**p, "measured_seconds": m, "measured_runs": each, "round_medians": rounds[variant],
                                        "run_spread": (max(each) - min(each)) / m, "ratio": p["seconds"] / m,
                                        "formula_ratio": p["formula_seconds"] / m,
                                        "in_situ_ratio": p.get("in_situ_seconds", math.nan) / m,
                                        "within": abs(p["seconds"] / m - 1) <= args.tolerance}
        pred = {v: row["variants"][v]["seconds"] for v in variants}
        meas = {v: row["variants"][v]["measured_seconds"] for v in variants}
        for v in variants:  # speed-ups cancel the machine's drift between runs, absolute times do not
            row["variants"][v]["to_sync_ratio"] = (pred[v] / pred["sync"]) / (meas[v] / meas["sync"])
        pairs = pair_verdicts(pred, rounds)
        row.update(predicted_ranking=ranking(pred), measured_ranking=ranking(meas), pairs=pairs,
                   ranking_right=ranking_right(pairs), measured_gap=_closest_gap(meas),
                   resolved_pairs=sum(v != "unresolved" for v in pairs.values()), rounds=len(rounds["sync"]))
        if factors:
            situ = {v: row["variants"][v]["in_situ_seconds"] for v in VARIANTS}
            situ_pairs = pair_verdicts(situ, rounds)
            row.update(in_situ_ranking=ranking(situ), in_situ_pairs=situ_pairs,
                       in_situ_ranking_right=ranking_right(situ_pairs))
        rows.append(row)
        print_case(row)
    return rows


def _verdict(pairs: dict[str, str], right: bool) -> str:
    """``right`` or ``NOT right`` with the pairs that are not, and the pairs the rounds left unordered."""
    bad = [f"{p} {v}" for p, v in pairs.items() if v not in ("right", "unresolved")]
    open_pairs = [p for p, v in pairs.items() if v == "unresolved"]
    out = "right" if right else "NOT right: " + ", ".join(bad)
    return out + (f" (not ordered by the measurement: {', '.join(open_pairs)})" if open_pairs else "")


def _closest_gap(times: dict[str, float]) -> float:
    """Relative gap between the two closest measured strategies (a near tie ranks by noise)."""
    ordered = sorted(times.values())
    return min(b / a - 1 for a, b in zip(ordered, ordered[1:]))


def print_case(row: dict[str, Any]) -> None:
    case = f"DP {row['dp_size']} x TP {row['tp_size']}"
    for variant, v in row["variants"].items():
        runs = "/".join(f"{1e3 * t:.0f}" for t in v["measured_runs"])
        to_sync = "" if variant == "sync" else f"{v['to_sync_ratio']:.2f}"
        print(f"| {case} | {variant} ({v['strategy']}) | {1e3 * v['seconds']:.0f} | "
              f"{1e3 * v['measured_seconds']:.0f} ({runs}) | {v['ratio']:.2f} | {'yes' if v['within'] else 'NO'} | "
              f"{v['in_situ_ratio']:.2f} | {to_sync} | {1e3 * v['step_compute_seconds']:.0f} | "
              f"{1e3 * v['step_comm_exposed_seconds']:.1f} | {1e3 * v['param_gather_seconds']:.1f} |", flush=True)
    verdict = _verdict(row["pairs"], row["ranking_right"])
    if "in_situ_pairs" in row:
        verdict += f"; in-step: {_verdict(row['in_situ_pairs'], row['in_situ_ranking_right'])}"
    loads = ", ".join(f"{r.get('load_average_1min_before', math.nan):.2f}" for r in row["bench_steps"])
    foreign = ", ".join(f"{r.get('foreign_cores', math.nan):.2f}" for r in row["bench_steps"])
    print(f"| {case} | ranking | {row['predicted_ranking']} | {row['measured_ranking']} | {verdict} | | "
          f"{row.get('in_situ_ranking', '')} | | {row['cluster']} | load before: {loads} | others' cores: "
          f"{foreign} |", flush=True)


TABLE_HEADER = ("| case | variant (strategy) | predicted (ms) | measured (ms): median (runs) | predicted / measured | "
                "within ±25% | in-situ compute: predicted / measured | step / sync: predicted / measured | "
                "of which compute (ms) | exposed step comm (ms) | param all-gather (ms) |\n"
                + "|---" * 11 + "|")


def gtp_specs(model: str, domain: int, ep_size: int, expert_tp_size: int) -> list[ParamSpec]:
    """A Qwen3 model's specs with every dense weight sharded over the TP x GTP ``domain``
    (GTP cuts weights, not heads, so the head-count check of qwen3_specs does not apply)."""
    specs = qwen3_specs(model, tp_size=1, ep_size=ep_size, expert_tp_size=expert_tp_size, split_qkv=True)
    return [s if s.is_expert else dataclasses.replace(s, tp_size=domain) for s in specs]


def gb300_check(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Predicted duplicated and layer-sharded steps of #6676's layout on the GB300 preset."""
    cluster = load_cluster(os.path.join(CLUSTER_DIR, "gb300-nvl72.toml"))
    domain, dp_size, ep_size, etp = 16, 2, 8, 2  # TP 2 x GTP 8; 32 GPUs; EP 8 x expert GTP 2
    rows = []
    for model in args.gb300_models:
        specs = gtp_specs(model, domain, ep_size, etp)
        plan, expert_plan = layerwise_plans(specs, dp_size, domain, ep_size, etp)
        row: dict[str, Any] = {"model": model, "dp_size": dp_size, "tp_size": domain, "ep_size": ep_size,
                               "expert_tp_size": etp, "strategies": {}}
        for strategy, published in PUBLISHED.items():
            r = simulate(specs, strategy=strategy, cluster=cluster, dp_size=dp_size, tp_size=domain, ep_size=ep_size,
                         expert_tp_size=etp, optimizer="muon", plan=plan, expert_plan=expert_plan)
            row["strategies"][strategy] = {
                "predicted_seconds": r.optimizer_step_seconds, "published_seconds": published,
                "ratio": r.optimizer_step_seconds / published, "step_compute_seconds": r.step_compute_seconds,
                "step_comm_exposed_seconds": r.step_comm_exposed_seconds}
        s = row["strategies"]
        row["predicted_speedup"] = (s["megatron_layerwise"]["predicted_seconds"]
                                    / s["layer_sharded"]["predicted_seconds"])
        row["published_speedup"] = PUBLISHED["megatron_layerwise"] / PUBLISHED["layer_sharded"]
        rows.append(row)
    return rows


def print_gb300(rows: list[dict[str, Any]]) -> None:
    print("\nMegatron-LM #6676 on gb300-nvl72 (32 GPUs: TP x GTP 16, DP 2, EP 8, expert TP 2; FLOP model, "
          "no calibration)")
    print("| model | strategy | predicted step (ms) | published (ms) | predicted / published | of which compute (ms) "
          "| exposed comm (ms) |\n|---|---|---|---|---|---|---|")
    for row in rows:
        for name, s in row["strategies"].items():
            print(f"| {row['model']} | {name} | {1e3 * s['predicted_seconds']:.0f} | "
                  f"{1e3 * s['published_seconds']:.0f} | {s['ratio']:.2f} | {1e3 * s['step_compute_seconds']:.0f} | "
                  f"{1e3 * s['step_comm_exposed_seconds']:.0f} |")
        print(f"| {row['model']} | speed-up | {row['predicted_speedup']:.2f}x | {row['published_speedup']:.2f}x | "
              f"{row['predicted_speedup'] / row['published_speedup']:.2f} | | |")


def summary(rows: list[dict[str, Any]], tolerance: float) -> dict[str, Any]:
    variants = [v for r in rows for v in r["variants"].values()]
    ratios = [v["ratio"] for v in variants]
    out = {"within_tolerance": all(v["within"] for v in variants), "within_count": sum(v["within"] for v in variants),
           "count": len(variants), "ranking_right_everywhere": all(r["ranking_right"] for r in rows),
           "ranking_right_count": sum(r["ranking_right"] for r in rows), "ratio_min": min(ratios),
           "ratio_max": max(ratios), "tolerance": tolerance,
           "pairs_resolved": sum(r["resolved_pairs"] for r in rows), "pairs": sum(len(r["pairs"]) for r in rows)}
    situ = [v["in_situ_ratio"] for v in variants if not math.isnan(v["in_situ_ratio"])]
    if situ:
        out.update(in_situ_within_tolerance=all(abs(x - 1) <= tolerance for x in situ),
                   in_situ_within_count=sum(abs(x - 1) <= tolerance for x in situ), in_situ_ratio_min=min(situ),
                   in_situ_ratio_max=max(situ),
                   in_situ_ranking_right_count=sum(r["in_situ_ranking_right"] for r in rows))
    to_sync = [v["to_sync_ratio"] for v in variants if v["strategy"] not in ("sync", "canzona_tp_sync")]
    out.update(to_sync_within_count=sum(abs(x - 1) <= tolerance for x in to_sync), to_sync_count=len(to_sync),
               to_sync_ratio_min=min(to_sync), to_sync_ratio_max=max(to_sync),
               run_spread_max=max(v["run_spread"] for v in variants))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clusters", nargs="+", default=list(DEFAULT_CLUSTERS),
                   help="the probe's cluster files (tools/probe_gloo.py); each case takes the smallest holding it")
    p.add_argument("--calibration", default=DEFAULT_CALIBRATION,
                   help="Muon seconds per shape (tools/bench_optim.py --calibrate)")
    p.add_argument("--cases", nargs="+", default=[f"{d}x{t}" for d, t in CASES], metavar="DPxTP",
                   help="cases to measure, DP x TP (default: 2x1 4x1 1x2 2x2)")
    p.add_argument("--layers", type=at_least(1), default=4, help="bench_step --layers")
    p.add_argument("--hidden", type=at_least(1), default=384, help="bench_step --hidden")
    p.add_argument("--steps", type=at_least(1), default=4, help="bench_step --steps")
    p.add_argument("--rounds", type=at_least(1), default=MIN_ROUNDS,
                   help=f"bench_step --rounds (the ranking needs >= {MIN_ROUNDS} over the runs of a case)")
    p.add_argument("--warmup", type=at_least(0), default=3,
                   help="bench_step --warmup (Megatron's layer-wise Muon settles over its first 2-3 steps)")
    p.add_argument("--alpha", type=fraction, default=0.5, help="Canzona planner balance knob (bench_step's default)")
    p.add_argument("--tolerance", type=positive, default=0.25, help="target |predicted / measured - 1|")
    p.add_argument("--max-load", type=non_negative, default=1.0, help="wait until the 1-minute load average is below this")
    p.add_argument("--max-wait", type=non_negative, default=900.0, help="seconds to wait for it at most, per case")
    p.add_argument("--max-foreign", type=fraction, default=0.15,
                   help="re-measure a case when other processes kept more cores than this busy during it")
    p.add_argument("--retries", type=at_least(0), default=2, help="re-measurements per case at most (the cleanest is kept)")
    p.add_argument("--no-in-situ", dest="in_situ", action="store_false",
                   help="skip the DP 1 runs that measure each variant's compute speed inside bench_step")
    p.add_argument("--reuse", metavar="FILE", nargs="+",
                   help="take the measurements from earlier --json files instead of running (several: their median)")
    p.add_argument("--gb300-only", action="store_true", help="only the Megatron-LM #6676 check (no measurements)")
    p.add_argument("--gb300-models", nargs="+", default=list(GB300_MODELS), help="models for the #6676 check")
    p.add_argument("--iteration", action="store_true",
                   help="validate bench_step --iteration: the exposed optimizer time per iteration (end of backward "
                   "to the next forward), grad reduce and param gather overlapped; no in-situ runs")
    p.add_argument("--bucket-size", type=at_least(1), default=None,
                   help="bench_step --bucket-size (default: Megatron's; 1000000 with --iteration, so buckets overlap)")
    p.add_argument("--json", metavar="FILE", help="also write everything as JSON")
    args = p.parse_args(argv)
    if args.iteration:
        args.in_situ = False  # its DP 1 factors are for the step alone
        args.bucket_size = args.bucket_size or 1_000_000
    try:
        args.cases = [tuple(int(x) for x in case.lower().split("x")) for case in args.cases]
    except ValueError:
        p.error(f"--cases {args.cases}: write each case as DPxTP, e.g. 2x1 or 2x2")
    if any(len(c) != 2 or min(c) < 1 for c in args.cases):
        p.error(f"--cases {args.cases}: write each case as DPxTP with positive sizes, e.g. 2x1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron.canzona.provenance import git_revision, machine
    from canzona_patches.harness.tiny_gpt import swiglu_ffn_hidden

    args.ffn_hidden = swiglu_ffn_hidden(args.hidden)
    report: dict[str, Any] = {"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
                              "git_revision": git_revision(), "machine": machine(),
                              "started": time.strftime("%F %T %z")}
    if not args.gb300_only:
        clusters, calibration = [load_cluster(c) for c in args.clusters], load_calibration(args.calibration)
        reused = None
        if args.reuse:
            reused = {"in_situ": []}
            for path in args.reuse:
                with open(path) as f:
                    old = json.load(f)
                for r in old["cases"]:
                    reused.setdefault(f"{r['dp_size']}x{r['tp_size']}", []).extend(
                        r.get("bench_steps") or [r["bench_step"]])
                reused["in_situ"] += (old.get("in_situ") or {}).get("runs") or []
        report["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "gb300_models")}
        report["clusters"] = [c.to_dict() for c in clusters]
        factors = None
        if args.in_situ:
            report["in_situ"] = in_situ(args, clusters, calibration, (reused or {}).get("in_situ") or None)
            factors = {v: f["pair"] for v, f in report["in_situ"]["factors"].items()}
        measured = "exposed optimizer time per iteration" if args.iteration else "optimizer step"
        print(f"bench_step's {measured}, predicted (clusters {', '.join(c.name for c in clusters)}, calibration "
              f"{os.path.basename(args.calibration)}) against measured; {args.layers} layers, hidden {args.hidden}")
        print(TABLE_HEADER)
        report["cases"] = validate(args, clusters, calibration, factors, reused)
        report["summary"] = s = summary(report["cases"], args.tolerance)
        print(f"kernel calibration: within ±{100 * args.tolerance:.0f}%: {s['within_count']}/{s['count']} (ratios "
              f"{s['ratio_min']:.2f} to {s['ratio_max']:.2f}); ranking right in {s['ranking_right_count']}/"
              f"{len(report['cases'])} cases ({s['pairs_resolved']} of {s['pairs']} pairs ordered by the measurement: "
              f"slower in all of >= {MIN_ROUNDS} paired rounds; a predicted tie, within {100 * TIE:.0f}%, of an "
              f"ordered pair counts as not right)")
        if "in_situ_within_count" in s:
            print(f"in-step calibration (bench_step at DP 1): within ±{100 * args.tolerance:.0f}%: {s['in_situ_within_count']}/"
                  f"{s['count']} (ratios {s['in_situ_ratio_min']:.2f} to {s['in_situ_ratio_max']:.2f}); ranking right "
                  f"in {s['in_situ_ranking_right_count']}/{len(report['cases'])} cases")
        print(f"step / sync step (drift between runs cancels): within ±{100 * args.tolerance:.0f}%: "
              f"{s['to_sync_within_count']}/{s['to_sync_count']} (ratios {s['to_sync_ratio_min']:.2f} to "
              f"{s['to_sync_ratio_max']:.2f}); the measured runs spread by up to {100 * s['run_spread_max']:.0f}%")
    report["gb300"] = gb300_check(args)
    print_gb300(report["gb300"])
    report["finished"] = time.strftime("%F %T %z")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
