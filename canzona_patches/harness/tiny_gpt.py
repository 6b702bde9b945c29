"""A tiny Megatron GPTModel trained for a few steps on one rank of a local gloo group.

:func:`train_tiny_gpt` is the body every rank runs under
:func:`megatron.canzona.runtime.launch`: it builds a 2-layer Qwen3-like GPTModel (local
spec, QK RMSNorm, SwiGLU, GQA, no biases), wraps it in Megatron's DDP with the distributed
optimizer, trains ``num_steps`` Adam steps on a fixed global batch and returns every
parameter gathered to its full (TP-unsharded) tensor by name, so that runs of different
DP x TP shapes can be compared with one single-process reference.

Megatron is imported inside the functions: pytest collects this module in the parent
process, which never needs it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

NUM_LAYERS = 2
HIDDEN = 64
FFN_HIDDEN = 128
NUM_HEADS = 4
NUM_QUERY_GROUPS = 2
VOCAB = 128
SEQ_LEN = 16



def swiglu_ffn_hidden(hidden: int) -> int:
    """The benchmarks' FFN size at ``hidden``: 8/3 of it (SwiGLU), a multiple of 64, at least 64."""
    return max(64, round(8 * hidden / 3 / 64) * 64)


LAYOUTS = ("megatron", "canzona", "layer_wise")
"""``megatron``: DDP computes its default layout; ``canzona``: the Canzona plan's
(canzona_patches.integration.setup.make_setup); ``layer_wise``:
LayerWiseDistributedOptimizer._compute_per_buffer_param_layout, called standalone. The
last two put every parameter wholly inside one DP rank's shard."""
OPTIMIZERS = ("adam", "megatron_muon", "sync_muon", "muon", "shampoo", "soap", "adamuon", "normuon", "every_holder")
"""``adam``: Megatron's Adam DistributedOptimizer; ``megatron_muon``: Megatron's layer-wise
Muon, wired as ``megatron.training`` wires it (its own layout; ``layout`` is ignored);
``sync_muon``: synchronous compute, gradients all-reduced and every rank running the whole
Muon step (Canzona's Muon math, no distributed optimizer); ``muon``/``shampoo``/``soap``:
the Canzona optimizer (needs ``layout="canzona"``); ``every_holder``: under Megatron-FSDP, the peer
design that gathers each matrix to every rank holding a piece of it
(:mod:`canzona_patches.harness.every_holder`, TP 1)."""


