"""pretrain_gpt.py --optimizer muon --canzona stops and resumes: 2 gloo ranks.

The ranks are forked from one process that imported Megatron (``support.launch_ranks``; torchrun's
agent is tested in test_failures.py). One module-scoped sequence of runs:

1. **killed mid-save**: 8 iterations at DP 2 with ``--save-interval 4``; rank 1 is SIGKILLed
   (``CANZONA_CKPT_FAULT=write@8:1``, armed by ``pretrain_with_fault.py``, which runs
   ``pretrain_gpt.py`` with ``canzona_patches/harness/faults.py``) after writing its files of
   iteration 8. Its metrics
   (written before the save) are the uninterrupted reference curve.
2. **resumed at DP 2** from the same directory: the tracker still names iteration 4; it
   trains 5..8 and saves iteration 8 over the torn attempt.
3. **resumed at DP 1** from a copy taken after run 1.
4. **mismatched model** (``--ffn-hidden-size`` changed) loading that copy: a one-line error.

With ``--async-save`` (a second sequence): rank 0 is SIGKILLed while committing iteration 8
(``CANZONA_CKPT_FAULT=commit@8``; the commit is the asynchronous request's last finalize
step, here run as training ends), then the job is resumed at DP 2, again with ``--async-save``.

With pipeline parallelism (a third sequence): 8 iterations at PP 2 saving iteration 4, resumed
from it at PP 2 and at PP 1 x DP 2 (stage 1's layer 0 is the model's layer 1: the optimizer
state is keyed by global layer number). The PP 2 runs compute the matrices early
(``--canzona-early-compute``), clipping at 0.7 so that iteration 4, the one saved, computes
them again.

Megatron's own AdamW in the legacy ``--ckpt-format torch`` (a fourth sequence): saved at
iteration 4 of 8 at DP 2, resumed with its moments (canzona_patches/integration/megatron_fixes.py makes
that load work with torch's optimizers) and, as a control, with ``--no-load-optim``.

NorMuon (``--optimizer adaptive_muon``) the same way at PP 2 (a fifth sequence, without early compute).

Dropout is off, as in the Qwen3 recipes: on CPU the data loader draws from the same
generator as dropout after a resume (on GPU dropout uses the CUDA generator), so CPU
resumes with dropout are not bitwise.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from .support import DemoData, launch_ranks
from .test_pretrain_gpt import QWEN3_TINY

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 240
ITERS, SAVE_INTERVAL = 8, 4
TRACKER = "latest_checkpointed_iteration.txt"


FAULTY_ENTRY = "canzona_patches/harness/pretrain_with_fault.py"
"""``pretrain_gpt.py`` with a ``CANZONA_CKPT_FAULT`` armed (the product has no fault injection)."""


def resume_args(data: DemoData, out: Path, *extra: str, optimizer: tuple[str, ...] = ("muon", "--canzona")) -> list[str]:
    """Muon with --canzona (or ``optimizer``), 8 iterations, a metrics line per iteration into ``out``."""
    return [
        *QWEN3_TINY, "--hidden-dropout", "0", "--attention-dropout", "0",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(ITERS),
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "3",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "0", "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", str(data.tokenizer_model), "--data-path", data.data_prefix, "--split", "80,10,10",
        "--data-cache-path", str(out / "cache"), "--num-workers", "0",
        "--canzona-metrics-file", str(out / "metrics.jsonl"),
        "--optimizer", *optimizer, "--use-distributed-optimizer", *extra,
    ]


def metrics_of(out: Path) -> dict[int, dict]:
    path = out / "metrics.jsonl"
    assert path.is_file(), f"no metrics at {path}"
    return {m["iteration"]: m for m in map(json.loads, path.read_text().splitlines())}


def _train(data: DemoData, out: Path, *args: str, nproc: int = 2, **kwargs: Any) -> dict[int, dict]:
    """One ``pretrain_gpt.py`` run (:func:`resume_args` plus ``args``) that must succeed; its metrics."""
    result = launch_ranks(nproc, "pretrain_gpt.py", *resume_args(data, out, *args, **kwargs), timeout_s=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-6000:]
    (out / "stdout.txt").write_text(result.stdout)
    return metrics_of(out)


def _save_then_resume(data: DemoData, root: Path, straight: tuple[str, ...], resumes: dict[str, tuple[str, ...]],
                      **kwargs: Any) -> dict:
    """8 iterations saving every 4 (``"reference"``), then each of ``resumes`` from iteration 4."""
    ckpt = root / "ckpt"
    out = {"reference": _train(data, root / "straight", *straight, "--save", str(ckpt),
                               "--save-interval", str(SAVE_INTERVAL), **kwargs)}
    out["stdout"] = (root / "straight" / "stdout.txt").read_text()
    (ckpt / TRACKER).write_text(str(SAVE_INTERVAL))
    for name, args in resumes.items():
        out[name] = _train(data, root / name, *args, "--load", str(ckpt), **kwargs)
    return out


@pytest.fixture(scope="module")
def runs(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("resume")
    ckpt, copy = root / "ckpt", root / "ckpt_copy"
    out = {"ckpt": ckpt, "copy": copy}

    killed = root / "killed"
    out["killed"] = launch_ranks(
        2, FAULTY_ENTRY, *resume_args(demo_data, killed, "--save", str(ckpt), "--save-interval", str(SAVE_INTERVAL)),
        timeout_s=RUN_TIMEOUT_S, env={"CANZONA_CKPT_FAULT": f"write@{ITERS}:1"})
    out["after_kill"] = sorted(p.name for p in ckpt.iterdir())
    out["tracker_after_kill"] = (ckpt / TRACKER).read_text()
    out["reference"] = metrics_of(killed)
    shutil.copytree(ckpt, copy)

    out["dp2"] = _train(demo_data, root / "dp2", "--load", str(ckpt), "--save", str(ckpt),
                        "--save-interval", str(SAVE_INTERVAL))
    out["dp1"] = _train(demo_data, root / "dp1", "--load", str(copy), nproc=1)
    # one optimizer instance -> two (each over DP 1, stepping the whole model)
    out["instances"] = _train(demo_data, root / "instances", "--load", str(copy),
                              "--num-distributed-optimizer-instances", "2")
    out["after_resume"] = sorted(p.name for p in ckpt.iterdir())
    out["tracker_after_resume"] = (ckpt / TRACKER).read_text()

    mismatched = [a if a != "176" else "192" for a in resume_args(demo_data, root / "bad", "--load", str(copy))]
    assert mismatched != resume_args(demo_data, root / "bad", "--load", str(copy)), "--ffn-hidden-size not found"
    out["mismatch"] = launch_ranks(1, "pretrain_gpt.py", *mismatched, timeout_s=RUN_TIMEOUT_S)
    return out


@pytest.fixture(scope="module")
def async_runs(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("async")
    ckpt = root / "ckpt"
    save = ("--save", str(ckpt), "--save-interval", str(SAVE_INTERVAL), "--async-save")
    out = {"killed": launch_ranks(2, FAULTY_ENTRY, *resume_args(demo_data, root / "killed", *save),
                                  timeout_s=RUN_TIMEOUT_S, env={"CANZONA_CKPT_FAULT": f"commit@{ITERS}"})}
    out["after_kill"] = sorted(p.name for p in ckpt.iterdir())
    out["tracker_after_kill"] = (ckpt / TRACKER).read_text()
    out["reference"] = metrics_of(root / "killed")
    out["resumed_metrics"] = _train(demo_data, root / "resumed", "--load", str(ckpt), *save)
    out["after_resume"] = sorted(p.name for p in ckpt.iterdir())
    out["tracker_after_resume"] = (ckpt / TRACKER).read_text()
    final = ckpt / f"iter_{ITERS:07d}"
    out["files"] = sorted(p.name for p in final.iterdir() if p.is_file())
    out["checksums"] = {line.split()[1]: line.split()[0] for listing in (final / "checksums").glob("*.sha256")
                        for line in listing.read_text().splitlines()}
    out["manifest"] = (final / "checksums" / "SHA256SUMS").read_text()
    out["digests"] = {name: hashlib.sha256((final / name).read_bytes()).hexdigest() for name in out["files"]}
    return out


@pytest.fixture(scope="module")
def instance_runs(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """DP 4 as 2 distributed-optimizer instances of DP 2 (micro-batches of 2), saved at iteration 4,
    resumed as 2 instances and as 1 instance of DP 4. Newton-Schulz in fp32: in bf16 the other sum
    order of the gradients (6e-8 at iteration 6) flips roundings of the update, 3.7e-5 of the grad
    norm at iteration 7 (measured)."""
    one = ("--micro-batch-size", "2", "--muon-fp32-matmul-prec", "high")
    two = (*one, "--num-distributed-optimizer-instances", "2")
    return _save_then_resume(demo_data, tmp_path_factory.mktemp("instances"), two, {"two": two, "one": one}, nproc=4)


@pytest.fixture(scope="module")
def per_head_runs(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``--canzona-split-qkv-per-head`` saved at DP 2 at iteration 4, resumed at DP 2 and at TP 2
    (each rank holding half of every QKV weight's heads); fp32 Newton-Schulz."""
    heads = ("--canzona-split-qkv-per-head", "--muon-fp32-matmul-prec", "high")
    return _save_then_resume(demo_data, tmp_path_factory.mktemp("per_head"), heads,
                             {"dp2": heads, "tp2": (*heads, "--tensor-model-parallel-size", "2")})


