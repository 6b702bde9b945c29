#!/usr/bin/env python
"""Build one rank of a full-size Canzona job in one CPU process and check it against the plan.

    python tools/dry_run.py --model qwen3-32b --tp 8 --dp 32
    python tools/dry_run.py --model qwen3-8b --tp 2 --dp 128 --rank 17 --optimizer soap
    python tools/dry_run.py --model qwen3-32b --tp 8 --dp 16 --pp 2 --rank 255 --json
    python tools/dry_run.py --model qwen3-30b-a3b --ep 8 --dp 32 --rank 77
    python tools/dry_run.py --model qwen3-235b-a22b --ep 8 --dp 32 --pp 8 \
        --decoder-first-pipeline-num-layers 10 --decoder-last-pipeline-num-layers 12
    python tools/dry_run.py --fsdp --model qwen3-8b --dp 64 --data-parallel-sharding-strategy optim

The named rank's real Megatron-Core ``GPTModel`` (its pipeline stage; local layer spec),
Megatron's ``DistributedDataParallel`` with the Canzona layout and the Canzona optimizer are
built on the meta device (shapes and dtypes, no storage) under torch's ``fake``
process-group backend standing in for the whole world. It prints what that rank holds --
parameter and gradient buffers, buckets, fp32 main parameters, optimizer state by kind,
the largest temporary buffer of the step -- beside the planner's prediction
(``megatron.canzona.planning.memory``), and exits 1 where they disagree.

Mixture-of-experts models with ``--ep`` above 1 (expert TP 1) also get expert-parallel
buffers, planned over the expert-data-parallel group, and a second (chained) optimizer over
them: the ``expert ...`` rows; optimizer state is summed over both optimizers.

``--fsdp`` (``--use-megatron-fsdp``) predicts instead of measuring (``canzona_patches/harness/fsdp_dry_run.py``:
Megatron-FSDP is not built without storage): the rank's part of its buffers per sharding strategy, optimizer state
and step buffers, from the plan of the model built as above; tests/e2e/test_canzona_fsdp.py (test_dry_runs_fsdp_prediction_is_what_every_rank_measured) holds
that prediction to what CPU runs measure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time

from canzona_patches.harness import fsdp_dry_run as fsdp_mode
from megatron.canzona.cli import ArgumentParser, at_least, fraction, non_negative
from megatron.canzona.planning import DEFAULT_ALPHA, OPTIMIZERS, QWEN3_MODELS, get_qwen3_config, qwen3_specs
from megatron.canzona.planning.grid import expert_coordinates, expert_dp_size
from megatron.canzona.planning.memory import (
    EARLY_COMPUTE_BYTES,
    FIELD_KINDS,
    STATE_BYTES,
    STATE_KINDS,
    RankMemory,
    StateLayout,
    rank_memory,
)
from megatron.canzona.planning.pipeline import FIRST_FLAG, LAST_FLAG, stage_layer_counts
from megatron.canzona.planning.qwen3 import padded_vocab_size
from megatron.canzona.planning.qwen3_moe import check_experts
from megatron.canzona.optim import MuonConfig
from megatron.canzona.optim.adaptive_muon import MOMENT2_METHODS, AdaptiveMuonConfig
from megatron.canzona.planning.balance import TP_TOGETHER
from megatron.canzona.runtime.config import FSDP_MICRO_GROUPS, LAYOUT_CHOICES, CanzonaConfig

DTYPE_BYTES = {"bf16": 2, "fp32": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b", help=f"one of: {', '.join(QWEN3_MODELS)}")
    p.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=at_least(1), default=1, help="tensor-parallel size")
    p.add_argument("--dp", "--data-parallel-size", dest="dp", type=at_least(1), default=8, help="data-parallel size")
    p.add_argument("--cp", "--context-parallel-size", dest="cp", type=at_least(1), default=1,
                   help="context-parallel size: the plan and the optimizer shard over DP x CP, as Megatron's DDP "
                   "reduces over it (ranks in Megatron's order, TP then CP then DP)")
    p.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=at_least(1), default=1, help="pipeline-parallel size")
    p.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=at_least(1), default=1,
                   help="expert-parallel size (MoE models; expert TP is 1 above 1)")
    p.add_argument(FIRST_FLAG, dest="first_stage_layers", type=at_least(0), default=None,
                   help="layers of the first pipeline stage (Megatron's; for layers PP does not divide)")
    p.add_argument(LAST_FLAG, dest="last_stage_layers", type=at_least(0), default=None,
                   help="layers of the last pipeline stage")
    p.add_argument("--etp", "--expert-tensor-parallel-size", dest="etp", type=at_least(1), default=None,
                   help="expert tensor-parallel size (default 1 under --ep, as the recipes; Megatron's own default is "
                   "the TP size): each expert matrix is hosted over expert DP x expert TP")
    p.add_argument("--rank", type=at_least(0), default=0, help="global rank to build (Megatron's default rank order)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="muon", help="matrix optimizer")
    p.add_argument("--muon-fp32-matmul-prec", choices=("low", "medium", "high"), default="medium",
                   help="Muon's Newton-Schulz precision (pretrain_gpt.py's flag): high iterates in fp32, the others "
                   "in bf16, whose directions (and, under --fsdp, gathers) move in bf16")
    p.add_argument("--adaptive-muon-moment2-method", choices=MOMENT2_METHODS, default="adamuon",
                   help="with --optimizer adaptive_muon: AdaMuon's elementwise second moment or NorMuon's per row "
                   "or column (pretrain_gpt.py's flag)")
    p.add_argument("--alpha", type=fraction, default=DEFAULT_ALPHA, help="planner balance knob")
    p.add_argument("--bucket-size", type=at_least(1), default=None, help="elements per DDP bucket (default: Megatron's)")
    p.add_argument("--layout", "--canzona-layout", dest="layout", choices=LAYOUT_CHOICES, default=CanzonaConfig.layout,
                   help="DP layout of the matrix buffers (pretrain_gpt.py's --canzona-layout)")
    p.add_argument("--cluster", "--canzona-cluster", dest="cluster", default="h100-ib400",
                   help="cluster the auto layout is projected on (a preset or a TOML/JSON file)")
    p.add_argument("--params-dtype", choices=tuple(DTYPE_BYTES), default="bf16", help="parameter dtype")
    p.add_argument("--grad-reduce-in-fp32", action="store_true", help="fp32 gradient buffers")
    p.add_argument("--no-early-compute", "--canzona-no-early-compute", dest="early_compute", action="store_false",
                   help="the run computes every matrix update in the step (pretrain_gpt.py's --canzona-no-early-compute; "
                   "default: early, as on CUDA, with its staging state and directions counted)")
    p.add_argument("--early-compute-budget", "--canzona-early-compute-budget", dest="early_compute_budget", type=non_negative,
                   default=EARLY_COMPUTE_BYTES / 2**30, metavar="GIB",
                   help="most GiB early compute keeps per rank (pretrain_gpt.py's --canzona-early-compute-budget)")
    p.add_argument("--fsdp-micro-groups", "--canzona-fsdp-micro-groups", dest="fsdp_micro_groups",
                   choices=FSDP_MICRO_GROUPS, default=None,
                   help="with --fsdp: the micro-groups of the run (pretrain_gpt.py's --canzona-fsdp-micro-groups; "
                   "default auto: as a CUDA run projects them on --cluster, at the recipes' batch)")
    p.add_argument("--tp-together", "--canzona-tp-together", dest="tp_together", choices=TP_TOGETHER, default=None,
                   help="with --fsdp, Muon and TP: the TP-sharded matrices whose TP ranks compute them together "
                   "(pretrain_gpt.py's --canzona-tp-together; default off)")
    p.add_argument("--narrow-gathers", "--canzona-narrow-gathers", dest="narrow_gathers", action="store_true",
                   default=None,
                   help="with --fsdp and Muon: the hosts gather each whole matrix's normalised input in bf16 "
                   "(pretrain_gpt.py's --canzona-narrow-gathers; default: with --fsdp and --optimizer muon, as a GPU "
                   "run's bf16 Newton-Schulz takes it)")
    p.add_argument("--no-narrow-gathers", "--canzona-no-narrow-gathers", dest="narrow_gathers", action="store_false",
                   help="with --fsdp and Muon: the pieces gathered in fp32 (pretrain_gpt.py's --canzona-no-narrow-gathers)")
    p.add_argument("--vocab-size", type=at_least(1), default=None,
                   help="the tokenizer's vocabulary (default: the model's), padded as Megatron pads it")
    fsdp_mode.add_fsdp_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    fsdp_mode.check_fsdp_args(p, args, CanzonaConfig.layout)
    if args.model.lower() not in QWEN3_MODELS:
        p.error(f"unknown model {args.model!r}; choose one of: {', '.join(QWEN3_MODELS)}")
    world = args.tp * args.dp * args.cp * args.pp
    if min(args.tp, args.dp, args.cp, args.pp) < 1:
        p.error("--tp, --dp, --cp and --pp must be 1 or more")
    if not 0 <= args.rank < world:
        cp = f" x CP {args.cp}" if args.cp > 1 else ""
        p.error(f"--rank {args.rank} is outside the world of TP {args.tp} x DP {args.dp}{cp} x PP {args.pp} = {world} "
                "ranks")
    # The optimizer's view from here on: DP x CP ranks (a rank's index there is cp_rank + CP x dp_rank).
    args.data_parallel, args.dp = args.dp, args.dp * args.cp
    cfg = model_config(args)
    try:
        check_experts(cfg, ep_size=args.ep, expert_tp_size=expert_tp_size(args) if cfg.is_moe else 1,
                      expert_layout="sequential")
        if cfg.is_moe:
            expert_dp_size(dp_size=args.dp, tp_size=args.tp, ep_size=args.ep, expert_tp_size=expert_tp_size(args))
        stage_layer_counts(cfg.num_layers, args.pp, first_stage_layers=args.first_stage_layers,
                           last_stage_layers=args.last_stage_layers)
    except ValueError as error:
        p.error(str(error))
    return args


def model_config(args: argparse.Namespace):
    """The catalog's configuration of ``args.model``, with ``--vocab-size`` where given."""
    cfg = get_qwen3_config(args.model)
    return cfg if args.vocab_size is None else dataclasses.replace(cfg, vocab_size=args.vocab_size)


