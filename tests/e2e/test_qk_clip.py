"""QK-clip under --canzona through pretrain_gpt.py, against one process at the same global batch.

The tiny Qwen3 without its QK norm (with it, the norm would undo the clip's scaling), Muon with
fp32 Newton-Schulz, 6 iterations, a threshold (0.1) under the logits of the first iterations
(0.12-0.15) so that the clip acts on most steps. Every 4-rank run goes through
tests/e2e/qk_clip_traced.py, which saves each rank's view of every clip: the reduced maxima of
largest logits, and each ``linear_qkv`` main weight it holds before and after the clip.

What is held, per layout (whole, lean) and configuration (DP 2 x TP 2, CP 2 x DP 2, PP 2 x DP 2):
* the losses within 1e-5 relative and every parameter within 1e-3 * lr of one process's (read whole
  from the torch_dist checkpoints), the logged largest logit within 1e-5 relative of one process's;
* every rank of a layer's DP x CP group has the same maxima of its heads at every step (one
  all-reduce over DP x CP);
* per step, layer and tensor-parallel rank, the ranks' main-weight pieces tile the matrix exactly
  once (nothing unclipped, nothing clipped twice), and the weight after the clip, gathered from the
  pieces, is the weight before it with each group's query rows times ``eta ** alpha`` and key rows
  times ``eta ** (1 - alpha)``, ``eta = tau / max`` where the group's largest logit is over tau,
  computed here from the reduced maxima: bitwise.
With the clip off, ``--log-max-attention-logit`` alone changes no weight and no loss (bitwise),
and logs the largest logit of the first iteration as the clipped run does (the same weights).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from .support import DemoData, launch_ranks
from .test_context_parallel import ITERS, LR, cp_args, parameters
from .test_pretrain_gpt import RUN_TIMEOUT_S, read_metrics

pytestmark = pytest.mark.slow

TAU = 0.1
ALPHA = 0.5
CLIP = ["--qk-clip", "--qk-clip-threshold", str(TAU), "--qk-clip-alpha", str(ALPHA)]
SAVED = 3
"""The one-process clipped run also saves after this iteration (the resume test's start)."""
LOSS_RTOL = 1e-5
LOGIT_RTOL = 1e-5
WEIGHT_ATOL = 1e-3 * LR
CONFIGS = {
    "dp2_tp2": ["--tensor-model-parallel-size", "2"],
    "cp2_dp2": ["--context-parallel-size", "2"],
    "pp2_dp2": ["--pipeline-model-parallel-size", "2"],
}
TRACED = str(Path(__file__).with_name("qk_clip_traced.py"))


def qk_args(data: DemoData, out: Path, *extra: str, optimizer: str = "muon") -> list[str]:
    """test_context_parallel.py's 6 iterations (global batch 8, no dropout, a loss every iteration,
    a checkpoint at the end) of the tiny Qwen3 without its QK norm, which would undo the clip."""
    flags = cp_args(data, out, optimizer, *extra)
    flags.remove("--qk-layernorm")
    return flags


def run(data: DemoData, out: Path, nproc: int, *extra: str, script: str = "pretrain_gpt.py",
        env: dict[str, str] | None = None, optimizer: str = "muon") -> tuple[list[float], list[float | None], str]:
    result = launch_ranks(nproc, script, *qk_args(data, out, *extra, optimizer=optimizer), timeout_s=RUN_TIMEOUT_S,
                          env=env)
    assert result.returncode == 0, result.stdout[-6000:]
    metrics = read_metrics(out / "metrics.jsonl")
    return [m["lm_loss"] for m in metrics], [m.get("max_attention_logit") for m in metrics], result.stdout


@pytest.fixture(scope="module")
def one_process(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process: clipped; the log alone; neither."""
    out = {}
    for name, flags in (("clip", [*CLIP, "--save-interval", str(SAVED)]), ("log", ["--log-max-attention-logit"]),
                        ("plain", [])):
        where = tmp_path_factory.mktemp(f"one_{name}")
        losses, logits, stdout = run(demo_data, where, 1, *flags)
        out[name] = (losses, logits, parameters(where / "ckpt"), stdout)
        out[f"{name} checkpoints"] = where / "ckpt"
    return out


def test_resume_after_a_clipped_step_is_bitwise(one_process: dict, demo_data: DemoData, tmp_path: Path) -> None:
    """The checkpoint saved after iteration 3, whose step the clip acted on, resumed: iterations
    4-6 and the last weights are the uninterrupted run's, bitwise."""
    losses, logits, params, _ = one_process["clip"]
    assert logits[SAVED - 1] > TAU, logits
    saved = tmp_path / "saved"
    shutil.copytree(one_process["clip checkpoints"] / f"iter_{SAVED:07d}", saved / f"iter_{SAVED:07d}")
    (saved / "latest_checkpointed_iteration.txt").write_text(str(SAVED))
    resumed, resumed_logits, _ = run(demo_data, tmp_path, 1, *CLIP, "--load", str(saved))
    assert resumed == losses[SAVED:]
    assert resumed_logits == logits[SAVED:]
    after = parameters(tmp_path / "ckpt")
    for key, value in after.items():
        assert torch.equal(value, params[key]), key


def test_logging_alone_changes_nothing(one_process: dict) -> None:
    clip_losses, clip_logits, _, _ = one_process["clip"]
    log_losses, log_logits, log_params, stdout = one_process["log"]
    plain_losses, plain_logits, plain_params, _ = one_process["plain"]
    assert log_losses == plain_losses
    assert set(log_params) == set(plain_params)
    for key, value in log_params.items():
        assert torch.equal(value, plain_params[key]), key
    assert plain_logits == [None] * len(plain_losses)
    assert all(v is not None and v > 0 for v in log_logits), log_logits
    assert "max attention logit:" in stdout
    assert stdout.count("[canzona] max attention logit: logged from Megatron's local attention, no clip") == 1
    clip_stdout = one_process["clip"][3]
    assert clip_stdout.count("[canzona] QK-clip: threshold 0.1, alpha 0.5, logits from Megatron's local attention\n") \
        == 1, clip_stdout[-3000:]
    # The first iteration's forward sees the same weights with the clip on or off.
    assert log_logits[0] == clip_logits[0]
    # The clip changed the run: later logits differ, and all logits were above the threshold.
    assert clip_logits[1:] != log_logits[1:]
    assert sum(v > TAU for v in clip_logits) >= 4, clip_logits


def _expected(before: torch.Tensor, logits: torch.Tensor, rows) -> torch.Tensor:
    """The single-device formula, written out: per query group, eta from its heads' largest logit."""
    grouped = logits.view(rows.groups, rows.heads_per_group).amax(dim=1)
    weight = before.view(rows.groups, rows.rows_per_group, -1).clone()
    for g in range(rows.groups):
        if grouped[g] > TAU:
            eta = TAU / grouped[g:g + 1]  # Megatron's expression (a Python float over the tensor)
            weight[g, :rows.query_rows] *= torch.pow(eta, ALPHA)
            weight[g, rows.query_rows:rows.query_rows + rows.head_dim] *= torch.pow(eta, 1 - ALPHA)
    return weight.view_as(before)


def check_trace(trace: Path, nproc: int, group: int) -> int:
    """Every rank of a layer's DP x CP ``group`` has its heads' maxima, the same; the pieces tile
    each matrix once and are scaled as the formula says. Returns the number of (step, layer, TP
    rank) matrices whose clip acted."""
    steps = sorted({int(p.stem.split("_step")[1]) for p in trace.glob("rank*_step*.pt")})
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5, steps
    acted = 0
    for step in steps:
        records = [torch.load(trace / f"rank{r}_step{step}.pt", weights_only=False) for r in range(nproc)]
        matrices: dict[tuple[int, int], list] = {}
        for record in records:
            for layer in record["layers"]:
                matrices.setdefault((layer["index"], record["tp_rank"]), []).append(layer)
        for (index, tp_rank), pieces in matrices.items():
            rows, columns = pieces[0]["rows"], pieces[0]["columns"]
            numel = rows.rows * columns
            before = torch.full((numel,), math.nan)
            after = torch.full((numel,), math.nan)
            covered = torch.zeros(numel, dtype=torch.int32)
            for piece in pieces:
                if piece["before"] is None:
                    continue
                span = slice(piece["start"], piece["start"] + piece["before"].numel())
                before[span], after[span] = piece["before"], piece["after"]
                covered[span] += 1
            assert torch.all(covered == 1), f"step {step}, layer {index}, TP rank {tp_rank}: pieces cover {covered}"
            logits = pieces[0]["logits"]
            for piece in pieces[1:]:  # one all-reduce over DP x CP: every holder has the same maxima
                assert torch.equal(piece["logits"], logits), f"step {step}, layer {index}: ranks reduced differently"
            assert len(pieces) == group, f"step {step}, layer {index}: {len(pieces)} ranks of DP x CP {group} hold it"
            expected = _expected(before.view(rows.rows, columns), logits, rows)
            assert torch.equal(after.view(rows.rows, columns), expected), f"step {step}, layer {index}, TP {tp_rank}"
            acted += int(not torch.equal(after, before))
    return acted


@pytest.fixture(scope="module")
def pp_reference(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], tuple]:
    """Under PP each stage draws its own layers' initial weights, so that a PP run and one process
    start apart. Both start from one checkpoint instead: one process's weights after a step at
    lr 0 (no clip), loaded with --finetune; the flags and one process's clipped run from it."""
    start = tmp_path_factory.mktemp("pp_start")
    flags = qk_args(demo_data, start)
    for flag, value in (("--train-iters", "1"), ("--lr", "0"), ("--min-lr", "0"), ("--lr-warmup-iters", "0"),
                        ("--save-interval", "1")):
        flags[flags.index(flag) + 1] = value
    result = launch_ranks(1, "pretrain_gpt.py", *flags, timeout_s=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-6000:]
    load = ["--load", str(start / "ckpt"), "--finetune", "--no-load-optim", "--no-load-rng"]
    where = tmp_path_factory.mktemp("pp_one")
    losses, logits, _ = run(demo_data, where, 1, *CLIP, *load)
    return load, (losses, logits, parameters(where / "ckpt"), "")


@pytest.mark.parametrize("layout", ["whole", "lean"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_qk_clip_matches_one_process(config: str, layout: str, demo_data: DemoData, tmp_path: Path,
                                     request: pytest.FixtureRequest) -> None:
    load, reference = request.getfixturevalue("pp_reference") if config == "pp2_dp2" else ([], None)
    ref_losses, ref_logits, ref_params, _ = reference or request.getfixturevalue("one_process")["clip"]
    trace = tmp_path / "trace"
    losses, logits, _ = run(demo_data, tmp_path, 4, *CLIP, "--canzona-layout", layout, *CONFIGS[config], *load,
                            script=TRACED, env={"QK_CLIP_TRACE": str(trace)})
    ref = torch.tensor(ref_losses, dtype=torch.float64)
    assert (torch.tensor(losses, dtype=torch.float64) - ref).abs().max() <= LOSS_RTOL * ref.abs().max(), \
        (losses, ref_losses)
    for got, want in zip(logits, ref_logits, strict=True):
        assert abs(got - want) <= LOGIT_RTOL * abs(want), (logits, ref_logits)
    params = parameters(tmp_path / "ckpt")
    assert set(params) == set(ref_params)
    for key, value in params.items():
        diff = (value.double() - ref_params[key].double()).abs().max().item()
        assert diff <= WEIGHT_ATOL, f"{config} {layout}: {key} differs by {diff:.3g} (allowed {WEIGHT_ATOL:.3g})"
    acted = check_trace(trace, 4, group=4 if config == "cp2_dp2" else 2)
    worst = max((value.double() - ref_params[key].double()).abs().max().item() for key, value in params.items())
    print(f"\n[qk-clip] {config} {layout}: losses {(torch.tensor(losses, dtype=torch.float64) - ref).abs().max() / ref.abs().max():.2g} "
          f"relative, logits {max(abs(a - b) / abs(b) for a, b in zip(logits, ref_logits)):.2g} relative, "
          f"parameters {worst:.2g}, clip acted on {acted} matrices", flush=True)
    # 2 layers x TP ranks per step, 6 steps: the clip acted on most of them.
    tp = 2 if config == "dp2_tp2" else 1
    assert acted >= 0.6 * 6 * 2 * tp, f"the clip acted on {acted} matrices only"


MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
       "--moe-router-score-function", "softmax", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-aux-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2",
       "--expert-tensor-parallel-size", "1"]
OTHERS = {
    # optimizer, ranks, flags: each optimizer once, with the layouts not above (EP, VPP, CP with lean)
    "shampoo_ep2_dp2": ("shampoo", 2, MOE),
    "soap_vpp_pp2_dp2": ("soap", 4, ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                     "--num-layers-per-virtual-pipeline-stage", "1"]),
    "normuon_cp2_lean": ("adaptive_muon", 2, ["--context-parallel-size", "2", "--canzona-layout", "lean",
                                              "--adaptive-muon-moment2-method", "normuon"]),
}


@pytest.mark.parametrize("name", list(OTHERS))
def test_qk_clip_with_every_optimizer(name: str, demo_data: DemoData, tmp_path: Path) -> None:
    """Shampoo under EP 2 (dense attention, MoE MLPs), SOAP under PP 2 with two virtual stages,
    NorMuon under CP 2 in the lean layout: the clip is the same rows scaled after any update, so
    each run is held to the trace's checks (the maxima agree over DP x CP; the pieces tile every
    matrix once and are scaled as the formula says, bitwise; the clip acts on most matrices) and
    logs its largest logit every iteration."""
    optimizer, nproc, flags = OTHERS[name]
    trace = tmp_path / "trace"
    losses, logits, _ = run(demo_data, tmp_path, nproc, *CLIP, *flags, script=TRACED,
                            env={"QK_CLIP_TRACE": str(trace)}, optimizer=optimizer)
    assert len(losses) == len(logits) == 6 and all(math.isfinite(v) and v > 0 for v in logits), logits
    layers = 4 if "--num-layers" in flags else 2  # (one TP rank)
    acted = check_trace(trace, nproc, group=2)
    assert acted >= 0.5 * 6 * layers, f"{name}: the clip acted on {acted} matrices only"
