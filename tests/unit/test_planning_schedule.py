"""The schedule: a plan expanded once into matrix tasks, read by every consumer."""

from __future__ import annotations

import pytest

from megatron.canzona.planning import make_plan, qwen3_specs
from megatron.canzona.planning.memory import StateLayout, rank_memory
from megatron.canzona.planning.schedule import Task, buffer_schedule, plan_schedule
from megatron.canzona.planning.sim.layouts import plan_tasks as sim_plan_tasks
from megatron.canzona.planning.specs import ParamSpec

pytestmark = pytest.mark.quick


def _specs(tp: int) -> list[ParamSpec]:
    return [s for s in qwen3_specs("qwen3-1.7b", tp_size=tp) if "layers.0." in s.name or "layers.1." in s.name]


@pytest.mark.parametrize("layout", ["whole", "lean"])
def test_every_matrix_is_one_task_per_copy_in_its_bucket(layout):
    """A TP-sharded matrix is one task held by every TP rank; a matrix every TP rank holds
    whole is one task per TP rank, hosted on that TP rank; pieces and bucket are the plan's."""
    specs = _specs(2)
    plan = make_plan(specs, dp_size=3, tp_size=2, bucket_size=300_000, layout=layout)
    schedule = plan_schedule(plan)
    by_spec = {s.name: s for s in specs if s.family == "matrix"}
    assert len({t.key for t in schedule.tasks}) == len(schedule.tasks)
    counted = {}
    for task in schedule.tasks:
        spec = by_spec[task.name]
        buffer = plan.layouts[task.chunk].matrix
        placement = buffer.placement(task.name)
        assert task.tp_sharded == spec.tp_sharded
        assert task.pieces == buffer.pieces(placement) and task.bucket == placement.bucket
        assert task.numel == spec.numel and task.full_numel(2) == spec.numel * (2 if spec.tp_sharded else 1)
        holders = {coord for coord, _, _ in task.holders(2)}
        assert task.host[0] in {d for d, _ in holders} or not task.tp_sharded
        if not task.tp_sharded:
            assert {t for _, t in holders} == {task.column} == {task.host[1]}
        counted[task.name] = counted.get(task.name, 0) + 1
    assert counted == {n: 1 if s.tp_sharded else 2 for n, s in by_spec.items()}
    if layout == "whole":  # every matrix whole in one DP shard
        assert all(len(t.pieces) == 1 for t in schedule.tasks)
    assert sum(len(v) for v in schedule.by_bucket().values()) == len(schedule.tasks)


def test_consumers_read_the_same_tasks():
    """The simulator, the traffic metrics and the memory model see the schedule's holders and hosts."""
    specs = _specs(2)
    plan = make_plan(specs, dp_size=4, tp_size=2, bucket_size=200_000, layout="lean")
    schedule = plan_schedule(plan)
    rank = lambda d, t: d * 2 + t  # noqa: E731
    sim = sim_plan_tasks(plan, specs, lambda s: 1.0, rank)
    assert [(s.name, s.host, s.group) for s in sim] == [(t.name, rank(*t.host), t.group) for t in schedule.tasks]
    assert [s.holders for s in sim] == [tuple((rank(*c), hi - lo) for c, lo, hi in t.holders(2))
                                        for t in schedule.tasks]
    for d in range(4):
        for t in range(2):
            mine = [task for task in schedule.tasks if task.host == (d, t)]
            memory = rank_memory(plan, specs, dp_rank=d, tp_rank=t, state=StateLayout(optimizer="muon"))
            per_group = {}
            for task in mine:
                per_group[task.group] = per_group.get(task.group, 0) + task.full_numel(2)
            assert memory.compute_batch_elements == max(per_group.values(), default=0)
    sync = plan_schedule(plan, synchronous=True)
    hosted = [t for t in schedule.tasks if t.host == (0, 0)]
    held = [t for t in sync.tasks if any(c == (0, 0) for c, _, _ in t.holders(2))]  # synchronous: every holder computes
    assert all(t.host is None for t in sync.tasks) and len(held) >= len(hosted)


def test_buffer_schedule_is_synchronous_compute_of_every_piece():
    specs = _specs(1)
    plan = make_plan(specs, dp_size=4, tp_size=1, bucket_size=100_000, layout="lean")
    schedule = buffer_schedule([plan.dp.matrix], specs, 1)
    assert all(t.host is None for t in schedule.tasks)
    assert sum(t.numel for t in schedule.tasks) == plan.dp.matrix.param_numel


def test_a_task_rejects_pieces_that_do_not_cover_it_and_a_copy_hosted_elsewhere():
    with pytest.raises(ValueError, match="cover"):
        Task(key="w", name="w", pieces=((0, 0, 4), (1, 5, 8)), tp_sharded=True, host=(0, 0))
    with pytest.raises(ValueError, match="TP rank 1's copy"):
        Task(key="w@tp1", name="w", pieces=((0, 0, 4),), tp_sharded=False, column=1, host=(0, 0))


def test_gate_and_up_are_two_tasks_with_two_hosts():
    """``--canzona-split-gate-up``: a gated fc1 is two parts, each a contiguous half of every
    TP shard ([gate_r; up_r]); the whole layout keeps both on the owner's DP rank and puts
    them on two TP ranks; the largest task is half the fused matrix."""
    specs = [s for s in qwen3_specs("qwen3-8b", tp_size=4, split_gate_up=True) if ".layers.0." in s.name
             or ".layers.1." in s.name]
    fused = [s for s in qwen3_specs("qwen3-8b", tp_size=4) if ".layers.0." in s.name or ".layers.1." in s.name]
    plan = make_plan(specs, dp_size=2, tp_size=4, layout="whole")
    fc1 = [s for s in specs if s.name.endswith("linear_fc1.weight")]
    assert len(fc1) == 2 and all(len(s.parts) == 2 for s in fc1)
    for spec in fc1:
        hosts = [h for h in plan.hosts if h.name == spec.name]
        assert [h.span for h in sorted(hosts, key=lambda h: h.part)] == [(0, spec.numel // 2), (spec.numel // 2, spec.numel)]
        assert len({h.dp_rank for h in hosts}) == 1 and len({h.tp_rank for h in hosts}) == 2
    tasks = [t for t in plan_schedule(plan).tasks if t.name.endswith("linear_fc1.weight")]
    assert len(tasks) == 4 and all(t.numel == t.span[1] - t.span[0] and "#part" in t.key for t in tasks)
    largest = max(h.cost for h in plan.hosts)
    fused_plan = make_plan(fused, dp_size=2, tp_size=4, layout="whole")
    assert largest < 0.6 * max(h.cost for h in fused_plan.hosts)
    # Two (f, h) updates cost a little more than one (2f, h): the Gram terms are per matrix.
    assert 1.0 <= sum(h.cost for h in plan.hosts) / sum(h.cost for h in fused_plan.hosts) <= 1.05
