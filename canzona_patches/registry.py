"""Every patch of Megatron-Core (and torch) internals, in one table: what, when and why.

A :class:`Patch` replaces attributes named ``"module:Attr.path"`` with ``make(original,
run)``: a wrapper of the original, or a stand-in. :data:`PATCHES` is the table.
:func:`install` installs the rows whose condition holds for a run's parsed flags
(``pretrain_gpt.py``); the CPU entry points (:func:`canzona_patches.emulation.cpu.enable_cpu_mode`,
:func:`~canzona_patches.emulation.cpu.enable_cpu_training_mode`,
:func:`canzona_patches.checkpoints.files.enable_cpu_checkpointing`) install their group with
:func:`install_group`. Either way each attribute is replaced once per process: installing
again finds the replacement in place and leaves it. A *scoped* row (no ``make``) is swapped
in for one call only, by :func:`swapped`.

Factories are named ``"module:function"`` and imported when their row is installed, so
this module imports no patch module, and a patch module may import it (to install its group
or swap a scoped row) without an import cycle.

``python -m canzona_patches.registry`` prints the table; ``--markdown`` prints docs/patches.md's.

How to add a patch: write ``make(original, run) -> replacement`` next to the code it serves;
add a row below (targets, factory, condition in words and as a predicate on the parsed
flags, the upstream behaviour it changes in one line); paste ``--markdown`` into docs/patches.md.
``tests/unit/test_patch_registry.py`` fails on any Megatron or torch attribute assigned
elsewhere in ``canzona_patches``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# Groups: the rows one entry point installs together.
CPU = "cpu"  # cpu.enable_cpu_mode: Megatron-Core on CPU (or on meta, for dry runs)
CPU_TRAINING = "cpu-training"  # cpu.enable_cpu_training_mode: megatron.training on CPU
CPU_CHECKPOINT = "cpu-checkpoint"  # checkpoint_files.enable_cpu_checkpointing
CPU_SYNC_SAVE = "cpu-sync-save"  # the same, for synchronous saves
ARGUMENTS = "arguments"  # pretrain_gpt.py, before it parses the command line
CHECKSUMS = "checksums"  # a checksum per checkpoint file (pretrain_gpt.py unless --canzona-no-checksums; save_distributed)
PRETRAIN = "pretrain"  # pretrain_gpt.py's loop and checkpoints
CANZONA = "canzona"  # --canzona: its layout, optimizer and checkpoint metadata
UNEVEN = "uneven"  # layout.full_param_layouts, for a plan with variable-size DP shards (the whole layout)
EARLY_GATHER = "early-gather"  # early_gather.attach, when an async Canzona optimizer has gathers to issue
BASELINE = "baseline"  # upstream fixes only Megatron's own optimizers need
SCOPED = "scoped"  # swapped in for one call (:func:`swapped`), never installed


class Run:
    """What the patches installed together share: the run's parsed flags, and objects made
    once for several hooks (the interval metrics, the plan handed from DDP to the optimizer)."""

    def __init__(self, args: Any = None) -> None:
        self.args = args
        self._shared: dict[str, Any] = {}

    def shared(self, key: str, make: Callable[[], Any]) -> Any:
        """The object ``key``, made by ``make()`` on first use."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One row of the table."""

    targets: tuple[str, ...]
    """Every attribute replaced, as ``"module:Attr.path"``."""
    make: str | None
    """``"module:function"``; ``function(original, run)`` returns the replacement. ``None``
    for a scoped row, whose replacement the caller of :func:`swapped` makes."""
    condition: str
    """When it is installed, in words."""
    when: Callable[[Any], bool]
    """The same condition on a run's parsed flags (``pretrain_gpt.py``'s ``args``)."""
    reason: str
    """The upstream behaviour it changes, in one line."""
    group: str
    """The entry point that installs it (see the group constants above)."""
    label: str = ""
    """How the table names several targets at once (default: the targets themselves)."""


# --------------------------------------------------------------------------- conditions


def _always(args: Any) -> bool:
    return True


def _never(args: Any) -> bool:
    return False


def _no_cuda(args: Any) -> bool:
    return not torch.cuda.is_available()


def _checksums(args: Any) -> bool:
    return getattr(args, "canzona_checksums", True)


