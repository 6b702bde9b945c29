"""One job per ``--save`` directory: a lock file held for the job's life.

Two jobs saving into one directory tear each other's checkpoints (one's save moves the
other's staging directory aside mid-write). The first rank of a job that saves takes
``<save>/canzona.lock`` before anything else runs; a second job stops at start with one line
naming the holder (host, PID, SLURM job id).

Which lock is stale, on a filesystem shared by many nodes (NFS, Lustre, GPFS):

* the holder refreshes the file's modification time every :data:`HEARTBEAT_S` seconds; a lock
  not refreshed for :data:`STALE_AFTER_S` is stale, whichever node holds it. "Now" is the
  modification time of a file this process just touched in the same directory, so clocks that
  differ between nodes do not matter: both times come from the file server;
* a lock of this host whose PID no longer runs is stale at once (a job killed with SIGKILL
  leaves its lock behind; the next run on the node needs no wait);
* a job with the holder's SLURM job id takes it over: a requeued job (``scontrol requeue``, a
  node failure) is the same job, and its previous incarnation is gone.

Taking a lock is ``O_CREAT | O_EXCL`` (atomic on NFSv3+ and parallel filesystems); taking a
stale one renames it away first, so of two jobs racing for it exactly one rename succeeds.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron.canzona.runtime.lifetime import running

LOCK_NAME = "canzona.lock"
"""The lock file's name inside the ``--save`` directory."""
HEARTBEAT_S = 30.0
"""How often the holder refreshes the lock's modification time."""
STALE_AFTER_S = 300.0
"""A lock not refreshed for this long belongs to a dead job (10 missed heartbeats)."""


_ROUNDS = 5


class SaveDirectoryLocked(RuntimeError):
    """Another live job holds the ``--save`` directory; the message is one line naming it."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: written into the lock file as JSON."""

    host: str
    pid: int
    job_id: str | None
    """``SLURM_JOB_ID`` of the holder (None outside SLURM)."""
    started: str

    @classmethod
    def this_process(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), os.environ.get("SLURM_JOB_ID"),
                   time.strftime("%Y-%m-%d %H:%M:%S"))

    def describe(self) -> str:
        job = f", SLURM job {self.job_id}" if self.job_id else ""
        return f"PID {self.pid} on {self.host}{job}, since {self.started}"


def check_save_directory(save_dir: str | Path) -> None:
    """Raise :class:`SaveDirectoryLocked` in one line naming ``--save`` and the fix unless
    ``save_dir`` is (or can be made) a directory this process creates files in: a regular file,
    a read-only or immutable directory, or one without write permission is named at start,
    not at the first save. Creates the directory, as the first save would."""
    path = Path(save_dir)
    if path.exists() and not path.is_dir():
        raise SaveDirectoryLocked(f"--save {path} is a file, not a directory: pass a directory (e.g. --save "
                                  f"{path}.d), or move the file away")
    probe = path / f".canzona-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        probe.unlink()
    except OSError as error:
        where = f" ({error.filename})" if error.filename and str(error.filename) != str(probe) else ""
        hint = " (an immutable directory? lsattr -d shows it)" if error.errno == errno.EPERM else ""
        raise SaveDirectoryLocked(f"--save {path} cannot hold checkpoints: {error.strerror or error}{where}{hint}; "
                                  "pass a directory this job can write to") from None


def take_save_lock(save_dir: str | Path, *, heartbeat_s: float = HEARTBEAT_S,
                   stale_after_s: float = STALE_AFTER_S) -> SaveLock:
    """Take ``save_dir``'s lock for this process's life (released at exit), or raise
    :class:`SaveDirectoryLocked`. Returns the lock; ``release()`` gives it up earlier."""
    lock = SaveLock(Path(save_dir), heartbeat_s=heartbeat_s, stale_after_s=stale_after_s)
    lock.acquire()
    return lock


class SaveLock:
    """The lock of one ``--save`` directory, held by this process (see the module docstring)."""

    def __init__(self, save_dir: Path, *, heartbeat_s: float, stale_after_s: float) -> None:
        self.path = save_dir / LOCK_NAME
        self.holder = Holder.this_process()
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.taken_over: Holder | None = None
        """The stale holder this process replaced, if any (for one log line)."""
        self.taken_over_because = ""
        self._stop = threading.Event()

    def acquire(self) -> None:
        check_save_directory(self.path.parent)  # a file, a read-only directory: one line, not a traceback
        for _ in range(_ROUNDS):  # a stale lock renamed away, then ours; a race costs one more round
            if self._create():
                break
            current = read_holder(self.path)
            if current is None:
                time.sleep(0.2)  # released, or its holder is still writing it
                continue
            reason = self._stale_reason(current)
            if reason is None:
                raise SaveDirectoryLocked(
                    f"--save {self.path.parent} is in use by another job ({current.describe()}; lock file "
                    f"{self.path}): wait for it to end, or give this job another --save directory")
            if self._set_aside(current):
                self.taken_over = current
                self.taken_over_because = reason
        else:
            raise SaveDirectoryLocked(f"could not take {self.path}: other jobs keep replacing it; retry")
        atexit.register(self.release)
        threading.Thread(target=self._beat, name="canzona-save-lock", daemon=True).start()

    def release(self) -> None:
        """Remove the lock if it is still this process's."""
        self._stop.set()
        if read_holder(self.path) == self.holder:
            self.path.unlink(missing_ok=True)

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as file:
            json.dump(asdict(self.holder), file)
        return True

    def _stale_reason(self, current: Holder) -> str | None:
        """Why ``current`` no longer holds the lock, or None while it does."""
        if current.job_id is not None and current.job_id == self.holder.job_id:
            return f"the same SLURM job {current.job_id}, requeued"
        if current.host == self.holder.host and not running(current.pid):
            return f"PID {current.pid} no longer runs on {current.host}"
        idle = _filesystem_now(self.path.parent) - _mtime(self.path)
        if idle > self.stale_after_s:
            return f"not refreshed for {idle:.0f} s (more than {self.stale_after_s:.0f} s)"
        return None

    def _set_aside(self, judged: Holder) -> bool:
        """Rename the stale lock away; False when another job replaced it first."""
        aside = self.path.with_name(f".{LOCK_NAME}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        if read_holder(aside) != judged:  # we moved a fresh lock another job just took: put it back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                pass  # a filesystem hiccup: the next beat retries; STALE_AFTER_S spans ten


def read_holder(path: Path) -> Holder | None:
    """The holder a lock file names (None if there is no such file, or it is being written)."""
    try:
        return Holder(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")  # gone: not stale, the next round re-reads it


def _filesystem_now(directory: Path) -> float:
    """The time the file server gives a file touched now (node clocks may differ from it)."""
    probe = directory / f".{LOCK_NAME}.now-{uuid.uuid4().hex[:8]}"
    try:
        probe.touch()
        return probe.stat().st_mtime
    finally:
        probe.unlink(missing_ok=True)
