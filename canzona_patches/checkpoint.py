"""Checkpoints of the Canzona optimizer on Megatron-Core's distributed checkpointing.

Hooks (megatron-core 0.19.2):

* ``DistributedOptimizer.sharded_state_dict``/``load_state_dict`` read Adam-style state
  through ``_get_main_param_and_optimizer_states`` and a bucket geometry that changes with
  the DP size. ``CanzonaDistributedOptimizer`` overrides both with
  :func:`optimizer_sharded_state_dict` and :func:`load_optimizer_state_dict`: every state
  tensor becomes name-keyed global ``ShardedTensor`` chunks
  (:mod:`megatron.canzona.runtime.state_io`), so a checkpoint loads at any DP/TP size.
  Model-space boxes use an irregular grid (``axis_fragmentations=None``): 0.19.2 rejects
  ``ShardedTensor.flattened_range`` (mapping.py:133), which the upstream
  ``fully_sharded_model_space`` format still builds on.
* ``megatron.training.checkpointing.save_checkpoint`` (as ``training.py`` calls it) writes
  into ``<save>/iter_N`` directly and then the tracker ``latest_checkpointed_iteration.txt``
  with ``open(..., 'w')`` (checkpointing.py:1011), which truncates before it writes; and it
  saves into a non-empty ``iter_N`` ("Overwriting old incomplete / corrupted checkpoint",
  dist_checkpointing/serialization.py:395), so re-saving the tracked iteration tears the
  checkpoint the tracker points at. :func:`staged_save_checkpoint` sends the write to a
  hidden staging directory (``get_checkpoint_name`` and ``get_checkpoint_tracker_filename``
  redirected for the call), then renames it into place and replaces the tracker atomically
  (:func:`commit_checkpoint`). A job killed at any point leaves the previous checkpoint
  tracked and loadable.
* ``checkpointing._build_sharded_state_dict_metadata``: with ``--canzona`` the content
  metadata says ``fully_reshardable`` (``load_checkpoint`` refuses a TP/PP change for any
  other distributed-optimizer format, checkpointing.py:2239) and ``canzona_state_format``.
* ``training.load_checkpoint``: checked first (:func:`check_checkpoint_files`,
  :func:`check_optimizer_compatible`); any failure becomes one :class:`CanzonaCheckpointError`
  line naming the file and what mismatched.
* CPU only: the ``torch_dist`` writer's CUDA calls (``filesystem_async.preload_tensors``
  calls ``torch.cuda.synchronize``) are redirected like ``canzona_patches.cpu`` does, and
  synchronous saves get an in-process result queue instead of the ``spawn`` multiprocessing
  Manager ``get_write_results_queue`` starts (a child process: forbidden in daemonic ranks,
  and ~4 s of start-up in a ``torchrun`` rank, which re-imports the entry script).

Fault injection for tests: ``CANZONA_CKPT_FAULT=<phase>@<iteration>[:<rank>]`` SIGKILLs the
rank (default 0) while saving that iteration. Phases: ``write`` (after the rank wrote its
data files, before the checkpoint's index exists), ``commit`` (everything written, before
the rename), ``tracker`` (renamed, temporary tracker written, before it replaces the old one).
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
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from canzona_patches.arguments import CanzonaArgumentError
from canzona_patches.version import require_pinned_megatron
from megatron.canzona.optim import SOAP, Muon, Shampoo
from megatron.canzona.optim.split import GateUpLayout, QKVLayout
from megatron.canzona.runtime.state_io import (
    Placement,
    StateChunk,
    elementwise_chunks,
    flat_chunks,
    matrix_chunks,
)

require_pinned_megatron()

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

STATE_PREFIX = "optimizer.canzona."
"""Key prefix of every Canzona optimizer tensor in a checkpoint."""
STATE_FORMAT = 1
"""Version of the layout below; stored in the checkpoint's content metadata and common state."""
TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's tracker file: the iteration ``--load`` resumes from."""
STAGING_PREFIX = ".staging-"
"""Hidden name prefix of a checkpoint directory being written."""
FAULT_ENV = "CANZONA_CKPT_FAULT"
FAULT_PHASES = ("write", "commit", "tracker")

logger = logging.getLogger(__name__)


class CanzonaCheckpointError(CanzonaArgumentError):
    """A checkpoint that cannot be loaded; the message is one line naming the file and why."""


# --------------------------------------------------------------------------- optimizer state


