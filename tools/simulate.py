#!/usr/bin/env python
"""Project one training iteration on a cluster, for Canzona and every alternative, before launch.

    python tools/simulate.py --model qwen3-32b --gpus 256 --tp 8
    python tools/simulate.py --model qwen3-8b --gpus 128 --cluster h800-ib400 --optimizer soap --json
    python tools/simulate.py --model qwen3-30b-a3b --gpus 256 --ep 8 --plot iteration.png
    python tools/simulate.py --model qwen3-32b --gpus 256 --calibration calib/muon.json --cluster my.toml
    python tools/simulate.py --cases          # docs/projection.md's table (H100, 64-256 GPUs)
    python tools/simulate.py --model qwen3-8b --gpus 256 --tp 1 --fsdp     # under --use-megatron-fsdp
    python tools/simulate.py --model qwen3-8b --gpus 256 --tp 1 --fsdp --no-early-compute
    python tools/simulate.py --fsdp-cases     # docs/fsdp.md's projection table

The plans are the ones the runtime executes (``make_plan`` for Canzona, Megatron-Core's own
layer-wise layout, stock ZeRO-1); megatron.canzona.planning.sim turns them into per-rank
timelines on the cluster (a preset ($N/) or a TOML/JSON file, schema in the
package docstring). Parallel sizes and batch default to the model's recipe
(examples/qwen3/pretrain_<model>.sh); the global batch is raised to one micro-batch per DP
rank where the recipe's is smaller. With PP > 1 every stage is simulated and the slowest one
reported. Every number is a projection: the FLOP cost model at an assumed fraction of peak
unless ``--calibration`` gives measured seconds per shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from megatron.canzona.cli import ArgumentParser, at_least, fraction, non_negative  # noqa: E402
from megatron.canzona.curves import save_figure  # noqa: E402
from megatron.canzona.planning import (  # noqa: E402
    NS_METHODS,
    OPTIMIZERS,
    QWEN3_MODELS,
    CostModel,
    WireConfig,
    get_qwen3_config,
    qwen3_specs,
)
from megatron.canzona.planning.balance import TP_TOGETHER  # noqa: E402
from megatron.canzona.planning.cost import NS_OPTIMIZERS  # noqa: E402
from megatron.canzona.planning.geometry import default_bucket_size  # noqa: E402
from megatron.canzona.planning.memory import EARLY_COMPUTE_BYTES  # noqa: E402
from megatron.canzona.planning.sim import (  # noqa: E402
    STRATEGIES,
    ClusterSpec,
    StrategyResult,
    Workload,
    load_calibration,
    load_cluster,
    simulate,
)
from megatron.canzona.planning.fsdp import SHARDING_STRATEGIES  # noqa: E402
from megatron.canzona.planning.sim.cluster import presets  # noqa: E402
from megatron.canzona.planning.sim.fsdp import FSDP_PEERS, FSDP_STRATEGIES, simulate_fsdp  # noqa: E402
from megatron.canzona.planning.sim.choose import ONE_GROUP_BUDGET, faster_fsdp_groups, project_fsdp_groups  # noqa: E402
from megatron.canzona.runtime.config import FSDP_MICRO_GROUPS  # noqa: E402
from megatron.canzona.planning.sim.simulate import (  # noqa: E402
    INSTANCE_STRATEGIES,
    NEEDS_LAYERWISE_PLAN,
    TP_MODE_STRATEGIES,
    seconds_per_update,
    strategy_ns_method,
)
from megatron.canzona.planning.speculation import (  # noqa: E402
    EarlyComputeDecision,
    early_compute_decision,
    expected_rates,
)
from megatron.canzona.planning.sim.step import ADAMW_BYTES_PER_ELEMENT, APPLY_BYTES_PER_ELEMENT  # noqa: E402
from megatron.canzona.planning.specs import elementwise_specs, matrix_specs  # noqa: E402

RECIPE_DIR = os.path.join(ROOT, "examples", "qwen3")
DEFAULT_CLUSTER = "h100-ib400"
DEFAULT_STRATEGIES = ("canzona", "canzona_lean", "megatron_layerwise", "megatron_tp_blockwise",
                      "megatron_tp_distributed", "layer_sharded", "megatron_main", "sync", "zero1", "adamw")
PEERS = ("megatron_layerwise", "megatron_tp_blockwise", "megatron_tp_distributed", "layer_sharded", "megatron_main")
"""The layouts Megatron users pick today, which Canzona's step is held against (the
``--muon-tp-mode`` ones, Muon's only: :data:`TP_MODE_STRATEGIES`)."""
RECIPE_KEYS = {"TP": "tp", "CP": "cp", "PP": "pp", "EP": "ep", "ETP": "etp", "MICRO_BATCH": "micro_batch",
               "GLOBAL_BATCH": "global_batch", "SEQ_LENGTH": "seq_length", "PP_FIRST_LAYERS": "first_stage_layers",
               "PP_LAST_LAYERS": "last_stage_layers"}


