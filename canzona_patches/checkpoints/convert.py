"""A checkpoint of one format rewritten in the other: ``torch_dist`` (``--use-distributed-optimizer``)
and ``fsdp_dtensor`` (``--use-megatron-fsdp``), so a run moves between the two layouts and resumes.

Both are torch DCP directories of global tensors; what differs is how they are named and cut:

* the model. ``torch_dist`` stacks a transformer layer's tensors over the layers (``decoder.layers.X``
  of shape ``(layers, ...)``; a SequentialMLP's experts over ``(layers, experts, ...)`` as
  ``decoder.layers.mlp.experts.experts.X``) and, under Megatron's local layer spec, names the two
  layer norms after the transformer-engine modules they fuse into (``input_layernorm.`` ->
  ``self_attention.linear_qkv.layer_norm_``); ``fsdp_dtensor`` keeps one tensor per parameter,
  ``model.module.<name>``, experts by global index, a gated fc1 cut into its gate and up halves
  (``weight_w``, ``weight_v``: Megatron's ``handle_swiglu_in_state_dict``);
* the Canzona optimizer state: the same name-keyed global tensors (``optimizer.canzona.<key>``
  against ``optimizer.canzona_state.optimizer.canzona.<key>``), except Muon's (AdaMuon's) momentum:
  the distributed optimizer keeps it with the matrix on its host, one tensor per piece of a fused
  matrix (``<name>.piece<k>.momentum``); Megatron-FSDP on the holders, in the parameter's own layout
  (``<name>.holder_momentum``). The pieces are the parameter's rows as the optimizer splits it
  (:mod:`megatron.canzona.optim.split`), so the one is the other merged: exact, element for element;
* everything else (arguments, iteration, scheduler, the optimizer's common state, the RNG states of
  each (PP, TP) rank) one object each, ``common_state`` and ``ShardedObject``s in ``torch_dist``,
  flat keys in ``fsdp_dtensor``. Megatron's rerun-state record is not carried (an ``fsdp_dtensor``
  checkpoint has none; a run ignores it whenever the layout changes).

:func:`convert` reads one iteration and writes it, staged and committed with its checksums as a
save is (:mod:`canzona_patches.checkpoints.files`). Each tensor is read and written whole by one
process: with several processes (torchrun, gloo), each takes its share by bytes, so memory is the
checkpoint over the processes.
"""

from __future__ import annotations

import copy
import itertools
import math
import pickle
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from canzona_patches.checkpoints.files import (
    CanzonaCheckpointError,
    commit_checkpoint,
    enable_cpu_checkpointing,
    prepare_staging,
)
from canzona_patches.checkpoints.checksums import record_checksums
from canzona_patches.checkpoints.state import (
    FSDP_STATE,
    STATE_PREFIX,
    canzona_content_metadata,
    saved_format,
    verified_checkpoint,
)
from megatron.canzona.optim.split import GateUpLayout, QKVLayout, merge_pieces, split_pieces

FORMATS = ("torch_dist", "fsdp_dtensor")
FSDP_MODEL = "model.module."
"""Prefix of the model's tensors in an ``fsdp_dtensor`` checkpoint (the model inside Megatron-FSDP's wrapper)."""
FSDP_OPTIMIZER = f"optimizer.{FSDP_STATE}.{STATE_PREFIX}"
TORCH_DIST_OPTIMIZER = STATE_PREFIX
LAYERS = "decoder.layers."
STACKED_EXPERTS = "mlp.experts.experts."
"""A SequentialMLP's tensors in ``torch_dist`` (stacked over experts); per expert ``mlp.experts.local_experts.<e>.``."""
LOCAL_SPEC_NAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
"""Megatron's local layer spec: module name -> its ``torch_dist`` key (``sharded_state_dict_keys_map``)."""
TOP_LEVEL = ("embedding.", "output_layer.", "decoder.final_layernorm.")
SWIGLU_FC1 = re.compile(r"(^|\.)(mlp|mlp\.shared_experts|mlp\.experts\.local_experts\.\d+)\.linear_fc1\.(weight|bias)$")
"""The gated fc1 tensors Megatron-FSDP's checkpoints keep as gate (``_w``) and up (``_v``) halves."""
SCALARS = ("args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far")
PIECE_MOMENTUM = re.compile(r"^(?P<name>.+)\.piece(?P<k>\d+)\.momentum$")
HOLDER_MOMENTUM = ".holder_momentum"


