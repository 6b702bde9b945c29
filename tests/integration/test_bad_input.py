"""Bad input stops at parse time with one line naming the flag and the fix, where Megatron-Core
0.19.2 would answer with a bare assert, a deep traceback, another flag's name or nothing."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from canzona_patches.checkpoints.files import one_line_errors
from canzona_patches.errors import CanzonaCheckpointError
from canzona_patches.integration.arguments import (
    CanzonaArgumentError,
    add_canzona_args,
    check_common_args,
)

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "10", "--lr", "1e-3", "--eval-interval", "5"]


def parse(*flags: str) -> argparse.Namespace:
    from megatron.training.arguments import add_megatron_arguments

    parser = add_canzona_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    return parser.parse_args([*BASE, *flags])


def test_a_sound_command_line_passes(tmp_path: Path) -> None:
    from megatron.canzona.data import TokenizerTrainConfig, train_sentencepiece

    # the tokenizer model is loaded at parse time: a real one (a page of a shipped book, ~0.5 s)
    page = (ROOT / "data" / "books" / "austen-emma.txt").read_text()[:200_000].split("\n\n")
    tokenizer = train_sentencepiece(page, tmp_path / "tokenizer", TokenizerTrainConfig(vocab_size=400, num_threads=1),
                                    log=lambda line: None)
    check_common_args(parse("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tokenizer),
                            "--data-path", "0.3", "a", "0.7", "b", "--canzona-metrics-file",
                            str(tmp_path / "new" / "m.jsonl")), {"WORLD_SIZE": "4"})
    check_common_args(parse("--data-path", "a", "b"), {"WORLD_SIZE": "2"})


@pytest.mark.parametrize(("flags", "world", "message"), [
    (["--lr-warmup-iters", "10"], 1, "--lr-warmup-iters 10 is not below --train-iters 10"),
    (["--hidden-size", "66"], 1, "--hidden-size 66 is not divisible by --num-attention-heads 4"),
    (["--global-batch-size", "12"], 4, "--global-batch-size 12 is not a multiple of --micro-batch-size 2 x "
                                       "data-parallel size 4"),
    (["--ddp-bucket-size", "0"], 1, "--ddp-bucket-size 0 must be a positive number"),
    (["--ddp-bucket-size", "-5"], 4, "--ddp-bucket-size -5 must be a positive number"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "/no/such/tokenizer.model"], 1,
     "--tokenizer-model /no/such/tokenizer.model does not exist"),
    (["--data-path", "0.5", "a", "0.5"], 1, "--data-path 0.5 a 0.5: a blend is weight-prefix pairs"),
    (["--data-path", "a", "0.5", "b"], 1, "a blend is weight-prefix pairs"),
])
def test_bad_flags_are_one_line_naming_the_fix(flags: list[str], world: int, message: str) -> None:
    with pytest.raises(CanzonaArgumentError, match=message.replace("(", r"\(")) as raised:
        check_common_args(parse(*flags), {"WORLD_SIZE": str(world)})
    assert "\n" not in str(raised.value)


def test_no_eval_interval_is_one_line_not_a_type_error() -> None:
    args = parse()
    args.eval_interval = None  # what Megatron's parser gives without --eval-interval
    with pytest.raises(CanzonaArgumentError, match="--eval-interval is not set: .* pass --eval-interval N"):
        check_common_args(args, {})
    args.skip_train = True  # evaluation alone: no division, nothing to say
    check_common_args(args, {})


def test_a_metrics_file_under_a_regular_file(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(CanzonaArgumentError, match="is a file, not a directory"):
        check_common_args(parse("--canzona-metrics-file", str(blocker / "sub" / "m.jsonl")), {})


def test_pretrain_gpt_under_plain_python_says_how_to_launch_it() -> None:
    done = subprocess.run([sys.executable, "pretrain_gpt.py", *BASE, "--mock-data", "--tokenizer-type", "NullTokenizer",
                           "--vocab-size", "64"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_ADDR")})
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        "pretrain_gpt.py: error: no RANK or MASTER_ADDR in the environment: launch one process per rank with torchrun")


def test_plan_rejects_a_negative_parallel_size() -> None:
    done = subprocess.run([sys.executable, "tools/plan.py", "--tp", "-2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "plan.py: error: argument --tp/--tensor-model-parallel-size: -2 is below 1: pass a whole number of 1 or more")


def test_a_resumed_schedule_that_differs_names_megatrons_two_flags(tmp_path: Path) -> None:
    """Resuming with another --train-iters: Megatron's bare assert becomes one line naming
    --use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    def scheduler(decay_steps: int) -> OptimizerParamScheduler:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
        return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2,
                                       lr_decay_steps=decay_steps, lr_decay_style="cosine", start_wd=0.1,
                                       end_wd=0.1, wd_incr_steps=decay_steps, wd_incr_style="constant",
                                       use_checkpoint_opt_param_scheduler=False)

    saved = scheduler(100).state_dict()
    with pytest.raises(CanzonaCheckpointError) as raised:
        with one_line_errors(tmp_path):
            scheduler(200).load_state_dict(saved)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{tmp_path}: this run's ")
    assert "200" in message and "100" in message
    assert "--use-checkpoint-opt_param-scheduler" in message and "--override-opt_param-scheduler" in message


