"""``optimizer.step()`` reads one value from the device, and forward-backward none.

Each host read (``Tensor.item``, ``tolist``, ``__bool__``, ``__float__``, ...) waits for every
queued kernel on CUDA. The tiny GPT takes Canzona steps at DP 2 with matrices split across
DP shards, and at TP 2, for Muon and Shampoo (whose step 1 refreshes its inverse roots), with
2 and with 4 layers: every step reads the same one value whatever the number of parameters --
the global gradient norm when clipping is on (it is also the inf/NaN check: one pass over the
gradients, not two), else the found-inf flag of Canzona's own check.

Forward-backward with the overlapped reduce-scatter and Canzona's early gathers issued at its
dispatch (during backward, as on CUDA) reads nothing: not more than Megatron's own layer-wise
Muon over the same model, which reads nothing either.
"""

from __future__ import annotations

import pytest

from megatron.canzona.runtime import LaunchConfig, launch

from canzona_patches.harness.tiny_gpt import TinyRun, train_tiny_gpts
from . import CPU_RANKS

pytestmark = CPU_RANKS

SYNCS_PER_STEP = 1
"""The global gradient norm (clipping on) or the found-inf flag (clipping off)."""
LAUNCH_TIMEOUT_S = 240.0
BACKWARD_RUNS = {
    "canzona": TinyRun(tp_size=2, num_steps=2, layout="canzona", optimizer="muon", num_layers=2, bucket_size=20_000,
                       count_syncs=True, overlap_grad_reduce=True, early_gather_at_dispatch=True, clip_grad=1.0),
    "megatron": TinyRun(tp_size=2, num_steps=2, layout="megatron", optimizer="megatron_muon", num_layers=2,
                        bucket_size=20_000, count_syncs=True, overlap_grad_reduce=True, clip_grad=1.0),
}
"""TP 2 with overlapped reduce-scatters: Canzona's early gathers (forced to dispatch time) and
Megatron's layer-wise Muon, for their forward-backward reads."""


def _runs(tp_size: int) -> list[TinyRun]:
    return [
        TinyRun(tp_size=tp_size, num_steps=3, layout="canzona", optimizer=optimizer, num_layers=layers,
                bucket_size=20_000, alpha=1.0, count_syncs=True, weight_decay=0.1, clip_grad=clip_grad)
        for optimizer in ("muon", "shampoo") for layers in (2, 4) for clip_grad in (0.0, 1.0)
    ]


@pytest.fixture(scope="module")
def syncs() -> dict[tuple, list[dict]]:
    """(tp_size, optimizer, layers, clip_grad) or a name of :data:`BACKWARD_RUNS` -> per rank, its result."""
    out = {}
    for tp_size in (1, 2):
        runs = _runs(tp_size) + (list(BACKWARD_RUNS.values()) if tp_size == 2 else [])
        per_rank = launch(train_tiny_gpts, LaunchConfig(world_size=2, timeout_s=LAUNCH_TIMEOUT_S), runs)
        keys = [(tp_size, r.optimizer, r.num_layers, r.clip_grad) for r in _runs(tp_size)]
        keys += list(BACKWARD_RUNS) if tp_size == 2 else []
        for i, key in enumerate(keys):
            out[key] = [rank[i] for rank in per_rank]
    return out


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("optimizer", ["muon", "shampoo"])
@pytest.mark.parametrize("clip_grad", [0.0, 1.0])
def test_a_step_reads_one_value(syncs, tp_size: int, optimizer: str, clip_grad: float) -> None:
    small, large = syncs[(tp_size, optimizer, 2, clip_grad)], syncs[(tp_size, optimizer, 4, clip_grad)]
    for rank, (few, more) in enumerate(zip(small, large)):
        assert few["host_syncs"] == more["host_syncs"], (rank, few["host_syncs"], more["host_syncs"])
        first, *later = few["host_syncs"]
        # Megatron asks its group once, in the first clipped step, whether a parameter has a
        # norm group of its own (MegatronOptimizer.has_grad_norm_group, cached afterwards)
        assert len(first) == SYNCS_PER_STEP + (clip_grad > 0), f"rank {rank}: {first}"
        for step in later:
            assert len(step) == SYNCS_PER_STEP, f"rank {rank}: {step}"


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)
def test_forward_backward_with_early_gathers_reads_nothing(syncs) -> None:
    canzona, megatron = syncs["canzona"], syncs["megatron"]
    assert all(rank["early_gathers_at_dispatch"] > 0 for rank in canzona)  # the hooks did run in backward
    for rank, (ours, theirs) in enumerate(zip(canzona, megatron)):
        assert len(ours["forward_backward_syncs"]) == 2
        assert ours["forward_backward_syncs"] == [[], []], f"rank {rank}: {ours['forward_backward_syncs']}"
        assert theirs["forward_backward_syncs"] == [[], []], f"rank {rank}: {theirs['forward_backward_syncs']}"