@dataclass(frozen=True, kw_only=True)
class TinyRun:
    """One training run of the tiny GPT; every rank of a launch gets the same value."""

    tp_size: int = 1
    """Tensor-parallel size; the data-parallel size is world_size / tp_size."""
    num_steps: int = 3
    """Optimizer steps to take."""
    global_batch: int = 8
    """Sequences per step over all DP ranks; the same tokens whatever the DP size."""
    micro_batch: int = 2
    """Sequences per micro-batch; each DP rank accumulates global/(dp*micro) of them."""
    overlap_grad_reduce: bool = False
    """Megatron DDP's overlap of bucket reduce-scatters with backward."""
    reduce_scatter_with_fp32_accumulation: bool = False
    """Megatron DDP's reduce-scatter as an all-to-all summed in fp32 (--ddp-reduce-scatter-with-fp32-accumulation)."""
    overlap_param_gather: bool = False
    """Megatron DDP's overlap of bucket parameter all-gathers with the next forward
    (distributed optimizers only: Canzona's and Megatron's Adam)."""
    time_iteration: bool = False
    """Record, per iteration, when backward ends (the embedding's gradient) and when the next
    forward reaches the first transformer layer (``iteration_marks``); no barrier before the
    step and no loss all-reduce, so nothing but the optimizer's own work lies between them."""
    bucket_size: int | None = None
    """DDP bucket size in elements; None keeps Megatron's default (one bucket here)."""
    layout: str = "megatron"
    """Which FullParamLayout DDP gets; one of :data:`LAYOUTS`."""
    seed: int = 1234
    """Seeds weight init (CPU master weights) and the token stream."""
    lr: float = 1e-3
    """Learning rate (constant)."""
    optimizer: str = "adam"
    """One of :data:`OPTIMIZERS`."""
    weight_decay: float = 0.0
    """Decoupled weight decay (Megatron skips vectors and biases)."""
    split_qkv: bool = True
    """Canzona and Megatron Muon: optimize Q, K, V as separate matrices."""
    split_qkv_per_head: bool = False
    """Canzona: optimize every head's query, key and value block as its own matrix."""
    split_gate_up: bool = False
    """Canzona: optimize gate and up of fc1 as separate matrices."""
    alpha: float = 0.5
    """Canzona planner balance knob."""
    canzona_layout: str = "whole"
    """Canzona's DP layout of the matrix buffers: ``whole``, ``lean`` or ``auto`` (--canzona-layout)."""
    num_layers: int = NUM_LAYERS
    """Transformer layers (benchmarks grow the model; tests keep the default)."""
    hidden: int = HIDDEN
    """Hidden size; heads keep NUM_HEADS, so the head dim grows with it."""
    ffn_hidden: int = FFN_HIDDEN
    """SwiGLU intermediate size."""
    tp_mode: str = "async"
    """Canzona at TP > 1: ``async`` host-rank compute or ``sync`` (every TP rank computes)."""
    megatron_muon_tp_mode: str = "duplicated"
    """Megatron's ``muon_tp_mode`` at TP > 1 (``duplicated`` keeps the exact math)."""
    nan_grad_at_step: int | None = None
    """Fill rank 0's gradient buffers with NaN before this step's update (the step must be skipped)."""
    big_grad_at_step: int | None = None
    """Multiply rank 0's gradient buffers by 100 before this step's update: the global norm, so
    the clip, then acts on every rank because of rank 0's gradients alone."""
    count_syncs: bool = False
    """Count the host synchronisations inside each ``optimizer.step()``, and inside each
    forward-backward (``host_syncs.py``)."""
    num_experts: int = 0
    """MoE: experts per layer (every layer's MLP), 0 for the dense model."""
    ep_size: int = 1
    """Expert-parallel size."""
    expert_tp_size: int | None = None
    """Expert tensor-parallel size (``None``: 1 with EP > 1, else the TP size; Megatron's own
    default, the TP size, is ``expert_tp_size=tp_size``)."""
    moe_ffn_hidden: int = 32
    """Each expert's SwiGLU intermediate size."""
    moe_topk: int = 2
    """Experts per token."""
    clip_grad: float = 0.0
    """Megatron's global-norm gradient clipping (0: none; the norm is then not computed)."""
    grad_norm_skip_threshold: float = float("inf")
    """Skip the step of an iteration whose global norm is above this (``--grad-norm-skip-threshold``)."""
    early_gather: bool = True
    """Canzona (async): issue host-group gathers as buckets reduce (``--canzona-no-early-gather``: False)."""
    fsdp_micro_groups: str = "auto"
    """Under Megatron-FSDP: ``--canzona-fsdp-micro-groups`` (``one``, ``budget``; ``auto`` is ``budget`` on gloo)."""
    tp_together: str = "off"
    """Under Megatron-FSDP with Muon: ``--canzona-tp-together`` (``auto``, ``all``)."""
    narrow_gathers: bool = False
    """Under Megatron-FSDP with Muon in bf16: ``--canzona-narrow-gathers``."""
    exact_norm: bool | None = None
    """Canzona's Muon: ``--canzona-exact-norm`` (``None``: with :attr:`narrow_gathers`, which needs it)."""
    muon_ns_dtype: str = "float32"
    """Canzona's Muon: the Newton-Schulz dtype (``bfloat16`` is Megatron's default precision)."""
    muon_ns_method: str = "standard"
    """Canzona's Muon: the Newton-Schulz method (``--muon-ns-method``)."""
    early_gather_at_dispatch: bool = False
    """Issue them from the reduce-scatters' dispatch, in backward, as on CUDA (on gloo each
    waits for its reduce-scatter there: exact, slower)."""
    early_compute: bool | str = False
    """Compute each micro-group's updates before the step, staged (``True``: ``--canzona-early-compute
    on``; or the setting by name, ``auto`` too). With :attr:`early_gather_at_dispatch` the gathers
    go in backward and the compute once Megatron's loop that ends it starts, as on CUDA; the step
    commits them or, the clip acting, computes them again. Off: in the step."""
    speculation: str = "always"
    """In which iterations early compute speculates (``always``, so a few steps reach every
    outcome; ``backoff``: the run's default policy)."""
    matrices_first: bool | None = None
    """With early compute: the dense buckets without a matrix reduce after the last one with a
    matrix (``--canzona-matrices-reduce-first``); ``None``: the default (off without a batch
    to project)."""
    early_compute_bytes: int | None = None
    """Their memory budget per rank (``--canzona-early-compute-budget``; default 2 GiB)."""
    replay_grads: bool = False
    """After each forward-backward, replace every reduced gradient by one drawn from the
    parameter's global name and the step (``replayed_grad_seed``), the same at any DP and TP
    size: the step's inputs are then fixed, with no rounding of one step's forward fed into the
    next (needs ``early_gather=False``: gathers issued in backward would read the old ones).
    The result's ``initial_params`` are the parameters before the first step."""
    instances: int = 1
    """Megatron's distributed-optimizer instances (``--num-distributed-optimizer-instances``): each
    shards its optimizer (Canzona's plan) over ``dp / instances`` consecutive DP ranks, the
    gradients' shards all-reduced across instances after each reduce-scatter."""
    fsdp: str | None = None
    """Wrap the model in Megatron-FSDP with this sharding strategy (``optim``, ``optim_grads``,
    ``optim_grads_params``) instead of DDP: the Canzona optimizer's FSDP binding (``layout="canzona"``;
    its early gathers go at each bucket group's last reduce-scatter, on gloo inside backward), or
    Megatron's own Adam under FSDP (``optimizer="adam"``)."""
    return_state: bool = False
    """Return this rank's optimizer state (``state``: every tensor of the Canzona inner
    optimizer by path), for bitwise comparisons of runs on the same layout."""


def train_tiny_gpts(runs: list[TinyRun]) -> list[dict[str, Any]]:
    """Rank body for several runs in one launch (process start-up dominates test time)."""
    return [train_tiny_gpt(run) for run in runs]


def train_tiny_gpt(run: TinyRun) -> dict[str, Any]:
    """Rank body: train, then return full parameters, per-step losses and layout facts."""
    from canzona_patches.emulation.cpu import enable_cpu_mode

    enable_cpu_mode()
    if run.fsdp:  # Megatron-FSDP's CPU rows are in the training group (it imports megatron.training)
        from canzona_patches.emulation.cpu import enable_cpu_training_mode

        enable_cpu_training_mode()
    from canzona_patches import registry

    registry.install(argparse.Namespace(), groups=(registry.NORM,))  # as pretrain_gpt.py: one read per norm
    with model_parallel(run) as keep:
        model, ddp_model, optimizer, setup = build(run)
        plan = None if setup is None else setup.plan
        keep(ddp_model)
        params_of = (lambda: _fsdp_full_params(ddp_model)) if run.fsdp else (lambda: full_params(model))
        initial = params_of() if run.replay_grads else None
        syncs: list[list[str]] = []
        fb_syncs: list[list[str]] = []
        losses, grad_norms, step_seconds, applied = map(list, zip(
            *(train_step(run, ddp_model, optimizer, step, syncs, fb_syncs) for step in range(run.num_steps))
        ))
        if run.overlap_param_gather and not run.fsdp:  # the last step's all-gather waits for a next forward:
            ddp_model.disable_forward_pre_hook()  # force it, as Megatron does before evaluation and checkpoints
            # (not under Megatron-FSDP, which gathers in its own forward hooks: the parameters are read from its shards)
        return {
            "params": params_of(),
            "losses": list(losses),
            "grad_norms": list(grad_norms),
            "whole_params_owned": _owned_ranges_are_whole(optimizer),
            "updated": _updated(optimizer),
            "step_seconds": step_seconds,
            "skipped_steps": [step for step, ok in enumerate(applied) if not ok],
            "tp_stats": _tp_stats(optimizer),
            "host_coord": _host_coord(optimizer),
            "plan": None if plan is None else plan.to_json(),
            "planned_narrow": _planned_narrow(setup),
            "host_syncs": syncs,
            "forward_backward_syncs": fb_syncs,
            "state": _optimizer_state(optimizer) if run.return_state else None,
            "initial_params": initial,
            "iteration_marks": {k: list(v) for k, v in ITERATION_MARKS.items()} if run.time_iteration else None,
            "param_gather_chain": _param_gather_chain(ddp_model) if run.overlap_param_gather and not run.fsdp else None,
            "early_gathers": _early_count(optimizer, "issued"),
            "early_gathers_at_dispatch": _early_count(optimizer, "issued_at_dispatch"),
            "early_gathers_in_backward": _early_count(optimizer, "issued_in_backward"),
            "early_computed": _early_count(optimizer, "computed"),
            "early_computed_after_backward": _early_count(optimizer, "computed_after_backward"),
            "norms_ahead": _early_count(optimizer, "norms_ahead"),
            "norms_at_gather": _early_count(optimizer, "norms_at_gather"),
            "early_sources_made": _early_count(optimizer, "sources_made_last"),
            "reduces_held": _reduces_held(optimizer),
            "early_steps": _early_steps(optimizer),
        }


