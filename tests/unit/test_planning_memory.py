"""Per-rank memory predicted from the plan alone: the expert part of an expert-parallel rank.

``tools/dry_run.py`` checks these numbers against a built full-size rank; here, invariants
of the prediction itself over every rank of a small stage.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron.canzona.planning import expert_coordinates, make_plan, qwen3_specs
from megatron.canzona.planning.memory import StateLayout, rank_memory

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
