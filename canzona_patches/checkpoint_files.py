"""Checkpoint directories on disk: staged atomic saves, the tracker, checked loads.

Hooks (megatron-core 0.19.2), installed by :func:`canzona_patches.checkpoint.install_checkpoint_hooks`:

* ``megatron.training.checkpointing.save_checkpoint`` (as ``training.py`` calls it) writes
  into ``<save>/iter_N`` directly and then the tracker ``latest_checkpointed_iteration.txt``
  with ``open(..., 'w')`` (checkpointing.py:1011), which truncates before it writes; and it
  saves into a non-empty ``iter_N`` ("Overwriting old incomplete / corrupted checkpoint",
  dist_checkpointing/serialization.py:395), so re-saving the tracked iteration tears the
  checkpoint the tracker points at. :func:`staged_save_checkpoint` sends the write to a
  hidden staging directory (``get_checkpoint_name`` and ``get_checkpoint_tracker_filename``
  redirected for the call), then renames it into place and replaces the tracker atomically
  (:func:`commit_checkpoint`). With ``--async-save`` the commit is the last finalize step of
  the asynchronous request, so it runs once every rank's background write is done. A job
  killed at any point leaves the previous checkpoint tracked and loadable.
* Loads are checked first (:func:`check_checkpoint_files`); a failure while reading is one
  :class:`CanzonaCheckpointError` line naming the file and what mismatched
  (:func:`one_line_errors`).
* CPU only: the ``torch_dist`` writer's CUDA calls (``filesystem_async.preload_tensors``
  calls ``torch.cuda.synchronize``) are redirected like ``canzona_patches.cpu`` does, and
  synchronous saves get an in-process result queue instead of the ``spawn`` multiprocessing
  Manager ``get_write_results_queue`` starts (a child process: forbidden in daemonic ranks,
  and ~4 s of start-up in a ``torchrun`` rank, which re-imports the entry script).

Fault injection for tests: ``CANZONA_CKPT_FAULT=<phase>@<iteration>[:<rank>]`` SIGKILLs the
rank (default 0) while saving that iteration. Phases: ``write`` (after the rank wrote its
data files, before the checkpoint's index exists; synchronous saves only), ``commit``
(everything written, before the rename), ``tracker`` (renamed, temporary tracker written,
before it replaces the old one).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import logging
import os
import queue
import re
import shutil
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from canzona_patches.arguments import CanzonaArgumentError
from canzona_patches.hooks import install_hook
from canzona_patches.version import require_pinned_megatron

require_pinned_megatron()

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's tracker file: the iteration ``--load`` resumes from."""
STAGING_PREFIX = ".staging-"
"""Hidden name prefix of a checkpoint directory being written."""
FAULT_ENV = "CANZONA_CKPT_FAULT"
FAULT_PHASES = ("write", "commit", "tracker")

logger = logging.getLogger(__name__)


class CanzonaCheckpointError(CanzonaArgumentError):
    """A checkpoint that cannot be loaded; the message is one line naming the file and why."""


# --------------------------------------------------------------------------- CPU and writer


_CHECKPOINT_CUDA_MODULES = (
    "megatron.core.dist_checkpointing.strategies.filesystem_async",  # preload_tensors: synchronize
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
)


def enable_cpu_checkpointing(*, synchronous_saves: bool = True) -> None:
    """Make ``torch_dist`` saves run on CPU and without a helper process; idempotent, and a
    no-op when CUDA is available.

    Redirects the writer modules' CUDA calls; with ``synchronous_saves`` (no
    ``--async-save``) the write results travel through an in-process queue (the write runs
    in this process, so no Manager is needed)."""
    if torch.cuda.is_available():
        return
    from canzona_patches.cpu import _CpuTorch

    for name in _CHECKPOINT_CUDA_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _CpuTorch):
            module.torch = _CpuTorch()
    if synchronous_saves:
        writer = importlib.import_module("megatron.core.dist_checkpointing.strategies.filesystem_async")
        if writer._results_queue is None:
            writer._results_queue = queue.Queue()


# --------------------------------------------------------------------------- atomic saves


def iteration_dir(save_dir: str | Path, iteration: int) -> Path:
    """Megatron's directory of a saved iteration (``get_checkpoint_name(..., return_base_dir=True)``)."""
    return Path(save_dir) / f"iter_{iteration:07d}"


def staging_dir(save_dir: str | Path, iteration: int) -> Path:
    """Where iteration ``iteration`` is written before it is committed."""
    return Path(save_dir) / f"{STAGING_PREFIX}iter_{iteration:07d}"


def _replaced_dir(final: Path) -> Path:
    return final.with_name(f"{STAGING_PREFIX}replaced-{final.name}")