def _synchronous_saves_on_cpu(args: Any) -> bool:
    return _no_cuda(args) and not getattr(args, "async_save", False)


def _canzona(args: Any) -> bool:
    return bool(args.canzona)


def _layer_wise_muon(args: Any) -> bool:
    """Megatron's own layer-wise Muon (``validate_args`` turns ``--use-distributed-optimizer``
    into it for every optimizer but adam and sgd)."""
    return not args.canzona and bool(args.use_layer_wise_distributed_optimizer)


def _megatron_distributed_optimizer(args: Any) -> bool:
    """Megatron's own ``DistributedOptimizer`` runs: Adam with ``--use-distributed-optimizer``,
    or the Adam part of its layer-wise Muon. (Canzona's subclass overrides all three methods.)"""
    return not args.canzona and bool(args.use_distributed_optimizer or args.use_layer_wise_distributed_optimizer)


def _megatron_distributed_optimizer_on_torch(args: Any) -> bool:
    distrib_optimizer = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    return _megatron_distributed_optimizer(args) and not distrib_optimizer.HAVE_APEX_OR_TE


def _megatron_distributed_optimizer_legacy_format(args: Any) -> bool:
    return _megatron_distributed_optimizer(args) and args.ckpt_format == "torch"


# --------------------------------------------------------------------------- the table

CPU_TORCH_MODULES = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.timers",
    "megatron.core.rerun_state_machine",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.module",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.layer_wise_optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.utils",
)
"""Megatron-Core modules whose ``torch`` global is CPU mode's stand-in (a Megatron module not
listed still raises "Found no NVIDIA driver" at its first CUDA call: add it here)."""

CPU_TORCH_TRAINING_MODULES = (
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.training.utils.common_utils",
    "megatron.training.checkpointing",
)
"""``megatron.training`` modules whose ``torch`` global is the one-device CPU stand-in."""

CHECKPOINT_WRITER_MODULES = (
    "megatron.core.dist_checkpointing.strategies.filesystem_async",  # preload_tensors: synchronize
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
)
"""The ``torch_dist`` writer's modules, redirected like :data:`CPU_TORCH_MODULES`."""

PRETEND_CUDA_WINDOWS = (
    # param.type() in ['torch.cuda.HalfTensor', ...] / == 'torch.cuda.FloatTensor' routing:
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
    "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
    "megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32",  # bound by import
    # tensor.cuda() on CPU data:
    "megatron.core.tensor_parallel.data:broadcast_data",
    "megatron.core.tensor_parallel:broadcast_data",  # re-exported binding
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.get_parameter_state_dp_zero",
    "megatron.core.models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer",
    "megatron.core.utils:check_param_hashes_across_dp_replicas",
    # .cuda(current_device()) of the loaded loss scale (--fp16 resumes):
    "megatron.core.optimizer.grad_scaler:DynamicGradScaler.load_state_dict",
)
"""Functions inside which a CPU tensor answers as a CUDA one; each binding needs its own entry."""

_ON_CPU = "no CUDA (or a meta dry run): `cpu.enable_cpu_mode`"
_ON_CPU_TRAINING = "no CUDA, `pretrain_gpt.py`: `cpu.enable_cpu_training_mode`"
_EVERY_RUN = "every `pretrain_gpt.py` run"
_DISTRIBUTED_OPTIMIZER = "Megatron's DistributedOptimizer: `--use-distributed-optimizer` without `--canzona`"
_DURING_SAVE = "during each staged `save_checkpoint` call"
_WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_TRAINING = "megatron.training.training"
_CHECKPOINTING = "megatron.training.checkpointing"
_RANDOM = "megatron.core.tensor_parallel.random"
_DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
_BUFFER = "megatron.core.distributed.param_and_grad_buffer"
_UNEVEN_SHARDS = "`--canzona` (a plan with variable-size DP shards: `layout.full_param_layouts`)"

