"""Splitting fused matrices and routing parameters between the matrix optimizer and AdamW."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.canzona.optim import ExpertStackLayout, GateUpLayout, ParamRouting, QKVLayout
from megatron.canzona.optim import build_param_groups, classify_parameter, merge_pieces, split_pieces

pytestmark = pytest.mark.quick


def megatron_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Fuse Q (groups*hpg*d, h), K and V (groups*d, h) the way Megatron lays out linear_qkv:
    for each KV group, its query heads, then its key head, then its value head."""
    blocks = []
    for q_g, k_g, v_g in zip(q.chunk(groups), k.chunk(groups), v.chunk(groups)):
        blocks += [q_g, k_g, v_g]
    return torch.cat(blocks)


@settings(max_examples=25, deadline=None)
@given(groups=st.integers(1, 4), per_group=st.integers(1, 4), head_dim=st.integers(1, 5),
       cols=st.integers(1, 6), lead=st.sampled_from([(), (2,), (2, 3)]))
def test_qkv_split_recovers_q_k_v_and_merges_back(groups, per_group, head_dim, cols, lead):
    layout = QKVLayout(num_query_groups=groups, heads_per_group=per_group, head_dim=head_dim)
    q = torch.randn(*lead, groups * per_group * head_dim, cols)
    k = torch.randn(*lead, groups * head_dim, cols)
    v = torch.randn(*lead, groups * head_dim, cols)
    if lead:
        fused = torch.stack([megatron_qkv(a, b, c, groups) for a, b, c in
                             zip(q.flatten(0, -3), k.flatten(0, -3), v.flatten(0, -3))]).reshape(*lead, -1, cols)
    else:
        fused = megatron_qkv(q, k, v, groups)
    pieces = layout.split(fused)
    assert [torch.equal(a, b) for a, b in zip(pieces, (q, k, v))] == [True, True, True]
    assert torch.equal(layout.merge(pieces), fused)


def test_qkv_split_per_head():
    layout = QKVLayout(num_query_groups=2, heads_per_group=2, head_dim=3, split_heads=True)
    q, k, v = torch.randn(12, 5), torch.randn(6, 5), torch.randn(6, 5)
    fused = megatron_qkv(q, k, v, 2)
    pieces = layout.split(fused)
    assert len(pieces) == 4 + 2 + 2
    assert all(p.shape == (3, 5) for p in pieces)
    assert torch.equal(torch.cat(pieces[:4]), q) and torch.equal(torch.cat(pieces[4:6]), k)
    assert torch.equal(torch.cat(pieces[6:]), v)
    assert torch.equal(layout.merge(pieces), fused)


@pytest.mark.parametrize("partitions", [1, 2, 4])
def test_gate_up_split_per_tensor_parallel_partition(partitions):
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    # Megatron's fc1 shard i is [gate_i; up_i]; a gathered matrix concatenates the shards.
    fused = torch.cat([torch.cat([g, u]) for g, u in zip(gate.chunk(partitions), up.chunk(partitions))])
    layout = GateUpLayout(num_partitions=partitions)
    got_gate, got_up = layout.split(fused)
    assert torch.equal(got_gate, gate) and torch.equal(got_up, up)
    assert torch.equal(layout.merge([got_gate, got_up]), fused)


def test_layout_errors_say_what_to_check():
    with pytest.raises(ValueError, match="head counts"):
        QKVLayout(num_query_groups=2, heads_per_group=2, head_dim=3).split(torch.zeros(10, 4))
    with pytest.raises(ValueError, match="multiple of 2"):
        GateUpLayout(num_partitions=2).split(torch.zeros(6, 4))
    with pytest.raises(ValueError, match=">= 1"):
        QKVLayout(num_query_groups=0, heads_per_group=1, head_dim=1)


def test_unfused_pieces_are_the_tensor_itself():
    x = torch.randn(4, 5)
    assert split_pieces(x, None)[0] is x and merge_pieces([x], None) is x