@contextlib.contextmanager
def model_parallel(run: TinyRun):
    """Megatron's process groups for the block (:func:`init_model_parallel`); the block hands the
    DDP model it builds to the callable it gets. After the block, the model's autograd graphs are
    dropped (:func:`_release`), Megatron's groups destroyed in c10d too (Megatron only forgets
    them: c10d keeps them, with their gloo threads and sockets) and the cycles collected, so the
    next run of a launch starts as the first did."""
    from megatron.core import parallel_state

    before = _process_groups()
    init_model_parallel(run)
    built: list = []
    try:
        yield built.append
    finally:
        for ddp_model in built:
            _release(ddp_model)
        parallel_state.destroy_model_parallel()
        for group in _process_groups() - before:
            if group in _process_groups():  # destroying a group may take groups split from it along
                dist.destroy_process_group(group)
        gc.collect()  # the model and optimizer hold the groups in cycles; their threads end with them


def _release(ddp_model: Any) -> None:
    """Empty every module of a finished run. Autograd's C++ nodes hold Python objects no
    collection sees through (DDP's and Megatron-FSDP's gradient hooks close over the wrapper; the
    distributed optimizer's fp32 shards are views of the parameters, carrying the graph to those
    hooks; the MoE dispatcher keeps the last routing probabilities and their graph), so each run's
    model, optimizer and process groups (with their gloo threads, about 60 a run) outlived it, and
    each later run of a launch was slower: 1.5 s to 3.8 s over 12 runs of one launch, a 4-rank
    launch of 24 runs 180 s instead of 47 (measured)."""
    for module in list(ddp_model.modules()):
        vars(module).clear()


def _process_groups() -> set:
    """Every process group c10d holds but the default one (no public API lists them)."""
    from torch.distributed import distributed_c10d

    return {group for group in distributed_c10d._world.pg_map if group is not distributed_c10d.GroupMember.WORLD}


def expert_tp_size(run: TinyRun) -> int:
    """``run``'s expert TP size: :attr:`TinyRun.expert_tp_size`, or 1 with EP > 1 and the TP size at EP 1."""
    if run.expert_tp_size is not None:
        return run.expert_tp_size
    return 1 if run.ep_size > 1 else run.tp_size


def init_model_parallel(run: TinyRun) -> None:
    """Megatron's process groups for ``run``: TP, EP, and expert TP 1 under expert
    parallelism (else the TP size: at EP 1 experts are dense parameters)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=run.tp_size, expert_model_parallel_size=run.ep_size,
        expert_tensor_parallel_size=expert_tp_size(run),
        num_distributed_optimizer_instances=run.instances,
    )


def build(run: TinyRun):
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(run.seed)  # master weights are drawn from the CPU generator
    model_parallel_cuda_manual_seed(run.seed)
    config = _transformer_config(run)
    model = _gpt_model(config)
    if run.num_experts:
        _init_by_global_name(model, run.seed)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=run.optimizer != "sync_muon",
        overlap_grad_reduce=run.overlap_grad_reduce,
        overlap_param_gather=run.overlap_param_gather,
        grad_reduce_in_fp32=True,
        reduce_scatter_with_fp32_accumulation=run.reduce_scatter_with_fp32_accumulation,
        bucket_size=run.bucket_size,
        num_distributed_optimizer_instances=run.instances,
        **({"use_megatron_fsdp": True, "data_parallel_sharding_strategy": run.fsdp,
            "gradient_reduce_div_fusion": False} if run.fsdp else {}),
    )
    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True)
    setup, layout = _layout(run, model, dp_size, ddp_config)
    if run.fsdp:
        if setup is None and run.optimizer not in ("adam", "every_holder"):
            raise ValueError("TinyRun.fsdp runs the Canzona optimizer (layout='canzona') or Megatron's Adam")
        from canzona_patches.emulation.cpu import pretending_cuda
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        # as megatron.training builds it: inside get_model's pretend-CUDA window on CPU
        ddp_model = pretending_cuda(FullyShardedDataParallel)(config=config, ddp_config=ddp_config, module=model)
    else:
        ddp_model = DistributedDataParallel(config, ddp_config, model, full_param_layout=layout)
    if setup is not None and not run.fsdp:  # as pretrain_gpt.py wraps a --canzona model
        from canzona_patches.integration.layout import gather_in_forward_order

        gather_in_forward_order(ddp_model)
    config.finalize_model_grads_func = finalize_model_grads
    if not run.fsdp or run.overlap_grad_reduce:  # as megatron.training: Megatron-FSDP's no_sync without
        config.no_sync_func = ddp_model.no_sync    # the overlap leaves all but the last micro-batch unreduced
    optimizer = _optimizer(run, ddp_model, OptimizerConfig, get_megatron_optimizer, setup)
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        early = getattr(getattr(part, "canzona", None), "early_gathers", None)
        if early is not None:
            early.at_dispatch = early.at_dispatch or run.early_gather_at_dispatch
    if run.time_iteration:
        _mark_iterations(model, fsdp=bool(run.fsdp))
    return model, ddp_model, optimizer, setup


ITERATION_MARKS: dict[str, list[float]] = {"backward_end": [], "forward_start": [], "step_end": []}
"""This process's ``time.perf_counter()`` marks of :attr:`TinyRun.time_iteration` runs."""


