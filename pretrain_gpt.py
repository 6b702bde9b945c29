#!/usr/bin/env python
"""Pretrain a Qwen3-style GPT with ``megatron.training``, optionally with Canzona's optimizer.

Megatron-LM's command line (``--num-layers``, ``--hidden-size``, ``--tensor-model-parallel-
size``, ``--use-distributed-optimizer``, ``--data-path``, ...) plus Canzona's flags
(``canzona_patches/integration/arguments.py``: ``--canzona``, ``--canzona-alpha``, ``--optimizer
shampoo``, ``--canzona-metrics-file``, ...). Launch one process per rank, e.g.::

    torchrun --nproc-per-node 4 pretrain_gpt.py --num-layers 2 --hidden-size 64 ...

On a machine without CUDA it runs on CPU: ``canzona_patches.emulation.cpu.enable_cpu_training_mode``
redirects Megatron's CUDA calls, and :func:`adapt_args_to_cpu` switches the flags that
name CUDA-only pieces (NCCL, transformer-engine, fused kernels) to their CPU equivalents.
With CUDA nothing is redirected and the flags are used as given.

See ``examples/qwen3/pretrain_qwen3_tiny_cpu.sh`` for a complete tiny run.
"""

from __future__ import annotations

import os
import signal

# torchrun's SIGTERM to the rank that reports start-up errors, taken before the imports below
# (seconds on a loaded machine): another rank failing the same flags may exit first, and the
# line would be lost with this rank. main() passes a SIGTERM taken here on, once its line is out.
_SIGTERM_DURING_IMPORTS: list[int] = []


def _sigterm_during_imports(number: int, frame: object) -> None:
    _SIGTERM_DURING_IMPORTS.append(number)


if "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("RANK", "0") == "0":
    signal.signal(signal.SIGTERM, _sigterm_during_imports)

import argparse  # noqa: E402  (after the hold above)
import contextlib  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable
from typing import Any

import torch

from canzona_patches.checkpoints.recovery import clear_failed_saves, describe_bytes, resume_advice
from canzona_patches.errors import CanzonaRankError
from canzona_patches.integration.arguments import (
    CanzonaArgumentError,
    add_canzona_args,
    finalize_canzona_args,
    reports_errors,
    validate_canzona_args,
)
from canzona_patches.emulation.cpu import enable_cpu_training_mode
from canzona_patches.integration.data_files import data_worker_died_words
from canzona_patches.integration.megatron_checks import one_line as megatron_check_failed
from canzona_patches.integration.megatron_checks import raised_in_set_up
from canzona_patches.integration.preemption import exit_handler_of, sigterm_handler, stop_on_sigterm
from canzona_patches.registry import ARGUMENTS as ARGUMENT_PATCHES
from canzona_patches.registry import install as install_patches
from canzona_patches.registry import install_group as install_patch_group
from canzona_patches.integration.training import LOSS_KEY, iterations_this_job, nothing_trained
from megatron.canzona.data import GPTDataConfig, build_gpt_datasets, check_gpt_data, describe_datasets
from megatron.canzona.runtime.lifetime import end_with_parent, launched_by_torchrun, signal_held
from megatron.canzona.runtime.peers import (
    claim_report,
    lost_peer_words,
    mark_ended_knowingly,
    report_lost_peer,
    report_silent_peer,
    timed_out_words,
    watch_for_lost_peers,
)
from megatron.canzona.runtime.save_lock import SaveDirectoryLocked, take_save_lock
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.utils import get_batch_on_this_cp_rank
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import (
    core_transformer_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import set_global_variables
from megatron.training.utils import get_blend_and_blend_per_split

# Fused kernels that Megatron's local layers take from a compiled extension, not from torch, as
# (args attribute, value without it, the module that provides it). On a GPU machine without
# transformer-engine or apex, Megatron's defaults stop the run at the first of them.
_EXTENSION_KERNELS = (
    ("apply_rope_fusion", False, "transformer_engine"),
    ("masked_softmax_fusion", False, "scaled_upper_triang_masked_softmax_cuda"),
    ("gradient_accumulation_fusion", False, "fused_weight_gradient_mlp_cuda"),
    ("no_persist_layer_norm", True, "apex"),  # without apex the local spec's norm is torch's, which refuses it
)

# Fused kernels that need CUDA, apex or transformer-engine, as (args attribute, CPU value): the
# extensions' kernels, and those torch compiles for CUDA.
_CPU_FLAG_VALUES = (
    *((name, value) for name, value, _ in _EXTENSION_KERNELS),
    ("bias_dropout_fusion", False),
    ("bias_gelu_fusion", False),
    ("bias_swiglu_fusion", False),
    ("moe_grouped_gemm", False),  # needs CUDA (validate_args reads the device capability)
)


_PEER_WATCH: list = []
"""``watch_for_lost_peers``' report and stop handlers, made by :func:`main` (empty: no watch)."""


def start_peer_watch() -> None:
    """The lost-peer watch takes SIGTERM, once per process, when the model is first built: after
    the process group exists. Before, a rank waits for its peers inside torch's rendezvous and
    Megatron's start-up collectives, in C++, where no Python handler runs; under SIGTERM's default
    it ends at once when torchrun stops the job (a peer's start-up error, e.g. --save locked by
    another job, which only rank 0 checks), where a handler that cannot run held it until
    torchrun's SIGKILL, 30 s later."""
    if _PEER_WATCH:
        watch_for_lost_peers(*_PEER_WATCH)
        _PEER_WATCH.clear()


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                   config: Any = None, pg_collection: Any = None) -> GPTModel:
    """The GPT of the flags: a Qwen3 block is RMSNorm, SwiGLU, QK-RMSNorm, GQA and RoPE.

    Transformer-engine layers when ``--transformer-impl transformer_engine`` (and TE
    imports), Megatron-Core's local layers otherwise (always on CPU).
    """
    args = get_args()
    start_peer_watch()
    print_rank_0("building GPT model ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def _layer_spec(args: argparse.Namespace) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs

    # With --num-experts every layer's MLP is a mixture of experts (Qwen3-MoE has no dense
    # layers): SequentialMLP on the local spec, grouped GEMM with --moe-grouped-gemm on TE.
    if args.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm, qk_layernorm=args.qk_layernorm)
    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm, qk_layernorm=args.qk_layernorm,
        normalization=args.normalization)


