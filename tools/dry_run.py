#!/usr/bin/env python
"""Build one rank of a full-size Canzona job in one CPU process and check it against the plan.

    python tools/dry_run.py --model qwen3-32b --tp 8 --dp 32
    python tools/dry_run.py --model qwen3-8b --tp 2 --dp 128 --rank 17 --optimizer soap
    python tools/dry_run.py --model qwen3-32b --tp 8 --dp 16 --pp 2 --rank 255 --json

The named rank's real Megatron-Core ``GPTModel`` (its pipeline stage; local layer spec),
Megatron's ``DistributedDataParallel`` with the Canzona layout and the Canzona optimizer are
built on the meta device (shapes and dtypes, no storage) under torch's ``fake``
process-group backend standing in for the whole world. It prints what that rank holds --
parameter and gradient buffers, buckets, fp32 main parameters, optimizer state by kind,
the largest temporary buffer of the step -- beside the planner's prediction
(``megatron.canzona.planning.memory``), and exits 1 where they disagree.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.canzona.planning import DEFAULT_ALPHA, QWEN3_MODELS, get_qwen3_config  # noqa: E402
from megatron.canzona.planning.memory import FIELD_KINDS, STATE_BYTES, STATE_KINDS, StateLayout, rank_memory  # noqa: E402
from megatron.canzona.planning.qwen3 import padded_vocab_size  # noqa: E402

DTYPE_BYTES = {"bf16": 2, "fp32": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b", help=f"one of: {', '.join(QWEN3_MODELS)}")
    p.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--dp", "--data-parallel-size", dest="dp", type=int, default=8, help="data-parallel size")
    p.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--rank", type=int, default=0, help="global rank to build (Megatron's default rank order)")
    p.add_argument("--optimizer", choices=("muon", "shampoo", "soap"), default="muon", help="matrix optimizer")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="planner balance knob")
    p.add_argument("--bucket-size", type=int, default=None, help="elements per DDP bucket (default: Megatron's)")
    p.add_argument("--params-dtype", choices=tuple(DTYPE_BYTES), default="bf16", help="parameter dtype")
    p.add_argument("--grad-reduce-in-fp32", action="store_true", help="fp32 gradient buffers")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    if args.model.lower() not in QWEN3_MODELS:
        p.error(f"unknown model {args.model!r}; choose one of: {', '.join(QWEN3_MODELS)}")
    world = args.tp * args.dp * args.pp
    if min(args.tp, args.dp, args.pp) < 1:
        p.error("--tp, --dp and --pp must be 1 or more")
    if not 0 <= args.rank < world:
        p.error(f"--rank {args.rank} is outside the world of TP {args.tp} x DP {args.dp} x PP {args.pp} = {world} ranks")
    return args


def coordinates(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(DP rank, TP rank, PP stage) of a global rank in Megatron's default order tp-cp-ep-dp-pp."""
    return (rank // tp) % dp, rank % tp, rank // (tp * dp)


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


def build_rank(args: argparse.Namespace):
    """Rank ``args.rank``'s model stage, DDP wrapper, plan and Canzona optimizer, on meta."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from canzona_patches.version import quiet_megatron_notices

    quiet_megatron_notices()
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.tp * args.dp * args.pp)
    from canzona_patches.cpu import enable_cpu_mode

    enable_cpu_mode(meta=True)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from canzona_patches.layout import build_canzona_plan, full_param_layouts
    from canzona_patches.optimizer import build_canzona_optimizer

    real_new_group = dist.new_group

    def fake_group(*group_args, backend=None, **kwargs):  # every group fakes, Megatron's gloo ones too
        return real_new_group(*group_args, **kwargs)

    dist.new_group = fake_group
    try:
        parallel_state.initialize_model_parallel(args.tp, args.pp)
    finally:
        dist.new_group = real_new_group
    model_parallel_cuda_manual_seed(1234)
    cfg = get_qwen3_config(args.model)
    dtype = torch.bfloat16 if args.params_dtype == "bf16" else torch.float32
    config = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", layernorm_epsilon=1e-6, qk_layernorm=True, add_bias_linear=False,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=False,
        perform_initialization=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    with torch.device("meta"):
        model = GPTModel(
            config, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
            vocab_size=padded_vocab_size(cfg.vocab_size, args.tp), max_sequence_length=cfg.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=cfg.tied_embeddings, position_embedding_type="rope",
            rotary_base=1_000_000,
        ).to(dtype)  # what Megatron's Float16Module does to a bf16 model
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
        grad_reduce_in_fp32=args.grad_reduce_in_fp32, bucket_size=args.bucket_size,
    )
    canzona = canzona_config(args)
    plan, specs = build_canzona_plan([model], ddp_config, canzona, dp_size=args.dp, tp_size=args.tp)
    (layout,) = full_param_layouts(plan, [model], ddp_config)
    ddp_model = DistributedDataParallel(config, ddp_config, model, full_param_layout=layout)
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=4e-4, weight_decay=0.1, clip_grad=1.0, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=True,
    )
    stage = coordinates(args.rank, args.tp, args.dp)[2]
    optimizer = build_canzona_optimizer(optimizer_config, [ddp_model], canzona, plan, host_ranks=host_ranks(args, stage))
    optimizer.optimizer.init_state()
    return ddp_model, optimizer, plan, specs, canzona


def canzona_config(args: argparse.Namespace):
    """The Canzona configuration ``pretrain_gpt.py --canzona`` uses by default for this optimizer."""
    from megatron.canzona.optim import MuonConfig, ShampooConfig, SOAPConfig
    from megatron.canzona.runtime.config import CanzonaConfig

    matrix = {"muon": MuonConfig(), "shampoo": ShampooConfig(), "soap": SOAPConfig()}[args.optimizer]
    return CanzonaConfig(optimizer=args.optimizer, matrix=matrix, alpha=args.alpha)


def measure(ddp_model, optimizer) -> dict:
    """What the built rank actually holds, in elements."""
    from canzona_patches.layout import BUFFER_ROUTING_ATTR

    buffers = list(ddp_model.buffers) + list(ddp_model.expert_parallel_buffers)
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
        "device": str(buffers[0].param_data.device),
    }


def predict(args: argparse.Namespace, plan, specs_state: StateLayout, specs) -> dict:
    dp_rank, tp_rank, _ = coordinates(args.rank, args.tp, args.dp)
    mem = rank_memory(plan, specs, dp_rank=dp_rank, tp_rank=tp_rank, state=specs_state)
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
    }


ROWS = (  # (key, label, bytes per element: a number, or the key of one)
    ("param_buffer_elements", "parameter buffers", "param_dtype_bytes"),
    ("grad_buffer_elements", "gradient buffers", "grad_dtype_bytes"),
    ("num_matrix_buckets", "matrix buffer buckets", None),
    ("shard_elements", "parameter elements in this rank's shards", None),
    ("main_param_elements", "fp32 main parameters", STATE_BYTES),
    *((f"state:{kind}", f"optimizer state: {kind.replace('_', ' ')}", STATE_BYTES) for kind in STATE_KINDS),
    ("largest_temporary_elements", "largest temporary buffer of the step", STATE_BYTES),
    ("step_temporary_elements", "host-group buffers alive at once", STATE_BYTES),
    ("compute_batch_elements", "largest host-compute batch (stacked grads)", STATE_BYTES),
)
STEADY = ("parameter buffers", "gradient buffers", "fp32 main parameters",
          *(f"optimizer state: {kind.replace('_', ' ')}" for kind in STATE_KINDS))
"""What a rank holds between steps; the step adds the host-group buffers and a stack copy."""
TRANSIENT = ("host-group buffers alive at once", "largest host-compute batch (stacked grads)")


def memory_summary(rows: list[dict]) -> dict:
    """Steady-state and peak bytes of the step, from the measured rows."""
    by_name = {row["quantity"]: row["bytes"] or 0 for row in rows}
    steady = sum(by_name[name] for name in STEADY)
    peak = steady + sum(by_name[name] for name in TRANSIENT)
    return {"steady_bytes": steady, "peak_bytes": peak, "peak_over_steady": peak / steady if steady else 0.0}


def _value(record: dict, key: str):
    if key.startswith("state:"):
        return record["state_elements"][key.split(":", 1)[1]]
    return record[key]


def compare(predicted: dict, measured: dict) -> list[dict]:
    rows = []
    for key, label, per in ROWS:
        p, m = _value(predicted, key), _value(measured, key)
        size = measured[per] if isinstance(per, str) else per
        rows.append({"quantity": label, "predicted": p, "measured": m, "bytes": None if size is None else m * size,
                     "ok": p == m})
    rows.append({"quantity": "bucket sizes, in order", "predicted": len(predicted["bucket_elements"]),
                 "measured": len(measured["bucket_elements"]), "bytes": None,
                 "ok": predicted["bucket_elements"] == measured["bucket_elements"]})
    for key in ("param_dtype_bytes", "grad_dtype_bytes"):
        rows.append({"quantity": key.replace("_", " "), "predicted": predicted[key], "measured": measured[key],
                     "bytes": None, "ok": predicted[key] == measured[key]})
    return rows


def _gib(value: int | None) -> str:
    return "" if value is None else f"{value / 2**30:.3f} GiB"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        ddp_model, optimizer, plan, specs, canzona = build_rank(args)
    except (ValueError, RuntimeError) as error:
        print(f"dry_run.py: error: {error}", file=sys.stderr)
        return 2
    built = time.perf_counter() - start
    matrix = canzona.matrix
    state = StateLayout(optimizer=args.optimizer, max_precond_dim=getattr(matrix, "max_precond_dim", 10000),
                        grafting=getattr(matrix, "grafting", "adam") == "adam")
    measured = measure(ddp_model, optimizer)
    predicted = predict(args, plan, state, specs)
    rows = compare(predicted, measured)
    dp_rank, tp_rank, stage = coordinates(args.rank, args.tp, args.dp)
    report = {
        "config": {"model": args.model, "tp": args.tp, "dp": args.dp, "pp": args.pp, "rank": args.rank,
                   "dp_rank": dp_rank, "tp_rank": tp_rank, "pp_stage": stage, "optimizer": args.optimizer,
                   "params_dtype": args.params_dtype, "grad_reduce_in_fp32": args.grad_reduce_in_fp32,
                   "alpha": args.alpha, "bucket_size": plan.dp.bucket_size, "device": measured["device"]},
        "build_seconds": built,
        "rows": rows,
        "buckets": measured["bucket_elements"],
        "memory": memory_summary(rows),
        "agree": all(r["ok"] for r in rows),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if report["agree"] else 1


def print_report(report: dict) -> None:
    c = report["config"]
    print(f"[canzona] dry run: {c['model']} TP {c['tp']} x DP {c['dp']} x PP {c['pp']}, rank {c['rank']} "
          f"(DP rank {c['dp_rank']}, TP rank {c['tp_rank']}, stage {c['pp_stage']}), {c['optimizer']}, "
          f"{c['params_dtype']} parameters, built on {c['device']} in {report['build_seconds']:.1f} s")
    print(f"{'':2}{'quantity':<44}{'predicted':>16}{'measured':>16}{'bytes':>14}")
    for row in report["rows"]:
        mark = "  " if row["ok"] else "! "
        print(f"{mark}{row['quantity']:<44}{row['predicted']:>16,}{row['measured']:>16,}{_gib(row['bytes']):>14}")
    buckets = report["buckets"]
    print(f"buckets: {len(buckets)}, largest {max(buckets):,} elements, smallest {min(buckets):,}")
    memory = report["memory"]
    print(f"memory: {_gib(memory['steady_bytes'])} between steps, peak {_gib(memory['peak_bytes'])} in the "
          f"optimizer step ({memory['peak_over_steady']:.3f}x; the update functions' own working set comes on top)")
    bad = [r["quantity"] for r in report["rows"] if not r["ok"]]
    print("every number agrees with the plan" if not bad else f"DISAGREE with the plan: {', '.join(bad)}")


if __name__ == "__main__":
    sys.exit(main())