def checkpoint_format(path: Path) -> str:
    """:func:`~canzona_patches.checkpoints.state.saved_format`, which must be one of the two."""
    found = saved_format(path)
    if found is None:
        raise CanzonaCheckpointError(f"{path} is neither a torch_dist nor an fsdp_dtensor checkpoint (no metadata.json, "
                                     "no .metadata)")
    return found


# --------------------------------------------------------------------------- the plan of a conversion


@dataclass
class Unit:
    """Tensors read together and written together: ``sources`` (keys in the source checkpoint)
    become ``transform(loaded)`` (keys in the target)."""

    sources: tuple[str, ...]
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    nbytes: int = 0


@dataclass
class Contents:
    """A checkpoint's index, read without its tensors: the format, each tensor's shape and dtype,
    the keys of its objects."""

    path: Path
    format: str
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    objects: list[str] = field(default_factory=list)


def read_contents(path: Path) -> Contents:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    contents = Contents(path=path, format=checkpoint_format(path))
    for key, meta in FileSystemReader(str(path)).read_metadata().state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            contents.tensors[key] = (tuple(meta.size), meta.properties.dtype)
        else:
            contents.objects.append(key)
    return contents


def load_keys(path: Path, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]], objects: Iterable[str] = ()) -> dict:
    """The named tensors (whole) and objects of a DCP checkpoint, read by this process alone."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    wanted: dict[str, Any] = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in tensors.items()}
    wanted.update({key: b"" for key in objects})
    if wanted:
        load(wanted, storage_reader=FileSystemReader(str(path)), planner=DefaultLoadPlanner(allow_partial_load=True),
             no_dist=True)
    return wanted


def _layer_names(stacked: str, shape: tuple[int, ...], local_spec: bool) -> list[tuple[tuple[int, ...], str]]:
    """``(index into the stacked tensor, the parameter's name)`` for each parameter a ``torch_dist``
    layer-stacked tensor holds."""
    rest = stacked[len(LAYERS):]
    if local_spec:
        for module, key in LOCAL_SPEC_NAMES:
            if rest.startswith(key):
                rest = module + rest[len(key):]
    if rest.startswith(STACKED_EXPERTS):
        inner = rest[len(STACKED_EXPERTS):]
        return [((layer, expert), f"{LAYERS}{layer}.mlp.experts.local_experts.{expert}.{inner}")
                for layer in range(shape[0]) for expert in range(shape[1])]
    return [((layer,), f"{LAYERS}{layer}.{rest}") for layer in range(shape[0])]


def _stacked_key(name: str, local_spec: bool) -> tuple[str, tuple[int, ...]]:
    """The ``torch_dist`` stacked key of a per-layer parameter name, and its index there."""
    match = re.match(r"decoder\.layers\.(\d+)\.(.+)$", name)
    if match is None:
        raise CanzonaCheckpointError(f"{name}: not a transformer layer's parameter")
    layer, rest = int(match[1]), match[2]
    expert = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(.+)$", rest)
    if expert:
        return f"{LAYERS}{STACKED_EXPERTS}{expert[2]}", (layer, int(expert[1]))
    if local_spec:
        for module, key in LOCAL_SPEC_NAMES:
            if rest.startswith(module):
                rest = key + rest[len(module):]
    return f"{LAYERS}{rest}", (layer,)


def _unknown(key: str, fmt: str) -> CanzonaCheckpointError:
    return CanzonaCheckpointError(
        f"{key}: this converter does not know how {fmt} lays out that tensor (transformer layers, embedding, output "
        "layer and final norm only: no multi-token prediction, no grouped-GEMM experts); convert it with Megatron's "
        "tools/checkpoint, or resume in the layout it was saved in")


def _halves(name: str, swiglu: bool) -> bool:
    return swiglu and SWIGLU_FC1.search(name) is not None


def model_units(contents: Contents, args: Any, to: str) -> list[Unit]:
    """The model's tensors, each unit one source tensor."""
    local_spec = getattr(args, "transformer_impl", "local") == "local"
    swiglu = bool(getattr(args, "swiglu", False))
    units: list[Unit] = []
    if contents.format == "torch_dist":
        for key, (shape, dtype) in contents.tensors.items():
            if key.startswith("optimizer."):
                continue
            if key.startswith(LAYERS):
                names = _layer_names(key, shape, local_spec)
                if key[len(LAYERS):].startswith(STACKED_EXPERTS) and len(shape) < 3:
                    raise _unknown(key, "torch_dist")
            elif key.startswith(TOP_LEVEL):
                names = [((), key)]
            else:
                raise _unknown(key, "torch_dist")

            def split_layers(loaded: dict, key: str = key, names: list = names) -> dict:
                out = {}
                for index, name in names:
                    tensor = loaded[key][index] if index else loaded[key]
                    if _halves(name, swiglu):
                        w, v = tensor.chunk(2, dim=0)
                        out[f"{FSDP_MODEL}{name}_w"], out[f"{FSDP_MODEL}{name}_v"] = w.clone(), v.clone()
                    else:
                        out[f"{FSDP_MODEL}{name}"] = tensor.clone() if index else tensor
                return out

            units.append(Unit((key,), split_layers, _nbytes(shape, dtype)))
        return units
    # fsdp_dtensor -> torch_dist: per stacked key, every layer's (expert's) tensor
    stacks: dict[str, dict[tuple[int, ...], tuple[str, ...]]] = {}
    top: list[str] = []
    for key in contents.tensors:
        if not key.startswith(FSDP_MODEL):
            continue
        name = key[len(FSDP_MODEL):]
        if name.endswith(("_w", "_v")) and _halves(name[:-2], swiglu):
            if name.endswith("_v"):
                continue
            name, sources = name[:-2], (f"{FSDP_MODEL}{name[:-2]}_w", f"{FSDP_MODEL}{name[:-2]}_v")
        else:
            sources = (key,)
        if name.startswith(LAYERS):
            stacked, index = _stacked_key(name, local_spec)
            stacks.setdefault(stacked, {})[index] = sources
        elif name.startswith(TOP_LEVEL):
            top.append(key)
        else:
            raise _unknown(name, "fsdp_dtensor")
    for key in top:
        units.append(Unit((key,), lambda loaded, key=key: {key[len(FSDP_MODEL):]: loaded[key]},
                          _nbytes(*contents.tensors[key])))
    for stacked, members in stacks.items():
        indices = sorted(members)
        extent = tuple(max(i[d] for i in indices) + 1 for d in range(len(indices[0])))
        if len(indices) != math.prod(extent):
            raise CanzonaCheckpointError(f"{stacked}: the fsdp_dtensor checkpoint holds {len(indices)} of its "
                                         f"{math.prod(extent)} layers (experts); it is incomplete")
        sources = tuple(s for i in indices for s in members[i])

        def stack(loaded: dict, stacked: str = stacked, members: dict = members, indices: list = indices,
                  extent: tuple = extent) -> dict:
            parts = [torch.cat([loaded[s] for s in members[i]], dim=0) for i in indices]
            return {stacked: torch.stack(parts).reshape(*extent, *parts[0].shape)}

        units.append(Unit(sources, stack, sum(_nbytes(*contents.tensors[s]) for s in sources)))
    return units


def fused_layouts(args: Any, pieces: list[str]) -> Callable[[str], Any]:
    """The optimizer's split of a parameter by name (:func:`canzona_patches.integration.setup.fused_layout`'s
    rules, from the saved arguments and the checkpoint's ``pieces``)."""
    heads = args.num_attention_heads
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    groups = groups or heads
    head_dim = getattr(args, "kv_channels", None) or args.hidden_size // heads

    def layout(name: str) -> Any:
        if {"qkv", "qkv_heads"} & set(pieces) and name.endswith("linear_qkv.weight"):
            return QKVLayout(num_query_groups=groups, heads_per_group=heads // groups, head_dim=head_dim,
                             split_heads="qkv_heads" in pieces)
        if "gate_up" in pieces and getattr(args, "swiglu", False) and name.endswith("linear_fc1.weight"):
            return GateUpLayout(num_partitions=1)
        return None

    return layout


def optimizer_units(contents: Contents, layout_of: Callable[[str], Any], to: str) -> list[Unit]:
    """The Canzona optimizer's tensors, renamed; Muon's momentum between its hosts' pieces and its holders'."""
    source_prefix = TORCH_DIST_OPTIMIZER if contents.format == "torch_dist" else FSDP_OPTIMIZER
    target_prefix = TORCH_DIST_OPTIMIZER if to == "torch_dist" else FSDP_OPTIMIZER
    keys = [k[len(source_prefix):] for k in contents.tensors if k.startswith(source_prefix)]
    units: list[Unit] = []
    momenta: dict[str, dict[int, str]] = {}
    for key in keys:
        match = PIECE_MOMENTUM.match(key)
        if to == "fsdp_dtensor" and match:
            momenta.setdefault(match["name"], {})[int(match["k"])] = key
            continue
        source = source_prefix + key
        if to == "torch_dist" and key.endswith(HOLDER_MOMENTUM):
            name = key[:-len(HOLDER_MOMENTUM)]

            def to_pieces(loaded: dict, source: str = source, name: str = name) -> dict:
                pieces = split_pieces(loaded[source], layout_of(name))
                return {f"{target_prefix}{name}.piece{k}.momentum": p.clone() for k, p in enumerate(pieces)}

            units.append(Unit((source,), to_pieces, _nbytes(*contents.tensors[source])))
            continue
        units.append(Unit((source,), lambda loaded, source=source, key=key: {target_prefix + key: loaded[source]},
                          _nbytes(*contents.tensors[source])))
    for name, pieces in momenta.items():
        sources = tuple(source_prefix + pieces[k] for k in sorted(pieces))
        if sorted(pieces) != list(range(len(pieces))):
            raise CanzonaCheckpointError(f"{name}: momentum pieces {sorted(pieces)}; the checkpoint is incomplete")

        def to_holders(loaded: dict, sources: tuple = sources, name: str = name) -> dict:
            layout = layout_of(name)
            if layout is None and len(sources) != 1:
                raise CanzonaCheckpointError(f"{name}: {len(sources)} momentum pieces of a matrix the saved run does not split")
            return {f"{target_prefix}{name}{HOLDER_MOMENTUM}": merge_pieces([loaded[s] for s in sources], layout)}

        units.append(Unit(sources, to_holders, sum(_nbytes(*contents.tensors[s]) for s in sources)))
    return units


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


READ_BATCH_BYTES = 1 << 30
"""Bytes of source tensors read by one torch DCP ``load`` (each reads the checkpoint's whole index:
one per tensor would be quadratic in the tensors, ~10^5 of them in Qwen3-235B's fsdp_dtensor)."""


def batches(units: list[Unit], limit: int) -> list[list[Unit]]:
    """``units`` in order, cut into runs of at most ``limit`` bytes (a larger unit alone)."""
    out: list[list[Unit]] = []
    size = limit
    for unit in units:
        if size + unit.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(unit)
        size += unit.nbytes
    return out


def share(units: list[Unit], rank: int, world: int) -> list[Unit]:
    """This process's units: the largest first, each to the process with the fewest bytes so far."""
    loads = [0] * world
    mine = []
    for index in sorted(range(len(units)), key=lambda i: -units[i].nbytes):
        owner = min(range(world), key=lambda r: (loads[r], r))
        loads[owner] += units[index].nbytes
        if owner == rank:
            mine.append(units[index])
    return mine


# --------------------------------------------------------------------------- the objects


def read_objects(contents: Contents) -> dict:
    """The checkpoint's objects: ``SCALARS``, ``opt_param_scheduler``, ``optimizer`` (the Canzona
    common state, or None), ``rng`` (``{(pp, tp): that rank's RNG state list}``) and, of a
    ``torch_dist`` one, its content metadata."""
    if contents.format == "torch_dist":
        from megatron.core import dist_checkpointing

        common = dist_checkpointing.load_common_state_dict(str(contents.path))
        rng_keys = [k for k in contents.objects if k.startswith("rng_state/shard_")]
        loaded = load_keys(contents.path, {}, rng_keys)
        rng = {}
        for key in rng_keys:
            offsets = key[len("rng_state/shard_"):].split("_")[0].split(".")
            rng[tuple(int(o) for o in offsets)] = _sharded_object(loaded[key], key)
        optimizer = common.get("optimizer")
        return {**{k: common[k] for k in SCALARS if k in common}, "opt_param_scheduler": common.get("opt_param_scheduler"),
                "optimizer": optimizer.get("canzona") if isinstance(optimizer, dict) else None, "rng": rng,
                "content_metadata": common.get("content_metadata")}
    wanted = [k for k in contents.objects if k in SCALARS or k.startswith(("opt_param_scheduler.", "rng_state."))
              or k == "optimizer.canzona"]
    rng_tensors = {k: v for k, v in contents.tensors.items() if k.startswith("rng_state.")}
    loaded = load_keys(contents.path, rng_tensors, wanted)
    out: dict = {k: loaded[k] for k in SCALARS if k in loaded}
    out["opt_param_scheduler"] = {k.split(".", 1)[1]: v for k, v in loaded.items() if k.startswith("opt_param_scheduler.")} or None
    out["optimizer"] = pickle.loads(loaded["optimizer.canzona"]) if "optimizer.canzona" in loaded else None
    out["rng"] = {}
    for key, value in loaded.items():
        if key.startswith("rng_state."):
            match = re.match(r"rng_state\.\((\d+), (\d+)\)\.(.+)$", key)
            if match is None:
                raise _unknown(key, "fsdp_dtensor")
            _nest(out["rng"].setdefault((int(match[1]), int(match[2])), []), match[3].split("."), value)
    return out


def _sharded_object(raw: Any, key: str) -> Any:
    """A ``ShardedObject``'s data as read from storage without Megatron (which stores it as ``[data]``)."""
    if not (isinstance(raw, list) and len(raw) == 1):
        raise CanzonaCheckpointError(f"{key}: not a Megatron ShardedObject ({type(raw).__name__}); the checkpoint is damaged")
    return raw[0]


def _nest(into: Any, path: list[str], value: Any) -> None:
    """Put ``value`` at a flattened DCP path (list indices as digits) of ``into``."""
    head, rest = path[0], path[1:]
    if isinstance(into, list):
        index = int(head)
        while len(into) <= index:
            into.append([] if rest and rest[0].isdigit() else {})
        if rest:
            _nest(into[index], rest, value)
        else:
            into[index] = value
        return
    if rest:
        _nest(into.setdefault(head, [] if rest[0].isdigit() else {}), rest, value)
    else:
        into[head] = value


def _flatten(prefix: str, value: Any, out: dict) -> None:
    """DCP's flattening of nested dicts and lists (keys joined by dots, list indices as digits)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}", item, out)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _flatten(f"{prefix}.{index}", item, out)
    else:
        out[prefix] = value


def _target_args(args: Any, to: str) -> Any:
    """The saved arguments as the target layout's run would have saved them."""
    args = copy.copy(args)
    args.ckpt_format = to
    args.use_megatron_fsdp = to == "fsdp_dtensor"
    args.use_distributed_optimizer = to == "torch_dist"
    return args


# --------------------------------------------------------------------------- the conversion


def convert(load_dir: str | Path, save_dir: str | Path, *, to: str, step: int | None = None, optimizer: bool = True,
            progress: Callable[[str], None] | None = None) -> Path:
    """Rewrite the tracked iteration of ``load_dir`` (or ``step``) as a ``to`` checkpoint in
    ``save_dir`` (without ``optimizer``: the model alone, for ``--no-load-optim``); returns the
    committed directory. Collective when ``torch.distributed`` is initialized (each process
    converts its share)."""
    if to not in FORMATS:
        raise CanzonaCheckpointError(f"--to {to}: choose one of {', '.join(FORMATS)}")
    say = progress or (lambda line: None)
    path = verified_checkpoint(load_dir, step=step)
    if path is None:
        raise CanzonaCheckpointError(f"{load_dir} holds no checkpoint (no latest_checkpointed_iteration.txt)")
    contents = read_contents(path)
    if contents.format == to:
        raise CanzonaCheckpointError(f"{path} is already a {to} checkpoint: --load it as it is")
    objects = read_objects(contents)
    args = objects.get("args")
    if args is None:
        raise CanzonaCheckpointError(f"{path} holds no saved arguments: it cannot be converted")
    if not optimizer:
        objects["optimizer"] = None
    elif objects["optimizer"] is None and any(k.startswith("optimizer.") for k in contents.tensors):
        raise CanzonaCheckpointError(
            f"{path} holds the state of Megatron's own optimizer, which the two layouts keep in forms this converter "
            "does not map: pass --no-load-optim to convert the model alone (and resume with --no-load-optim)")
    units = model_units(contents, args, to)
    if objects["optimizer"] is not None:
        units += optimizer_units(contents, fused_layouts(args, objects["optimizer"]["pieces"]), to)
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) \
        if torch.distributed.is_initialized() else (0, 1)
    mine = share(units, rank, world)
    say(f"{path} ({contents.format}, iteration {objects['iteration']}) -> {to}: {len(units)} tensors, "
        f"{sum(u.nbytes for u in units) / 2**20:.1f} MiB; this process {len(mine)}")
    tensors: dict[str, torch.Tensor] = {}
    done = 0
    for batch in batches(mine, READ_BATCH_BYTES):
        loaded = load_keys(path, {s: contents.tensors[s] for unit in batch for s in unit.sources})
        for unit in batch:
            tensors.update(unit.transform({s: loaded.pop(s) for s in unit.sources}))
        done += len(batch)
        say(f"  read {done}/{len(mine)}")
    iteration = int(objects["iteration"])
    enable_cpu_checkpointing()
    record_checksums()
    staging = prepare_staging(save_dir, iteration)
    (_save_torch_dist if to == "torch_dist" else _save_fsdp_dtensor)(tensors, objects, staging, rank == 0, to)
    final = commit_checkpoint(save_dir, iteration)
    say(f"wrote {final}")
    return final