def train_valid_test_datasets_provider(num_samples: tuple[int, int, int], vp_stage: int | None = None) -> list[Any]:
    """``[train, valid, test]`` GPT datasets from Megatron's data flags (the same for every
    virtual pipeline stage ``vp_stage``): see :func:`data_config_from_args`.

    A data flag that would crash or hang Megatron's dataset builder (a missing file, a split
    without documents in any dataset of a blend) stops the run with one line naming the fix.
    """
    args = get_args()
    try:
        config = data_config_from_args(args)
        check_gpt_data(config)
    except ValueError as error:
        raise CanzonaArgumentError(str(error)) from None
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = build_gpt_datasets(config, get_tokenizer(), num_samples)
    for line in describe_datasets(datasets):
        print_rank_0(f">   {line}")
    return datasets


# What Megatron's validate_args gives --data-path without --split; --data-args-path gets the same.
_DEFAULT_SPLIT = "969, 30, 1"


def data_config_from_args(args: argparse.Namespace) -> GPTDataConfig:
    """The data flags as Megatron's pretrain_gpt reads them, onto a :class:`GPTDataConfig`.

    ``--data-path [W1] P1 [W2] P2 ...`` or ``--data-args-path FILE`` (the same list in a
    file): a blend every split is drawn from, each dataset cut by ``--split``;
    ``--train-data-path/--valid-data-path/--test-data-path`` or ``--per-split-data-args-path
    JSON``: one blend per split; ``--mock-data``: Megatron's synthetic tokens. Blends are
    parsed by Megatron's own ``get_blend_and_blend_per_split``.
    """
    _check_data_flags(args)
    try:
        blend, blend_per_split = get_blend_and_blend_per_split(args)
    except OSError as error:
        raise ValueError(f"cannot read the data args file: {error}") from None
    except KeyError as error:
        raise ValueError(f"--per-split-data-args-path needs the keys train, valid and test: "
                         f"{error} is missing") from None
    if blend_per_split is not None and args.split is not None:
        raise ValueError(f"--split {args.split} cuts the datasets of --data-path; with --train/valid/test-data-path "
                         "each split has its own datasets: drop --split")
    return GPTDataConfig(
        seq_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        mock=args.mock_data,
        split=args.split if args.split is not None else _DEFAULT_SPLIT,
        seed=args.seed,
        cache_dir=args.data_cache_path,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        num_builder_threads=args.num_dataset_builder_threads,
    )