def early_budget(args: argparse.Namespace) -> int:
    """Bytes early compute may keep on the rank (0 without early compute)."""
    return int(args.early_compute_budget * 2**30) if args.early_compute else 0


def expert_tp_size(args: argparse.Namespace) -> int:
    """``--etp``; by default expert TP 1 under EP (the recipes'), and at EP 1 the TP size (experts
    are then dense parameters, sharded like them over the TP group)."""
    if args.etp is not None:
        return args.etp
    return 1 if args.ep > 1 else args.tp


def coordinates(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(DP rank, TP rank, PP stage) of a global rank in Megatron's default order tp-cp-ep-dp-pp."""
    return (rank // tp) % dp, rank % tp, rank // (tp * dp)


def expert_coords(args: argparse.Namespace) -> tuple[int, int, int]:
    """(expert DP rank, EP rank, expert TP rank) of ``args.rank`` in Megatron's expert order etp-ep-dp-pp."""
    dp_rank, tp_rank, _ = coordinates(args.rank, args.tp, args.dp)
    return expert_coordinates(dp_rank, tp_rank, tp_size=args.tp, ep_size=args.ep, expert_tp_size=expert_tp_size(args))


def host_ranks(args: argparse.Namespace, stage: int) -> dict[tuple[int, int], int]:
    """(DP rank, TP rank) -> rank in the stage's tensor-and-data-parallel group, checked against
    the process groups Megatron built."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    base = stage * args.tp * args.dp
    members = dist.get_process_group_ranks(parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))
    table = {coordinates(g, args.tp, args.dp)[:2]: members.index(g) for g in range(base, base + args.tp * args.dp)}
    tp_members = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    dp_members = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
    me = coordinates(args.rank, args.tp, args.dp)
    if [coordinates(g, args.tp, args.dp)[1] for g in tp_members] != list(range(args.tp)) or \
            [coordinates(g, args.tp, args.dp)[0] for g in dp_members] != list(range(args.dp)) or \
            any(coordinates(g, args.tp, args.dp)[0] != me[0] for g in tp_members):
        raise RuntimeError("Megatron's process groups do not follow the tp-cp-ep-dp-pp rank order this tool assumes")
    return table


def check_expert_hosts(args: argparse.Namespace, engine) -> None:
    """The expert optimizer's hosts ``(expert DP rank d, 0)`` are rank ``d`` of its host group
    (``build_canzona_optimizer``'s mapping): check that group rank ``d`` is the GPU of this
    stage and EP rank whose expert DP coordinate is ``d``."""
    import torch.distributed as dist

    base = coordinates(args.rank, args.tp, args.dp)[2] * args.tp * args.dp
    members = dist.get_process_group_ranks(engine.group)
    _, ep_rank, _ = expert_coords(args)
    for (edp, etp), index in engine.rank_of.items():
        g = members[index]
        dp_rank, tp_rank, _ = coordinates(g, args.tp, args.dp)
        where = expert_coordinates(dp_rank, tp_rank, tp_size=args.tp, ep_size=args.ep,
                                   expert_tp_size=expert_tp_size(args))
        if not base <= g < base + args.tp * args.dp or where != (edp, ep_rank, etp):
            raise RuntimeError(f"the expert host group's rank {index} is global rank {g} at expert (DP, EP, TP) "
                               f"{where}, not the host ({edp}, {ep_rank}, {etp}) the expert optimizer maps to it")


def build_rank(args: argparse.Namespace):
    """Rank ``args.rank``'s model stage, DDP wrapper, plan and Canzona optimizer, on meta."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from canzona_patches.integration.optimizer import build_canzona_optimizer
    from canzona_patches.integration.setup import make_setup

    dtype = torch.bfloat16 if args.params_dtype == "bf16" else torch.float32
    config, model = build_model(args, dtype)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
        grad_reduce_in_fp32=args.grad_reduce_in_fp32, bucket_size=args.bucket_size,
    )
    stage = coordinates(args.rank, args.tp, args.dp)[2]
    # The setup is made from the live model's parameters, as pretrain_gpt.py makes it.
    setup = make_setup([model], ddp_config, canzona_config(args), dp_size=args.dp, tp_size=args.tp, ep_size=args.ep,
                       expert_tp_size=expert_tp_size(args), host_ranks=host_ranks(args, stage), log=False)
    ddp_model = DistributedDataParallel(config, ddp_config, model, full_param_layout=setup.layouts[0])
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=4e-4, weight_decay=0.1, clip_grad=1.0, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=True,
    )
    optimizer = build_canzona_optimizer(optimizer_config, [ddp_model], setup)
    dense, expert = split_optimizer(optimizer)
    if expert is not None:  # its host mapping is build_canzona_optimizer's own: check it
        check_expert_hosts(args, expert.optimizer.engine)
    for part in (dense, expert):
        if part is not None:
            part.optimizer.init_state()
    return ddp_model, optimizer, setup


def canzona_config(args: argparse.Namespace) -> CanzonaConfig:
    """The run's Canzona configuration (``pretrain_gpt.py``'s flags of the same names)."""
    # Muon's family as pretrain_gpt.py configures it: Newton-Schulz in the flag's precision, the exact
    # norm under Megatron-FSDP (its default there)
    muon = dict(ns_dtype="float32" if args.muon_fp32_matmul_prec == "high" else "bfloat16",
                exact_norm=bool(getattr(args, "fsdp", None)))
    matrix = (AdaptiveMuonConfig(moment2_method=args.adaptive_muon_moment2_method, **muon)
              if args.optimizer == "adaptive_muon" else MuonConfig(**muon) if args.optimizer == "muon" else None)
    return CanzonaConfig(optimizer=args.optimizer, matrix=matrix, alpha=args.alpha, layout=args.layout,
                         cluster=args.cluster,
                         # the GPU run this rank models computes early (auto: DP above 1, overlapped reduces)
                         early_compute="on" if args.early_compute else "off", early_compute_bytes=early_budget(args),
                         fsdp_micro_groups=getattr(args, "fsdp_micro_groups", None) or "auto",
                         tp_together=getattr(args, "tp_together", None) or "off",
                         narrow_gathers=bool(getattr(args, "narrow_gathers", False)))


def fsdp_main(args: argparse.Namespace) -> int:
    """``--fsdp``: the rank's Megatron-FSDP buffers, state and step buffers as its plan predicts them."""
    import torch

    start = time.perf_counter()
    try:
        _, model = build_model(args, torch.bfloat16 if args.params_dtype == "bf16" else torch.float32)
        setup = fsdp_mode.fsdp_setup(args, model, canzona_config(args), host_ranks=host_ranks(args, 0),
                                     expert_tp_size=expert_tp_size(args))
    except (ValueError, RuntimeError) as error:
        print(f"dry_run.py: error: {error}", file=sys.stderr)
        return 2
    dp_rank, tp_rank, _ = coordinates(args.rank, args.tp, args.dp)
    report = fsdp_mode.fsdp_report(args, setup, config_record(args, setup.plan), catalog_row(args, list(setup.specs)),
                                   dp_rank=dp_rank, tp_rank=tp_rank, param_bytes=DTYPE_BYTES[args.params_dtype],
                                   build_seconds=time.perf_counter() - start)
    if args.json:
        print(json.dumps(report))
    else:
        fsdp_mode.print_fsdp_report(report, describe_rank(report["config"], stages=False))
    return 0 if report["agree"] else 1


def config_record(args: argparse.Namespace, plan) -> dict:
    """The report's ``config``: the job, the rank's coordinates and the settings."""
    dp_rank, tp_rank, stage = coordinates(args.rank, args.tp, args.dp)
    expert_dp_rank, ep_rank, _ = expert_coords(args)
    return {"model": args.model, "tp": args.tp, "dp": args.data_parallel, "cp": args.cp, "pp": args.pp,
            "ep": args.ep, "rank": args.rank, "dp_rank": dp_rank // args.cp, "cp_rank": dp_rank % args.cp,
            "tp_rank": tp_rank, "pp_stage": stage,
            "expert_dp": None if plan.experts is None else plan.experts.dp_size, "expert_dp_rank": expert_dp_rank,
            "ep_rank": ep_rank, "optimizer": args.optimizer,
            "params_dtype": args.params_dtype, "grad_reduce_in_fp32": args.grad_reduce_in_fp32, "alpha": args.alpha,
            "bucket_size": plan.dp.bucket_size if not args.fsdp else args.bucket_size}


def init_fake_world(args: argparse.Namespace) -> None:
    """Torch's fake process groups for the whole world, Megatron's groups over them, and
    Megatron's CUDA allocations redirected to the meta device."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from canzona_patches.version import quiet_megatron_notices

    quiet_megatron_notices()
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)  # "GPTModel IS DEPRECATED"
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.tp * args.dp * args.pp)
    from canzona_patches.emulation.cpu import enable_cpu_mode

    enable_cpu_mode(meta=True)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    real_new_group = dist.new_group

    def fake_group(*group_args, backend=None, **kwargs):  # every group fakes, Megatron's gloo ones too
        return real_new_group(*group_args, **kwargs)

    dist.new_group = fake_group
    try:
        parallel_state.initialize_model_parallel(args.tp, args.pp, expert_model_parallel_size=args.ep,
                                                 expert_tensor_parallel_size=expert_tp_size(args))
    finally:
        dist.new_group = real_new_group
    model_parallel_cuda_manual_seed(1234)


def build_model(args: argparse.Namespace, dtype):
    """(TransformerConfig, this rank's GPTModel stage on meta) of ``args.model``."""
    import torch

    init_fake_world(args)
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = model_config(args)
    config = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", layernorm_epsilon=cfg.norm_epsilon, qk_layernorm=True, add_bias_linear=False,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        num_layers_in_first_pipeline_stage=args.first_stage_layers,
        num_layers_in_last_pipeline_stage=args.last_stage_layers,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=False,
        perform_initialization=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        **moe_config(args, cfg),
    )
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts or None, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")  # moe_grouped_gemm off: SequentialMLP, the catalog's
    with torch.device("meta"):
        model = GPTModel(
            config, spec,
            vocab_size=padded_vocab_size(cfg.vocab_size, args.tp), max_sequence_length=cfg.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=cfg.tied_embeddings, position_embedding_type="rope",
            rotary_base=int(cfg.rotary_base),
        ).to(dtype)  # what Megatron's Float16Module does to a bf16 model
    return config, model


def moe_config(args: argparse.Namespace, cfg) -> dict:
    """Qwen3-MoE's TransformerConfig fields (router, dropless all-to-all dispatch, expert
    sizes); nothing for a dense model."""
    if not cfg.is_moe:
        return {}
    return dict(
        num_moe_experts=cfg.num_experts, moe_router_topk=cfg.moe_router_topk, moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3,
        expert_model_parallel_size=args.ep, expert_tensor_parallel_size=expert_tp_size(args),
        sequence_parallel=args.tp > 1,  # Megatron's MoE layer refuses TP without it
    )


def split_optimizer(optimizer):
    """(dense, expert or None) ``CanzonaDistributedOptimizer``s of what ``build_canzona_optimizer`` returned."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return optimizer, None
    dense, expert = chained
    return dense, expert


def measure(ddp_model, optimizer, early_compute: int = EARLY_COMPUTE_BYTES) -> dict:
    """What the built rank actually holds, in elements: its dense buffers and optimizer, and
    (``experts``) its expert-parallel ones; with an ``early_compute`` budget in bytes (CUDA's
    default; 0: none), what the early compute of its engine keeps."""
    dense, expert = split_optimizer(optimizer)
    record = _measure_part(list(ddp_model.buffers), dense, early_compute)
    record["experts"] = (None if expert is None else
                         _measure_part(list(ddp_model.expert_parallel_buffers), expert, early_compute))
    return record


def _measure_part(buffers: list, optimizer, early_compute: int) -> dict:
    """Buffers, shards, main parameters, state and temporaries of one distributed optimizer."""
    from canzona_patches.integration.layout import BUFFER_ROUTING_ATTR
    from canzona_patches.integration.optimizer import early_groups

    matrix = [b for b in buffers if getattr(b.params[0], BUFFER_ROUTING_ATTR, False)]
    other = [b for b in buffers if not getattr(b.params[0], BUFFER_ROUTING_ATTR, False)]
    inner = optimizer.optimizer
    kinds = dict.fromkeys(STATE_KINDS, 0)
    for stored in inner.matrix_state.values():
        for piece in stored["pieces"]:
            for field, value in piece.items():
                if hasattr(value, "numel"):
                    kinds[FIELD_KINDS[field]] += value.numel()
    for group in inner.param_groups:
        if not group["matrix"]:
            for p in group["params"]:
                kinds["adam_moments"] += sum(v.numel() for v in inner.state[p].values() if hasattr(v, "numel"))
    main = sum(t.numel() for group in optimizer.shard_fp32_from_float16_groups for t in group if t is not None)
    groups = early_groups(inner, early_compute) if early_compute and inner.engine.mode == "async" else frozenset()
    hosted = {t.key for e in inner.engine.exchanges if e.index in groups for b in e.computed for t in b}
    largest, step = inner.engine.temporaries()
    tp = inner.engine.tp_size
    batch = max((sum(math.prod(inner._tasks[k].full_shape(tp)) for k in keys) for keys in inner.engine.compute_batches()),
                default=0)
    return {
        "param_buffer_elements": sum(b.numel for b in buffers),
        "grad_buffer_elements": sum(b.grad_data.numel() for b in buffers),
        "param_dtype_bytes": buffers[0].param_data.element_size(),
        "grad_dtype_bytes": buffers[0].grad_data.element_size(),
        "bucket_elements": [bucket.grad_data.numel() for b in matrix + other for bucket in b.buckets],
        "num_matrix_buckets": sum(len(b.buckets) for b in matrix),
        "shard_elements": sum(p.numel() for group in inner.param_groups for p in group["params"]),
        "main_param_elements": main,
        "state_elements": kinds,
        "largest_temporary_elements": largest,
        "step_temporary_elements": step,
        "compute_batch_elements": batch,
        "early_gather_elements": inner.engine.early_temporaries() if optimizer.canzona.early_gathers else 0,
        # the staging copy mirrors the state it stages: what init_state made of those matrices
        "early_state_elements": 0 if inner.direction_fn is not None else sum(  # Muon: advanced at the commit
            value.numel() for key in hosted for piece in inner.matrix_state[key]["pieces"]
            for value in piece.values() if hasattr(value, "numel")),
        "early_direction_elements": inner.engine.early_directions(groups),
        "device": str(buffers[0].param_data.device),
    }


def predict(args: argparse.Namespace, plan, specs_state: StateLayout, specs) -> dict:
    """The planner's prediction of what :func:`measure` finds, dense and (``experts``) expert."""
    dp_rank, tp_rank, _ = coordinates(args.rank, args.tp, args.dp)
    mem = rank_memory(plan, specs, dp_rank=dp_rank, tp_rank=tp_rank, state=specs_state,
                      early_compute_bytes=early_budget(args))
    record = _predict_part(args, mem, plan)
    record["experts"] = None if mem.experts is None else _predict_part(args, mem.experts, plan.experts)
    return record


def catalog_row(args: argparse.Namespace, specs) -> dict:
    """The stage's parameters as the planning catalog describes them (``qwen3_specs``: its
    pipeline split, expert sharding and Megatron names) against the built model's: the
    plan is made from the model, so this is what checks the model is the one asked for."""
    stage = coordinates(args.rank, args.tp, args.dp)[2]
    catalog = qwen3_specs(model_config(args), tp_size=args.tp, ep_size=args.ep,
                          expert_tp_size=expert_tp_size(args) if get_qwen3_config(args.model).is_moe else 1,
                          pp_size=args.pp, pp_rank=stage, first_stage_layers=args.first_stage_layers,
                          last_stage_layers=args.last_stage_layers)

    def described(rows) -> list[tuple]:
        return [(s.name, s.local_shape, s.is_expert, s.family) for s in rows]

    row = _row("parameter elements (the catalog's names and shapes)", sum(s.numel for s in catalog),
               sum(s.numel for s in specs), None)
    return {**row, "ok": row["ok"] and described(catalog) == described(specs)}


def _predict_part(args: argparse.Namespace, mem: RankMemory, plan) -> dict:
    return {
        "param_buffer_elements": mem.param_buffer_elements,
        "grad_buffer_elements": mem.param_buffer_elements,
        "param_dtype_bytes": DTYPE_BYTES[args.params_dtype],
        "grad_dtype_bytes": 4 if args.grad_reduce_in_fp32 else DTYPE_BYTES[args.params_dtype],
        "bucket_elements": list(mem.bucket_elements),
        "num_matrix_buckets": sum(len(dp.matrix.buckets) for dp in plan.layouts),
        "shard_elements": mem.shard_elements,
        "main_param_elements": mem.shard_elements if args.params_dtype != "fp32" else 0,
        "state_elements": mem.state_elements,
        "largest_temporary_elements": mem.largest_temporary_elements,
        "step_temporary_elements": mem.step_temporary_elements,
        "compute_batch_elements": mem.compute_batch_elements,
        "early_gather_elements": mem.early_gather_elements,
        "early_state_elements": mem.early_state_elements,
        "early_direction_elements": mem.early_direction_elements,
    }


PART_ROWS = (  # (key, label, bytes per element: a number, or the key of one), once per part (dense, expert)
    ("param_buffer_elements", "parameter buffers", "param_dtype_bytes"),
    ("grad_buffer_elements", "gradient buffers", "grad_dtype_bytes"),
    ("num_matrix_buckets", "matrix buffer buckets", None),
    ("shard_elements", "parameter elements in this rank's shards", None),
    ("main_param_elements", "fp32 main parameters", STATE_BYTES),
)
STATE_ROWS = tuple((f"state:{kind}", f"optimizer state: {kind.replace('_', ' ')}", STATE_BYTES) for kind in STATE_KINDS)
"""Summed over the dense and the expert optimizer."""
TEMPORARY_ROWS = (
    ("largest_temporary_elements", "largest temporary buffer of the step", STATE_BYTES),
    ("step_temporary_elements", "host-group buffers alive at once", STATE_BYTES),
    ("compute_batch_elements", "largest host-compute batch (stacked grads)", STATE_BYTES),
    ("early_gather_elements", "early gather buffers (alive from backward)", STATE_BYTES),
    ("early_state_elements", "early compute: staging copy of the matrix state", STATE_BYTES),
    ("early_direction_elements", "early compute: directions (alive from backward)", STATE_BYTES),
)
EXPERT = "expert "
"""Label prefix of the expert part's rows."""
STEADY = ("parameter buffers", "gradient buffers", "fp32 main parameters",
          "early compute: staging copy of the matrix state")
"""What a part holds between steps, with the optimizer state; the step adds the host-group
buffers and a stack copy."""
TRANSIENT = ("host-group buffers alive at once", "largest host-compute batch (stacked grads)",
             "early compute: directions (alive from backward)")


def memory_summary(rows: list[dict]) -> dict:
    """Steady-state and peak bytes of the step, from the measured rows. The dense and the
    expert optimizer step one after the other, so the peak adds the larger of their transients."""
    by_name = {row["quantity"]: row["bytes"] or 0 for row in rows}
    steady = sum(by_name.get(prefix + name, 0) for prefix in ("", EXPERT) for name in STEADY)
    steady += sum(by_name[label] for _, label, _ in STATE_ROWS)
    peak = steady + max(sum(by_name.get(prefix + name, 0) for name in TRANSIENT) for prefix in ("", EXPERT))
    return {"steady_bytes": steady, "peak_bytes": peak, "peak_over_steady": peak / steady if steady else 0.0}


def _row(label: str, predicted: int, measured: int, size: int | None) -> dict:
    return {"quantity": label, "predicted": predicted, "measured": measured,
            "bytes": None if size is None else measured * size, "ok": predicted == measured}


def _part_rows(predicted: dict, measured: dict, specs: tuple, prefix: str) -> list[dict]:
    return [_row(prefix + label, predicted[key], measured[key], measured[per] if isinstance(per, str) else per)
            for key, label, per in specs]


def _layout_rows(predicted: dict, measured: dict, prefix: str) -> list[dict]:
    """Every bucket's size in order, and the buffers' dtypes."""
    rows = [{"quantity": prefix + "bucket sizes, in order", "predicted": len(predicted["bucket_elements"]),
             "measured": len(measured["bucket_elements"]), "bytes": None,
             "ok": predicted["bucket_elements"] == measured["bucket_elements"]}]
    return rows + [_row(prefix + key.replace("_", " "), predicted[key], measured[key], None)
                   for key in ("param_dtype_bytes", "grad_dtype_bytes")]


def compare(predicted: dict, measured: dict) -> list[dict]:
    """One row per quantity: the dense part, the expert part (when either side has one), the
    optimizer state of both, the temporaries of each optimizer, then bucket sizes and dtypes."""
    parts = [(predicted, measured, "")]
    rows = []
    if predicted["experts"] is not None and measured["experts"] is not None:
        parts.append((predicted["experts"], measured["experts"], EXPERT))
    elif predicted["experts"] is not None or measured["experts"] is not None:
        rows.append(_row("expert-parallel buffers", int(predicted["experts"] is not None),
                         int(measured["experts"] is not None), None))
    rows = [row for p, m, prefix in parts for row in _part_rows(p, m, PART_ROWS, prefix)] + rows
    for key, label, per in STATE_ROWS:
        kind = key.split(":", 1)[1]
        rows.append(_row(label, *(sum(part[i]["state_elements"][kind] for part in parts) for i in (0, 1)), per))
    rows += [row for p, m, prefix in parts for row in _part_rows(p, m, TEMPORARY_ROWS, prefix)]
    return rows + [row for p, m, prefix in parts for row in _layout_rows(p, m, prefix)]


def _gib(value: int | None) -> str:
    return "" if value is None else f"{value / 2**30:.3f} GiB"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fsdp:
        return fsdp_main(args)
    start = time.perf_counter()
    try:
        ddp_model, optimizer, setup = build_rank(args)
        plan, specs, canzona = setup.plan, list(setup.specs), setup.config
    except (ValueError, RuntimeError) as error:
        print(f"dry_run.py: error: {error}", file=sys.stderr)
        return 2
    built = time.perf_counter() - start
    matrix = canzona.matrix
    state = StateLayout.of(args.optimizer, matrix)
    budget = canzona.early_compute_bytes if canzona.early_compute != "off" else 0
    measured = measure(ddp_model, optimizer, early_compute=budget)
    predicted = predict(args, plan, state, specs)
    rows = [catalog_row(args, specs), *compare(predicted, measured)]
    experts = measured["experts"]
    report = {
        "config": {**config_record(args, plan), "device": measured["device"]},
        "build_seconds": built,
        "rows": rows,
        "buckets": measured["bucket_elements"],
        "expert_buckets": None if experts is None else experts["bucket_elements"],
        "memory": memory_summary(rows),
        "agree": all(r["ok"] for r in rows),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if report["agree"] else 1


def describe_rank(c: dict, *, stages: bool = True) -> str:
    """The job and the rank of a report's ``config``, as the table's first line names them."""
    experts = "" if c["expert_dp"] is None else \
        f" (experts: EP {c['ep']} x expert DP {c['expert_dp']}, EP rank {c['ep_rank']}, expert DP rank {c['expert_dp_rank']})"
    cp, cp_rank = (f" x CP {c['cp']}", f", CP rank {c['cp_rank']}") if c.get("cp", 1) > 1 else ("", "")
    pp, stage = (f" x PP {c['pp']}", f", stage {c['pp_stage']}") if stages else ("", "")
    return (f"{c['model']} TP {c['tp']} x DP {c['dp']}{cp}{pp}, rank {c['rank']} (DP rank {c['dp_rank']}{cp_rank}, "
            f"TP rank {c['tp_rank']}{stage}){experts}, {c['optimizer']}, {c['params_dtype']} parameters")


def print_report(report: dict) -> None:
    print(f"[canzona] dry run: {describe_rank(report['config'])}, built on {report['config']['device']} in "
          f"{report['build_seconds']:.1f} s")
    width = max(44, *(len(row["quantity"]) + 2 for row in report["rows"]))
    print(f"{'':2}{'quantity':<{width}}{'predicted':>16}{'measured':>16}{'bytes':>14}")
    for row in report["rows"]:
        mark = "  " if row["ok"] else "! "
        print(f"{mark}{row['quantity']:<{width}}{row['predicted']:>16,}{row['measured']:>16,}{_gib(row['bytes']):>14}")
    for label, buckets in (("buckets", report["buckets"]), ("expert buckets", report["expert_buckets"])):
        if buckets:
            print(f"{label}: {len(buckets)}, largest {max(buckets):,} elements, smallest {min(buckets):,}")
    memory = report["memory"]
    print(f"memory: {_gib(memory['steady_bytes'])} between steps, peak {_gib(memory['peak_bytes'])} in the "
          f"optimizer step ({memory['peak_over_steady']:.3f}x; the update functions' own working set comes on top)")
    bad = [r["quantity"] for r in report["rows"] if not r["ok"]]
    print("every number agrees with the plan" if not bad else f"DISAGREE with the plan: {', '.join(bad)}")


if __name__ == "__main__":
    sys.exit(main())
