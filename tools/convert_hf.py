#!/usr/bin/env python
"""Convert Qwen3 weights between pretrain_gpt.py's torch_dist checkpoints and Hugging Face.

    python tools/convert_hf.py export --load CKPT_DIR [--iteration N] --save HF_DIR
    python tools/convert_hf.py import --hf HF_DIR --save CKPT_DIR

``export`` reads the model weights of a ``torch_dist`` checkpoint (the tracked iteration of
``--load``, or ``--iteration N``; saved at any TP, PP and DP size, without its optimizer
state) and writes a directory that ``transformers.Qwen3ForCausalLM.from_pretrained`` loads:
``config.json``, ``model.safetensors`` (numbered shards and an index above
``--max-shard-size``) and, when the run's ``--tokenizer-model`` is a Hugging Face tokenizer
directory (or ``--tokenizer DIR`` names one), its tokenizer and generation files. The
architecture comes from the Megatron arguments saved in the checkpoint; one that is not
Qwen3 (LayerNorm, GELU, biases, MoE, ...) is refused. ``vocab_size`` is Megatron's padded
vocabulary unless ``--vocab-size N`` keeps the first N rows.

``import`` builds the Megatron GPT model of a Hugging Face Qwen3 directory in this process
(TP 1, PP 1, on CPU), copies the weights in and saves it with Megatron's distributed
checkpointing as a *release* checkpoint (``CKPT_DIR/release``, tracker ``release``):
``pretrain_gpt.py --load CKPT_DIR`` with the printed architecture flags starts from it at
iteration 0 with a fresh optimizer, at any TP and PP size (torch_dist reshards on load).

The layouts are mapped by ``megatron.canzona.hf`` (fused QKV per query group, fc1 as
[gate; up]). Bad input exits 2 with one line that names the fix.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from megatron.canzona.cli import ArgumentParser, at_least
from megatron.canzona.hf import (
    EMBEDDING,
    EXPERT_TENSORS,
    FINAL_NORM,
    LAYER_PREFIX,
    LAYER_TENSORS,
    STACKED_EXPERTS,
    LOCAL_SPEC_NAMES,
    OUTPUT_LAYER,
    ConversionError,
    arch_from_hf_config,
    arch_from_megatron_args,
    checkpoint_name,
    from_hf,
    hf_config,
    layer_tensors,
    hf_names,
    megatron_flags,
    megatron_shapes,
    to_hf,
    vocab_divisor,
)
from megatron.canzona.planning import Qwen3Config

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's tracker: the iteration ``--load`` resumes from, or ``release``."""
RELEASE = "release"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "generation_config.json")
"""Files copied beside the weights when the tokenizer directory has them."""
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
"""Keys of a torch_dist checkpoint that hold model weights (the rest: optimizer, RNG, ...)."""
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
"""What a model-only save of ``megatron.training`` (0.19.2) records about its sharded layout."""


