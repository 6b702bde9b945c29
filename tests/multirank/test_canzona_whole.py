"""The whole layout at DP sizes and TP x DP shapes the other tests do not reach.

Every matrix lies whole in one DP rank's shard and shards have the sizes the plan gives them
(uneven reduce-scatter and all-gather through ``canzona_patches/integration/uneven.py``). Small buckets
make the shards unequal, leave some empty and put a matrix larger than a bucket in one
(checked). Muon, Shampoo and SOAP at DP 3, TP 2 x DP 2 and DP 3 x TP 2 must end with the
parameters of one device, within ``test_canzona_tp.py``'s bounds (the same reorderings of
fp32 sums, and no others). Overlapped and blocking bucket collectives run the same layout
bitwise, through a clipped step and a skipped (NaN) step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron.canzona.planning import CanzonaPlan, plan_schedule
from megatron.canzona.runtime import LaunchConfig, launch

from .test_canzona_tp import ELEMENTWISE_ATOL, MATRIX_ATOL, MEAN_ATOL, SPLITS
from canzona_patches.harness.tiny_gpt import TinyRun, train_tiny_gpts
from . import CPU_RANKS

pytestmark = CPU_RANKS

LR = 2e-3
STEPS = 4
BUCKET = 10_000
"""Six buckets of the tiny GPT; fc1 (16384 elements) is larger than one."""
GLOBAL_BATCH = 12  # divisible by DP 1, 2 and 3 with micro-batches of 2
OPTIMIZERS = ("muon", "shampoo", "soap")
SHAPES = {3: ((1, "dp3"),), 4: ((2, "tp2_dp2"),), 6: ((2, "dp3_tp2"),)}
"""World size -> (TP size, case) launched there."""
# DP 3 sums gradients in an order no other test uses. Measured worst differences from one
# device after 4 steps, the same for the whole and the lean layout (the layout plays no
# part): one embedding element (row 2) whose first AdamW step is sign-like, 1.2e-2 lr at DP 3
# and 1.5e-2 lr at DP 3 x TP 2 (test_canzona_tp.py allows 1e-2 lr at DP 2 and 4), and SOAP's
# last loss 1.5e-5 relative. SOAP (its matrices' rounding amplified by the eigenbasis, see
# test_canzona_dp.py) changes later gradients enough to flip one AdamW embedding element's
# sign-like step: element (65, 22) moves by 1.36 lr at DP 3, 1.28 lr at TP 2 x DP 2 and 1.35
# lr at DP 3 x TP 2, alone of 8192; and a few elements of layer 0's linear_proj by up to 0.69
# lr (0.60 lr at DP 3), its mean by 0.095 lr (0.073 lr at DP 3). The layout plays no part
# there: the lean layout, with these buckets or with one bucket, differs from one device by
# the same 0.60 lr (mean 0.073 lr) at DP 3. A lost or doubled update moves a whole tensor by
# ~lr; for SOAP the mean bound is what catches one.
ELEMENTWISE_BOUND = {opt: max(atol, 0.05 * LR) for opt, atol in ELEMENTWISE_ATOL.items()} | {"soap": 2 * LR}
MATRIX_BOUND = MATRIX_ATOL | {"soap": 1.0 * LR}
MEAN_BOUND = MEAN_ATOL | {"soap": 0.15 * LR}
LOSS_RTOL = 5e-5
MATRIX_SUFFIXES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
LAUNCH_TIMEOUT_S = 300.0
TEST_TIMEOUT_S = 4 * LAUNCH_TIMEOUT_S


def _run(optimizer: str, tp_size: int = 1, **overrides) -> TinyRun:
    split_qkv, split_gate_up = SPLITS[optimizer]["split"]
    fields = dict(
        tp_size=tp_size, lr=LR, num_steps=STEPS, layout="canzona", optimizer=optimizer, weight_decay=0.1,
        global_batch=GLOBAL_BATCH, bucket_size=BUCKET, overlap_grad_reduce=True, canzona_layout="whole",
        split_qkv=split_qkv, split_gate_up=split_gate_up,
    )
    return TinyRun(**{**fields, **overrides})


def _overlap_pair() -> list[TinyRun]:
    """Muon over 5 steps, clipped (the norm is ~1 here) and with a NaN at step 2, with the
    bucket collectives overlapped (reduce-scatters with backward, all-gathers with the next
    forward) and blocking."""
    run = _run("muon", num_steps=5, clip_grad=0.05, nan_grad_at_step=2, return_state=True, overlap_param_gather=True)
    return [run, replace(run, overlap_grad_reduce=False, overlap_param_gather=False)]


def _early_runs() -> list[TinyRun]:
    """At TP 2 x DP 2 (gathers to TP hosts): Muon over 5 steps, clipped and with a NaN at step
    2, the host-group gathers issued as buckets finish reducing (gloo's default), as their
    reduce-scatters are dispatched in backward (CUDA's), and in the step."""
    run = _run("muon", tp_size=2, num_steps=5, clip_grad=0.05, nan_grad_at_step=2, return_state=True)
    return [run, replace(run, early_gather_at_dispatch=True), replace(run, early_gather=False)]


def _launch(world_size: int, runs: list[TinyRun]) -> list[list[dict]]:
    per_rank = launch(train_tiny_gpts, LaunchConfig(world_size=world_size, timeout_s=LAUNCH_TIMEOUT_S), runs)
    return [[rank[i] for rank in per_rank] for i in range(len(runs))]


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str], list[dict]]:
    """(optimizer or "overlap_on"/"overlap_off", case) -> per-rank results; one launch per world size."""
    out = {}
    single = [_run(o) for o in OPTIMIZERS] + [_run("muon", muon_ns_dtype="bfloat16")]
    for name, per_rank in zip([*OPTIMIZERS, "muon_bf16"], _launch(1, single)):
        out[(name, "dp1")] = per_rank
    for world_size, shapes in SHAPES.items():
        runs = [_run(o, tp) for tp, _ in shapes for o in OPTIMIZERS]
        names = [(o, case) for _, case in shapes for o in OPTIMIZERS]
        if world_size == 3:
            runs += _overlap_pair()
            names += [("overlap_on", "dp3"), ("overlap_off", "dp3")]
        if world_size == 4:
            runs += _early_runs() + [_run("muon", 2, muon_ns_dtype="bfloat16")]
            names += [("early_on", "tp2dp2"), ("early_dispatch", "tp2dp2"), ("early_off", "tp2dp2"),
                      ("muon_bf16", "tp2_dp2")]
        for name, per_rank in zip(names, _launch(world_size, runs)):
            out[name] = per_rank
    return out


