"""AdaMuon and NorMuon under ``--canzona`` (``--optimizer adaptive_muon``) against one process.

Each matrix's host keeps its momentum and its second moment (elementwise for AdaMuon, one per
row or column for NorMuon) at full size, and runs the single-device math on the whole matrix
(``megatron/canzona/optim/adaptive_muon.py``, bitwise emerging-optimizers' ``AdaptiveMuon``:
``tests/unit/test_optim_emerging.py``). Against one process on the same global batches, with
Q, K and V optimized apart and the clip acting:

* TP 2 x DP 2 (whole layout) and EP 2 x DP 2 (four experts a layer) end within the Muon
  tolerance of ``test_canzona_dp.py``, 1e-3 * lr, for NorMuon; AdaMuon's elementwise division
  makes it sensitive to the last bits of the reordered sums, and its bound is measured (:data:`ATOL`);
* early compute (forced, its gathers at the reduce-scatters' dispatch, a staging copy of both
  moments) is bitwise the step's own through committed steps, a NaN step and a step whose clip
  acts, at TP 2 x DP 2;
* a checkpoint saved at DP 2 resumes bitwise at DP 2 and, at DP 4, within the reshard tolerance
  of ``test_checkpoint.py`` (NorMuon) or ten times it (AdaMuon, :data:`RESHARD_ATOL`); at TP 2 x DP 2
  within the TP bound above (:data:`ATOL`);
* a checkpoint saved at EP 2 x DP 2 (each expert matrix's moments with its host) resumes on one
  process (EP 1) within the EP bound above.

Three launches (2, 4, then 1 rank).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron.canzona.runtime import LaunchConfig, launch

from canzona_patches.harness.tiny_checkpoint import ResumeJob
from canzona_patches.harness.tiny_gpt import TinyRun
from . import CPU_RANKS
from .test_canzona_moe import _union, moe_jobs
from .test_early_compute import _bitwise

pytestmark = CPU_RANKS

LR = 2e-4
"""AdaMuon's first step is sign-like (``O / sqrt((1 - beta2) O^2)``): a small rate keeps the tiny
model's updates in the range Muon's tests train in."""
STEPS, HALF = 4, 2
METHODS = ("adamuon", "normuon")
ATOL = {"normuon": 1e-3 * LR, "adamuon": 4.0 * LR}
"""Matrices against one process. NorMuon keeps Muon's bound (measured: 3.7e-5 lr at TP 2 x DP 2,
5.6e-5 lr at EP 2 x DP 2). AdaMuon divides each element by its own root mean square: an element
whose orthogonalised momentum is near zero in every step so far moves by about +-(1 - beta2)^-1/2
times the scale, whatever its size, so the last bits that TP's and EP's reordered sums change in a
gradient can flip such an element's step; measured 0.049 lr at TP 2 x DP 2 and 0.46 lr at EP 2 x DP 2
(4 steps) on this machine's default BLAS path, 0.53 lr at TP 2 x DP 2 with ATEN_CPU_CAPABILITY=default
and 1.96 lr at EP 2 x DP 2 (one linear_proj element), where one step moves an element by up to
4.47 x sqrt(max(m, n)) lr, 36-84 lr on these shapes: the bound, twice the worst measured, is about a
tenth of one step's move, and a lost or doubled update still fails it."""
LOSS_RTOL = {"normuon": 1e-5, "adamuon": 1e-4}
"""Losses against one process. AdaMuon's flipped elements (above) move the last step's loss: at EP 2 x
DP 2 by 3.4e-5 relative with MKL_CBWR=COMPATIBLE (within 1e-5 on this machine's default BLAS path);
bounded at three times that. NorMuon keeps 1e-5."""
ELEMENTWISE_ATOL = {"normuon": 0.05 * LR, "adamuon": 5.0 * LR}
"""AdamW's parameters (embedding, output layer, norms) at TP 2 and EP 2, the whole layout's bound at
DP 3 (test_canzona_whole.py): a few embedding elements whose early AdamW steps are near sign-like.
Measured 1.7e-3 lr at TP 2 x DP 2 and 4.8e-3 lr at EP 2 x DP 2 on this machine's default BLAS path;
with ATEN_CPU_CAPABILITY=default, 0.011 lr (TP 2 x DP 2, both methods) and 0.019 lr (EP 2 x DP 2,
AdaMuon), in units of this module's small lr. A lost or doubled update moves a tensor by ~lr. Beside
AdaMuon the AdamW parameters train on gradients that its flipped elements changed: at EP 2 x DP 2 with
MKL_CBWR=COMPATIBLE, 135 of the embedding's 8192 elements part by up to 2.3 lr (their early steps
near sign-like), as beside SOAP (test_canzona_whole.py allows 2 lr there); bounded at twice that."""
ADAMUON_FLIPPED = 0.03
"""Share of a matrix's elements that may lie beyond :data:`ATOL`. An AdaMuon element whose step is
sign-like can flip whole: at EP 2 x DP 2 with MKL_CBWR=COMPATIBLE, 51 of linear_proj's 4096 elements
(1.2%) part by up to 28 lr, one step's move; a lost or doubled update moves every element."""
ADAMUON_MEAN_ATOL = 2.0 * LR
"""AdaMuon matrices' mean difference (a lost update moves the mean by about one step, 36-84 lr here)."""
RESHARD_ATOL = {"normuon": 1e-3 * LR, "adamuon": 1e-2 * LR}
"""Saved at DP 2, resumed at DP 4, against the straight DP 2 run (measured: NorMuon 3.7e-5 lr,
AdaMuon 1.7e-3 lr, for the reason above)."""
MATRIX_SUFFIXES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
LAUNCH_TIMEOUT_S = 420.0
TEST_TIMEOUT_S = 3 * LAUNCH_TIMEOUT_S


