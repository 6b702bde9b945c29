#!/usr/bin/env python
"""Plan Canzona's data- and tensor-parallel work split for a Qwen3 model and compare layouts.

    python tools/plan.py --model qwen3-32b --tp 8 --dp 32 --compare --plot loads.png
    python tools/plan.py --model qwen3-8b --tp 2 --dp 64 --optimizer soap --json
    python tools/plan.py --model qwen3-30b-a3b --ep 8 --dp 64 --split-qkv --compare   # MoE: expert buffers too
    python tools/plan.py --model qwen3-235b-a22b --tp 4 --ep 8 --pp 8 --dp 8 --split-qkv \
        --decoder-first-pipeline-num-layers 11 --decoder-last-pipeline-num-layers 11
    python tools/plan.py --cases --plot cases.png   # docs/planner.md's case matrix
    python tools/plan.py --moe-cases --split-qkv    # docs/planner.md's MoE table
    python tools/plan.py --fsdp-cases               # docs/fsdp.md's memory table (Megatron-FSDP)
    python tools/plan.py --model qwen3-32b --tp 4 --dp 64 --fsdp   # one layout under Megatron-FSDP
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from megatron.canzona.cli import ArgumentParser, at_least, fraction, positive
from megatron.canzona.curves import save_figure
from megatron.canzona.planning import (
    NS_METHODS,
    OPTIMIZERS,
    DEFAULT_ALPHA,
    EXPERT_LAYOUTS,
    LAYOUTS,
    QWEN3_MODELS,
    Calibration,
    CanzonaPlan,
    CostModel,
    WireConfig,
    combined_lower_bound,
    expert_dp_size,
    get_qwen3_config,
    lower_bound,
    make_plan,
    plan_eq1,
    plan_hosts,
    plan_zero1,
    qwen3_specs,
    split_experts,
    stage_layer_counts,
    summarize_canzona,
    summarize_plan,
    summarize_sync,
    with_experts,
)
from megatron.canzona.planning.fsdp import SHARDING_STRATEGIES
from megatron.canzona.planning.geometry import default_bucket_size
from megatron.canzona.planning.megatron_main import plan_megatron_main
from megatron.canzona.provenance import git_revision

STRATEGIES = ("canzona", "canzona_other", "eq1", "megatron_layerwise", "megatron_main", "zero1")
"""``canzona`` is the ``--layout`` plan; ``canzona_other`` (with ``--compare``) stands for the
other Canzona layout and is reported as ``canzona_lean`` or ``canzona_whole``."""
CASES = (
    ("qwen3-1.7b", 1, (8, 32, 64, 128, 256)),
    ("qwen3-8b", 2, (16, 64, 128, 256)),
    ("qwen3-14b", 4, (8, 32, 64, 128)),
    ("qwen3-32b", 8, (8, 16, 32, 64, 128, 256)),
)
FSDP_CASES = (("qwen3-8b", 1, 1, (64, 256)), ("qwen3-32b", 4, 1, (64, 256)), ("qwen3-30b-a3b", 1, 8, (64, 256)))
"""Model, TP, EP, FSDP sizes of docs/fsdp.md's memory table (``--fsdp-cases``; experts over
expert-DP = FSDP / EP, expert TP 1), for each optimizer and NorMuon (``adaptive_muon`` whose second
moment is one per row or column)."""
FSDP_OPTIMIZERS = tuple((o, o, "adamuon") for o in OPTIMIZERS) + (("normuon", "adaptive_muon", "normuon"),)
MOE_CASES = (  # model, TP, EP, expert TP, PP, first/last stage layers, DPs
    ("qwen3-30b-a3b", 1, 8, 1, 1, None, (32, 64, 256)),
    ("qwen3-235b-a22b", 4, 8, 1, 8, 11, (4, 8)),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b", help=f"one of: {', '.join(QWEN3_MODELS)}")
    p.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=at_least(1), default=1, help="tensor-parallel size")
    p.add_argument("--dp", "--data-parallel-size", dest="dp", type=at_least(1), default=8, help="data-parallel size")
    p.add_argument("--cp", "--context-parallel-size", dest="cp", type=at_least(1), default=1,
                   help="context-parallel size: the plan spans DP x CP ranks, as Megatron's DDP reduces over them")
    p.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=at_least(1), default=1,
                   help="expert-parallel size (MoE models): each EP rank holds num_experts/EP local experts")
    p.add_argument("--etp", "--expert-tensor-parallel-size", dest="etp", type=at_least(1), default=1,
                   help="expert tensor-parallel size (default 1 here; Megatron's own default is ETP = TP)")
    p.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=at_least(1), default=1,
                   help="pipeline stages: every stage is planned, the busiest one reported")
    p.add_argument("--decoder-first-pipeline-num-layers", dest="first_stage_layers", type=at_least(0), default=None,
                   help="layers of the first pipeline stage when PP does not divide the layers")
    p.add_argument("--decoder-last-pipeline-num-layers", dest="last_stage_layers", type=at_least(0), default=None,
                   help="layers of the last pipeline stage when PP does not divide the layers")
    p.add_argument("--expert-layout", choices=EXPERT_LAYOUTS, default="sequential",
                   help="module holding the experts: SequentialMLP, TE GroupedMLP, legacy GroupedMLP (stacked)")
    p.add_argument("--no-joint-balance", dest="joint_balance", action="store_false",
                   help="plan dense and expert buffers each on its own (for comparison)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="muon", help="matrix optimizer whose cost is balanced")
    p.add_argument("--cost", choices=("flops", "numel"), default="flops", help="balance optimizer FLOPs or element counts")
    p.add_argument("--muon-ns-method", choices=NS_METHODS, default="standard",
                   help="Muon's Newton-Schulz whose FLOPs are balanced (the runtime's --muon-ns-method)")
    p.add_argument("--muon-ns-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype Muon's Newton-Schulz iterates in (gram restarts every 2 steps in bf16)")
    p.add_argument("--calibration", metavar="FILE", help="JSON of measured seconds per shape (replaces the FLOP formulas)")
    p.add_argument("--alpha", type=fraction, default=DEFAULT_ALPHA, help="0 favours equal chunk sizes, 1 equal compute")
    p.add_argument("--layout", "--canzona-layout", dest="layout", choices=LAYOUTS, default="whole",
                   help="Canzona's DP layout (--compare also plans the other one): whole = variable-size shards, "
                   "every matrix whole; lean = equal shards, matrices split across them gathered in the step")
    p.add_argument("--bucket-size", type=at_least(1), default=None, help="elements per DDP bucket (default: Megatron's max(40M, 1M*dp))")
    p.add_argument("--tp-group-budget", type=positive, default=None, help="largest per-slot cost of one TP micro-group")
    p.add_argument("--params-dtype", choices=("bf16", "fp32"), default="bf16", help="parameter dtype (bytes all-gathered)")
    p.add_argument("--grad-reduce-in-fp32", action="store_true", help="gradients reduce-scattered in fp32 (else in the parameter dtype)")
    p.add_argument("--split-qkv", action=argparse.BooleanOptionalAction, default=None,
                   help="optimize Q, K and V as separate matrices (default: no; with --fsdp yes, as the runtime's "
                   "--canzona-split-qkv and Megatron's --muon-split-qkv default)")
    p.add_argument("--split-qkv-per-head", action="store_true",
                   help="optimize every attention head's query, key and value block as its own matrix "
                   "(--canzona-split-qkv-per-head)")
    p.add_argument("--split-gate-up", action="store_true", help="optimize gate and up projections as separate matrices")
    p.add_argument("--compare", action="store_true", help="also plan eq1, megatron_layerwise and zero1")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--plot", metavar="FILE.png",
                   help="bar chart of per-GPU loads, one panel per strategy (with --cases: padding and bytes per case)")
    p.add_argument("--cases", action="store_true", help="run docs/planner.md's case matrix and print its table")
    p.add_argument("--moe-cases", action="store_true", help="run docs/planner.md's mixture-of-experts table")
    p.add_argument("--fsdp-cases", action="store_true",
                   help="docs/fsdp.md's table: Canzona's plan over Megatron-FSDP's buckets (optim_grads_params), each "
                   "GPU's optimizer state against AdamW-FSDP's, every optimizer")
    p.add_argument("--fsdp", nargs="?", const="optim_grads_params", default=None, choices=SHARDING_STRATEGIES,
                   metavar="STRATEGY",
                   help="plan this layout under Megatron-FSDP (--use-megatron-fsdp --data-parallel-sharding-strategy "
                   "STRATEGY, default optim_grads_params; --bucket-size for --ddp-bucket-size, default "
                   "Megatron's max(40M, 1M x DP)): the busiest GPU's optimizer state against AdamW-FSDP's and the mean, the "
                   "hosts' balance, and each rank's bytes of the step against 2 x matrix elements / GPUs x 4 B")
    p.add_argument("--num-distributed-optimizer-instances", "--instances", dest="instances", type=at_least(1), default=1,
                   help="distributed-optimizer instances (Megatron's flag): the plan is one instance's, over DP x CP / N "
                   "ranks; every instance steps the whole model, the gradients' shards all-reduced across instances")
    args = p.parse_args(argv)
    if args.split_qkv is None:
        args.split_qkv = bool(args.fsdp)
    if args.fsdp and (args.pp > 1 or args.cp > 1 or args.instances > 1 or args.etp > 1 or args.compare
                      or args.layout != "whole"):
        p.error("--fsdp plans one stage over Megatron-FSDP's shards at TP, DP and EP sizes: drop --pp, --cp, "
                "--num-distributed-optimizer-instances, --etp, --compare and --layout")
    if (args.dp * args.cp) % args.instances:
        p.error(f"--num-distributed-optimizer-instances {args.instances} does not divide DP x CP {args.dp * args.cp}: "
                f"pick a divisor of it")
    if args.instances > 1 and args.bucket_size is None:  # Megatron's default grows with the whole DP group
        args.bucket_size = default_bucket_size(args.dp * args.cp)
    # the plan's DP group is DP x CP, an instance's share of it
    args.data_parallel, args.dp = args.dp, args.dp * args.cp // args.instances
    return args


def cost_model(args: argparse.Namespace) -> CostModel:
    kind = "numel" if args.cost == "numel" else args.optimizer
    calibration = None
    if args.calibration:
        with open(args.calibration) as f:
            calibration = Calibration.from_json(f.read())
    return CostModel(kind=kind, calibration=calibration, ns_method=args.muon_ns_method, ns_dtype=args.muon_ns_dtype)


def wire_config(args: argparse.Namespace) -> WireConfig:
    param_bytes = 2 if args.params_dtype == "bf16" else 4
    return WireConfig(param_bytes=param_bytes, grad_bytes=4 if args.grad_reduce_in_fp32 else param_bytes)


def strategy_records(specs, args, cm: CostModel, wire: WireConfig, strategies) -> tuple[dict[str, dict], CanzonaPlan]:
    """Each strategy's record (planning/metrics.py) with its planning time, and Canzona's plan.

    Every strategy lays out the dense buffers over DP x TP and the expert-parallel buffers
    over expert DP x expert TP; its record holds the dense fields, ``experts`` and the
    combined balance per GPU (``canzona`` balances the two together, the others as is)."""
    records, plan = {}, None
    dense, experts = split_experts(specs)
    if "megatron_layerwise" in strategies:
        from canzona_patches.version import quiet_megatron_notices

        quiet_megatron_notices()
        import canzona_patches.integration.layerwise_baseline  # noqa: F401  (loads Megatron-Core before the clock starts)
    expert_dp = expert_dp_size(dp_size=args.dp, tp_size=args.tp, ep_size=args.ep, expert_tp_size=args.etp)
    bucket_size = default_bucket_size(args.dp) if args.bucket_size is None else args.bucket_size
    other = next(layout for layout in LAYOUTS if layout != args.layout)
    for name in strategies:
        start = time.perf_counter()
        if name in ("canzona", "canzona_other"):
            layout = args.layout if name == "canzona" else other
            made = make_plan(specs, dp_size=args.dp, tp_size=args.tp, cost_model=cm, alpha=args.alpha,
                             bucket_size=args.bucket_size, tp_budget=args.tp_group_budget, wire=wire, ep_size=args.ep,
                             expert_tp_size=args.etp, joint_balance=args.joint_balance, layout=layout)
            record = {**summarize_canzona(made, specs, cm, wire), **shard_balance(made)}
            plan = made if name == "canzona" else plan
            name = name if name == "canzona" else f"canzona_{other}"
        else:
            record = buffer_record(name, dense, args.dp, args.tp, bucket_size, cm, wire)
            if experts:
                expert_record = buffer_record(name, experts, expert_dp, args.etp, bucket_size, cm, wire)
                record = with_experts(record, expert_record, specs, cm, dp_size=args.dp, tp_size=args.tp,
                                      ep_size=args.ep, expert_tp_size=args.etp)
        records[name] = {**record, "plan_seconds": time.perf_counter() - start}
    assert plan is not None
    return records, plan


def shard_balance(plan: CanzonaPlan) -> dict:
    """How evenly the dense matrix buffers' shards spread over DP ranks: the largest rank's
    elements (its main parameters and optimizer state) over the mean."""
    held = [0] * plan.dp_size
    for layout in plan.layouts:
        for bucket in layout.matrix.buckets:
            for rank, (a, b) in enumerate(zip(bucket.shard_bounds, bucket.shard_bounds[1:])):
                held[rank] += b - a
    mean = sum(held) / len(held)
    return {"layout": plan.layout, "largest_shard_over_mean": max(held) / mean if mean else 1.0}


def buffer_record(name: str, specs, dp: int, tp: int, bucket_size: int, cm: CostModel, wire: WireConfig) -> dict:
    """The record of strategy ``name`` (not ``canzona``) on the buffers of ``specs`` over DP x TP."""
    if name == "eq1":  # whole matrices on the DP rank of their start, one host TP rank each
        eq1 = plan_eq1(specs, dp_size=dp, cost_model=cm, bucket_size=bucket_size)
        return summarize_plan(plan_hosts(eq1, specs, tp_size=tp, cost_model=cm, wire=wire), specs, cm, wire)
    if name == "megatron_layerwise":
        from canzona_patches.integration.layerwise_baseline import plan_megatron_layerwise

        layerwise = plan_megatron_layerwise(specs, dp_size=dp, cost_model=cm, bucket_size=bucket_size)
        return summarize_sync(layerwise, specs, cm, wire, tp)
    if name == "megatron_main":  # Megatron-LM main's layer-wise layout, modelled (planning/megatron_main.py)
        return summarize_sync(plan_megatron_main(specs, dp_size=dp, cost_model=cm, bucket_size=bucket_size),
                              specs, cm, wire, tp)
    zero1 = plan_zero1(specs, dp_size=dp, cost_model=cm, bucket_size=bucket_size)
    return summarize_sync(zero1, specs, cm, wire, tp)


def host_summary(plan: CanzonaPlan) -> dict:
    """Micro-groups of the Canzona plan: how many, and how each host's work spreads over them."""
    per_host: dict[tuple[int, int], list[int]] = {}
    for h in plan.hosts:
        per_host.setdefault((h.dp_rank, h.tp_rank or 0), []).append(h.group)
    busiest = max(per_host.items(), key=lambda kv: len(kv[1]), default=((0, 0), []))
    multi = [len(set(groups)) for groups in per_host.values() if len(groups) > 1]
    return {
        "num_groups": plan.num_groups,
        "budget": plan.budget,
        "hosts": len(per_host),
        "max_matrices_per_host": len(busiest[1]),
        "min_groups_of_a_host_with_two_matrices": min(multi, default=None),
    }