PATCHES: tuple[Patch, ...] = (
    # --- Megatron-Core on CPU
    Patch(targets=tuple(f"{module}:torch" for module in CPU_TORCH_MODULES), make="canzona_patches.emulation.cpu:cpu_torch",
          label=f"`torch` of {len(CPU_TORCH_MODULES)} Megatron-Core modules (`registry.CPU_TORCH_MODULES`)",
          condition=_ON_CPU, when=_no_cuda, group=CPU,
          reason="they allocate on, fence and seed CUDA in ~200 places; their torch sends CUDA devices to the CPU "
                 "(or meta) and makes streams and events no-ops"),
    Patch(targets=(f"{_RANDOM}:CudaRNGStatesTracker",), make="canzona_patches.emulation.cpu:cpu_rng_tracker",
          condition=_ON_CPU, when=_no_cuda, group=CPU,
          reason="the tensor-parallel RNG tracker forks CUDA generator states; on CPU it forks the CPU generator's"),
    Patch(targets=(f"{_RANDOM}:_get_cuda_rng_state",), make="canzona_patches.emulation.cpu:cpu_get_rng_state",
          condition=_ON_CPU, when=_no_cuda, group=CPU, reason="reads the CUDA generator; on CPU the CPU generator"),
    Patch(targets=(f"{_RANDOM}:_set_cuda_rng_state",), make="canzona_patches.emulation.cpu:cpu_set_rng_state",
          condition=_ON_CPU, when=_no_cuda, group=CPU, reason="writes the CUDA generator; on CPU the CPU generator"),
    Patch(targets=("torch:Tensor.type",), make="canzona_patches.emulation.cpu:tensor_type_pretending",
          condition=_ON_CPU, when=_no_cuda, group=CPU,
          reason="inside a pretend-CUDA window a CPU tensor names itself `torch.cuda.*Tensor` "
                 "(Megatron's optimizers route parameters by that name); unchanged outside"),
    Patch(targets=("torch:Tensor.cuda",), make="canzona_patches.emulation.cpu:tensor_cuda_pretending",
          condition=_ON_CPU, when=_no_cuda, group=CPU,
          reason="inside a pretend-CUDA window `.cuda()` of CPU data returns the tensor; unchanged outside"),
    Patch(targets=PRETEND_CUDA_WINDOWS, make="canzona_patches.emulation.cpu:pretending_cuda",
          label=f"{len(PRETEND_CUDA_WINDOWS)} functions (`registry.PRETEND_CUDA_WINDOWS`)",
          condition=_ON_CPU, when=_no_cuda, group=CPU,
          reason="the pretend-CUDA windows: these route parameters by `type()` or move CPU data with `.cuda()`"),
    Patch(targets=("megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",),
          make="canzona_patches.emulation.cpu:split_sizes_on_cpu", condition=_ON_CPU, when=_no_cuda, group=CPU,
          reason="the all-to-all token dispatcher turns its split sizes into host lists only when they are on CUDA; "
                 "on CPU they stay tensors, which the all-to-all rejects"),
    Patch(targets=("megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__",),
          make="canzona_patches.emulation.cpu:torch_norm_with_sequence_parallel", condition=_ON_CPU, when=_no_cuda, group=CPU,
          reason="the local spec's torch norms refuse sequence parallelism, which MoE with TP requires; "
                 "they accept it and mark their weights for the TP all-reduce, as transformer-engine's norms do"),
    # --- megatron.training on CPU
    Patch(targets=tuple(f"{module}:torch" for module in CPU_TORCH_TRAINING_MODULES),
          make="canzona_patches.emulation.cpu:cpu_torch_one_device",
          label=f"`torch` of {len(CPU_TORCH_TRAINING_MODULES)} megatron.training modules "
                "(`registry.CPU_TORCH_TRAINING_MODULES`)",
          condition=_ON_CPU_TRAINING, when=_no_cuda, group=CPU_TRAINING,
          reason="as above, with one CPU device per process: initialization sets up model parallelism and "
                 "seeds only when `device_count() > 0`"),
    Patch(targets=(f"{_TRAINING}:get_model",), make="canzona_patches.emulation.cpu:pretending_cuda",
          condition=_ON_CPU_TRAINING, when=_no_cuda, group=CPU_TRAINING,
          reason="a pretend-CUDA window: `get_model` moves every chunk with `.cuda()`"),
    Patch(targets=("megatron.training.arguments:get_device_arch_version",), make="canzona_patches.emulation.cpu:no_cuda_arch",
          condition=_ON_CPU_TRAINING, when=_no_cuda, group=CPU_TRAINING,
          reason="`validate_args` asks CUDA for device 0's compute capability at TP or CP > 1; answers 0"),
    Patch(targets=(f"{_TRAINING}:initialize_megatron",), make="canzona_patches.emulation.cpu:allowing_no_cuda",
          condition=_ON_CPU_TRAINING, when=_no_cuda, group=CPU_TRAINING,
          reason="`initialize_megatron` asserts CUDA unless called with `allow_no_cuda=True`"),
    Patch(targets=(f"{_TRAINING}:set_jit_fusion_options",),
          make="canzona_patches.emulation.cpu:warming_fused_kernels_only_in_use",
          condition=_ON_CPU_TRAINING, when=_no_cuda, group=CPU_TRAINING,
          reason="compiles the fused bias-GeLU/SwiGLU and bias-dropout-add kernels by running them (about 2.5 s a "
                 "rank on CPU), although `pretrain_gpt.py` turns them off on CPU; skipped while all three are off"),
    # --- torch_dist checkpoints on CPU
    Patch(targets=tuple(f"{module}:torch" for module in CHECKPOINT_WRITER_MODULES),
          make="canzona_patches.emulation.cpu:cpu_torch",
          label=f"`torch` of {len(CHECKPOINT_WRITER_MODULES)} torch_dist writer modules "
                "(`registry.CHECKPOINT_WRITER_MODULES`)",
          condition="no CUDA, `torch_dist` saves: `checkpoint_files.enable_cpu_checkpointing`",
          when=_no_cuda, group=CPU_CHECKPOINT,
          reason="the writer synchronizes CUDA before it writes (`preload_tensors`)"),
    Patch(targets=("megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue",),
          make="canzona_patches.checkpoints.files:in_process_results_queue",
          condition="the same, without `--async-save`", when=_synchronous_saves_on_cpu, group=CPU_SYNC_SAVE,
          reason="a synchronous save writes in this process: an in-process queue instead of a spawned Manager "
                 "(forbidden in daemonic ranks, ~4 s in a torchrun rank)"),
    # --- pretrain_gpt.py
    Patch(targets=("megatron.training.argument_utils:ArgumentGroupFactory._build_argparse_kwargs_from_field",),
          make="canzona_patches.integration.arguments:escaping_percent_in_help",
          condition="every `pretrain_gpt.py` run, before it parses the flags", when=_always, group=ARGUMENTS,
          reason="flags built from config dataclasses take their help from docstrings, which argparse formats "
                 "with `%`: `--moe-paged-stash-buffer-size-factor-cuda`'s \"10%\" makes `--help` raise"),
    Patch(targets=("megatron.core.datasets.utils:compile_helpers",),
          make="canzona_patches.integration.training:shipped_dataset_helpers",
          condition=_EVERY_RUN, when=_always, group=PRETRAIN,
          reason="the registry wheel ships the dataset helpers prebuilt but no Makefile: `make` fails and "
                 "initialization exits"),
    Patch(targets=("megatron.training.arguments:parse_args",), make="canzona_patches.integration.training:with_canzona_flags",
          condition=_EVERY_RUN, when=_always, group=PRETRAIN,
          reason="`pretrain` parses the command line again without an `extra_args_provider` and would reject "
                 "`--canzona` and `--optimizer shampoo`"),
    Patch(targets=(f"{_TRAINING}:setup_model_and_optimizer",), make="canzona_patches.integration.training:timing_optimizer_step",
          condition=_EVERY_RUN, when=_always, group=PRETRAIN,
          reason="times the optimizer's step for the `[canzona]` interval line"),
    Patch(targets=(f"{_TRAINING}:training_log",), make="canzona_patches.integration.training:logging_interval_metrics",
          condition=_EVERY_RUN, when=_always, group=PRETRAIN,
          reason="one more line per log interval (optimizer step time, tokens/s, progress) and "
                 "`--canzona-metrics-file`; a first iteration on the log interval resets the sums, so the next "
                 "line does not average two intervals (resumed runs, `--log-interval 1`)"),
    Patch(targets=(f"{_TRAINING}:train_step",), make="canzona_patches.integration.megatron_fixes:numbering_the_step",
          condition=_EVERY_RUN, when=_always, group=PRETRAIN,
          reason="NaN and rerun reports name the iteration after the failing one; the rerun state machine is "
                 "set to the step about to run"),
    Patch(targets=(f"{_TRAINING}:save_checkpoint",), make="canzona_patches.checkpoints.files:staged_save_checkpoint",
          condition=_EVERY_RUN, when=_always, group=PRETRAIN,
          reason="upstream writes `iter_N` in place and truncates the tracker before writing it: a killed save "
                 "tears the tracked checkpoint; saves are staged and committed by rename"),
    Patch(targets=(f"{_WRITER}:_write_item",), make="canzona_patches.checkpoints.checksums:hashing_write_item",
          condition="unless `--canzona-no-checksums`", when=_checksums, group=CHECKSUMS,
          reason="records no checksum: each data file's bytes also feed a SHA-256 as they are written, recorded "
                 "in `checksums/<file>.sha256` after its last item"),
    Patch(targets=(f"{_WRITER}:FileSystemWriterAsync.write_preloaded_data",),
          make="canzona_patches.checkpoints.checksums:hashing_preloaded_writes",
          condition="unless `--canzona-no-checksums`", when=_checksums, group=CHECKSUMS,
          reason="marks the file it writes (and its number of items) for the hashing `_write_item`"),
    Patch(targets=(f"{_TRAINING}:load_checkpoint",), make="canzona_patches.checkpoints.state:checked_load_checkpoint",
          condition=_EVERY_RUN, when=_always, group=PRETRAIN,
          reason="rank 0 checks the files and the optimizer state's kind and every rank gets its verdict; "
                 "any failure is one line naming the file"),
    # --- --canzona
    Patch(targets=(f"{_CHECKPOINTING}:_build_sharded_state_dict_metadata",),
          make="canzona_patches.checkpoints.state:with_canzona_metadata",
          condition="`--canzona`", when=_canzona, group=CANZONA,
          reason="the content metadata says `fully_reshardable` (else `load_checkpoint` refuses a TP or PP "
                 "change) and `canzona_state_format`"),
    Patch(targets=(f"{_TRAINING}:wrap_model_chunks_with_ddp",), make="canzona_patches.integration.training:with_canzona_layouts",
          condition="`--canzona`", when=_canzona, group=CANZONA,
          reason="makes the run's plan and builds DDP with its `FullParamLayout` per chunk"),
    Patch(targets=(f"{_TRAINING}:get_megatron_optimizer",), make="canzona_patches.integration.training:canzona_optimizer",
          condition="`--canzona`", when=_canzona, group=CANZONA,
          reason="builds the Canzona optimizer on the plan the model was wrapped with"),
    # --- the whole layout's variable-size DP shards (canzona_patches/integration/uneven.py)
    Patch(targets=(f"{_BUFFER}:_ParamAndGradBuffer.__init__",), make="canzona_patches.integration.uneven:tagging_buckets",
          condition=_UNEVEN_SHARDS, when=_canzona, group=UNEVEN,
          reason="buckets are cut into equal DP shards; a layout carrying planned shard bounds tags each bucket's "
                 "views with its shard sizes"),
    Patch(targets=(f"{_BUFFER}:shard_buffer",), make="canzona_patches.integration.uneven:uneven_shard_buffer",
          condition=_UNEVEN_SHARDS, when=_canzona, group=UNEVEN,
          reason="a rank's view of a bucket is its 1/DP slice; a tagged bucket's is its planned shard"),
    Patch(targets=(f"{_BUFFER}:dist_reduce_scatter_func",), make="canzona_patches.integration.uneven:uneven_reduce_scatter",
          condition=_UNEVEN_SHARDS, when=_canzona, group=UNEVEN,
          reason="`reduce_scatter_tensor` needs equal shards; a tagged bucket runs torch's list-form "
                 "`reduce_scatter` (grouped `ncclReduce` on NCCL)"),
    Patch(targets=(f"{_BUFFER}:dist_all_gather_func",), make="canzona_patches.integration.uneven:uneven_all_gather",
          condition=_UNEVEN_SHARDS, when=_canzona, group=UNEVEN,
          reason="`all_gather_into_tensor` needs equal shards; a tagged bucket runs the list-form `all_gather` "
                 "(grouped `ncclBroadcast`), on gloo one broadcast per shard"),
    Patch(targets=(f"{_BUFFER}:_coalescing_manager",), make="canzona_patches.integration.uneven:joining_uneven_works",
          condition=_UNEVEN_SHARDS, when=_canzona, group=UNEVEN,
          reason="torch's manager waits only for the `*_tensor` collectives it batched; the list-form ones' works "
                 "join its handle, so the bucket's finish waits for them"),
    # --- host-group gathers issued as buckets reduce (canzona_patches/integration/early_gather.py)
    Patch(targets=(f"{_BUFFER}:_ParamAndGradBucketGroup.start_grad_sync",),
          make="canzona_patches.integration.early_gather:announcing_dispatched_grads",
          condition="`--canzona` with `--canzona-tp-mode async` (the default) and matrices that move to their hosts",
          when=_canzona, group=EARLY_GATHER,
          reason="nothing follows a bucket group's asynchronous dispatch; its listeners are told, so on CUDA the "
                 "optimizer's side stream waits for the reduce-scatter and issues the host-group gathers in backward"),
    Patch(targets=(f"{_BUFFER}:_ParamAndGradBucketGroup.finish_grad_sync",),
          make="canzona_patches.integration.early_gather:announcing_reduced_grads",
          condition="`--canzona` with `--canzona-tp-mode async` (the default) and matrices that move to their hosts",
          when=_canzona, group=EARLY_GATHER,
          reason="nothing follows a bucket group's reduction; its listeners are told, so the optimizer issues "
                 "the host-group gathers of the matrices it completes before the step"),
    # --- upstream fixes only the baselines need
    Patch(targets=("megatron.core.optimizer.layer_wise_optimizer:LayerWiseDistributedOptimizer.__init__",),
          make="canzona_patches.integration.megatron_fixes:keeping_config",
          condition="Megatron's layer-wise Muon: `--optimizer muon --use-distributed-optimizer` without `--canzona`",
          when=_layer_wise_muon, group=BASELINE,
          reason="in fp32 its children carry no config, so `ChainedOptimizer` asserts and `prepare_grads` is "
                 "missing; keeps the config and wraps each child in `FP32Optimizer`"),
    Patch(targets=(f"{_DISTRIB_OPTIMIZER}.sharded_state_dict",),
          make="canzona_patches.integration.megatron_fixes:allocating_state_first",
          condition=_DISTRIBUTED_OPTIMIZER + ", on torch's optimizers (no Apex or Transformer Engine)",
          when=_megatron_distributed_optimizer_on_torch, group=BASELINE,
          reason="torch's AdamW has no state before its first step and `state_dict` asserts one: `--load` fails"),
    Patch(targets=(f"{_DISTRIB_OPTIMIZER}.load_state_dict",), make="canzona_patches.integration.megatron_fixes:loading_exactly",
          condition=_DISTRIBUTED_OPTIMIZER, when=_megatron_distributed_optimizer, group=BASELINE,
          reason="restores one `step` tensor per parameter (upstream shares one, or copies the pre-load step "
                 "back) and copies into leaf views under `no_grad`"),
    Patch(targets=(f"{_DISTRIB_OPTIMIZER}.load_parameter_state",),
          make="canzona_patches.integration.megatron_fixes:restoring_moments",
          condition=_DISTRIBUTED_OPTIMIZER + ", `--ckpt-format torch`",
          when=_megatron_distributed_optimizer_legacy_format, group=BASELINE,
          reason="the legacy load copies a `step` the file lacks (`KeyError`) and copies into leaf views"),
    # --- scoped: swapped in for one staged save
    Patch(targets=(f"{_CHECKPOINTING}:get_checkpoint_name",), make=None,
          condition=_DURING_SAVE, when=_never, group=SCOPED,
          reason="the iteration's paths point into its staging directory"),
    Patch(targets=(f"{_CHECKPOINTING}:get_checkpoint_tracker_filename",), make=None,
          condition=_DURING_SAVE, when=_never, group=SCOPED,
          reason="Megatron's own tracker write goes to a scratch file; the commit replaces the real one"),
    Patch(targets=(f"{_CHECKPOINTING}:schedule_async_save",), make=None,
          condition=_DURING_SAVE + " with `--async-save`", when=_never, group=SCOPED,
          reason="the commit becomes the asynchronous request's last finalize step"),
)
"""Every patch of Megatron-Core and torch internals (``tests/unit/test_patch_registry.py``)."""