@pytest.fixture(scope="module")
def pp_runs(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    # Early compute forced on gloo, clipping at 0.7: iterations 1-3 (norms ~0.67) commit what was
    # computed in backward, iteration 4 (0.75) computes again, and is the one saved.
    clip = ("--clip-grad", "0.7")
    pp2 = ("--pipeline-model-parallel-size", "2", "--canzona-early-compute", "--overlap-grad-reduce", *clip)
    return _save_then_resume(demo_data, tmp_path_factory.mktemp("pp"), pp2, {"pp2": pp2, "dp2": clip})


@pytest.fixture(scope="module")
def pp_normuon_runs(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """NorMuon (its second moment beside the momentum, per stage) saved at PP 2, resumed at PP 2 and PP 1 x DP 2."""
    pp2 = ("--pipeline-model-parallel-size", "2", "--overlap-grad-reduce")
    normuon = ("adaptive_muon", "--adaptive-muon-moment2-method", "normuon", "--canzona")
    return _save_then_resume(demo_data, tmp_path_factory.mktemp("pp_normuon"), pp2, {"pp2": pp2, "dp2": ()},
                             optimizer=normuon)


@pytest.fixture(scope="module")
def legacy_runs(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    legacy = ("--ckpt-format", "torch")
    return _save_then_resume(demo_data, tmp_path_factory.mktemp("legacy"), legacy,
                             {"resumed": legacy, "no_optim": (*legacy, "--no-load-optim")}, optimizer=("adam",))


def _per_iteration(metrics: dict[int, dict]) -> dict[int, float]:
    """The logged loss of every iteration (``--log-interval 1``). A resumed run's line after its
    first is that iteration's alone, as in the uninterrupted run (Megatron's own log would
    average the two; ``canzona_patches.integration.training.logging_interval_metrics``)."""
    return {i: m["lm_loss"] for i, m in metrics.items()}


def test_a_save_killed_mid_write_keeps_the_previous_checkpoint(runs):
    assert runs["killed"].returncode != 0
    assert f"killing rank 1 during 'write' of iteration {ITERS}" in runs["killed"].stdout
    assert runs["tracker_after_kill"] == str(SAVE_INTERVAL)
    assert "iter_0000004" in runs["after_kill"] and "iter_0000008" not in runs["after_kill"]
    assert ".staging-iter_0000008" in runs["after_kill"]  # the torn write, never tracked
    assert sorted(runs["reference"]) == list(range(1, ITERS + 1))


def _assert_repeats_exactly(resumed: dict[int, dict], reference: dict[int, dict]) -> None:
    """Iterations 5..8 of a resumed run: the same losses, grad norms and samples, bit for bit."""
    assert sorted(resumed) == list(range(SAVE_INTERVAL + 1, ITERS + 1))
    losses = _per_iteration(resumed)
    for iteration in resumed:
        assert losses[iteration] == reference[iteration]["lm_loss"], iteration
        assert resumed[iteration]["grad_norm"] == reference[iteration]["grad_norm"], iteration
        assert resumed[iteration]["consumed_samples"] == reference[iteration]["consumed_samples"]


def _assert_repeats_closely(resumed: dict[int, dict], reference: dict[int, dict], *, dp_size: int) -> None:
    """Iterations 5..8 of a run resumed at another layout: losses and grad norms within 1e-5."""
    losses = _per_iteration(resumed)
    for iteration in range(SAVE_INTERVAL + 1, ITERS + 1):
        assert losses[iteration] == pytest.approx(reference[iteration]["lm_loss"], rel=1e-5), iteration
        assert resumed[iteration]["grad_norm"] == pytest.approx(reference[iteration]["grad_norm"], rel=1e-5)
        assert resumed[iteration]["dp_size"] == dp_size


def test_resume_at_dp2_repeats_the_uninterrupted_run_exactly(runs):
    _assert_repeats_exactly(runs["dp2"], runs["reference"])
    # The resumed run saved iteration 8 over the torn attempt and cleaned it up.
    assert runs["tracker_after_resume"] == str(ITERS)
    assert runs["after_resume"] == ["iter_0000004", "iter_0000008", TRACKER]


def test_resume_at_dp1_from_a_dp2_checkpoint(runs):
    """DP 1 sums the gradient in another order; measured: equal losses, grad norms within 7e-8."""
    _assert_repeats_closely(runs["dp1"], runs["reference"], dp_size=1)


def test_checkpoints_move_between_optimizer_instance_counts(runs, instance_runs):
    """``--num-distributed-optimizer-instances``: 2 instances resume their own checkpoint bit for bit;
    1 instance of DP 4 resumes it, and 2 instances of DP 1 a single DP 2 instance's, within the DP
    resharding bound (the gradients' shards are summed in another order)."""
    _assert_repeats_exactly(instance_runs["two"], instance_runs["reference"])
    _assert_repeats_closely(instance_runs["one"], instance_runs["reference"], dp_size=4)
    _assert_repeats_closely(runs["instances"], runs["reference"], dp_size=2)
    assert ("[canzona] plan: whole layout, 8 matrices over DP 2 (each of 2 distributed-optimizer instances) x TP 1"
            in instance_runs["stdout"]), instance_runs["stdout"][-3000:]


def test_per_head_matrices_train_and_resume_across_tp_sizes(per_head_runs):
    """Every head's query, key and value block its own matrix (the start-up line says so): resumed
    bit for bit at DP 2, and at TP 2 (the heads split over the TP ranks) within the resharding bound."""
    assert "[canzona] QKV: each head its own matrix" in per_head_runs["stdout"], per_head_runs["stdout"][-3000:]
    _assert_repeats_exactly(per_head_runs["dp2"], per_head_runs["reference"])
    _assert_repeats_closely(per_head_runs["tp2"], per_head_runs["reference"], dp_size=1)


def test_a_mismatched_model_gets_one_line_naming_the_file(runs):
    result = runs["mismatch"]
    assert result.returncode != 0
    lines = [line for line in result.stdout.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert lines, result.stdout[-4000:]
    assert re.search(
        r"iter_0000004/__\d+_\d+\.distcp: decoder\.layers\.mlp\.linear_fc1\.weight has shape \(2, 352, 64\) "
        r"in the checkpoint, this run expects \(2, 384, 64\)", lines[0]), lines[0]


def test_an_async_save_killed_before_its_commit_keeps_the_previous_checkpoint(async_runs):
    assert async_runs["killed"].returncode != 0
    assert f"killing rank 0 during 'commit' of iteration {ITERS}" in async_runs["killed"].stdout
    assert async_runs["tracker_after_kill"] == str(SAVE_INTERVAL)
    # Iteration 8 was written in full in the background but never renamed into place or tracked;
    # Megatron's own tracker write went to a scratch file. Both are cleared by the next save. The
    # killed rank 0's save-directory lock stays, for the resume to take over (its PID is gone).
    assert async_runs["after_kill"] == [".staging-iter_0000008", f".staging-megatron-{TRACKER}", "canzona.lock",
                                        "iter_0000004", TRACKER], async_runs["after_kill"]


def test_an_async_resume_repeats_the_uninterrupted_run_exactly(async_runs):
    _assert_repeats_exactly(async_runs["resumed_metrics"], async_runs["reference"])
    # The final save was committed when the job finalized it, and the torn attempt is gone.
    assert async_runs["tracker_after_resume"] == str(ITERS)
    assert async_runs["after_resume"] == ["iter_0000004", "iter_0000008", TRACKER]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(demo_data, tmp_path, mode):
    """Rank 1's files of iteration 4 are written onto /dev/full (the kernel's ENOSPC): every rank
    stops with one line naming the file (with --async-save the write fails in the background and
    surfaces when the save is finalized), and iteration 2 stays tracked and intact."""
    ckpt = tmp_path / "ckpt"
    asynchronous = ("--async-save",) if mode == "async" else ()
    result = launch_ranks(
        2, FAULTY_ENTRY, *resume_args(demo_data, tmp_path, "--save", str(ckpt), "--save-interval", "2",
                                      "--train-iters", "4", *asynchronous),
        timeout_s=RUN_TIMEOUT_S, env={"CANZONA_CKPT_FAULT": "full@4:1"})
    out = result.stdout + (result.stderr or "")
    assert result.returncode != 0, out[-6000:]
    staged = ckpt / ".staging-iter_0000004" / "__1_0.distcp"
    line = (f"pretrain_gpt.py: error: saving iteration 4 failed: {staged}: no space left on device (ENOSPC); the "
            f"previous checkpoint {ckpt / 'iter_0000002'} stays tracked and loadable: free space on the filesystem "
            f"of --save {ckpt}, or point --save elsewhere, then resume")
    assert out.count(line) == 1, out[-6000:]  # once per job: rank 0 reads the file rank 1 marked, and says it
    assert not re.search(r'File "[^"]*(canzona_patches|megatron/canzona|pretrain_gpt\.py)', out), out[-6000:]
    assert (ckpt / TRACKER).read_text() == "2"
    saved = ckpt / "iter_0000002"
    for listing in (saved / "checksums").glob("*.sha256"):
        digest, name = listing.read_text().split()
        assert hashlib.sha256((saved / name).read_bytes()).hexdigest() == digest, name


def test_an_async_save_records_a_checksum_of_every_file(async_runs):
    """Each rank's data files are hashed as its background writer writes them; the first rank's
    small files when it commits (canzona_patches/checkpoints/checksums.py)."""
    assert any(name.endswith(".distcp") for name in async_runs["files"]), async_runs["files"]
    assert async_runs["checksums"] == async_runs["digests"]
    # ... and every checksum once more in the commit's list, which tells an edited checksum file apart
    listed = dict(reversed(line.split()) for line in async_runs["manifest"].splitlines())
    assert listed == async_runs["digests"]


def test_resume_at_pp2_from_a_pp2_checkpoint_is_exact(pp_runs):
    _assert_repeats_exactly(pp_runs["pp2"], pp_runs["reference"])


def test_a_checkpoint_saved_right_after_a_recomputed_early_step_resumes_exactly(pp_runs):
    """The PP 2 runs compute early (``--canzona-early-compute``): the saved iteration's updates
    were computed before the step, dropped because the clip acted, and computed again; the resume
    above repeats the run bit for bit, and commits, recomputes and waits as it did."""
    outcomes = {i: m["early_compute"] for i, m in pp_runs["reference"].items()}
    none = {"committed": 0, "recomputed": 0, "skipped": 0, "not speculated": 0}
    committed, recomputed = {**none, "committed": 1}, {**none, "recomputed": 1}
    assert [outcomes[i] for i in (1, 2, 3, SAVE_INTERVAL)] == [committed] * 3 + [recomputed], outcomes
    # the speculation policy does not speculate in the iteration after the clip acted, in the resumed
    # run too (the policy is saved with the optimizer state)
    assert outcomes[SAVE_INTERVAL + 1] == {**none, "not speculated": 1}, outcomes
    assert {i: m["early_compute"] for i, m in pp_runs["pp2"].items()} == {i: outcomes[i] for i in pp_runs["pp2"]}
    assert pp_runs["dp2"][ITERS]["early_compute"] is None  # gloo's default: computed in the step
    # early compute on and reduce-scatters overlapping backward: the reduce order was projected for
    # each stage (the choice is the projection's)
    for stage in (0, 1):
        assert re.search(rf"\[canzona\] stage {stage}: matrices reduce first: (on|off) \(projected on ",
                         pp_runs["stdout"]), pp_runs["stdout"][-4000:]
        assert f"[canzona] stage {stage}: early compute: on (--canzona-early-compute on)" in pp_runs["stdout"]


def test_resume_at_dp2_from_a_pp2_checkpoint(pp_runs):
    """The two stages' state merged into one model: losses and grad norms within 1e-5 (relative)."""
    _assert_repeats_closely(pp_runs["dp2"], pp_runs["reference"], dp_size=2)


def test_normuon_resumes_at_pp2_exactly_and_at_dp2_closely_from_a_pp2_checkpoint(pp_normuon_runs):
    _assert_repeats_exactly(pp_normuon_runs["pp2"], pp_normuon_runs["reference"])
    _assert_repeats_closely(pp_normuon_runs["dp2"], pp_normuon_runs["reference"], dp_size=2)


def test_megatron_adamw_resumes_exactly_from_the_legacy_format(legacy_runs):
    _assert_repeats_exactly(legacy_runs["resumed"], legacy_runs["reference"])
    # The control: without the moments the next step already differs.
    assert legacy_runs["no_optim"][SAVE_INTERVAL + 2]["grad_norm"] != legacy_runs["reference"][SAVE_INTERVAL + 2]["grad_norm"]

