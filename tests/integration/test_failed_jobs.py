"""The pieces of a failed job's report: a lost peer read from gloo's words, a failed save's
leftovers removed, the resume advice, and the loss of an interval that trained nothing.
(tests/e2e/test_failures_round3.py runs them in real jobs.)"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import pytest
import torch

from canzona_patches.checkpoints.recovery import clear_failed_saves, describe_bytes, resume_advice
from canzona_patches.harness.host_syncs import count_host_syncs
from canzona_patches.integration.skipped import ADVANCED, SkippedLosses
from megatron.canzona.runtime.peers import lost_peer_words

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:2973: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
              "application. Check the logs of the remote worker before reporting an error. GLHF!")


def test_a_lost_peer_is_read_from_gloos_words_through_the_chain() -> None:
    assert lost_peer_words(RuntimeError(GLOO_RESET)) == "Read error [127.0.0.1]:2973: Connection reset by peer"
    try:
        try:
            raise RuntimeError(GLOO_RESET)
        except RuntimeError as error:
            raise ValueError("saving iteration 4 failed") from error
    except ValueError as wrapped:
        assert lost_peer_words(wrapped) == "Read error [127.0.0.1]:2973: Connection reset by peer"
    assert lost_peer_words(RuntimeError("Rank 0: Unexpected result nan")) is None
    assert lost_peer_words(RuntimeError("The client socket has failed to connect: Connection refused")) is None


def _digests(directory: Path) -> dict[str, str]:
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file()}


def test_failed_saves_are_removed_and_complete_checkpoints_kept(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    (save / "iter_0000002").mkdir(parents=True)
    (save / "iter_0000002" / "__0_0.distcp").write_bytes(b"a" * 300)
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    (save / ".staging-iter_0000004" / "sub").mkdir(parents=True)
    (save / ".staging-iter_0000004" / "sub" / "__1_0.distcp").write_bytes(b"b" * 1500)
    (save / ".staging-deleting-0123abcd-iter_0000000").mkdir()
    (save / ".staging-deleting-0123abcd-iter_0000000" / "x").write_bytes(b"c" * 20)
    (save / ".staging-megatron-latest_checkpointed_iteration.txt").write_text("4")
    (save / ".staging-replaced-iter_0000006").mkdir()  # a re-save killed between its two renames
    (save / ".staging-replaced-iter_0000006" / "__0_0.distcp").write_bytes(b"d" * 7)
    kept = _digests(save / "iter_0000002")
    names, freed = clear_failed_saves(save)
    assert names == [".staging-deleting-0123abcd-iter_0000000", ".staging-iter_0000004",
                     ".staging-megatron-latest_checkpointed_iteration.txt"]
    assert freed == 1500 + 20 + 1
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000002", "iter_0000006", "latest_checkpointed_iteration.txt"]
    assert _digests(save / "iter_0000002") == kept and (save / "iter_0000006" / "__0_0.distcp").read_bytes() == b"d" * 7
    assert clear_failed_saves(save) == ([], 0) and clear_failed_saves(tmp_path / "absent") == ([], 0)
    assert describe_bytes(812) == "812 bytes" and describe_bytes(3_804_541) == "3.8 MB (3804541 bytes)"


def test_resume_advice_names_the_last_complete_checkpoint(tmp_path: Path) -> None:
    """The end of a one-line error (under 300 characters with a short path) and, on a line of its
    own, the command that resumes or starts again."""
    def args(**kw):
        return argparse.Namespace(**{"save": str(tmp_path), "load": str(tmp_path), **kw})

    advice, command = resume_advice(args(save=None))
    assert advice == "there is no --save: nothing to resume from (command to start again below)"
    assert command.startswith("  start again: ")
    assert resume_advice(args())[0].startswith(f"no complete checkpoint under --save {tmp_path}: nothing to resume")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    assert resume_advice(args())[0].startswith(f"no complete checkpoint under --save {tmp_path}")  # tracked, not there
    (tmp_path / "iter_0000004").mkdir()
    advice, command = resume_advice(args())
    assert advice == f"the last complete checkpoint is {tmp_path / 'iter_0000004'} (resume command below)"
    assert command.startswith("  resume: ") and "--load" not in command and "\n" not in command
    assert resume_advice(args(load=None))[1].endswith(f" --load {tmp_path}")


def test_an_interval_that_trained_nothing_logs_its_skipped_loss() -> None:
    losses = SkippedLosses()
    total: dict = {"lm loss": torch.tensor([0.0]), ADVANCED: 0}  # as Megatron resets it after a log
    with count_host_syncs() as reads:
        losses.record({"lm loss": torch.tensor(6.5)}, skipped_iter=1)
        losses.record({"lm loss": torch.tensor(7.5)}, skipped_iter=1)
    assert reads == [] and losses.all_skipped == 2
    with losses.honest(total, logging_now=True, reset=True):
        assert float(total["lm loss"] / max(1, total[ADVANCED])) == 7.0  # what training_log prints
    assert losses.all_skipped == 0  # a new interval
    losses.record({"lm loss": torch.tensor(1.0)}, skipped_iter=0)
    losses.record({"lm loss": torch.tensor(9.0)}, skipped_iter=1)
    total = {"lm loss": torch.tensor([1.0]), ADVANCED: 1}
    with losses.honest(total, logging_now=True, reset=True):
        assert float(total["lm loss"]) == 1.0  # a trained iteration: Megatron's own average stands
    losses.record({"lm loss": torch.tensor(3.0)}, skipped_iter=1)
    total = {ADVANCED: 0}
    with losses.honest(total, logging_now=True, reset=False):  # the first iteration, off the interval
        assert float(total["lm loss"]) == pytest.approx(3.0)
    assert "lm loss" not in total  # Megatron keeps its sums until the interval's line: left as they were