class TinyMegatronLike(torch.nn.Module):
    """Megatron-style names: embedding, QKV, proj, fc1 (gate/up), fc2, norms, output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 8)
        self.linear_qkv = torch.nn.Linear(8, 24, bias=True)
        self.linear_proj = torch.nn.Linear(8, 8, bias=False)
        self.linear_fc1 = torch.nn.Linear(8, 32, bias=False)
        self.linear_fc2 = torch.nn.Linear(16, 8, bias=False)
        self.final_layernorm = torch.nn.LayerNorm(8)
        self.output_layer = torch.nn.Linear(8, 16, bias=False)
        self.conv = torch.nn.Conv1d(2, 2, 3)


def test_default_routing():
    model = TinyMegatronLike()
    kinds = {name: classify_parameter(name, p, ParamRouting()) for name, p in model.named_parameters()}
    assert kinds == {
        "embedding.weight": "adamw", "linear_qkv.weight": "matrix", "linear_qkv.bias": "adamw",
        "linear_proj.weight": "matrix", "linear_fc1.weight": "matrix", "linear_fc2.weight": "matrix",
        "final_layernorm.weight": "adamw", "final_layernorm.bias": "adamw",
        "output_layer.weight": "adamw", "conv.weight": "adamw", "conv.bias": "adamw",
    }


def test_routing_rules_are_configurable_and_respect_megatron_attributes():
    model = TinyMegatronLike()
    routing = ParamRouting(matrix_patterns=(r"output_layer",), adamw_patterns=(r"linear_proj",))
    assert classify_parameter("output_layer.weight", model.output_layer.weight, routing) == "matrix"
    assert classify_parameter("linear_proj.weight", model.linear_proj.weight, routing) == "adamw"
    tagged = torch.nn.Parameter(torch.zeros(4, 4))
    tagged.is_embedding_or_output_parameter = True  # what Megatron sets
    assert classify_parameter("decoder.weird_name", tagged, ParamRouting()) == "adamw"
    ignore = ParamRouting(respect_megatron_attributes=False)
    assert classify_parameter("decoder.weird_name", tagged, ignore) == "matrix"


def test_build_param_groups():
    model = TinyMegatronLike()
    qkv = QKVLayout(num_query_groups=1, heads_per_group=1, head_dim=8)
    groups = build_param_groups(model.named_parameters(), qkv_layout=qkv, gate_up_layout=GateUpLayout())
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"matrix", "qkv", "gate_up", "adamw", "adamw_no_decay"}
    assert by_name["qkv"]["params"] == [model.linear_qkv.weight]
    assert by_name["qkv"]["fused_layout"] is qkv and by_name["qkv"]["matrix"] is True
    assert by_name["gate_up"]["params"] == [model.linear_fc1.weight]
    assert by_name["matrix"]["params"] == [model.linear_proj.weight, model.linear_fc2.weight]
    assert by_name["adamw"]["params"] == [model.embedding.weight, model.output_layer.weight, model.conv.weight]
    assert by_name["adamw_no_decay"]["weight_decay"] == 0.0
    assert all(p.ndim < 2 for p in by_name["adamw_no_decay"]["params"])
    # Without layouts, fused weights stay single matrices.
    plain = {g["name"]: g for g in build_param_groups(model.named_parameters())}
    assert model.linear_qkv.weight in plain["matrix"]["params"] and "qkv" not in plain


@pytest.mark.parametrize(("stacked", "expert"), [((8, 3 * 12), (8, 12)), ((3 * 5, 8), (5, 8))])
def test_expert_stack_layout_takes_the_views_grouped_mlp_takes(stacked, expert):
    """Legacy GroupedMLP: weight1 (h, E*fc1) is E contiguous (h, fc1) matrices and weight2
    (E*fc2, h) E contiguous (fc2, h) ones -- its forward's ``view(E, ...)``."""
    layout = ExpertStackLayout(num_experts=3, expert_shape=expert, shape=stacked)
    x = torch.randn(stacked)
    pieces = layout.split(x)
    assert [tuple(p.shape) for p in pieces] == [expert] * 3
    for e, piece in enumerate(pieces):
        assert torch.equal(piece, x.view(3, *expert)[e])
    assert torch.equal(layout.merge(pieces), x)
    with pytest.raises(ValueError, match="do not fill"):
        ExpertStackLayout(num_experts=4, expert_shape=expert, shape=stacked)