def prepare_staging(save_dir: str | Path, iteration: int) -> Path:
    """Rank 0 clears what killed saves left behind and creates the staging directory; every
    rank waits for it (collective when distributed)."""
    staging = staging_dir(save_dir, iteration)
    if global_rank() == 0:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        recover_replaced(Path(save_dir))
        for stale in Path(save_dir).glob(f"{STAGING_PREFIX}*"):
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        staging.mkdir()
    barrier()
    return staging


def commit_checkpoint(save_dir: str | Path, iteration: int) -> Path:
    """Publish a fully written staging directory (call on every rank once all have written):
    rank 0 renames it to ``iter_N`` and then atomically points the tracker at it."""
    final = iteration_dir(save_dir, iteration)
    if global_rank() == 0:
        _fault("commit", iteration)
        staging = staging_dir(save_dir, iteration)
        if final.exists():  # re-saving an iteration: move the old copy aside, never mix the two
            replaced = _replaced_dir(final)
            os.replace(final, replaced)
            os.replace(staging, final)
            shutil.rmtree(replaced)
        else:
            os.replace(staging, final)
        _fsync_dir(final.parent)
        write_tracker(save_dir, iteration)
    barrier()
    return final


def write_tracker(save_dir: str | Path, iteration: int) -> None:
    """Replace ``latest_checkpointed_iteration.txt`` atomically (write, fsync, rename)."""
    tracker = Path(save_dir) / TRACKER
    temporary = tracker.with_name(f"{STAGING_PREFIX}{TRACKER}")
    with open(temporary, "w") as stream:
        stream.write(str(iteration))
        stream.flush()
        os.fsync(stream.fileno())
    _fault("tracker", iteration)
    os.replace(temporary, tracker)
    _fsync_dir(tracker.parent)


def recover_before_load(load_dir: str | Path) -> None:
    """Rank 0 undoes a re-save killed between its renames (:func:`recover_replaced`); every
    rank waits for it (collective when distributed)."""
    if global_rank() == 0:
        recover_replaced(Path(load_dir))
    barrier()


def recover_replaced(save_dir: Path) -> None:
    """Undo a re-save killed between its two renames: the old copy goes back into place."""
    for replaced in save_dir.glob(f"{STAGING_PREFIX}replaced-iter_*"):
        final = save_dir / replaced.name[len(f"{STAGING_PREFIX}replaced-"):]
        if not final.exists():
            os.replace(replaced, final)


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _fault(phase: str, iteration: int) -> None:
    """SIGKILL this rank if ``CANZONA_CKPT_FAULT`` asks for ``phase`` at ``iteration`` (tests)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    match = re.fullmatch(r"(?P<phase>\w+)@(?P<iteration>\d+)(?::(?P<rank>\d+))?", spec.strip())
    if match is None or match["phase"] not in FAULT_PHASES:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected <{'|'.join(FAULT_PHASES)}>@<iteration>[:<rank>]")
    if match["phase"] == phase and int(match["iteration"]) == iteration and int(match["rank"] or 0) == global_rank():
        print(f"[canzona] {FAULT_ENV}: killing rank {global_rank()} during '{phase}' of iteration {iteration}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def fault_during_write(iteration: int) -> Iterator[None]:
    """While saving ``iteration``, let ``_fault('write')`` fire right after this rank's data
    files are written (``FileSystemWriterAsync.write_preloaded_data_multithread``), before the
    coordinator writes the checkpoint index."""
    if not os.environ.get(FAULT_ENV, "").startswith("write@"):
        yield
        return
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.__dict__["write_preloaded_data_multithread"]

    def write_then_fault(*args: Any, **kwargs: Any) -> Any:
        result = original.__func__(*args, **kwargs)
        _fault("write", iteration)
        return result

    FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(write_then_fault)
    try:
        yield
    finally:
        FileSystemWriterAsync.write_preloaded_data_multithread = original


# --------------------------------------------------------------------------- loading checks


def resolve_checkpoint(load_dir: str | Path | None, iteration: int | None = None) -> Path | None:
    """The checkpoint directory ``--load`` resumes from (``None``: no tracker, nothing saved)."""
    if load_dir is None:
        return None
    tracker = Path(load_dir) / TRACKER
    if iteration is None:
        if not tracker.is_file():
            return None
        text = tracker.read_text().strip()
        if text == "release":
            return Path(load_dir) / "release"
        if not text.isdigit():
            raise CanzonaCheckpointError(f"{tracker} holds {text!r}, not an iteration number: the tracker is corrupt")
        iteration = int(text)
    return iteration_dir(load_dir, iteration)


def check_checkpoint_files(path: Path) -> None:
    """Every file a ``torch_dist`` checkpoint's index refers to exists and is long enough."""
    from torch.distributed.checkpoint import FileSystemReader

    if not path.is_dir():
        raise CanzonaCheckpointError(f"{path} does not exist (named by {path.parent / TRACKER})")
    if any(entry.name.startswith("mp_rank_") for entry in path.iterdir()):
        return  # --ckpt-format torch: Megatron reads it itself
    if not (path / ".metadata").is_file():
        raise CanzonaCheckpointError(f"{path / '.metadata'} is missing: the checkpoint is incomplete")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # noqa: BLE001 -- any unpickling failure means a corrupt index
        raise CanzonaCheckpointError(f"{path / '.metadata'} is unreadable ({type(error).__name__}): corrupt checkpoint index") from error
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        file = path / relative
        if not file.is_file():
            raise CanzonaCheckpointError(f"{file} is missing (the index {path / '.metadata'} refers to it)")
        if file.stat().st_size < size:
            raise CanzonaCheckpointError(f"{file} is truncated: {file.stat().st_size} bytes, the index needs {size}")



