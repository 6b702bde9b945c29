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
* ``checkpointing._build_sharded_state_dict_metadata``: with ``--canzona`` the content
  metadata says ``fully_reshardable`` (``load_checkpoint`` refuses a TP/PP change for any
  other distributed-optimizer format, checkpointing.py:2239) and ``canzona_state_format``.
* ``training.load_checkpoint``: rank 0 checks the files first (:func:`canzona_patches.
  checkpoint_files.check_checkpoint_files`), then the saved optimizer state against this run's
  (:func:`check_optimizer_compatible`), and every rank gets its verdict
  (:func:`verified_checkpoint`); any failure is one :class:`CanzonaCheckpointError` line
  naming the file and what mismatched, the same on every rank.
* ``training.save_checkpoint``: staged and committed atomically, see
  :mod:`canzona_patches.checkpoints.files`.

Which attribute each hook replaces, and when, is :data:`canzona_patches.registry.PATCHES`.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from canzona_patches.params import global_param_names, shard_entries, tp_stride
from canzona_patches.checkpoints.checksums import agreed_mismatch, record_checksums
from canzona_patches.checkpoints.files import (
    TRACKER,
    CanzonaCheckpointError,
    check_checkpoint_files,
    commit_checkpoint,
    decided_on_rank_zero,
    enable_cpu_checkpointing,
    global_rank,
    one_line_errors,
    prepare_staging,
    recover_replaced,
    resolve_checkpoint,
)
from canzona_patches.checkpoints.recovery import way_on
from canzona_patches.version import require_pinned_megatron
from megatron.canzona.runtime.optimizer import CanzonaOptimizer
from megatron.canzona.runtime.state_io import (
    Placement,
    StateChunk,
    elementwise_chunks,
    flat_chunks,
    matrix_chunks,
)

require_pinned_megatron()

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402

STATE_PREFIX = "optimizer.canzona."
"""Key prefix of every Canzona optimizer tensor in a checkpoint."""
STATE_FORMAT = 2
"""Version of the layout below (2: parameter groups keyed by :func:`group_signature`); stored in the checkpoint's content metadata and common state."""

FSDP_STATE = "canzona_state"
"""Where an ``fsdp_dtensor`` checkpoint keeps the Canzona state tensors in the optimizer's state dict."""

# --------------------------------------------------------------------------- optimizer state


def optimizer_sharded_state_dict(optimizer: Any, *, is_loading: bool, metadata: dict | None = None) -> dict:
    """The Canzona optimizer's checkpoint: plain common values and name-keyed ``ShardedTensor``s.

    When loading, state is created first (zeros) so that every chunk has its final shape, and
    the loader reads straight into the live state tensors where a chunk is one (whole matrix
    state, flat slices of whole rows): no second copy of the optimizer state. Other chunks (a
    box of a few columns) get a buffer, copied into place by :func:`load_optimizer_state_dict`.
    """
    if is_loading and metadata is not None and "canzona_state_format" not in metadata:
        raise CanzonaCheckpointError(
            "the checkpoint holds no Canzona optimizer state (saved without --canzona); "
            "pass --no-load-optim to load the model weights only"
        )
    chunks = state_chunks(optimizer, find_main=not is_loading)
    if _under_fsdp(optimizer):  # --ckpt-format fsdp_dtensor: torch's DCP saves it, not Megatron's dist_checkpointing
        # The common state as one pickled value (DCP would store a dict key by key), "state" empty for
        # Megatron's SwiGLU split of Adam's moments.
        return {"canzona": pickle.dumps(common_state(optimizer)), "state": {},
                FSDP_STATE: dcp_tensors(chunks, is_loading=is_loading)}
    tensors: dict[str, list[ShardedTensor]] = {}
    for chunk in chunks:
        if is_loading:
            data = chunk.data if chunk.data.is_contiguous() else torch.empty_like(chunk.data, memory_format=torch.contiguous_format)
        else:
            data = chunk.data.contiguous()
        tensors.setdefault(chunk.key, []).append(ShardedTensor(
            chunk.key, data, data.dtype, tuple(data.shape), chunk.global_shape, chunk.global_offset,
            axis_fragmentations=None, replica_id=0 if chunk.main else 1,
        ))
    return {"canzona": common_state(optimizer), "state": tensors}


