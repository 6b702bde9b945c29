"""Greedy-rollback micro-groups for tensor parallelism."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.canzona.planning import schedule_microgroups
from megatron.canzona.planning.microgroups import _assign

costs_lists = st.lists(st.floats(0.0, 1000.0, allow_nan=False), min_size=0, max_size=60)


def _largest_slot(costs: list[float], tp: int) -> float:
    """Largest slot when ``costs`` are assigned largest first onto ``tp`` empty slots."""
    _, slots = _assign(list(range(len(costs))), costs, [0.0] * tp)
    return max(slots)


@settings(max_examples=150, deadline=None)
@given(costs_lists, st.integers(1, 16), st.one_of(st.none(), st.floats(0.0, 3000.0)))
def test_greedy_rollback_rule(costs, tp, budget):
    names = [f"m{i}" for i in range(len(costs))]
    plan = schedule_microgroups(names, costs, tp_size=tp, budget=budget)
    flat = [n for g in plan.groups for n in g.names]
    assert sorted(flat) == sorted(names)  # each matrix in exactly one group
    cost_of = dict(zip(names, costs))
    order = [n for g in plan.groups for n in g.names]
    assert [cost_of[n] for n in order] == sorted(costs, reverse=True)  # largest cost first
    for k, g in enumerate(plan.groups):
        assert all(0 <= h < tp for h in g.hosts)
        slots = [0.0] * tp
        for n, h in zip(g.names, g.hosts):
            slots[h] += cost_of[n]
        assert slots == pytest.approx(list(g.slot_loads))
        if len(g.names) > 1:  # only a single matrix may exceed the budget
            assert max(g.slot_loads) <= plan.budget
        if k + 1 < len(plan.groups):  # sealed because the next matrix would overflow it
            nxt = plan.groups[k + 1].names[0]
            assert _largest_slot([cost_of[n] for n in g.names] + [cost_of[nxt]], tp) > plan.budget
    assert sum(plan.rank_loads) == pytest.approx(sum(costs))


def test_a_matrix_above_budget_gets_its_own_group():
    plan = schedule_microgroups(["big", "a", "b"], [10.0, 1.0, 1.0], tp_size=2, budget=4.0)
    assert plan.groups[0].names == ("big",)
    assert plan.groups[1].names == ("a", "b") and sorted(plan.groups[1].hosts) == [0, 1]


def test_groups_balance_slots_and_totals():
    # Eight equal matrices on TP 4 with a budget of two each: two groups, every slot used.
    plan = schedule_microgroups([f"m{i}" for i in range(8)], [1.0] * 8, tp_size=4, budget=2.0)
    assert len(plan.groups) == 1 and plan.groups[0].slot_loads == (2.0, 2.0, 2.0, 2.0)
    plan = schedule_microgroups([f"m{i}" for i in range(8)], [1.0] * 8, tp_size=4, budget=1.0)
    assert len(plan.groups) == 2 and plan.rank_loads == (2.0, 2.0, 2.0, 2.0)


def test_bad_tp_size():
    with pytest.raises(ValueError, match="--tp 1 or more"):
        schedule_microgroups(["a"], [1.0], tp_size=0)
