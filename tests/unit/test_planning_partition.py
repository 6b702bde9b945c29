"""Invariants of the DP layouts, over random shape sets, DP sizes and α."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron.canzona.planning import (
    CanzonaPlan,
    CostModel,
    DPPlan,
    ParamSpec,
    lower_bound,
    make_plan,
    plan_canzona,
    plan_eq1,
    plan_zero1,
    qwen3_specs,
    split_params,
    tight_capacity,
)
from megatron.canzona.planning.geometry import bucket_end_divisor, round_up, shard_divisor

COST = CostModel(kind="muon")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def models(draw):
    """A random model: matrices of random shapes plus a few elementwise vectors."""
    shapes = draw(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=40))
    specs = [ParamSpec(name=f"w{i}", global_shape=s, family="matrix") for i, s in enumerate(shapes)]
    specs += [ParamSpec(name=f"norm{i}", global_shape=(draw(st.integers(1, 64)),), family="elementwise") for i in range(3)]
    order = draw(st.permutations(range(len(specs))))
    return [dataclasses.replace(s, order=o) for s, o in zip(specs, order)]

dp_sizes = st.integers(1, 512)
alphas = st.floats(0.0, 1.0)
bucket_sizes = st.one_of(st.none(), st.integers(1, 200_000))


def check_geometry(plan: DPPlan, specs: list[ParamSpec]) -> None:
    """Stock-compatible buffer: aligned starts, adjacent buckets, padded ends, no overlap."""
    mats = sorted((s for s in specs if s.family == "matrix"), key=lambda s: s.order)
    placements = plan.matrix.placements
    assert sorted(p.name for p in placements) == sorted(s.name for s in mats)  # nothing lost or duplicated
    numel = {s.name: s.numel for s in mats}
    assert all(p.end - p.start == numel[p.name] and p.start % 64 == 0 for p in placements)
    spans = sorted((p.start, p.end) for p in placements)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    cursor = 0
    for b in plan.matrix.buckets:
        assert b.start == cursor and (b.end - b.start) % bucket_end_divisor(plan.dp_size) == 0
        assert b.shard_bounds[0] == b.start and b.shard_bounds[-1] == b.end
        cursor = b.end
    # buckets are contiguous in backprop order: bucket index never decreases along it
    bucket_of = {p.name: p.bucket for p in placements}
    seq = [bucket_of[s.name] for s in mats]
    assert seq == sorted(seq)
    for p in placements:
        b = plan.matrix.buckets[p.bucket]
        assert b.start <= p.start and p.end <= b.end


def check_whole_ownership(plan: DPPlan) -> None:
    for p in plan.matrix.placements:
        b = plan.matrix.buckets[p.bucket]
        assert p.host is not None
        assert b.shard_bounds[p.host] <= p.start and p.end <= b.shard_bounds[p.host + 1]


@SETTINGS
@given(models(), dp_sizes, alphas, bucket_sizes)
def test_canzona_plan_invariants(specs, dp, alpha, bucket_size):
    plan = plan_canzona(specs, dp_size=dp, cost_model=COST, alpha=alpha, bucket_size=bucket_size)
    check_geometry(plan, specs)
    check_whole_ownership(plan)
    assert all(b.uniform for b in plan.matrix.buckets)  # equal chunks in every bucket
    assert (plan.matrix.buckets[0].end - plan.matrix.buckets[0].start) // dp % shard_divisor(dp) == 0
    costs = [COST.cost(s) for s in specs if s.family == "matrix"]
    assert sum(plan.loads) == pytest.approx(sum(costs))  # every matrix counted once
    per_rank = [0.0] * dp
    for p in plan.matrix.placements:
        per_rank[p.host] += p.cost
    assert per_rank == pytest.approx(list(plan.loads))
    again = plan_canzona(specs, dp_size=dp, cost_model=COST, alpha=alpha, bucket_size=bucket_size)
    assert again == plan  # deterministic
    assert DPPlan.from_json(plan.to_json()) == plan


@SETTINGS
@given(models(), dp_sizes, bucket_sizes)
def test_alpha_zero_never_pads_more_than_the_tight_packing(specs, dp, bucket_size):
    plan = plan_canzona(specs, dp_size=dp, cost_model=COST, alpha=0.0, bucket_size=bucket_size)
    for k, b in enumerate(plan.matrix.buckets):
        sizes = [round_up(p.end - p.start, 64) for p in plan.matrix.placements if p.bucket == k]
        tight = round_up(tight_capacity(sizes, dp), shard_divisor(dp))
        assert (b.end - b.start) // dp <= tight


@SETTINGS
@given(models(), dp_sizes, bucket_sizes)
def test_alpha_one_obeys_the_list_scheduling_bound(specs, dp, bucket_size):
    plan = plan_canzona(specs, dp_size=dp, cost_model=COST, alpha=1.0, bucket_size=bucket_size)
    costs = [COST.cost(s) for s in specs if s.family == "matrix"]
    assert max(plan.loads) <= sum(costs) / dp + max(costs) + 1e-6 * max(costs)
    assert max(plan.loads) >= lower_bound(specs, COST, dp) * (1 - 1e-12)


@SETTINGS
@given(models(), dp_sizes, bucket_sizes)
def test_zero1_splits_exactly_the_straddling_matrices(specs, dp, bucket_size):
    plan = plan_zero1(specs, dp_size=dp, cost_model=COST, bucket_size=bucket_size)
    check_geometry(plan, specs)
    brute = 0
    for p in plan.matrix.placements:
        b = plan.matrix.buckets[p.bucket]
        chunk = (b.end - b.start) // dp
        brute += (p.start - b.start) // chunk != (p.end - 1 - b.start) // chunk
    assert split_params(plan) == brute


@SETTINGS
@given(models(), dp_sizes, bucket_sizes)
def test_eq1_owner_is_the_chunk_holding_the_start(specs, dp, bucket_size):
    plan = plan_eq1(specs, dp_size=dp, cost_model=COST, bucket_size=bucket_size)
    check_geometry(plan, specs)
    for p in plan.matrix.placements:
        b = plan.matrix.buckets[p.bucket]
        assert p.host == (p.start - b.start) // ((b.end - b.start) // dp)
        assert b.shard_bounds[p.host] <= p.start and p.end <= b.shard_bounds[p.host + 1]


@pytest.mark.parametrize("model,tp,dp", [("qwen3-8b", 2, 16), ("qwen3-32b", 8, 32), ("qwen3-1.7b", 1, 64)])
def test_full_plan_computes_every_matrix_exactly_once(model, tp, dp):
    specs = qwen3_specs(model, tp_size=tp, split_qkv=True)
    plan = make_plan(specs, dp_size=dp, tp_size=tp)
    computed = [(dp_rank, tp_rank, n) for dp_rank, t in enumerate(plan.tp) for g in t.groups for n, tp_rank in zip(g.names, g.hosts)]
    names = [n for _, _, n in computed]
    assert sorted(names) == sorted(s.name for s in specs if s.family == "matrix")
    for dp_rank, tp_rank, name in computed:
        assert plan.compute_rank(name) == (dp_rank, tp_rank)
        assert 0 <= tp_rank < tp
    assert CanzonaPlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("bad,match", [({"dp_size": 0}, "positive integer"), ({"alpha": -0.1}, r"\[0, 1\]"),
                                       ({"alpha": 1.5}, r"\[0, 1\]"), ({"bucket_size": 0}, "positive")])
def test_bad_input_says_how_to_fix(bad, match):
    kwargs = {"dp_size": 4, "cost_model": COST, **bad}
    with pytest.raises(ValueError, match=match):
        plan_canzona(qwen3_specs("qwen3-tiny"), **kwargs)


def test_alpha_trades_padding_for_balance_on_a_real_model():
    specs = qwen3_specs("qwen3-8b", tp_size=2)
    tight = plan_canzona(specs, dp_size=16, cost_model=COST, alpha=0.0)
    loose = plan_canzona(specs, dp_size=16, cost_model=COST, alpha=1.0)
    assert max(loose.loads) <= max(tight.loads)
    assert loose.matrix.numel >= tight.matrix.numel
    assert math.isclose(sum(loose.loads), sum(tight.loads))