def optimizer_sharded_state_dict(optimizer: Any, *, is_loading: bool, metadata: dict | None = None) -> dict:
    """The Canzona optimizer's checkpoint: plain common values and name-keyed ``ShardedTensor``s.

    When loading, state is created first (zeros) so that every chunk has its final shape; the
    tensors handed to the loader are fresh buffers, copied into the live state by
    :func:`load_optimizer_state_dict`.
    """
    if is_loading and metadata is not None and "canzona_state_format" not in metadata:
        raise CanzonaCheckpointError(
            "the checkpoint holds no Canzona optimizer state (saved without --canzona); "
            "pass --no-load-optim to load the model weights only"
        )
    chunks = state_chunks(optimizer, find_main=not is_loading)
    tensors: dict[str, list[ShardedTensor]] = {}
    for chunk in chunks:
        data = torch.empty_like(chunk.data, memory_format=torch.contiguous_format) if is_loading else chunk.data.contiguous()
        tensors.setdefault(chunk.key, []).append(ShardedTensor(
            chunk.key, data, data.dtype, tuple(data.shape), chunk.global_shape, chunk.global_offset,
            axis_fragmentations=None, replica_id=0 if chunk.main else 1,
        ))
    return {"canzona": common_state(optimizer), "state": tensors}


def load_optimizer_state_dict(optimizer: Any, state_dict: dict) -> None:
    """Copy a loaded :func:`optimizer_sharded_state_dict` into the live optimizer state."""
    common = state_dict.get("canzona")
    if common is None:
        raise CanzonaCheckpointError("the optimizer state has no 'canzona' section; it was not saved by Canzona")
    _check_common(common, common_state(optimizer))
    loaded = state_dict.get("state")
    if loaded is None:
        raise CanzonaCheckpointError("the optimizer state has no tensors; Canzona checkpoints need --ckpt-format torch_dist")
    chunks = state_chunks(optimizer, find_main=False)
    by_key: dict[str, list[StateChunk]] = {}
    for chunk in chunks:
        by_key.setdefault(chunk.key, []).append(chunk)
    missing = sorted(set(by_key) - set(loaded))
    if missing:
        raise CanzonaCheckpointError(f"the optimizer state lacks {missing[0]} (and {len(missing) - 1} more)")
    for key, wanted in by_key.items():
        values = loaded[key]
        values = values if isinstance(values, list) else [values]
        if len(values) != len(wanted):
            raise CanzonaCheckpointError(f"{key}: {len(values)} loaded blocks for {len(wanted)} requested")
        for chunk, value in zip(wanted, values):
            if tuple(value.shape) != tuple(chunk.data.shape):
                raise CanzonaCheckpointError(f"{key}: loaded shape {tuple(value.shape)}, expected {tuple(chunk.data.shape)}")
            chunk.restore(value)
    inner = optimizer.optimizer
    for group, saved in zip(inner.param_groups, common["param_groups"]):
        group.update(saved)
    if optimizer.grad_scaler is not None and common.get("grad_scaler") is not None:
        optimizer.grad_scaler.load_state_dict(common["grad_scaler"])


def common_state(optimizer: Any) -> dict:
    """What the checkpoint stores once for all ranks: format, optimizer, pieces, group scalars."""
    inner = optimizer.optimizer
    return {
        "format": STATE_FORMAT,
        "optimizer": optimizer_name(inner),
        "pieces": pieces_signature(inner),
        "param_groups": [{"lr": g["lr"], "weight_decay": g["weight_decay"]} for g in inner.param_groups],
        "grad_scaler": optimizer.grad_scaler.state_dict() if optimizer.grad_scaler is not None else None,
    }


def optimizer_name(inner: Any) -> str:
    """``muon``, ``shampoo`` or ``soap`` for a Canzona inner optimizer."""
    for name, cls in (("muon", Muon), ("shampoo", Shampoo), ("soap", SOAP)):
        if isinstance(inner, cls):
            return name
    raise TypeError(f"{type(inner).__name__} is not a Canzona matrix optimizer")


def pieces_signature(inner: Any) -> list[str]:
    """Which fused matrices are optimized as separate pieces (the matrix state's structure)."""
    kinds = {type(g["fused_layout"]) for g in inner.param_groups if g.get("fused_layout") is not None}
    return sorted(name for name, cls in (("qkv", QKVLayout), ("gate_up", GateUpLayout)) if cls in kinds)


