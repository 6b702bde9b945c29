"""One :class:`CanzonaSetup` per run: what Canzona decides, made once, where DDP is built.

The walk from the plan to the step::

    make_setup (or setup_from_args)     plan, schedule, layouts, host ranks, summary, logged once
      -> DistributedDataParallel(full_param_layout=setup.layouts[i])      one per model chunk
      -> build_canzona_optimizer(optimizer_config, ddp_chunks, setup)     binds setup.plan to the shards
      -> CanzonaDistributedOptimizer.canzona                              its part: binding, TP group, engine

``pretrain_gpt.py`` (``canzona_patches.integration.training``), ``tools/dry_run.py`` and the
test harness (``canzona_patches.harness.tiny_gpt``) all build through it. Nothing of it is
set on a Megatron object: each consumer gets the setup, or its part, as an argument.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from canzona_patches.integration.arguments import canzona_config_from_args, check_expert_sizes
from canzona_patches.integration.binding import Binding
from canzona_patches.integration.early_gather import EarlyGathers
from canzona_patches.integration.layout import (
    BUFFER_ROUTING_ATTR,
    build_canzona_plan,
    choose_matrices_first,
    early_compute_choice,
    early_compute_line,
    full_param_layouts,
    node_note,
    reduces_in_backward,
    stacked_expert_blocks,
    uses_megatron_fsdp,
    wire_config,
)
from canzona_patches.params import tp_stride
from canzona_patches.version import require_pinned_megatron
from megatron.canzona.optim import ExpertStackLayout, GateUpLayout, QKVLayout
from megatron.canzona.optim.split import FusedLayout
from megatron.canzona.planning import LAYOUTS, CanzonaPlan, summarize_canzona
from megatron.canzona.planning.comm import narrow_gather_bytes
from megatron.canzona.planning.schedule import Coord, plan_schedule
from megatron.canzona.planning.sim import Workload
from megatron.canzona.planning.sim.choose import ONE_GROUP_BUDGET
from megatron.canzona.runtime.config import CanzonaConfig
from megatron.canzona.runtime.host_groups import HostGroupEngine

require_pinned_megatron()

from megatron.core import parallel_state  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class CanzonaSetup:
    """What Canzona decides for one pipeline stage of a run (every model chunk together)."""

    config: CanzonaConfig
    """The matrix optimizer, its math and Canzona's own options."""
    plan: CanzonaPlan
    """Who hosts each matrix, the DP shards of every bucket, the micro-groups (``plan.experts``:
    the expert buffers' plan over the expert-data-parallel group)."""
    layouts: tuple[Any, ...]
    """The ``FullParamLayout`` each (unwrapped) model chunk's DDP must be built with (none under
    Megatron-FSDP, which lays out its own buckets)."""
    specs: tuple[Any, ...]
    """The parameter specs the plan was made from (the tools' accounting reads them)."""
    summary: dict | None
    """:func:`~megatron.canzona.planning.summarize_canzona` of the plan, where it was logged
    or asked for; else ``None``."""
    fused_layouts: dict[tuple[int, str], FusedLayout | None]
    """Per matrix parameter (model chunk, name): how its host splits the full (TP-global)
    matrix into the matrices optimized apart (:func:`fused_layout`)."""
    tp_strides: dict[tuple[int, str], int]
    """Per matrix parameter (model chunk, name): blocks per TP shard along its TP dim
    (:func:`~canzona_patches.params.tp_stride`)."""
    host_ranks: dict[Coord, int] | None = None
    """(DP rank, TP rank) -> rank in the tensor-and-data-parallel group; ``None``: the ranks
    tell each other when the optimizer is built (one collective)."""
    matrices_first: bool = False
    """The dense buckets without a matrix reduce after the last one with a matrix
    (``--canzona-matrices-reduce-first``, or its projected default; only with early compute)."""
    early_compute: tuple[bool, bool] = (False, False)
    """Whether the dense and the expert optimizer compute micro-groups early
    (``--canzona-early-compute``, decided for each one's data-parallel group at start-up)."""