def recipe_defaults(model: str) -> dict[str, int]:
    """Parallel sizes and batch of a model's recipe: common.sh's defaults, then the recipe's
    ``VAR="${VAR:-N}"`` lines (the recipe wins)."""
    pattern = re.compile(r'(?:^|\s)(\w+)="\$\{\w+:-(\d+)\}"', re.MULTILINE)
    out: dict[str, Any] = {"tp": 1, "cp": 1, "pp": 1, "ep": 1, "etp": 1, "micro_batch": 1, "global_batch": 128,
                           "seq_length": 4096, "first_stage_layers": None, "last_stage_layers": None}
    recipe = os.path.join(RECIPE_DIR, f"pretrain_{model.replace('-', '_')}.sh")
    texts = []
    with open(os.path.join(RECIPE_DIR, "common.sh")) as f:
        common = f.read()
    own = ""
    if os.path.exists(recipe):
        with open(recipe) as f:
            own = f.read()
    # The GPU recipes take qwen3_defaults(); the CPU ones (qwen3_cpu_main) their own block first.
    texts.append(common[common.find("qwen3_defaults()"):common.find("# The whole command")])
    if "qwen3_cpu_main" in own:
        texts.append(common[common.find("qwen3_cpu_main()"):common.find("qwen3_recipe_main()")])
    texts.append(own)
    for text in texts:
        for key, value in pattern.findall(text):
            if key in RECIPE_KEYS:
                out[RECIPE_KEYS[key]] = int(value)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-32b", help=f"one of: {', '.join(QWEN3_MODELS)}")
    p.add_argument("--gpus", type=at_least(1), default=256, help="GPUs of the job: DP = GPUs / (TP x PP)")
    p.add_argument("--tp", type=at_least(1), help="tensor-parallel size (default: the recipe's)")
    p.add_argument("--cp", type=at_least(1), help="context-parallel size (default: the recipe's): each sequence cut over CP "
                   "GPUs; the optimizer and the bucket collectives span DP x CP, as Megatron's DDP reduces over it")
    p.add_argument("--pp", type=at_least(1), help="pipeline-parallel size (default: the recipe's)")
    p.add_argument("--ep", type=at_least(1), help="expert-parallel size, MoE models (default: the recipe's)")
    p.add_argument("--etp", type=at_least(1), help="expert tensor-parallel size (default 1, as the recipes)")
    p.add_argument("--decoder-first-pipeline-num-layers", dest="first_stage_layers", type=at_least(0))
    p.add_argument("--decoder-last-pipeline-num-layers", dest="last_stage_layers", type=at_least(0))
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="muon")
    p.add_argument("--muon-ns-method", choices=NS_METHODS, default="standard",
                   help="Newton-Schulz of Canzona's Muon (the runtime's --muon-ns-method); the other strategies "
                   "run Megatron's standard one")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER,
                   help=f"a TOML/JSON file or a preset of megatron/canzona/planning/sim/clusters/ ({', '.join(presets())})")
    p.add_argument("--calibration", metavar="FILE", help="measured seconds per shape (tools/bench_optim.py --calibration-dir)")
    p.add_argument("--global-batch", type=at_least(1), help="sequences per iteration (default: the recipe's, at least DP x micro)")
    p.add_argument("--micro-batch", type=at_least(1), help="sequences per micro-batch (default: the recipe's)")
    p.add_argument("--seq-length", type=at_least(1), help="tokens per sequence (default: the recipe's)")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(DEFAULT_STRATEGIES))
    p.add_argument("--alpha", type=fraction, default=0.5, help="Canzona planner balance knob")
    p.add_argument("--bucket-size", type=at_least(1), help="DDP bucket elements (default Megatron's max(40M, 1M x DP))")
    p.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce gradients in bf16 (the recipes reduce in fp32: --accumulate-allreduce-grads-in-fp32)")
    p.add_argument("--no-split-qkv", dest="split_qkv", action="store_false", help="one matrix per fused QKV")
    p.add_argument("--split-qkv-per-head", action="store_true",
                   help="one matrix per attention head's query, key and value block (--canzona-split-qkv-per-head)")
    p.add_argument("--split-gate-up", action="store_true",
                   help="Canzona hosts gate and up of every SwiGLU fc1 apart (--canzona-split-gate-up); the "
                   "other strategies keep the fused fc1, as Megatron's optimizers do")
    p.add_argument("--tp-together", choices=TP_TOGETHER, default="off",
                   help="Canzona's TP-sharded matrices computed by their TP ranks together, each its shard, their "
                   "Gram matrices summed over NVLink in fp32: auto, those whose update alone costs more than the mean "
                   "per GPU; all, every one whose TP-split side is its long one (the runtime's --canzona-tp-together, "
                   "which runs under --use-megatron-fsdp only: without --fsdp a projection; default off)")
    p.add_argument("--narrow-gathers", action="store_true", default=None,
                   help="with --fsdp: Canzona's Muon gathers each whole matrix's Newton-Schulz input in bf16, its "
                   "holders normalising it by the matrix's norm first (half the gathers' bytes): the runtime's "
                   "--canzona-narrow-gathers, its default under --use-megatron-fsdp with Muon (default: with --fsdp "
                   "and --optimizer muon)")
    p.add_argument("--no-narrow-gathers", dest="narrow_gathers", action="store_false",
                   help="with --fsdp: Canzona's Muon gathers in fp32 (the runtime's --canzona-no-narrow-gathers)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="Canzona's micro-groups without pipelining (gather, compute, scatter in turn)")
    p.add_argument("--early-compute", action="store_true", default=None,
                   help="Canzona computes each micro-group before the step once gathered and backward is over, "
                        "in the reduce-scatters' exposed tail (never beside backward's GEMMs), speculating that "
                        "the clip does not act. Not given: off, but under --fsdp and --fsdp-cases the runtime's "
                        "--canzona-early-compute auto (on for a CUDA cluster at FSDP > 1, off on the cpu-gloo ones)")
    p.add_argument("--no-early-compute", dest="early_compute", action="store_false", default=None,
                   help="Canzona computes every micro-group in the step (--canzona-early-compute off; the default "
                        "without --fsdp)")
    p.add_argument("--clip-rate", type=fraction, default=0.0,
                   help="with --early-compute: the chance that the clip acts in an iteration; the step is priced "
                        "as the runtime's speculation policy decides (committed early, or recomputed / not "
                        "speculated: the step without early compute), its shares printed")
    p.add_argument("--early-compute-budget", type=non_negative, default=EARLY_COMPUTE_BYTES / 2**30, metavar="GIB",
                   help="with --early-compute: the most GiB each rank keeps for it (--canzona-early-compute-budget; "
                        "the groups that fit go early, the others in the step; 'inf': every group)")
    p.add_argument("--matrices-reduce-first", choices=("auto", "on", "off"), default="auto",
                   help="with --early-compute: reduce the dense buckets without matrices (output layer, norms) "
                        "after the last matrix bucket, so the matrices' early compute runs beside them "
                        "(--canzona-matrices-reduce-first); auto: where the iteration is projected shorter")
    p.add_argument("--num-distributed-optimizer-instances", "--instances", dest="instances", type=at_least(1), default=1,
                   help="distributed-optimizer instances (Megatron's flag): each shards its optimizer over DP / N "
                   "consecutive DP ranks, the gradients all-reduced across the instances after each bucket's "
                   f"reduce-scatter; projects {', '.join(INSTANCE_STRATEGIES)} only")
    p.add_argument("--instance-cases", action="store_true",
                   help="docs/projection.md's instance table: Qwen3-32B and Qwen3-235B-A22B at 256 GPUs, Canzona and "
                   "AdamW at every instance count, with the bytes each rank sends per link")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--cases", action="store_true",
                   help="every model of docs/projection.md's table at 64, 128 and 256 GPUs (recipe sizes)")
    p.add_argument("--plot", metavar="FILE.png", help="Gantt of one iteration, two strategies side by side")
    p.add_argument("--plot-strategies", nargs=2, choices=sorted({*STRATEGIES, *FSDP_STRATEGIES}),
                   help="the two strategies of --plot (default canzona and megatron_layerwise; with --fsdp, "
                   "canzona and owner_uniform)")
    p.add_argument("--fsdp", nargs="?", const="optim_grads_params", choices=SHARDING_STRATEGIES, metavar="STRATEGY",
                   help="project under Megatron-FSDP (--use-megatron-fsdp --data-parallel-sharding-strategy STRATEGY, "
                   "default optim_grads_params): Canzona, NVIDIA/Megatron-LM #4486's every-holder Muon, an owner per "
                   f"matrix over FSDP2's uniform shards, AdamW ({', '.join(FSDP_STRATEGIES)}); FSDP's bucket "
                   "collectives run every micro-batch beside forward and backward")
    p.add_argument("--fsdp-micro-groups", choices=FSDP_MICRO_GROUPS, default="auto",
                   help="with --fsdp: Canzona's micro-groups, as the runtime's --canzona-fsdp-micro-groups (one, the "
                   "planner's budget, or auto: one where its iterations with the clip idle and acting every iteration "
                   "add up to less, on a cluster whose early gathers ride FSDP's link)")
    p.add_argument("--fsdp-cases", action="store_true",
                   help="docs/fsdp.md's projection table: Qwen3-8B at FSDP 64 and 256, Qwen3-32B at TP 4 x FSDP 64, "
                   "Qwen3-30B-A3B at EP 8 x FSDP 64 and 256 (optim_grads_params), Canzona as the runtime runs it by "
                   "default and with the clip acting every iteration")
    args = p.parse_args(argv)
    if args.plot_strategies is None:
        args.plot_strategies = ("canzona", "owner_uniform") if args.fsdp else ("canzona", "megatron_layerwise")
    wrong = [n for n in args.plot_strategies if n not in (FSDP_STRATEGIES if args.fsdp else STRATEGIES)]
    if args.plot and wrong:
        p.error(f"--plot-strategies {' '.join(wrong)}: {'with' if args.fsdp else 'without'} --fsdp choose among "
                f"{', '.join(FSDP_STRATEGIES if args.fsdp else STRATEGIES)}")
    if args.fsdp_cases and (args.narrow_gathers is not None or args.tp_together != "off"):
        flag = "--tp-together" if args.narrow_gathers is None else (
            "--narrow-gathers" if args.narrow_gathers else "--no-narrow-gathers")
        p.error(f"--fsdp-cases reports the defaults (and --no-narrow-gathers and --tp-together auto in columns of "
                f"their own): drop {flag}")
    if args.narrow_gathers and not args.fsdp:
        p.error("--narrow-gathers projects Muon's gathers under Megatron-FSDP, whose holders keep its momentum: add --fsdp")
    if args.narrow_gathers and args.optimizer != "muon":
        p.error("--narrow-gathers sends Muon's normalised input to its hosts in bf16: it needs --optimizer muon")
    if args.narrow_gathers is None:  # the runtime's default under Megatron-FSDP
        args.narrow_gathers = bool(args.fsdp) and args.optimizer == "muon"
    if args.instances > 1 and args.fsdp:
        p.error("--num-distributed-optimizer-instances is the distributed optimizer's; Megatron-FSDP has its own "
                "hybrid sharding (--outer-dp-sharding-strategy): drop one of them")
    if args.optimizer not in NS_OPTIMIZERS:  # Megatron's --muon-tp-mode is Muon's
        named = [n for n in args.strategies if n in TP_MODE_STRATEGIES]
        if named and args.strategies != list(DEFAULT_STRATEGIES):
            p.error(f"--strategies {' '.join(named)}: Megatron's --muon-tp-mode is Muon's; --optimizer "
                    f"{args.optimizer} has no Newton-Schulz: drop them")
        args.strategies = [n for n in args.strategies if n not in TP_MODE_STRATEGIES]
    if args.instances > 1:
        dropped = [n for n in args.strategies if n not in INSTANCE_STRATEGIES]
        args.strategies = [n for n in args.strategies if n in INSTANCE_STRATEGIES]
        args.dropped_strategies = dropped
        if args.plot and any(n not in INSTANCE_STRATEGIES for n in args.plot_strategies):
            p.error(f"--plot-strategies with --num-distributed-optimizer-instances {args.instances}: choose among "
                    f"{', '.join(INSTANCE_STRATEGIES)}")
    if not 0.0 <= args.clip_rate <= 1.0:
        p.error(f"--clip-rate {args.clip_rate} is a probability: pick a value in [0, 1]")
    auto = args.early_compute is None and (args.fsdp or args.fsdp_cases)  # the runtime's auto decides
    if args.clip_rate and not (args.early_compute or auto):
        p.error("--clip-rate prices the recomputes of --early-compute: add --early-compute")
    if args.matrices_reduce_first == "on" and not args.early_compute:
        p.error("--matrices-reduce-first on reorders the reduce-scatters for --early-compute: add --early-compute")
    if not args.early_compute_budget >= 0.0:
        p.error(f"--early-compute-budget {args.early_compute_budget} must be 0 or more GiB ('inf': no bound)")
    return args


