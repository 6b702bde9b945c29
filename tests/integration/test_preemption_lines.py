"""canzona_patches/integration/preemption.py: what a SIGTERM that tells the job to stop does on a
rank (tests/e2e/test_preemption.py runs it under torchrun and SLURM)."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import pytest

from canzona_patches.integration.preemption import stop_on_sigterm

pytestmark = pytest.mark.quick


def _args(tmp_path: Path, **kw) -> argparse.Namespace:
    return argparse.Namespace(**{"save": str(tmp_path / "ckpt"), "exit_signal": signal.SIGUSR1,
                                 "exit_signal_handler": True, "curr_iteration": 6, **kw})


def test_under_the_exit_handler_the_rank_goes_on_to_save(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    called = []
    assert stop_on_sigterm(_args(tmp_path), lambda sig, frame: called.append(sig), None, True) is True
    assert called == [signal.SIGUSR1]  # Megatron's handler of --exit-signal, whatever it names
    out = capsys.readouterr().out
    assert out.startswith("[canzona] SIGTERM after iteration 6: every rank saves a checkpoint to --save ")
    assert stop_on_sigterm(_args(tmp_path), lambda sig, frame: None, None, False) is True
    assert capsys.readouterr().out == ""  # one rank of the job speaks


def test_without_it_one_line_says_nothing_was_saved_then_the_previous_handler_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    shutdowns = []
    args = _args(tmp_path, exit_signal_handler=False, curr_iteration=None)
    assert stop_on_sigterm(args, None, lambda sig, frame: shutdowns.append(sig), True) is False
    err = capsys.readouterr().err
    assert err.startswith("pretrain_gpt.py: error: stopped by SIGTERM before training: nothing was saved (no "
                          "checkpoint under --save ") and "--exit-signal-handler" in err and err.count("\n") == 1
    assert shutdowns == [signal.SIGTERM]  # e.g. Megatron's --exit-signal-handler-for-training shutdown
    assert stop_on_sigterm(_args(tmp_path, exit_signal_handler=False, save=None), None, signal.SIG_DFL, True) is False
    assert "there is no --save" in capsys.readouterr().err