@dataclass(frozen=True, kw_only=True)
class CanzonaPart:
    """One Canzona DistributedOptimizer's share of a setup (the dense buffers, or the experts'),
    bound to its shards when it is built; the checkpoint code and the early gathers read it."""

    binding: Binding
    """The plan's tasks, pieces and layouts found in this optimizer's shards."""
    engine: HostGroupEngine
    """The host-group engine that gathers, computes and scatters the matrices."""
    tp_group: Any
    """The TP group the matrices are sharded over (the expert TP group for experts)."""
    early_gathers: EarlyGathers | None
    """Host-group gathers issued as buckets reduce; ``None`` when off or nothing moves."""


def make_setup(
    model_chunks: list[torch.nn.Module], ddp_config: Any, config: CanzonaConfig, *, dp_size: int, tp_size: int,
    ep_size: int = 1, expert_tp_size: int | None = None, workload: Workload | None = None,
    host_ranks: dict[Coord, int] | None = None, summarize_here: bool = False, log: bool = True,
    cuda: bool | None = None,
) -> CanzonaSetup:
    """The setup of ``model_chunks`` (before DDP wraps them; their parameters are tagged for
    buffer routing) at the given parallel sizes. The first rank of each pipeline stage (DP and
    TP rank 0) logs the plan (unless ``log`` is off); ``summarize_here`` keeps its summary on
    this rank too.

    ``expert_tp_size`` defaults to 1 under expert parallelism, the TP size at EP 1 (experts are
    then dense parameters); ``setup_from_args`` passes the run's. ``cuda``: choose as a run with
    or without CUDA would (default: this process's; ``tools/dry_run.py`` models a CUDA run)."""
    expert_tp_size = (1 if ep_size > 1 else tp_size) if expert_tp_size is None else expert_tp_size
    fsdp = uses_megatron_fsdp(ddp_config)
    if ep_size > 1 or any(getattr(chunk.config, "num_moe_experts", None) for chunk in model_chunks):
        check_expert_sizes(tp_size, ep_size, expert_tp_size, fsdp=fsdp)
    plan, specs, choice = build_canzona_plan(model_chunks, ddp_config, config, dp_size=dp_size, tp_size=tp_size,
                                             ep_size=ep_size, expert_tp_size=expert_tp_size, workload=workload,
                                             cuda=cuda)
    first, stage = _stage_first_rank()
    first = first and log
    summary = None
    named = [(n, p) for chunk in model_chunks for n, p in chunk.named_parameters() if p.requires_grad]
    wire = wire_config(named, ddp_config)
    matrices_first, order = (False, None) if fsdp else choose_matrices_first(
        plan, specs, config, wire=wire, workload=workload, overlap=ddp_config.overlap_grad_reduce,
        instances=getattr(ddp_config, "num_distributed_optimizer_instances", 1))
    overlap = reduces_in_backward(ddp_config)
    expert_dp = plan.experts.dp_size if plan.experts is not None else None
    early = early_compute_line(config, dp_size, overlap, expert_dp)
    early_compute = (early_compute_choice(config, dp_size, overlap).on,
                     expert_dp is not None and early_compute_choice(config, expert_dp, overlap).on)
    if fsdp and choice is not None:  # each rank projected the micro-groups for itself
        check_same_choices({"--canzona-fsdp-micro-groups auto": int(plan.budget == ONE_GROUP_BUDGET)})
    elif choice is not None or order is not None:
        check_same_choices({"--canzona-layout auto": LAYOUTS.index(plan.layout),
                            "--canzona-matrices-reduce-first": int(matrices_first)})
    if first or summarize_here:
        summary = summarize_canzona(plan, specs, config.cost_model(), wire, narrow_gathers=config.narrow_gathers)
    if first:
        for line in (choice, early, order, qkv_line(config, model_chunks[0].config), together_line(config, plan),
                     narrow_line(config, plan, specs)):
            if line is not None:
                print(line if stage is None else line.replace("[canzona]", f"[canzona] stage {stage}:"), flush=True)
        _log_plan(plan, summary, stage)
        note = node_note(tp_size, ep_size, plan.experts.tp_size if plan.experts is not None else 1)
        if note is not None:
            print(note, flush=True)
    matrices = [(c, name, chunk) for c, chunk in enumerate(model_chunks) for name, p in chunk.named_parameters()
                 if getattr(p, BUFFER_ROUTING_ATTR, False)]
    return CanzonaSetup(
        config=config, plan=plan, layouts=() if fsdp else tuple(full_param_layouts(plan, model_chunks, ddp_config)),
        specs=tuple(specs), summary=summary, host_ranks=host_ranks, matrices_first=matrices_first,
        early_compute=early_compute,
        fused_layouts={(c, name): fused_layout(name, chunk, config) for c, name, chunk in matrices},
        tp_strides={(c, name): tp_stride(name, chunk.config.gated_linear_unit) for c, name, chunk in matrices},
    )


