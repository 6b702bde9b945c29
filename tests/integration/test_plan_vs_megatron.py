"""The planner's geometry against the installed Megatron-Core 0.19.2."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron.canzona.planning import (
    CostModel,
    WireConfig,
    make_plan,
    plan_zero1,
    qwen3_specs,
    summarize_canzona,
    summarize_sync,
)
from megatron.canzona.planning.qwen3 import get_qwen3_config

from canzona_patches.integration.layerwise_baseline import plan_megatron_layerwise
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

COST = CostModel(kind="muon")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("model,tp", [("qwen3-tiny", 1), ("qwen3-8b", 2)])
@pytest.mark.parametrize("dp,bucket_size", [(1, None), (4, 100_000), (8, 40_000_000), (48, 7_000_000)])
def test_stock_layout_matches_megatron_distributed_optimizer(model, tp, dp, bucket_size):
    specs = [s for s in qwen3_specs(model, tp_size=tp) if s.family == "matrix"]
    mine = plan_zero1(specs, dp_size=dp, cost_model=COST, bucket_size=bucket_size or 10**15)
    forward = sorted(specs, key=lambda s: -s.order)
    params = [torch.nn.Parameter(torch.empty(s.local_shape, device="meta")) for s in forward]
    theirs = DistributedOptimizer._compute_per_buffer_param_layout(
        params, bucket_size, dp, DistributedDataParallelConfig(use_distributed_optimizer=True)
    )
    assert [(b.start, b.end) for b in mine.matrix.buckets] == list(theirs.bucket_indices)
    by_name = {p.name: (p.start, p.end, p.bucket) for p in mine.matrix.placements}
    assert {s.name: theirs.param_index_map[p] for s, p in zip(forward, params)} == by_name


def test_layerwise_baseline_is_read_back_faithfully():
    specs = qwen3_specs("qwen3-14b", tp_size=4)
    plan = plan_megatron_layerwise(specs, dp_size=32, cost_model=COST)
    for p in plan.matrix.placements:  # Megatron's layer-wise layout also keeps matrices whole
        b = plan.matrix.buckets[p.bucket]
        assert b.shard_bounds[p.host] <= p.start and p.end <= b.shard_bounds[p.host + 1]
    assert sum(plan.loads) == pytest.approx(sum(COST.cost(s) for s in specs if s.family == "matrix"))


CASES = [("qwen3-1.7b", 1, 8), ("qwen3-1.7b", 1, 32), ("qwen3-1.7b", 1, 64), ("qwen3-1.7b", 1, 128),
         ("qwen3-1.7b", 1, 256), ("qwen3-8b", 2, 16), ("qwen3-8b", 2, 64), ("qwen3-8b", 2, 128), ("qwen3-8b", 2, 256),
         ("qwen3-14b", 4, 8), ("qwen3-14b", 4, 32), ("qwen3-14b", 4, 64), ("qwen3-14b", 4, 128), ("qwen3-32b", 8, 8),
         ("qwen3-32b", 8, 16), ("qwen3-32b", 8, 32), ("qwen3-32b", 8, 64), ("qwen3-32b", 8, 128), ("qwen3-32b", 8, 256)]
MAKESPAN_TARGET = 1.10
PADDING_TARGET = 0.05
BUCKET_TARGET = 2.0
COMM_TARGET = 1.10


@pytest.mark.parametrize("model,tp,dp", CASES)
def test_canzona_meets_targets_against_megatron_layerwise(model, tp, dp):
    """docs/planner.md's case matrix (Muon cost, default α and bucket size, bf16 parameters and
    gradients): balance, padding, bucket sizes and bytes per rank."""
    specs = qwen3_specs(model, tp_size=tp)
    wire = WireConfig()
    plan = make_plan(specs, dp_size=dp, tp_size=tp)
    ours = summarize_canzona(plan, specs, COST, wire)
    peer = summarize_sync(plan_megatron_layerwise(specs, dp_size=dp, cost_model=COST), specs, COST, wire, tp)
    zero1 = summarize_sync(plan_zero1(specs, dp_size=dp, cost_model=COST), specs, COST, wire, tp)
    largest = max(s.numel for s in specs if s.family == "matrix")
    assert ours["makespan_over_lower_bound"] <= MAKESPAN_TARGET
    assert ours["makespan_over_lower_bound"] <= peer["makespan_over_lower_bound"] + 1e-9
    assert ours["padding_overhead"] <= PADDING_TARGET
    assert ours["padding_overhead"] <= peer["padding_overhead"] + 1e-9
    assert ours["largest_bucket_elements"] <= max(BUCKET_TARGET * plan.dp.bucket_size, largest)
    assert ours["comm_bytes_per_rank"] <= COMM_TARGET * zero1["comm_bytes_per_rank"]


CATALOG_PROBE = textwrap.dedent(
    """
    import json, os, sys, torch, warnings
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    c = json.loads(sys.argv[2])
    cfg = TransformerConfig(num_layers=c["num_layers"], hidden_size=c["hidden_size"], ffn_hidden_size=c["ffn_hidden_size"],
        num_attention_heads=c["num_attention_heads"], num_query_groups=c["num_query_groups"], kv_channels=c["kv_channels"],
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        qk_layernorm=True, use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
        vocab_size=c["vocab"], max_sequence_length=16, share_embeddings_and_output_weights=c["tied_embeddings"],
        position_embedding_type="rope")
    print(json.dumps([[n, list(p.shape), getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else None]
                      for n, p in model.named_parameters()]))
    torch.distributed.destroy_process_group()
    """
)


def test_tiny_catalog_matches_a_real_megatron_gpt_model():
    """Names, registration order, shapes and TP partition dims of Megatron's GPTModel."""
    import json

    cfg = get_qwen3_config("qwen3-tiny")
    specs = qwen3_specs(cfg)
    payload = {**cfg.__dict__, "vocab": specs[0].global_shape[0]}
    out = subprocess.run([sys.executable, "-c", CATALOG_PROBE, "29611", json.dumps(payload)], capture_output=True,
                         text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    real = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r[0] for r in real] == [s.name for s in specs]
    assert [tuple(r[1]) for r in real] == [s.global_shape for s in specs]
    assert [r[2] for r in real] == [s.tp_dim for s in specs]