def resolve_cluster(name: str) -> ClusterSpec:
    return load_cluster(name)


def configure(args: argparse.Namespace) -> dict[str, Any]:
    """The run's sizes: the recipe's defaults under the flags given, checked."""
    cfg = get_qwen3_config(args.model)
    recipe = recipe_defaults(cfg.name)
    sizes = {k: getattr(args, k) if getattr(args, k, None) is not None else recipe[k]
             for k in ("tp", "cp", "pp", "ep", "etp", "micro_batch", "seq_length", "first_stage_layers",
                       "last_stage_layers")}
    if not cfg.is_moe:
        sizes["ep"] = sizes["etp"] = 1
    if args.pp is not None and args.pp != recipe["pp"] and args.first_stage_layers is None:
        sizes["first_stage_layers"] = sizes["last_stage_layers"] = None  # the recipe's split is for its own PP
    model_parallel = sizes["tp"] * sizes["cp"] * sizes["pp"]
    if sizes["cp"] < 1 or args.gpus < 1 or args.gpus % model_parallel:
        raise ValueError(f"--gpus {args.gpus} is not a multiple of TP {sizes['tp']} x CP {sizes['cp']} x PP "
                         f"{sizes['pp']}; pass a multiple of {model_parallel}")
    if sizes["seq_length"] % (2 * sizes["cp"]):
        raise ValueError(f"--seq-length {sizes['seq_length']} must be a multiple of 2 x CP = {2 * sizes['cp']} "
                         "(each CP rank holds two equal chunks of every sequence)")
    dp = args.gpus // model_parallel
    per_step = dp * sizes["micro_batch"]
    note = None
    global_batch = args.global_batch
    if global_batch is None:
        global_batch = recipe["global_batch"]
        if global_batch % per_step:
            global_batch = -(-global_batch // per_step) * per_step
            note = (f"global batch raised from the recipe's {recipe['global_batch']} to {global_batch}: "
                    f"DP {dp} x micro batch {sizes['micro_batch']} needs a multiple of {per_step}")
    return {"model": cfg.name, "gpus": args.gpus, "dp": dp, "dp_cp": dp * sizes["cp"], **sizes,
            "global_batch": global_batch, "note": note,
            "optimizer": args.optimizer, "ns_method": args.muon_ns_method, "split_qkv": args.split_qkv,
            "split_qkv_per_head": getattr(args, "split_qkv_per_head", False), "split_gate_up": getattr(args, "split_gate_up", False),
            "tp_together": getattr(args, "tp_together", "off"), "alpha": args.alpha,
            "grad_reduce_in_fp32": not args.grad_reduce_in_bf16, "overlap": args.overlap,
            "bucket_size": args.bucket_size or default_bucket_size(dp * sizes["cp"]),
            "early_compute": bool(getattr(args, "early_compute", False)), "clip_rate": getattr(args, "clip_rate", 0.0),
            "early_compute_bytes": early_compute_bytes(getattr(args, "early_compute_budget", EARLY_COMPUTE_BYTES / 2**30)),
            "matrices_first": getattr(args, "matrices_reduce_first", "auto"),
            "instances": _instances(getattr(args, "instances", 1), dp * sizes["cp"], sizes, cfg)}


def _instances(instances: int, dp_cp: int, sizes: dict[str, Any], cfg: Any) -> int:
    """``--num-distributed-optimizer-instances``, checked as Megatron checks it: it divides DP x CP
    and the expert-data-parallel size."""
    if dp_cp % instances:
        raise ValueError(f"--num-distributed-optimizer-instances {instances} does not divide DP x CP {dp_cp}: pick one "
                         f"of {', '.join(str(i) for i in range(1, dp_cp + 1) if dp_cp % i == 0)}")
    expert_dp = dp_cp * sizes["tp"] // (sizes["ep"] * sizes["etp"]) if cfg.is_moe else dp_cp
    if expert_dp % instances:
        raise ValueError(f"--num-distributed-optimizer-instances {instances} does not divide the expert-data-parallel "
                         f"size {expert_dp} (DP x CP x TP / (EP x expert TP)): pick a divisor of both")
    return instances


def early_compute_bytes(gib: float) -> int | None:
    """``--early-compute-budget`` in bytes; ``None`` for no bound."""
    return None if math.isinf(gib) else int(gib * 2**30)


def stage_specs(args: argparse.Namespace, run: dict[str, Any], pp_rank: int) -> list:
    return qwen3_specs(run["model"], tp_size=run["tp"], ep_size=run["ep"], expert_tp_size=run["etp"],
                       pp_size=run["pp"], pp_rank=pp_rank, first_stage_layers=run["first_stage_layers"],
                       last_stage_layers=run["last_stage_layers"], split_qkv=run["split_qkv"],
                       split_qkv_per_head=run.get("split_qkv_per_head", False),
                       split_gate_up=run.get("split_gate_up", False))


def fused_gate_up(specs: list) -> list:
    """``specs`` with every gated fc1 one matrix again (what the strategies other than Canzona's run)."""
    return [dataclasses.replace(s, blocks=()) if s.fused == "gate_up" else s for s in specs]


def layerwise_plans(specs: list, run: dict[str, Any]) -> tuple[Any, Any]:
    """Megatron-Core's own layer-wise layouts (dense, expert) of a stage, from the installed package."""
    from canzona_patches.version import quiet_megatron_notices

    quiet_megatron_notices()
    from canzona_patches.integration.layerwise_baseline import plan_megatron_layerwise_stage

    return plan_megatron_layerwise_stage(specs, dp_size=run["dp_cp"], tp_size=run["tp"], ep_size=run["ep"],
                                         expert_tp_size=run["etp"], cost_model=CostModel(kind=run["optimizer"]),
                                         bucket_size=run["bucket_size"])


def simulate_stage(specs: list, run: dict[str, Any], cluster: ClusterSpec, calibrations, strategies) -> dict[str, StrategyResult]:
    """Each strategy on one pipeline stage; ``calibrations``: measured timings by Newton-Schulz
    method (``None``: the FLOP formulas)."""
    cfg = get_qwen3_config(run["model"])
    activity = cfg.moe_router_topk * run["ep"] / cfg.num_experts if cfg.is_moe else 1.0
    workload = Workload(global_batch=run["global_batch"], micro_batch=run["micro_batch"], seq_length=run["seq_length"],
                        expert_activity=activity, context_parallel=run.get("cp", 1))
    wire = WireConfig(grad_bytes=4 if run["grad_reduce_in_fp32"] else 2)
    fused = fused_gate_up(specs)
    layerwise = layerwise_plans(fused, run) if set(strategies) & set(NEEDS_LAYERWISE_PLAN) else (None, None)
    out = {}
    first = run.get("matrices_first", "auto")
    for name in strategies:
        plan, expert_plan = layerwise if name in NEEDS_LAYERWISE_PLAN else (None, None)
        results = [simulate(
            specs if name.startswith("canzona") else fused, strategy=name, cluster=cluster, dp_size=run["dp_cp"], tp_size=run["tp"], ep_size=run["ep"],
            expert_tp_size=run["etp"], pp_size=run["pp"], optimizer=run["optimizer"],
            calibration=calibrations[strategy_ns_method(name, run["ns_method"])] if calibrations else None,
            workload=workload, plan=plan, expert_plan=expert_plan, wire=wire, overlap=run["overlap"],
            alpha=run["alpha"], bucket_size=run["bucket_size"], ns_method=run["ns_method"],
            early_compute=run.get("early_compute", False), clip_rate=run.get("clip_rate", 0.0),
            early_compute_bytes=run.get("early_compute_bytes", EARLY_COMPUTE_BYTES), matrices_first=matrices_first,
            instances=run.get("instances", 1) if name in INSTANCE_STRATEGIES else 1,
            tp_together=run["tp_together"] if name.startswith("canzona") else "off",
        ) for matrices_first in ((False, True) if first == "auto" and run.get("early_compute") and
                                 name.startswith("canzona") else (first == "on",))]
        out[name] = min(results, key=lambda r: r.iteration_seconds)  # auto: the shorter, backward order on a tie
    return out


def physical_limit(specs: list, run: dict[str, Any], cluster: ClusterSpec, calibrations) -> float:
    """No layout's optimizer step on this stage beats L = max(matrix work / GPUs, largest
    matrix, or part hosted apart) + a GPU's share of applying the updates and of AdamW: the work spread perfectly,
    with no communication at all. Expert matrices count per EP rank, over expert DP x expert TP."""
    cost = CostModel(kind=run["optimizer"], calibration=calibrations[run["ns_method"]] if calibrations else None,
                     ns_method=run["ns_method"], ns_dtype=cluster.gpu.ns_dtype)
    seconds = seconds_per_update(cost, cluster)
    gpus = run["dp_cp"] * run["tp"]
    expert_gpus = gpus // (run["ep"] * run["etp"])
    work, largest, applied, adamw = 0.0, 0.0, 0.0, 0.0
    for spec in matrix_specs(specs):
        copies = 1 if spec.tp_sharded else (run["etp"] if spec.is_expert else run["tp"])
        t = seconds(spec)
        work += t * copies / (expert_gpus * run["etp"] if spec.is_expert else gpus)
        largest = max(largest, *(seconds(spec, k) for k in range(len(spec.parts))))
        applied += spec.numel / (expert_gpus if spec.is_expert else run["dp_cp"])
    for spec in elementwise_specs(specs):
        adamw += spec.numel / (expert_gpus if spec.is_expert else run["dp_cp"])
    memory = cluster.gpu.memory_bytes_per_s
    return max(work, largest) + (applied * APPLY_BYTES_PER_ELEMENT + adamw * ADAMW_BYTES_PER_ELEMENT) / memory


def project(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, StrategyResult]]:
    """The report and, per strategy, the result of its slowest pipeline stage."""
    cluster = resolve_cluster(args.cluster)
    # Canzona's Newton-Schulz method and Megatron's (standard) may differ: a calibration of each
    calibrations = ({method: load_calibration(args.calibration, args.optimizer, method if args.optimizer == "muon" else None)
                     for method in {args.muon_ns_method, "standard"}} if args.calibration else None)
    run = configure(args)
    strategies = list(dict.fromkeys(["canzona", *args.strategies, *(args.plot_strategies if args.plot else ())]))
    cache: dict[tuple, dict[str, StrategyResult]] = {}
    best: dict[str, tuple[int, StrategyResult]] = {}
    limits: dict[tuple, float] = {}
    stage_limits: list[float] = []  # per pipeline stage: a step is set against its own stage's limit
    for pp_rank in range(run["pp"]):
        specs = stage_specs(args, run, pp_rank)
        key = tuple(specs)
        if key not in cache:
            cache[key] = simulate_stage(specs, run, cluster, calibrations, strategies)
            limits[key] = physical_limit(specs, run, cluster, calibrations)
        stage_limits.append(limits[key])
        for name, result in cache[key].items():
            if name not in best or result.iteration_seconds > best[name][1].iteration_seconds:
                best[name] = (pp_rank, result)
    results = {name: best[name][1] for name in strategies}
    limit = stage_limits[best["canzona"][0]]
    report = {"config": {**run, "cluster": cluster.name, "gpus_per_node": cluster.gpus_per_node,
                         "cost": "calibration" if calibrations else
                         f"FLOP formula at {cluster.gpu.matmul_efficiency:.0%} of the {cluster.gpu.optimizer_dtype} peak",
                         "machine": f"{platform.node()} python {platform.python_version()}"},
              "cluster": cluster.to_dict(), "strategies": {}, "physical_limit_seconds": limit,
              "physical_limit_seconds_by_stage": stage_limits}
    report["dropped_strategies"] = getattr(args, "dropped_strategies", [])
    if "speculation" in results["canzona"].details:  # the policy's shares the early compute step is priced with
        report["config"]["speculation"] = results["canzona"].details["speculation"]
    canzona = results["canzona"]
    for name, r in results.items():
        report["strategies"][name] = {
            **r.to_dict(), "pipeline_stage": best[name][0],
            "step_ratio_to_canzona": r.optimizer_step_seconds / canzona.optimizer_step_seconds,
            "iteration_ratio_to_canzona": r.iteration_seconds / canzona.iteration_seconds,
            "step_over_limit": r.optimizer_step_seconds / stage_limits[best[name][0]],
        }
    return report, results


