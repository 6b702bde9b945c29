"""``--canzona-split-qkv-per-head``: every attention head's query, key and value block is its own
matrix, in the planner's cost (``qkv_blocks``), the Qwen3 catalog, a live model's specs and the
optimizer's split (``QKVLayout(split_heads=True)``), in the same order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.canzona.optim import QKVLayout
from megatron.canzona.planning import qwen3_specs
from megatron.canzona.planning.cost import CostModel
from megatron.canzona.planning.qwen3 import get_qwen3_config
from megatron.canzona.planning.specs import qkv_blocks
from megatron.canzona.runtime.config import CanzonaConfig

from canzona_patches.integration.layout import specs_from_model
from canzona_patches.integration.setup import fused_layout, qkv_line

pytestmark = pytest.mark.quick


def test_the_planner_counts_one_matrix_per_head_in_the_split_order() -> None:
    heads, groups, dim, cols = 4, 2, 3, 5
    layout = QKVLayout(num_query_groups=groups, heads_per_group=heads // groups, head_dim=dim, split_heads=True)
    pieces = layout.split(torch.randn(layout.rows, cols))
    assert [tuple(p.shape) for p in pieces] == list(qkv_blocks(heads, groups, dim, cols, per_head=True))
    whole = QKVLayout(num_query_groups=groups, heads_per_group=heads // groups, head_dim=dim)
    assert [tuple(p.shape) for p in whole.split(torch.randn(whole.rows, cols))] == list(qkv_blocks(heads, groups, dim, cols))


@pytest.mark.parametrize("tp", [1, 4])
def test_qwen3_per_head_matrices_cost_less_than_q_k_and_v(tp: int) -> None:
    cfg = get_qwen3_config("qwen3-8b")
    split = {s.name: s for s in qwen3_specs(cfg, tp_size=tp, split_qkv=True)}
    heads = {s.name: s for s in qwen3_specs(cfg, tp_size=tp, split_qkv=True, split_qkv_per_head=True)}
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert heads[name].matrices == ((cfg.kv_channels, cfg.hidden_size),) * (cfg.num_attention_heads + 2 * cfg.num_query_groups)
    assert heads[name].global_shape == split[name].global_shape and heads[name].numel == split[name].numel
    cost = CostModel(kind="muon")
    assert cost.cost(heads[name]) < cost.cost(split[name]) / 10
    others = [n for n in split if n != name and "linear_qkv" not in n]
    assert all(split[n] == heads[n] for n in others)


def test_a_live_models_qkv_splits_per_head_as_planned() -> None:
    heads, groups, dim, hidden = 4, 2, 16, 64
    weight = torch.nn.Parameter(torch.zeros((heads + 2 * groups) * dim // 2, hidden))
    weight.tensor_model_parallel, weight.partition_dim = True, 0
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    (spec,) = specs_from_model([(name, weight)], tp_size=2, num_attention_heads=heads, num_query_groups=groups,
                               kv_channels=dim, split_qkv=True, split_qkv_per_head=True)
    assert spec.matrices == ((dim, hidden),) * (heads + 2 * groups) and spec.global_shape == ((heads + 2 * groups) * dim, hidden)
    module = SimpleNamespace(config=SimpleNamespace(num_query_groups=groups, num_attention_heads=heads, kv_channels=dim,
                                                    gated_linear_unit=False))
    layout = fused_layout(name, module, CanzonaConfig(split_qkv_per_head=True))
    assert isinstance(layout, QKVLayout) and layout.split_heads
    assert not fused_layout(name, module, CanzonaConfig()).split_heads
    assert qkv_line(CanzonaConfig(), module.config) is None
    assert qkv_line(CanzonaConfig(split_qkv_per_head=True), module.config) == (
        "[canzona] QKV: each head its own matrix, 4 query + 2 key + 2 value heads of 16 rows per linear_qkv "
        "(Megatron's --muon-split-qkv splits only Q, K and V)")
