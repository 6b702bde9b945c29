"""``optimizer.step()`` reads a small constant number of values from the device.

Each host read (``Tensor.item``, ``tolist``, ``__bool__``, ``__float__``, ...) waits for every
queued kernel on CUDA. The tiny GPT takes Canzona steps at DP 2 with matrices split across
DP shards, and at TP 2, for Muon and Shampoo (whose step 1 refreshes its inverse roots), with
2 and with 4 layers: every step reads the same few values whatever the number of
parameters -- the found-inf flag of Canzona's non-finite check and Megatron's global gradient
norm.
"""

from __future__ import annotations

import pytest

from megatron.canzona.runtime import LaunchConfig, launch

from canzona_patches.harness.tiny_gpt import TinyRun, train_tiny_gpts
from . import CPU_RANKS

pytestmark = CPU_RANKS

MAX_SYNCS_PER_STEP = 2
"""The found-inf flag (one all-reduced value) and the global gradient norm."""
LAUNCH_TIMEOUT_S = 240.0


def _runs(tp_size: int) -> list[TinyRun]:
    return [
        TinyRun(tp_size=tp_size, num_steps=2, layout="canzona", optimizer=optimizer, num_layers=layers,
                bucket_size=20_000, alpha=1.0, count_syncs=True, weight_decay=0.1)
        for optimizer in ("muon", "shampoo") for layers in (2, 4)
    ]


@pytest.fixture(scope="module")
def syncs() -> dict[tuple[int, str, int], list[list[str]]]:
    """(tp_size, optimizer, layers) -> per rank, the reads of each step."""
    out = {}
    for tp_size in (1, 2):
        runs = _runs(tp_size)
        per_rank = launch(train_tiny_gpts, LaunchConfig(world_size=2, timeout_s=LAUNCH_TIMEOUT_S), runs)
        for i, run in enumerate(runs):
            out[(tp_size, run.optimizer, run.num_layers)] = [rank[i]["host_syncs"] for rank in per_rank]
    return out


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("optimizer", ["muon", "shampoo"])
def test_a_step_reads_a_constant_few_values(syncs, tp_size: int, optimizer: str) -> None:
    small, large = syncs[(tp_size, optimizer, 2)], syncs[(tp_size, optimizer, 4)]
    for rank, (few, more) in enumerate(zip(small, large)):
        assert [len(step) for step in few] == [len(step) for step in more], (rank, few, more)
        for step in few:
            assert 0 < len(step) <= MAX_SYNCS_PER_STEP, f"rank {rank}: {step}"
