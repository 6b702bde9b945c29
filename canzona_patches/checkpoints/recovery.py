"""What a failed job leaves under ``--save``, and how the next one goes on from it.

* :func:`clear_failed_saves`: a save that failed or was killed leaves its staging directory
  (``.staging-iter_N``, :mod:`canzona_patches.checkpoints.files`) holding its disk space. The next
  job that takes the directory's lock removes it at start, before anything is written, so a
  resume into a full filesystem has that space back. A complete checkpoint is never touched: an
  old copy of a re-saved iteration goes back into place first (``recover_replaced``).
* :func:`resume_advice`: the last complete checkpoint and the command that resumes from it, for
  the one line of a job that stops because a rank is gone.
* :func:`way_on`: for a checkpoint that cannot be loaded (a file missing or cut short, a tracker
  that names nothing or holds garbage, a ``--ckpt-step`` with no such checkpoint), the complete
  checkpoints that are there and the ``--ckpt-step N`` that resumes from the latest of them.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from canzona_patches.checkpoints.files import (
    STAGING_PREFIX,
    TRACKER,
    check_checkpoint_files,
    recover_replaced,
    resolve_checkpoint,
)
from canzona_patches.errors import CanzonaCheckpointError


def clear_failed_saves(save_dir: str | Path) -> tuple[list[str], int]:
    """Remove what failed or killed saves left in ``save_dir`` (staging and set-aside directories,
    Megatron's scratch tracker); return their names and the bytes freed. Call with the
    directory's lock held (no other job writes there), on one rank, before the job writes."""
    save = Path(save_dir)
    if not save.is_dir():
        return [], 0
    recover_replaced(save)  # a re-save killed between its renames: its old copy is the checkpoint
    names, freed = [], 0
    for leftover in sorted(save.glob(f"{STAGING_PREFIX}*")):
        freed += _bytes(leftover)
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover)
        else:
            leftover.unlink(missing_ok=True)
        names.append(leftover.name)
    return names, freed


def describe_bytes(count: int) -> str:
    """``count`` bytes for a log line: ``812 bytes``, ``3.4 MB``, ``1.2 GB``."""
    if count < 1000:
        return f"{count} bytes"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit} ({count} bytes)"
    raise AssertionError("unreachable")


def last_complete_checkpoint(save_dir: str | Path | None) -> Path | None:
    """The checkpoint ``save_dir``'s tracker names, if it is there; ``None`` otherwise."""
    try:
        path = resolve_checkpoint(save_dir)
    except CanzonaCheckpointError:
        return None
    return path if path is not None and path.is_dir() else None


def complete_checkpoints(load_dir: str | Path) -> list[int]:
    """The iterations of the checkpoints under ``load_dir`` whose every file is there at its full
    size (:func:`check_checkpoint_files`; checksums are not read), oldest first."""
    found = []
    for path in sorted(Path(load_dir).glob("iter_[0-9]*")):
        try:
            iteration = int(path.name[len("iter_"):])
            check_checkpoint_files(path)
        except (ValueError, CanzonaCheckpointError, OSError):
            continue
        found.append(iteration)
    return sorted(found)


def way_on(load_dir: str | Path, *, damaged: Path | None = None) -> str:
    """What a run can resume from when the checkpoint ``damaged`` (or the tracker) cannot be
    loaded: the complete checkpoints under ``load_dir`` and the ``--ckpt-step`` of the latest."""
    found = [i for i in complete_checkpoints(load_dir) if damaged is None or Path(load_dir) / f"iter_{i:07d}" != damaged]
    if not found:
        return f"no complete checkpoint under --load {load_dir}: restore one, or drop --load to train from scratch"
    if len(found) == 1:
        return f"iteration {found[0]} is complete: resume from it with --ckpt-step {found[0]}"
    shown = ", ".join(map(str, found[-4:])) + (f" (and {len(found) - 4} older)" if len(found) > 4 else "")
    return f"iterations {shown} are complete: resume from the latest with --ckpt-step {found[-1]}"


def resume_advice(args: Any) -> tuple[str, str]:
    """The last complete checkpoint under ``--save`` and the command that resumes from it, as the
    end of a one-line error and a second line holding the command (hundreds of characters: this
    job's own launch command, read from torchrun on this host, with ``--load`` added where the
    job did not load from its ``--save``)."""
    command = _launch_command()
    if args.save is None:
        return "there is no --save: nothing to resume from (command to start again below)", f"  start again: {command}"
    checkpoint = last_complete_checkpoint(args.save)
    if checkpoint is None:
        return (f"no complete checkpoint under --save {args.save}: nothing to resume from (command to start again "
                "below)"), f"  start again: {command}"
    if args.load is None or Path(args.load).resolve() != Path(args.save).resolve():
        command += f" --load {shlex.quote(str(args.save))}"
    return f"the last complete checkpoint is {checkpoint} (resume command below)", f"  resume: {command}"


def _launch_command() -> str:
    """torchrun's command line when it started this rank, else this process's own."""
    argv = None
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            argv = [part.decode() for part in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if part]
        except OSError:
            argv = None
    if not argv:
        argv = [sys.executable, *sys.argv]
    return shlex.join(argv)


def _bytes(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size if path.exists() or path.is_symlink() else 0
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).lstat().st_size
            except OSError:
                pass
    return total