def _param_gather_chain(ddp_model) -> list[int]:
    """The overlapped parameter all-gathers' prefetch chain: from the bucket group nothing
    links to, each group's first parameter (its position in registration order) in turn."""
    position = {param: index for index, param in enumerate(ddp_model.module.parameters())}
    groups = ddp_model.bucket_groups
    linked = {id(g.next_param_gather_bucket_group) for g in groups}
    group = next(g for g in groups if id(g) not in linked)
    chain = []
    while group is not None:
        chain.append(min(position[p] for b in group.buckets for p in b.params_list))
        group = group.next_param_gather_bucket_group
    return chain


def _mark_iterations(model: torch.nn.Module, fsdp: bool = False) -> None:
    """Marks at the end of backward (the embedding's gradient is the last one computed; under
    Megatron-FSDP (``fsdp``) the gradient of its output, just before it) and at the first
    transformer layer's forward (after any parameter all-gather it waits for)."""
    for marks in ITERATION_MARKS.values():
        marks.clear()

    def backward_end(grad):
        ITERATION_MARKS["backward_end"].append(time.perf_counter())

    def on_output(module, args, out) -> None:
        if out.requires_grad:
            out.register_hook(backward_end)

    if fsdp:  # Megatron-FSDP swaps in the parameters forward uses: the mark rides the embedding's output
        model.embedding.word_embeddings.register_forward_hook(on_output)
    else:
        model.embedding.word_embeddings.weight.register_hook(backward_end)
    model.decoder.layers[0].register_forward_pre_hook(
        lambda module, args: ITERATION_MARKS["forward_start"].append(time.perf_counter()))


def _optimizer(run: TinyRun, ddp_model, OptimizerConfig, get_megatron_optimizer, setup):
    if run.optimizer not in OPTIMIZERS:
        raise ValueError(f"TinyRun.optimizer must be one of {OPTIMIZERS}, got {run.optimizer!r}.")
    megatron_muon = run.optimizer == "megatron_muon"
    optimizer_config = OptimizerConfig(
        optimizer="muon" if megatron_muon else "adam",
        lr=run.lr,
        weight_decay=run.weight_decay,
        clip_grad=run.clip_grad,
        grad_norm_skip_threshold=run.grad_norm_skip_threshold,
        bf16=False,
        params_dtype=torch.float32,
        # Megatron's own switch for Muon: the layer-wise optimizer replaces the distributed one.
        use_distributed_optimizer=not megatron_muon,
        use_layer_wise_distributed_optimizer=megatron_muon,
        # the layer-wise optimizer defers its all-gather to the forward pre-hooks with it
        overlap_param_gather=run.overlap_param_gather,
        **({**MEGATRON_MUON, "muon_tp_mode": run.megatron_muon_tp_mode} if megatron_muon else {}),
        muon_split_qkv=run.split_qkv,
    )
    if run.optimizer == "sync_muon":
        return _sync_muon(run, ddp_model, optimizer_config)
    if run.optimizer == "every_holder":
        from megatron.core import parallel_state

        from .every_holder import EveryHolderMuon

        if not run.fsdp or run.tp_size != 1:
            raise ValueError("TinyRun.optimizer='every_holder' runs under Megatron-FSDP (TinyRun.fsdp) at TP 1")
        cfg = canzona_config(run)
        return EveryHolderMuon(ddp_model, _fsdp_geometry(ddp_model), config=cfg.matrix, adamw=cfg.adamw, lr=run.lr,
                               weight_decay=run.weight_decay, dp_group=parallel_state.get_data_parallel_group())
    if run.optimizer in ("adam", "megatron_muon"):
        from canzona_patches import registry

        # The upstream fixes pretrain_gpt.py installs for these baselines (fp32 layer-wise Muon
        # cannot be built on stock 0.19.2; its distributed Adam cannot resume on torch's AdamW).
        flags = argparse.Namespace(canzona=False, use_distributed_optimizer=not megatron_muon,
                                   use_layer_wise_distributed_optimizer=megatron_muon, ckpt_format="torch_dist")
        registry.install(flags, groups=(registry.BASELINE,))
        optimizer = get_megatron_optimizer(optimizer_config, [ddp_model])
        # What OptimizerParamScheduler does before the first step (no scheduler here):
        # norms and biases (wd_mult 0) get no weight decay.
        for group in optimizer.param_groups:
            group["weight_decay"] = run.weight_decay * group.get("wd_mult", 1.0)
        return optimizer
    if run.layout != "canzona":
        raise ValueError("the Canzona optimizers need TinyRun.layout='canzona'.")
    from canzona_patches.integration.optimizer import build_canzona_optimizer

    return build_canzona_optimizer(optimizer_config, [ddp_model], setup)