def load_optimizer_state_dict(optimizer: Any, state_dict: dict) -> None:
    """Copy a loaded :func:`optimizer_sharded_state_dict` into the live optimizer state."""
    common = state_dict.get("canzona")
    if isinstance(common, bytes):  # an fsdp_dtensor checkpoint's (optimizer_sharded_state_dict)
        common = pickle.loads(common)
    if common is None:
        raise CanzonaCheckpointError("the optimizer state has no 'canzona' section; it was not saved by Canzona")
    _check_common(common, common_state(optimizer))
    chunks = state_chunks(optimizer, find_main=False)
    if _under_fsdp(optimizer):
        if FSDP_STATE not in state_dict:
            raise CanzonaCheckpointError("the optimizer state has no Canzona tensors (saved without --canzona under "
                                         "--use-megatron-fsdp); pass --no-load-optim to load the model weights only")
        restore_dcp_tensors(chunks, state_dict[FSDP_STATE])
        _restore_common(optimizer, common)
        return
    loaded = state_dict.get("state")
    if loaded is None:
        raise CanzonaCheckpointError("the optimizer state has no tensors; Canzona checkpoints need --ckpt-format torch_dist")
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
    _restore_common(optimizer, common)


def _restore_common(optimizer: Any, common: dict) -> None:
    """The group scalars, the loss scale and the speculation record of a loaded checkpoint."""
    for part in canzona_parts(optimizer):
        for group in part.optimizer.param_groups:
            group.update(common["param_groups"][group_signature(group)])
        if part.grad_scaler is not None and common.get("grad_scaler") is not None:
            part.grad_scaler.load_state_dict(common["grad_scaler"])
        part.resume_speculation(common.get("speculation", {}))