def stage_specs(args: argparse.Namespace, pp_rank: int) -> list:
    return qwen3_specs(
        args.model, tp_size=args.tp, ep_size=args.ep, expert_tp_size=args.etp, pp_size=args.pp, pp_rank=pp_rank,
        first_stage_layers=args.first_stage_layers, last_stage_layers=args.last_stage_layers,
        split_qkv=args.split_qkv, split_qkv_per_head=args.split_qkv_per_head, split_gate_up=args.split_gate_up,
        expert_layout=args.expert_layout,
    )


def plan_stages(args: argparse.Namespace, cm: CostModel, wire: WireConfig, strategies) -> tuple[int, list, list]:
    """Every pipeline stage's specs and records; the index of the busiest stage (the largest
    optimizer compute on one GPU under Canzona: the step waits for it). Stages with the same
    parameters (the middle ones) are planned once."""
    cache: dict[tuple, tuple[dict, CanzonaPlan]] = {}
    stages = []
    for pp_rank in range(args.pp):
        specs = stage_specs(args, pp_rank)
        key = tuple(specs)
        if key not in cache:
            cache[key] = strategy_records(specs, args, cm, wire, strategies)
        stages.append((specs, *cache[key]))
    peaks = [max(r["canzona"].get("combined_gpu_loads", r["canzona"]["gpu_loads"]), default=0.0) for _, r, _ in stages]
    return max(range(args.pp), key=lambda k: (peaks[k], -k)), stages, peaks


