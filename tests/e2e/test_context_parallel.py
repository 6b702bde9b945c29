"""Context parallelism under --canzona through pretrain_gpt.py: CP 2 x DP 2 and CP 2 x TP 2
(4 gloo ranks, the CPU context-parallel attention of canzona_patches/emulation) against one
process at the same global batch, for Muon, Shampoo and SOAP, in the whole and the lean layout.

Every optimizer runs in every layout in both configurations: twelve 4-rank runs, three
one-process references, and for Shampoo and SOAP one run without CP per world size (the
yardstick both layouts there are held to). What is compared:
the loss of every iteration and every parameter after the last one (read whole from each
run's torch_dist checkpoint, however it was sharded). Every run initializes on the CPU
(``--use-cpu-initialization``): Megatron then draws each weight whole from one seed and cuts
it, so TP 2 starts from the one-process weights (otherwise each TP rank draws its own slice).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from .support import ROOT, DemoData, run_with_deadline, torchrun
from .test_pretrain_gpt import QWEN3_TINY, RUN_TIMEOUT_S, read_metrics

pytestmark = pytest.mark.slow

ITERS = 6
LR = 3e-3
# Newton-Schulz in fp32 (--muon-fp32-matmul-prec high), as the exactness tests run it: in bf16
# the runs agree in their losses but not in the last digits of their weights. CP reorders the
# attention's sums and the DP x CP reductions; each optimizer normalises its update, so an
# element moves by about lr per step and a lost or doubled update moves a whole tensor by ~lr.
# Measured (`pytest -s` prints each run's "[cp]" line; Muon against one process after 6 steps):
# matrices 5e-8, AdamW parameters 1.2e-7, losses 1.6e-7 relative. SOAP's Adam in an eigenbasis
# amplifies rounding (tests/multirank/test_canzona_tp.py): its bounds are wider.
MATRIX_ATOL = {"muon": 1e-3 * LR, "shampoo": 1e-3 * LR, "soap": 0.5 * LR}
ELEMENTWISE_ATOL = {"muon": 0.01 * LR, "shampoo": 0.01 * LR, "soap": 0.25 * LR}
MEAN_ATOL = {"muon": 1e-4 * LR, "shampoo": 1e-4 * LR, "soap": 0.05 * LR}
LOSS_RTOL = {"muon": 1e-5, "shampoo": 1e-5, "soap": 1e-4}
YARDSTICK = ("shampoo", "soap")
"""Optimizers whose runs at 4 ranks already differ from one process beyond those bounds
without CP: Shampoo's inverse roots and SOAP's eigenbases amplify any reordered sum
(measured after 6 steps, largest relative loss difference from one process, without CP /
with: Shampoo at DP 4 5.8e-5 / 1.7e-4 at CP 2 x DP 2, SOAP 2.5e-3 / 1.8e-3; SOAP's matrices
0.21 / 0.35 apart). Each of their CP runs
is held against a run at the same world size without CP (DP 4, TP 2 x DP 2; its layout in
YARDSTICK_LAYOUT, one run bounding both layouts, as the amplification is the optimizer's): its
difference from one process may be at most REORDER_FACTOR times that run's, or the bound.
The first iteration, before any step, is held to FIRST_LOSS_RTOL for every optimizer."""
REORDER_FACTOR = 4.0
"""Over all iterations (the largest loss difference) and per tensor (largest and mean)."""
FIRST_LOSS_RTOL = 1e-6
"""The first iteration's loss, every optimizer (measured 8e-8)."""
MATRICES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
"""Checkpoint keys of the matrix optimizer's parameters (the rest is AdamW's)."""
CP_DP = ["--context-parallel-size", "2"]
CP_TP = ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"]
RUNS = {f"cp2_{config}_{optimizer}_{layout}": (optimizer, layout, extra)
        for config, extra in (("dp2", CP_DP), ("tp2", CP_TP))
        for optimizer in ("muon", "shampoo", "soap") for layout in ("whole", "lean")}
YARDSTICK_LAYOUT = {("shampoo", 1): "lean", ("soap", 1): "whole", ("shampoo", 2): "whole", ("soap", 2): "lean"}
"""(optimizer, TP size) -> the layout of its run without CP (the measurements quoted above)."""


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
        "--use-cpu-initialization",
        "--save", str(out / "ckpt"), "--save-interval", str(ITERS), *extra,
    ]


