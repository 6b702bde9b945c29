"""``--ddp-reduce-scatter-with-fp32-accumulation`` under the whole layout.

Megatron's fp32-accumulated reduce-scatter is an all-to-all of every rank's shards, each rank then
summing what it received in fp32, over equal shards. The whole layout's shards differ in size
(``canzona_patches.integration.uneven.uneven_fp32_reduce_scatter`` splits the all-to-all at the
planned shards). Without that split the run stops at its first reduce (the all-to-all's output does
not fit the shard). Held here, at DP 4 with six buckets of unequal, some empty, shards
(``test_canzona_dp.py``'s): Muon in the whole layout with the fp32-accumulated reduce is **bitwise**
the lean layout's (Megatron's own equal-shard function: every element is the same fp32 sum in the
same rank order), and both equal the run reduced by gloo's reduce-scatter within the DP tests'
bound.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron.canzona.runtime import LaunchConfig, launch

from canzona_patches.harness.tiny_gpt import TinyRun, train_tiny_gpts
from .test_canzona_dp import BUCKET, LAUNCH_TIMEOUT_S, LR, PARAM_ATOL, SPLITS, STEPS
from . import CPU_RANKS

pytestmark = CPU_RANKS

BASE = TinyRun(lr=LR, num_steps=STEPS, layout="canzona", optimizer="muon", weight_decay=0.1, bucket_size=BUCKET,
               overlap_grad_reduce=True, canzona_layout="whole", **SPLITS["muon"])
RUNS = {"whole": BASE,
        "whole_fp32_accumulation": replace(BASE, reduce_scatter_with_fp32_accumulation=True),
        "lean_fp32_accumulation": replace(BASE, canzona_layout="lean", reduce_scatter_with_fp32_accumulation=True)}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    per_rank = launch(train_tiny_gpts, LaunchConfig(world_size=4, timeout_s=LAUNCH_TIMEOUT_S), list(RUNS.values()))
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(RUNS)}


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)
def test_the_whole_layout_reduces_with_fp32_accumulation_as_megatrons_equal_shards(results) -> None:
    whole, lean, plain = (results[k] for k in ("whole_fp32_accumulation", "lean_fp32_accumulation", "whole"))
    for rank in range(4):
        assert whole[rank]["losses"] == lean[rank]["losses"]
        for name, expected in lean[rank]["params"].items():
            assert torch.equal(whole[rank]["params"][name], expected), (rank, name)
            torch.testing.assert_close(plain[rank]["params"][name], expected, rtol=0, atol=PARAM_ATOL["muon"])
        assert whole[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-4)
