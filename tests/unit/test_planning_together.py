"""TP-sharded matrices computed by their TP ranks together (``tp_together``): which ones the planner
picks, what each TP rank is charged, the tasks the schedule makes of them, and their projection."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.canzona.planning import CostModel, ParamSpec, make_plan, plan_schedule, qwen3_specs
from megatron.canzona.planning.balance import computed_together
from megatron.canzona.planning.comm import WireConfig, rank_index, shared_grams, traffic
from megatron.canzona.planning.cost import sharded_ns_flops
from megatron.canzona.planning.plan import CanzonaPlan
from megatron.canzona.planning.sim import ClusterSpec, simulate

pytestmark = pytest.mark.quick

MUON = CostModel()
TALL = ParamSpec(name="layers.0.mlp.linear_fc1.weight", global_shape=(2048, 256), tp_dim=0, tp_size=2, order=0)
"""A column-parallel fc1: its long side (rows) split over TP."""
SHORT = ParamSpec(name="layers.0.self_attention.linear_k.weight", global_shape=(64, 256), tp_dim=0, tp_size=2, order=1)
"""K-like: TP splits its short side."""
WHOLE = ParamSpec(name="layers.0.router.weight", global_shape=(64, 256), order=2)


def test_the_rule_takes_a_long_split_muon_matrix_above_the_mean_load():
    big = MUON.cost(TALL)
    assert computed_together(TALL, MUON, big / 2, "auto")
    assert not computed_together(TALL, MUON, big * 2, "auto")  # below the mean: one host, as before
    assert computed_together(TALL, MUON, big * 2, "all")
    assert not computed_together(TALL, MUON, 0.0, "off")
    assert not computed_together(SHORT, MUON, 0.0, "all")  # its Gram matrix would be the long side's square
    assert not computed_together(WHOLE, MUON, 0.0, "all")  # not TP-sharded
    assert not computed_together(TALL, CostModel(kind="shampoo"), 0.0, "all")
    assert not computed_together(TALL, CostModel(kind="adaptive_muon"), 0.0, "all")
    split = dataclasses.replace(TALL, fused="gate_up", blocks=((1024, 256), (1024, 256)))
    assert not computed_together(split, MUON, 0.0, "all")  # hosted in parts
    with pytest.raises(ValueError, match="--canzona-tp-together"):
        computed_together(TALL, MUON, 0.0, "sometimes")


def test_each_tp_rank_is_charged_its_share():
    share = MUON.shared_cost(TALL)
    assert share == sharded_ns_flops(2048, 256, 2)
    assert 0.5 * MUON.cost(TALL) < share < MUON.cost(TALL)  # half the long-side products, all of the square's
    assert MUON.shared_reductions(TALL) == [(5, 256 * 256)]
    with pytest.raises(ValueError, match="TP-sharded"):
        MUON.shared_cost(WHOLE)


@pytest.mark.parametrize("layout", ["fsdp", "whole", "lean"])
def test_a_matrix_computed_together_is_a_task_per_tp_rank_on_one_dp_rank(layout):
    specs = [TALL, SHORT, WHOLE]
    off = make_plan(specs, dp_size=2, tp_size=2, cost_model=MUON, layout=layout)
    plan = make_plan(specs, dp_size=2, tp_size=2, cost_model=MUON, layout=layout, tp_together="all")
    assert not any(h.together for h in off.hosts)
    host = plan.host(TALL.name)
    assert host.together and host.tp_rank is None and host.cost == MUON.shared_cost(TALL)
    assert not plan.host(SHORT.name).together and plan.host(SHORT.name).tp_rank is not None
    loads = plan.rank_loads()
    assert loads[host.dp_rank][0] >= host.cost and loads[host.dp_rank][1] >= host.cost  # both TP ranks compute
    tasks = [t for t in plan_schedule(plan).tasks if t.name == TALL.name]
    assert [(t.together, t.tp_sharded, t.column, t.host) for t in tasks] == [
        (True, False, c, (host.dp_rank, c)) for c in (0, 1)]
    assert [t.pieces for t in tasks][0] == tasks[1].pieces  # each TP rank's shard, the same DP pieces
    assert CanzonaPlan.from_json(plan.to_json()) == plan
    grams = [traffic([], tasks, dp_size=2, tp_size=2, wire=WireConfig(), grams=shared_grams(tasks, specs, MUON))
             [rank_index(*t.host, 2)].tp_gram for t in tasks]
    assert grams == [5 * 2 * 0.5 * 256 * 256 * 4] * 2  # each co-host: five ring all-reduces of the fp32 Gram matrix


def test_qwen3_32b_under_fsdp_takes_fc1_and_fc2_and_lowers_the_busiest_gpu():
    specs = qwen3_specs("qwen3-32b", tp_size=4, split_qkv=True)
    off = make_plan(specs, dp_size=64, tp_size=4, cost_model=MUON, layout="fsdp")
    auto = make_plan(specs, dp_size=64, tp_size=4, cost_model=MUON, layout="fsdp", tp_together="auto")
    kinds = {h.name.split(".")[-2] for h in auto.hosts if h.together}
    assert kinds == {"linear_fc1", "linear_fc2"}
    busiest = [max(load for row in p.rank_loads() for load in row) for p in (off, auto)]
    assert busiest[1] < 0.7 * busiest[0]


def test_projected_tasks_computed_together_move_nothing_and_sum_their_gram_matrices():
    """TP 2, DP 1, one column-parallel matrix: each TP rank computes its half where it lies (nothing
    gathered or scattered), its share of the FLOPs plus five ring all-reduces of the fp32 256 x 256
    Gram matrix over NVLink, then applies its half."""
    toy = ClusterSpec.from_dict({
        "name": "toy", "gpus_per_node": 8,
        "gpu": {"bf16_tflops": 100.0, "fp32_tflops": 10.0, "memory_gb_per_s": 1000.0, "matmul_efficiency": 0.5,
                "memory_efficiency": 1.0},
        "training": {"mfu": 0.5}, "intra_node": {"bandwidth_gb_per_s": 100.0, "latency_us": 10.0},
        "collectives": {"ring_efficiency": 1.0, "alltoall_efficiency": 0.5}})
    numel = 2048 * 256
    together = simulate([TALL], strategy="canzona", cluster=toy, dp_size=1, tp_size=2, tp_together="all")
    share = sharded_ns_flops(2048, 256, 2) / 50e12 + 12 * numel / 2 / 1e12
    ring = 10e-6 + 0.5 * 256 * 256 * 4 / 100e9
    apply = numel / 2 * 14 / 1e12
    assert together.optimizer_step_seconds == pytest.approx(share + 2 * 5 * ring + apply, rel=1e-12)
    assert together.step_bytes_per_rank == 2 * 5 * 0.5 * 256 * 256 * 4
    alone = simulate([TALL], strategy="canzona", cluster=toy, dp_size=1, tp_size=2)
    assert alone.step_bytes_per_rank == numel / 2 * 4  # one host: the other half gathered to it, in fp32