def canzona_parts(optimizer: Any) -> list[Any]:
    """The Canzona DistributedOptimizers of a run: the one, or the dense and the expert one a
    ``CanzonaChainedOptimizer`` chains (expert parallelism)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def group_signature(group: dict) -> str:
    """A parameter group's name independent of the parallel layout: its optimizer family and
    Megatron's multipliers and schedule bounds. Expert parameters are a group of their own at
    EP > 1 and share the dense groups at EP 1; both are the same signature."""
    skip = {"lr", "weight_decay", "step", "is_expert_parallel"}
    fields = sorted((k, v) for k, v in group.items()
                    if k not in skip and isinstance(v, (bool, int, float, str)))
    return ",".join(f"{k}={v}" for k, v in fields)


def common_state(optimizer: Any) -> dict:
    """What the checkpoint stores once for all ranks: format, optimizer, pieces, group scalars
    (by :func:`group_signature`, so that they load at any expert-parallel size)."""
    parts = canzona_parts(optimizer)
    groups: dict[str, dict] = {}
    for part in parts:
        for g in part.optimizer.param_groups:
            groups.setdefault(group_signature(g), {"lr": g["lr"], "weight_decay": g["weight_decay"]})
    scaler = parts[0].grad_scaler
    return {
        "format": STATE_FORMAT,
        "optimizer": optimizer_name(parts[0].optimizer),
        "pieces": sorted({piece for part in parts for piece in pieces_signature(part.optimizer)}),
        "param_groups": groups,
        "grad_scaler": scaler.state_dict() if scaler is not None else None,
        "speculation": parts[0].speculation.state(),
        "moment2_method": getattr(parts[0].optimizer.config, "moment2_method", None),  # AdaMuon or NorMuon
    }


def optimizer_name(inner: Any) -> str:
    """``muon``, ``shampoo`` or ``soap`` for a Canzona inner optimizer."""
    name = getattr(inner, "math", None)
    if name is None:
        raise TypeError(f"{type(inner).__name__} is not a Canzona matrix optimizer")
    return name


def pieces_signature(inner: Any) -> list[str]:
    """Which fused matrices are optimized as separate pieces (the matrix state's structure)."""
    return sorted(inner.split_kinds())


def _check_common(saved: dict, current: dict) -> None:
    if saved.get("format") != STATE_FORMAT:
        raise CanzonaCheckpointError(f"optimizer state format {saved.get('format')}, this Canzona reads {STATE_FORMAT}")
    if saved["optimizer"] != current["optimizer"]:
        raise CanzonaCheckpointError(
            f"the checkpoint holds {saved['optimizer']} state, this run uses --optimizer {current['optimizer']}: "
            f"resume with --optimizer {saved['optimizer']}, or pass --no-load-optim to load the weights and start "
            f"{current['optimizer']}'s state afresh"
        )
    method = saved.get("moment2_method")  # (checkpoints saved before it was recorded: the shapes tell)
    if method is not None and method != current.get("moment2_method"):
        raise CanzonaCheckpointError(
            f"the checkpoint holds {method}'s second moment, this run uses {current.get('moment2_method')}: resume with "
            f"--adaptive-muon-moment2-method {method}, or pass --no-load-optim to start the optimizer afresh")
    if saved["pieces"] != current["pieces"]:
        raise CanzonaCheckpointError(
            f"the checkpoint optimizes fused matrices split as {', '.join(saved['pieces']) or 'none'}, this run as "
            f"{', '.join(current['pieces']) or 'none'}; match --canzona-split-qkv/--canzona-split-qkv-per-head/--canzona-split-gate-up to the saved run"
        )
    missing = sorted(set(current["param_groups"]) - set(saved["param_groups"]))
    if missing:
        raise CanzonaCheckpointError(
            f"the checkpoint has no parameter group {missing[0]} (it has {', '.join(sorted(saved['param_groups']))}); "
            "resume with the learning-rate and weight-decay settings of the saved run"
        )


def state_chunks(optimizer: Any, *, find_main: bool = True) -> list[StateChunk]:
    """Every state tensor this rank holds, as chunks of name-keyed global tensors.

    Per parameter piece in this rank's shard: the fp32 main parameter and, for an
    elementwise parameter, the AdamW moments (model-space boxes). Per matrix this rank
    computes: its whole piece state, written by one rank (its host; in sync mode its first
    holder; of a matrix every TP rank computes, TP rank 0's copy). The writer follows from
    the plan, without a collective; ``find_main`` is accepted for callers and ignored. With several
    distributed-optimizer instances, each holds the whole state: instance 0's ranks write it, the
    others' chunks are replicas (every instance loads its own copy)."""
    del find_main
    chunks = [chunk for part in canzona_parts(optimizer) for chunk in _part_chunks(part)]
    if _instance_id() > 0:
        chunks = [dataclasses.replace(chunk, main=False) for chunk in chunks]
    return chunks


def _instance_id() -> int:
    """This rank's distributed-optimizer instance (``--num-distributed-optimizer-instances``): its
    rank in Megatron's inter-instance group, 0 with one instance."""
    if not torch.distributed.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return 0
    group = parallel_state.get_inter_distributed_optimizer_instance_group(check_initialized=False)
    return 0 if group is None else torch.distributed.get_rank(group)


def _part_chunks(optimizer: Any) -> list[StateChunk]:
    """:func:`state_chunks` of one Canzona DistributedOptimizer (dense or expert buffers).
    Under Megatron-FSDP the shards are its ``DTensor`` parameters' local elements (the main
    weights), and Muon's momentum kept by the holders is a flat slice of each matrix too."""
    inner = optimizer.optimizer
    inner.init_state()  # zeros where there is no state yet; what a first step would create
    names = global_param_names(optimizer.model_chunks)
    part = optimizer.canzona
    tp_rank, tp_size = _rank_and_size(part.tp_group)
    gated = optimizer.model_chunks[0].config.gated_linear_unit
    chunks: list[StateChunk] = []
    fsdp = getattr(optimizer, "fsdp", False)
    for model_param, shard, group, (start, end) in _shards(optimizer, fsdp):
        name = names[shard if fsdp else model_param]
        placement = _placement(model_param, tp_stride(name, gated), start, end, tp_rank, tp_size)
        local = shard.to_local().view(-1) if fsdp else shard
        chunks.extend(flat_chunks(f"{STATE_PREFIX}{name}.main_param", local.detach(), placement))
        if not group["matrix"]:
            chunks.extend(elementwise_chunks(STATE_PREFIX, name, inner.state[shard], placement))
        elif "momentum" in inner.state[shard]:  # momentum_on_holders
            chunks.extend(flat_chunks(f"{STATE_PREFIX}{name}.holder_momentum", inner.state[shard]["momentum"], placement))
    binding, engine = part.binding, part.engine
    for task in inner.computed_tasks():
        writer = engine.writes(task) and task.column == 0
        name = names[binding.params[task.key]]
        piece, pieces = binding.parts.get(task.key, (0, None))  # a part's state is that piece of the matrix's
        chunks.extend(matrix_chunks(STATE_PREFIX, name, inner.matrix_state[task.key], main=writer, first_piece=piece,
                                    pieces=pieces))
    return chunks


def _shards(optimizer: Any, fsdp: bool) -> list[tuple[torch.nn.Parameter, torch.Tensor, dict, tuple[int, int]]]:
    """``(model param, shard, inner group, (start, end) in the flattened local param)`` of every
    shard this rank holds elements of: the distributed optimizer's flat main params, or (``fsdp``)
    Megatron-FSDP's ``DTensor`` parameters (their ``orig_param`` the model's)."""
    if not fsdp:
        return [(p, shard, group, (r.start, r.end)) for p, shard, group, r in shard_entries(optimizer)]
    spans = optimizer.canzona.binding.spans
    return [(param.orig_param, param, group, spans[param]) for group in optimizer.optimizer.param_groups
            for param in group["params"] if param in spans]


def _under_fsdp(optimizer: Any) -> bool:
    return any(getattr(part, "fsdp", False) for part in canzona_parts(optimizer))


def _placement(param: torch.nn.Parameter, stride: int, start: int, end: int, tp_rank: int, tp_size: int) -> Placement:
    sharded = bool(getattr(param, "tensor_model_parallel", False)) and tp_size > 1
    return Placement(
        local_shape=tuple(param.shape), flat_start=start, flat_end=end,
        tp_dim=param.partition_dim if sharded else None,
        tp_stride=stride if sharded else 1,
        tp_rank=tp_rank, tp_size=tp_size,
    )


def _rank_and_size(group: Any) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def save_distributed(sharded_state_dict: dict, save_dir: str | Path, iteration: int, *,
                     content_metadata: dict | None = None, verify_integrity: bool = False,
                     checksums: bool = True) -> Path:
    """``dist_checkpointing.save`` of one iteration, staged and committed atomically (for
    callers that do not go through ``megatron.training``: the tests' harness, benchmarks).
    ``verify_integrity`` also writes SHA-256 hashes (``--verify-integrity``), so a corrupt
    file can be named on load. ``checksums`` records Canzona's per-file SHA-256s (once on, on
    for the rest of the process: :func:`canzona_patches.checkpoints.checksums.record_checksums`)."""
    enable_cpu_checkpointing()
    if checksums:
        record_checksums()
    staging = prepare_staging(save_dir, iteration)
    dist_checkpointing.save(sharded_state_dict, str(staging), content_metadata=content_metadata,
                            verify_integrity=verify_integrity)
    return commit_checkpoint(save_dir, iteration)


def load_distributed(sharded_state_dict: dict, load_dir: str | Path, *, optimizer: Any = None) -> tuple[dict, int]:
    """Load the tracked iteration of ``load_dir`` into ``sharded_state_dict``; returns the loaded
    state dict and the iteration. With ``optimizer``, its state is checked to match first.
    Failures raise :class:`CanzonaCheckpointError`."""
    path = verified_checkpoint(load_dir, optimizer=optimizer)
    if path is None:
        raise CanzonaCheckpointError(f"{Path(load_dir) / TRACKER} does not exist: nothing was saved in {load_dir}")
    with one_line_errors(path):
        return dist_checkpointing.load(sharded_state_dict, str(path)), int(path.name[len("iter_"):])


def verified_checkpoint(load_dir: str | Path, *, step: int | None = None, optimizer: Any = None,
                        group: Any = None, checksums: bool = True, ckpt_format: str | None = None) -> Path | None:
    """The checkpoint ``--load`` resumes from, checked by one rank for all of them.

    The first rank of ``group`` (default: every rank) undoes a re-save killed between its
    renames, reads the tracker (or takes ``step``) and checks every file the index names; with
    ``checksums`` the ranks then re-hash the files, each its share, and agree on the first
    mismatch (:func:`canzona_patches.checkpoints.checksums.agreed_mismatch`); with
    ``optimizer``, the first rank checks that a ``torch_dist`` checkpoint's optimizer state is
    the kind this run reads; with ``ckpt_format`` (this run's ``--ckpt-format``), that it is a
    checkpoint of that format (the other layout's is converted once: ``tools/convert_checkpoint.py``).
    Every rank returns the same answer (``None``: nothing was saved) or raises the same line
    (:func:`canzona_patches.checkpoints.files.decided_on_rank_zero`)."""

    def find() -> str | None:
        recover_replaced(Path(load_dir))
        path = None
        try:
            path = resolve_checkpoint(load_dir, step)
            if path is None:
                return None
            if step is not None and not path.is_dir():
                raise CanzonaCheckpointError(f"--ckpt-step {step}: there is no {path}")
            check_checkpoint_files(path)
        except CanzonaCheckpointError as error:  # the checkpoints that are there, and how to go on
            raise CanzonaCheckpointError(f"{error}; {way_on(load_dir, damaged=path)}") from None
        if ckpt_format is not None:
            check_format(path, ckpt_format)
        return str(path)

    found = decided_on_rank_zero(find, group=group)
    if found is None:
        return None
    # Before anything unpickles the files (the optimizer check reads the saved common state).
    mismatch = agreed_mismatch(Path(found), group=group) if checksums else None
    if mismatch and "(the data is intact)" in mismatch:  # only a checksum file changed: restoring it is the way on
        raise CanzonaCheckpointError(mismatch)
    if mismatch:
        way = decided_on_rank_zero(lambda: way_on(load_dir, damaged=Path(found)), group=group)
        raise CanzonaCheckpointError(f"{mismatch}; {way}")
    if optimizer is not None and ((Path(found) / "metadata.json").is_file() or (Path(found) / ".metadata").is_file()):
        decided_on_rank_zero(lambda: check_optimizer_compatible(Path(found), optimizer), group=group)
    return Path(found)


LAYOUT_OF_FORMAT = {"torch_dist": "--use-distributed-optimizer", "fsdp_dtensor": "--use-megatron-fsdp"}


def saved_format(path: Path) -> str | None:
    """``torch_dist`` (Megatron's distributed checkpoint: ``metadata.json``), ``fsdp_dtensor``
    (torch DCP alone: ``.metadata``), or ``None`` for neither."""
    if (path / "metadata.json").is_file():
        return "torch_dist"
    return "fsdp_dtensor" if (path / ".metadata").is_file() else None


def check_format(path: Path, ckpt_format: str) -> None:
    """``path`` is a checkpoint of ``ckpt_format``, or one line says how to convert it (a
    ``torch_dist`` checkpoint under ``--use-megatron-fsdp``, an ``fsdp_dtensor`` one under the
    distributed optimizer: Megatron would fail deep in its load)."""
    saved = saved_format(path)
    if saved is None or ckpt_format not in LAYOUT_OF_FORMAT or saved == ckpt_format:
        return
    step = f" --ckpt-step {int(path.name[len('iter_'):])}" if path.name.startswith("iter_") else ""
    raise CanzonaCheckpointError(
        f"{path} is a {saved} checkpoint (saved under {LAYOUT_OF_FORMAT[saved]}), this run reads {ckpt_format} "
        f"({LAYOUT_OF_FORMAT[ckpt_format]}): convert it once with python tools/convert_checkpoint.py --load "
        f"{path.parent}{step} --save NEW_DIR --to {ckpt_format}, then --load NEW_DIR")


def _fsdp_common_state(path: Path) -> dict:
    """``{"optimizer": {"canzona": common state or None}}`` of an ``fsdp_dtensor`` checkpoint (torch
    DCP), read by this rank alone; ``{}`` when it holds no optimizer state."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if not any(key.startswith("optimizer.") for key in keys):
        return {}
    if "optimizer.canzona" not in keys:
        return {"optimizer": {"canzona": None}}
    wanted: dict = {"optimizer": {"canzona": b""}}
    load(wanted, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    return {"optimizer": {"canzona": pickle.loads(wanted["optimizer"]["canzona"])}}


def is_canzona_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is the Canzona optimizer (a DistributedOptimizer around a
    :class:`CanzonaOptimizer`: ``canzona_patches.integration.optimizer.CanzonaDistributedOptimizer``)."""
    return all(isinstance(part, DistributedOptimizer) and isinstance(part.optimizer, CanzonaOptimizer)
               for part in canzona_parts(optimizer))


def check_optimizer_compatible(path: Path, optimizer: Any) -> None:
    """The optimizer state in ``path`` is the kind this run's optimizer reads."""
    with one_line_errors(path):
        common = dist_checkpointing.load_common_state_dict(str(path)) if (path / "metadata.json").is_file() \
            else _fsdp_common_state(path)
    if not isinstance(common.get("optimizer"), dict):
        if path.name == "release":
            return  # a release checkpoint (tools/convert_hf.py import): Megatron loads its model only
        # (Megatron's load would stop with KeyError: 'optimizer')
        raise CanzonaCheckpointError(
            f"{path} holds no optimizer state (it was saved with --no-save-optim): pass --no-load-optim to load the "
            "model and start the optimizer afresh")
    saved = common["optimizer"].get("canzona")
    canzona_run = is_canzona_optimizer(optimizer)
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


# --------------------------------------------------------------------------- megatron.training hooks

def checked_load_checkpoint(load_checkpoint: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """``load_checkpoint`` after :func:`verified_checkpoint` (the files and, unless the optimizer
    state is not loaded, its kind); any failure is one :class:`CanzonaCheckpointError` line."""

    @functools.wraps(load_checkpoint)
    def load_checkpoint_checked(ddp_model: Any, optimizer: Any, opt_param_scheduler: Any, load_arg: str = "load",
                                *args: Any, **kwargs: Any) -> Any:
        from megatron.training.global_vars import get_args

        megatron_args = get_args()
        load_dir = getattr(megatron_args, load_arg, None)
        loads_optimizer = optimizer is not None and not megatron_args.no_load_optim and not megatron_args.finetune
        path = None if load_dir is None else verified_checkpoint(
            load_dir, step=getattr(megatron_args, "ckpt_step", None), optimizer=optimizer if loads_optimizer else None,
            checksums=getattr(megatron_args, "canzona_checksums", True), ckpt_format=megatron_args.ckpt_format)
        if path is None:
            if load_dir is not None and load_arg == "load":
                _check_nothing_to_resume(load_dir, megatron_args.save)
            return load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg, *args, **kwargs)
        with one_line_errors(path):
            return load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg, *args, **kwargs)

    return load_checkpoint_checked