CASES = [(o, case) for shapes in SHAPES.values() for _, case in shapes for o in OPTIMIZERS]


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize(("optimizer", "case"), CASES)
def test_whole_layout_equals_single_process(results, optimizer: str, case: str) -> None:
    (reference,) = results[(optimizer, "dp1")]
    for rank, result in enumerate(results[(optimizer, case)]):
        assert result["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL)
        for name, expected in reference["params"].items():
            matrix = name.endswith(MATRIX_SUFFIXES)
            got = result["params"][name]
            atol = (MATRIX_BOUND if matrix else ELEMENTWISE_BOUND)[optimizer]
            torch.testing.assert_close(got, expected, rtol=0, atol=atol,
                                       msg=lambda m: f"{optimizer} {case} rank {rank} {name}: {m}")
            assert (got - expected).abs().mean().item() <= MEAN_BOUND[optimizer], (case, rank, name)


BF16_LOSS_RTOL = 5e-5
BF16_MATRIX_BOUND = 0.5 * LR
"""Newton-Schulz in bf16 (Megatron's default precision): measured after 4 steps at TP 2 x DP 2
against one device, losses 7.7e-6 relative and matrices 3.1e-4 = 0.16 lr apart (mean 4.7e-5;
fp32: 9.8e-8 and 9.3e-8). A different reduce order flips bf16 roundings inside the
iteration, and Newton-Schulz carries them into whole rows of the update; a lost or doubled
update would still move a matrix by about lr."""


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_bf16_newton_schulz_agrees_in_loss_and_within_its_rounding(results) -> None:
    """The exactness table's Muon figures are fp32 Newton-Schulz; with bf16 (docs/exactness.md)
    the losses still agree, the weights to bf16's rounding of the updates. The whole matrices'
    directions went back to their holders in bf16 (``runtime.optimizer.narrow_updates``): the
    step's scatter moved less than its fp32 gather, by half of the unsplit matrices' share."""
    (reference,) = results[("muon_bf16", "dp1")]
    per_rank = results[("muon_bf16", "tp2_dp2")]
    for rank, result in enumerate(per_rank):
        assert result["losses"] == pytest.approx(reference["losses"], rel=BF16_LOSS_RTOL)
        worst = max(float((result["params"][name] - value).abs().max()) for name, value in reference["params"].items()
                    if name.endswith(MATRIX_SUFFIXES))
        assert worst <= BF16_MATRIX_BOUND, (rank, worst)
    plan = CanzonaPlan.from_json(per_rank[0]["plan"])
    gathered = scattered = 0  # fp32 pieces to their hosts; back in bf16, each rounded up to 4 bytes
    for task in plan_schedule(plan).tasks:
        narrow = not task.name.endswith("linear_qkv.weight")  # QKV is split in three, each with its own scale
        for holder, lo, hi in task.holders(plan.tp_size):
            if holder != task.host:
                gathered += 4 * (hi - lo)
                scattered += -(-2 * (hi - lo) // 4) * 4 if narrow else 4 * (hi - lo)
    sent = sum(result["tp_stats"]["bytes_sent"] for result in per_rank)
    assert scattered < gathered and sent == gathered + scattered, (sent, gathered, scattered)


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("case", [case for shapes in SHAPES.values() for _, case in shapes])
def test_shards_are_uneven_whole_and_some_empty(results, case: str) -> None:
    per_rank = results[("muon", case)]
    plan = CanzonaPlan.from_json(per_rank[0]["plan"])
    assert plan.layout == "whole"
    buckets = [b for layout in plan.layouts for b in layout.matrix.buckets]
    sizes = [b - a for bucket in buckets for a, b in zip(bucket.shard_bounds, bucket.shard_bounds[1:])]
    assert len(set(sizes)) > 2 and 0 in sizes, sizes
    assert all(p.host is not None for layout in plan.layouts for p in layout.matrix.placements)
    if plan.tp_size == 1:  # fc1 larger than a bucket (at TP 2 its shard is 8192 elements)
        assert any(p.end - p.start > BUCKET for layout in plan.layouts for p in layout.matrix.placements)
    assert all(result["whole_params_owned"] for result in per_rank)
    updated = sorted(name for result in per_rank for name in result["updated"])
    assert len(updated) == len(set(updated)) > 0, "a matrix was computed twice"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_overlapped_collectives_are_bitwise_the_blocking_ones(results) -> None:
    for on, off in zip(results[("overlap_on", "dp3")], results[("overlap_off", "dp3")]):
        _assert_bitwise_with_skip_and_clip(on, off)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_parameter_all_gathers_are_chained_in_forward_order(results) -> None:
    """The matrices' buffer and the elementwise one are chained as forward first uses their
    bucket groups (Megatron chains one buffer after the other), every group once; the test
    above shows the parameters bitwise those of the blocking all-gathers."""
    for rank in results[("overlap_on", "dp3")]:
        chain = rank["param_gather_chain"]
        assert len(chain) >= 3 and chain == sorted(chain), chain


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_gathers_issued_as_buckets_reduce_are_bitwise_the_steps_own(results) -> None:
    """The hosts scale what was gathered before the step (clip factor) as the holders did,
    and a skipped step drops it: parameters and state equal the run gathering in the step."""
    for on, dispatch, off in zip(*(results[(name, "tp2dp2")] for name in ("early_on", "early_dispatch", "early_off"))):
        assert on["early_gathers"] > 0 and on["early_gathers_at_dispatch"] == 0 and off["early_gathers"] is None
        assert dispatch["early_gathers_at_dispatch"] == dispatch["early_gathers"] == on["early_gathers"]
        _assert_bitwise_with_skip_and_clip(on, off)
        _assert_bitwise_with_skip_and_clip(dispatch, off)


def _assert_bitwise_with_skip_and_clip(on: dict, off: dict, skipped: tuple[int, ...] = (2,), clip: float = 0.05) -> None:
    """Two runs of one rank, the NaN step skipped and the clip acting in both, bit for bit."""
    assert on["skipped_steps"] == off["skipped_steps"] == list(skipped)
    assert _same(on["losses"], off["losses"]) and _same(on["grad_norms"], off["grad_norms"])
    assert all(norm > clip for norm in on["grad_norms"] if norm == norm), "the clip must act"
    for name, expected in off["params"].items():
        assert torch.equal(on["params"][name], expected), name
    assert on["state"].keys() == off["state"].keys() and on["state"]
    for path, expected in off["state"].items():
        assert torch.equal(on["state"][path], expected), path


def _same(a: list[float], b: list[float]) -> bool:
    """Equal lists, NaN (the skipped step's) equal to NaN."""
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))
