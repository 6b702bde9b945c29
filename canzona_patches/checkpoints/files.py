"""Checkpoint directories on disk: staged atomic saves, the tracker, checked loads.

Hooks (megatron-core 0.19.2; rows of :data:`canzona_patches.registry.PATCHES`):

* ``megatron.training.checkpointing.save_checkpoint`` (as ``training.py`` calls it) writes
  into ``<save>/iter_N`` directly and then the tracker ``latest_checkpointed_iteration.txt``
  with ``open(..., 'w')`` (checkpointing.py:1011), which truncates before it writes; and it
  saves into a non-empty ``iter_N`` ("Overwriting old incomplete / corrupted checkpoint",
  dist_checkpointing/serialization.py:395), so re-saving the tracked iteration tears the
  checkpoint the tracker points at. :func:`staged_save_checkpoint` sends the write to a
  hidden staging directory (``get_checkpoint_name`` and ``get_checkpoint_tracker_filename``
  swapped for the call), then renames it into place and replaces the tracker atomically
  (:func:`commit_checkpoint`). With ``--async-save`` the commit is the last finalize step of
  the asynchronous request, so it runs once every rank's background write is done. A job
  killed at any point leaves the previous checkpoint tracked and loadable.
* Deleting is off the critical path: what a save removes (stale staging directories of
  killed saves, the old copy of a re-saved iteration, a checkpoint retired by
  ``--save-retain-interval``) is renamed out of the way by rank 0, a metadata operation, and
  deleted by a daemon thread started after the save's barrier (:func:`wait_for_removals`;
  joined at exit). No barrier waits on a deletion, however large the checkpoint.
* Loads are checked first (:func:`check_checkpoint_files`) by one rank, whose verdict every
  rank gets (:func:`decided_on_rank_zero`); a failure while reading is one
  :class:`CanzonaCheckpointError` line naming the file and what mismatched
  (:func:`one_line_errors`).
* CPU only: the ``torch_dist`` writer's CUDA calls (``filesystem_async.preload_tensors``
  calls ``torch.cuda.synchronize``) are redirected like ``canzona_patches.emulation.cpu`` does, and
  synchronous saves get an in-process result queue instead of the ``spawn`` multiprocessing
  Manager ``get_write_results_queue`` starts (a child process: forbidden in daemonic ranks,
  and ~4 s of start-up in a ``torchrun`` rank, which re-imports the entry script).
"""

from __future__ import annotations

import atexit
import errno
import functools
import hashlib
import inspect
import json
import logging
import os
import queue
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

import torch

from canzona_patches import registry
from canzona_patches.checkpoints.checksums import record_small_files, take_write_failure
from canzona_patches.errors import CanzonaArgumentError, CanzonaCheckpointError
from canzona_patches.version import require_pinned_megatron

require_pinned_megatron()

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's tracker file: the iteration ``--load`` resumes from."""
STAGING_PREFIX = ".staging-"
"""Hidden name prefix of a checkpoint directory being written."""
DELETING_PREFIX = f"{STAGING_PREFIX}deleting-"
"""Name prefix of a directory renamed out of the way, waiting for the background deletion."""
NEARLY_FULL_BYTES = 64 << 20
"""Free bytes below which a failed save is put down to a full disk when no rank could say why."""

logger = logging.getLogger(__name__)
T = TypeVar("T")


# --------------------------------------------------------------------------- CPU and writer


def enable_cpu_checkpointing(*, synchronous_saves: bool = True) -> None:
    """Make ``torch_dist`` saves run on CPU and without a helper process; idempotent, and a
    no-op when CUDA is available.

    Redirects the writer modules' CUDA calls; with ``synchronous_saves`` (no
    ``--async-save``) the write results travel through an in-process queue (the write runs
    in this process, so no Manager is needed). The ``cpu-checkpoint`` and ``cpu-sync-save``
    rows of :data:`canzona_patches.registry.PATCHES`."""
    if torch.cuda.is_available():
        return
    registry.install_group(registry.CPU_CHECKPOINT)
    if synchronous_saves:
        registry.install_group(registry.CPU_SYNC_SAVE)