def step_bytes_bound(specs: list, run: dict[str, Any]) -> float:
    """The most bytes a rank should send in an FSDP step: every matrix element of its shards out
    once and its update back once, in fp32, ``2 x (matrix elements / group size) x 4``, the dense
    matrices over DP and the experts over expert DP (issue target, docs/fsdp.md)."""
    gpus = run["dp"] * run["tp"]
    expert_dp = gpus // (run["ep"] * run["etp"])
    return sum(2 * 4 * s.numel / (expert_dp if s.is_expert else run["dp"]) for s in matrix_specs(specs))


def fsdp_early_compute(early_compute: bool | None, cluster: ClusterSpec, dp_size: int) -> EarlyComputeDecision:
    """Whether Canzona computes early under ``--fsdp``: as the flag says, else as the runtime's
    ``--canzona-early-compute auto`` decides for the cluster (its early gathers always on, in
    the default async TP mode, ``--overlap-grad-reduce`` as the recipes run)."""
    setting = "auto" if early_compute is None else "on" if early_compute else "off"
    return early_compute_decision(setting, dp_size=dp_size, overlap=True, early_gather=True,
                                  cuda=cluster.backend != "gloo")


def project_fsdp(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, StrategyResult]]:
    """The report and results of every design of :data:`FSDP_STRATEGIES` under Megatron-FSDP's
    ``args.fsdp`` sharding. Canzona runs the specs as planned (``--split-gate-up`` hosts fc1's
    halves apart), the peers the fused matrices, as Megatron's optimizers keep them; Canzona
    computes early as :func:`fsdp_early_compute` decides."""
    cluster = resolve_cluster(args.cluster)
    calibrations = ({method: load_calibration(args.calibration, args.optimizer, method if args.optimizer == "muon" else None)
                     for method in {args.muon_ns_method, "standard"}} if args.calibration else None)
    run = configure(args)
    if run["pp"] > 1 or run["cp"] > 1:
        raise ValueError(f"--fsdp projects PP 1 (Megatron-FSDP has no pipeline stages) and CP 1 (CP under FSDP is "
                         f"not projected yet; it runs) (the recipe has PP {run['pp']}, CP {run['cp']}): pass --pp 1 --cp 1")
    run["fsdp"] = args.fsdp
    decision = fsdp_early_compute(getattr(args, "early_compute", None), cluster, run["dp"])
    run["early_compute"], run["early_compute_decision"] = decision.on, decision.line()
    specs = stage_specs(args, run, 0)
    cfg = get_qwen3_config(run["model"])
    activity = cfg.moe_router_topk * run["ep"] / cfg.num_experts if cfg.is_moe else 1.0
    workload = Workload(global_batch=run["global_batch"], micro_batch=run["micro_batch"], seq_length=run["seq_length"],
                        expert_activity=activity)
    wire = WireConfig(grad_bytes=4 if run["grad_reduce_in_fp32"] else 2)
    common = dict(cluster=cluster, dp_size=run["dp"], tp_size=run["tp"], ep_size=run["ep"], expert_tp_size=run["etp"],
                  sharding=args.fsdp, optimizer=run["optimizer"], workload=workload, wire=wire,
                  bucket_size=args.bucket_size, alpha=run["alpha"], ns_method=run["ns_method"],
                  early_compute=run["early_compute"], clip_rate=run["clip_rate"],
                  early_compute_bytes=run["early_compute_bytes"], tp_together=run["tp_together"],
                  narrow_gathers=getattr(args, "narrow_gathers", False))

    def calibration(name: str) -> Calibration | None:
        return calibrations[strategy_ns_method(name, run["ns_method"])] if calibrations else None

    setting = getattr(args, "fsdp_micro_groups", "auto")
    groups = {}  # the runtime's choice (fsdp_group_budget), on a cluster whose gathers ride the link
    if setting == "auto" and cluster.backend != "gloo":
        groups = project_fsdp_groups(specs, calibration=calibration("canzona"),
                                     **{k: v for k, v in common.items() if k != "clip_rate"})
        setting = faster_fsdp_groups(groups)
    run["fsdp_micro_groups"] = setting
    if groups:
        run["fsdp_micro_groups_projected_ms"] = {k: [1e3 * r.iteration_seconds for r in both]
                                                 for k, both in groups.items()}
    reuse = {0.0: 0, 1.0: 1}.get(run["clip_rate"]) if groups else None
    results = {name: groups[setting][reuse] if name == "canzona" and reuse is not None else simulate_fsdp(
        specs if name == "canzona" else fused_gate_up(specs), strategy=name, calibration=calibration(name),
        tp_budget=ONE_GROUP_BUDGET if name == "canzona" and setting == "one" else None, **common,
    ) for name in FSDP_STRATEGIES}
    limit = physical_limit(specs, {**run, "dp_cp": run["dp"]}, cluster, calibrations)
    report = {"config": {**run, "cluster": cluster.name, "gpus_per_node": cluster.gpus_per_node,
                         "cost": "calibration" if calibrations else
                         f"FLOP formula at {cluster.gpu.matmul_efficiency:.0%} of the {cluster.gpu.optimizer_dtype} peak",
                         "machine": f"{platform.node()} python {platform.python_version()}"},
              "cluster": cluster.to_dict(), "strategies": {}, "physical_limit_seconds": limit,
              "step_bytes_bound": step_bytes_bound(specs, run)}
    if "speculation" in results["canzona"].details:
        report["config"]["speculation"] = results["canzona"].details["speculation"]
    canzona, adamw = results["canzona"], results["adamw"]
    for name, r in results.items():
        report["strategies"][name] = {
            **r.to_dict(), "step_ratio_to_canzona": r.optimizer_step_seconds / canzona.optimizer_step_seconds,
            "iteration_ratio_to_adamw": r.iteration_seconds / adamw.iteration_seconds,
            "step_over_limit": r.optimizer_step_seconds / limit,
        }
    return report, results