def _sync_muon(run: TinyRun, ddp_model, optimizer_config):
    """Every rank updates every matrix: Canzona's single-device Muon behind Megatron's
    FP32Optimizer (which reads DDP's all-reduced ``main_grad``)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.optimizer import FP32Optimizer

    from canzona_patches.integration.layout import is_matrix_param
    from canzona_patches.integration.setup import fused_layout
    from megatron.canzona.optim import Muon

    cfg = canzona_config(run)
    if parallel_state.get_tensor_model_parallel_world_size() != 1:
        raise ValueError("sync_muon runs at TP 1 (its fused layouts are the full matrices')")
    model = ddp_model.module
    groups: dict[tuple, list] = {}
    for name, param in model.named_parameters():
        matrix = is_matrix_param(name, param)
        key = (matrix, fused_layout(name, model, cfg) if matrix else None, param.ndim == 1)
        groups.setdefault(key, []).append(param)
    param_groups = [
        {"params": params, "matrix": matrix, "fused_layout": layout, "weight_decay": 0.0 if vector else run.weight_decay}
        for (matrix, layout, vector), params in groups.items()
    ]
    inner = Muon(param_groups, lr=run.lr, weight_decay=run.weight_decay, config=cfg.matrix, adamw_config=cfg.adamw)
    return FP32Optimizer(inner, optimizer_config, lambda *unused: None)


# Megatron's Muon and Canzona's configured to the same math: fp32 Newton-Schulz
# ("high" matmul precision), the fixed quintic (3.4445, -4.775, 2.0315) that Megatron calls
# "simple", 5 steps, spectral scale sqrt(max(m, n)).
MEGATRON_MUON = dict(
    muon_momentum=0.95, muon_nesterov=False, muon_num_ns_steps=5, muon_scale_mode="spectral",
    muon_fp32_matmul_prec="high", muon_coefficient_type="simple", muon_extra_scale_factor=1.0,
)


def canzona_config(run: TinyRun):
    """The Canzona configuration a run uses; exact math (fp32/fp64 factorizations)."""
    from megatron.canzona.optim import AdaptiveMuonConfig, MuonConfig, ShampooConfig, SOAPConfig
    from megatron.canzona.runtime.config import CanzonaConfig

    matrix = {
        "muon": MuonConfig(ns_dtype=run.muon_ns_dtype, ns_method=run.muon_ns_method, scale_mode="spectral",
                           coefficients="quintic",
                           exact_norm=run.narrow_gathers if run.exact_norm is None else run.exact_norm),
        "shampoo": ShampooConfig(precondition_frequency=2, root_dtype="float64", eps=1e-4, eps_mode="relative"),
        # Shampoo's refreshes are staggered by name (the default) in every distributed run.
        # SOAP's are not: a staggered matrix refreshes again at step 2, from statistics of
        # two gradients, whose ill-determined eigenbasis amplifies the reduce order's
        # rounding 2.4x past the TP tolerance. Its staggered schedule is checked on one
        # device (tests/unit/test_optim_stacks_and_refresh.py).
        "soap": SOAPConfig(precondition_frequency=2, eigh_dtype="float64", max_precond_dim=64, eps=1e-4,
                           stagger_refresh=False),
        **{method: AdaptiveMuonConfig(ns_dtype=run.muon_ns_dtype, ns_method=run.muon_ns_method, scale_mode="spectral",
                                      coefficients="quintic", moment2_method=method) for method in ("adamuon", "normuon")},
    }
    name = run.optimizer if run.optimizer in matrix else "muon"  # sync_muon: Muon's math
    return CanzonaConfig(
        optimizer="adaptive_muon" if name in ("adamuon", "normuon") else name, matrix=matrix[name], alpha=run.alpha, split_qkv=run.split_qkv,
        split_qkv_per_head=run.split_qkv_per_head, split_gate_up=run.split_gate_up,
        tp_mode=run.tp_mode, layout=run.canzona_layout, early_gather=run.early_gather,
        early_compute=(run.early_compute if isinstance(run.early_compute, str) else "on" if run.early_compute else "off")
        if run.early_gather else "off", speculation=run.speculation,
        matrices_first=run.matrices_first, fsdp_micro_groups=run.fsdp_micro_groups, tp_together=run.tp_together,
        narrow_gathers=run.narrow_gathers,
        **({} if run.early_compute_bytes is None else {"early_compute_bytes": run.early_compute_bytes}),
    )


def _host_coord(optimizer) -> tuple[int, int] | None:
    """This rank's (DP rank, TP rank) in the Canzona host group, if a Canzona optimizer runs."""
    engine = getattr(_inner(optimizer), "engine", None)
    return None if engine is None else tuple(engine.coord)


def _planned_narrow(setup) -> dict[str, dict[str, int]] | None:
    """The dense plan's tasks whose update and pieces go narrower, as the planner prices them
    (``planning.comm``: its ``traffic``'s ``narrow`` and ``gathers``), if a Canzona optimizer runs."""
    if setup is None:
        return None
    from megatron.canzona.planning.comm import narrow_update_bytes
    from megatron.canzona.planning.schedule import plan_schedule

    from .fsdp_dry_run import gathered_narrow

    tasks = plan_schedule(setup.plan).tasks
    return {"updates": narrow_update_bytes(tasks, setup.specs, setup.config.cost_model()), "gathers": gathered_narrow(setup)}


def _tp_stats(optimizer) -> dict[str, Any] | None:
    """The Canzona TP engine's record of the last step (bytes, timeline), if it ran one."""
    import dataclasses

    if hasattr(optimizer, "bytes_sent"):  # the every-holder baseline's all-gathers
        return {"bytes_sent": optimizer.bytes_sent}
    stats = getattr(_inner(optimizer), "last_stats", None)
    return dataclasses.asdict(stats) if stats is not None else None


def planned_tasks(plan) -> dict[str, tuple[int, int]]:
    """Every task of a single-chunk Canzona plan as the optimizer reports it (``name#part<k>``
    for a part hosted apart, ``--canzona-split-gate-up``) -> the (DP rank, TP rank) computing
    it (TP rank 0 for a matrix every TP rank holds whole)."""
    return {h.name if h.span is None else f"{h.name}#part{h.part}": (h.dp_rank, h.tp_rank or 0) for h in plan.hosts}


