"""Context parallelism under --canzona through pretrain_gpt.py: CP 2 x DP 2 and CP 2 x TP 2
(4 gloo ranks, the CPU context-parallel attention of canzona_patches/emulation) against one
process at the same global batch, for Muon, Shampoo and SOAP, in the whole and the lean layout.

Every optimizer runs in every layout in both configurations: twelve 4-rank runs and three
one-process references. What is compared:
the loss of every iteration and every parameter after the last one (read whole from each
run's torch_dist checkpoint, however it was sharded). Every run initializes on the CPU
(``--use-cpu-initialization``): Megatron then draws each weight whole from one seed and cuts
it, so TP 2 starts from the one-process weights (otherwise each TP rank draws its own slice).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from .support import ROOT, DemoData, launch_ranks
from .test_pretrain_gpt import QWEN3_TINY, RUN_TIMEOUT_S, read_metrics

pytestmark = pytest.mark.slow

ITERS = 6
LR = 3e-3
# Newton-Schulz in fp32 (--muon-fp32-matmul-prec high), as the exactness tests run it: in bf16
# the runs agree in their losses but not in the last digits of their weights. CP reorders the
# attention's sums and the DP x CP reductions; each optimizer normalises its update, so an
# element moves by about lr per step and a lost or doubled update moves a whole tensor by ~lr.
# Measured (`pytest -s` prints each run's "[cp]" line; Muon against one process after 6 steps):
# matrices 5e-8, AdamW parameters 1.2e-7, losses 1.6e-7 relative. Shampoo and SOAP run with
# MATRIX_FLAGS; their spread was measured on this machine (AMD EPYC, AVX-512, MKL) as it is and
# with MKL_CBWR=COMPATIBLE, MKL_CBWR=AVX2, ATEN_CPU_CAPABILITY=default and ATEN_CPU_CAPABILITY=avx2
# set for the whole pytest run (the "[cp-share]" line gives each bound's share). Shampoo stays
# within Muon's bounds: matrices 6.7e-5 lr at most, AdamW parameters 2e-4 lr, means 9e-6 lr, losses 1.5e-7 relative.
# SOAP's Adam in an eigenbasis amplifies the reorderings in every setting alike: matrices up to
# 3.1 lr apart (mean 0.28 lr), AdamW parameters 2.9 lr (an embedding element whose sign-like
# first Adam steps flip; mean 0.07 lr), losses 1.7e-4 relative. An Adam step moves an element
# by about lr, so two runs part by at most ~2 lr per step: SOAP's largest differences are held
# to ITERS * lr (half that worst case, about twice the measured), its means to 0.6 lr and its
# losses to 3.5e-4, about twice the measured. On the same gradients SOAP's distributed step is
# the one-device math to a few ulp (tests/multirank/test_replay_exactness.py).
MATRIX_ATOL = {"muon": 1e-3 * LR, "shampoo": 1e-3 * LR, "soap": ITERS * LR}
ELEMENTWISE_ATOL = {"muon": 0.01 * LR, "shampoo": 0.01 * LR, "soap": ITERS * LR}
MEAN_ATOL = {"muon": 1e-4 * LR, "shampoo": 1e-4 * LR, "soap": 0.6 * LR}
LOSS_RTOL = {"muon": 1e-5, "shampoo": 1e-5, "soap": 3.5e-4}
FIRST_LOSS_RTOL = 1e-6
"""The first iteration's loss, every optimizer (measured 8e-8)."""
MATRIX_FLAGS = {
    "muon": (),
    "shampoo": ("--shampoo-precondition-frequency", "2", "--shampoo-root-dtype", "float64", "--shampoo-epsilon", "1e-4",
                "--shampoo-eps-mode", "relative"),
    "soap": ("--soap-precondition-frequency", "2", "--soap-eigh-dtype", "float64", "--soap-max-precond-dim", "64",
             "--soap-eps", "1e-4", "--canzona-no-stagger-refresh"),
}
"""Shampoo and SOAP as the multi-rank exactness tests run them (canzona_patches/harness/tiny_gpt.py's
``canzona_config``): fp64 roots and eigenbases, an eps that dominates rounding, SOAP rotating only
sides <= 64. With the defaults (fp32 roots, eps 1e-12) the 6-step runs lose every digit to the
reorderings: SOAP's matrices end up to 137 lr apart at CP 2 x DP 2, Shampoo's 1.6 lr."""
OPTIMIZER_FLAGS = {"normuon": ("adaptive_muon", "--adaptive-muon-moment2-method", "normuon")}
"""Names that stand for more than --optimizer: NorMuon keeps a second moment per row or column of
each whole matrix beside the momentum."""
MATRICES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
"""Checkpoint keys of the matrix optimizer's parameters (the rest is AdamW's)."""
CP_DP = ["--context-parallel-size", "2"]
CP_TP = ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"]
RUNS = {f"cp2_{config}_{optimizer}_{layout}": (optimizer, layout, extra)
        for config, extra in (("dp2", CP_DP), ("tp2", CP_TP))
        for optimizer in ("muon", "shampoo", "soap") for layout in ("whole", "lean")}