def print_fsdp_report(report: dict[str, Any]) -> None:
    c = report["config"]
    moe = f" EP {c['ep']} ETP {c['etp']}" if c["ep"] > 1 else ""
    print(f" [simulate] {c['model']} on {c['gpus']} x {c['cluster']} ({c['gpus_per_node']} per node) | Megatron-FSDP "
          f"{c['fsdp']} | TP {c['tp']} FSDP {c['dp']}{moe} | global batch {c['global_batch']}, micro batch "
          f"{c['micro_batch']}, seq {c['seq_length']} | {c['optimizer']}: {c['cost']} | MFU "
          f"{report['cluster']['training']['mfu']:.2f}")
    if c["note"]:
        print(f" [simulate] note: {c['note']}")
    print(f" [simulate] canzona gathers each micro-group as its buckets reduce; early compute "
          f"{c['early_compute_decision']}")
    projected = c.get("fsdp_micro_groups_projected_ms")
    print(f" [simulate] micro-groups: {c['fsdp_micro_groups']}" + (
        " (auto, iteration with the clip idle / acting every iteration: {:.1f} / {:.1f} ms in one, {:.1f} / {:.1f} ms "
        "in the budget's)".format(*projected["one"], *projected["budget"]) if projected else ""))
    if c["early_compute"]:
        print(f" [simulate] {speculation_line(c['clip_rate'])}")
    print(f" [simulate] physical limit of the step (work spread perfectly, no communication): "
          f"{ms(report['physical_limit_seconds']).strip()} ms; step bytes bound per rank "
          f"{report['step_bytes_bound'] / 2**20:.1f} MiB")
    for name, s in report["strategies"].items():
        print(f" {name:<14}| iteration (ms): {ms(s['iteration_seconds'])} | optimizer step (ms): "
              f"{ms(s['optimizer_step_seconds'])} | FSDP comm exposed (ms): "
              f"{ms(s['param_gather_exposed_seconds'] + s['grad_reduce_exposed_seconds'])} | step MiB/rank: "
              f"{s['step_bytes_per_rank'] / 2**20:8.1f} | step / canzona: {s['step_ratio_to_canzona']:6.2f} | "
              f"iteration / adamw: {s['iteration_ratio_to_adamw']:6.3f} | step / limit: {s['step_over_limit']:6.2f} |")