def in_process_results_queue(results_queue: Any, run: Any = None) -> Any:
    """``filesystem_async._results_queue`` for synchronous saves: a plain queue, unless one exists."""
    return queue.Queue() if results_queue is None else results_queue


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
    """Rank 0 moves what killed saves left behind out of the way and creates the staging
    directory; every rank waits for it (collective when distributed). The leftovers are
    deleted in the background once the barrier is passed."""
    staging = staging_dir(save_dir, iteration)
    doomed: list[Path] = []
    if global_rank() == 0:
        save = Path(save_dir)
        save.mkdir(parents=True, exist_ok=True)
        recover_replaced(save)
        being_removed = _REMOVER.pending()
        for stale in save.glob(f"{STAGING_PREFIX}*"):
            if stale in being_removed:
                continue
            if stale.is_dir():
                doomed.append(_set_aside(stale))
            else:
                stale.unlink(missing_ok=True)
        staging.mkdir()
    barrier()
    _REMOVER.remove(doomed)
    return staging


def commit_checkpoint(save_dir: str | Path, iteration: int) -> Path:
    """Publish a fully written staging directory (call on every rank once all have written):
    rank 0 renames it to ``iter_N`` and then atomically points the tracker at it. The old copy
    of a re-saved iteration is deleted in the background, after the barrier."""
    final = iteration_dir(save_dir, iteration)
    doomed: list[Path] = []
    if global_rank() == 0:
        staging = staging_dir(save_dir, iteration)
        record_small_files(staging)
        if final.exists():  # re-saving an iteration: move the old copy aside, never mix the two
            replaced = _replaced_dir(final)
            os.replace(final, replaced)
            os.replace(staging, final)
            doomed.append(_set_aside(replaced))
        else:
            os.replace(staging, final)
        _fsync_dir(final.parent)
        write_tracker(save_dir, iteration)
    barrier()
    _REMOVER.remove(doomed)
    return final


def write_tracker(save_dir: str | Path, iteration: int) -> None:
    """Replace ``latest_checkpointed_iteration.txt`` atomically (write, fsync, rename)."""
    tracker = Path(save_dir) / TRACKER
    temporary = tracker.with_name(f"{STAGING_PREFIX}{TRACKER}")
    with open(temporary, "w") as stream:
        stream.write(str(iteration))
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, tracker)
    _fsync_dir(tracker.parent)


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


# --------------------------------------------------------------------------- deleting off the critical path


def _set_aside(path: Path) -> Path:
    """Rename ``path`` to a unique hidden name in the same directory (no loader or save looks
    at it again) and return that name; a directory set aside before is returned as it is."""
    if path.name.startswith(DELETING_PREFIX):
        return path
    aside = path.with_name(f"{DELETING_PREFIX}{uuid.uuid4().hex[:12]}-{path.name}")
    os.replace(path, aside)
    return aside