def _check_common(saved: dict, current: dict) -> None:
    if saved.get("format") != STATE_FORMAT:
        raise CanzonaCheckpointError(f"optimizer state format {saved.get('format')}, this Canzona reads {STATE_FORMAT}")
    if saved["optimizer"] != current["optimizer"]:
        raise CanzonaCheckpointError(
            f"the checkpoint holds {saved['optimizer']} state, this run uses --optimizer {current['optimizer']}"
        )
    if saved["pieces"] != current["pieces"]:
        raise CanzonaCheckpointError(
            f"the checkpoint optimizes fused matrices split as {', '.join(saved['pieces']) or 'none'}, this run as "
            f"{', '.join(current['pieces']) or 'none'}; match --canzona-split-qkv/--canzona-split-gate-up to the saved run"
        )
    if len(saved["param_groups"]) != len(current["param_groups"]):
        raise CanzonaCheckpointError(
            f"the checkpoint has {len(saved['param_groups'])} parameter groups, this run {len(current['param_groups'])}"
        )


def state_chunks(optimizer: Any, *, find_main: bool = True) -> list[StateChunk]:
    """Every state tensor this rank holds, as chunks of name-keyed global tensors.

    Per parameter in this rank's shard: the fp32 main parameter and, by the group's route,
    the AdamW moments (model-space boxes) or the whole-matrix piece state. A matrix's state
    is written by one rank; where several tensor-parallel ranks hold it (TP-replicated
    matrices, ``--canzona-tp-mode sync``) ``find_main`` elects the lowest (a collective over
    the TP group)."""
    inner = optimizer.optimizer
    inner.init_state()  # zeros where a parameter has no state yet; what a first step would create
    names = global_param_names(optimizer.model_chunks)
    tp_group = _tp_group(optimizer)
    tp_rank, tp_size = _rank_and_size(tp_group)
    chunks: list[StateChunk] = []
    matrices: list[tuple[str, dict]] = []
    for model_param, shard, group, param_range in _shard_entries(optimizer):
        name = names[model_param]
        placement = _placement(model_param, param_range, tp_rank, tp_size)
        chunks.extend(flat_chunks(f"{STATE_PREFIX}{name}.main_param", shard.detach(), placement))
        state = inner.state[shard]
        if group["matrix"]:
            if state.get("pieces"):  # at TP > 1 only the host rank(s) of a matrix hold its state
                matrices.append((name, state))
        else:
            chunks.extend(elementwise_chunks(STATE_PREFIX, name, state, placement))
    writers = _matrix_writers([n for n, _ in matrices], tp_group, tp_rank, tp_size) if find_main else None
    for name, state in matrices:
        chunks.extend(matrix_chunks(STATE_PREFIX, name, state, main=writers is None or writers[name] == tp_rank))
    return chunks


def _shard_entries(optimizer: Any) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor, dict, Any]]:
    """``(model param, flat main param, inner group, range in the param)`` for this rank's shard."""
    inner = optimizer.optimizer
    for gbuf_range_maps in optimizer.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket in per_bucket:
                for model_param, ranges in bucket["param_map"].items():
                    group_index, order = optimizer.model_param_group_index_map[model_param]
                    group = inner.param_groups[group_index]
                    yield model_param, group["params"][order], group, ranges["param"]


def _placement(param: torch.nn.Parameter, param_range: Any, tp_rank: int, tp_size: int) -> Placement:
    sharded = bool(getattr(param, "tensor_model_parallel", False)) and tp_size > 1
    return Placement(
        local_shape=tuple(param.shape), flat_start=param_range.start, flat_end=param_range.end,
        tp_dim=param.partition_dim if sharded else None,
        tp_stride=getattr(param, "partition_stride", 1) if sharded else 1,
        tp_rank=tp_rank, tp_size=tp_size,
    )


