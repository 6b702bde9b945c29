"""A rank ends when its launcher does.

torchrun's agent is the parent of every rank it starts. Killed with SIGKILL (an OOM killer,
``kill -9``, a node agent), it cannot stop them: they are re-parented to init and go on
training, holding the node's GPUs and writing checkpoints nobody waits for. Each rank
therefore asks the kernel for a signal when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``)
or, elsewhere, watches its parent from a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal this process gets when the thread that forked it exits."""
WATCH_INTERVAL_S = 1.0
"""How often the watchdog (systems without ``prctl``) looks at its parent."""


def launched_by_torchrun(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether this process is a rank torchrun's agent started (it sets ``TORCHELASTIC_RUN_ID``)."""
    return "TORCHELASTIC_RUN_ID" in environ


def end_with_parent(signal_number: int = signal.SIGKILL) -> str:
    """Deliver ``signal_number`` to this process when its parent dies; returns how: ``prctl``
    or ``watchdog``. SIGKILL by default: a rank whose launcher is gone has no one to report to,
    and a checkpoint it is writing stays staged (the previous one stays loadable).

    ``prctl``'s signal follows the death of the *thread* that started this process; torchrun's
    agent starts its ranks from its main thread, which lives as long as the agent."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal_number, 0, 0, 0) == 0:
            if os.getppid() != parent:  # the parent died before the request took effect
                os.kill(os.getpid(), signal_number)
            return "prctl"

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_INTERVAL_S)
        os.kill(os.getpid(), signal_number)

    threading.Thread(target=watch, name="canzona-parent-watchdog", daemon=True).start()
    return "watchdog"


def ranks_of(launcher_pid: int) -> dict[str, int]:
    """The ranks a torchrun agent started, by local rank: its children that carry
    ``LOCAL_RANK`` (Linux ``/proc``; for tools and tests that watch a job from outside)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != launcher_pid:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        local = next((entry[len(b"LOCAL_RANK="):].decode() for entry in environ if entry.startswith(b"LOCAL_RANK=")), None)
        if local is not None:
            found[local] = int(stat.parent.name)
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` runs on this host: it exists (another user's included), and is not a
    zombie waiting for its reaper (read from Linux ``/proc`` where there is one)."""
    try:
        os.kill(pid, 0)
    except OSError as error:
        if error.errno != errno.EPERM:
            return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc entry to read (another system): it exists


def end_session(process: subprocess.Popen) -> int:
    """SIGKILL every process of the session ``process`` leads (one started with
    ``start_new_session=True``: a launcher and its ranks) and reap ``process``; its exit code."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the whole session has ended
    return process.wait()


@contextlib.contextmanager
def signal_held(signal_number: int = signal.SIGTERM) -> Iterator[None]:
    """Hold ``signal_number`` off while the block runs, then take it as it would have been taken.

    torchrun ends a job's other ranks (SIGTERM) within its monitor interval (0.1 s) of the first
    rank's exit. At start-up every rank fails a bad flag alike and only the first rank prints the
    line, so a rank that got there first would have torchrun end the printing one before it
    printed: the printing rank holds the signal over its checks and its line (torchrun's SIGKILL
    follows only after its shutdown timeout, 30 s by default). A handler the block installs for
    the signal (Megatron's ``--exit-signal-handler``, set while the flags are checked) is kept,
    and a signal held meanwhile goes to it. Outside the main thread, where no handler can be
    set, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def hold(number: int, frame: Any) -> None:
        received.append(number)

    previous = signal.signal(signal_number, hold)
    try:
        yield
    finally:
        if signal.getsignal(signal_number) is hold:
            signal.signal(signal_number, previous)
        if received:
            os.kill(os.getpid(), signal_number)
