"""The ``--save`` directory lock (megatron.canzona.runtime.save_lock) with real processes.

A holder is a child Python process that takes the lock and waits; what a second taker
sees depends on whether that holder runs, its host, its SLURM job id and its heartbeat.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron.canzona.runtime.save_lock import (
    LOCK_NAME,
    SaveDirectoryLocked,
    read_holder,
    take_save_lock,
)

ROOT = Path(__file__).resolve().parents[2]
HOLD = textwrap.dedent("""
    import sys, time
    from megatron.canzona.runtime.save_lock import take_save_lock
    take_save_lock(sys.argv[1])
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
""")


def start_holder(save: Path, hold_s: float = 60.0, **env: str) -> subprocess.Popen:
    child_env = {key: value for key, value in os.environ.items() if key != "SLURM_JOB_ID"}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(save), str(hold_s)], cwd=ROOT, text=True,
                              env={**child_env, **env}, stdout=subprocess.PIPE)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.fixture(autouse=True)
def outside_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


@pytest.mark.quick
def test_a_second_job_stops_naming_the_first(tmp_path: Path) -> None:
    holder = start_holder(tmp_path)
    try:
        with pytest.raises(SaveDirectoryLocked) as raised:
            take_save_lock(tmp_path)
        message = str(raised.value)
        assert f"PID {holder.pid} on {socket.gethostname()}" in message and str(tmp_path / LOCK_NAME) in message
        assert "\n" not in message and "another --save directory" in message
        assert read_holder(tmp_path / LOCK_NAME).pid == holder.pid  # the refused taker left it alone
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holders_lock_is_taken_over_and_ours_goes_at_exit(tmp_path: Path) -> None:
    holder = start_holder(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert read_holder(tmp_path / LOCK_NAME).pid == holder.pid  # SIGKILL leaves it behind
    lock = take_save_lock(tmp_path)
    assert lock.taken_over.pid == holder.pid and "no longer runs" in lock.taken_over_because
    assert read_holder(tmp_path / LOCK_NAME) == lock.holder and lock.holder.pid == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    # A holder that ends normally removes its lock.
    start_holder(tmp_path, hold_s=0).wait(timeout=60)
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_requeued_slurm_job_takes_its_own_lock_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    holder = start_holder(tmp_path, SLURM_JOB_ID="4242")  # the previous incarnation, still running
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "4343")
        with pytest.raises(SaveDirectoryLocked, match="SLURM job 4242"):
            take_save_lock(tmp_path)
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        lock = take_save_lock(tmp_path)
        assert lock.taken_over.pid == holder.pid and "requeued" in lock.taken_over_because
        lock.release()
    finally:
        holder.kill()
        holder.wait()


def test_another_nodes_lock_is_stale_once_its_heartbeat_stops(tmp_path: Path) -> None:
    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text('{"host": "node-elsewhere", "pid": 1, "job_id": null, "started": "then"}')
    with pytest.raises(SaveDirectoryLocked, match="PID 1 on node-elsewhere"):
        take_save_lock(tmp_path, stale_after_s=300)  # refreshed just now: alive, whatever its PID here
    old = time.time() - 301
    os.utime(lock_file, (old, old))
    lock = take_save_lock(tmp_path, stale_after_s=300)
    assert lock.taken_over.host == "node-elsewhere" and "not refreshed for" in lock.taken_over_because
    lock.release()


def test_the_holder_refreshes_its_lock(tmp_path: Path) -> None:
    lock = take_save_lock(tmp_path, heartbeat_s=0.05)
    try:
        old = time.time() - 1000
        os.utime(tmp_path / LOCK_NAME, (old, old))
        deadline = time.monotonic() + 10
        while (tmp_path / LOCK_NAME).stat().st_mtime < old + 900 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / LOCK_NAME).stat().st_mtime > old + 900
    finally:
        lock.release()