def _updated(optimizer) -> list[str]:
    """Global names (experts by global index) of the matrices this rank computed last step."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [name for part in parts for name in getattr(getattr(part, "optimizer", None), "last_step_updates", [])]


def _early_steps(optimizer) -> list[dict[str, int]]:
    """Steps computed before they ran, by outcome (committed, recomputed, skipped), of each
    part of the Canzona optimizer (the dense one, then the expert one of a chained one)."""
    return [dict(getattr(part, "early_steps", {})) for part in getattr(optimizer, "chained_optimizers", [optimizer])]


def _early_count(optimizer, field: str) -> int | None:
    """Gathers the Canzona optimizer (each of a chained one) issued before its steps; ``None``
    when none issues early."""
    parts = [getattr(getattr(part, "canzona", None), "early_gathers", None)
             for part in getattr(optimizer, "chained_optimizers", [optimizer])]
    counts = [getattr(early, field) for early in parts if early is not None]
    return sum(counts) if counts else None


def _reduces_held(optimizer) -> int | None:
    """Reduce-scatters held back behind the matrices' (``--canzona-matrices-reduce-first``);
    ``None`` where the order is Megatron's."""
    orders = [getattr(getattr(getattr(part, "canzona", None), "early_gathers", None), "order", None)
              for part in getattr(optimizer, "chained_optimizers", [optimizer])]
    counts = [order.held_count for order in orders if order is not None]
    return sum(counts) if counts else None


def _optimizer_state(optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the Canzona inner optimizer's state (matrix and AdamW), by path; of
    each part of a chained one (dense, expert), under ``<i>/``."""
    if hasattr(optimizer, "chained_optimizers"):
        return {f"{i}/{path}": value for i, part in enumerate(optimizer.chained_optimizers)
                for path, value in _optimizer_state(part).items()}
    inner = _inner(optimizer)
    out: dict[str, torch.Tensor] = {}

    def walk(path: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out[path] = value.detach().clone()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{path}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{path}/{i}", v)
        elif hasattr(value, "__dict__"):
            walk(path, vars(value))

    walk("matrix", inner.matrix_state)
    flat = [p for group in inner.param_groups for p in group["params"]]
    walk("elementwise", [inner.state[p] for p in flat if p in inner.state])
    return out


def _inner(optimizer):
    """The Canzona inner optimizer (None for Megatron's own, which may be chained)."""
    if hasattr(optimizer, "chained_optimizers"):
        return None
    return getattr(optimizer, "optimizer", None)


def _transformer_config(run: TinyRun):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=run.num_layers,
        hidden_size=run.hidden,
        ffn_hidden_size=run.ffn_hidden,
        num_attention_heads=NUM_HEADS,
        num_query_groups=NUM_QUERY_GROUPS,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        qk_layernorm=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=run.tp_size,
        params_dtype=torch.float32,
        # Full master weights drawn on CPU, then split: identical model whatever tp_size.
        use_cpu_initialization=True,
        perform_initialization=True,
        # Fused kernels need CUDA, apex or transformer-engine.
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **_moe_config(run),
    )


def _moe_config(run: TinyRun) -> dict[str, Any]:
    """Qwen3-MoE's router (softmax over the top k, auxiliary load-balancing loss), dropless,
    all-to-all token dispatch, sequence parallelism with TP; nothing for the dense model."""
    if not run.num_experts:
        return {}
    return dict(
        num_moe_experts=run.num_experts, moe_router_topk=run.moe_topk, moe_ffn_hidden_size=run.moe_ffn_hidden,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        expert_model_parallel_size=run.ep_size, expert_tensor_parallel_size=expert_tp_size(run),
        sequence_parallel=run.tp_size > 1,  # Megatron's MoE layer refuses TP without it
    )


def _gpt_model(config):
    import logging

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    # Its deprecation notice (one per model built) says nothing about these runs.
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                 normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ_LEN,
        position_embedding_type="rope",
    )


def _layout(run: TinyRun, model: torch.nn.Module, dp_size: int, ddp_config):
    """``(CanzonaSetup or None, FullParamLayout or None)`` for DDP."""
    if run.layout not in LAYOUTS:
        raise ValueError(f"TinyRun.layout must be one of {LAYOUTS}, got {run.layout!r}.")
    if run.optimizer == "megatron_muon":
        from megatron.core import parallel_state

        expert_dp_size = parallel_state.get_expert_data_parallel_world_size()
        return None, megatron_layer_wise_muon_layout(model, dp_size, ddp_config, bucket_size=run.bucket_size,
                                                     expert_dp_size=expert_dp_size)
    if run.layout == "megatron":
        return None, None  # DDP computes DistributedOptimizer's default layout itself
    if run.layout == "canzona":
        from megatron.core import parallel_state

        from canzona_patches.integration.setup import make_setup

        setup = make_setup([model], ddp_config, canzona_config(run), dp_size=dp_size,
                           tp_size=parallel_state.get_tensor_model_parallel_world_size(), ep_size=run.ep_size,
                           expert_tp_size=expert_tp_size(run))
        return setup, setup.layouts[0] if setup.layouts else None  # none under Megatron-FSDP
    params = [p for p in model.parameters() if p.requires_grad]
    return None, layer_wise_layout(params, dp_size, ddp_config, bucket_size=run.bucket_size)


def megatron_layer_wise_muon_layout(model, dp_size: int, ddp_config, *, bucket_size: int | None,
                                    expert_dp_size: int | None = None):
    """What ``megatron.training`` does for ``--optimizer muon --use-distributed-optimizer``:
    tag the parameters for buffer routing and take LayerWiseDistributedOptimizer's layout,
    expert buffers sharded over the expert-DP group (``wrap_model_chunks_with_ddp``; sized by
    the dense DP group, they name shards no expert-DP rank has)."""
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer,
        tag_params_for_buffer_routing,
    )

    tag_params_for_buffer_routing([model])
    params = [p for p in model.parameters() if p.requires_grad]
    return LayerWiseDistributedOptimizer.compute_full_param_layout(
        params, bucket_size, dp_size, ddp_config, expert_data_parallel_world_size=expert_dp_size
    )