_SCOPED_TARGETS = frozenset(t for patch in PATCHES if patch.group == SCOPED for t in patch.targets)

# --------------------------------------------------------------------------- installing

_installed: dict[str, Any] = {}
"""Target -> the value this process put there; the one record of what is installed."""


def install(args: Any, *, groups: Collection[str] | None = None) -> list[Patch]:
    """Install every row (of ``groups``, default all) whose condition holds for ``args``, in
    table order; each attribute once per process. Returns the rows now in place."""
    run = Run(args)
    chosen = [p for p in PATCHES if p.make is not None and (groups is None or p.group in groups) and p.when(args)]
    for patch in chosen:
        _install(patch, run)
    return chosen


def install_group(group: str) -> None:
    """Install every row of ``group`` whatever its condition (its entry point has checked it)."""
    run = Run()
    for patch in PATCHES:
        if patch.group == group:
            _install(patch, run)


def installed(patch_or_group: Patch | str) -> bool:
    """Whether the row (every row of the group) is in place in this process."""
    rows = [patch_or_group] if isinstance(patch_or_group, Patch) else [p for p in PATCHES if p.group == patch_or_group]
    return bool(rows) and all(_in_place(target) for patch in rows for target in patch.targets)


def _install(patch: Patch, run: Run) -> None:
    assert patch.make is not None, f"{patch.targets[0]} is scoped: use swapped()"
    make = _resolve_factory(patch.make)
    for target in patch.targets:
        if _in_place(target):
            continue
        owner, name = _owner(target)
        replacement = make(getattr(owner, name), run)
        # A static method stays one (the class's attribute reads back as the plain function).
        static = isinstance(owner, type) and isinstance(owner.__dict__.get(name), staticmethod)
        setattr(owner, name, staticmethod(replacement) if static else replacement)
        _installed[target] = replacement