def _check_data_flags(args: argparse.Namespace) -> None:
    """One data source, and no path flag given without a path (Megatron's parser would fail on it)."""
    path_flags = {"--data-path": args.data_path, "--train-data-path": args.train_data_path,
                  "--valid-data-path": args.valid_data_path, "--test-data-path": args.test_data_path}
    for flag, paths in path_flags.items():
        if paths is not None and not paths:
            raise ValueError(f"{flag} names no dataset: give a prefix, or weights and prefixes (e.g. 0.3 A 0.7 B)")
    sources = {
        "--data-path": args.data_path is not None,
        "--data-args-path": args.data_args_path is not None,
        "--train/valid/test-data-path": any(paths is not None for paths in
                                            (args.train_data_path, args.valid_data_path, args.test_data_path)),
        "--per-split-data-args-path": args.per_split_data_args_path is not None,
        "--mock-data": args.mock_data,
    }
    named = [flag for flag, given in sources.items() if given]
    if len(named) > 1:
        raise ValueError(f"{' and '.join(named)} each name the data: keep one")


# Every rank builds the datasets itself (no broadcast of batches over TP ranks needed):
# Megatron's build_train_valid_test_data_loaders honours this attribute.
train_valid_test_datasets_provider.is_distributed = True


def get_batch(data_iterator: Any) -> dict[str, torch.Tensor]:
    """The next micro-batch, on this rank's device.

    All TP ranks of one DP rank read the same samples (the sampler is keyed by DP rank),
    so each reads its own iterator instead of receiving a broadcast from TP rank 0. Under
    context parallelism each CP rank keeps its two chunks of every sequence, as Megatron cuts
    them (``get_batch_on_this_cp_rank``); the losses are reduced over DP x CP by Megatron.
    """
    batch = next(data_iterator)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    batch = {key: value if value is None or device is None else value.to(device, non_blocking=True)
             for key, value in batch.items()}
    if parallel_state.get_context_parallel_world_size() > 1:  # this CP rank's chunks r and 2 CP - 1 - r
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group())
    return batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked token-loss sum, token count, and the ``lm loss`` report as [sum, count].

    Returning the count lets Megatron's schedule divide by it and ``train_step`` average
    the report over all tokens of the global batch.
    """
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.view(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach().clone(), num_tokens.float()])
    return loss, num_tokens, {LOSS_KEY: report}


def forward_step(data_iterator: Any, model: GPTModel):
    """Megatron's ``forward_step_func``: per-token losses and the function that reduces them."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                          labels=batch["labels"])
    return output_tensor, functools.partial(loss_func, batch["loss_mask"])


def adapt_args_to_cpu(args: argparse.Namespace) -> list[str]:
    """Switch CUDA-only choices to CPU ones; return ``flag=value`` notes of what changed."""
    changed = []
    # validate_args requires it for TP/CP > 1 before Blackwell, and refuses it under Megatron-FSDP
    # (which only warns at TP > 1); CPU has no device queues.
    fsdp = getattr(args, "use_megatron_fsdp", False)
    if not fsdp and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        changed.append("CUDA_DEVICE_MAX_CONNECTIONS=1")
    if fsdp and args.gradient_reduce_div_fusion:  # its reduce-scatter divides by PREMUL_SUM, which gloo lacks
        args.gradient_reduce_div_fusion = False
        changed.append("gradient_reduce_div_fusion=False")
    if args.distributed_backend == "nccl":
        args.distributed_backend = "gloo"
        changed.append("--distributed-backend=gloo")
    if args.transformer_impl == "transformer_engine":
        args.transformer_impl = "local"
        changed.append("--transformer-impl=local")
    for name, value in _CPU_FLAG_VALUES:
        if getattr(args, name) != value:
            setattr(args, name, value)
            changed.append(f"{name}={value}")
    return changed


def check_transformer_engine(transformer_impl: str, importable: bool) -> None:
    """On a GPU machine, Megatron's default ``--transformer-impl transformer_engine`` needs the
    package: stop with the fix instead of falling back to slower local layers unnoticed."""
    if transformer_impl == "transformer_engine" and not importable:
        raise CanzonaArgumentError(
            "transformer-engine is not installed: pip install -e '.[gpu]', or pass --transformer-impl local")


def adapt_args_to_missing_kernels(args: argparse.Namespace,
                                  importable: Callable[[str], bool] | None = None) -> list[str]:
    """With ``--transformer-impl local`` on a GPU, turn off the fused kernels whose extension
    is not installed (they only make the step faster); return ``flag=value`` notes."""
    if args.transformer_impl != "local":
        return []
    importable = importable or (lambda module: importlib.util.find_spec(module) is not None)
    changed = []
    for name, value, module in _EXTENSION_KERNELS:
        if getattr(args, name) != value and not importable(module):
            setattr(args, name, value)
            changed.append(f"{name}={value} (no {module})")
    return changed


