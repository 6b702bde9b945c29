"""A SHA-256 per checkpoint file, hashed by the rank that writes it, verified at load by all ranks.

A byte flipped inside a data file keeps its size, so the file checks pass and the load fails
deep in unpickling on one rank (``UnicodeDecodeError``) while another sees gloo's "Connection
closed by peer"; neither names the file. So:

* **At save**, each rank hashes the bytes of its ``__<rank>_<n>.distcp`` files *as it writes
  them* (``_write_item``'s stream is wrapped: no second read) and writes
  ``checksums/<file>.sha256`` beside them before the write is reported done: ``torch_dist``
  through Megatron's writer, ``fsdp_dtensor`` through torch DCP's ``FileSystemWriter`` (its
  ``_write_files_from_queue`` threads record theirs when they are done with the queue). The first rank
  hashes the small files it wrote itself (``.metadata``, ``common.pt``, ``metadata.json``)
  when it commits. The lines are ``sha256sum``'s: ``cd iter_N && sha256sum -c checksums/*``
  checks a checkpoint by hand.
* A write that fails (a full disk, a quota) is noted with its file and error, which
  Megatron's own exception drops (:func:`take_write_failure`).
* **At load**, before Megatron reads anything, rank ``r`` of ``W`` re-hashes the files of
  checksum lists ``r, r + W, ...``: the checkpoint is read once, spread over the ranks, never
  by one rank alone. The verdicts are gathered once (one ``all_gather_object`` of a short
  string or ``None``); every rank raises the same one-line error naming the file.

Cost: the hash runs on the writer's thread (``docs/checkpoints.md`` has the GiB/s measured by
``tools/bench_checksums.py``); a load reads ``checkpoint bytes / W`` per rank
once more. ``--canzona-no-checksums`` turns both off (the save rows are not installed, the
load skips the check); checkpoints saved without checksums load without it. ``--ckpt-format torch`` checkpoints are not covered.

Hooks (rows of :data:`canzona_patches.registry.PATCHES`): ``filesystem_async._write_item`` and
``FileSystemWriterAsync.write_preloaded_data`` (megatron-core 0.19.2); torch's
``torch.distributed.checkpoint.filesystem._write_item`` and ``_write_files_from_queue``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

CHECKSUM_DIR = "checksums"
"""Subdirectory of a checkpoint holding one ``<file>.sha256`` per file."""
SUFFIX = ".sha256"
MANIFEST = "SHA256SUMS"
"""Every checksum of the checkpoint once more, in one file the first rank writes at commit."""
FAILED_SUFFIX = ".failed"
"""Marker of a data file whose write failed (``<file>.failed``: errno and path)."""

_pending: dict[str, list[Any]] = {}
"""Data file being written -> [items left, running hash] (one writer thread per file)."""
_pending_lock = threading.Lock()
_write_failures: list[tuple[str, OSError]] = []
"""(data file, error) of writes that failed in this process, for :func:`take_write_failure`."""
_queue_files = threading.local()
"""In a thread of torch DCP's ``FileSystemWriter`` (:func:`hashing_queue_writes`): ``files``, each
data file it writes -> its running hash."""


def sidecar(data_file: Path) -> Path:
    """Where the checksum of ``data_file`` is recorded."""
    return data_file.parent / CHECKSUM_DIR / f"{data_file.name}{SUFFIX}"


def record(data_file: Path, digest: str) -> None:
    """Write ``data_file``'s checksum line (``sha256sum`` format), durably."""
    path = sidecar(data_file)
    path.parent.mkdir(exist_ok=True)
    with open(path, "w") as out:
        out.write(f"{digest}  {data_file.name}\n")
        out.flush()
        os.fsync(out.fileno())


def file_digest(path: Path) -> str:
    """SHA-256 of a file on disk (read in pieces by ``hashlib.file_digest``)."""
    with open(path, "rb") as source:
        return hashlib.file_digest(source, "sha256").hexdigest()


# --------------------------------------------------------------------------- at save


def record_checksums() -> None:
    """Make this process's ``torch_dist`` saves record checksums (the ``checksums`` rows;
    ``pretrain_gpt.py`` installs them from its flags); idempotent."""
    from canzona_patches import registry

    registry.install_group(registry.CHECKSUMS)


