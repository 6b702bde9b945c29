"""Hosts over DP x TP ranks, micro-groups, and the bytes each rank sends."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.canzona.planning import (
    GROUPS_PER_HOST,
    WireConfig,
    make_plan,
    plan_schedule,
    qwen3_specs,
    schedule_groups,
    traffic,
)
from megatron.canzona.planning.comm import narrow_bytes
from megatron.canzona.planning.cost import CostModel
from megatron.canzona.planning.hosts import SINGLE_LARGE, HostItem, assign_hosts
from megatron.canzona.planning.schedule import Task

costs_lists = st.lists(st.floats(0.0, 1000.0, allow_nan=False), min_size=0, max_size=60)


@settings(max_examples=150, deadline=None)
@given(costs_lists, st.integers(1, 8), st.one_of(st.none(), st.floats(0.0, 3000.0)), st.data())
@pytest.mark.quick
def test_groups_cut_each_host_into_runs_under_the_budget(costs, num_hosts, budget, data):
    hosts = [data.draw(st.integers(0, num_hosts - 1)) for _ in costs]
    local = [data.draw(st.booleans()) for _ in costs]
    chosen = 1000.0 if budget is None else budget
    groups = schedule_groups(costs, hosts, budget=chosen, at_least_two=budget is None, local=local)
    assert len(groups) == len(costs)
    single = [costs[i] for i in range(len(costs)) if hosts.count(hosts[i]) == 1 and not local[i]]
    for host in sorted(set(hosts)):
        mine = [i for i in range(len(costs)) if hosts[i] == host]
        runs = sorted({groups[i] for i in mine})
        first = 0
        if budget is None and len(mine) == 1 and not local[mine[0]]:  # large single matrices in group 1
            first = int(costs[mine[0]] >= SINGLE_LARGE * max(single))
        assert runs == list(range(first, first + len(runs)))  # a host's groups are consecutive
        order = sorted(mine, key=lambda i: (groups[i], not local[i], -costs[i], i))
        assert [not local[i] for i in order] == sorted(not local[i] for i in mine)  # local work first
        for k in runs:
            run = [costs[i] for i in mine if groups[i] == k]
            if len(run) > 1 and not (budget is None and len(runs) == 2 and len(mine) > 1):
                assert sum(run) <= chosen * (1 + 1e-12)
        if budget is None and len(mine) >= 2:
            assert len(runs) >= 2  # the next group's gather overlaps this one's compute


@pytest.mark.quick
def test_a_matrix_above_budget_runs_alone():
    groups = schedule_groups([10.0, 1.0, 1.0], [0, 0, 0], budget=4.0, at_least_two=False)
    assert groups == [0, 1, 1]


def test_a_host_runs_its_matrices_in_the_order_their_buckets_reduce():
    """Bucket order before size: the first group's gathers can go while backward runs."""
    groups = schedule_groups([1.0, 5.0, 3.0], [0, 0, 0], budget=5.0, at_least_two=False,
                             ready=[(0, 0), (0, 1), (0, 0)])
    assert groups == [0, 1, 0]
    assert schedule_groups([1.0, 5.0, 3.0], [0, 0, 0], budget=5.0, at_least_two=False) == [1, 0, 1]


def test_hosts_of_one_matrix_compute_small_ones_first():
    """The small matrices' scatters go while the large ones compute."""
    assert schedule_groups([5.0, 4.0, 2.0, 1.0], [0, 1, 2, 3], budget=5.0) == [1, 1, 0, 0]


@pytest.mark.parametrize("model,tp", [("qwen3-1.7b", 1), ("qwen3-4b", 1), ("qwen3-8b", 2), ("qwen3-14b", 4),
                                      ("qwen3-32b", 8)])
@pytest.mark.parametrize("dp", [8, 16, 32, 64, 128, 256])
def test_default_budget_gives_two_groups_to_every_host_with_two_matrices(model, tp, dp):
    """Every recipe's TP at DP 8-256: the pipeline has something to overlap on every host."""
    plan = make_plan(qwen3_specs(model, tp_size=tp), dp_size=dp, tp_size=tp)
    per_host: dict[tuple[int, int], set[int]] = {}
    counts: dict[tuple[int, int], int] = {}
    for h in plan.hosts:
        key = (h.dp_rank, h.tp_rank or 0)
        per_host.setdefault(key, set()).add(h.group)
        counts[key] = counts.get(key, 0) + 1
    for key, groups in per_host.items():
        if counts[key] >= 2:
            assert len(groups) >= 2, f"host {key} has {counts[key]} matrices in one micro-group"
    assert 2 <= plan.num_groups <= 3 * GROUPS_PER_HOST  # one matrix per host: small ones first