def place_ranks_on_gpus(args: argparse.Namespace, device_count: int) -> list[str]:
    """Megatron puts local rank r on GPU r. gloo ranks may share GPUs (how a single GPU runs a
    multi-rank test): local rank r goes to GPU ``r % device_count``. NCCL refuses two ranks on
    one GPU, so there the error names the fix."""
    if device_count == 0 or args.local_rank < device_count:
        return []
    if args.distributed_backend == "nccl":
        raise CanzonaArgumentError(
            f"local rank {args.local_rank} has no GPU of its own ({device_count} on this node): start at most "
            f"{device_count} processes per node (--nproc-per-node), or use --distributed-backend gloo to share GPUs")
    gpu = args.local_rank % device_count
    args.local_rank = gpu
    return [f"local rank -> GPU {gpu} (gloo ranks share the node's {device_count} GPUs)"]


def _transformer_engine_importable() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def check_launched_as_a_rank(environ: dict[str, str] | os._Environ = os.environ) -> None:
    """One process per rank, started by torchrun (or a launcher that sets what it sets): a
    plain ``python pretrain_gpt.py`` has no rendezvous and would fail deep in Megatron."""
    if "MASTER_ADDR" not in environ and "RANK" not in environ:
        raise CanzonaArgumentError(
            "no RANK or MASTER_ADDR in the environment: launch one process per rank with torchrun, e.g. "
            "torchrun --nproc-per-node 1 pretrain_gpt.py <flags> (or an examples/qwen3/ recipe)")


def lock_save_directory(args: argparse.Namespace, environ: dict[str, str] | os._Environ = os.environ) -> None:
    """The job's first rank takes ``--save``'s lock for the job's life (a second job saving
    there stops here, naming the first); the other ranks follow its fate through torchrun."""
    if args.save is None or int(environ.get("RANK", "0")) != 0:
        return
    lock = take_save_lock(args.save)
    if lock.taken_over is not None:
        print(f"[canzona] took over the lock of --save {args.save} from {lock.taken_over.describe()}: "
              f"{lock.taken_over_because}", flush=True)
    # Holding the lock, before anything is written: what failed or killed saves left goes now, so a
    # resume into a full filesystem gets that space back (a complete checkpoint is never touched).
    removed, freed = clear_failed_saves(args.save)
    if removed:
        print(f"[canzona] removed what a failed or killed save left under --save {args.save} ({', '.join(removed)}): "
              f"{describe_bytes(freed)} freed", flush=True)


def parse_and_validate() -> argparse.Namespace:
    """Megatron's flags + Canzona's, checked, and set as Megatron's global args.

    Megatron's own ``parse_and_validate_args`` in three steps, so that Canzona's checks run
    first (one-line errors) and its one correction runs after ``validate_args``.
    """
    install_patch_group(ARGUMENT_PATCHES)  # Megatron's --help must format (canzona_patches/registry.py)
    args = parse_args(extra_args_provider=add_canzona_args)
    validate_canzona_args(args)
    on_cpu = enable_cpu_training_mode()
    notes = adapt_args_to_cpu(args) if on_cpu else []
    if not on_cpu:
        check_transformer_engine(args.transformer_impl, _transformer_engine_importable())
        notes = adapt_args_to_missing_kernels(args) + place_ranks_on_gpus(args, torch.cuda.device_count())
    try:
        validate_args(args)
    except AssertionError as error:  # Megatron's bare asserts: one line naming the flags and the fix
        raise megatron_check_failed(error, args) from None
    finalize_canzona_args(args)
    set_global_variables(args)
    if notes:
        reason = "no CUDA, running on CPU" if on_cpu else "flags adjusted"
        print_rank_0(f"> {reason}: {', '.join(notes)}")
    return args