class _HashingStream:
    """A file stream whose writes also feed a hash; everything else goes to the stream."""

    def __init__(self, stream: Any, digest: Any) -> None:
        self._stream, self._digest = stream, digest

    def write(self, data: Any) -> int:
        written = self._stream.write(data)
        self._digest.update(data)
        return written

    def seek(self, *args: Any) -> int:  # noqa: ARG002 -- a non-sequential write would break the hash
        raise OSError("checkpoint data files are written sequentially: a seek would void the running checksum")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def hashing_write_item(write_item: Any, run: Any = None) -> Any:
    """``_write_item`` that routes the bytes of a data file being hashed through its hash; after
    the file's last item, its checksum is recorded (before the writer reports the file done)."""

    @functools.wraps(write_item)
    def write_item_hashed(*args: Any, **kwargs: Any) -> Any:
        # (transforms, stream, data, write_item, storage_key, ...): the stream is the first
        # positional argument that has a name (the transforms object has none).
        position = next((i for i, arg in enumerate(args) if hasattr(arg, "write") and hasattr(arg, "name")), None)
        if position is None or isinstance(args[position], _HashingStream):  # (hashed by an outer wrapper)
            return write_item(*args, **kwargs)
        stream = args[position]
        entry = _pending.get(str(stream.name))
        files = getattr(_queue_files, "files", None)
        if entry is None and files is not None:  # torch DCP's writer: recorded when its thread is done
            digest = files.setdefault(str(stream.name), hashlib.sha256())
            return write_item(*args[:position], _HashingStream(stream, digest), *args[position + 1:], **kwargs)
        if entry is None:
            return write_item(*args, **kwargs)
        args = (*args[:position], _HashingStream(stream, entry[1]), *args[position + 1:])
        result = write_item(*args, **kwargs)
        entry[0] -= 1
        if entry[0] == 0:
            with _pending_lock:
                del _pending[str(stream.name)]
            record(Path(stream.name), entry[1].hexdigest())
        return result

    return write_item_hashed


def hashing_queue_writes(write_files_from_queue: Any, run: Any = None) -> Any:
    """torch DCP's ``_write_files_from_queue`` (what ``FileSystemWriter`` runs in each of its
    threads: ``fsdp_dtensor`` saves): every file the thread writes is hashed as written (the
    hashing ``_write_item``), and once the queue is drained each one's checksum is recorded,
    before the writer joins its threads and reports the save's results."""

    @functools.wraps(write_files_from_queue)
    def write_files_hashed(*args: Any, **kwargs: Any) -> Any:
        _queue_files.files = files = {}
        try:
            result = write_files_from_queue(*args, **kwargs)
        finally:
            _queue_files.files = None
        for name, digest in files.items():
            record(Path(name), digest.hexdigest())
        return result

    return write_files_hashed


def hashing_preloaded_writes(write_preloaded_data: Any, run: Any = None) -> Any:
    """``FileSystemWriterAsync.write_preloaded_data`` (a static method) that marks its file for hashing."""

    @functools.wraps(write_preloaded_data)
    def write_preloaded_data_hashed(transform_list: Any, local_proc_idx: int, write_bucket: Any, *args: Any,
                                    **kwargs: Any) -> Any:
        file_name, _, (bytes_data, tensor_data) = write_bucket
        items = len(bytes_data) + len(tensor_data)
        if items:
            with _pending_lock:
                _pending[str(file_name)] = [items, hashlib.sha256()]
        try:
            result = write_preloaded_data(transform_list, local_proc_idx, write_bucket, *args, **kwargs)
        finally:
            with _pending_lock:
                _pending.pop(str(file_name), None)
        # (worker index, results or the exception): Megatron passes on only the exception's
        # type ("error: <class 'OSError'>"); keep the file and the reason for the error line.
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], OSError):
            with _pending_lock:
                _write_failures.append((str(file_name), result[1]))
            _mark_failed(Path(file_name), result[1])
        return result

    return write_preloaded_data_hashed


def _mark_failed(data_file: Path, error: OSError) -> None:
    """Leave ``checksums/<file>.failed`` (errno, file) for the ranks that report the failure: an
    ``--async-save`` writes in another process, and another rank's file is not in this one's
    memory. Best effort: on a disk that is truly full this write may fail too."""
    try:
        marker = data_file.parent / CHECKSUM_DIR / f"{data_file.name}{FAILED_SUFFIX}"
        marker.parent.mkdir(exist_ok=True)
        marker.write_text(f"{error.errno or 0} {data_file}\n")
    except OSError:
        pass


def take_write_failure(staging: Path) -> tuple[str, OSError] | None:
    """A data file of ``staging`` that could not be written, and why: one this process failed
    to write since the last call, else one any rank marked (:func:`_mark_failed`); None if none."""
    with _pending_lock:
        failures = list(_write_failures)
        _write_failures.clear()
    if failures:
        return failures[0]
    for marker in sorted((staging / CHECKSUM_DIR).glob(f"*{FAILED_SUFFIX}")):
        try:
            number, file = marker.read_text().split(maxsplit=1)
            return file.strip(), OSError(int(number), os.strerror(int(number)))
        except (OSError, ValueError):
            continue
    return None