def log(message: str) -> None:
    print(f"[convert_hf] {message}", flush=True)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _megabytes(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


# --------------------------------------------------------------------------- export


def checkpoint_dir(load: Path, iteration: int | None) -> Path:
    """The iteration directory to read: ``--iteration`` or the tracked one of ``load``
    (which may also be an iteration directory itself)."""
    if not load.is_dir():
        raise ConversionError(f"--load {load} does not exist: pass the --save directory of a pretrain_gpt.py run")
    if (load / ".metadata").is_file() and iteration is None:
        return load
    if iteration is not None:
        path = load / f"iter_{iteration:07d}"
    elif (load / TRACKER).is_file():
        tracked = (load / TRACKER).read_text().strip()
        if tracked != RELEASE and not tracked.isdigit():
            raise ConversionError(f"{load / TRACKER} holds {tracked!r}, not an iteration: pass --iteration N")
        path = load / (RELEASE if tracked == RELEASE else f"iter_{int(tracked):07d}")
    else:
        raise ConversionError(f"{load} is not a Megatron checkpoint directory (no {TRACKER}): pass the --save "
                              "directory of a pretrain_gpt.py run, or --iteration N")
    if not path.is_dir():
        raise ConversionError(f"{path} does not exist: pass --iteration N of a saved iteration of {load}")
    if any(entry.name.startswith("mp_rank_") for entry in path.iterdir()):
        raise ConversionError(f"{path} is a --ckpt-format torch checkpoint: only torch_dist checkpoints (the "
                              "default format) export; save the run with --ckpt-format torch_dist")
    if not (path / ".metadata").is_file():
        raise ConversionError(f"{path / '.metadata'} is missing: not a complete torch_dist checkpoint")
    return path


def read_megatron_args(path: Path) -> argparse.Namespace:
    """The Megatron arguments a checkpoint was saved with (its common state)."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    with _reading(path):
        common = load_common_state_dict(str(path))
    args = common.get("args")
    if args is None:
        raise ConversionError(f"{path} holds no Megatron arguments: save it with pretrain_gpt.py")
    return args


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Any failure to read ``path`` as one ConversionError line."""
    try:
        yield
    except ConversionError:
        raise
    except BaseException as error:  # noqa: BLE001 -- DCP's CheckpointException derives from BaseException
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        cause = (str(error).strip().splitlines() or [""])[-1][:300]
        raise ConversionError(f"cannot read {path} ({type(error).__name__}: {cause}): is it a complete checkpoint?") from error


def model_tensors(path: Path) -> dict[str, Any]:
    """Storage metadata of the checkpoint's model tensors, keyed by checkpoint key."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with _reading(path):
        metadata = FileSystemReader(str(path)).read_metadata()
    return {key: meta for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(MODEL_PREFIXES) and isinstance(meta, TensorStorageMetadata)}


def read_tensor(path: Path, key: str, meta: Any) -> torch.Tensor:
    """One whole (unsharded) tensor of a torch_dist checkpoint, however it was sharded."""
    from torch.distributed.checkpoint import FileSystemReader, load

    tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    with _reading(path), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
        load({key: tensor}, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return tensor


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the checkpoint and the per-layer Megatron tensors it holds."""

    key: str
    """Checkpoint key."""
    names: tuple[str, ...]
    """Megatron names (layer number included) of its slices, in order."""
    stacked: bool
    """Whether a leading dimension numbers the layers (torch_dist's layout)."""
    experts: bool = False
    """Whether a second one numbers the experts (a SequentialMLP's tensors: ``(layers, experts, ...)``)."""


def stored_tensors(arch: Qwen3Config, stored: dict[str, Any]) -> list[StoredTensor]:
    """The checkpoint's model tensors in model order. A layer tensor is one stacked key
    (``decoder.layers.<name>``) or one key per layer; the input norms may carry the local
    spec's names. Unknown or missing tensors raise."""
    found = [StoredTensor(EMBEDDING, (EMBEDDING,), False)]
    local_names = {fused: local for local, fused in LOCAL_SPEC_NAMES.items()}
    for name in (EXPERT_TENSORS if arch.is_moe else ()):  # every layer's experts, by global index
        names = tuple(f"{LAYER_PREFIX}{layer}.mlp.experts.local_experts.{expert}.{name}"
                      for layer in range(arch.num_layers) for expert in range(arch.num_experts))
        found.append(StoredTensor(f"{LAYER_PREFIX}{STACKED_EXPERTS}{name}", names, True, experts=True))
    for name in layer_tensors(arch):
        spellings = [name, local_names[name]] if name in local_names else [name]
        names = tuple(f"{LAYER_PREFIX}{layer}.{name}" for layer in range(arch.num_layers))
        stacked = [f"{LAYER_PREFIX}{spelling}" for spelling in spellings if f"{LAYER_PREFIX}{spelling}" in stored]
        if stacked:
            found.append(StoredTensor(stacked[0], names, True))
            continue
        for layer, layer_name in enumerate(names):
            keys = [f"{LAYER_PREFIX}{layer}.{spelling}" for spelling in spellings]
            found.append(StoredTensor(next((key for key in keys if key in stored), layer_name), (layer_name,), False))
    found.append(StoredTensor(FINAL_NORM, (FINAL_NORM,), False))
    if not arch.tied_embeddings:
        found.append(StoredTensor(OUTPUT_LAYER, (OUTPUT_LAYER,), False))
    wanted = {tensor.key for tensor in found}
    unknown, missing = sorted(stored.keys() - wanted), sorted(wanted - stored.keys())
    if unknown:
        raise ConversionError(f"the checkpoint holds {unknown[0]} (and {len(unknown) - 1} more unknown tensors), "
                              "which a Qwen3 GPT model does not have: only Qwen3-architecture checkpoints export")
    if missing:
        raise ConversionError(f"the checkpoint lacks {missing[0]} (and {len(missing) - 1} more): it is incomplete, or "
                              "its saved arguments do not describe its weights")
    return found


def export(options: argparse.Namespace) -> int:
    """``export``: torch_dist checkpoint -> Hugging Face directory."""
    path = checkpoint_dir(options.load, options.iteration)
    _check_empty_hf_dir(options.save)
    megatron_args = read_megatron_args(path)
    arch = arch_from_megatron_args(megatron_args)
    out_arch = arch if options.vocab_size is None else replace(arch, vocab_size=options.vocab_size)
    if not 0 < out_arch.vocab_size <= arch.vocab_size:
        raise ConversionError(f"--vocab-size {out_arch.vocab_size} is outside 1..{arch.vocab_size} (the "
                              "checkpoint's padded vocabulary)")
    stored = model_tensors(path)
    tensors = stored_tensors(arch, stored)
    layout = (f"TP {getattr(megatron_args, 'tensor_model_parallel_size', 1)} x "
              f"PP {getattr(megatron_args, 'pipeline_model_parallel_size', 1)} x "
              f"DP {getattr(megatron_args, 'data_parallel_size', 1)}")
    if arch.is_moe:
        layout += (f" x EP {getattr(megatron_args, 'expert_model_parallel_size', 1)} x expert TP "
                   f"{getattr(megatron_args, 'expert_tensor_parallel_size', None) or 1}")
    moe = f", {arch.num_experts} experts of {arch.moe_ffn_hidden_size} (top {arch.moe_router_topk})" if arch.is_moe else ""
    log(f"reading {path} (torch_dist, saved at {layout}): Qwen3{'-MoE' if arch.is_moe else ''}, {arch.num_layers} "
        f"layers, hidden {arch.hidden_size}{moe}, {'tied' if arch.tied_embeddings else 'untied'} embeddings")
    options.save.mkdir(parents=True, exist_ok=True)
    writer = SafetensorsWriter(options.save, options.max_shard_size)
    dtype = DTYPES.get(options.dtype)
    for index, stored_tensor in enumerate(tensors, start=1):
        tensor = read_tensor(path, stored_tensor.key, stored[stored_tensor.key])
        targets = [hf.rsplit(".", 2)[-2] for hf in hf_names(stored_tensor.names[0])]
        log(f"{index}/{len(tensors)} {stored_tensor.key} {tuple(tensor.shape)} -> {', '.join(targets)}")
        _write_hf_tensors(stored_tensor, tensor, arch, out_arch, writer, dtype)
    files = writer.close()
    out_dtype = dtype or stored[EMBEDDING].properties.dtype
    (options.save / "config.json").write_text(json.dumps(hf_config(out_arch, out_dtype), indent=2) + "\n")
    copied = copy_tokenizer(options.tokenizer or run_tokenizer(megatron_args), options.save)
    log(f"exported {writer.num_elements:,} parameters ({_dtype_name(out_dtype)}) of {path} to {options.save}: "
        f"config.json, {', '.join(f.name for f in files)} ({_megabytes(writer.num_bytes)})"
        + (f", {', '.join(copied)}" if copied else "; no tokenizer files (--tokenizer DIR adds them)"))
    if options.vocab_size is None:
        log(f"vocab_size {arch.vocab_size} is Megatron's padded vocabulary: --vocab-size N keeps a tokenizer's N rows")
    return 0


def _write_hf_tensors(stored: StoredTensor, tensor: torch.Tensor, arch: Qwen3Config, out_arch: Qwen3Config,
                      writer: SafetensorsWriter, dtype: torch.dtype | None) -> None:
    """Each layer of one checkpoint tensor, shape-checked against ``arch``, as its Hugging Face tensors."""
    shapes = megatron_shapes(arch)
    pieces = tensor.flatten(0, 1).unbind(0) if stored.experts else tensor.unbind(0) if stored.stacked else (tensor,)
    for name, piece in zip(stored.names, pieces, strict=True):
        if tuple(piece.shape) != shapes[name]:
            raise ConversionError(f"{stored.key} is {tuple(piece.shape)} per layer in the checkpoint, its saved "
                                  f"arguments say {shapes[name]}: not a plain Qwen3 GPT checkpoint")
        for hf_name, hf_tensor in to_hf(name, piece, out_arch).items():
            writer.add(hf_name, hf_tensor, dtype or hf_tensor.dtype)


def _check_empty_hf_dir(save: Path) -> None:
    if save.exists() and ((save / "config.json").exists() or any(save.glob("*.safetensors*"))):
        raise ConversionError(f"--save {save} already holds a Hugging Face model: remove it or choose another directory")


def run_tokenizer(megatron_args: argparse.Namespace) -> Path | None:
    """The training run's tokenizer directory, when it was a Hugging Face one on this disk."""
    model = getattr(megatron_args, "tokenizer_model", None)
    if getattr(megatron_args, "tokenizer_type", None) == "HuggingFaceTokenizer" and model and Path(model).is_dir():
        return Path(model)
    return None


def copy_tokenizer(source: Path | None, destination: Path) -> list[str]:
    if source is None:
        return []
    if not source.is_dir():
        raise ConversionError(f"--tokenizer {source} is not a directory: pass a Hugging Face tokenizer directory")
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copyfile(source / name, destination / name)
    return copied


class SafetensorsWriter:
    """Hugging Face's weight files: one ``model.safetensors``, or numbered shards of at most
    ``max_shard_bytes`` each plus ``model.safetensors.index.json``. Tensors are written as
    they come, so no more than one shard is held in memory."""

    def __init__(self, directory: Path, max_shard_bytes: int) -> None:
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.num_elements = 0
        self.num_bytes = 0

    def add(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        # A fresh contiguous copy: safetensors refuses views that share storage (layers of a stack).
        copy = torch.empty(tensor.shape, dtype=dtype)
        copy.copy_(tensor)
        size = copy.numel() * copy.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending[name] = copy
        self.pending_bytes += size
        self.num_elements += copy.numel()
        self.num_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.directory / f".shard-{len(self.shards)}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write what is pending, give the files their final names; returns them."""
        if self.pending or not self.shards:
            self._flush()
        if len(self.shards) == 1:
            return [_publish(self.shards[0][0], self.directory / "model.safetensors")]
        count = len(self.shards)
        weight_map, files = {}, []
        for number, (path, names) in enumerate(self.shards, start=1):
            final = _publish(path, self.directory / f"model-{number:05d}-of-{count:05d}.safetensors")
            files.append(final)
            weight_map.update(dict.fromkeys(names, final.name))
        index = {"metadata": {"total_size": self.num_bytes}, "weight_map": weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return files


def _publish(written: Path, final: Path) -> Path:
    """Rename a finished file into place, readable as the umask allows (safetensors creates it 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(written, 0o666 & ~umask)
    os.replace(written, final)
    return final


# --------------------------------------------------------------------------- import


def read_hf_config(hf_dir: Path) -> Qwen3Config:
    """The architecture of a Hugging Face directory's ``config.json`` (refused unless Qwen3)."""
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{hf_dir} has no config.json: pass a Hugging Face model directory (save_pretrained's output)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ConversionError(f"{config_path} is not valid JSON ({error}): re-download or re-save the model") from error
    return arch_from_hf_config(config, str(config_path))


class HFWeights:
    """The tensors of a Hugging Face directory, read one at a time from its safetensors files."""

    def __init__(self, hf_dir: Path) -> None:
        index = hf_dir / "model.safetensors.index.json"
        single = hf_dir / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: hf_dir / file for name, file in weight_map.items()}
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as handle:
                self.files = dict.fromkeys(handle.keys(), single)
        else:
            raise ConversionError(f"{hf_dir} has no model.safetensors (nor model.safetensors.index.json): save the "
                                  "model with save_pretrained(..., safe_serialization=True)")
        self.handles: dict[Path, Any] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = safe_open(str(file), framework="pt")
        return self.handles[file].get_tensor(name)

    def require(self, names: list[str], hf_dir: Path) -> None:
        missing = [name for name in names if name not in self.files]
        if missing:
            raise ConversionError(f"{hf_dir} lacks {missing[0]} (and {len(missing) - 1} more tensors) that its "
                                  "config.json implies: the weights and the config do not match")


def megatron_args_for(arch: Qwen3Config, dtype: torch.dtype, tokenizer_dir: Path | None) -> argparse.Namespace:
    """Megatron's (and Canzona's) arguments of a one-process TP 1 run with this
    architecture, parsed and validated as ``pretrain_gpt.py`` does: the checkpoint records
    them, and the model is built from them."""
    from unittest import mock

    from canzona_patches.integration.arguments import add_canzona_args
    from megatron.training.arguments import parse_args, validate_args

    positions = str(arch.max_position_embeddings)
    flags = [*megatron_flags(arch), "--seq-length", positions, "--max-position-embeddings", positions,
             "--init-method-std", repr(arch.init_method_std), "--micro-batch-size", "1",
             "--transformer-impl", "local", "--ckpt-format", "torch_dist",
             # The checkpoint holds weights only: Megatron's load skips optimizer and RNG state.
             "--no-save-optim", "--no-save-rng"]
    flags += {torch.bfloat16: ["--bf16"], torch.float16: ["--fp16"]}.get(dtype, [])
    if tokenizer_dir is not None:
        flags += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer_dir)]
    with mock.patch.object(sys, "argv", ["pretrain_gpt.py", *flags]), mock.patch.dict(os.environ, {"RANK": "0", "WORLD_SIZE": "1"}):
        args = parse_args(extra_args_provider=add_canzona_args)
    one_process_args(args)
    with contextlib.redirect_stdout(io.StringIO()):
        validate_args(args)
    args.padded_vocab_size = arch.vocab_size
    return args


def one_process_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` (parsed, or a checkpoint's) for a model built whole in this process:
    TP 1, PP 1, one rank, and on a machine without CUDA the CPU choices of pretrain_gpt.py."""
    import pretrain_gpt
    from canzona_patches.emulation.cpu import enable_cpu_mode

    args.rank, args.world_size, args.data_parallel_size = 0, 1, 1
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.expert_model_parallel_size = args.expert_tensor_parallel_size = 1  # a mixture's experts whole here too
    args.virtual_pipeline_model_parallel_size = None
    args.sequence_parallel = False
    if enable_cpu_mode():
        with contextlib.redirect_stdout(io.StringIO()):
            pretrain_gpt.adapt_args_to_cpu(args)
    args.transformer_impl = "local"
    return args


def build_megatron_model(args: argparse.Namespace, *, initialize: bool = False) -> torch.nn.Module:
    """The GPTModel ``pretrain_gpt.py`` builds for ``args`` (see :func:`one_process_args`), on
    CPU in this one process; weights uninitialized unless ``initialize``."""
    import torch.distributed as dist

    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.global_vars import set_args

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(args.seed)
    set_args(args)  # model_provider reads Megatron's global args
    config = core_transformer_config_from_args(args)
    config.use_cpu_initialization = True
    config.perform_initialization = initialize
    with contextlib.redirect_stdout(io.StringIO()):
        return pretrain_gpt.model_provider(config=config)


def end_process_group() -> None:
    """Tear down the one-rank group of :func:`build_megatron_model`: gloo's threads stop
    before the interpreter exits."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def sharded_metadata() -> dict[str, Any]:
    """The ``metadata`` Megatron's training save passes to ``sharded_state_dict`` for the model."""
    from megatron.core import parallel_state

    return {**CONTENT_METADATA, "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


def copy_hf_weights(model: torch.nn.Module, weights: HFWeights, arch: Qwen3Config) -> int:
    """Copy every parameter of ``model`` from the Hugging Face tensors; returns the element count."""
    count, layer = 0, -1
    for name, param in model.named_parameters():
        megatron_name = checkpoint_name(name)
        sources = hf_names(megatron_name)
        if name.startswith(f"{LAYER_PREFIX}{layer + 1}."):
            layer += 1
            log(f"layer {layer + 1}/{arch.num_layers}")
        elif not name.startswith(LAYER_PREFIX):
            log(f"{name} <- {', '.join(sources)}")
        tensor = from_hf(megatron_name, {source: weights[source] for source in sources}, arch)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ConversionError(f"{', '.join(sources)} make a {tuple(tensor.shape)} tensor, Megatron's {name} is "
                                  f"{tuple(param.shape)}: the weights and config.json do not match")
        with torch.no_grad():
            param.copy_(tensor)
        count += param.numel()
    return count


def save_release(model: torch.nn.Module, args: argparse.Namespace, save: Path) -> Path:
    """``save/release``, written by Megatron's ``dist_checkpointing.save`` as a model-only
    training save would be, then published by rename and the tracker."""
    from canzona_patches.checkpoints.files import enable_cpu_checkpointing
    from megatron.core import dist_checkpointing

    enable_cpu_checkpointing()
    staging, final = save / f".staging-{RELEASE}", save / RELEASE
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    state = {"model": model.sharded_state_dict(metadata=sharded_metadata()), "args": args,
             "checkpoint_version": 3.0, "iteration": 0, "num_floating_point_operations_so_far": 0}
    dist_checkpointing.save(state, str(staging), content_metadata=dict(CONTENT_METADATA))
    os.replace(staging, final)
    tracker = save / f".staging-{TRACKER}"
    tracker.write_text(RELEASE)
    os.replace(tracker, save / TRACKER)
    return final


def import_(options: argparse.Namespace) -> int:
    """``import``: Hugging Face directory -> torch_dist release checkpoint."""
    hf_dir, save = options.hf, options.save
    if not hf_dir.is_dir():
        raise ConversionError(f"--hf {hf_dir} does not exist: pass a Hugging Face model directory")
    arch = read_hf_config(hf_dir)
    if (save / TRACKER).exists() or (save / RELEASE).exists():
        raise ConversionError(f"--save {save} already holds a checkpoint: remove it or choose another directory")
    weights = HFWeights(hf_dir)
    weights.require([name for megatron_name in megatron_shapes(arch) for name in hf_names(megatron_name)], hf_dir)
    dtype = DTYPES[options.dtype] if options.dtype != "auto" else weights["model.embed_tokens.weight"].dtype
    if dtype not in DTYPES.values():
        raise ConversionError(f"{hf_dir} stores {dtype} weights: pass --dtype float32, bfloat16 or float16")
    tokenizer_dir = hf_dir if any((hf_dir / name).is_file() for name in TOKENIZER_FILES[:2]) else None
    log(f"reading {hf_dir}: Qwen3, {arch.num_layers} layers, hidden {arch.hidden_size}, "
        f"{'tied' if arch.tied_embeddings else 'untied'} embeddings; building Megatron's GPT model (TP 1, CPU)")
    args = megatron_args_for(arch, dtype, tokenizer_dir)
    model = build_megatron_model(args)
    count = copy_hf_weights(model, weights, arch)
    path = save_release(model, args, save)
    end_process_group()
    log(f"imported {count:,} parameters ({_dtype_name(dtype)}) of {hf_dir} to {path} "
        f"(torch_dist release checkpoint: any TP and PP load it)")
    _print_training_flags(arch, save, tokenizer_dir)
    return 0


def _print_training_flags(arch: Qwen3Config, save: Path, tokenizer_dir: Path | None) -> None:
    log(f"continue pretraining with pretrain_gpt.py --load {save} (iteration 0, fresh optimizer) and these "
        "architecture flags:")
    print(" ".join(megatron_flags(arch)), flush=True)
    tokenizer = (f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tokenizer_dir}" if tokenizer_dir
                 else "the tokenizer the model was trained with")
    log(f"plus --seq-length N --max-position-embeddings N (N <= {arch.max_position_embeddings}) and {tokenizer}; "
        f"--make-vocab-size-divisible-by {vocab_divisor(arch.vocab_size)} pads a tokenizer of more than "
        f"{arch.vocab_size} - {vocab_divisor(arch.vocab_size)} x TP entries to the {arch.vocab_size} rows saved")


# --------------------------------------------------------------------------- command line


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * factor)
    if upper.isdigit():
        return int(upper)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB or 500MB")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    out = commands.add_parser("export", help="torch_dist checkpoint -> Hugging Face Qwen3 directory")
    out.add_argument("--load", type=Path, required=True, help="pretrain_gpt.py's --save directory (or one iter_N in it)")
    out.add_argument("--iteration", type=at_least(0), default=None, help="iteration to export (default: the tracked one)")
    out.add_argument("--save", type=Path, required=True, help="Hugging Face directory to write")
    out.add_argument("--vocab-size", type=at_least(1), default=None,
                     help="keep the first N embedding rows (default: Megatron's padded vocabulary)")
    out.add_argument("--tokenizer", type=Path, default=None,
                     help="Hugging Face tokenizer directory to copy (default: the run's, if it was one)")
    out.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="weight dtype (default: as saved)")
    out.add_argument("--max-shard-size", type=_size, default=5 * 10**9,
                     help="largest safetensors file before sharding (default 5GB)")
    into = commands.add_parser("import", help="Hugging Face Qwen3 directory -> torch_dist release checkpoint")
    into.add_argument("--hf", type=Path, required=True, help="Hugging Face model directory (config.json, safetensors)")
    into.add_argument("--save", type=Path, required=True, help="checkpoint directory for pretrain_gpt.py --load")
    into.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                      help="parameter dtype (default: the Hugging Face weights')")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    start = time.perf_counter()
    try:
        status = export(options) if options.command == "export" else import_(options)
    except ConversionError as error:
        print(f"convert_hf.py: error: {error}", file=sys.stderr, flush=True)
        return 2
    log(f"done in {time.perf_counter() - start:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