def check_same_choices(choices: dict[str, int], group: Any = None) -> None:
    """What each rank projected for itself (``choices``: a flag -> the value it took) is the same
    on every rank of the stage's tensor-and-data-parallel group (``group``: that one by default;
    no check outside a distributed job): ranks that chose differently would lay out or order
    their collectives differently, and hang or mix buckets. The projections read only what
    every rank shares, unless the launcher gives nodes different sizes (``LOCAL_WORLD_SIZE``);
    then this says so in one line. Costs two small all-reduces, once, at start-up."""
    if not torch.distributed.is_initialized():
        return
    if group is None:
        if not parallel_state.model_parallel_is_initialized():
            return
        group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    nccl = torch.distributed.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    low = torch.tensor(list(choices.values()), dtype=torch.int64, device=device)
    high = low.clone()
    torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN, group=group)
    torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX, group=group)
    differ = [flag for flag, a, b in zip(choices, low.tolist(), high.tolist()) if a != b]
    if differ:
        raise RuntimeError(
            f"the ranks projected different choices for {', '.join(differ)} (nodes of different sizes?): "
            "give the choice explicitly, or --canzona-cluster with the node size of every node")


def together_line(cfg: CanzonaConfig, plan: Any) -> str | None:
    """The start-up line of ``--canzona-tp-together`` (none without it): which matrices their TP
    ranks compute together."""
    if cfg.tp_together == "off":
        return None
    shared = [h for h in plan.hosts if h.together]
    kinds = sorted({h.name.rsplit(".", 2)[-2] for h in shared})
    return (f"[canzona] TP together ({cfg.tp_together}): {len(shared)} of {len(plan.hosts)} matrices computed by their "
            f"{plan.tp_size} TP ranks together, each its own shard, the Gram matrices summed over the TP group"
            + (f" ({', '.join(kinds)})" if kinds else ""))


def narrow_line(cfg: CanzonaConfig, plan: Any, specs: Any) -> str | None:
    """The start-up line of ``--canzona-narrow-gathers`` (none without it): how many matrices'
    pieces go to their hosts in bf16 (the dense plan's; the experts' alike)."""
    if not cfg.narrow_gathers:
        return None
    tasks = plan_schedule(plan).tasks
    narrow = narrow_gather_bytes(tasks, specs, cfg.cost_model())
    return (f"[canzona] narrow gathers: {len(narrow)} of {len(tasks)} matrices sent to their hosts in bf16, divided by "
            "their exact Frobenius norms (the holders' squares summed in integers over two all-reduces: one "
            "device's bits)")


def qkv_line(cfg: CanzonaConfig, tc: Any) -> str | None:
    """The start-up line of ``--canzona-split-qkv-per-head`` (none without it)."""
    if not cfg.split_qkv_per_head:
        return None
    heads, groups = tc.num_attention_heads, tc.num_query_groups or tc.num_attention_heads
    return (f"[canzona] QKV: each head its own matrix, {heads} query + {groups} key + {groups} value heads of "
            f"{tc.kv_channels} rows per linear_qkv (Megatron's --muon-split-qkv splits only Q, K and V)")


def fused_layout(name: str, module: torch.nn.Module, cfg: CanzonaConfig) -> FusedLayout | None:
    """How a full (TP-global) fused weight splits into the matrices optimized separately."""
    tc = module.config
    groups = tc.num_query_groups or tc.num_attention_heads
    if (cfg.split_qkv or cfg.split_qkv_per_head) and name.endswith("linear_qkv.weight"):
        return QKVLayout(num_query_groups=groups, heads_per_group=tc.num_attention_heads // groups,
                         head_dim=tc.kv_channels, split_heads=cfg.split_qkv_per_head)
    if cfg.split_gate_up and tc.gated_linear_unit and name.endswith("linear_fc1.weight"):
        return GateUpLayout(num_partitions=1)
    if name.endswith(("experts.weight1", "experts.weight2")):  # legacy GroupedMLP: one matrix per expert
        shape = tuple(module.get_parameter(name).shape)
        num_local = tc.num_moe_experts // tc.expert_model_parallel_size
        blocks = stacked_expert_blocks(name, shape, num_local)
        return ExpertStackLayout(num_experts=num_local, expert_shape=blocks[0], shape=shape)
    return None