def layer_wise_layout(params, dp_size: int, ddp_config, *, bucket_size: int | None):
    """FullParamLayout from LayerWiseDistributedOptimizer's bin-packing, called standalone."""
    from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.optimizer.param_layout import FullParamLayout

    compute = LayerWiseDistributedOptimizer._compute_per_buffer_param_layout
    groups = group_params_for_buffers(params, ddp_config.grad_reduce_in_fp32)
    return FullParamLayout(
        layouts={
            key: compute(group, bucket_size, dp_size, ddp_config, indices)
            for key, (group, indices) in groups.items()
        }
    )


def train_step(run: TinyRun, ddp_model, optimizer, step: int, syncs: list | None = None,
               fb_syncs: list | None = None) -> tuple[float, float, float, bool]:
    """One optimizer step; returns (global-batch mean loss, global grad norm, step seconds,
    whether the update was applied). With ``run.count_syncs`` the step's host reads are
    appended to ``syncs``, and forward-backward's (early gathers included) to ``fb_syncs``.

    The step time is ``optimizer.step()`` alone (after a barrier), all-gather included."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from .host_syncs import count_host_syncs

    micro_batches = _local_micro_batches(run, step)
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    with count_host_syncs() if run.count_syncs else contextlib.nullcontext([]) as fb_seen:
        outputs = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=iter(micro_batches),
            model=[ddp_model],
            num_microbatches=len(micro_batches),
            seq_length=SEQ_LEN,
            micro_batch_size=run.micro_batch,
            forward_only=False,
        )
    if fb_syncs is not None and run.count_syncs:
        fb_syncs.append(fb_seen)
    if run.replay_grads:
        if run.fsdp:
            _replay_fsdp_grads(ddp_model, run, step)
        else:
            _replay_grads(ddp_model.module, run, step)
    if step == run.nan_grad_at_step and dist.get_rank() == 0:
        for buffer in ddp_model.buffers:
            buffer.grad_data.fill_(float("nan"))
    if step == run.big_grad_at_step and dist.get_rank() == 0:
        for buffer in ddp_model.buffers:
            buffer.grad_data.mul_(100.0)
    if not run.time_iteration:
        dist.barrier()
    start = time.perf_counter()
    if run.count_syncs:
        with count_host_syncs() as seen:
            update_ok, grad_norm, _ = optimizer.step()
        if syncs is not None:
            syncs.append(seen)
    else:
        update_ok, grad_norm, _ = optimizer.step()
    seconds = time.perf_counter() - start
    if run.time_iteration:
        ITERATION_MARKS["step_end"].append(start + seconds)
    local_mean = torch.stack([out["loss"] for out in outputs]).mean()
    if run.time_iteration:  # this rank's loss only: no collective between step and next forward
        return float(local_mean), float("nan") if grad_norm is None else float(grad_norm), seconds, bool(update_ok)
    dist.all_reduce(local_mean, group=parallel_state.get_data_parallel_group())
    loss = float(local_mean) / parallel_state.get_data_parallel_world_size()
    return loss, float("nan") if grad_norm is None else float(grad_norm), seconds, bool(update_ok)


def _local_micro_batches(run: TinyRun, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's share of step ``step``'s global batch, cut into micro-batches."""
    from megatron.core import parallel_state

    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    if run.global_batch % (dp_size * run.micro_batch):
        raise ValueError("global_batch must be a multiple of dp_size * micro_batch.")
    generator = torch.Generator().manual_seed(run.seed * 1000 + step)
    tokens = torch.randint(0, VOCAB, (run.global_batch, SEQ_LEN + 1), generator=generator)
    per_rank = run.global_batch // dp_size
    local = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return [
        (local[i : i + run.micro_batch, :-1], local[i : i + run.micro_batch, 1:])
        for i in range(0, per_rank, run.micro_batch)
    ]


def _forward_step(data_iterator, model):
    inputs, labels = next(data_iterator)
    positions = torch.arange(SEQ_LEN).expand_as(inputs)
    per_token_loss = model(inputs, positions, None, labels=labels)
    return per_token_loss, functools.partial(_mean_loss, per_token_loss.numel())


def _mean_loss(num_tokens: int, per_token_loss: torch.Tensor):
    # Mean over this micro-batch; the schedule divides by the number of micro-batches and
    # DDP by dp_size, so every DP shape optimizes the same global-batch mean.
    loss = per_token_loss.float().sum() / num_tokens
    return loss, {"loss": loss.detach().clone()}  # the schedule rescales `loss` in place


def _init_by_global_name(model: torch.nn.Module, seed: int) -> None:
    """Draw every matrix from a generator seeded by its global name, and take this rank's TP
    shard: the same model at any EP and TP size. (Megatron draws experts in construction
    order, so an EP rank holding experts 2 and 3 draws what EP 1 gives experts 0 and 1, and
    every later layer shifts with it.) Norm weights keep their ones."""
    import zlib

    from canzona_patches.params import global_param_names

    names = global_param_names([model])
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() < 2:
                continue
            generator = torch.Generator().manual_seed(zlib.crc32(names[param].encode()) ^ seed)
            param.copy_(_drawn_whole_then_sliced(param, generator))