def test_a_schedule_mismatch_says_samples_as_samples_and_iterations_as_iterations(tmp_path: Path) -> None:
    """Megatron counts the schedule's lengths in samples under names that say iterations: the
    line says samples, and iterations of the global batch where the run counts iterations; a
    run that would end before the checkpoint's iteration is told to raise --train-iters, since
    --override-opt_param-scheduler would then train nothing."""
    from canzona_patches.checkpoints.files import schedule_mismatch

    args = argparse.Namespace(train_iters=6, global_batch_size=8)
    message = schedule_mismatch(tmp_path / "iter_0000004", "total number of iterations", "48", "128", args)
    assert "learning-rate decay is 48 samples (6 iterations of 8), the checkpoint's 128 samples (16 iterations of 8)" \
        in message and "--override-opt_param-scheduler" in message
    message = schedule_mismatch(tmp_path / "iter_0000016", "total number of iterations", "48", "128", args)
    assert message.endswith("the checkpoint is at iteration 16 and this run's --train-iters 6 ends there or before: "
                            "nothing would train; raise --train-iters above 16")
    assert "samples" in schedule_mismatch(tmp_path, "warmup iterations", "16", "24", None)


def test_a_run_that_trained_nothing_unasked_says_why() -> None:
    from collections import Counter

    from canzona_patches.integration.skipped import run_skipped_warning
    from canzona_patches.integration.training import nothing_trained

    def run(**kw):
        return argparse.Namespace(**{"train_iters": 20, "iteration": 0, "skip_train": False, "fp16": True,
                                     "initial_loss_scale": 2.0 ** 32, **kw})

    overflow = Counter(overflow=20)
    assert nothing_trained(run(), trained=3, skipped=2, reasons=overflow) is None
    assert "all 20 iterations were skipped" in nothing_trained(run(), trained=0, skipped=20, reasons=overflow)
    assert "--initial-loss-scale (this run's: 4.29497e+09)" in nothing_trained(run(), 0, 20, reasons=overflow)
    assert nothing_trained(run(iteration=20), trained=0, skipped=0) is None  # asked: train-iters = loaded
    assert nothing_trained(run(skip_train=True), trained=0, skipped=0) is None
    assert "raise --train-iters above 48" in nothing_trained(run(iteration=48), trained=0, skipped=0)
    line = run_skipped_warning(5, Counter(overflow=5), run(), None, 2.0 ** 27)
    assert line.startswith("[canzona] warning: all 5 iteration(s) so far were skipped (the loss scale is now 1.34218e+08)")
    assert "--initial-loss-scale" in line


@pytest.mark.parametrize(("grad_norm", "fp16", "reason"), [
    (None, True, "overflow"), (float("inf"), True, "overflow"), (float("nan"), False, "nonfinite"),
    (float("inf"), False, "nonfinite"), (7.5, False, "threshold"), (7.5, True, "threshold")])
def test_a_skipped_iteration_is_told_by_its_norm(grad_norm, fp16, reason) -> None:
    from canzona_patches.integration.skipped import skip_reason

    assert skip_reason(grad_norm, argparse.Namespace(fp16=fp16)) == reason


def test_skips_over_the_threshold_name_the_threshold_not_the_loss_scale() -> None:
    """An fp32 run, or Megatron's own optimizer, skipping every step over --grad-norm-skip-threshold
    is told so (it used to read "the fp16 loss scale overflowed ... --initial-loss-scale")."""
    from collections import Counter

    from canzona_patches.integration.skipped import nothing_trained_line, why_skipped

    args = argparse.Namespace(fp16=False, grad_norm_skip_threshold=0.5, initial_loss_scale=None,
                              check_for_nan_in_loss_and_grad=True)
    line = nothing_trained_line(4, Counter(threshold=4), args, 0.93)
    assert line == ("all 4 iterations were skipped: the gradient norm was over --grad-norm-skip-threshold 0.5 (last: "
                    "0.93) each time and nothing trained; raise --grad-norm-skip-threshold (or drop it), or lower --lr")
    assert "loss scale" not in line
    mixed = why_skipped(Counter(overflow=1, threshold=2), argparse.Namespace(fp16=True, initial_loss_scale=2.0 ** 16,
                                                                            grad_norm_skip_threshold=3.0), last_norm=4.0)
    assert mixed.startswith("1 because the fp16 loss scale overflowed, 2 because the gradient norm was over "
                            "--grad-norm-skip-threshold 3") and "--initial-loss-scale" in mixed


def test_an_unwritable_metrics_file_fails_at_start_up(tmp_path: Path) -> None:
    """Opened while the flags are checked, so it fails before the first iteration, in one line
    (it used to be a PermissionError after iteration 1). /proc refuses new files even to root."""
    with pytest.raises(CanzonaArgumentError, match=r"--canzona-metrics-file /proc/canzona/m.jsonl cannot be written"):
        check_common_args(parse("--canzona-metrics-file", "/proc/canzona/m.jsonl"), {})
    readonly = tmp_path / "metrics.jsonl"
    check_common_args(parse("--canzona-metrics-file", str(readonly)), {})
    assert readonly.is_file()  # created where it can be


def test_a_hugging_face_directory_given_to_load_points_to_the_converter(tmp_path: Path) -> None:
    from canzona_patches.checkpoints.state import _check_nothing_to_resume

    hf = tmp_path / "Qwen3-8B"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(CanzonaCheckpointError) as raised:
        _check_nothing_to_resume(str(hf), None)
    message = str(raised.value)
    assert message.startswith(f"--load {hf} is a Hugging Face model directory") and "\n" not in message
    assert f"python tools/convert_hf.py import --hf {hf} --save <dir>" in message
    (hf / "model-00001-of-00002.safetensors").unlink()  # config.json alone: just no checkpoint
    with pytest.raises(CanzonaCheckpointError, match="holds no checkpoint"):
        _check_nothing_to_resume(str(hf), None)