def _in_place(target: str) -> bool:
    if target not in _installed:
        return False
    owner, name = _owner(target)
    return getattr(owner, name) is _installed[target]


@contextmanager
def swapped(target: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """Within the ``with`` block ``target`` (a scoped row of :data:`PATCHES`) is
    ``make(original)``; the original is put back however the block ends."""
    if target not in _SCOPED_TARGETS:
        raise KeyError(f"{target} is no scoped row of canzona_patches.registry.PATCHES: add one")
    owner, name = _owner(target)
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _owner(target: str) -> tuple[Any, str]:
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


def _resolve_factory(reference: str) -> Callable[[Any, Run], Any]:
    module_name, _, name = reference.partition(":")
    return getattr(importlib.import_module(module_name), name)


# --------------------------------------------------------------------------- the printed table


def _what(patch: Patch) -> str:
    return patch.label or ", ".join(f"`{target}`" for target in patch.targets)


def markdown_table() -> str:
    """The table as docs/patches.md shows it."""
    lines = ["| patched | installed when | why |", "|---|---|---|"]
    lines += [f"| {_what(p)} | {p.condition} | {p.reason} |" for p in PATCHES]
    return "\n".join(lines) + "\n"


def text_table(*, every_target: bool = False) -> str:
    """The table for a terminal: one block per row (with ``every_target``, each target named)."""
    blocks = []
    for patch in PATCHES:
        what = list(patch.targets) if every_target or not patch.label else [patch.label]
        lines = [*what, f"    installed when: {patch.condition}", f"    why: {patch.reason}"]
        blocks.append("\n".join(lines).replace("`", ""))
    return "\n\n".join(blocks) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print every patch of Megatron-Core internals: what, when, why.")
    parser.add_argument("--markdown", action="store_true", help="docs/patches.md's table")
    parser.add_argument("--targets", action="store_true", help="name every attribute of a row that replaces several")
    options = parser.parse_args(argv)
    sys.stdout.write(markdown_table() if options.markdown else text_table(every_target=options.targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