def record_small_files(checkpoint: Path) -> None:
    """At commit, on the first rank: checksums of the files written without the hashing stream
    (the index, ``common.pt``, ``metadata.json``: kilobytes), if the data files have theirs;
    then every checksum once more in one list (:data:`MANIFEST`), so that a load can tell an
    edited checksum file from a changed data file."""
    if not (checkpoint / CHECKSUM_DIR).is_dir():
        return
    for file in sorted(checkpoint.iterdir()):
        if file.is_file() and not sidecar(file).exists():
            record(file, file_digest(file))
    lines = [listing.read_text() for listing in sorted((checkpoint / CHECKSUM_DIR).glob(f"*{SUFFIX}"))]
    with open(checkpoint / CHECKSUM_DIR / MANIFEST, "w") as out:
        out.write("".join(lines))
        out.flush()
        os.fsync(out.fileno())


def _manifest(checkpoint: Path) -> dict[str, str]:
    """File name -> the digest :data:`MANIFEST` recorded at commit (empty without one)."""
    try:
        text = (checkpoint / CHECKSUM_DIR / MANIFEST).read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        parts = line.split(maxsplit=1)
        if len(parts) == 2:
            out[parts[1].strip()] = parts[0]
    return out


def _which_disagrees(file: Path, listing: Path, actual: str, expected: str | None, saved: str | None) -> str:
    """The mismatch of ``file`` (digest ``actual``) against its checksum file ``listing``
    (``expected``; ``None``: unreadable), told apart with the commit's list (``saved``)."""
    restore = ("restore the file, or resume from an earlier checkpoint (--ckpt-step, or point "
               "latest_checkpointed_iteration.txt at it)")
    if saved is not None and actual == saved:
        return (f"{listing} was changed after the save: {file} still has the SHA-256 the save recorded "
                f"({saved[:16]}..., {MANIFEST}); restore the checksum file (the data is intact)")
    if saved is not None and expected == saved:
        return (f"{file} is corrupt: its SHA-256 is {actual[:16]}..., the save recorded {saved[:16]}... "
                f"({listing}, and {MANIFEST} agrees); {restore}")
    if saved is not None:
        return (f"{file} and {listing} both changed after the save: the file's SHA-256 is {actual[:16]}..., the "
                f"checksum file says {(expected or 'nothing readable')[:16]}..., the save recorded {saved[:16]}... "
                f"({MANIFEST}); {restore}")
    if expected is None:
        return f"{listing} is unreadable: the checkpoint's checksums are damaged"
    return (f"{file} is corrupt: its SHA-256 is {actual[:16]}..., the save recorded {expected[:16]}... "
            f"({listing}; this checkpoint has no {MANIFEST} to tell which of the two changed); {restore}")


# --------------------------------------------------------------------------- at load


def first_mismatch(checkpoint: Path, rank: int, world_size: int) -> str | None:
    """Re-hash this rank's share (checksum lists ``rank, rank + world_size, ...``); the first
    mismatch as one line, or None."""
    mine = sorted((checkpoint / CHECKSUM_DIR).glob(f"*{SUFFIX}"))[rank::world_size]
    saved = _manifest(checkpoint) if mine else {}
    for listing in mine:
        name = listing.name.removesuffix(SUFFIX)
        try:
            expected, named = listing.read_text().split(maxsplit=1)
            name = named.strip()
        except (OSError, ValueError):
            expected = None
        file = checkpoint / name
        if not file.is_file():
            return f"{file} is missing (its checksum is recorded in {listing})"
        if expected is None and name not in saved:
            return f"{listing} is unreadable: the checkpoint's checksums are damaged"
        actual = file_digest(file)
        if actual != expected:
            return _which_disagrees(file, listing, actual, expected, saved.get(name))
    return None


def agreed_mismatch(checkpoint: Path, *, group: Any = None) -> str | None:
    """Every rank of ``group`` (default: all) checks its share of ``checkpoint``; all return the
    first mismatch found anywhere (one ``all_gather_object``), or None. None at once when the checkpoint has no
    checksums (saved with ``--canzona-no-checksums``, or before they existed)."""
    import torch.distributed as dist

    if not (checkpoint / CHECKSUM_DIR).is_dir():
        return None
    distributed = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    try:
        verdict = first_mismatch(checkpoint, rank, world_size)
    except OSError as error:
        verdict = f"{checkpoint}: reading it failed ({type(error).__name__}: {error})"
    verdicts = [verdict]
    if distributed:
        verdicts = [None] * world_size
        dist.all_gather_object(verdicts, verdict, group=group)
    return next((v for v in verdicts if v), None)
