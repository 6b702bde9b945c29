"""Kill a rank at a chosen point of an optimizer step or a checkpoint save (the test harness
arms it; the product has no such path).

A fault is ``<phase>@<iteration>[:<rank>]`` (rank 0 by default), e.g. ``write@8:1``; the
rank SIGKILLs itself, after printing one line, at

* ``step``: inside the optimizer step of that iteration (as logged: Megatron's
  ``args.curr_iteration + 1``), as soon as the rank has kept the first part of it: the state of
  its first batch of matrices it hosts (``MatrixOptimizer._commit``; the other matrices, and the
  TP peers waiting for their updates, not yet), or, on a rank that hosts none, its AdamW
  update of the elementwise parameters;

* ``write``: right after it wrote its data files of that iteration, before the checkpoint's
  index exists (``FileSystemWriterAsync.write_preloaded_data_multithread``, in the process
  that writes: synchronous saves);
* ``commit``: everything written, before the staging directory is renamed into place (the
  first ``os.replace`` to or from ``iter_<iteration>``);
* ``tracker``: renamed, temporary tracker written, before it replaces the tracker;
* ``full``: not a kill: the rank's data files of that iteration are created as links to
  ``/dev/full``, so its writes fail with the kernel's ``ENOSPC`` (a full disk, without one).

:func:`arm` installs the fault in this process; :func:`arm_from_environment` reads it from
``CANZONA_CKPT_FAULT`` (``canzona_patches/harness/pretrain_with_fault.py`` arms a
``pretrain_gpt.py`` run; the Qwen3 recipes run it with ``ENTRY=``).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAULT_ENV = "CANZONA_CKPT_FAULT"
PHASES = ("step", "write", "commit", "tracker", "full")
_TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class Fault:
    phase: str
    iteration: int
    rank: int = 0

    @classmethod
    def parse(cls, spec: str) -> Fault:
        match = re.fullmatch(r"(?P<phase>\w+)@(?P<iteration>\d+)(?::(?P<rank>\d+))?", spec.strip())
        if match is None or match["phase"] not in PHASES:
            raise ValueError(f"{FAULT_ENV}={spec!r}: expected <{'|'.join(PHASES)}>@<iteration>[:<rank>]")
        return cls(match["phase"], int(match["iteration"]), int(match["rank"] or 0))

    def fire(self) -> None:
        if _rank() != self.rank:
            return
        print(f"[test fault] {FAULT_ENV}: killing rank {self.rank} during {self.phase!r} of iteration "
              f"{self.iteration}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _names_iteration(path: Any, iteration: int) -> bool:
    return f"iter_{iteration:07d}" in Path(path).name


def _is_iteration(path: Any, iteration: int) -> bool:
    return Path(path).name == f"iter_{iteration:07d}"


def arm(spec: str) -> Callable[[], None]:
    """Install the fault ``spec`` in this process; returns the function that removes it."""
    fault = Fault.parse(spec)
    if fault.phase == "step":
        return _arm_step(fault)
    if fault.phase == "write":
        return _arm_write(fault)
    if fault.phase == "full":
        return _arm_full_disk(fault)
    real_replace = os.replace

    def replace_or_die(source: Any, target: Any, *args: Any, **kwargs: Any) -> None:
        if fault.phase == "commit" and (_is_iteration(source, fault.iteration) or _is_iteration(target, fault.iteration)):
            fault.fire()
        if (fault.phase == "tracker" and Path(target).name == _TRACKER
                and Path(source).read_text().strip() == str(fault.iteration)):
            fault.fire()
        return real_replace(source, target, *args, **kwargs)

    os.replace = replace_or_die

    def disarm() -> None:
        os.replace = real_replace

    return disarm


def _arm_step(fault: Fault) -> Callable[[], None]:
    from megatron.canzona.optim.optimizers import MatrixOptimizer

    def current_iteration() -> int:
        from megatron.training import get_args

        return get_args().curr_iteration + 1

    originals = {name: MatrixOptimizer.__dict__[name] for name in ("_commit", "_step_elementwise")}

    def dying_after(name: str) -> Callable[..., Any]:
        def part_then_die(self: MatrixOptimizer, *args: Any, **kwargs: Any) -> Any:
            result = originals[name](self, *args, **kwargs)
            if current_iteration() == fault.iteration:
                fault.fire()
            return result

        return part_then_die

    for name in originals:
        setattr(MatrixOptimizer, name, dying_after(name))

    def disarm() -> None:
        for name, original in originals.items():
            setattr(MatrixOptimizer, name, original)

    return disarm


def _wrap_writer(name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Replace the static method ``FileSystemWriterAsync.<name>`` by ``wrap(original)``; returns the
    function that puts the original back."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.__dict__[name]
    setattr(FileSystemWriterAsync, name, staticmethod(wrap(original.__func__)))
    return lambda: setattr(FileSystemWriterAsync, name, original)


def _arm_write(fault: Fault) -> Callable[[], None]:
    def dying_after(write: Callable[..., Any]) -> Callable[..., Any]:
        def write_then_die(transform_list: Any, use_msc: Any, rank: Any, write_buckets: Any, *args: Any, **kwargs: Any):
            result = write(transform_list, use_msc, rank, write_buckets, *args, **kwargs)
            if any(_names_iteration(Path(bucket[0]).parent, fault.iteration) for bucket in write_buckets):
                fault.fire()
            return result

        return write_then_die

    return _wrap_writer("write_preloaded_data_multithread", dying_after)


def _arm_full_disk(fault: Fault) -> Callable[[], None]:
    def onto_dev_full(write: Callable[..., Any]) -> Callable[..., Any]:
        def write_to_a_full_disk(transform_list: Any, local_proc_idx: int, write_bucket: Any, *args: Any, **kwargs: Any):
            file_name = Path(write_bucket[0])
            if _rank() == fault.rank and _names_iteration(file_name.parent, fault.iteration):
                print(f"[test fault] {FAULT_ENV}: rank {fault.rank} writes {file_name} onto /dev/full", flush=True)
                file_name.unlink(missing_ok=True)
                file_name.symlink_to("/dev/full")
            return write(transform_list, local_proc_idx, write_bucket, *args, **kwargs)

        return write_to_a_full_disk

    return _wrap_writer("write_preloaded_data", onto_dev_full)


def arm_from_environment() -> None:
    """:func:`arm` the fault ``CANZONA_CKPT_FAULT`` names, if any."""
    spec = os.environ.get(FAULT_ENV)
    if spec:
        arm(spec)
