"""Per-rank memory predicted from the plan alone: the expert part of an expert-parallel rank.

``tools/dry_run.py`` checks these numbers against a built full-size rank; here, invariants
of the prediction itself over every rank of a small stage.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron.canzona.planning import expert_coordinates, make_plan, qwen3_specs
from megatron.canzona.planning.memory import StateLayout, rank_memory

pytestmark = pytest.mark.quick

MUON = StateLayout(optimizer="muon")


def _moe(dp_size: int, tp_size: int, ep_size: int):
    specs = qwen3_specs("qwen3-moe-tiny", tp_size=tp_size, ep_size=ep_size, expert_tp_size=1)
    return make_plan(specs, dp_size=dp_size, tp_size=tp_size, ep_size=ep_size, expert_tp_size=1,
                     bucket_size=4096), specs


def test_a_dense_rank_has_no_expert_part():
    specs = qwen3_specs("qwen3-tiny")
    plan = make_plan(specs, dp_size=2, bucket_size=4096)
    assert rank_memory(plan, specs, dp_rank=1, tp_rank=0, state=MUON).experts is None


@pytest.mark.parametrize("dp_size,tp_size,ep_size", [(4, 1, 2), (2, 2, 2), (4, 2, 4)])
def test_each_rank_gets_the_expert_plan_at_its_expert_coordinate(dp_size, tp_size, ep_size):
    plan, specs = _moe(dp_size, tp_size, ep_size)
    assert plan.experts is not None
    expert_specs = [s for s in specs if s.is_expert]
    by_expert_rank = {}
    for dp_rank in range(dp_size):
        for tp_rank in range(tp_size):
            mem = rank_memory(plan, specs, dp_rank=dp_rank, tp_rank=tp_rank, state=MUON)
            edp, _, etp = expert_coordinates(dp_rank, tp_rank, tp_size=tp_size, ep_size=ep_size, expert_tp_size=1)
            assert mem.experts == rank_memory(plan.experts, specs, dp_rank=edp, tp_rank=etp, state=MUON)
            # The dense part is what it is without experts.
            dense = rank_memory(dataclasses.replace(plan, experts=None), specs, dp_rank=dp_rank, tp_rank=tp_rank,
                                state=MUON)
            assert dataclasses.replace(mem, experts=None) == dense
            by_expert_rank[edp] = mem.experts
    assert sorted(by_expert_rank) == list(range(plan.experts.dp_size))
    parts = list(by_expert_rank.values())
    # Each expert element sits in exactly one expert-DP shard; each expert matrix has one host.
    assert sum(p.shard_elements for p in parts) == sum(s.numel for s in expert_specs)
    assert sum(p.state_elements["momentum"] for p in parts) == sum(m * n for s in expert_specs for m, n in s.matrices)
    assert {p.param_buffer_elements for p in parts} == {plan.experts.dp.matrix.numel}


def test_early_compute_keeps_a_moving_whole_matrix_direction_in_its_newton_schulz_dtype():
    """Muon iterating in bf16: a whole matrix that moves to its host has its direction exactly in
    bf16 before its scale (the update it scatters in bf16), and early compute keeps it so, half
    the fp32 elements; a split QKV (a scale per matrix) and fp32 Newton-Schulz keep it in fp32.
    What each rank keeps adds up to the hosted directions, in the dtype each is kept in."""
    from megatron.canzona.planning.schedule import plan_schedule

    specs = qwen3_specs("qwen3-tiny", tp_size=2, split_qkv=True)
    plan = make_plan(specs, dp_size=2, tp_size=2, bucket_size=4096)
    bf16 = StateLayout(optimizer="muon", ns_dtype="bfloat16")
    assert bf16.direction_elements(3, 5, narrow=True) == 8 and bf16.direction_elements(3, 5, narrow=False) == 15
    assert MUON.direction_elements(3, 5, narrow=True) == 15  # fp32 Newton-Schulz: nothing narrower
    by_name = {(s.chunk, s.name): s for s in specs}
    full = half = 0
    for task in plan_schedule(plan).tasks:
        matrices = by_name[(task.chunk, task.name)].part_matrices(task.part)
        numel = sum(rows * cols for rows, cols in matrices)
        full += numel
        half += -(-numel // 2) if len(matrices) == 1 and not task.is_local() else numel
    assert half < full
    kept = {state.ns_dtype: sum(rank_memory(plan, specs, dp_rank=d, tp_rank=t, state=state, early_compute_bytes=2**40)
                                .early_direction_elements for d in range(2) for t in range(2))
            for state in (MUON, bf16)}
    assert kept == {"float32": full, "bfloat16": half}