def _run(method: str, **fields) -> TinyRun:
    return TinyRun(**{**dict(lr=LR, num_steps=STEPS, layout="canzona", optimizer=method, weight_decay=0.1, clip_grad=1.0,
                             split_qkv=True, canzona_layout="whole"), **fields})


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple, list[dict]]:
    """(method, case) -> per-rank results."""
    root = tmp_path_factory.mktemp("adaptive_checkpoints")
    two, four, one = [], [], []
    for m in METHODS:
        saved = _run(m, bucket_size=10_000)
        two += [((m, "straight"), saved), ((m, "saved"), ResumeJob(run=saved, save_dir=str(root / m), save_after=(HALF,))),
                ((m, "resumed_dp2"), ResumeJob(run=saved, load_dir=str(root / m)))]
        early = _run(m, tp_size=2, clip_grad=3.0, nan_grad_at_step=1, big_grad_at_step=STEPS - 1, return_state=True,
                     overlap_grad_reduce=True, bucket_size=10_000)
        moe = _run(m, num_experts=4, ep_size=2)
        four += [((m, "tp2_dp2"), _run(m, tp_size=2)), ((m, "ep2_dp2"), moe),
                 ((m, "ep_saved"), ResumeJob(run=moe, save_dir=str(root / f"{m}_ep"), save_after=(HALF,))),
                 ((m, "early"), replace(early, early_compute=True, early_gather_at_dispatch=True)), ((m, "step"), early),
                 ((m, "resumed_dp4"), ResumeJob(run=saved, load_dir=str(root / m))),
                 ((m, "resumed_tp2"), ResumeJob(run=replace(saved, tp_size=2), load_dir=str(root / m)))]
        if m == "normuon":  # Megatron's default expert TP, the TP size: TP 2 x EP 2 x expert TP 2
            four += [((m, "ep2_tp2_etp2"), replace(moe, tp_size=2, expert_tp_size=2))]
        one += [((m, "single"), _run(m)), ((m, "single_moe"), _run(m, num_experts=4)),
                ((m, "resumed_ep1"), ResumeJob(run=replace(moe, ep_size=1), load_dir=str(root / f"{m}_ep")))]
    out = {}
    for world, cases in ((2, two), (4, four), (1, one)):
        per_rank = launch(moe_jobs, LaunchConfig(world_size=world, timeout_s=LAUNCH_TIMEOUT_S), [j for _, j in cases])
        for i, (key, _) in enumerate(cases):
            out[key] = [rank[i] for rank in per_rank]
    return out


