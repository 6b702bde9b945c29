"""``tools/dry_run.py --fsdp``'s prediction (``canzona_patches.harness.fsdp_dry_run``) on a plan made
in process: the rank's part of Megatron-FSDP's buffers per sharding strategy, its optimizer state
and the step's buffers. tests/integration/test_dry_run.py runs the tool at full size and
tests/e2e/test_canzona_fsdp.py (test_dry_runs_fsdp_prediction_is_what_every_rank_measured) holds the prediction to what CPU runs measure."""

from __future__ import annotations

import pytest

from canzona_patches.harness.fsdp_dry_run import SHARDED, every_rank_state, fsdp_memory, fsdp_rows, predict_fsdp
from megatron.canzona.planning import make_plan, qwen3_specs
from megatron.canzona.planning.memory import StateLayout

pytestmark = pytest.mark.quick

DP = 4


def _plan(model: str = "qwen3-tiny", ep: int = 1):
    specs = qwen3_specs(model, ep_size=ep)
    return make_plan(specs, dp_size=DP, ep_size=ep, layout="fsdp", fsdp_strategy="optim_grads_params"), specs


@pytest.mark.parametrize("strategy", list(SHARDED))
def test_a_rank_holds_its_shards_and_the_whole_buckets_its_strategy_keeps(strategy):
    plan, specs = _plan()
    state = StateLayout(optimizer="muon")
    ranks = [predict_fsdp(plan, specs, state, dp_rank=d, tp_rank=0, strategy=strategy, bucket_size=None,
                          param_bytes=2, grad_bytes=2) for d in range(DP)]
    whole = sum(ranks[0]["bucket_elements"])
    weights, grads = SHARDED[strategy]
    for p in ranks:
        assert p["main_weight_elements"] == whole // DP
        assert p["weight_elements"] == (whole // DP if weights else whole)
        assert p["grad_elements"] == (whole // DP if grads else whole)
        # Muon: each element a rank holds has its momentum there (a matrix's) or AdamW's two moments
        assert p["state_elements"]["momentum"] + p["state_elements"]["adam_moments"] // 2 == p["shard_elements"]
        if strategy == "optim_grads_params":  # the plan's own geometry: a source of each matrix piece it holds,
            assert p["early_source_elements"] == p["state_elements"]["momentum"] > 0  # made in backward
        assert p["experts"] is None
    assert sum(p["shard_elements"] for p in ranks) == sum(s.numel for s in specs)
    rows = fsdp_rows(ranks[0], strategy)
    held = {row["quantity"]: row["held"] for row in rows}
    assert held["model weights"] == ("shard" if weights else "whole") and held["fp32 main weights"] == "shard"
    memory = fsdp_memory(rows)
    assert memory["peak_bytes"] > memory["steady_bytes"] > 0


def test_every_rank_state_is_each_ranks_prediction_with_experts():
    plan, specs = _plan("qwen3-moe-tiny", ep=2)
    state = StateLayout(optimizer="shampoo")
    every = every_rank_state(plan, specs, state, strategy="optim_grads_params", bucket_size=None)
    assert [r["rank"] for r in every] == list(range(DP))
    for r in every:
        p = predict_fsdp(plan, specs, state, dp_rank=r["rank"], tp_rank=0, strategy="optim_grads_params",
                         bucket_size=None, param_bytes=2, grad_bytes=2)
        assert (p["state_elements"], p["experts"]["state_elements"]) == (r["dense"], r["experts"])
        assert p["experts"]["num_buckets"] == 2 and all(b["expert"] and b["dp_size"] == 2 for b in p["experts"]["buckets"])
    hosted = sum(r["dense"]["statistics"] + r["experts"]["statistics"] for r in every)
    assert hosted > 0  # Shampoo's statistics on the hosts, none on the holders
    assert all(r["dense"]["momentum"] == 0 for r in every)
    # Shampoo gathers raw gradients: its holders make no source
    assert predict_fsdp(plan, specs, state, dp_rank=0, tp_rank=0, strategy="optim_grads_params", bucket_size=None,
                        param_bytes=2, grad_bytes=2)["early_source_elements"] == 0