def _convert_hf():
    """tools/convert_hf.py, whose reader takes a torch_dist checkpoint's tensors whole."""
    if "convert_hf" not in sys.modules:
        spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "tools" / "convert_hf.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["convert_hf"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["convert_hf"]


def cp_args(data: DemoData, out: Path, optimizer: str, *extra: str) -> list[str]:
    """6 iterations of the tiny Qwen3 at global batch 8 (micro batch 2), no dropout, a loss
    every iteration, a checkpoint at the end."""
    return [
        *QWEN3_TINY, "--attention-dropout", "0", "--hidden-dropout", "0",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS),
        "--lr", str(LR), "--min-lr", str(LR / 10), "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1", "--eval-interval", str(ITERS),
        "--eval-iters", "0",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(data.tokenizer_model),
        "--data-path", data.data_prefix, "--split", "80,10,10", "--data-cache-path", str(out / "cache"),
        "--num-workers", "0", "--canzona-metrics-file", str(out / "metrics.jsonl"),
        "--optimizer", optimizer, "--canzona", "--use-distributed-optimizer", "--muon-fp32-matmul-prec", "high",
        "--use-cpu-initialization", *MATRIX_FLAGS.get(optimizer, ()),
        "--save", str(out / "ckpt"), "--save-interval", str(ITERS), *extra,
    ]


def run(data: DemoData, out: Path, nproc: int, optimizer: str, *extra: str) -> tuple[list[float], dict]:
    result = launch_ranks(nproc, "pretrain_gpt.py", *cp_args(data, out, optimizer, *extra), timeout_s=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-6000:]
    losses = [m["lm_loss"] for m in read_metrics(out / "metrics.jsonl")]
    return losses, result.stdout


def parameters(ckpt: Path) -> dict[str, torch.Tensor]:
    convert = _convert_hf()
    path = ckpt / f"iter_{ITERS:07d}"
    return {key: convert.read_tensor(path, key, meta) for key, meta in convert.model_tensors(path).items()}


def differences(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Per tensor: the largest and the mean absolute difference."""
    out = {}
    for key, value in params.items():
        diff = (value.double() - ref[key].double()).abs()
        out[key] = (diff.max().item(), diff.mean().item())
    return out


def report(name: str, losses: list[float], ref_losses: list[float], diffs: dict[str, tuple[float, float]]) -> None:
    """The measured differences (``pytest -s`` prints them; docs/context_parallel.md quotes them)."""
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    first = abs(losses[0] - ref_losses[0]) / abs(ref_losses[0])
    matrices = max((top for key, (top, _) in diffs.items() if key.endswith(MATRICES) or "experts" in key), default=0.0)
    others = max((top for key, (top, _) in diffs.items() if not (key.endswith(MATRICES) or "experts" in key)),
                 default=0.0)
    print(f"\n[cp] {name}: losses {rel:.2g} relative at most (first {first:.2g}), matrices {matrices:.2g}, "
          f"AdamW parameters {others:.2g}", flush=True)


@pytest.fixture(scope="module")
def references(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[float], dict]]:
    """One process per optimizer: the losses and the parameters every CP run must match, each
    run when a test first asks for it (a selection of the tests runs only the ones it needs)."""

    class OneProcess(dict):
        def __missing__(self, optimizer: str) -> tuple[list[float], dict]:
            where = tmp_path_factory.mktemp(f"one_{optimizer}")
            losses, _ = run(demo_data, where, 1, *OPTIMIZER_FLAGS.get(optimizer, (optimizer,)))
            self[optimizer] = (losses, parameters(where / "ckpt"))
            return self[optimizer]

    return OneProcess()


QUICK_RUN = "cp2_dp2_muon_whole"
"""The run of the quick suite (``make test``): CP's path, one reference."""


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.quick) if name == QUICK_RUN else name
                                  for name in RUNS])
