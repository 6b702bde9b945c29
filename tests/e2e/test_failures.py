"""How a training job fails: a rank that dies, a loss that turns NaN.

Both run the qwen3-tiny recipe (examples/qwen3/pretrain_qwen3_tiny.sh: torchrun, 2 gloo
ranks, AdamW) on the demo data, with a deadline on every wait: a job that hangs instead of
failing fails the test, and its whole process group is killed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from megatron.canzona.runtime.lifetime import end_session, ranks_of, running

from .support import ROOT, DemoData

pytestmark = [pytest.mark.slow, pytest.mark.alone]

RECIPE = ROOT / "examples" / "qwen3" / "pretrain_qwen3_tiny.sh"
START_TIMEOUT_S = 240  # until the first iterations are logged (each rank imports Megatron: ~15 s)
EXIT_AFTER_KILL_S = 60  # a dead rank must end the job within this
NAN_RUN_TIMEOUT_S = 240


class Job:
    """A recipe run in its own session whose output is collected line by line as it comes."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
        self.process = subprocess.Popen(["bash", str(RECIPE), *args], cwd=ROOT, env=full_env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        """The first match of ``pattern`` in the output; fails the test at the deadline or exit."""
        deadline = time.monotonic() + timeout_s
        regex = re.compile(pattern)
        with self._changed:
            while True:
                match = regex.search("".join(self.lines))
                if match:
                    return match
                if self.process.poll() is not None and not self._reader.is_alive():
                    pytest.fail(f"job exited ({self.process.returncode}) before /{pattern}/:\n{self.output_tail()}")
                if time.monotonic() > deadline:
                    self.kill()
                    pytest.fail(f"no /{pattern}/ within {timeout_s} s:\n{self.output_tail()}")
                self._changed.wait(timeout=1.0)

    def wait(self, timeout_s: float) -> int:
        """The exit status; at the deadline the process group is killed and the test fails."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"job still running {timeout_s} s later (a hang):\n{self.output_tail()}")
        self._reader.join(timeout=10)
        return code

    def finish(self, timeout_s: float) -> tuple[int, str]:
        """The exit status and the whole output; the process group is killed whatever happens."""
        try:
            return self.wait(timeout_s), self.output
        finally:
            self.kill()

    def kill(self) -> None:
        end_session(self.process)

    def output_tail(self, chars: int = 6000) -> str:
        return self.output[-chars:]


def recipe_env(data: DemoData, tmp_path: Path, **extra: str) -> dict[str, str]:
    """The tiny recipe on the test's demo data, logging every iteration, no checkpoints."""
    return {"DATA_PATH": data.data_prefix, "TOKENIZER_MODEL": str(data.tokenizer_model), "SPLIT": "80,10,10",
            "LOG_DIR": str(tmp_path), "CKPT_DIR": "none", "LOG_INTERVAL": "1", "EVAL_INTERVAL": "100000",
            "WARMUP_ITERS": "1", "NPROC_PER_NODE": "2", "VARIANT": "adamw", **extra}


def test_a_killed_rank_ends_the_job_naming_rank_and_signal(demo_data: DemoData, tmp_path: Path) -> None:
    """SIGKILL one rank mid-training: torchrun stops the other and exits non-zero, saying which
    rank died of what, within EXIT_AFTER_KILL_S."""
    job = Job(recipe_env(demo_data, tmp_path, TRAIN_ITERS="100000"))
    try:
        job.wait_for(r"iteration +3/ +100000 \|", START_TIMEOUT_S)
        # The recipe execs torchrun, whose children are the ranks.
        ranks = ranks_of(job.process.pid)
        assert set(ranks) >= {"0", "1"}, f"ranks of torchrun {job.process.pid}: {ranks}"
        victim = ranks["1"]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        code = job.wait(EXIT_AFTER_KILL_S)
        took_s = time.monotonic() - killed_at
    finally:
        job.kill()
    out = job.output
    assert code != 0, out[-6000:]
    assert took_s < EXIT_AFTER_KILL_S
    # torchrun's failure report names the rank, its PID and the signal.
    assert re.search(rf"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9 \(pid: {victim}\)", out), out[-6000:]
    assert f"Signal 9 (SIGKILL) received by PID {victim}" in out, out[-6000:]
    assert "iteration      100000/" not in out


@pytest.fixture(scope="module")
def nan_run(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str]:
    """AdamW at lr 1e6: the weights blow up within a few steps and the gradients turn NaN."""
    job = Job(recipe_env(demo_data, tmp_path_factory.mktemp("nan"), TRAIN_ITERS="20", LR="1e6", MIN_LR="0"))
    return job.finish(NAN_RUN_TIMEOUT_S)


NAN_REPORT = r"Rank (\d+), node \S+, device \S+, iteration (\d+): Unexpected result nan \(message='([^']*)'\)"


def test_nan_stops_the_job_naming_rank_and_iteration(nan_run: tuple[int, str]) -> None:
    """--rerun-mode disabled (set by the recipes): the first NaN is a RuntimeError on every rank."""
    code, out = nan_run
    assert code != 0, out[-6000:]
    reports = re.findall(NAN_REPORT, out)
    assert reports, out[-6000:]
    assert {rank for rank, _, _ in reports} == {"0", "1"}
    assert all("NaN" in message for _, _, message in reports), reports
    assert len({iteration for _, iteration, _ in reports}) == 1, reports
    # Training stopped there: the iteration reported never finished.
    reported = int(reports[0][1])
    assert not re.search(rf"iteration +{reported}/ +20 \|", out)
    assert "iteration       20/" not in out


def test_nan_report_names_the_iteration_that_failed(nan_run: tuple[int, str]) -> None:
    """With a log line per iteration, the failing one is the first that was not logged.
    (Megatron-Core 0.19.2 alone names the next one; canzona_patches.integration.megatron_fixes.numbering_the_step.)"""
    _, out = nan_run
    logged = [int(n) for n in re.findall(r"\] iteration +(\d+)/ +20 \| consumed samples", out)]
    reported = int(re.findall(NAN_REPORT, out)[0][1])
    assert logged == list(range(1, len(logged) + 1)), logged
    assert reported == logged[-1] + 1, (logged, reported)


LAUNCHER_GONE_S = 10  # a rank must end within this of its torchrun's death
RANK_TRACEBACK = re.compile(r'File "[^"]*(canzona_patches|megatron/canzona|megatron/training|megatron/core|pretrain_gpt\.py)')
"""A frame of a rank's own code in a traceback (torchrun prints its own when a rank fails)."""


def test_ranks_end_when_their_launcher_is_killed(demo_data: DemoData, tmp_path: Path) -> None:
    """SIGKILL torchrun itself mid-training: its ranks, re-parented, must not train on
    (megatron.canzona.runtime.lifetime: each rank asks for a signal at its parent's death).

    Meanwhile (its ranks paused, as by a busy node) a second job given the same --save stops at start
    naming the first, and ends at once (its rank 1 waits in the rendezvous for rank 0, which stopped)
    (megatron.canzona.runtime.save_lock); the first, whose --load is its --save and empty,
    said it starts from iteration 0."""
    ckpt = tmp_path / "ckpt"
    env = recipe_env(demo_data, tmp_path, TRAIN_ITERS="100000", CKPT_DIR=str(ckpt), SAVE_INTERVAL="100000")
    job = Job(env)
    ranks: list[int] = []
    try:
        job.wait_for(r"iteration +3/ +100000 \|", START_TIMEOUT_S)
        assert f"[canzona] --load {ckpt} holds no checkpoint yet: training starts from iteration 0" in job.output
        by_local_rank = ranks_of(job.process.pid)
        ranks = list(by_local_rank.values())
        assert len(ranks) == 2, f"ranks of torchrun {job.process.pid}: {by_local_rank}"
        first = by_local_rank["0"]
        for pid in ranks:  # paused while the second job starts: it gets both cores (its lock stays held)
            os.kill(pid, signal.SIGSTOP)
        try:
            # its rank 0 starts 3 s late, so that rank 1 waits for it in the rendezvous when it stops
            late = {"ENTRY": str(ROOT / "canzona_patches" / "harness" / "pretrain_with_fault.py"),
                    "CANZONA_START_DELAY": "0:3"}
            code, second = Job({**env, **late, "LOG_DIR": str(tmp_path / "second")}, "--train-iters", "2").finish(
                START_TIMEOUT_S)
        finally:
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
        assert code != 0, second[-6000:]
        assert re.search(rf"pretrain_gpt.py: error: --save {re.escape(str(ckpt))} is in use by another job "
                         rf"\(PID {first} on [^;]+; lock file {re.escape(str(ckpt))}/canzona.lock\): wait for it",
                         second), second[-6000:]
        assert not RANK_TRACEBACK.search(second) and "iteration        1/" not in second, second[-6000:]
        # its rank 1, blocked in the rendezvous, ended by torchrun's SIGTERM, not by the SIGKILL that
        # follows 30 s later when a Python handler that cannot run there has taken SIGTERM
        assert "(SIGTERM)" in second and "(SIGKILL)" not in second, second[-3000:]
        os.kill(job.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + LAUNCHER_GONE_S
        while time.monotonic() < deadline and any(running(pid) for pid in ranks):
            time.sleep(0.2)
        survivors = [pid for pid in ranks if running(pid)]
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.kill()
    assert not survivors, f"ranks {survivors} outlived their launcher by {LAUNCHER_GONE_S} s"


def test_nan_without_a_save_directory_says_so_and_exits_with_megatrons_code(demo_data: DemoData,
                                                                           tmp_path: Path) -> None:
    """Under --rerun-mode validate_results a NaN makes Megatron checkpoint and exit; with no
    --save that is one line, not a traceback from the staged save."""
    code, out = Job(recipe_env(demo_data, tmp_path, TRAIN_ITERS="20", LR="1e6", MIN_LR="0"),
                    "--rerun-mode", "validate_results").finish(NAN_RUN_TIMEOUT_S)
    assert code != 0, out[-6000:]
    assert re.search(r"\[canzona\] iteration \d+ asks for a checkpoint, but there is no --save directory: "
                     r"nothing saved", out), out[-6000:]
    assert not RANK_TRACEBACK.search(out) and "TypeError" not in out, out[-6000:]
    # torchrun reports the ranks' exit code: Megatron's, not a crash's 1.
    assert re.search(r"exitcode\s*: (1[0-9])\b", out), out[-6000:]


def test_a_load_directory_without_a_checkpoint_stops_the_job(demo_data: DemoData, tmp_path: Path) -> None:
    """A typo in --load would train from scratch and exit 0: it stops with one line, unless
    --load is --save (the requeue pattern), which starts afresh and says so."""
    typo = tmp_path / "ckpt-typo"
    code, out = Job(recipe_env(demo_data, tmp_path, CKPT_DIR=str(tmp_path / "ckpt"), TRAIN_ITERS="2",
                               SAVE_INTERVAL="100"), "--load", str(typo)).finish(START_TIMEOUT_S)
    assert code != 0, out[-6000:]
    assert f"pretrain_gpt.py: error: --load {typo} does not exist: fix the path" in out, out[-6000:]
    assert not RANK_TRACEBACK.search(out) and "iteration        1/" not in out, out[-6000:]