def report(args: argparse.Namespace) -> dict:
    cm = cost_model(args)
    wire = wire_config(args)
    strategies = STRATEGIES if args.compare else ("canzona",)
    busiest, stages, peaks = plan_stages(args, cm, wire, strategies)
    specs, records, plan = stages[busiest]
    dense, experts = split_experts(specs)
    rep = {
        "config": {
            "model": args.model, "tp": args.tp, "dp": args.data_parallel, "cp": args.cp, "ep": args.ep, "etp": args.etp, "pp": args.pp,
            "instances": args.instances, "instance_dp": args.dp,
            "expert_dp": expert_dp_size(dp_size=args.dp, tp_size=args.tp, ep_size=args.ep, expert_tp_size=args.etp),
            "expert_layout": args.expert_layout, "joint_balance": args.joint_balance,
            "optimizer": args.optimizer, "cost": cm.kind if cm.kind != "muon" else f"muon, {cm.ns_method} Newton-Schulz in {cm.ns_dtype}",
            "cost_unit": cm.unit, "alpha": args.alpha, "bucket_size": plan.dp.bucket_size,
            "params_dtype": args.params_dtype, "grad_reduce_in_fp32": args.grad_reduce_in_fp32,
            "split_qkv": args.split_qkv, "split_qkv_per_head": args.split_qkv_per_head,
            "split_gate_up": args.split_gate_up,
            "num_matrices": sum(s.family == "matrix" for s in dense),
            "num_expert_matrices": sum(len(s.matrices) for s in experts if s.family == "matrix"),
            "git": git_revision(),
            "machine": f"{platform.node()} {platform.machine()} python {platform.python_version()}",
        },
        "pipeline": {
            "stage": busiest, "num_stages": args.pp, "label": f"stage {busiest} of {args.pp}",
            "layers_per_stage": list(stage_layer_counts(
                get_qwen3_config(args.model).num_layers, args.pp, first_stage_layers=args.first_stage_layers,
                last_stage_layers=args.last_stage_layers)),
            "stage_peak_loads": peaks,
        },
        "lower_bound": lower_bound(dense, cm, args.dp * args.tp),
        "strategies": records,
        "host_groups": host_summary(plan),
    }
    if args.instances > 1:
        rep["across_instances_bytes"] = across_instances_bytes(plan, args.instances, wire.grad_bytes)
    if plan.experts is not None:
        rep["expert_lower_bound"] = lower_bound(experts, cm, rep["config"]["expert_dp"] * args.etp)
        rep["combined_lower_bound"] = combined_lower_bound(specs, cm, dp_size=args.dp, tp_size=args.tp,
                                                           ep_size=args.ep, expert_tp_size=args.etp)
        rep["expert_host_groups"] = host_summary(plan.experts)
    return rep