def _save_torch_dist(tensors: dict, objects: dict, staging: Path, first: bool, to: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    state: dict[str, Any] = {k: objects[k] for k in SCALARS if k in objects}
    state["args"] = _target_args(objects["args"], to)
    if objects.get("opt_param_scheduler") is not None:
        state["opt_param_scheduler"] = objects["opt_param_scheduler"]
    model = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()
             if not k.startswith(TORCH_DIST_OPTIMIZER)}
    state["model"] = model
    state["extra_state"] = _extra_states(tensors, ShardedObject)
    if objects["optimizer"] is not None:
        state["optimizer"] = {"canzona": objects["optimizer"], "state": {
            k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()
            if k.startswith(TORCH_DIST_OPTIMIZER)}}
    if first and objects["rng"]:
        grid = tuple(max(i[d] for i in objects["rng"]) + 1 for d in range(2))
        state["rng_state"] = [ShardedObject("rng_state", value, grid, index, replica_id=0)
                              for index, value in sorted(objects["rng"].items())]
    metadata = dict(objects.get("content_metadata") or {})
    metadata.update(canzona_content_metadata() if objects["optimizer"] is not None else {})
    metadata.setdefault("distrib_optim_sharding_type", "fully_reshardable")
    metadata.setdefault("singleton_local_shards", False)
    metadata.setdefault("chained_optim_avoid_prefix", True)
    dist_checkpointing.save(state, str(staging), content_metadata=metadata)