class _BackgroundRemover:
    """Deletes directories, in the order given, on one daemon thread of this process.

    A checkpoint of a large model is thousands of files; deleting them can outlast a
    collective timeout, so no rank may wait for it inside a barrier. The thread is started on
    first use; :meth:`wait` (registered to run at exit) blocks until everything handed over
    so far is gone."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Path] = queue.Queue()
        self._pending: set[Path] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def remove(self, paths: Iterable[Path]) -> None:
        paths = list(paths)
        if not paths:
            return
        with self._lock:
            self._pending.update(paths)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="canzona-checkpoint-remover", daemon=True)
                self._thread.start()
                atexit.register(self.wait)
        for path in paths:
            self._queue.put(path)

    def pending(self) -> set[Path]:
        """Directories handed over and not deleted yet."""
        with self._lock:
            return set(self._pending)

    def wait(self) -> None:
        self._queue.join()

    def _run(self) -> None:
        while True:
            path = self._queue.get()
            try:
                shutil.rmtree(path)
            except OSError as error:  # left for the next save's cleanup, which retries it
                logger.warning("could not delete %s: %s", path, error)
            finally:
                with self._lock:
                    self._pending.discard(path)
                self._queue.task_done()


_REMOVER = _BackgroundRemover()


def wait_for_removals() -> None:
    """Block until every directory set aside by this process so far is deleted."""
    _REMOVER.wait()


# --------------------------------------------------------------------------- one rank decides


def decided_on_rank_zero(decide: Callable[[], T], *, group: Any = None) -> T:
    """``decide()`` on the first rank of ``group`` (default: every rank) alone; every rank
    returns its result, or raises the :class:`CanzonaCheckpointError` it raised. Costs one
    ``broadcast_object_list`` (two broadcasts: the pickle's length, then the pickle).

    For checks of a checkpoint on a shared filesystem: one rank reads the index and stats the
    files instead of every rank all of them, and no two ranks can reach different verdicts
    and part ways (one into the load's collectives, one out with an error)."""
    if not torch.distributed.is_initialized():
        return decide()
    source = 0 if group is None else torch.distributed.get_global_rank(group, 0)
    verdict: list[Any] = [None]
    failure: BaseException | None = None
    if torch.distributed.get_rank() == source:
        try:
            verdict = [("ok", decide())]
        except CanzonaCheckpointError as error:
            verdict = [("error", str(error))]
        except Exception as error:  # noqa: BLE001 -- the other ranks wait for a verdict: send one
            verdict, failure = [("crash", f"{type(error).__name__}: {error}")], error
    torch.distributed.broadcast_object_list(verdict, src=source, group=group)
    if failure is not None:
        raise failure
    kind, value = verdict[0]
    if kind == "error":
        raise CanzonaCheckpointError(value)
    if kind == "crash":
        raise RuntimeError(f"rank {source} failed while checking the checkpoint: {value}")
    return value


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
        schedule = _SCHEDULE_MISMATCH.search(text)
        if schedule:
            message = schedule_mismatch(path, schedule["name"], schedule["ours"], schedule["saved"])
        elif shape:
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


_SCHEDULE_MISMATCH = re.compile(
    r"OptimizerParamScheduler: class input value (?P<ours>\S+) and checkpoint\s*value (?P<saved>\S+) for "
    r"(?P<name>.+?) do not match")
"""Megatron's assert when a resumed run's learning-rate schedule differs from the saved one."""


_SCHEDULE_IN_SAMPLES = {"warmup iterations": "learning-rate warm-up", "total number of iterations": "learning-rate decay",
                        "total number of weight decay iterations": "weight-decay schedule"}
"""Megatron's names of the schedule lengths it counts in samples (whatever the name says)."""


def schedule_mismatch(path: Path, name: str, ours: str, saved: str, args: Any = None) -> str:
    """One line for a resumed run whose schedule differs from the checkpoint's: the lengths
    Megatron counts in samples said in samples, and in iterations where the run counts
    iterations; the two flags that settle it, unless this run would end before the checkpoint's
    iteration (then no schedule helps: --train-iters must go up)."""
    if args is None:
        try:
            from megatron.training.global_vars import get_args

            args = get_args()
        except (ImportError, AssertionError):
            args = None
    iters, batch = getattr(args, "train_iters", None), getattr(args, "global_batch_size", None)
    loaded = re.search(r"iter_(\d+)", str(path))
    if iters and loaded and int(loaded.group(1)) >= iters:
        return (f"{path}: the checkpoint is at iteration {int(loaded.group(1))} and this run's --train-iters {iters} "
                f"ends there or before: nothing would train; raise --train-iters above {int(loaded.group(1))}")
    what = _SCHEDULE_IN_SAMPLES.get(name)
    if what is None:
        ours_text, saved_text, what = ours, saved, name
    else:
        def length(value: str) -> str:
            samples = float(value)
            text = f"{samples:.0f} samples"
            if iters and batch:
                text += f" ({samples / batch:g} iterations of {batch})"
            return text

        ours_text, saved_text = length(ours), length(saved)
    return (f"{path}: this run's {what} is {ours_text}, the checkpoint's {saved_text} (another --train-iters, "
            "--lr-decay-iters or --lr-warmup-iters?): pass --use-checkpoint-opt_param-scheduler to keep the saved "
            "schedule, or --override-opt_param-scheduler to take this run's")


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

def staged_save_checkpoint(save_checkpoint: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
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
        if save_dir is None:
            # Megatron asks for a checkpoint before exiting (a NaN under --rerun-mode
            # validate_results, a signal) whether or not there is a save directory.
            if global_rank() == 0:
                print(f"[canzona] iteration {iteration} asks for a checkpoint, but there is no --save directory: "
                      "nothing saved", flush=True)
            return None
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

        @contextmanager
        def one_line() -> Iterator[None]:
            try:
                yield
            except (CheckpointException, OSError) as error:  # every rank: the write results are gathered
                raise CanzonaCheckpointError(_save_failure(iteration, save_dir, staging, error)) from error

        def failing_in_one_line(finalize: Callable[[], Any]) -> Callable[[], Any]:
            def finalize_in_one_line() -> Any:
                with one_line():
                    return finalize()

            return finalize_in_one_line

        committed_last = _committed_last(commit, failing_in_one_line) if asynchronous else nullcontext()
        with one_line(), _redirected_names(save_dir, iteration, staging), committed_last:
            result = save_checkpoint(*args, **kwargs)
        if not asynchronous:
            commit()
        return result

    return save_checkpoint_staged


def _nearly_full(save_dir: str) -> bool:
    try:
        return shutil.disk_usage(save_dir).free < NEARLY_FULL_BYTES
    except OSError:
        return False


def _save_failure(iteration: int, save_dir: str, staging: Path, error: BaseException) -> str:
    """One line for a save that could not write: the file and the reason where this rank knows
    them (a full disk names the path), what is still loadable, what to do."""
    previous = _tracked(save_dir)
    kept = (f"the previous checkpoint {previous} stays tracked and loadable" if previous is not None and previous.is_dir()
            else "no earlier checkpoint exists")
    failure = take_write_failure(staging)
    if failure is None and _nearly_full(save_dir):
        failure = str(staging), OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if failure is not None:
        file, cause = failure
        reason = (f"{os.strerror(cause.errno).lower()} ({errno.errorcode.get(cause.errno, cause.errno)})"
                  if cause.errno else str(cause))
        fix = (f"free space on the filesystem of --save {save_dir}, or point --save elsewhere"
               if cause.errno in (errno.ENOSPC, errno.EDQUOT) else f"check --save {save_dir}")
        return f"saving iteration {iteration} failed: {file}: {reason}; {kept}: {fix}, then resume"
    ranks = sorted(getattr(error, "failures", {}) or [])
    where = f"on rank {', '.join(map(str, ranks))}" if ranks else f"({type(error).__name__}: {str(error)[:200]})"
    return (f"saving iteration {iteration} into {staging} failed {where} (see that rank's output); {kept}: "
            "fix the cause, then resume")


@contextmanager
def _committed_last(commit: Callable[[], None], failing_in_one_line: Callable[[Callable], Callable]) -> Iterator[None]:
    """During one asynchronous ``save_checkpoint`` call: the request it schedules gets ``commit``
    as its last finalize function (``checkpointing.schedule_async_save`` wrapped), and its other
    finalize functions are wrapped by ``failing_in_one_line``."""
    scheduled = []

    def committing_last(schedule: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def schedule_then_commit(request: Any) -> Any:
            # The request that carries the checkpoint's finalize functions: the checkpoint's own,
            # or the distillation logits request they were moved to (checkpointing.py:1117).
            if not scheduled and request.finalize_fns:
                # A background write that failed surfaces in the first finalize function, on
                # every rank: one line, as for a synchronous save, and the commit never runs.
                request.finalize_fns[:] = [failing_in_one_line(fn) for fn in request.finalize_fns]
                request.add_finalize_fn(commit)
                scheduled.append(request)
            return schedule(request)

        return schedule_then_commit

    with registry.swapped("megatron.training.checkpointing:schedule_async_save", committing_last):
        yield
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
    is a multiple of the interval -- after the new one is committed, and in the background.
    (Upstream deletes it in the finalize step before the tracker moves on; the scratch tracker
    hides it from that step.)"""
    if previous is None or not retain_interval or not previous.name.startswith("iter_") or previous.is_symlink():
        return
    old = int(previous.name[len("iter_"):])
    if old != iteration and old % retain_interval != 0 and previous.is_dir():
        _REMOVER.remove([_set_aside(previous)])  # renamed now, deleted in the background


@contextmanager
def _redirected_names(save_dir: str, iteration: int, staging: Path) -> Iterator[None]:
    """During one ``save_checkpoint`` call: ``iter_N`` paths point into ``staging`` and the
    tracker Megatron writes (now, or when an asynchronous save is finalized) is a scratch file;
    the real one is replaced on commit."""
    final = str(iteration_dir(save_dir, iteration))
    scratch = _scratch_tracker(save_dir)

    def into_staging(get_name: Callable[..., str]) -> Callable[..., str]:
        def checkpoint_name(checkpoints_path: str, iteration_: int, *args: Any, **kwargs: Any) -> str:
            name = get_name(checkpoints_path, iteration_, *args, **kwargs)
            if checkpoints_path == save_dir and iteration_ == iteration and name.startswith(final):
                return str(staging) + name[len(final):]
            return name

        return checkpoint_name

    def into_scratch(get_tracker: Callable[[str], str]) -> Callable[[str], str]:
        def tracker_filename(checkpoints_path: str) -> str:
            return str(scratch) if checkpoints_path == save_dir else get_tracker(checkpoints_path)

        return tracker_filename

    with (registry.swapped("megatron.training.checkpointing:get_checkpoint_name", into_staging),
          registry.swapped("megatron.training.checkpointing:get_checkpoint_tracker_filename", into_scratch)):
        yield


def _scratch_tracker(save_dir: str | Path) -> Path:
    """Where Megatron's own tracker write goes during a staged save (removed on commit)."""
    return Path(save_dir) / f"{STAGING_PREFIX}megatron-{TRACKER}"