def across_instances_bytes(plan: CanzonaPlan, instances: int, grad_bytes: int) -> float:
    """Bytes the rank with each bucket's largest shard sends per iteration in the all-reduce of its
    shards across ``instances`` (a ring: ``2 (I - 1)/I`` of the shard), dense and expert buffers."""
    total = 0.0
    for layouts in (plan.layouts, plan.experts.layouts if plan.experts is not None else ()):
        for dp in layouts:
            for buffer in (dp.matrix, dp.elementwise):
                for bucket in (buffer.buckets if buffer is not None else ()):
                    total += bucket.largest_shard * grad_bytes
    return 2 * (instances - 1) / instances * total


TABLE_HEADER = (f"{'strategy':<20}{'makespan/LB':>12}{'padding':>9}{'split':>7}{'buckets':>9}{'largest bucket':>16}"
                f"{'GB sent/rank':>14}{'plan s':>8}")


def print_report(rep: dict) -> None:
    c = rep["config"]
    moe = "expert_lower_bound" in rep
    parallel = f"TP={c['tp']} DP={c['dp']}" + (f" CP={c['cp']}" if c["cp"] > 1 else "") + (f" EP={c['ep']} ETP={c['etp']}" if moe else "")
    print(f"{c['model']}  {parallel}  cost={c['cost']} ({c['cost_unit']})  alpha={c['alpha']}  "
          f"bucket_size={c['bucket_size']:,}  matrices={c['num_matrices']}"
          + (f"  expert matrices={c['num_expert_matrices']} per EP rank" if moe else ""))
    pipe = rep["pipeline"]
    if pipe["num_stages"] > 1:
        print(f"pipeline: {pipe['label']} is the busiest (layers per stage: {pipe['layers_per_stage']}); "
              f"the tables below are its buffers")
    if c.get("instances", 1) > 1:
        print(f"{c['instances']} distributed-optimizer instances: the plan is one instance's, over DP x CP "
              f"{c['instance_dp']} (each instance steps the whole model); each bucket's shards are all-reduced across "
              f"the instances after its reduce-scatter: at most {rep['across_instances_bytes'] / 1e9:.2f} GB sent per rank "
              "and iteration (each bucket's largest shard)")
    print(f"lower bound per GPU (max of total/(DP*TP) and largest matrix): {rep['lower_bound']:.4g} {c['cost_unit']}\n")
    if moe:
        cp = f" x CP {c['cp']}" if c["cp"] > 1 else ""
        print(f"dense buffers (DP {c['dp']}{cp} x TP {c['tp']})")
    print(TABLE_HEADER)
    for name, s in rep["strategies"].items():
        print_row(name, s)
    if moe:
        print(f"\nexpert buffers (expert DP {c['expert_dp']} x expert TP {c['etp']}, the same on each of {c['ep']} "
              f"EP ranks; lower bound {rep['expert_lower_bound']:.4g} {c['cost_unit']})")
        print(TABLE_HEADER)
        for name, s in rep["strategies"].items():
            print_row(name, s["experts"])
        print(f"\ncombined per GPU, dense + expert (lower bound {rep['combined_lower_bound']:.4g} {c['cost_unit']}"
              f"{'' if c['joint_balance'] else '; --no-joint-balance'}):")
        for name, s in rep["strategies"].items():
            print(f"{name:<20}{s['combined_makespan_over_lower_bound']:>12.3f}")
    for key, label in (("host_groups", "\nhost groups"), ("expert_host_groups", "expert host groups"))[:1 + moe]:
        g = rep[key]
        print(f"{label}: {g['num_groups']} micro-group(s), budget {g['budget']:.3g} {c['cost_unit']}; "
              f"{g['hosts']} hosts, at most {g['max_matrices_per_host']} matrices on one")