def main() -> int:
    """Parse, validate, install the hooks and run ``megatron.training.pretrain``."""
    if launched_by_torchrun():
        end_with_parent()  # a rank whose torchrun was killed stops instead of training on
    # Every rank fails these checks alike and only the first says why: it holds torchrun's SIGTERM
    # (sent once another rank has exited) until its line is out, or the line would be lost.
    if signal.getsignal(signal.SIGTERM) is _sigterm_during_imports:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the import-time hold ends: signal_held takes over
    with signal_held(signal.SIGTERM) if reports_errors() else contextlib.nullcontext():
        if _SIGTERM_DURING_IMPORTS:
            os.kill(os.getpid(), signal.SIGTERM)  # held with the rest, taken once the checks are done
        try:
            args = parse_and_validate()
            check_launched_as_a_rank()
            lock_save_directory(args)
        except (CanzonaArgumentError, SaveDirectoryLocked) as error:
            if reports_errors():  # once per job: every rank fails alike at start-up
                print(f"pretrain_gpt.py: error: {error}", file=sys.stderr, flush=True)
            return 2
    install_patches(args)  # every Megatron patch whose condition holds (python -m canzona_patches.registry)
    # SIGTERM: torchrun's after a rank died (one line naming it), or a stop (scancel, preemption):
    # saved at the next iteration boundary under --exit-signal-handler, else one line saying so.
    # The handlers are read now; the watch takes SIGTERM once the process group exists (model_provider).
    _PEER_WATCH[:] = [functools.partial(_print_lost_peer, args),
                      functools.partial(stop_on_sigterm, args, exit_handler_of(args), sigterm_handler())]
    try:
        pretrain(
            pretrain_cfg_container_from_args(args),
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            model_provider=model_provider,
        )
    except CanzonaRankError as error:  # found by one rank alone (a data file cut short under the job)
        if claim_report():
            print(f"pretrain_gpt.py: error: {_last_line(error)}", file=sys.stderr, flush=True)
        return 2
    except CanzonaArgumentError as error:  # found once the model exists (e.g. bucket too small), or the data
        if _peer_failed(error):  # a save whose collective lost a rank, or timed out
            return _stop_for_peer(args, error)
        mark_ended_knowingly()
        if reports_errors():  # every rank checks the same plan and the same files
            print(f"pretrain_gpt.py: error: {error}", file=sys.stderr, flush=True)
        return 2
    except (AssertionError, RuntimeError) as error:  # sizes Megatron's parallel-state set-up cannot lay out
        if _peer_failed(error):
            return _stop_for_peer(args, error)
        if (data := data_worker_died_words(error, args.data_path)) is not None:
            if claim_report():
                print(f"pretrain_gpt.py: error: {data}", file=sys.stderr, flush=True)
            return 2
        mark_ended_knowingly()
        if not raised_in_set_up(error):
            raise
        if reports_errors():
            print(f"pretrain_gpt.py: error: {megatron_check_failed(error, args)}", file=sys.stderr, flush=True)
        return 2
    except SystemExit as stop:  # Megatron's clean stops (--exit-interval, --exit-duration-in-mins)
        if stop.code not in (None, 0):
            mark_ended_knowingly()
            raise
    except BaseException as error:  # noqa: BLE001  (reported, or marked and raised on)
        if _peer_failed(error):
            return _stop_for_peer(args, error)
        mark_ended_knowingly()
        raise
    _tear_down_process_groups()
    problem = nothing_trained(get_args(), *iterations_this_job())
    if problem is not None:  # a run that trained nothing unasked is a failure, not a success
        mark_ended_knowingly()
        if reports_errors():
            print(f"pretrain_gpt.py: error: {problem}", file=sys.stderr, flush=True)
        return 1
    return 0


def _last_line(error: BaseException) -> str:
    """The error's own line: a DataLoader worker's error comes back with its traceback before it."""
    text = str(error).strip()
    if "Original Traceback" not in text:
        return text
    return text.splitlines()[-1].split(": ", 1)[-1]


def _peer_failed(error: BaseException) -> bool:
    return lost_peer_words(error) is not None or timed_out_words(error) is not None


def _stop_for_peer(args: argparse.Namespace, error: BaseException) -> int:
    """A collective failed because a rank is gone, or timed out waiting for one: the one reporting
    survivor prints one line (which rank, the last complete checkpoint) and the command to
    resume; every survivor stops."""
    lost = lost_peer_words(error)
    gone = report_lost_peer(lost) if lost is not None else report_silent_peer(timed_out_words(error))
    if gone is not None:
        _print_lost_peer(args, gone)
    return 1


def _print_lost_peer(args: argparse.Namespace, gone: str) -> None:
    """One line (the rank gone or silent, the last complete checkpoint), then the command to resume."""
    advice, command = resume_advice(args)
    print(f"pretrain_gpt.py: error: {gone}; {advice}\n{command}", file=sys.stderr, flush=True)


def _tear_down_process_groups() -> None:
    """Megatron leaves the process groups alive; tearing them down once every rank is done stops
    gloo's worker threads before interpreter exit (else an occasional abort at exit)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