def print_report(report: dict[str, Any]) -> None:
    c = report["config"]
    moe = f" EP {c['ep']} ETP {c['etp']}" if c["ep"] > 1 else ""
    cp = f" CP {c['cp']}" if c.get("cp", 1) > 1 else ""
    print(f" [simulate] {c['model']} on {c['gpus']} x {c['cluster']} ({c['gpus_per_node']} per node) | TP {c['tp']} "
          f"PP {c['pp']} DP {c['dp']}{cp}{moe} | global batch {c['global_batch']}, micro batch {c['micro_batch']}, "
          f"seq {c['seq_length']} | {c['optimizer']}: {c['cost']} | MFU {report['cluster']['training']['mfu']:.2f}")
    if c["note"]:
        print(f" [simulate] note: {c['note']}")
    if c.get("instances", 1) > 1:
        dropped = report.get("dropped_strategies") or []
        print(f" [simulate] {c['instances']} distributed-optimizer instances, each over DP x CP "
              f"{c['dp_cp'] // c['instances']}: every instance steps the whole model; the gradients' shards are "
              "all-reduced across instances after each bucket's reduce-scatter"
              + (f" ({', '.join(dropped)}: one instance only, not projected)" if dropped else ""))
    if c.get("early_compute"):
        print(f" [simulate] {speculation_line(c['clip_rate'])}")
    stages = report.get("physical_limit_seconds_by_stage", [])
    where = (f" on pipeline stage {report['strategies']['canzona']['pipeline_stage']}, the slowest (each strategy's step / limit "
             f"is against its slowest stage's limit; stages {' / '.join(ms(x).strip() for x in stages)} ms)"
             if len(set(stages)) > 1 else "")
    print(f" [simulate] physical limit of the step (work spread perfectly, no communication): "
          f"{ms(report['physical_limit_seconds']).strip()} ms{where}")
    for name, s in report["strategies"].items():
        print(f" {name:<24}| iteration (ms): {ms(s['iteration_seconds'])} | optimizer step (ms): "
              f"{ms(s['optimizer_step_seconds'])} | exposed comm (ms): {ms(s['exposed_comm_seconds'])} | "
              f"step / canzona: {s['step_ratio_to_canzona']:6.2f} | iteration / canzona: "
              f"{s['iteration_ratio_to_canzona']:5.2f} | step / limit: {s['step_over_limit']:5.2f} |")


def speculation_line(clip_rate: float) -> str:
    """How the runtime's speculation policy splits iterations at ``clip_rate`` (what the early
    compute step is priced with)."""
    r = expected_rates(clip_rate)
    return (f"early compute at clip rate {clip_rate:g} (the clip acts in that share of iterations): the "
            f"policy commits {r.committed:.1%}, recomputes {r.recomputed:.1%} (the clip acted), does not "
            f"speculate in {r.not_speculated:.1%}; the step is priced committed x early + the rest x without")


def ms(seconds: float) -> str:
    """Milliseconds, four significant digits (CPU toy runs are microseconds)."""
    return f"{1e3 * seconds:>9.4g}"


KIND_COLOURS = {"forward_backward": "tab:gray", "bubble": "lightgray", "grad_reduce": "tab:purple",
                "param_gather": "tab:cyan", "gather": "tab:blue", "step_gather": "tab:olive", "compute": "tab:orange",
                "scatter": "tab:green", "gram all-reduce": "tab:pink", "apply": "tab:red", "adamw": "tab:brown"}


def plot_ranks(result: StrategyResult, limit: int = 6) -> list[int]:
    """The busiest rank of the step, then the lowest ranks, ``limit`` in all."""
    busy: dict[int, float] = {}
    for s in result.timeline:
        if s.lane == "compute" and s.kind not in ("forward_backward", "bubble"):
            busy[s.rank] = busy.get(s.rank, 0.0) + s.end - s.start
    ranks = sorted({s.rank for s in result.timeline})
    busiest = max(busy, key=busy.__getitem__) if busy else ranks[0]
    return sorted(list(dict.fromkeys([busiest, *ranks]))[:limit])