def print_row(name: str, s: dict) -> None:
    print(f"{name:<20}{s['makespan_over_lower_bound']:>12.3f}{s['padding_overhead'] * 100:>8.1f}%{s['split_params']:>7}"
          f"{s['num_buckets']:>9}{s['largest_bucket_elements']:>16,}{s['comm_bytes_per_rank'] / 1e9:>14.3f}"
          + (f"{s['plan_seconds']:>8.3f}" if 'plan_seconds' in s else ""))


def plot(rep: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rep["strategies"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    moe = "combined_lower_bound" in rep  # MoE: each GPU's dense plus expert work
    bound = rep["combined_lower_bound"] if moe else rep["lower_bound"]
    for ax, name in zip(axes[0], names):
        s = rep["strategies"][name]
        loads = [x / bound for x in s["combined_gpu_loads" if moe else "gpu_loads"]]
        ax.bar(range(len(loads)), loads, width=1.0, color="tab:blue" if name == "canzona" else "tab:gray")
        ax.axhline(1.0, color="tab:red", linestyle="--", linewidth=1, label="lower bound")
        ratio = s["combined_makespan_over_lower_bound" if moe else "makespan_over_lower_bound"]
        ax.set_title(f"{name}\n{'combined ' if moe else ''}makespan/LB {ratio:.2f}, "
                     f"pad {s['padding_overhead'] * 100:.0f}%", fontsize=9)
        ax.set_xlabel("GPU (DP rank x TP size + TP rank)")
        ax.set_ylim(0, max(1.2, max(loads) * 1.1))
        ax.set_ylabel("optimizer compute / lower bound")
    axes[0][0].legend(fontsize=8)
    c = rep["config"]
    what = f"EP={c['ep']} ETP={c['etp']}: per-GPU dense + expert" if moe else "per-rank"
    fig.suptitle(f"{c['model']} TP={c['tp']} DP={c['dp']} {what} {c['cost']} load", fontsize=10)
    save_figure(fig, path)
    print(f"wrote {path}", file=sys.stderr)


CASE_HEADER = (
    "| model | TP | DP | canzona makespan/LB | lean makespan/LB | layer-wise makespan/LB | canzona padding "
    "| lean padding | layer-wise padding | split (canzona / lean) | largest shard / mean | buckets (canzona / zero1) "
    "| largest bucket / bucket size | bytes/rank vs zero1 | vs stock RS+AG | plan s |"
)


def run_cases(args: argparse.Namespace) -> list[dict]:
    rows = []
    print(CASE_HEADER)
    print("|" + "---|" * (CASE_HEADER.count("|") - 1))
    for model, tp, dps in CASES:
        for dp in dps:
            case = argparse.Namespace(**{**vars(args), "model": model, "tp": tp, "dp": dp, "compare": True})
            rep = report(case)
            s = rep["strategies"]
            cz, lw, z1 = s["canzona"], s["megatron_layerwise"], s["zero1"]
            other = next(v for k, v in s.items() if k.startswith("canzona_"))
            print(f"| {model} | {tp} | {dp} | {cz['makespan_over_lower_bound']:.3f} | "
                  f"{other['makespan_over_lower_bound']:.3f} | {lw['makespan_over_lower_bound']:.3f} | "
                  f"{cz['padding_overhead'] * 100:.1f}% | {other['padding_overhead'] * 100:.1f}% | "
                  f"{lw['padding_overhead'] * 100:.1f}% | {cz['split_params']} / {other['split_params']} | "
                  f"{cz['largest_shard_over_mean']:.2f} | {cz['num_buckets']} / {z1['num_buckets']} | "
                  f"{cz['largest_bucket_elements'] / rep['config']['bucket_size']:.2f} | "
                  f"{cz['comm_bytes_per_rank'] / z1['comm_bytes_per_rank']:.3f} | "
                  f"{cz['comm_bytes_per_rank'] / z1['collective_bytes_per_rank']:.3f} | {cz['plan_seconds']:.2f} |", flush=True)
            rows.append(rep)
    return rows


def plot_cases(rows: list[dict], path: str) -> None:
    """Padding and bytes per rank of every case, Canzona beside Megatron's layer-wise layout
    and stock ZeRO-1, where a table hides the trend with DP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['config']['model'].removeprefix('qwen3-')}\nTP{r['config']['tp']} DP{r['config']['dp']}" for r in rows]
    x = range(len(rows))
    fig, (pad, sent) = plt.subplots(2, 1, figsize=(13, 6.4), sharex=True)
    width = 0.38
    for offset, name, colour in ((-width / 2, "canzona", "tab:blue"), (width / 2, "megatron_layerwise", "tab:gray")):
        pad.bar([i + offset for i in x], [100 * r["strategies"][name]["padding_overhead"] for r in rows], width,
                label=name, color=colour)
    pad.set_ylabel("padding (% of parameters)")
    pad.legend(fontsize=8)
    for name, colour, marker in (("canzona", "tab:blue", "o"), ("megatron_layerwise", "tab:gray", "s"),
                                 ("zero1", "tab:red", "^")):
        sent.plot(list(x), [r["strategies"][name]["comm_bytes_per_rank"] / r["strategies"]["zero1"]["collective_bytes_per_rank"]
                            for r in rows], marker=marker, color=colour, label=name, linewidth=1)
    sent.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    sent.set_yscale("log")
    sent.set_ylabel("bytes sent per rank and step\n/ stock reduce-scatter + all-gather")
    sent.set_xticks(list(x), labels, fontsize=7)
    sent.legend(fontsize=8)
    fig.suptitle("Muon under each layout: padding, and everything a rank sends (collectives, host groups, "
                 "synchronous-compute gathers)", fontsize=10)
    save_figure(fig, path)
    print(f"wrote {path}", file=sys.stderr)


MOE_HEADER = (
    "| model | TP | EP | PP: busiest stage | DP | expert DP | dense makespan/LB | expert makespan/LB "
    "| dense padding | expert padding | combined makespan/LB | combined, planned apart | dense / expert GB sent/rank "
    "| plan s |"
)


FSDP_HEADER = ("| model | TP x FSDP (x EP) | optimizer | makespan / LB | state per GPU, busiest (GiB) | mean (GiB) | "
               "busiest / mean | AdamW-FSDP busiest (GiB) | busiest / AdamW's | hosts by compute alone: makespan / LB, "
               "busiest (GiB) |")


def fsdp_state_per_gpu(plan: CanzonaPlan, specs, state, buckets, *, dp: int, tp: int, coords) -> tuple[list, list]:
    """Bytes of optimizer state per GPU under Megatron-FSDP: Canzona's (``state``, its host state
    by ``plan``) and AdamW-FSDP's two moments of the same shards; a GPU of an expert-parallel model
    (``coords``: its expert coordinate per dense one) holds its dense and its expert rank's."""
    from megatron.canzona.planning.memory import STATE_BYTES, StateLayout, fsdp_state_elements

    per_gpu, adamw = [], []
    for d in range(dp):
        for t in range(tp):
            parts = [(False, d, t)] + ([(True, *coords[t + tp * d])] if coords else [])
            mine = adam_total = 0
            for experts, dd, tt in parts:
                kinds = fsdp_state_elements(plan, specs, dp_rank=dd, tp_rank=tt, state=state, buckets=buckets,
                                            experts=experts)
                held = fsdp_state_elements(plan, specs, dp_rank=dd, tp_rank=tt, buckets=buckets,
                                           state=StateLayout(optimizer="muon"), experts=experts)
                mine += sum(kinds.values())
                adam_total += 2 * held["momentum"] + held["adam_moments"]
            per_gpu.append(mine * STATE_BYTES)
            adamw.append(adam_total * STATE_BYTES)
    return per_gpu, adamw


def fsdp_makespan(plan: CanzonaPlan, specs, cm: CostModel, wire: WireConfig) -> float:
    """Busiest GPU's compute over the lower bound (dense and expert work per GPU where there are experts)."""
    summary = summarize_canzona(plan, specs, cm, wire)
    return summary.get("combined_makespan_over_lower_bound", summary["makespan_over_lower_bound"])


def fsdp_row(args: argparse.Namespace, *, model: str, tp: int, ep: int, dp: int, optimizer: str, moment2: str,
             label: str, strategy: str = "optim_grads_params",
             bucket_size: int | None = None) -> tuple[dict, CanzonaPlan, list, CostModel]:
    """One layout under Megatron-FSDP's ``strategy`` (one bucket per layer, or ``bucket_size``
    elements): every GPU's optimizer state as the memory model predicts it
    (:func:`~megatron.canzona.planning.memory.fsdp_state_elements`: Muon's momentum in FSDP's shard
    layout, the rest of the matrix state on hosts, chosen for that state as well as compute), against
    AdamW-FSDP's two moments of the same shards, and beside the hosts chosen for compute alone.
    Returns the row, the runtime's plan, its specs and cost model."""
    from megatron.canzona.planning.fsdp import fsdp_buckets
    from megatron.canzona.planning.grid import dense_to_expert, expert_dp_size
    from megatron.canzona.planning.memory import StateLayout

    specs = qwen3_specs(model, tp_size=tp, ep_size=ep, split_qkv=args.split_qkv, split_gate_up=args.split_gate_up)
    coords = dense_to_expert(dp_size=dp, tp_size=tp, ep_size=ep, expert_tp_size=1) if ep > 1 else None
    expert_dp = expert_dp_size(dp_size=dp, tp_size=tp, ep_size=ep, expert_tp_size=1) if ep > 1 else None
    buckets = {0: fsdp_buckets(specs, dp_size=dp, strategy=strategy, bucket_size=bucket_size, expert_dp_size=expert_dp)}
    case = argparse.Namespace(**{**vars(args), "optimizer": optimizer})
    cm, wire = cost_model(case), wire_config(case)
    state = StateLayout(optimizer=optimizer, ns_dtype=args.muon_ns_dtype, moment2_method=moment2)
    # the runtime's default --canzona-narrow-gathers: Muon iterating in bf16 sends its input narrow
    narrow = optimizer == "muon" and args.muon_ns_dtype == "bfloat16"
    plans = [make_plan(specs, dp_size=dp, tp_size=tp, cost_model=cm, alpha=args.alpha, wire=wire, ep_size=ep,
                       layout="fsdp", fsdp_strategy=strategy, fsdp_bucket_size=bucket_size, state=kept,
                       tp_budget=args.tp_group_budget, narrow_gathers=narrow)
             for kept in (state, None)]  # the runtime's plan, and hosts chosen for compute alone
    per_gpu, adamw = fsdp_state_per_gpu(plans[0], specs, state, buckets, dp=dp, tp=tp, coords=coords)
    alone = per_gpu if plans[1] == plans[0] else \
        fsdp_state_per_gpu(plans[1], specs, state, buckets, dp=dp, tp=tp, coords=coords)[0]
    busiest, mean = max(per_gpu), sum(per_gpu) / len(per_gpu)
    row = {"model": model, "tp": tp, "ep": ep, "dp": dp, "optimizer": label, "strategy": strategy,
           "makespan_over_lower_bound": fsdp_makespan(plans[0], specs, cm, wire), "busiest_bytes": busiest,
           "mean_bytes": mean, "adamw_busiest_bytes": max(adamw),
           "compute_alone_makespan_over_lower_bound": fsdp_makespan(plans[1], specs, cm, wire),
           "compute_alone_busiest_bytes": max(alone)}
    return row, plans[0], specs, cm


def fsdp_line(row: dict) -> str:
    """``row`` (:func:`fsdp_row`) as a line of :data:`FSDP_HEADER`'s table."""
    busiest, mean, adamw = row["busiest_bytes"], row["mean_bytes"], row["adamw_busiest_bytes"]
    ep = row["ep"]
    return (f"| {row['model']} | {row['tp']} x {row['dp']}{f' x {ep}' if ep > 1 else ''} | {row['optimizer']} | "
            f"{row['makespan_over_lower_bound']:.3f} | {busiest / 2**30:.3f} | {mean / 2**30:.3f} | {busiest / mean:.3f} | "
            f"{adamw / 2**30:.3f} | {busiest / adamw:.2f} | {row['compute_alone_makespan_over_lower_bound']:.3f}, "
            f"{row['compute_alone_busiest_bytes'] / 2**30:.3f} |")


def print_fsdp_header() -> None:
    print(FSDP_HEADER)
    print("|" + "---|" * (FSDP_HEADER.count("|") - 1))


def run_fsdp_cases(args: argparse.Namespace) -> list[dict]:
    """docs/fsdp.md's memory table: :func:`fsdp_row` under ``optim_grads_params`` for every case of
    :data:`FSDP_CASES` and every optimizer with the runtime's state (Q, K and V as ``--split-qkv``
    says, fused by default; the parameters outside the layers in one bucket)."""
    rows = []
    print_fsdp_header()
    for model, tp, ep, dps in FSDP_CASES:
        for dp in dps:
            for label, optimizer, moment2 in FSDP_OPTIMIZERS:  # the runtime's state, at its default config
                row = fsdp_row(args, model=model, tp=tp, ep=ep, dp=dp, optimizer=optimizer, moment2=moment2, label=label)[0]
                rows.append(row)
                print(fsdp_line(row), flush=True)
    return rows


def run_fsdp(args: argparse.Namespace) -> dict:
    """``--fsdp STRATEGY``: the layout of ``--model``, ``--tp``, ``--dp`` and ``--ep`` under
    Megatron-FSDP: :func:`fsdp_row`, the plan's hosts and micro-groups, and each rank's bytes of the
    step (its pieces to their hosts and the updates back, Muon's whole matrices both ways in bf16 as
    the runtime sends them by default: ``--canzona-narrow-gathers``) against the issue's bound,
    ``2 x matrix elements / GPUs x 4`` bytes (the dense matrices over DP, the experts over expert DP)."""
    from megatron.canzona.planning.comm import narrow_gather_bytes, narrow_update_bytes, rank_index, traffic
    from megatron.canzona.planning.grid import dense_to_expert
    from megatron.canzona.planning.schedule import plan_schedule
    from megatron.canzona.planning.specs import matrix_specs

    bucket_size = args.bucket_size or default_bucket_size(args.dp)
    row, plan, specs, cm = fsdp_row(args, model=args.model, tp=args.tp, ep=args.ep, dp=args.dp,
                                    optimizer=args.optimizer, moment2="adamuon", label=args.optimizer,
                                    strategy=args.fsdp, bucket_size=bucket_size)
    wire = wire_config(args)

    def sent_per_rank(part: CanzonaPlan, tasks, part_specs) -> list[float]:
        ranks = traffic([dp.matrix for dp in part.layouts], tasks, dp_size=part.dp_size, tp_size=part.tp_size,
                        wire=wire, narrow=narrow_update_bytes(tasks, part_specs, cm),
                        gathers=narrow_gather_bytes(tasks, part_specs, cm))
        return [r.host_gather + r.host_scatter for r in ranks]

    dense = plan_schedule(plan).tasks
    per_rank = sent_per_rank(plan, dense, [s for s in specs if not s.is_expert] if plan.experts else specs)
    if plan.experts is not None:  # a GPU sends its dense rank's bytes and its expert rank's
        experts = sent_per_rank(plan.experts, plan_schedule(plan.experts).tasks, [s for s in specs if s.is_expert])
        coords = dense_to_expert(dp_size=args.dp, tp_size=args.tp, ep_size=args.ep, expert_tp_size=plan.experts.tp_size)
        per_rank = [b + experts[rank_index(*coords[r], plan.experts.tp_size)] for r, b in enumerate(per_rank)]
    expert_dp = args.dp * args.tp // args.ep
    bound = sum(2 * 4 * s.numel / (expert_dp if s.is_expert else args.dp) for s in matrix_specs(specs))
    row.update(bucket_size=bucket_size, step_bytes_per_rank_busiest=max(per_rank),
               step_bytes_per_rank_mean=sum(per_rank) / len(per_rank), step_bytes_bound=bound,
               matrices=len(plan.hosts), micro_groups=len({t.group for t in dense}),
               split_across_shards=sum(1 for t in dense if not t.is_local()))
    return row


def print_fsdp(row: dict) -> None:
    """``--fsdp``'s table and the step's bytes."""
    print(f"plan.py: {row['model']} under Megatron-FSDP {row['strategy']}, TP {row['tp']} x FSDP {row['dp']}"
          + (f", EP {row['ep']}" if row["ep"] > 1 else "") + f", {row['optimizer']}: {row['matrices']} matrices "
          f"({row['split_across_shards']} across shards, gathered to their hosts), {row['micro_groups']} micro-group(s)")
    print_fsdp_header()
    print(fsdp_line(row))
    print(f"bytes per rank of the step (pieces to hosts, updates back): busiest "
          f"{row['step_bytes_per_rank_busiest'] / 2**20:.1f} MiB, mean {row['step_bytes_per_rank_mean'] / 2**20:.1f} MiB, "
          f"{row['step_bytes_per_rank_busiest'] / row['step_bytes_bound']:.2f}x the bound of "
          f"{row['step_bytes_bound'] / 2**20:.1f} MiB (2 x matrix elements / GPUs x 4 B)")


def run_moe_cases(args: argparse.Namespace) -> list[dict]:
    """docs/planner.md's MoE table: Canzona beside Megatron's layer-wise layout (``a / b``) on the
    dense and the expert buffers of the busiest pipeline stage, and the combined balance per
    GPU with and without joint balance."""
    rows = []
    print(MOE_HEADER)
    print("|" + "---|" * (MOE_HEADER.count("|") - 1))
    for model, tp, ep, etp, pp, edge, dps in MOE_CASES:
        for dp in dps:
            sizes = {"model": model, "tp": tp, "dp": dp, "ep": ep, "etp": etp, "pp": pp, "first_stage_layers": edge,
                     "last_stage_layers": edge}
            case = argparse.Namespace(**{**vars(args), **sizes, "compare": True, "joint_balance": True})
            rep = report(case)
            apart = report(argparse.Namespace(**{**vars(case), "compare": False, "joint_balance": False}))
            cz, lw = rep["strategies"]["canzona"], rep["strategies"]["megatron_layerwise"]

            def pair(key: str, scale: float = 1.0, fmt: str = ".3f", sub: str | None = None) -> str:
                a, b = (cz[sub] if sub else cz)[key], (lw[sub] if sub else lw)[key]
                return f"{a * scale:{fmt}} / {b * scale:{fmt}}"

            print(f"| {model} | {tp} | {ep} | {rep['pipeline']['label']} | {dp} | {rep['config']['expert_dp']} | "
                  f"{pair('makespan_over_lower_bound')} | {pair('makespan_over_lower_bound', sub='experts')} | "
                  f"{pair('padding_overhead', 100, '.1f')}% | {pair('padding_overhead', 100, '.1f', 'experts')}% | "
                  f"{pair('combined_makespan_over_lower_bound')} | "
                  f"{apart['strategies']['canzona']['combined_makespan_over_lower_bound']:.3f} | "
                  f"{cz['comm_bytes_per_rank'] / 1e9:.2f} / {cz['experts']['comm_bytes_per_rank'] / 1e9:.2f} | "
                  f"{cz['plan_seconds']:.2f} |", flush=True)
            rows.append(rep)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.fsdp_cases:
            rows = run_fsdp_cases(args)
            if args.json:
                print(json.dumps(rows))
            return 0
        if args.fsdp:
            row = run_fsdp(args)
            print(json.dumps(row)) if args.json else print_fsdp(row)
            return 0
        if args.cases or args.moe_cases:
            rows = run_cases(args) if args.cases else run_moe_cases(args)
            if args.plot:
                plot_cases(rows, args.plot)
            if args.json:
                print(json.dumps(rows))
            return 0
        rep = report(args)
    except (ValueError, OSError) as exc:
        print(f"plan.py: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep))
    else:
        print_report(rep)
    if args.plot:
        plot(rep, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