def test_traffic_counts_each_piece_once_each_way():
    """A 3-piece matrix hosted by one of its holders: the two others send their pieces and get
    them back; the stock collectives add (dp - 1) / dp of the buffer at both dtypes."""
    wire = WireConfig(param_bytes=2, grad_bytes=4)
    pieces = ((0, 0, 100), (1, 100, 150), (2, 150, 180))
    task = Task(key="w", name="w", pieces=pieces, tp_sharded=False, host=(1, 0))
    per_rank = traffic([], [task], dp_size=3, tp_size=1, wire=wire)
    assert [r.host_gather for r in per_rank] == [400.0, 0.0, 120.0]
    assert [r.host_scatter for r in per_rank] == [0.0, 520.0, 0.0]
    sync = traffic([], [Task(key="w", name="w", pieces=pieces, tp_sharded=False, host=None)], dp_size=3, tp_size=1, wire=wire)
    assert [r.sync_gather for r in sync] == [800.0, 400.0, 240.0]
    # bf16 both ways (--canzona-narrow-gathers): each piece rounded up to whole fp32 words, as packed
    odd = Task(key="w", name="w", pieces=((0, 0, 101), (1, 101, 150), (2, 150, 181)), tp_sharded=False, host=(1, 0))
    narrow = traffic([], [odd], dp_size=3, tp_size=1, wire=wire, narrow={"w": 2}, gathers={"w": 2})
    assert [r.host_gather for r in narrow] == [204.0, 0.0, 64.0]
    assert [r.host_scatter for r in narrow] == [0.0, 268.0, 0.0]


@pytest.mark.quick
def test_plan_traffic_is_what_the_planner_balanced():
    """The bytes per rank the metrics report come from the same tasks the runtime executes:
    every split matrix's non-host pieces, once each way."""
    specs = qwen3_specs("qwen3-1.7b")
    plan = make_plan(specs, dp_size=32)
    wire = WireConfig()
    per_rank = traffic([plan.dp.matrix], plan_schedule(plan).tasks, dp_size=32, tp_size=1, wire=wire)
    moved = sum(
        (hi - lo) for h in plan.hosts for d, lo, hi in plan.dp.matrix.pieces(plan.dp.matrix.placement(h.name))
        if d != h.dp_rank
    )
    assert sum(r.host_gather for r in per_rank) == moved * wire.main_grad_bytes
    assert sum(r.host_scatter for r in per_rank) == moved * wire.update_bytes


@pytest.mark.quick
def test_the_host_choice_prices_a_narrow_update_at_its_bytes():
    """A host scatters a bf16 Muon direction (2 bytes an element) where the update is narrow:
    the host choice counts those bytes, the ones the traffic metrics and the runtime send."""
    spec = next(s for s in qwen3_specs("qwen3-1.7b", tp_size=2) if s.tp_sharded and len(s.parts) == 1)
    assert narrow_bytes(CostModel(kind="muon", ns_dtype="bfloat16"), spec, 0) == 2
    assert narrow_bytes(CostModel(kind="muon", ns_dtype="float32"), spec, 0) is None
    assert narrow_bytes(CostModel(kind="soap"), spec, 0) is None
    wire = WireConfig()
    sent = {}
    for update_bytes, gather_bytes in ((None, None), (2, None), (2, 2)):  # each TP rank holds 100 elements;
        item = HostItem(cost=1.0, dp_rank=0, tp_sharded=True, pieces=((0, 100),),  # one hosts, the other sends
                        update_bytes=update_bytes, gather_bytes=gather_bytes)
        _, ranks = assign_hosts([item], dp_size=1, tp_size=2, alpha=0.5, wire=wire, base_bytes=0.0,
                                byte_scale=1.0, load_scale=1.0)
        sent[update_bytes, gather_bytes] = sorted(ranks.bytes)
    assert sent[None, None] == [100 * wire.main_grad_bytes, 100 * wire.update_bytes]
    assert sent[2, None] == [100 * 2, 100 * wire.main_grad_bytes]
    assert sent[2, 2] == [100 * 2, 100 * 2]  # --canzona-narrow-gathers: the piece goes in bf16 too
