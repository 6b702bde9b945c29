"""Megatron-LM's own GPT-3 example flags, shrunk: ``examples/gpt3/train_gpt3_tiny_distributed.sh``.

fp16 with dynamic loss scaling, a batch-size ramp, TP 2 x PP 2 on 4 gloo ranks, Muon under
``--canzona``, mock data, TensorBoard. The script runs twice, as a user would run it: stopped
by ``--exit-interval`` after iteration 10 (saved), then again, resuming to iteration 20. Both
launches are shared by every test here (about 2 minutes on 2 busy cores, most of it starting
4 processes twice).
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from canzona_patches.errors import CanzonaArgumentError
from megatron.canzona.runtime.launcher import free_port
from canzona_patches.integration.arguments import rampup_as_step_schedule

from .support import ROOT, run_with_deadline
from .test_pretrain_gpt import NUM_ITERS, check_tensorboard, read_metrics

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "examples" / "gpt3" / "train_gpt3_tiny_distributed.sh"
RUN_TIMEOUT_S = 300
# The script's flags: check_tensorboard counts one "lm loss" per iteration of NUM_ITERS.
TRAIN_ITERS = NUM_ITERS
STOP_AT = 10
SEQ_LENGTH = 64
INITIAL_LOSS_SCALE = 2.0**20
# --rampup-batch-size 2 2 48 up to --global-batch-size 8: 16 samples at each size, then 8.
BATCH_SIZES = [2] * 8 + [4] * 4 + [6] * 3 + [8] * 5

ITERATION_LINE = re.compile(
    r"\] iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|[^\n]*?global batch size:\s+(\d+) \|"
    r"(?: lm loss: (\S+) \|)? loss scale: (\S+) \|[^\n]*?number of skipped iterations:\s+(\d+)")
VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


@dataclass(frozen=True)
class Iteration:
    """One of Megatron's per-iteration log lines (``--log-interval 1``)."""

    iteration: int
    consumed_samples: int
    batch_size: int
    lm_loss: float | None  # Megatron prints none for a skipped iteration
    loss_scale: float
    skipped: bool


def iterations(output: str) -> list[Iteration]:
    return [Iteration(int(it), int(consumed), int(batch), float(loss) if loss else None, float(scale), skipped != "0")
            for it, consumed, batch, loss, scale, skipped in ITERATION_LINE.findall(output)]


@dataclass(frozen=True)
class ExampleRuns:
    first: str
    resumed: str
    checkpoints: Path
    tensorboard: Path
    metrics_file: Path