def test_context_parallel_matches_one_process(name: str, demo_data: DemoData, tmp_path: Path, references) -> None:
    optimizer, layout, extra = RUNS[name]
    losses, stdout = run(demo_data, tmp_path, 4, optimizer, "--canzona-layout", layout, *extra)
    assert len(losses) == ITERS, losses
    tp = 2 if "--tensor-model-parallel-size" in extra else 1
    dp = 4 // (2 * tp)
    assert re.search(rf"\[canzona\] plan: {layout} layout, \d+ matrices over DP {dp} x CP 2 x TP {tp},", stdout), \
        stdout[-4000:]
    ref_losses, ref_params = references[optimizer]
    params = parameters(tmp_path / "ckpt")
    assert set(params) == set(ref_params)
    ref = torch.tensor(ref_losses, dtype=torch.float64)
    loss_bound = LOSS_RTOL[optimizer] * ref.abs().max().item()
    bound = {key: (MATRIX_ATOL[optimizer] if key.endswith(MATRICES) else ELEMENTWISE_ATOL[optimizer],
                   MEAN_ATOL[optimizer]) for key in params}
    diffs = differences(params, ref_params)
    report(name, losses, ref_losses, diffs)
    loss_diff = (torch.tensor(losses, dtype=torch.float64) - ref).abs()
    print(f"[cp-share] {name}: " + json.dumps({
        "loss": [loss_diff.max().item(), loss_bound],
        "tensors": {key: [top, mean, *bound[key]] for key, (top, mean) in diffs.items()}}), flush=True)
    # Iteration 1 is the forward and backward of the same weights: CP's attention alone.
    assert loss_diff[0] <= FIRST_LOSS_RTOL * ref[0], f"{name}: first loss {losses[0]} against {ref_losses[0]}"
    assert loss_diff.max() <= loss_bound, f"{name}: losses {losses} against {ref_losses}, allowed {loss_bound:.3g}"
    for key, (top, mean) in diffs.items():
        assert top <= bound[key][0], f"{name}: {key} differs by up to {top:.3g} (allowed {bound[key][0]:.3g})"
        assert mean <= bound[key][1], f"{name}: {key} differs by {mean:.3g} on average ({bound[key][1]:.3g})"


MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
       "--moe-router-score-function", "softmax", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-aux-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2",
       "--expert-tensor-parallel-size", "1"]
"""Every layer a mixture of 4 experts (top 2), split over EP 2."""


def test_moe_at_cp2_ep2_matches_the_same_experts_without_cp(demo_data: DemoData, tmp_path: Path) -> None:
    """CP 2 x EP 2 (4 ranks, DP 2) against DP 4 x EP 2 without CP, Muon: one process cannot be
    the reference here, as each EP rank draws its own experts' initial weights. Megatron's
    expert-data-parallel group folds CP in (world / (EP x expert TP)), and Canzona plans the
    expert buffers over it."""
    losses, stdout = run(demo_data, tmp_path / "cp", 4, "muon", "--canzona-layout", "whole", *MOE, *CP_DP)
    assert "[canzona] experts:" in stdout and "over DP 2 x CP 2 x TP 1," in stdout, stdout[-4000:]
    ref_losses, _ = run(demo_data, tmp_path / "dp", 4, "muon", "--canzona-layout", "whole", *MOE)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL["muon"], atol=0)
    params, ref_params = parameters(tmp_path / "cp" / "ckpt"), parameters(tmp_path / "dp" / "ckpt")
    assert set(params) == set(ref_params) and any("experts" in key for key in params)
    diffs = differences(params, ref_params)
    report("cp2_ep2_moe", losses, ref_losses, diffs)
    for key, (top, _) in diffs.items():
        bound = MATRIX_ATOL["muon"] if key.endswith(MATRICES) or "experts" in key else ELEMENTWISE_ATOL["muon"]
        assert top <= bound, f"{key} differs by up to {top:.3g} (allowed {bound:.3g})"


RESUMES = {"cp2_to_cp1": ("muon", CP_DP[:2], []), "cp1_to_cp2": ("muon", [], CP_DP[:2]),
           "cp2_to_cp1_normuon": ("normuon", CP_DP[:2], [])}


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_across_cp_sizes(name: str, demo_data: DemoData, tmp_path: Path, references) -> None:
    """Muon (and NorMuon, whose second moment reshards too) on 2 ranks, saved after iteration 3
    at one CP size (CP 2 or DP 2) and resumed at the other to iteration 6: the resumed losses and
    the final parameters match one process's uninterrupted run within Muon's CP bounds (the
    checkpoint reshards over DP x CP as over DP)."""
    optimizer, saved, resumed = RESUMES[name]
    flags = OPTIMIZER_FLAGS.get(optimizer, (optimizer,))
    first, _ = run(demo_data, tmp_path / "first", 2, *flags, "--canzona-layout", "whole", "--save-interval", "3",
                   *saved)
    second, stdout = run(demo_data, tmp_path / "second", 2, *flags, "--canzona-layout", "whole",
                         "--load", str(tmp_path / "first" / "ckpt"), "--ckpt-step", "3", *resumed)
    assert "loading" in stdout.lower() and len(first) == ITERS and len(second) == ITERS - 3, stdout[-4000:]
    ref_losses, ref_params = references[optimizer]
    torch.testing.assert_close(torch.tensor(second), torch.tensor(ref_losses[3:]), rtol=LOSS_RTOL["muon"], atol=0)
    diffs = differences(parameters(tmp_path / "second" / "ckpt"), ref_params)
    report(f"resume {name}", second, ref_losses[3:], diffs)
    for key, (top, _) in diffs.items():
        bound = MATRIX_ATOL["muon"] if key.endswith(MATRICES) else ELEMENTWISE_ATOL["muon"]
        assert top <= bound, f"{key} differs by up to {top:.3g} (allowed {bound:.3g})"
