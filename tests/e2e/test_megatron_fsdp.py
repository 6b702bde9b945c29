"""Megatron-Core's own Megatron-FSDP trains on CPU with gloo through ``pretrain_gpt.py``, as
Megatron has it (``--use-megatron-fsdp --ckpt-format fsdp_dtensor --optimizer adam``), in each of
its three sharding strategies, at DP 2, DP 4 with experts over EP 2, TP 2 x DP 2 and CP 2 x DP 2
(and with small buckets); its losses and gradient norms are the ``--use-distributed-optimizer`` run's
(``canzona_patches/emulation/fsdp.py``); and the planner predicts the buckets it builds
(``megatron.canzona.planning.fsdp``), expert buckets over the expert-data-parallel group.

Measured: every logged loss and gradient norm agrees within 1.8e-7 relative (DP 4 x EP 2; 1.4e-7
at CP 2 x DP 2, 8.6e-8 in the dense layouts: fp32 sums in another order); the bound is 1e-6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.canzona.planning.fsdp import FsdpBucket, fsdp_buckets
from megatron.canzona.planning.specs import ParamSpec

from .support import DemoData, launch_ranks_once_more_after_heap_abort
from .test_pretrain_gpt import QWEN3_TINY

pytestmark = pytest.mark.slow

ITERS = 4
RUN_TIMEOUT_S = 240
REL = 1e-6
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
FSDP = ("--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor")
MOE = ("--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2", "--moe-router-score-function",
       "softmax", "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3",
       "--moe-token-dispatcher-type", "alltoall", "--expert-tensor-parallel-size", "1")
"""Every layer a mixture of 4 experts (top 2); with ``--expert-model-parallel-size`` (``moe(ep)``)."""


def moe(ep: int) -> tuple[str, ...]:
    return (*MOE, "--expert-model-parallel-size", str(ep))


LAYOUTS = {"dp2": (2, ()), "dp4_ep2": (4, moe(2)),
           "tp2_dp2": (4, ("--tensor-model-parallel-size", "2", "--sequence-parallel")),
           "cp2_dp2": (4, ("--context-parallel-size", "2")),
           "dp2_buckets": (2, ("--ddp-bucket-size", "20000"))}
"""Ranks and flags per layout; ``dp4_ep2``: dense buckets over DP 4, each layer's 4 experts over EP 2,
their buckets sharded over expert-DP 2; ``cp2_dp2``: every bucket over DP 2 x CP 2; ``dp2_buckets`` closes buckets at 20,000 elements
(``optim``: no units)."""


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


def _train(data: DemoData, out: Path, nproc: int, *extra: str, env: dict[str, str] | None = None) -> dict:
    """One run (Megatron-FSDP ones through ``fsdp_geometry_traced.py``; ``env``: more environment
    for its ranks): its metrics, output and each rank's recorded geometry."""
    fsdp = "--use-megatron-fsdp" in extra
    script = "tests/e2e/fsdp_geometry_traced.py" if fsdp else "pretrain_gpt.py"
    env = {**(env or {}), **({"FSDP_GEOMETRY_TRACE": str(out / "geometry")} if fsdp else {})}
    result = launch_ranks_once_more_after_heap_abort(out, nproc, script, *_args(data, out, *extra),
                                                     timeout_s=RUN_TIMEOUT_S, env=env or None)
    assert result.returncode == 0, result.stdout[-6000:]
    metrics = {m["iteration"]: m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    geometry = [json.loads(path.read_text()) for path in sorted((out / "geometry").glob("rank*.json"))] if fsdp else []
    return {"metrics": metrics, "stdout": result.stdout, "geometry": geometry, "dir": out}


@pytest.fixture(scope="module")
def runs(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per layout, the distributed optimizer's run and Megatron-FSDP's (every strategy at DP 2,
    optim_grads_params at DP 4 x EP 2 and TP 2 x DP 2)."""
    root = tmp_path_factory.mktemp("megatron_fsdp")
    out = {}
    for layout, (nproc, extra) in LAYOUTS.items():
        out[layout, "distopt"] = _train(demo_data, root / layout / "distopt", nproc, *extra, "--use-distributed-optimizer")
        for strategy in STRATEGIES if layout == "dp2" else ("optim",) if layout == "dp2_buckets" else ("optim_grads_params",):
            save = (layout, strategy) == SAVED
            out[layout, strategy] = _train(demo_data, root / layout / strategy, nproc, *extra, *FSDP,
                                           "--data-parallel-sharding-strategy", strategy,
                                           *(("--save", str(root / layout / strategy / "ckpt"), "--save-interval", "2")
                                             if save else ()))
    for nproc in (2, 4):  # resumed from the saved run's iteration 2
        out["resume", nproc] = _train(demo_data, root / f"resume_dp{nproc}", nproc, *FSDP,
                                      "--data-parallel-sharding-strategy", SAVED[1], "--load",
                                      str(root / SAVED[0] / SAVED[1] / "ckpt"), "--ckpt-step", "2")
    return out


SAVED = ("dp2", "optim_grads_params")
"""The run that also saves ``fsdp_dtensor`` checkpoints at iterations 2 and 4."""


CASES = [("dp2", s) for s in STRATEGIES] + [("dp4_ep2", "optim_grads_params"), ("tp2_dp2", "optim_grads_params"),
                                            ("cp2_dp2", "optim_grads_params"),
                                            ("dp2_buckets", "optim")]


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


@pytest.mark.parametrize(("layout", "strategy"), CASES, ids=[f"{layout}-{s}" for layout, s in CASES])
def test_the_planners_geometry_is_megatron_fsdps(runs: dict, layout: str, strategy: str) -> None:
    """megatron.canzona.planning.fsdp predicts, from the parameters' descriptions alone, every
    bucket Megatron-FSDP built: its items and their offsets, its chunk, its padded size; every
    rank alike. Each matrix that spans a shard boundary is cut between whole rows."""
    geometry = runs[layout, strategy]["geometry"]
    assert len(geometry) == LAYOUTS[layout][0]
    for rank in geometry:
        specs = [ParamSpec.from_dict(spec) for spec in rank["specs"]]
        read = tuple(FsdpBucket.from_dict(bucket) for bucket in rank["buckets"])
        predicted = fsdp_buckets(specs, dp_size=rank["dp_size"], strategy=rank["strategy"],
                                 bucket_size=rank["bucket_size"], expert_dp_size=rank["expert_dp_size"])
        assert predicted == read
        matrices = {spec.name for spec in specs if spec.family == "matrix"}
        for bucket in read:
            for item in bucket.items:
                if item.name in matrices and item.numel >= bucket.chunk:
                    assert all(lo % item.row == 0 and hi % item.row == 0 for _, lo, hi in bucket.pieces(item)), item
        if "--num-experts" in LAYOUTS[layout][1]:  # a bucket of each layer's experts, over expert-DP 2
            assert [b.unit for b in read if b.expert] == [0, 1] and {b.dp_size for b in read if b.expert} == {2}
    split = sum(len(b.pieces(i)) > 1 for b in read for i in b.items)
    print(f"[fsdp] {layout} {strategy}: {len(read)} buckets, {split} parameters across shards")


@pytest.mark.quick
def test_a_megatron_fsdp_run_trains_and_its_buckets_are_the_planners(demo_data: DemoData, tmp_path: Path) -> None:
    """The quick suite's one Megatron-FSDP launch: ``--canzona --optimizer muon`` at DP 2 in
    optim_grads_params, through the geometry trace; the plan is bound to Megatron-FSDP's shards
    (tests/e2e/test_canzona_fsdp.py compares such runs with the distributed optimizer), the loss
    falls, and the planner's buckets are the ones read from the buffers."""
    run = _train(demo_data, tmp_path, 2, *FSDP, "--data-parallel-sharding-strategy", "optim_grads_params",
                 "--canzona", "--optimizer", "muon")
    assert "[canzona] plan: fsdp layout, 8 matrices over DP 2 x TP 1" in run["stdout"]
    assert run["metrics"][ITERS]["lm_loss"] < run["metrics"][1]["lm_loss"]
    for rank in run["geometry"]:
        specs = [ParamSpec.from_dict(spec) for spec in rank["specs"]]
        assert fsdp_buckets(specs, dp_size=2, bucket_size=rank["bucket_size"]) == tuple(
            FsdpBucket.from_dict(bucket) for bucket in rank["buckets"])


RESUME_REL = REL
"""A resume at another FSDP size: the gradients are reduce-scattered over 4 shards instead of 2
(measured 7.7e-8), the bound of the module's comparisons."""


def test_megatron_fsdp_resumes_its_fsdp_dtensor_checkpoints(runs: dict) -> None:
    """Megatron's AdamW under Megatron-FSDP (optim_grads_params, DP 2) saves ``fsdp_dtensor``
    checkpoints at iterations 2 and 4 on CPU (every rank's optimizer state given the same entries:
    ``megatron_fixes.state_on_every_rank``; the fp32 model's SwiGLU keys found:
    ``finding_unwrapped_params``); resumed from iteration 2 at DP 2, iterations 3 and 4 are bitwise
    the uninterrupted run's, at DP 4 within RESUME_REL."""
    straight = runs["dp2", "optim_grads_params"]
    assert (straight["dir"] / "ckpt" / "iter_0000002").is_dir() and (straight["dir"] / "ckpt" / "iter_0000004").is_dir()
    for nproc in (2, 4):
        resumed = runs["resume", nproc]["metrics"]
        assert sorted(resumed) == [3, 4]
        worst = 0.0
        for iteration, got in resumed.items():
            want = straight["metrics"][iteration]
            for key in ("lm_loss", "grad_norm"):
                if nproc == 2:
                    assert got[key] == want[key], (nproc, iteration, key)
                assert got[key] == pytest.approx(want[key], rel=RESUME_REL), (nproc, iteration, key)
                worst = max(worst, abs(got[key] / want[key] - 1))
        print(f"[fsdp] resumed at DP {nproc}: largest relative difference {worst:.1e}")