_SHAPE_MISMATCH = re.compile(
    r"Global shape mismatch for loaded \((?P<saved>.*?)\) and expected \((?P<wanted>.*?)\) tensor for key (?P<key>\S+)"
)


def _shape(text: str) -> str:
    return "(" + ", ".join(re.findall(r"\d+", text)) + ")"


def _file_of(path: Path, key: str) -> Path:
    """The data file of ``path`` that holds tensor ``key`` (the index if none does)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        for index, info in FileSystemReader(str(path)).read_metadata().storage_data.items():
            if index.fqn == key:
                return path / info.relative_path
    except Exception:  # noqa: BLE001 -- only used to word an error message
        pass
    return path / ".metadata"


@contextmanager
def one_line_errors(path: Path) -> Iterator[None]:
    """Re-raise a failure while reading ``path`` as one line naming the checkpoint and the cause."""
    try:
        yield
    except CanzonaCheckpointError as error:
        message = str(error)
        raise CanzonaCheckpointError(message if str(path) in message else f"{path}: {message}") from error
    except (Exception, CheckpointException) as error:  # noqa: BLE001 -- all mean "cannot load"
        # torch.distributed.checkpoint's CheckpointException derives from BaseException.
        logger.info("loading %s failed", path, exc_info=True)  # the full story, for --log-level info
        text = str(error)
        shape = _SHAPE_MISMATCH.search(text)
        if shape:
            message = (f"{_file_of(path, shape['key'])}: {shape['key']} has shape {_shape(shape['saved'])} in the "
                       f"checkpoint, this run expects {_shape(shape['wanted'])}; the model or optimizer configuration "
                       "differs from the saved run")
        else:
            lines = [line.strip() for line in text.splitlines() if line.strip()] or [""]
            # A collected remote failure ends with the original exception's line.
            cause = f"{type(error).__name__}: " + (lines[-1] if any(line.startswith("Traceback") for line in lines) else lines[0])[:300]
            corrupt = _corrupt_files(path)
            message = (f"{corrupt[0]} is corrupt: its SHA-256 differs from {path / 'integrity.json'} ({cause})"
                       if corrupt else f"{path}: cannot load ({cause})")
        raise CanzonaCheckpointError(message) from error


def _corrupt_files(path: Path) -> list[Path]:
    """Files whose SHA-256 no longer matches the manifest a ``--verify-integrity`` save wrote."""
    manifest = path / "integrity.json"
    if not manifest.is_file():
        return []
    corrupt = []
    for name, digest in json.loads(manifest.read_text()).get("files", {}).items():
        file = path / name
        if not file.is_file() or hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            corrupt.append(file)
    return corrupt


# --------------------------------------------------------------------------- megatron.training hooks

def install_file_hooks(args: Any) -> None:
    """The CPU writer (:func:`enable_cpu_checkpointing`) and staged atomic saves; idempotent."""
    enable_cpu_checkpointing(synchronous_saves=not getattr(args, "async_save", False))
    install_hook(importlib.import_module("megatron.training.training"), "save_checkpoint", staged_save_checkpoint)


def staged_save_checkpoint(save_checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """``save_checkpoint`` writing into a staging directory, committed by :func:`commit_checkpoint`.

    With ``--async-save`` the commit is appended to the request's finalize functions, which
    Megatron runs on every rank once all ranks' background writes are done; a save still in
    flight is finalized first, so two saves never share the save directory's scratch names.
    Not staged (upstream behaviour): non-persistent and release checkpoints."""
    signature = inspect.signature(save_checkpoint)

    @functools.wraps(save_checkpoint)
    def save_checkpoint_staged(*args: Any, **kwargs: Any) -> Any:
        from megatron.training.global_vars import get_args

        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        megatron_args = get_args()
        if bound.arguments["non_persistent_ckpt"] or bound.arguments["release"]:
            return save_checkpoint(*args, **kwargs)
        iteration, save_dir = int(bound.arguments["iteration"]), megatron_args.save
        asynchronous = bool(megatron_args.async_save)
        if asynchronous:
            from megatron.training.async_utils import maybe_finalize_async_save

            maybe_finalize_async_save(blocking=True)
        previous = _tracked(save_dir) if global_rank() == 0 else None
        retain_interval = getattr(megatron_args, "save_retain_interval", None)
        staging = prepare_staging(save_dir, iteration)

        def commit() -> None:
            commit_checkpoint(save_dir, iteration)
            _retire(previous, iteration, retain_interval)
            if global_rank() == 0:
                _scratch_tracker(save_dir).unlink(missing_ok=True)

        # The 'write' fault hooks this process's writer; an asynchronous write runs in a worker.
        write_fault = nullcontext() if asynchronous else fault_during_write(iteration)
        committed_last = _committed_last(commit) if asynchronous else nullcontext()
        with _redirected_names(save_dir, iteration, staging), write_fault, committed_last:
            result = save_checkpoint(*args, **kwargs)
        if not asynchronous:
            commit()
        return result

    return save_checkpoint_staged


@contextmanager
def _committed_last(commit: Callable[[], None]) -> Iterator[None]:
    """During one asynchronous ``save_checkpoint`` call: the request it schedules gets ``commit``
    as its last finalize function (``checkpointing.schedule_async_save`` wrapped)."""
    checkpointing = importlib.import_module("megatron.training.checkpointing")
    schedule = checkpointing.schedule_async_save
    scheduled = []

    def schedule_then_commit(request: Any) -> Any:
        # The request that carries the checkpoint's finalize functions: the checkpoint's own, or
        # the distillation logits request they were moved to (checkpointing.py:1117).
        if not scheduled and request.finalize_fns:
            request.add_finalize_fn(commit)
            scheduled.append(request)
        return schedule(request)

    checkpointing.schedule_async_save = schedule_then_commit
    try:
        yield
    finally:
        checkpointing.schedule_async_save = schedule
    if not scheduled:
        raise RuntimeError("--async-save: save_checkpoint scheduled no request with finalize functions; "
                           "nothing would commit the staged checkpoint")


def _tracked(save_dir: str) -> Path | None:
    try:
        return resolve_checkpoint(save_dir)
    except CanzonaCheckpointError:
        return None  # a corrupt tracker is replaced by this save


def _retire(previous: Path | None, iteration: int, retain_interval: int | None) -> None:
    """``--save-retain-interval``: delete the previously tracked checkpoint unless its iteration
    is a multiple of the interval -- after the new one is committed. (Upstream deletes it in the
    finalize step before the tracker moves on; the scratch tracker hides it from that step.)"""
    if previous is None or not retain_interval or not previous.name.startswith("iter_") or previous.is_symlink():
        return
    old = int(previous.name[len("iter_"):])
    if old != iteration and old % retain_interval != 0:
        shutil.rmtree(previous, ignore_errors=True)


@contextmanager
def _redirected_names(save_dir: str, iteration: int, staging: Path) -> Iterator[None]:
    """During one ``save_checkpoint`` call: ``iter_N`` paths point into ``staging`` and the
    tracker Megatron writes (now, or when an asynchronous save is finalized) is a scratch file;
    the real one is replaced on commit."""
    checkpointing = importlib.import_module("megatron.training.checkpointing")
    get_name, get_tracker = checkpointing.get_checkpoint_name, checkpointing.get_checkpoint_tracker_filename
    final = str(iteration_dir(save_dir, iteration))
    scratch = _scratch_tracker(save_dir)

    def checkpoint_name(checkpoints_path: str, iteration_: int, *args: Any, **kwargs: Any) -> str:
        name = get_name(checkpoints_path, iteration_, *args, **kwargs)
        if checkpoints_path == save_dir and iteration_ == iteration and name.startswith(final):
            return str(staging) + name[len(final):]
        return name

    def tracker_filename(checkpoints_path: str) -> str:
        return str(scratch) if checkpoints_path == save_dir else get_tracker(checkpoints_path)

    checkpointing.get_checkpoint_name = checkpoint_name
    checkpointing.get_checkpoint_tracker_filename = tracker_filename
    try:
        yield
    finally:
        checkpointing.get_checkpoint_name = get_name
        checkpointing.get_checkpoint_tracker_filename = get_tracker


def _scratch_tracker(save_dir: str | Path) -> Path:
    """Where Megatron's own tracker write goes during a staged save (removed on commit)."""
    return Path(save_dir) / f"{STAGING_PREFIX}megatron-{TRACKER}"