def _drawn_whole_then_sliced(param: torch.nn.Parameter, generator: torch.Generator,
                             local_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """0.02 * a standard normal tensor of ``param``'s unsharded shape, cut to this rank's TP shard
    (``local_shape``: the TP shard's shape, where ``param`` does not have it: a Megatron-FSDP
    ``DTensor`` parameter reports the TP-global one)."""
    from megatron.core import parallel_state

    from canzona_patches.integration.layout import is_expert_param

    group = parallel_state.get_expert_tensor_parallel_group() if is_expert_param(param) else \
        parallel_state.get_tensor_model_parallel_group()
    tp_size, tp_rank = dist.get_world_size(group), dist.get_rank(group)
    sharded = tp_size > 1 and getattr(param, "tensor_model_parallel", False)
    shape = list(param.shape if local_shape is None else local_shape)
    if sharded:
        shape[param.partition_dim] *= tp_size
    full = 0.02 * torch.randn(shape, generator=generator)
    if sharded:  # rank r holds pieces r, r + tp, ... of tp * stride along the dim (see _unshard)
        stride = param.partition_stride
        pieces = full.chunk(tp_size * stride, dim=param.partition_dim)
        full = torch.cat([pieces[j * tp_size + tp_rank] for j in range(stride)], dim=param.partition_dim)
    return full


def replayed_grad_seed(name: str, seed: int, step: int) -> int:
    """The generator seed of ``name``'s replayed gradient at ``step`` (:attr:`TinyRun.replay_grads`)."""
    import zlib

    return zlib.crc32(f"{name}@{step}".encode()) ^ seed


def _replay_grads(model: torch.nn.Module, run: TinyRun, step: int) -> None:
    """Overwrite every reduced gradient with 0.02 * a normal tensor drawn from the parameter's
    global name and the step, cut to this rank's TP shard: every DP rank's whole buffer, so
    each shard (and each piece a host gathers) holds the same values at any DP and TP size."""
    from canzona_patches.params import global_param_names

    names = global_param_names([model])
    with torch.no_grad():
        for param in model.parameters():
            generator = torch.Generator().manual_seed(replayed_grad_seed(names[param], run.seed, step))
            param.main_grad.copy_(_drawn_whole_then_sliced(param, generator))


def _fsdp_geometry(ddp_model) -> dict[str, tuple[Any, tuple[int, ...], tuple[tuple[int, int, int], ...]]]:
    """Per parameter name: Megatron-FSDP's optimizer (``DTensor``) parameter, its TP-local shape and
    every rank's ``(rank, lo, hi)`` of its flat elements."""
    from canzona_patches.integration.fsdp_geometry import fsdp_param_buffer, read_fsdp_buckets, read_fsdp_shapes

    shapes = read_fsdp_shapes(ddp_model)
    pieces = {item.name: bucket.pieces(item) for bucket in read_fsdp_buckets(ddp_model) for item in bucket.items}
    return {name: (param, shapes[name], pieces[name])
            for name, param in fsdp_param_buffer(ddp_model).optimizer_named_parameters}


def _replay_fsdp_grads(ddp_model, run: TinyRun, step: int) -> None:
    """:func:`_replay_grads` under Megatron-FSDP: each rank's elements of the drawn gradient
    written into the gradient Megatron-FSDP attached to its optimizer parameter."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    with torch.no_grad():
        for name, (param, shape, pieces) in _fsdp_geometry(ddp_model).items():
            generator = torch.Generator().manual_seed(replayed_grad_seed(name, run.seed, step))
            full = _drawn_whole_then_sliced(param, generator, shape).view(-1)
            for rank, lo, hi in pieces:
                if rank == dp_rank:
                    param.grad.to_local().view(-1).copy_(full[lo:hi])


def _fsdp_full_params(ddp_model) -> dict[str, torch.Tensor]:
    """:func:`full_params` under Megatron-FSDP: every parameter's elements gathered from the
    ranks holding them (the main weights; an expert's over expert-DP), TP-unsharded (by local
    name: an expert parallel rank's own experts)."""
    from megatron.core import parallel_state

    from canzona_patches.integration.layout import is_expert_param

    groups = {False: (parallel_state.get_data_parallel_group(), parallel_state.get_tensor_model_parallel_group()),
              True: (parallel_state.get_expert_data_parallel_group(), parallel_state.get_expert_tensor_parallel_group())}
    out = {}
    for name, (param, shape, pieces) in _fsdp_geometry(ddp_model).items():
        dp_group, tp_group = groups[is_expert_param(param.orig_param)]
        held: list[Any] = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(held, param.to_local().detach().float().reshape(-1).clone(), group=dp_group)
        flat = torch.empty(math.prod(shape))
        for rank, lo, hi in pieces:
            flat[lo:hi] = held[rank]
        out[name] = _unshard(flat.view(shape), param, tp_group)
    return out


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters, TP-unsharded, by global name (experts by global index: the
    union over EP ranks is the whole model)."""
    from megatron.core import parallel_state

    from canzona_patches.params import global_param_names
    from canzona_patches.integration.layout import is_expert_param

    names = global_param_names([model])
    tp_group = parallel_state.get_tensor_model_parallel_group()
    expert_tp_group = parallel_state.get_expert_tensor_parallel_group()
    return {
        names[param]: _unshard(param.detach().float().clone(), param,
                               expert_tp_group if is_expert_param(param) else tp_group)
        for param in model.parameters()
    }


def _unshard(shard: torch.Tensor, param: torch.nn.Parameter, tp_group) -> torch.Tensor:
    """All-gather a TP-sharded param along its partition dim and undo its stride."""
    tp_size = dist.get_world_size(tp_group)
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return shard
    shards = [torch.empty_like(shard) for _ in range(tp_size)]
    dist.all_gather(shards, shard.contiguous(), group=tp_group)
    dim, stride = param.partition_dim, param.partition_stride
    # With stride s, rank r holds master pieces r, r + tp, ..., r + (s-1)tp along dim.
    pieces = [piece.chunk(stride, dim=dim) for piece in shards]
    return torch.cat([pieces[r][j] for j in range(stride) for r in range(tp_size)], dim=dim)


def _owned_ranges_are_whole(optimizer) -> bool:
    """True when every (matrix) param range this rank's DistributedOptimizer owns is whole."""
    for dist_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        # Megatron's layer-wise optimizer owns whole params by construction (no gbuf_ranges).
        for buffer_ranges in getattr(dist_optimizer, "gbuf_ranges", []):
            for bucket_ranges in buffer_ranges.values():
                for bucket in bucket_ranges:
                    for param, ranges in bucket["param_map"].items():
                        # A Canzona layout keeps matrices whole; AdamW params may be split.
                        if not getattr(param, "is_managed_by_layer_wise_optimizer", True):
                            continue
                        if ranges["param"].size != param.numel():
                            return False
    return True