def plot(report: dict[str, Any], results: dict[str, StrategyResult], names: tuple[str, str], path: str) -> None:
    """Per rank a compute and a comm lane: the whole iteration on top, the optimizer step below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(2, 2, figsize=(15, 7.5), squeeze=False)
    for col, name in enumerate(names):
        r = results[name]
        ranks = plot_ranks(r)
        step_start = r.iteration_seconds - r.optimizer_step_seconds
        for row, (lo, hi) in enumerate(((0.0, r.iteration_seconds), (step_start, r.iteration_seconds))):
            ax = axes[row][col]
            for s in r.timeline:
                if s.rank not in ranks or s.end < lo or s.start > hi:
                    continue
                y = 2 * ranks.index(s.rank) + (s.lane == "comm")
                ax.barh(y, 1e3 * (s.end - s.start), left=1e3 * s.start, height=0.8, color=KIND_COLOURS.get(s.kind, "k"),
                        edgecolor="black", linewidth=0.2)
            ax.set_yticks(range(2 * len(ranks)), [f"rank {q} {lane}" for q in ranks for lane in ("compute", "comm")],
                          fontsize=7)
            ax.invert_yaxis()
            ax.set_xlim(1e3 * lo, 1e3 * hi)
            what = "iteration" if row == 0 else "optimizer step"
            ax.set_title(f"{name}: {what} {1e3 * (hi - lo):.1f} ms", fontsize=9)
            ax.set_xlabel("ms since the iteration started")
    c = report["config"]
    fig.legend(handles=[Patch(color=v, label=k) for k, v in KIND_COLOURS.items()], loc="lower center",
               ncol=len(KIND_COLOURS), fontsize=8)
    fig.suptitle(f"Simulated {c['model']} on {c['gpus']} x {c['cluster']}, TP {c['tp']} PP {c['pp']} DP {c['dp']} "
                 f"({c['optimizer']}, {c['cost']})", fontsize=10)
    save_figure(fig, path, rect=(0, 0.05, 1, 1))
    print(f"wrote {path}", file=sys.stderr)


CASES = ("qwen3-1.7b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b")
CASE_GPUS = (64, 128, 256)
CASE_STRATEGIES = ("canzona", "canzona_lean", "megatron_layerwise", "megatron_tp_blockwise", "megatron_tp_distributed",
                   "layer_sharded", "megatron_main", "sync", "zero1", "adamw")


def short_ms(seconds: float) -> str:
    """Milliseconds with one decimal below a second, whole ones above."""
    return f"{1e3 * seconds:.0f}" if seconds >= 1 else f"{1e3 * seconds:.1f}"


def run_cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """docs/projection.md's table: per model and GPU count, step and iteration of every strategy
    (``a / b / ...`` in CASE_STRATEGIES order) and Canzona's speed-ups over Megatron's layer-wise.
    The ratios are those of the layout ``--canzona-layout auto`` (the default) picks: the whole
    or the lean one, whichever iteration is projected shorter."""
    header = ("| model | GPUs | TP, EP, DP | global batch | optimizer step (ms): " + " / ".join(CASE_STRATEGIES)
              + " | iteration (ms): " + " / ".join(CASE_STRATEGIES) + " | layout auto | limit L (ms) | step / L "
              "| step / best peer | iteration / best peer | iteration / AdamW | step speed-up | iteration speed-up "
              "| canzona step, `--muon-ns-method auto` (ms) | its step speed-up |")
    if args.early_compute:
        print(speculation_line(args.clip_rate) + "\n")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows = []
    for model in CASES:
        for gpus in CASE_GPUS:
            case = argparse.Namespace(**{**vars(args), "model": model, "gpus": gpus, "tp": None, "pp": None,
                                         "ep": None, "global_batch": None, "strategies": list(CASE_STRATEGIES),
                                         "plot": None})
            report, _ = project(case)
            auto, _ = project(argparse.Namespace(**{**vars(case), "muon_ns_method": "auto", "strategies": []}))
            report["canzona_auto_ns"] = auto["strategies"]["canzona"]
            c, s = report["config"], report["strategies"]
            steps = " / ".join(short_ms(s[n]["optimizer_step_seconds"]) for n in CASE_STRATEGIES)
            iters = " / ".join(f"{1e3 * s[n]['iteration_seconds']:.0f}" for n in CASE_STRATEGIES)
            layout = min(("canzona", "canzona_lean"), key=lambda n: (s[n]["iteration_seconds"],
                                                                     s[n]["optimizer_step_seconds"]))
            report["layout_auto"] = "whole" if layout == "canzona" else "lean"
            layerwise, canzona = s["megatron_layerwise"], s[layout]
            peer_step = min(s[n]["optimizer_step_seconds"] for n in PEERS)
            peer_iteration = min(s[n]["iteration_seconds"] for n in PEERS)
            print(f"| {model} | {gpus} | {c['tp']}, {c['ep']}, {c['dp']} | {c['global_batch']} | {steps} | {iters} | "
                  f"{report['layout_auto']} | {short_ms(report['physical_limit_seconds'])} | "
                  f"{canzona['optimizer_step_seconds'] / report['physical_limit_seconds']:.2f} | "
                  f"{canzona['optimizer_step_seconds'] / peer_step:.2f} | "
                  f"{canzona['iteration_seconds'] / peer_iteration:.3f} | "
                  f"{canzona['iteration_seconds'] / s['adamw']['iteration_seconds']:.3f} | "
                  f"{layerwise['optimizer_step_seconds'] / canzona['optimizer_step_seconds']:.2f}× | "
                  f"{layerwise['iteration_seconds'] / canzona['iteration_seconds']:.2f}× | "
                  f"{short_ms(report['canzona_auto_ns']['optimizer_step_seconds'])} | "
                  f"{layerwise['optimizer_step_seconds'] / report['canzona_auto_ns']['optimizer_step_seconds']:.2f}× |",
                  flush=True)
            rows.append(report)
    return rows


FSDP_CASES = (("qwen3-8b", 64, 1, 1), ("qwen3-8b", 256, 1, 1), ("qwen3-32b", 256, 4, 1), ("qwen3-30b-a3b", 64, 1, 8),
              ("qwen3-30b-a3b", 256, 1, 8))
"""``(model, GPUs, TP, EP)`` of docs/fsdp.md's projection table."""