def is_hugging_face_model(directory: Path) -> bool:
    """A Hugging Face model directory: its ``config.json`` beside safetensors or PyTorch weights."""
    if not (directory / "config.json").is_file():
        return False
    return any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin")) \
        or (directory / "model.safetensors.index.json").is_file()


def _check_nothing_to_resume(load_dir: str, save_dir: str | None) -> None:
    """``--load`` names no checkpoint. The same directory as ``--save`` is the requeue pattern:
    start afresh, and say so; any other directory is a mistake (a typo would otherwise train
    from scratch and exit 0): stop with one line, on every rank alike."""
    same = save_dir is not None and Path(save_dir).resolve() == Path(load_dir).resolve()
    if Path(load_dir).is_dir() and any(Path(load_dir).glob("iter_[0-9]*")):  # checkpoints without their tracker
        raise CanzonaCheckpointError(
            f"--load {load_dir} has checkpoints but no {TRACKER} (deleted?), so nothing says which to resume; "
            f"{way_on(load_dir)}")
    if same:
        if global_rank() == 0:
            print(f"[canzona] --load {load_dir} holds no checkpoint yet: training starts from iteration 0 "
                  "(it is also --save: a requeued job resumes from what this one saves)", flush=True)
        return
    if is_hugging_face_model(Path(load_dir)):
        raise CanzonaCheckpointError(
            f"--load {load_dir} is a Hugging Face model directory (config.json and weights), not a Megatron checkpoint: "
            f"convert it once with python tools/convert_hf.py import --hf {load_dir} --save <dir>, then --load <dir> "
            "(with --finetune to start a new run from its weights)")
    what = "does not exist" if not Path(load_dir).exists() else "holds no checkpoint (no latest_checkpointed_iteration.txt)"
    raise CanzonaCheckpointError(
        f"--load {load_dir} {what}: fix the path, or drop --load to train from scratch "
        "(or pass the same directory as --save, to resume whenever it holds one)")