def _run_script(out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = ["bash", str(SCRIPT), str(out / "checkpoints"), str(out / "tensorboard"),
               "--canzona-metrics-file", str(out / "metrics.jsonl"), *extra]
    result = run_with_deadline(command, timeout_s=RUN_TIMEOUT_S,
                               env={"PYTHON": sys.executable, "MASTER_PORT": str(free_port())})
    if result.returncode != 0:
        pytest.fail(f"{' '.join(command[1:])} exited {result.returncode}:\n{result.stdout[-6000:]}")
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> ExampleRuns:
    out = tmp_path_factory.mktemp("gpt3_tiny")
    first = _run_script(out, "--exit-interval", str(STOP_AT))
    resumed = _run_script(out)
    return ExampleRuns(first.stdout, resumed.stdout, out / "checkpoints", out / "tensorboard", out / "metrics.jsonl")


def test_the_run_stops_saved_and_resumes_from_that_iteration(runs: ExampleRuns) -> None:
    first, resumed = iterations(runs.first), iterations(runs.resumed)
    assert [i.iteration for i in first] == list(range(1, STOP_AT + 1)), runs.first[-4000:]
    assert f"saving checkpoint at iteration {STOP_AT:7d}" in runs.first
    assert re.search(rf"successfully loaded checkpoint from \S+ \[[^\]]*\] at iteration {STOP_AT}\n", runs.resumed)
    assert [i.iteration for i in resumed] == list(range(STOP_AT + 1, TRAIN_ITERS + 1)), runs.resumed[-4000:]
    # The ramp's batch size continues from the samples the checkpoint counted.
    assert resumed[0].consumed_samples == first[-1].consumed_samples + resumed[0].batch_size
    assert (runs.checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == str(TRAIN_ITERS)
    # --save-interval 5, plus Megatron's own save whenever the ramp changes the micro-batch count.
    saved = sorted({int(n) for n in re.findall(r"saving checkpoint at iteration +(\d+)", runs.first + runs.resumed)})
    assert saved == [5, 8, 10, 12, 15, 20], saved


def test_the_batch_ramps_up_as_the_old_rampup_did(runs: ExampleRuns) -> None:
    assert "--rampup-batch-size 2 2 48 runs as --step-batch-size-schedule '0:2 1024:4 2048:6 3072:8'" in runs.first
    logged = iterations(runs.first) + iterations(runs.resumed)
    assert [i.batch_size for i in logged] == BATCH_SIZES
    assert [i.consumed_samples for i in logged] == [sum(BATCH_SIZES[:k + 1]) for k in range(TRAIN_ITERS)]
    # Canzona's throughput counts the tokens of the batch each iteration actually had.
    metrics = read_metrics(runs.metrics_file)
    assert [m["iteration"] for m in metrics] == list(range(1, TRAIN_ITERS + 1))
    for m, batch in zip(metrics, BATCH_SIZES):
        assert m["tokens_per_s"] * m["iteration_ms"] / 1000 == pytest.approx(batch * SEQ_LENGTH, rel=1e-9)


def test_fp16_overflow_skips_the_step_and_halves_the_loss_scale(runs: ExampleRuns) -> None:
    """Megatron's dynamic loss scaling under --canzona, across the resume: the first overflow
    only uses up the hysteresis (--hysteresis 2), every later one halves the scale; a step
    without overflow keeps it (no growth within --loss-scale-window 1000) and has a finite
    loss. The resumed run goes on from the saved scale and hysteresis."""
    logged = iterations(runs.first) + iterations(runs.resumed)
    metrics = read_metrics(runs.metrics_file)
    assert logged[0].skipped and logged[0].loss_scale == INITIAL_LOSS_SCALE, runs.first[-4000:]
    scale, overflows = INITIAL_LOSS_SCALE, 0
    for i, m in zip(logged, metrics, strict=True):
        if i.skipped:
            overflows += 1
            scale = scale / 2 if overflows >= 2 else scale
            # A skipped step's loss is logged, not 0 (its interval trained nothing: the line shows
            # the skipped iterations' loss), and Canzona's metrics give the same.
            assert i.lm_loss is not None and math.isfinite(i.lm_loss) and i.lm_loss > 0
            assert m["lm_loss"] == pytest.approx(i.lm_loss, rel=1e-5)
        else:
            assert i.lm_loss is not None and math.isfinite(i.lm_loss) and i.lm_loss > 0
            assert m["lm_loss"] == pytest.approx(i.lm_loss, rel=1e-5)
        assert i.loss_scale == scale, f"iteration {i.iteration}: loss scale {i.loss_scale}, expected {scale}"
    trained = [i.iteration for i in logged if not i.skipped]
    assert overflows >= 2 and len(trained) >= TRAIN_ITERS // 2, [(i.iteration, i.loss_scale) for i in logged]
    assert any(t <= STOP_AT for t in trained) and any(t > STOP_AT for t in trained)


def test_losses_fall_and_tensorboard_has_the_scalars(runs: ExampleRuns) -> None:
    metrics = read_metrics(runs.metrics_file)
    for m in metrics:
        assert (m["dp_size"], m["tp_size"], m["optimizer"], m["canzona"]) == (1, 2, "muon", True)
    check_tensorboard(runs.tensorboard, metrics)
    losses = [i.lm_loss for i in iterations(runs.first) + iterations(runs.resumed) if i.lm_loss is not None]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.1, losses
    validation = dict((int(it), float(loss)) for it, loss in VALIDATION_LINE.findall(runs.first + runs.resumed))
    assert sorted(validation) == [5, 10, 15, 20], validation
    assert validation[20] < validation[10] < validation[5], validation


# --------------------------------------------------------------------------- the ramp alone


def _ramp_args(rampup: list[int], global_batch_size: int, *, micro_batch_size: int = 1, dp_size: int = 1,
               seq_length: int | None = 2048, step_batch_size_schedule: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(rampup_batch_size=rampup, global_batch_size=global_batch_size,
                              micro_batch_size=micro_batch_size, data_parallel_size=dp_size, seq_length=seq_length,
                              step_batch_size_schedule=step_batch_size_schedule, decrease_batch_size_if_needed=False)


@pytest.mark.parametrize("rampup, global_batch_size, seq_length", [
    ([16, 16, 5859375], 1536, 2048),  # the 175B example's ramp
    ([2, 2, 48], 8, 64),  # the tiny example's
    ([2, 2, 3], 12, None),  # fewer samples than increments: some thresholds take several at once
])
def test_the_schedule_gives_the_batch_of_the_old_ramp(rampup: list[int], global_batch_size: int,
                                                      seq_length: int | None) -> None:
    """Megatron's step-schedule calculator on the translated ramp against the ramp's rule from
    earlier Megatron releases, batch = START + INCREMENT * floor(consumed / (SAMPLES / n)),
    at every threshold and one sample either side of it."""
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

    start, increment, samples = rampup
    schedule = rampup_as_step_schedule(_ramp_args(rampup, global_batch_size, seq_length=seq_length))
    calculator = StepBatchsizeNumMicroBatchesCalculator(micro_batch_size=1, data_parallel_size=1,
                                                        decrease_batch_size_if_needed=False, rank=1,
                                                        schedule=schedule, seq_length=seq_length)
    num_increments = (global_batch_size - start) // increment
    probes = {c + d for c, _ in calculator.schedule for d in (-1, 0, 1) if c + d >= 0} | {samples * 2}
    for consumed in sorted(probes):
        calculator.update(consumed, consistency_check=True)
        expected = min(global_batch_size, start + increment * (consumed * num_increments // samples))
        assert calculator.get_current_global_batch_size() == expected, consumed


@pytest.mark.parametrize("args, message", [
    (_ramp_args([3, 2, 48], 8), "8 - START a multiple of INCREMENT"),
    (_ramp_args([2, 2, 48], 8, micro_batch_size=2, dp_size=2), "reaches a batch of 2, not a multiple of"),
    (_ramp_args([2, 2, 48], 8, step_batch_size_schedule="0:8"), "keep one"),
])
def test_a_ramp_megatron_cannot_run_is_one_line_naming_the_fix(args: argparse.Namespace, message: str) -> None:
    with pytest.raises(CanzonaArgumentError, match=re.escape(message)):
        rampup_as_step_schedule(args)