def setup_from_args(model_chunks: list[torch.nn.Module], ddp_config: Any, args: Any, *,
                    summarize_here: bool = False) -> CanzonaSetup:
    """:func:`make_setup` configured by ``pretrain_gpt.py``'s flags and Megatron's process groups."""
    workload = Workload(global_batch=args.global_batch_size, micro_batch=args.micro_batch_size,
                        seq_length=args.seq_length, context_parallel=getattr(args, "context_parallel_size", 1))
    return make_setup(
        model_chunks, ddp_config, canzona_config_from_args(args),
        # one distributed-optimizer instance's DP (x CP) ranks: Megatron shards every bucket over them
        dp_size=parallel_state.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tp_size=parallel_state.get_expert_tensor_parallel_world_size(),
        workload=workload, summarize_here=summarize_here,
    )


def _stage_first_rank() -> tuple[bool, int | None]:
    """Whether this rank logs its pipeline stage's plan (DP and TP rank 0 of the stage), and
    the stage's index when there are several."""
    if not torch.distributed.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0), None
    first = (parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
             and parallel_state.get_tensor_model_parallel_rank() == 0)
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    return first, (parallel_state.get_pipeline_model_parallel_rank() if stages > 1 else None)


def _dp_text(dp_size: int) -> str:
    """``DP d``, or ``DP d x CP c`` under context parallelism (the plan spans both: Megatron's
    DDP reduces and its distributed optimizer shards over DP x CP)."""
    initialized = parallel_state.model_parallel_is_initialized()
    cp = parallel_state.get_context_parallel_world_size() if initialized else 1
    text = f"DP {dp_size // cp} x CP {cp}" if cp > 1 else f"DP {dp_size}"
    inter = parallel_state.get_inter_distributed_optimizer_instance_group(check_initialized=False) if initialized else None
    if inter is not None and torch.distributed.get_world_size(inter) > 1:  # the plan is one instance's
        text += f" (each of {torch.distributed.get_world_size(inter)} distributed-optimizer instances)"
    return text


def _log_plan(plan: CanzonaPlan, s: dict, stage: int | None = None) -> None:
    """One line: layout, balance, padding, buckets, split matrices, bytes per rank."""
    prefix = "[canzona] plan:" if stage is None else f"[canzona] stage {stage} plan:"
    print(
        f"{prefix} {plan.layout} layout, {len(plan.hosts)} matrices over {_dp_text(plan.dp_size)} x TP {plan.tp_size}, "
        f"{s['num_buckets']} bucket(s), {s['split_params']} split across DP shards, "
        f"{plan.num_groups} micro-group(s), alpha {plan.layouts[0].alpha}, cost {plan.layouts[0].cost_kind} | "
        f"DP x TP makespan / lower bound {s['makespan_over_lower_bound']:.3f} | padding {100 * s['padding_overhead']:.1f}% | "
        f"sent per rank and step {s['comm_bytes_per_rank'] / 2**20:.1f} MiB",
        flush=True,
    )
    experts = s.get("experts")
    if plan.experts is not None and experts is not None:
        print(
            f"[canzona] experts: {len(plan.experts.hosts)} matrices per EP rank over expert-DP {plan.experts.dp_size} "
            f"x{f' expert TP {plan.experts.tp_size} x' if plan.experts.tp_size > 1 else ''} EP {plan.ep_size}, {experts['num_buckets']} bucket(s), {experts['split_params']} split | "
            f"makespan / lower bound {experts['makespan_over_lower_bound']:.3f} | padding "
            f"{100 * experts['padding_overhead']:.1f}% | dense + experts per rank "
            f"{s.get('combined_makespan_over_lower_bound', float('nan')):.3f}",
            flush=True,
        )