def _tp_group(optimizer: Any) -> Any:
    group = getattr(optimizer, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return group


def _rank_and_size(group: Any) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def _matrix_writers(held: list[str], tp_group: Any, tp_rank: int, tp_size: int) -> dict[str, int]:
    """Matrix name -> the lowest TP rank holding its state."""
    if tp_size == 1:
        return {name: tp_rank for name in held}
    everyone: list[list[str] | None] = [None] * tp_size
    torch.distributed.all_gather_object(everyone, held, group=tp_group)
    writers: dict[str, int] = {}
    for rank, names in enumerate(everyone):
        for name in names or []:
            writers.setdefault(name, rank)
    return writers


_LAYER = re.compile(r"^(?P<stack>.*?\blayers)\.(?P<index>\d+)\.")


def global_param_names(model_chunks: list) -> dict[torch.nn.Parameter, str]:
    """Parameter -> name independent of the parallel layout: wrapper prefixes (``module.``)
    dropped and a transformer layer's local index replaced by its global ``layer_number - 1``
    (pipeline stages number their layers from 0)."""
    names: dict[torch.nn.Parameter, str] = {}
    for chunk in model_chunks:
        module = chunk
        while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
            module = module.module
        layers = {
            name: sub.layer_number - 1
            for name, sub in module.named_modules()
            if isinstance(getattr(sub, "layer_number", None), int) and _LAYER.match(name + ".")
        }
        for name, param in module.named_parameters():
            match = _LAYER.match(name)
            if match:
                prefix = f"{match['stack']}.{match['index']}"
                if prefix in layers:
                    name = f"{match['stack']}.{layers[prefix]}." + name[match.end():]
            if names.setdefault(param, name) != name:
                raise RuntimeError(f"parameter named both {names[param]} and {name}")
    if len(set(names.values())) != len(names):
        raise RuntimeError("two parameters share a global name; checkpoint keys would collide")
    return names


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
    if _global_rank() == 0:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        _recover_replaced(Path(save_dir))
        for stale in Path(save_dir).glob(f"{STAGING_PREFIX}*"):
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        staging.mkdir()
    _barrier()
    return staging


def commit_checkpoint(save_dir: str | Path, iteration: int) -> Path:
    """Publish a fully written staging directory (call on every rank once all have written):
    rank 0 renames it to ``iter_N`` and then atomically points the tracker at it."""
    final = iteration_dir(save_dir, iteration)
    if _global_rank() == 0:
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
    _barrier()
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


def _recover_replaced(save_dir: Path) -> None:
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


def _global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
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
    if match["phase"] == phase and int(match["iteration"]) == iteration and int(match["rank"] or 0) == _global_rank():
        print(f"[canzona] {FAULT_ENV}: killing rank {_global_rank()} during '{phase}' of iteration {iteration}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def _fault_during_write(iteration: int) -> Iterator[None]:
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


def save_distributed(sharded_state_dict: dict, save_dir: str | Path, iteration: int, *,
                     content_metadata: dict | None = None, verify_integrity: bool = False) -> Path:
    """``dist_checkpointing.save`` of one iteration, staged and committed atomically (for
    callers that do not go through ``megatron.training``: the tests' harness, benchmarks).
    ``verify_integrity`` also writes SHA-256 hashes (``--verify-integrity``), so a corrupt
    file can be named on load."""
    enable_cpu_checkpointing()
    staging = prepare_staging(save_dir, iteration)
    with _fault_during_write(iteration):
        dist_checkpointing.save(sharded_state_dict, str(staging), content_metadata=content_metadata,
                                verify_integrity=verify_integrity)
    return commit_checkpoint(save_dir, iteration)


def load_distributed(sharded_state_dict: dict, load_dir: str | Path, *, optimizer: Any = None) -> tuple[dict, int]:
    """Load the tracked iteration of ``load_dir`` into ``sharded_state_dict``; returns the loaded
    state dict and the iteration. With ``optimizer``, its state is checked to match first.
    Failures raise :class:`CanzonaCheckpointError`."""
    if _global_rank() == 0:
        _recover_replaced(Path(load_dir))
    _barrier()
    path = resolve_checkpoint(load_dir)
    if path is None:
        raise CanzonaCheckpointError(f"{Path(load_dir) / TRACKER} does not exist: nothing was saved in {load_dir}")
    check_checkpoint_files(path)
    if optimizer is not None:
        check_optimizer_compatible(path, optimizer)
    with _one_line_errors(path):
        return dist_checkpointing.load(sharded_state_dict, str(path)), int(path.name[len("iter_"):])


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


def check_optimizer_compatible(path: Path, optimizer: Any) -> None:
    """The optimizer state in ``path`` is the kind this run's optimizer reads."""
    from canzona_patches.optimizer import CanzonaDistributedOptimizer

    with _one_line_errors(path):
        common = dist_checkpointing.load_common_state_dict(str(path))
    if not isinstance(common.get("optimizer"), dict):
        return  # saved with --no-save-optim: Megatron loads the model only
    saved = common["optimizer"].get("canzona")
    canzona_run = isinstance(optimizer, CanzonaDistributedOptimizer)
    if canzona_run and saved is None:
        raise CanzonaCheckpointError(
            f"{path} holds no Canzona optimizer state (saved without --canzona); pass --no-load-optim to load the model only"
        )
    if not canzona_run and saved is not None:
        raise CanzonaCheckpointError(
            f"{path} holds Canzona {saved['optimizer']} optimizer state; resume with --canzona --optimizer "
            f"{saved['optimizer']}, or pass --no-load-optim"
        )
    if canzona_run:
        try:
            _check_common(saved, common_state(optimizer))
        except CanzonaCheckpointError as error:
            raise CanzonaCheckpointError(f"{path}: {error}") from error


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
def _one_line_errors(path: Path) -> Iterator[None]:
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

_HOOK_MARK = "__canzona_checkpoint_hook__"


def install_checkpoint_hooks(args: Any) -> None:
    """Staged atomic saves, checked loads, (with ``--canzona``) the content metadata, and
    :func:`fix_distributed_optimizer_loading`; idempotent."""
    training = importlib.import_module("megatron.training.training")
    checkpointing = importlib.import_module("megatron.training.checkpointing")
    enable_cpu_checkpointing(synchronous_saves=not getattr(args, "async_save", False))
    _install(training, "save_checkpoint", staged_save_checkpoint)
    _install(training, "load_checkpoint", checked_load_checkpoint)
    _install(checkpointing, "_build_sharded_state_dict_metadata", _with_canzona_metadata)
    fix_distributed_optimizer_loading()


def fix_distributed_optimizer_loading() -> None:
    """Let Megatron's own ``DistributedOptimizer`` (``--optimizer adam`` without ``--canzona``)
    resume exactly from a ``torch_dist`` checkpoint with torch's optimizers (no Apex or
    Transformer Engine, as on CPU); idempotent. See the two hooks below."""
    from megatron.core.optimizer import distrib_optimizer

    if not distrib_optimizer.HAVE_APEX_OR_TE:
        _install(distrib_optimizer.DistributedOptimizer, "sharded_state_dict", _allocating_state_first)
    _install(distrib_optimizer.DistributedOptimizer, "load_state_dict", _loading_exactly)


def _loading_exactly(load_state_dict: Callable[..., Any]) -> Callable[..., Any]:
    """``DistributedOptimizer.load_state_dict`` fixed for torch's own optimizers.

    * Under ``torch.no_grad()``: with fp32 parameters the main parameters are views of the
      (leaf, requires-grad) model parameters, and ``_set_main_param_and_optimizer_states``
      copies into them in place (distrib_optimizer.py:1225), which autograd refuses.
    * The saved step count, one tensor per parameter: torch's AdamW keeps ``step`` in its state.
      Upstream sets every state's ``step`` to one shared tensor from the saved param groups
      (:1026-1032), which AdamW then increments in place once per parameter; and the
      ``dp_reshardable`` load copies the *pre-load* local ``step`` back over it
      (a ``LocalNonpersistentObject``, :1947, copied at :1225). Either way the bias correction
      after a resume is wrong."""

    @functools.wraps(load_state_dict)
    def load_state_dict_exactly(self: Any, state_dict: dict) -> None:
        groups = (state_dict.get("optimizer") or {}).get("param_groups", []) if isinstance(state_dict, dict) else []
        saved_steps = {group["step"] for group in groups if group.get("step") is not None}
        with torch.no_grad():
            load_state_dict(self, state_dict)
        for state in getattr(self.optimizer, "state", {}).values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                value = float(next(iter(saved_steps))) if len(saved_steps) == 1 else float(step)
                state["step"] = torch.tensor(value, dtype=step.dtype, device=step.device)

    return load_state_dict_exactly


def _allocating_state_first(sharded_state_dict: Callable[..., Any]) -> Callable[..., Any]:
    """``DistributedOptimizer.sharded_state_dict`` that can load into a fresh torch optimizer.

    Without Apex or Transformer Engine (CPU) the inner optimizer is ``torch.optim.AdamW``, whose
    state is empty until its first step, and ``DistributedOptimizer.state_dict`` asserts one
    ``step`` over that empty state (distrib_optimizer.py:839): ``--load`` of a stock
    distributed-optimizer checkpoint fails. Allocate the state first, as upstream does for
    ``fsdp_dtensor`` (``_init_optimizer_states_with_dummy_values``, :1643); every value it
    touches is then overwritten by the load."""

    @functools.wraps(sharded_state_dict)
    def sharded_state_dict_allocated(self: Any, model_sharded_state_dict: Any = None, is_loading: bool = False,
                                     *args: Any, **kwargs: Any) -> Any:
        if is_loading and not self.is_stub_optimizer and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        return sharded_state_dict(self, {} if model_sharded_state_dict is None else model_sharded_state_dict,
                                  is_loading, *args, **kwargs)

    return sharded_state_dict_allocated


def _install(owner: Any, name: str, make_hook: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    if getattr(getattr(owner, name), _HOOK_MARK, False):
        return
    hook = make_hook(getattr(owner, name))
    setattr(hook, _HOOK_MARK, True)
    setattr(owner, name, hook)


def staged_save_checkpoint(save_checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """``save_checkpoint`` writing into a staging directory, committed by :func:`commit_checkpoint`.

    Not staged (upstream behaviour): non-persistent and release checkpoints, and
    ``--async-save``, whose write finishes after the call returns."""
    signature = inspect.signature(save_checkpoint)

    @functools.wraps(save_checkpoint)
    def save_checkpoint_staged(*args: Any, **kwargs: Any) -> Any:
        from megatron.training.global_vars import get_args

        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        megatron_args = get_args()
        if bound.arguments["non_persistent_ckpt"] or bound.arguments["release"] or megatron_args.async_save:
            return save_checkpoint(*args, **kwargs)
        iteration, save_dir = int(bound.arguments["iteration"]), megatron_args.save
        previous = _tracked(save_dir) if _global_rank() == 0 else None
        staging = prepare_staging(save_dir, iteration)
        with _redirected_names(save_dir, iteration, staging), _fault_during_write(iteration):
            result = save_checkpoint(*args, **kwargs)
        commit_checkpoint(save_dir, iteration)
        _retire(previous, iteration, getattr(megatron_args, "save_retain_interval", None))
        return result

    return save_checkpoint_staged


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
    tracker Megatron writes is a scratch file (the real one is replaced on commit)."""
    checkpointing = importlib.import_module("megatron.training.checkpointing")
    get_name, get_tracker = checkpointing.get_checkpoint_name, checkpointing.get_checkpoint_tracker_filename
    final = str(iteration_dir(save_dir, iteration))
    scratch = Path(save_dir) / f"{STAGING_PREFIX}megatron-{TRACKER}"

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
    if _global_rank() == 0 and scratch.exists():
        scratch.unlink()


def checked_load_checkpoint(load_checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """``load_checkpoint`` after :func:`check_checkpoint_files` and
    :func:`check_optimizer_compatible`; any failure is one :class:`CanzonaCheckpointError` line."""

    @functools.wraps(load_checkpoint)
    def load_checkpoint_checked(ddp_model: Any, optimizer: Any, opt_param_scheduler: Any, load_arg: str = "load",
                                *args: Any, **kwargs: Any) -> Any:
        from megatron.training.global_vars import get_args

        megatron_args = get_args()
        load_dir = getattr(megatron_args, load_arg, None)
        if load_dir is not None and _global_rank() == 0:
            _recover_replaced(Path(load_dir))
        _barrier()
        path = resolve_checkpoint(load_dir, getattr(megatron_args, "ckpt_step", None))
        if path is None:
            return load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg, *args, **kwargs)
        check_checkpoint_files(path)
        if (optimizer is not None and not megatron_args.no_load_optim and not megatron_args.finetune
                and (path / "metadata.json").is_file()):  # a torch_dist checkpoint
            check_optimizer_compatible(path, optimizer)
        with _one_line_errors(path):
            return load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg, *args, **kwargs)

    return load_checkpoint_checked


def _with_canzona_metadata(build: Callable[..., dict]) -> Callable[..., dict]:
    """Content metadata of a ``--canzona`` save: the optimizer state is fully reshardable."""

    @functools.wraps(build)
    def build_with_canzona(args: Any, *rest: Any, **kwargs: Any) -> dict:
        metadata = build(args, *rest, **kwargs)
        if getattr(args, "canzona", False):
            metadata.update(canzona_content_metadata())
        return metadata

    return build_with_canzona


def canzona_content_metadata() -> dict:
    """What a checkpoint with Canzona optimizer state declares in its content metadata."""
    return {"distrib_optim_sharding_type": "fully_reshardable", "canzona_state_format": STATE_FORMAT}