def run(data: DemoData, out: Path, nproc: int, optimizer: str, *extra: str) -> tuple[list[float], dict]:
    result = run_with_deadline(torchrun(nproc, "pretrain_gpt.py", *cp_args(data, out, optimizer, *extra)),
                               timeout_s=RUN_TIMEOUT_S)
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
    """One process per optimizer: the losses and the parameters every CP run must match."""
    out = {}
    for optimizer in ("muon", "shampoo", "soap"):
        where = tmp_path_factory.mktemp(f"one_{optimizer}")
        losses, _ = run(demo_data, where, 1, optimizer)
        out[optimizer] = (losses, parameters(where / "ckpt"))
    return out


@pytest.fixture(scope="module")
def yardsticks(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory):
    """``yardstick(optimizer, tp, ref_losses, ref_params)``: the losses and per-tensor differences from one process of
    its run without CP at 4 ranks, made once for both layouts."""
    made: dict[tuple[str, int], tuple[list[float], dict[str, tuple[float, float]]]] = {}

    def yardstick(optimizer: str, tp: int, ref_losses: list[float], ref_params: dict[str, torch.Tensor]):
        if (optimizer, tp) not in made:
            layout = YARDSTICK_LAYOUT[(optimizer, tp)]
            where = tmp_path_factory.mktemp(f"no_cp_{optimizer}_tp{tp}")
            losses, _ = run(demo_data, where, 4, optimizer, "--canzona-layout", layout,
                            *(["--tensor-model-parallel-size", "2"] if tp == 2 else []))
            made[(optimizer, tp)] = losses, differences(parameters(where / "ckpt"), ref_params)
            report(f"{optimizer} TP {tp} {layout} yardstick (no CP)", losses, ref_losses, made[(optimizer, tp)][1])
        return made[(optimizer, tp)]

    return yardstick


@pytest.mark.parametrize("name", list(RUNS))
def test_context_parallel_matches_one_process(name: str, demo_data: DemoData, tmp_path: Path, references,
                                              yardsticks) -> None:
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
    if optimizer in YARDSTICK:  # the same world size without CP
        yard_losses, yard = yardsticks(optimizer, tp, ref_losses, ref_params)
        yard_diff = (torch.tensor(yard_losses, dtype=torch.float64) - ref).abs().max().item()
        loss_bound = max(loss_bound, REORDER_FACTOR * yard_diff)
        bound = {key: (max(top, REORDER_FACTOR * yard[key][0]), max(mean, REORDER_FACTOR * yard[key][1]))
                 for key, (top, mean) in bound.items()}
    diffs = differences(params, ref_params)
    report(name, losses, ref_losses, diffs)
    loss_diff = (torch.tensor(losses, dtype=torch.float64) - ref).abs()
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


@pytest.mark.parametrize(("saved", "resumed"), [(CP_DP[:2], []), ([], CP_DP[:2])], ids=["cp2_to_cp1", "cp1_to_cp2"])
def test_resume_across_cp_sizes(saved: list[str], resumed: list[str], demo_data: DemoData, tmp_path: Path,
                                references) -> None:
    """Muon on 2 ranks, saved after iteration 3 at one CP size (CP 2 or DP 2) and resumed at the
    other to iteration 6: the resumed losses and the final parameters match one process's
    uninterrupted run within the CP bounds (the checkpoint reshards over DP x CP as over DP)."""
    first, _ = run(demo_data, tmp_path / "first", 2, "muon", "--canzona-layout", "whole", "--save-interval", "3",
                   *saved)
    second, stdout = run(demo_data, tmp_path / "second", 2, "muon", "--canzona-layout", "whole",
                         "--load", str(tmp_path / "first" / "ckpt"), "--ckpt-step", "3", *resumed)
    assert "loading" in stdout.lower() and len(first) == ITERS and len(second) == ITERS - 3, stdout[-4000:]
    ref_losses, ref_params = references["muon"]
    torch.testing.assert_close(torch.tensor(second), torch.tensor(ref_losses[3:]), rtol=LOSS_RTOL["muon"], atol=0)
    diffs = differences(parameters(tmp_path / "second" / "ckpt"), ref_params)
    report(f"resume {'cp2 -> cp1' if saved else 'cp1 -> cp2'}", second, ref_losses[3:], diffs)
    for key, (top, _) in diffs.items():
        bound = MATRIX_ATOL["muon"] if key.endswith(MATRICES) else ELEMENTWISE_ATOL["muon"]
        assert top <= bound, f"{key} differs by up to {top:.3g} (allowed {bound:.3g})"
