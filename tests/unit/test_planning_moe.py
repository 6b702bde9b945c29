"""Mixture of experts in the pure planner: catalog, pipeline stages, expert buffers, joint balance."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.canzona.planning import (
    CanzonaPlan,
    CostModel,
    ParamSpec,
    WireConfig,
    combined_lower_bound,
    dense_to_expert,
    expert_coordinates,
    expert_dp_size,
    get_qwen3_config,
    make_plan,
    plan_canzona,
    qwen3_specs,
    split_experts,
    stage_layer_counts,
    summarize_canzona,
)
from megatron.canzona.planning.balance import MAX_PADDING

COST = CostModel()
WIRE = WireConfig()

# HF config.json of each model (num_hidden_layers, hidden_size, num_attention_heads,
# num_key_value_heads, head_dim, num_experts, num_experts_per_tok, moe_intermediate_size,
# intermediate_size, vocab_size, tie_word_embeddings).
HF_CONFIGS = {
    "qwen3-30b-a3b": (48, 2048, 32, 4, 128, 128, 8, 768, 6144, 151936, False),
    "qwen3-235b-a22b": (94, 4096, 64, 4, 128, 128, 8, 1536, 12288, 151936, False),
    "qwen3-moe-tiny": (2, 64, 4, 2, 16, 4, 2, 32, 176, 1024, False),
}
# Published total and activated parameter counts (billions, as rounded on the model cards).
PUBLISHED = {"qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235.0, 22.0)}


@pytest.mark.parametrize("model", sorted(HF_CONFIGS))
@pytest.mark.quick
def test_catalog_matches_the_hf_config(model):
    cfg = get_qwen3_config(model)
    got = (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels,
           cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.ffn_hidden_size, cfg.vocab_size,
           cfg.tied_embeddings)
    assert got == HF_CONFIGS[model] and cfg.is_moe


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_total_and_activated_parameters_match_the_model_card(model):
    cfg = get_qwen3_config(model)
    specs = qwen3_specs(model)
    total = sum(s.global_numel for s in specs)
    per_expert = 3 * cfg.hidden_size * cfg.moe_ffn_hidden_size  # gate, up, down
    # A token uses top-k of the experts; everything else (attention, router, norms, embeddings) always.
    activated = total - (cfg.num_experts - cfg.moe_router_topk) * per_expert * cfg.num_layers
    published_total, published_activated = PUBLISHED[model]
    assert total / 1e9 == pytest.approx(published_total, rel=0.01)
    assert activated / 1e9 == pytest.approx(published_activated, rel=0.03)


def names(specs: list[ParamSpec]) -> list[str]:
    return [s.name for s in specs]


def test_sequential_layout_is_megatrons_registration_order():
    """As a live Megatron-Core 0.19.2 GPTModel (local spec, MoE, SequentialMLP) names them."""
    specs = qwen3_specs("qwen3-moe-tiny", ep_size=2)
    layer = [s for s in specs if s.name.startswith("decoder.layers.0.")]
    p = "decoder.layers.0."
    e = p + "mlp.experts.local_experts."
    assert names(layer) == [
        p + "input_layernorm.weight", p + "self_attention.linear_proj.weight", p + "self_attention.linear_qkv.weight",
        p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight",
        p + "pre_mlp_layernorm.weight", p + "mlp.router.weight",
        e + "0.linear_fc1.weight", e + "0.linear_fc2.weight", e + "1.linear_fc1.weight", e + "1.linear_fc2.weight",
    ]
    by = {s.name: s for s in specs}
    assert by[e + "1.linear_fc1.weight"].global_shape == (64, 64) and by[e + "1.linear_fc1.weight"].fused == "gate_up"
    assert by[e + "1.linear_fc2.weight"].global_shape == (64, 32) and by[e + "1.linear_fc2.weight"].tp_dim == 1
    assert by[p + "mlp.router.weight"].global_shape == (4, 64)
    assert names(specs)[0] == "embedding.word_embeddings.weight"
    assert names(specs)[-2:] == ["decoder.final_layernorm.weight", "output_layer.weight"]
    assert [s.order for s in specs] == list(range(len(specs) - 1, -1, -1))


@pytest.mark.parametrize("layout", ["sequential", "grouped", "stacked"])
@pytest.mark.parametrize("ep,etp", [(1, 1), (2, 1), (4, 2)])
@pytest.mark.quick
def test_every_layout_holds_the_local_experts_once(layout, ep, etp):
    cfg = get_qwen3_config("qwen3-moe-tiny")
    specs = qwen3_specs(cfg, ep_size=ep, expert_tp_size=etp, tp_size=2, expert_layout=layout, split_gate_up=True)
    local = cfg.num_experts // ep
    h, f = cfg.hidden_size, cfg.moe_ffn_hidden_size
    experts = [s for s in specs if ".mlp.experts." in s.name]
    assert len(set(names(specs))) == len(specs)
    matrices = [m for s in experts for m in s.matrices]
    per_layer = sorted(matrices[: len(matrices) // cfg.num_layers])
    if layout == "stacked":  # one parameter per kind; each expert its own matrix
        assert sorted(m for m in per_layer) == sorted([(h, 2 * f)] * local + [(f, h)] * local)
        w1, w2 = experts[:2]
        assert names([w1, w2]) == ["decoder.layers.0.mlp.experts.weight1", "decoder.layers.0.mlp.experts.weight2"]
        assert w1.global_shape == (h, local * 2 * f) and w2.global_shape == (local * f, h)
        assert w1.fused == w2.fused == "experts" and w1.local_shape == (h, local * 2 * f // etp)
    else:
        assert per_layer == sorted([(f, h)] * (2 * local) + [(h, f)] * local)  # gate and up split
        assert all(s.tp_size == etp for s in experts)
        assert [s.local_shape for s in experts[:1]] == [(2 * f // etp, h)]
    if layout == "grouped":
        assert names(experts[: 2 * local]) == (
            [f"decoder.layers.0.mlp.experts.linear_fc1.weight{j}" for j in range(local)]
            + [f"decoder.layers.0.mlp.experts.linear_fc2.weight{j}" for j in range(local)])


@pytest.mark.parametrize("tp,ep,etp,expected", [
    (1, 1, 1, False), (2, 1, 2, False),  # experts are ordinary dense parameters
    (1, 2, 1, True), (2, 2, 2, True), (2, 4, 1, True),  # expert parallelism
    (2, 1, 1, True),  # Megatron-Core 0.19.2 also uses the expert groups when expert TP differs from TP
])
def test_experts_are_expert_parallel_as_megatron_marks_them(tp, ep, etp, expected):
    specs = qwen3_specs("qwen3-moe-tiny", tp_size=tp, ep_size=ep, expert_tp_size=etp)
    experts = [s for s in specs if ".mlp.experts." in s.name]
    assert experts and all(s.is_expert == expected for s in experts)
    assert not any(s.is_expert for s in specs if ".mlp.experts." not in s.name)


@pytest.mark.quick
def test_routers_and_norms_go_to_adamw_and_experts_to_the_matrix_optimizer():
    for s in qwen3_specs("qwen3-moe-tiny", ep_size=2):
        if s.name.endswith(("router.weight", "layernorm.weight")) or "embedding" in s.name or "output" in s.name:
            assert s.family == "elementwise" and not s.is_expert
        else:
            assert s.family == "matrix"


def test_bad_expert_sizes_say_what_to_do():
    with pytest.raises(ValueError, match="divides 128"):
        qwen3_specs("qwen3-30b-a3b", ep_size=3)
    with pytest.raises(ValueError, match="expert TP size that divides"):
        qwen3_specs("qwen3-30b-a3b", expert_tp_size=5)
    with pytest.raises(ValueError, match="dense"):
        qwen3_specs("qwen3-8b", ep_size=2)
    with pytest.raises(ValueError, match="expert_layout"):
        qwen3_specs("qwen3-moe-tiny", expert_layout="fused")
    with pytest.raises(ValueError, match="fused must be"):
        ParamSpec(name="w", global_shape=(4, 4), fused="kv")


# ------------------------------------------------------------------------------ pipeline


@pytest.mark.quick
def test_pipeline_split_follows_megatron():
    assert stage_layer_counts(48, 4) == (12,) * 4
    assert stage_layer_counts(94, 8, first_stage_layers=11, last_stage_layers=11) == (11,) + (12,) * 6 + (11,)
    assert stage_layer_counts(10, 4, first_stage_layers=1) == (1, 3, 3, 3)
    suggestion = "--decoder-first-pipeline-num-layers 11 --decoder-last-pipeline-num-layers 11"
    with pytest.raises(ValueError, match=suggestion):
        stage_layer_counts(94, 8)
    with pytest.raises(ValueError, match="not an even split"):
        stage_layer_counts(94, 8, first_stage_layers=9)
    with pytest.raises(ValueError, match="need pipeline parallelism"):
        stage_layer_counts(94, 1, first_stage_layers=10)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 120), st.integers(1, 16))
def test_a_suggested_split_is_valid(num_layers, pp):
    if num_layers < pp:
        with pytest.raises(ValueError):
            stage_layer_counts(num_layers, pp)
        return
    try:
        counts = stage_layer_counts(num_layers, pp)
    except ValueError as exc:
        flags = str(exc).split("(e.g. ")[1].rstrip(")").split()
        first, last = int(flags[1]), int(flags[3])
        counts = stage_layer_counts(num_layers, pp, first_stage_layers=first, last_stage_layers=last)
    assert sum(counts) == num_layers and len(counts) == pp and min(counts) >= 1


def test_each_stage_holds_its_layers_with_local_names():
    kwargs = dict(pp_size=8, first_stage_layers=11, last_stage_layers=11, ep_size=8, tp_size=4)
    stages = [qwen3_specs("qwen3-235b-a22b", pp_rank=k, **kwargs) for k in range(8)]
    for k, specs in enumerate(stages):
        layers = {int(s.name.split(".")[2]) for s in specs if s.name.startswith("decoder.layers.")}
        assert layers == set(range(11 if k in (0, 7) else 12))
        assert ("embedding.word_embeddings.weight" in names(specs)) == (k == 0)
        assert ("output_layer.weight" in names(specs)) == (k == 7)
        assert ("decoder.final_layernorm.weight" in names(specs)) == (k == 7)
    whole = qwen3_specs("qwen3-235b-a22b", ep_size=8, tp_size=4)
    assert sum(s.numel for specs in stages for s in specs) == sum(s.numel for s in whole)
    with pytest.raises(ValueError, match="pp_rank"):
        qwen3_specs("qwen3-moe-tiny", pp_size=2, pp_rank=2)


def test_a_tied_model_keeps_its_output_layer_on_the_last_stage():
    first, last = (qwen3_specs("qwen3-0.6b", pp_size=2, pp_rank=k) for k in (0, 1))
    assert "output_layer.weight" not in names(first) and "output_layer.weight" in names(last)


# ------------------------------------------------------------------------------ rank grid


@pytest.mark.parametrize("dp,tp,ep,etp", [(4, 2, 2, 1), (8, 1, 8, 1), (2, 4, 8, 1), (4, 4, 2, 2)])
def test_every_expert_rank_is_run_by_ep_size_gpus(dp, tp, ep, etp):
    coords = dense_to_expert(dp_size=dp, tp_size=tp, ep_size=ep, expert_tp_size=etp)
    edp = expert_dp_size(dp_size=dp, tp_size=tp, ep_size=ep, expert_tp_size=etp)
    assert edp == dp * tp // (ep * etp)
    assert sorted(set(coords)) == [(e, t) for e in range(edp) for t in range(etp)]
    assert all(coords.count(c) == ep for c in set(coords))
    for r, (e, t) in enumerate(coords):  # Megatron's order: expert TP fastest, then EP, then expert DP
        assert expert_coordinates(r // tp, r % tp, tp_size=tp, ep_size=ep, expert_tp_size=etp) == (
            r // (etp * ep), (r // etp) % ep, r % etp) and (e, t) == (r // (etp * ep), r % etp)


# ------------------------------------------------------------------------------ expert plans


def tiny_plan(layout: str = "sequential") -> tuple[CanzonaPlan, list[ParamSpec]]:
    sizes = dict(tp_size=2, ep_size=2, expert_tp_size=1)
    specs = qwen3_specs("qwen3-moe-tiny", split_qkv=True, expert_layout=layout, **sizes)
    return make_plan(specs, dp_size=4, **sizes), specs


@pytest.mark.parametrize("layout", ["sequential", "grouped", "stacked"])
@pytest.mark.quick
def test_every_expert_matrix_has_one_host_in_the_expert_plan(layout):
    plan, specs = tiny_plan(layout)
    dense, experts = split_experts(specs)
    assert plan.experts is not None and plan.ep_size == 2
    assert plan.experts.dp_size == 4 * 2 // 2 and plan.experts.tp_size == 1
    expert_names = sorted(s.name for s in experts if s.family == "matrix")
    assert sorted(h.name for h in plan.experts.hosts) == expert_names
    assert sorted(p.name for p in plan.experts.dp.matrix.placements) == expert_names
    assert sorted(h.name for h in plan.hosts) == sorted(s.name for s in dense if s.family == "matrix")
    assert not {p.name for p in plan.dp.matrix.placements} & set(expert_names)
    assert all(0 <= h.dp_rank < plan.experts.dp_size for h in plan.experts.hosts)


def test_without_expert_parallelism_experts_are_dense():
    specs = qwen3_specs("qwen3-moe-tiny")
    plan = make_plan(specs, dp_size=2)
    assert plan.experts is None
    assert len(plan.hosts) == sum(s.family == "matrix" for s in specs)


def test_expert_plan_size_must_divide():
    specs = qwen3_specs("qwen3-moe-tiny", ep_size=4)
    with pytest.raises(ValueError, match="choose --ep and --etp"):
        make_plan(specs, dp_size=2, ep_size=4)
    specs = qwen3_specs("qwen3-moe-tiny", ep_size=2, expert_tp_size=2)
    with pytest.raises(ValueError, match="expert tensor-parallel size"):
        make_plan(specs, dp_size=4, ep_size=2, expert_tp_size=1)


def test_json_round_trip_with_experts():
    plan, _ = tiny_plan()
    again = CanzonaPlan.from_json(plan.to_json())
    assert again == plan and again.experts == plan.experts
    old = json.loads(plan.to_json())
    del old["experts"], old["ep_size"]  # written before MoE plans existed
    dense = CanzonaPlan.from_json(json.dumps(old))
    assert dense.experts is None and dense.ep_size == 1 and dense.hosts == plan.hosts


def test_summary_keeps_experts_out_of_the_dense_record():
    plan, specs = tiny_plan()
    record = summarize_canzona(plan, specs, COST, WIRE)
    dense_only = summarize_canzona(dataclasses.replace(plan, experts=None), split_experts(specs)[0], COST, WIRE)
    assert {k: v for k, v in record.items() if k in dense_only} == dense_only
    assert len(record["experts"]["gpu_loads"]) == plan.experts.dp_size * plan.experts.tp_size
    combined = plan.combined_loads()
    assert record["combined_gpu_loads"] == pytest.approx(combined)
    assert sum(combined) == pytest.approx(sum(record["gpu_loads"]) + 2 * sum(record["experts"]["gpu_loads"]))
    bound = combined_lower_bound(specs, COST, dp_size=4, tp_size=2, ep_size=2, expert_tp_size=1)
    assert record["combined_makespan_over_lower_bound"] == pytest.approx(max(combined) / bound)
    assert record["combined_makespan_over_lower_bound"] >= 1.0 - 1e-12  # it is a lower bound


# ------------------------------------------------------------------------------ base loads


def test_a_uniform_base_load_leaves_the_plan_unchanged():
    specs = qwen3_specs("qwen3-1.7b", split_qkv=True)
    plain = plan_canzona(specs, dp_size=8, cost_model=COST)
    based = plan_canzona(specs, dp_size=8, cost_model=COST, base_loads=[[5e12]] * 8)
    assert based == plain


def test_base_loads_move_dense_work_off_busy_gpus():
    specs = qwen3_specs("qwen3-1.7b", split_qkv=True)
    plain = plan_canzona(specs, dp_size=8, cost_model=COST)
    total = sum(plain.layouts[0].loads)
    base = [[total / 8 if d < 2 else 0.0] for d in range(8)]  # DP ranks 0, 1 already busy
    based = plan_canzona(specs, dp_size=8, cost_model=COST, base_loads=base)
    assert sum(based.layouts[0].loads[:2]) < 0.5 * sum(plain.layouts[0].loads[:2])
    assert sum(based.layouts[0].loads) == pytest.approx(total)  # the plan's own work, every matrix once
    combined = [b[0] + x for b, x in zip(base, based.layouts[0].loads)]
    assert max(combined) < max(b[0] + x for b, x in zip(base, plain.layouts[0].loads))
    with pytest.raises(ValueError, match="dp_size x tp_size"):
        plan_canzona(specs, dp_size=8, cost_model=COST, base_loads=[[0.0]] * 4)


@pytest.mark.quick
def test_joint_balance_lowers_the_combined_makespan():
    """Qwen3-30B-A3B, one of 8 pipeline stages (6 layers), EP 8 x expert DP 8: 12 dense
    matrices for 64 GPUs, each 0.45 TFLOP of Muon against 1.9 TFLOP of expert work per GPU."""
    specs = qwen3_specs("qwen3-30b-a3b", ep_size=8, split_qkv=True, pp_size=8, pp_rank=1)
    joint = make_plan(specs, dp_size=64, ep_size=8)
    apart = make_plan(specs, dp_size=64, ep_size=8, joint_balance=False)
    mean = sum(apart.combined_loads()) / 64
    assert sum(joint.combined_loads()) == pytest.approx(64 * mean)  # the same work, placed better
    assert max(joint.combined_loads()) / mean < 1.03 < 1.15 < max(apart.combined_loads()) / mean


# ------------------------------------------------------------------------ docs/planner.md targets


def granularity_floor(costs: list[float], gpus: int) -> float:
    """No plan of whole matrices beats this busiest GPU: with more matrices than GPUs, some
    GPUs take two, at best the smallest ones, paired smallest with largest."""
    costs = sorted(costs)
    if len(costs) <= gpus:
        return costs[-1]
    paired = costs[: 2 * (len(costs) - gpus)]
    return max(max(costs), max(a + b for a, b in zip(paired, reversed(paired))))


# (model, TP, EP, PP, stage, DP): docs/planner.md's Mixture-of-experts table (busiest stage of 235B).
DOC_CASES = [
    ("qwen3-30b-a3b", 1, 8, 1, 0, 32), ("qwen3-30b-a3b", 1, 8, 1, 0, 64), ("qwen3-30b-a3b", 1, 8, 1, 0, 256),
    ("qwen3-235b-a22b", 4, 8, 8, 1, 4), ("qwen3-235b-a22b", 4, 8, 8, 1, 8),
]
TARGET_MAKESPAN, TARGET_PADDING = 1.10, 0.05


@pytest.mark.parametrize("model,tp,ep,pp,stage,dp", DOC_CASES)
def test_doc_targets(model, tp, ep, pp, stage, dp):
    edge = 11 if pp > 1 else None
    specs = qwen3_specs(model, tp_size=tp, ep_size=ep, pp_size=pp, pp_rank=stage, first_stage_layers=edge,
                        last_stage_layers=edge, split_qkv=True)
    record = summarize_canzona(make_plan(specs, dp_size=dp, tp_size=tp, ep_size=ep), specs, COST, WIRE)
    experts = record["experts"]
    assert experts["makespan_over_lower_bound"] <= TARGET_MAKESPAN
    assert experts["padding_overhead"] <= TARGET_PADDING and record["padding_overhead"] <= TARGET_PADDING
    assert record["combined_makespan_over_lower_bound"] <= TARGET_MAKESPAN
    # Dense: the target, or the floor of whole matrices where there are more of them than GPUs.
    dense = [COST.cost(s) for s in split_experts(specs)[0] if s.family == "matrix"]
    bound = max(sum(dense) / (dp * tp), max(dense))
    floor = granularity_floor(dense, dp * tp) / bound
    assert record["makespan_over_lower_bound"] <= max(TARGET_MAKESPAN, floor) + 1e-9
    assert MAX_PADDING == TARGET_PADDING