def run_fsdp_cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """docs/fsdp.md's projection table: per case, every design's step and iteration under
    Megatron-FSDP (``optim_grads_params``), Canzona as the runtime's defaults run it (early
    gathers, early compute as :func:`fsdp_early_compute` decides, Megatron's fused fc1), and the
    issue's targets for those defaults: Canzona's step over the limit L (and the time its busiest
    rank's bytes take on the link, which L leaves out) and over the best peer, its iteration over
    AdamW-FSDP's, #4486's iteration over AdamW's, Canzona's bytes per rank over the bound; then the
    same defaults when the clip acts every iteration (the speculation policy then computes in the
    step, and Muon's gathers, which carry its source, wait for it: Shampoo's and SOAP's still go
    early); then ``--no-narrow-gathers`` (Muon's pieces gathered in fp32); then the opt-in ``--canzona-split-gate-up`` (gate and up hosted apart: another
    optimizer than Megatron's Muon, which orthogonalises the fused fc1), against its own limit;
    last, at TP > 1, the opt-in ``--canzona-tp-together auto`` (the largest TP-sharded matrices
    computed by their TP ranks together: the same optimizer, to rounding)."""
    header = ("| model | GPUs | TP, EP, FSDP | optimizer step (ms): " + " / ".join(FSDP_STRATEGIES)
              + " | iteration (ms): " + " / ".join(FSDP_STRATEGIES) + " | limit L (ms) | step / L | its bytes over "
              "the link (ms) | step / best peer | iteration / AdamW | #4486 iteration / AdamW | bytes / bound | clip "
              "acts every iteration: step (ms), step / L, iteration / AdamW | with --canzona-no-narrow-gathers: iteration / "
              "AdamW, bytes / bound | with --canzona-split-gate-up: step (ms), "
              "step / its L, iteration / AdamW | with --canzona-tp-together auto: step (ms), iteration / AdamW, bytes / "
              "bound |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    cluster = resolve_cluster(args.cluster)
    rows = []
    for model, gpus, tp, ep in FSDP_CASES:
        base = {**vars(args), "model": model, "gpus": gpus, "tp": tp, "ep": ep, "pp": 1, "cp": 1, "global_batch": None,
                "fsdp": args.fsdp or "optim_grads_params", "plot": None, "split_gate_up": False, "tp_together": "off",
                "narrow_gathers": args.optimizer == "muon"}
        report, _ = project_fsdp(argparse.Namespace(**base))
        wide, _ = project_fsdp(argparse.Namespace(**{**base, "narrow_gathers": False}))
        split, _ = project_fsdp(argparse.Namespace(**{**base, "split_gate_up": True}))
        clipped, _ = project_fsdp(argparse.Namespace(**{**base, "clip_rate": 1.0}))
        report["canzona_split_gate_up"] = gate_up = split["strategies"]["canzona"]
        report["canzona_clip_acts"] = clipped = clipped["strategies"]["canzona"]
        report["canzona_fp32_gathers"] = wide = wide["strategies"]["canzona"]
        together = None
        if tp > 1:
            shared, _ = project_fsdp(argparse.Namespace(**{**base, "tp_together": "auto"}))
            report["canzona_tp_together"] = together = shared["strategies"]["canzona"]
        s, c = report["strategies"], report["config"]
        canzona, limit = s["canzona"], report["physical_limit_seconds"]
        peer = min(s[n]["optimizer_step_seconds"] for n in FSDP_PEERS)
        adamw = s["adamw"]["iteration_seconds"]
        # the bytes a rank sends, at the all-to-all's speed on the link its group spans
        link = cluster.link(c["dp"] * c["tp"] > cluster.gpus_per_node).bytes_per_s * cluster.collectives.alltoall_efficiency
        wire = canzona["step_bytes_per_rank"] / link
        print(f"| {model} | {gpus} | {c['tp']}, {c['ep']}, {c['dp']} | "
              + " / ".join(short_ms(s[n]["optimizer_step_seconds"]) for n in FSDP_STRATEGIES) + " | "
              + " / ".join(f"{1e3 * s[n]['iteration_seconds']:.0f}" for n in FSDP_STRATEGIES) + " | "
              f"{short_ms(limit)} | {canzona['optimizer_step_seconds'] / limit:.2f} | {short_ms(wire)} | "
              f"{canzona['optimizer_step_seconds'] / peer:.2f} | "
              f"{canzona['iteration_seconds'] / adamw:.3f} | {s['every_holder']['iteration_seconds'] / adamw:.2f} | "
              f"{canzona['step_bytes_per_rank'] / report['step_bytes_bound']:.2f} | "
              f"{short_ms(clipped['optimizer_step_seconds'])}, {clipped['optimizer_step_seconds'] / limit:.2f}, "
              f"{clipped['iteration_seconds'] / adamw:.3f} | "
              f"{wide['iteration_seconds'] / adamw:.3f}, {wide['step_bytes_per_rank'] / report['step_bytes_bound']:.2f} | "
              f"{short_ms(gate_up['optimizer_step_seconds'])}, "
              f"{gate_up['optimizer_step_seconds'] / split['physical_limit_seconds']:.2f}, "
              f"{gate_up['iteration_seconds'] / adamw:.3f} | "
              + ("(TP 1)" if together is None else f"{short_ms(together['optimizer_step_seconds'])}, "
                 f"{together['iteration_seconds'] / adamw:.3f}, "
                 f"{together['step_bytes_per_rank'] / report['step_bytes_bound']:.2f}") + " |", flush=True)
        rows.append(report)
    return rows


INSTANCE_CASES = ("qwen3-32b", "qwen3-235b-a22b")
"""Models of docs/projection.md's instance table (at 256 GPUs, their recipes' sizes)."""
STATE_BYTES_PER_ELEMENT = {"adamw": 12, "muon": 8, "adaptive_muon": 12}
"""fp32 main parameter and optimizer state per parameter element a rank's shard holds: AdamW's
two moments, Muon's momentum, AdaMuon's momentum and second moment (NorMuon's is per row; counted
as Muon's here); elementwise parameters always take AdamW's."""


def state_bytes(specs: list, run: dict[str, Any], optimizer: str) -> float:
    """One rank's fp32 main parameters and optimizer state: its stage's local elements sharded over
    an instance's DP (x CP) ranks (experts over its expert-DP ranks), at
    :data:`STATE_BYTES_PER_ELEMENT` (Shampoo's and SOAP's factors are not counted)."""
    instances = run.get("instances", 1)
    dp = run["dp_cp"] // instances
    expert_dp = run["dp_cp"] * run["tp"] // (run["ep"] * run["etp"]) // instances
    matrix = STATE_BYTES_PER_ELEMENT.get(optimizer, STATE_BYTES_PER_ELEMENT["muon"])
    out = 0.0
    for spec in specs:
        per = STATE_BYTES_PER_ELEMENT["adamw"] if spec.family != "matrix" else matrix
        out += spec.numel * per / (expert_dp if spec.is_expert else dp)
    return out


def run_instance_cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """docs/projection.md's instance table: per model at 256 GPUs and per instance count (every
    divisor of the DP and expert-DP sizes up to 8), Canzona's (the layout ``--canzona-layout auto``
    picks, the shorter iteration of the whole and the lean one) and AdamW's step and iteration, the
    reductions' exposed tail, the bytes a rank sends per iteration in the buckets' collectives by
    link, and the optimizer state a rank holds; the fastest count per model and optimizer."""
    header = ("| model | instances | DP per instance | canzona (layout auto): step, iteration (ms) | adamw: step, iteration (ms) "
              "| reduce exposed, canzona / adamw (ms) | canzona's bytes per rank and iteration, inter-node: reduce-scatter + "
              "across instances + all-gather (GiB) | NVLink (GiB) | state per rank, canzona / adamw (GiB) |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows: list[dict[str, Any]] = []
    for model in INSTANCE_CASES:
        base = {**vars(args), "model": model, "gpus": 256, "tp": None, "pp": None, "ep": None, "global_batch": None,
                "strategies": ["canzona_lean", "adamw"], "plot": None}
        first, _ = project(argparse.Namespace(**{**base, "instances": 1}))
        dp_cp = first["config"]["dp_cp"]
        counts = [i for i in (1, 2, 4, 8) if dp_cp % i == 0]
        best: dict[str, tuple[float, int]] = {}
        for instances in counts:
            try:
                report, _ = project(argparse.Namespace(**{**base, "instances": instances}))
            except ValueError:  # not a divisor of the expert-DP size
                continue
            c, s = report["config"], dict(report["strategies"])
            layout = min(("canzona", "canzona_lean"), key=lambda n: s[n]["iteration_seconds"])
            report["layout_auto"] = "whole" if layout == "canzona" else "lean"
            s["canzona"] = {**s[layout], "layout": report["layout_auto"]}
            stages = [stage_specs(args, c, pp_rank) for pp_rank in range(c["pp"])]
            moved = s["canzona"]["details"]["bytes"]
            inter = [moved["reduce_inter"], moved["instances_inter"], moved["gather_inter"]]
            intra = moved["reduce_intra"] + moved["instances_intra"] + moved["gather_intra"]
            report["state_bytes"] = {name: max(state_bytes(specs, c, name if name == "adamw" else c["optimizer"])
                                               for specs in stages) for name in ("canzona", "adamw")}
            for name in ("canzona", "adamw"):
                t = s[name]["iteration_seconds"]
                if name not in best or t < best[name][0]:
                    best[name] = (t, instances)
            gib = 2.0**30
            print(f"| {model} | {instances} | {c['dp_cp'] // instances} | {s['canzona']['layout']}: "
                  f"{short_ms(s['canzona']['optimizer_step_seconds'])}, {1e3 * s['canzona']['iteration_seconds']:.0f} | "
                  f"{short_ms(s['adamw']['optimizer_step_seconds'])}, {1e3 * s['adamw']['iteration_seconds']:.0f} | "
                  f"{short_ms(s['canzona']['grad_reduce_exposed_seconds'])} / "
                  f"{short_ms(s['adamw']['grad_reduce_exposed_seconds'])} | "
                  f"{' + '.join(f'{b / gib:.2f}' for b in inter)} = {sum(inter) / gib:.2f} | {intra / gib:.2f} | "
                  f"{report['state_bytes']['canzona'] / gib:.1f} / {report['state_bytes']['adamw'] / gib:.1f} |",
                  flush=True)
            rows.append(report)
        print(f"\n{model}: fastest iteration with {best['canzona'][1]} instance(s) for Canzona "
              f"({1e3 * best['canzona'][0]:.0f} ms), {best['adamw'][1]} for AdamW ({1e3 * best['adamw'][0]:.0f} ms)\n",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.instance_cases:
            rows = run_instance_cases(args)
            if args.json:
                print(json.dumps(rows))
            return 0
        if args.cases or args.fsdp_cases:
            rows = run_fsdp_cases(args) if args.fsdp_cases else run_cases(args)
            if args.json:
                print(json.dumps(rows))
            return 0
        report, results = project_fsdp(args) if args.fsdp else project(args)
    except (ValueError, TypeError, OSError) as exc:
        print(f"simulate.py: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        (print_fsdp_report if args.fsdp else print_report)(report)
    if args.plot:
        plot(report, results, tuple(args.plot_strategies), args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
