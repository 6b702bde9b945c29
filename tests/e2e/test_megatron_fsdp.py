"""Megatron-Core's own Megatron-FSDP trains on CPU with gloo through ``pretrain_gpt.py``, as
Megatron has it (``--use-megatron-fsdp --ckpt-format fsdp_dtensor --optimizer adam``), in each of
its three sharding strategies, at DP 2, DP 4 and TP 2 x DP 2; its losses and gradient norms are
the ``--use-distributed-optimizer`` run's (``canzona_patches/emulation/fsdp.py``).

Measured: every logged loss and gradient norm agrees within 8.6e-8 relative (fp32 sums in another
order); the bound is 1e-6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .support import DemoData, launch_ranks
from .test_pretrain_gpt import QWEN3_TINY

pytestmark = pytest.mark.slow

ITERS = 4
RUN_TIMEOUT_S = 240
REL = 1e-6
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
FSDP = ("--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor")
LAYOUTS = {"dp2": (2, ()), "dp4": (4, ()), "tp2_dp2": (4, ("--tensor-model-parallel-size", "2", "--sequence-parallel"))}


def _args(data: DemoData, out: Path, *extra: str) -> list[str]:
    return [*QWEN3_TINY, "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS),
            "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1", "--eval-interval", "1000",
            "--eval-iters", "0", "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", str(data.tokenizer_model), "--data-path", data.data_prefix, "--split", "80,10,10",
            "--data-cache-path", str(out / "cache"), "--num-workers", "0", "--optimizer", "adam",
            "--overlap-grad-reduce", "--overlap-param-gather", "--canzona-metrics-file", str(out / "metrics.jsonl"),
            *extra]


def _train(data: DemoData, out: Path, nproc: int, *extra: str) -> dict:
    result = launch_ranks(nproc, "pretrain_gpt.py", *_args(data, out, *extra), timeout_s=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-6000:]
    metrics = {m["iteration"]: m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    return {"metrics": metrics, "stdout": result.stdout}


@pytest.fixture(scope="module")
def runs(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per layout, the distributed optimizer's run and Megatron-FSDP's (every strategy at DP 2,
    optim_grads_params at DP 4 and TP 2 x DP 2)."""
    root = tmp_path_factory.mktemp("megatron_fsdp")
    out = {}
    for layout, (nproc, extra) in LAYOUTS.items():
        out[layout, "distopt"] = _train(demo_data, root / layout / "distopt", nproc, *extra, "--use-distributed-optimizer")
        for strategy in STRATEGIES if layout == "dp2" else ("optim_grads_params",):
            out[layout, strategy] = _train(demo_data, root / layout / strategy, nproc, *extra, *FSDP,
                                           "--data-parallel-sharding-strategy", strategy)
    return out


CASES = [("dp2", s) for s in STRATEGIES] + [("dp4", "optim_grads_params"), ("tp2_dp2", "optim_grads_params")]


@pytest.mark.parametrize(("layout", "strategy"), CASES, ids=[f"{layout}-{s}" for layout, s in CASES])
def test_megatron_fsdp_trains_as_the_distributed_optimizer(runs: dict, layout: str, strategy: str) -> None:
    fsdp, reference = runs[layout, strategy]["metrics"], runs[layout, "distopt"]["metrics"]
    assert sorted(fsdp) == sorted(reference) == list(range(1, ITERS + 1))
    worst = 0.0
    for iteration in reference:
        for key in ("lm_loss", "grad_norm"):
            assert fsdp[iteration][key] == pytest.approx(reference[iteration][key], rel=REL), (iteration, key)
            worst = max(worst, abs(fsdp[iteration][key] / reference[iteration][key] - 1))
    print(f"[fsdp] {layout} {strategy}: largest relative difference {worst:.1e} (bound {REL:.0e})")
    assert fsdp[ITERS]["lm_loss"] < fsdp[1]["lm_loss"]  # it trains


def test_the_cpu_adaptation_says_what_it_changed_for_fsdp(runs: dict) -> None:
    """CUDA_DEVICE_MAX_CONNECTIONS stays unset (Megatron-FSDP refuses 1), the reduce's division
    fusion is off (gloo has no PREMUL_SUM); no warning of Megatron-FSDP's about the device."""
    out = runs["tp2_dp2", "optim_grads_params"]["stdout"]
    adapted = next(line for line in out.splitlines() if line.startswith("> no CUDA, running on CPU:"))
    assert "gradient_reduce_div_fusion=False" in adapted and "CUDA_DEVICE_MAX_CONNECTIONS" not in adapted, adapted
    assert "instead of the current device" not in out
