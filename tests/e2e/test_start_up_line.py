"""The one line of a start-up error survives torchrun ending the job.

Every rank of a job fails a bad flag alike and only rank 0 prints why. torchrun sends SIGTERM to
the ranks still running within its monitor interval (0.1 s) of the first exit, so a rank 0 a
little behind its peers (reading the failing statement, compiling a module on its first import)
was ended before its line: ``tools/chaos.py --bad-input``'s ``micro-batch-0`` once exited 1 with
no line. ``pretrain_gpt.py`` holds SIGTERM over its checks (``signal_held``); here a rank 0 that
is one second late, under torchrun, prints its line with the signal held and loses it without.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .support import ROOT, run_with_deadline

LATE_RANK_0 = '''
import os, signal, sys, time
sys.path.insert(0, {root!r})
from megatron.canzona.runtime.lifetime import signal_held
import contextlib

hold = sys.argv[1] == "hold"
with signal_held(signal.SIGTERM) if hold and os.environ["RANK"] == "0" else contextlib.nullcontext():
    if os.environ["RANK"] == "0":
        time.sleep(3.0)  # well after rank 1's exit and torchrun's next look at it, on a loaded machine too
        print("late.py: error: the one line", file=sys.stderr, flush=True)
        print("rank 0 still here after its line", flush=True)
sys.exit(2)
'''


@pytest.mark.alone
@pytest.mark.parametrize("hold", ["hold", "no-hold"])
def test_a_late_rank_0_prints_its_line_while_it_holds_sigterm(hold: str, tmp_path: Path) -> None:
    script = tmp_path / "late.py"
    script.write_text(LATE_RANK_0.format(root=str(ROOT)))
    result = run_with_deadline([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                str(script), hold], timeout_s=120)
    out = result.stdout + (result.stderr or "")
    assert result.returncode != 0, out
    if hold == "hold":
        assert out.count("late.py: error: the one line") == 1, out
        # the held SIGTERM was taken once the block ended: rank 0 went no further
        assert "rank 0 still here" in out and "exitcode  : -15" in out, out
    else:  # the race the hold closes: torchrun ended rank 0 before it printed
        assert "the one line" not in out, out


SLOW_IMPORTS_RANK_0 = '''
import importlib.abc, os, runpy, sys, time
sys.path.insert(0, {root!r})


class SlowTorch(importlib.abc.MetaPathFinder):
    """Rank 0's first import of torch (pretrain_gpt.py's, after its first lines) takes 3 s more."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            time.sleep(3.0)  # well after rank 1's exit and torchrun's SIGTERM, on a loaded machine too
        return None


if os.environ["RANK"] == "0":
    sys.meta_path.insert(0, SlowTorch())
sys.argv = [{entry!r}, *sys.argv[1:]]
runpy.run_path({entry!r}, run_name="__main__")
'''


@pytest.mark.alone
def test_a_rank_0_still_importing_when_torchrun_ends_the_job_prints_its_line(tmp_path: Path) -> None:
    """pretrain_gpt.py holds SIGTERM from its first lines, before its imports (seconds on a loaded
    machine): rank 1 fails the flag and exits while rank 0 is still importing, and rank 0's line
    is printed all the same, once (the race seen in make test-all with two jobs at once)."""
    script = tmp_path / "slow_imports.py"
    script.write_text(SLOW_IMPORTS_RANK_0.format(root=str(ROOT), entry=str(ROOT / "pretrain_gpt.py")))
    result = run_with_deadline([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
                                "--canzona", "--optimizer", "adam", "--use-distributed-optimizer"], timeout_s=180)
    out = result.stdout + (result.stderr or "")
    assert result.returncode != 0, out
    assert out.count("pretrain_gpt.py: error: --canzona needs a matrix optimizer") == 1, out[-4000:]
    assert "exitcode  : -15" in out, out[-4000:]  # the SIGTERM was taken, once the line was out