def _close(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], atol: float, where: str,
           elementwise_atol: float | None = None, method: str = "normuon") -> None:
    """Every matrix within ``atol`` (AdaMuon: all but :data:`ADAMUON_FLIPPED` of its elements, and
    its mean within :data:`ADAMUON_MEAN_ATOL`), every AdamW parameter within ``elementwise_atol``
    (default ``atol``);
    prints the worst differences in units of lr (``pytest -s``: docs/exactness.md's figures)."""
    assert ours.keys() == reference.keys(), where
    worst = {True: 0.0, False: 0.0}
    flipped = 0.0
    for name, expected in reference.items():
        matrix = name.endswith(MATRIX_SUFFIXES)
        diff = (ours[name] - expected).abs()
        worst[matrix] = max(worst[matrix], diff.max().item())
        if matrix and method == "adamuon":
            flipped = max(flipped, (diff > atol).double().mean().item())
            assert flipped <= ADAMUON_FLIPPED, f"{where} {name}: {flipped:.2%} of the elements beyond {atol / LR} lr"
            assert diff.mean().item() <= ADAMUON_MEAN_ATOL, f"{where} {name}: mean {diff.mean().item() / LR:.3g} lr"
            continue
        torch.testing.assert_close(ours[name], expected, rtol=0, atol=atol if matrix else elementwise_atol or atol,
                                   msg=lambda m: f"{where} {name}: {m}")
    print(f"[adaptive] {where}: worst matrix difference {worst[True] / LR:.1e} lr, AdamW {worst[False] / LR:.1e} lr, "
          f"matrix elements beyond the bound {flipped:.2%}")


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("case", "reference"), [("tp2_dp2", "single"), ("ep2_dp2", "single_moe")])
def test_distributed_equals_one_process(results, method: str, case: str, reference: str) -> None:
    (single,) = results[(method, reference)]
    per_rank = results[(method, case)]
    assert any(result["updated"] for result in per_rank)
    for rank, result in enumerate(per_rank):
        assert result["losses"] == pytest.approx(single["losses"], rel=LOSS_RTOL[method]), \
            f"{method} {case} rank {rank}"
    params = _union(per_rank) if case == "ep2_dp2" else per_rank[0]["params"]
    reference = single["params"]
    if method == "adamuon" and case == "ep2_dp2":
        # A reordered sum flips a router's top-2 choice for a token, and AdaMuon's sign-like steps turn
        # the expert's changed gradient into a changed update of much of the matrix: with
        # MKL_CBWR=COMPATIBLE 45% of one expert's fc1 elements part by more than 4 lr after 4 steps.
        # An expert's host runs the dense matrices' per-matrix step, which replayed gradients pin bitwise
        # at DP and TP (test_replay_exactness.py; it has no EP case). Here: the losses above and the
        # dense parameters.
        params = {name: value for name, value in params.items() if ".experts." not in name}
        reference = {name: value for name, value in reference.items() if ".experts." not in name}
    _close(params, reference, ATOL[method], f"{method} {case}", ELEMENTWISE_ATOL[method], method)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_normuon_at_expert_tp_2_equals_one_process(results) -> None:
    """NorMuon with each expert matrix TP-sharded over expert TP 2 and hosted over expert-DP 1 x
    expert-TP 2 (its per-row moment of the whole matrix on the host): the one-process MoE run's
    losses and parameters within the EP bounds."""
    (single,) = results[("normuon", "single_moe")]
    per_rank = results[("normuon", "ep2_tp2_etp2")]
    assert all(any(".experts." in name for name in result["updated"]) for result in per_rank)
    for rank, result in enumerate(per_rank):
        assert result["losses"] == pytest.approx(single["losses"], rel=LOSS_RTOL["normuon"]), f"rank {rank}"
    _close(_union(per_rank), single["params"], ATOL["normuon"], "normuon ep2_tp2_etp2", ELEMENTWISE_ATOL["normuon"])


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("method", METHODS)
def test_early_compute_is_bitwise_the_steps_own(results, method: str) -> None:
    for rank, (early, step) in enumerate(zip(results[(method, "early")], results[(method, "step")])):
        where = f"{method} rank {rank}"
        assert early["early_steps"] == [{"committed": 2, "skipped": 1, "recomputed": 1}], (where, early["early_steps"])
        assert any(path.endswith("moment2") for path in step["state"]), "the second moment is compared too"
        _bitwise(early, step, where)


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("method", METHODS)
def test_a_checkpoint_resumes_across_dp_sizes(results, method: str) -> None:
    (straight, *_) = results[(method, "straight")]
    for rank, result in enumerate(results[(method, "resumed_dp2")]):
        assert result["start"] == HALF and result["losses"] == straight["losses"][HALF:], f"rank {rank}"
        for name, expected in straight["params"].items():
            assert torch.equal(result["params"][name], expected), f"{method} DP 2 -> DP 2 rank {rank} {name}"
    for rank, result in enumerate(results[(method, "resumed_dp4")]):
        assert result["losses"] == pytest.approx(straight["losses"][HALF:], rel=1e-4)
        _close(result["params"], straight["params"], RESHARD_ATOL[method], f"{method} DP 2 -> DP 4 rank {rank}",
               ELEMENTWISE_ATOL[method])
    # Into TP 2 x DP 2: each matrix's host still holds both moments whole (NorMuon's per row or
    # column of the whole matrix); TP's reordered sums bound it as they bound TP 2 x DP 2 itself.
    for rank, result in enumerate(results[(method, "resumed_tp2")]):
        assert result["start"] == HALF, f"rank {rank}"
        assert result["losses"] == pytest.approx(straight["losses"][HALF:], rel=1e-4)
        _close(result["params"], straight["params"], ATOL[method], f"{method} DP 2 -> TP 2 x DP 2 rank {rank}",
               ELEMENTWISE_ATOL[method], method)


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("method", METHODS)
def test_a_checkpoint_resumes_across_ep_sizes(results, method: str) -> None:
    """Saved at EP 2 x DP 2 after step 2, resumed at EP 1 on one rank (every expert's momentum and
    second moment from the two EP hosts' shards): the straight EP 2 run's last losses and weights."""
    straight = results[(method, "ep2_dp2")]
    for result in results[(method, "ep_saved")]:  # saving changes nothing
        assert result["losses"] == straight[0]["losses"]
    (resumed,) = results[(method, "resumed_ep1")]
    assert resumed["start"] == HALF
    assert resumed["losses"] == pytest.approx(straight[0]["losses"][HALF:], rel=1e-4)
    _close(resumed["params"], _union(straight), ATOL[method], f"{method} EP 2 x DP 2 -> EP 1",
           ELEMENTWISE_ATOL[method], method)