def _extra_states(tensors: dict, sharded_object: Any) -> list:
    """The ``_extra_state`` objects a ``torch_dist`` load asks of each linear module of the layers (none
    under Megatron's local spec; transformer-engine's FP8 metadata, which a load without it starts afresh)."""
    out = []
    for key, tensor in tensors.items():
        module, _, leaf = key.rpartition(".")
        if not key.startswith(LAYERS) or leaf != "weight" or not module.rpartition(".")[2].startswith("linear_"):
            continue
        grid = tuple(tensor.shape[:2 if f".{STACKED_EXPERTS}" in f".{key[len(LAYERS):]}" else 1])
        for index in itertools.product(*(range(n) for n in grid)):
            out.append(sharded_object(f"{module}._extra_state", None, grid, index, replica_id=0))
    return out


def _save_fsdp_dtensor(tensors: dict, objects: dict, staging: Path, first: bool, to: str) -> None:
    from torch.distributed.checkpoint import FileSystemWriter, save

    state: dict[str, Any] = dict(tensors)
    if first:
        for key in SCALARS:
            if key in objects:
                state[key] = objects[key]
        state["args"] = _target_args(objects["args"], to)
        for key, value in (objects.get("opt_param_scheduler") or {}).items():
            state[f"opt_param_scheduler.{key}"] = value
        if objects["optimizer"] is not None:
            state["optimizer.canzona"] = pickle.dumps(objects["optimizer"])
        for (pp, tp), value in objects["rng"].items():
            _flatten(f"rng_state.({pp}, {tp})", value, state)
    save(state, storage_writer=FileSystemWriter(str(staging)), no_dist=not torch.distributed.is_initialized())