def with_canzona_metadata(build: Callable[..., dict], run: Any = None) -> Callable[..., dict]:
    """Content metadata of a ``--canzona`` save: the optimizer state is fully reshardable."""

    @functools.wraps(build)
    def build_with_canzona(args: Any, *rest: Any, **kwargs: Any) -> dict:
        metadata = build(args, *rest, **kwargs)
        metadata.update(canzona_content_metadata())
        return metadata

    return build_with_canzona


def canzona_content_metadata() -> dict:
    """What a checkpoint with Canzona optimizer state declares in its content metadata."""
    return {"distrib_optim_sharding_type": "fully_reshardable", "canzona_state_format": STATE_FORMAT}


# --------------------------------------------------------------------------- fsdp_dtensor (torch DCP)


def dcp_tensors(chunks: list[StateChunk], *, is_loading: bool) -> dict[str, torch.Tensor]:
    """The chunks as torch DCP saves and loads them (``--ckpt-format fsdp_dtensor``): per global
    tensor one local tensor holding this rank's blocks of it stacked along the first dimension
    (padded to the widest), marked with DCP's ``CheckpointableTensor`` fields (the global shape,
    each block's global offset, its place and size in the local tensor), so that a load at any
    layout reads each block from wherever it was written. Saving keeps the blocks this rank
    writes (``main``); loading requests every block this rank holds, into zeros that
    :func:`restore_dcp_tensors` copies into the live state."""
    by_key: dict[str, list[StateChunk]] = {}
    for chunk in chunks:
        if is_loading or chunk.main:
            by_key.setdefault(chunk.key, []).append(chunk)
    out = {}
    for key, blocks in by_key.items():
        shapes = [tuple(b.data.shape) for b in blocks]
        if any(len(shape) != len(blocks[0].global_shape) or not shape for shape in shapes):
            raise RuntimeError(f"{key}: a block of shape {shapes[0]} of a {blocks[0].global_shape} tensor; "
                               "fsdp_dtensor checkpoints need blocks of the global tensor's rank")
        width = tuple(max(shape[d] for shape in shapes) for d in range(1, len(shapes[0])))
        local = torch.zeros((sum(shape[0] for shape in shapes), *width), dtype=blocks[0].data.dtype,
                            device=blocks[0].data.device)
        places, row = [], 0
        for block, shape in zip(blocks, shapes):
            places.append((row, *(0 for _ in width)))
            if not is_loading:
                local[_slices(places[-1], shape)] = block.data
            row += shape[0]
        local.global_shape = tuple(blocks[0].global_shape)
        local.global_offsets = tuple(tuple(b.global_offset) for b in blocks)
        local.local_offsets = tuple(places)
        local.local_sizes = tuple(shapes)
        out[key] = local
    return out


def restore_dcp_tensors(chunks: list[StateChunk], loaded: dict[str, torch.Tensor]) -> None:
    """Copy what DCP loaded into the tensors of :func:`dcp_tensors` back into the live state."""
    for chunk in chunks:
        local = loaded.get(chunk.key)
        if local is None:
            raise CanzonaCheckpointError(f"the optimizer state lacks {chunk.key}; it was saved by another optimizer "
                                         "or model (pass --no-load-optim to load the model weights only)")
        where = {tuple(g): (tuple(o), tuple(z)) for g, o, z in
                 zip(local.global_offsets, local.local_offsets, local.local_sizes)}
        place, size = where[tuple(chunk.global_offset)]
        chunk.restore(local[_slices(place, size)])


def _slices(offset: tuple[int, ...], size: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, size))
