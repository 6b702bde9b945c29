"""Model parameters → planner specs → the Canzona plan, and its layouts → ``FullParamLayout``.

:func:`build_canzona_plan` is the one place a run's plan is made; everything after it
(:func:`full_param_layouts` for DDP, ``canzona_patches.integration.optimizer.build_canzona_optimizer``
for the optimizer) takes the plan as an argument.

Hooks (megatron-core 0.19.2):
* ``megatron.core.distributed.param_and_grad_buffer.group_params_for_buffers`` — the grouping
  ``DistributedDataParallel`` checks a supplied layout against; matrix parameters are routed
  to their own buffer through the ``is_managed_by_layer_wise_optimizer`` attribute it reads.
* ``megatron.core.optimizer.param_layout.{FullParamLayout, PerBufferParamLayout}`` — the
  layout ``DistributedDataParallel(full_param_layout=...)`` accepts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch

from canzona_patches import registry
from canzona_patches.version import require_pinned_megatron
from megatron.canzona.planning import LAYOUTS, CanzonaPlan, DPPlan, ParamSpec, WireConfig, make_plan
from megatron.canzona.planning.fsdp import FSDP_LAYOUT
from megatron.canzona.planning.specs import qkv_blocks
from megatron.canzona.planning.geometry import default_bucket_size
from megatron.canzona.planning.memory import StateLayout
from megatron.canzona.planning.plan import BufferPlan
from megatron.canzona.planning.speculation import EarlyComputeDecision, early_compute_decision
from megatron.canzona.planning.sim import Workload, load_cluster
from megatron.canzona.planning.sim.choose import (
    ONE_GROUP_BUDGET,
    faster_fsdp_groups,
    faster_layout,
    fsdp_groups_line,
    layout_line,
    project_fsdp_groups,
    project_layouts,
    project_reduce_orders,
    reduce_order_line,
)

require_pinned_megatron()

from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers  # noqa: E402
from megatron.core.optimizer.param_layout import FullParamLayout, PerBufferParamLayout  # noqa: E402

from canzona_patches.integration.uneven import ShardedParamLayout  # noqa: E402

BUFFER_ROUTING_ATTR = "is_managed_by_layer_wise_optimizer"
"""Parameter attribute ``group_params_for_buffers`` reads to put a parameter in its own buffer."""

NamedParams = Sequence[tuple[str, torch.nn.Parameter]]

SINGLE_BUCKET = 2**62
"""Bucket size meaning "one bucket" (Megatron's ``bucket_size=None`` without overlap)."""


def is_matrix_param(name: str, param: torch.nn.Parameter) -> bool:
    """Matrix optimizers take 2-D weights except embeddings, the output layer and MoE
    routers (AdamW: a router's rows are per-expert logits, not a linear map to orthogonalize)."""
    if param.dim() != 2 or getattr(param, "is_embedding_or_output_parameter", False):
        return False
    if ".router." in f".{name}":
        return False
    return not ("embedding" in name or name.startswith("output_layer") or ".output_layer." in name)


def is_expert_param(param: torch.nn.Parameter) -> bool:
    """Whether DDP puts ``param`` in an expert buffer, reduced over the expert-data-parallel
    group: Megatron marks expert weights ``allreduce = False`` when experts are sharded
    differently from dense weights (EP > 1, or expert TP unlike TP); at EP 1 with expert TP
    equal to TP (what ``--canzona`` asks for there) they are ordinary dense parameters."""
    return not getattr(param, "allreduce", True)


def _fused_kind(name: str, gated_linear_unit: bool) -> str | None:
    """How a parameter fuses several matrices: Megatron's QKV, a gated fc1, or the legacy
    ``GroupedMLP``'s stacked expert weights (``experts.weight1``/``weight2``)."""
    if name.endswith("linear_qkv.weight"):
        return "qkv"
    if name.endswith("linear_fc1.weight") and gated_linear_unit:
        return "gate_up"
    if name.endswith(("experts.weight1", "experts.weight2")):
        return "experts"
    return None


def specs_from_model(
    named_params: NamedParams,
    *,
    tp_size: int,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    kv_channels: int | None = None,
    gated_linear_unit: bool = True,
    split_qkv: bool = False,
    split_qkv_per_head: bool = False,
    split_gate_up: bool = False,
    chunk: int = 0,
    expert_tp_size: int = 1,
    num_local_experts: int = 0,
) -> list[ParamSpec]:
    """Planner descriptions of a live (TP-sharded) model chunk, in registration order.

    Expert-parallel parameters (:func:`is_expert_param`) are sharded over the expert TP
    group (``expert_tp_size``), every other one over the TP group; a legacy ``GroupedMLP``
    stacked weight holds ``num_local_experts`` matrices, each optimized on its own."""
    specs, last = [], len(named_params) - 1
    for k, (name, p) in enumerate(named_params):
        expert = is_expert_param(p)
        group_size = expert_tp_size if expert else tp_size
        sharded = getattr(p, "tensor_model_parallel", False) and group_size > 1
        tp_dim = getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None
        shape = list(p.shape)
        if sharded and tp_dim is not None:
            shape[tp_dim] *= group_size
        fused = _fused_kind(name, gated_linear_unit)
        blocks: tuple[tuple[int, int], ...] = ()
        if fused == "qkv" and (split_qkv or split_qkv_per_head):
            if None in (num_attention_heads, num_query_groups, kv_channels):
                raise ValueError("splitting QKV needs num_attention_heads, num_query_groups and kv_channels")
            blocks = qkv_blocks(num_attention_heads, num_query_groups, kv_channels, shape[1],
                                per_head=split_qkv_per_head)
        elif fused == "gate_up" and split_gate_up:
            blocks = ((shape[0] // 2, shape[1]), (shape[0] // 2, shape[1]))
        elif fused == "experts":
            blocks = stacked_expert_blocks(name, tuple(shape), num_local_experts)
        specs.append(ParamSpec(
            name=name, global_shape=tuple(shape), tp_dim=tp_dim, tp_size=group_size if sharded else 1,
            dtype=str(p.dtype).removeprefix("torch."), family="matrix" if is_matrix_param(name, p) else "elementwise",
            is_expert=expert, order=last - k, blocks=blocks, fused=fused, chunk=chunk,
        ))
    return specs


def stacked_expert_blocks(name: str, shape: tuple[int, ...], num_local_experts: int) -> tuple[tuple[int, int], ...]:
    """The per-expert matrices of a ``GroupedMLP`` stacked weight: ``weight1`` of shape
    ``(h, E * fc1)`` is E contiguous ``(h, fc1)`` matrices, ``weight2`` of shape
    ``(E * fc2, h)`` is E contiguous ``(fc2, h)`` ones (the views its forward takes)."""
    if num_local_experts < 1:
        raise ValueError(f"{name}: a stacked expert weight needs the number of local experts")
    rows, cols = shape
    if name.endswith("weight1"):
        return ((rows, cols // num_local_experts),) * num_local_experts
    return ((rows // num_local_experts, cols),) * num_local_experts


def plan_bucket_size(ddp_config: Any, dp_size: int) -> int:
    """The bucket size DDP would use: the configured one, Megatron's default when gradient
    reduction overlaps backward, else a single bucket."""
    if ddp_config.bucket_size is not None:
        return int(ddp_config.bucket_size)
    return default_bucket_size(dp_size) if ddp_config.overlap_grad_reduce else SINGLE_BUCKET


def wire_config(named_params: NamedParams, ddp_config: Any) -> WireConfig:
    """Bytes per element of this run's collectives: parameters in their dtype, gradients in
    fp32 with ``grad_reduce_in_fp32`` else in the parameters' dtype."""
    param_bytes = max((p.element_size() for _, p in named_params), default=2)
    return WireConfig(param_bytes=param_bytes, grad_bytes=4 if ddp_config.grad_reduce_in_fp32 else param_bytes)


DEFAULT_CLUSTERS = {True: "h100-ib400", False: "cpu-gloo-local"}
"""The cluster ``--canzona-layout auto`` projects on without ``--canzona-cluster``: on CUDA
the H100 preset, on CPU this machine's gloo probe (``tools/probe_gloo.py``)."""


def local_world_size() -> int | None:
    """Processes on this node, as the launcher says (``LOCAL_WORLD_SIZE``: torchrun, our
    launcher and the SLURM scripts set it); ``None`` when unknown."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def node_note(tp_size: int, ep_size: int = 1, expert_tp_size: int = 1) -> str | None:
    """A warning when a tensor-parallel group spans nodes: a matrix's host is a TP rank of its
    DP owner, so its gathers stay on NVLink only while every TP group lies in one node
    (Megatron orders ranks TP fastest, so TP size dividing the node size is enough)."""
    node = local_world_size()
    if node is None:
        return None
    for name, size in (("--tensor-model-parallel-size", tp_size), ("--expert-tensor-parallel-size", expert_tp_size)):
        if size > 1 and node % size:
            return (f"[canzona] warning: {name} {size} does not divide the {node} processes of a node "
                    f"(LOCAL_WORLD_SIZE): host-group gathers cross the inter-node network; choose a TP size "
                    f"that divides the GPUs per node")
    return None


def build_canzona_plan(
    model_chunks: Sequence[torch.nn.Module], ddp_config: Any, cfg: Any, *, dp_size: int, tp_size: int,
    ep_size: int = 1, expert_tp_size: int = 1, workload: Workload | None = None, cuda: bool | None = None,
) -> tuple[CanzonaPlan, list[ParamSpec], str | None]:
    """The plan of this pipeline stage (every model chunk together), the specs it was made
    from, and, for ``cfg.layout == "auto"`` (under Megatron-FSDP: for its micro-groups projected,
    :func:`fsdp_group_budget`), the log line of the choice. ``cfg`` is a
    ``megatron.canzona.runtime.config.CanzonaConfig``; parameters are tagged for buffer
    routing (:func:`tag_params_for_buffers`) as a side effect. With expert parallelism
    (``ep_size`` > 1) the expert buffers are planned over the expert-data-parallel group
    (``plan.experts``), balanced together with the dense work of the same ranks.

    ``auto`` plans every layout and keeps the one whose iteration (``workload``: the run's
    batch; without it the step and its exposed bucket collectives) is projected shorter on
    ``cfg.cluster`` (:data:`DEFAULT_CLUSTERS`), with early compute where the run computes early
    and the reduce order it will take."""
    if not ddp_config.use_distributed_optimizer:
        raise ValueError("--canzona needs the distributed optimizer: pass --use-distributed-optimizer")
    specs: list[ParamSpec] = []
    named_all: list[tuple[str, torch.nn.Parameter]] = []
    for index, chunk in enumerate(model_chunks):
        named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
        tc = chunk.config
        chunk_specs = specs_from_model(
            named, tp_size=tp_size, num_attention_heads=tc.num_attention_heads,
            num_query_groups=tc.num_query_groups or tc.num_attention_heads, kv_channels=tc.kv_channels,
            gated_linear_unit=tc.gated_linear_unit, split_qkv=cfg.split_qkv,
            split_qkv_per_head=cfg.split_qkv_per_head, split_gate_up=cfg.split_gate_up, chunk=index, expert_tp_size=expert_tp_size,
            num_local_experts=(getattr(tc, "num_moe_experts", None) or 0) // ep_size,
        )
        tag_params_for_buffers(named, chunk_specs)
        specs += chunk_specs
        named_all += named
    wire = wire_config(named_all, ddp_config)
    cost_model = cfg.cost_model()
    instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1)  # the plan is one instance's
    # Megatron's default buckets grow with the whole DP group, every instance's ranks (as the tools plan them)
    bucket_size = plan_bucket_size(ddp_config, dp_size * instances)
    # Under Megatron-FSDP the hosts keep the optimizer's state, so the plan balances it too
    # (tools/plan.py --fsdp-cases plans with the same state layout).
    fsdp = {"fsdp_strategy": ddp_config.data_parallel_sharding_strategy, "fsdp_bucket_size": ddp_config.bucket_size,
            "state": StateLayout.of(cfg.optimizer, cfg.matrix)}
    layouts = (FSDP_LAYOUT,) if uses_megatron_fsdp(ddp_config) else LAYOUTS if cfg.layout == "auto" else (cfg.layout,)
    budget, line = cfg.tp_group_budget, None
    if uses_megatron_fsdp(ddp_config):
        budget, line = fsdp_group_budget(specs, cfg, ddp_config, wire=wire, dp_size=dp_size, tp_size=tp_size,
                                         ep_size=ep_size, expert_tp_size=expert_tp_size, workload=workload, cuda=cuda)
    plans = {
        layout: make_plan(
            specs, dp_size=dp_size, tp_size=tp_size, cost_model=cost_model, alpha=cfg.alpha,
            bucket_size=bucket_size, tp_budget=budget, wire=wire,
            ep_size=ep_size, expert_tp_size=expert_tp_size, layout=layout, **fsdp,
            tp_together=cfg.tp_together if layout == FSDP_LAYOUT else "off",
            narrow_gathers=cfg.narrow_gathers and layout == FSDP_LAYOUT,
        )
        for layout in layouts
    }
    if len(plans) == 1:
        return next(iter(plans.values())), specs, line
    cluster = projection_cluster(cfg, dp_size * tp_size * instances)
    results = project_layouts(specs, plans, cluster=cluster, optimizer=cfg.optimizer, wire=wire, workload=workload,
                              ns_method=cost_model.ns_method, instances=instances,
                              early_compute=early_compute_on(cfg, dp_size, ddp_config.overlap_grad_reduce),
                              early_compute_bytes=cfg.early_compute_bytes,
                              matrices_first=matrices_first_setting(cfg, workload, ddp_config.overlap_grad_reduce, dp_size))
    choice = faster_layout(results)
    return plans[choice], specs, layout_line(choice, results, cluster, iteration=workload is not None)


def fsdp_group_budget(specs: Sequence[ParamSpec], cfg: Any, ddp_config: Any, *, wire: WireConfig, dp_size: int,
                      tp_size: int, ep_size: int, expert_tp_size: int,
                      workload: Workload | None, cuda: bool | None = None) -> tuple[float | None, str | None]:
    """The planner's micro-group budget under Megatron-FSDP (``--canzona-fsdp-micro-groups``) and,
    where ``auto`` projected it, the log line of the choice. ``auto`` projects where the early
    gathers ride FSDP's link (``cuda``: this process's CUDA by default; ``async``, early gathers on)
    with the run's batch and no ``--canzona-tp-group-budget``; elsewhere it takes the planner's
    groups."""
    if cfg.fsdp_micro_groups == "one":
        return ONE_GROUP_BUDGET, None
    cuda = torch.cuda.is_available() if cuda is None else cuda
    projected = (cfg.fsdp_micro_groups == "auto" and cfg.tp_group_budget is None and cfg.early_gather
                 and cfg.tp_mode == "async" and cuda and workload is not None)
    if not projected:
        return cfg.tp_group_budget, None
    strategy = ddp_config.data_parallel_sharding_strategy
    cost_model = cfg.cost_model()
    cluster = projection_cluster(cfg, dp_size * tp_size)
    results = project_fsdp_groups(
        specs, cluster=cluster, dp_size=dp_size, tp_size=tp_size, ep_size=ep_size, expert_tp_size=expert_tp_size,
        sharding=strategy, optimizer=cfg.optimizer, calibration=cost_model.calibration, workload=workload, wire=wire,
        bucket_size=ddp_config.bucket_size, alpha=cfg.alpha, ns_method=cost_model.ns_method,
        early_compute=early_compute_on(cfg, dp_size, reduces_in_backward(ddp_config)),
        early_compute_bytes=cfg.early_compute_bytes, tp_together=cfg.tp_together, narrow_gathers=cfg.narrow_gathers)
    choice = faster_fsdp_groups(results)
    return (ONE_GROUP_BUDGET if choice == "one" else None), fsdp_groups_line(choice, results, cluster)


def reduces_in_backward(ddp_config: Any) -> bool:
    """Whether gradients are reduced while backward runs, leaving a tail for early compute:
    ``--overlap-grad-reduce``, or Megatron-FSDP reduce-scattering sharded gradients (``optim_grads``,
    ``optim_grads_params``)."""
    sharded = ddp_config.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")
    return bool(ddp_config.overlap_grad_reduce or (uses_megatron_fsdp(ddp_config) and sharded))


def uses_megatron_fsdp(ddp_config: Any) -> bool:
    """Whether the chunks are wrapped by Megatron-FSDP (``--use-megatron-fsdp``): the plan then
    takes its buckets and shards as they are (:data:`~megatron.canzona.planning.fsdp.FSDP_LAYOUT`)."""
    return bool(getattr(ddp_config, "use_megatron_fsdp", False))


def projection_cluster(cfg: Any, world: int) -> Any:
    """The cluster the run's choices are projected on: ``cfg.cluster``, else the default preset
    (h100-ib400 on CUDA, the gloo probe on CPU) with the launcher's node size (on CPU, ``world``:
    one machine)."""
    cluster = load_cluster(cfg.cluster or DEFAULT_CLUSTERS[torch.cuda.is_available()])
    if cfg.cluster is None:  # the preset's node size is a guess; the launcher's is the run's
        node = local_world_size() or (None if torch.cuda.is_available() else world)
        if node is not None:
            cluster = dataclasses.replace(cluster, gpus_per_node=node)
    return cluster


def early_compute_choice(cfg: Any, dp_size: int, overlap: bool) -> EarlyComputeDecision:
    """Whether an optimizer reduced over ``dp_size`` ranks (data parallel times context parallel,
    or the expert-data-parallel group) computes micro-groups early, and why
    (:func:`~megatron.canzona.planning.speculation.early_compute_decision`; ``overlap``:
    ``--overlap-grad-reduce``)."""
    return early_compute_decision(cfg.early_compute, dp_size=dp_size, overlap=overlap, early_gather=cfg.early_gather,
                                  cuda=torch.cuda.is_available(), async_mode=cfg.tp_mode == "async")


def early_compute_on(cfg: Any, dp_size: int, overlap: bool) -> bool:
    """Whether the dense optimizer computes micro-groups early (:func:`early_compute_choice`)."""
    return early_compute_choice(cfg, dp_size, overlap).on


def early_compute_line(cfg: Any, dp_size: int, overlap: bool, expert_dp_size: int | None = None) -> str:
    """The start-up line of the early-compute choice (the experts' too, where they differ)."""
    dense = early_compute_choice(cfg, dp_size, overlap)
    line = f"[canzona] early compute: {dense.line()}"
    if expert_dp_size is not None:
        experts = early_compute_choice(cfg, expert_dp_size, overlap)
        if experts.on != dense.on:
            line += f"; experts: {experts.line()}"
    return line


def matrices_first_setting(cfg: Any, workload: Workload | None, overlap: bool, dp_size: int) -> bool | None:
    """``--canzona-matrices-reduce-first`` as the run takes it, ``None`` where it is projected:
    off without early compute or without reduce-scatters overlapping backward (``overlap``:
    ``--overlap-grad-reduce``; nothing to reorder), as given, and by default off without the
    run's batch (nothing to project the tail of)."""
    if not (early_compute_on(cfg, dp_size, overlap) and overlap):
        return False
    if cfg.matrices_first is not None:
        return cfg.matrices_first
    return None if workload is not None else False


def choose_matrices_first(plan: CanzonaPlan, specs: Sequence[ParamSpec], cfg: Any, *, wire: WireConfig,
                          workload: Workload | None, overlap: bool = True,
                          instances: int = 1) -> tuple[bool, str | None]:
    """``--canzona-matrices-reduce-first`` as the run takes it (:func:`matrices_first_setting`),
    and, where its default was projected, the log line of the choice."""
    setting = matrices_first_setting(cfg, workload, overlap, plan.dp_size)
    if setting is not None:
        return setting, None
    cluster = projection_cluster(cfg, plan.dp_size * plan.tp_size * instances)
    results = project_reduce_orders(specs, plan, cluster=cluster, optimizer=cfg.optimizer, wire=wire,
                                    workload=workload, ns_method=cfg.cost_model().ns_method,
                                    early_compute_bytes=cfg.early_compute_bytes, instances=instances)
    return reduce_order_line(results, cluster)


def full_param_layouts(plan: CanzonaPlan, model_chunks: Sequence[torch.nn.Module], ddp_config: Any) -> list[FullParamLayout]:
    """The ``FullParamLayout`` of each chunk, for ``DistributedDataParallel(full_param_layout=...)``:
    its dense buffers from ``plan.layouts``, its expert buffers from ``plan.experts.layouts``."""
    if len(plan.layouts) != len(model_chunks):
        raise ValueError(f"the plan has {len(plan.layouts)} chunk layouts for {len(model_chunks)} model chunks")
    experts = plan.experts.layouts if plan.experts is not None else [None] * len(model_chunks)
    if any(not b.uniform for p in (plan, plan.experts) if p is not None for dp in p.layouts for b in dp.matrix.buckets):
        registry.install_group(registry.UNEVEN)  # DDP's buckets run the planned, unequal shards
    return [
        to_full_param_layout(layout, [(n, p) for n, p in chunk.named_parameters() if p.requires_grad],
                             grad_reduce_in_fp32=ddp_config.grad_reduce_in_fp32, experts=expert_layout)
        for layout, expert_layout, chunk in zip(plan.layouts, experts, model_chunks)
    ]


def tag_params_for_buffers(named_params: NamedParams, specs: Sequence[ParamSpec]) -> None:
    """Route matrix parameters into their own DDP buffer (the one the Canzona plan lays out)."""
    family = {s.name: s.family for s in specs}
    for name, p in named_params:
        setattr(p, BUFFER_ROUTING_ATTR, family[name] == "matrix")


def to_full_param_layout(plan: DPPlan, named_params: NamedParams, *, grad_reduce_in_fp32: bool,
                         experts: DPPlan | None = None) -> FullParamLayout:
    """The plan as the ``FullParamLayout`` that ``DistributedDataParallel`` accepts: ``plan``
    lays out the dense buffers, ``experts`` (over the expert-DP group) the expert buffers.

    Parameters must already be tagged with :func:`tag_params_for_buffers`.
    """
    name_of = {p: n for n, p in named_params}
    groups = group_params_for_buffers([p for _, p in named_params], grad_reduce_in_fp32)
    seen: set[tuple[bool, bool]] = set()
    layouts = {}
    for key, (params, indices) in groups.items():
        matrix, expert = bool(key.is_managed_by_layer_wise_optimizer), bool(key.is_expert_parallel)
        if (matrix, expert) in seen:
            raise ValueError(
                "Canzona plans one matrix buffer and one elementwise buffer per model chunk (and per expert "
                f"group); this model needs more ({key}). Use a single parameter dtype with --canzona"
            )
        seen.add((matrix, expert))
        dp_plan = experts if expert else plan
        if dp_plan is None:
            raise ValueError("the model has expert-parallel parameters but the plan has no expert layout; "
                             "plan with the run's --expert-model-parallel-size")
        buffer = dp_plan.matrix if matrix else dp_plan.elementwise
        assert buffer is not None, f"plan has no {'matrix' if matrix else 'elementwise'} buffer for {key}"
        layouts[key] = _per_buffer(buffer, params, indices, name_of, dp_plan.dp_size)
    return FullParamLayout(layouts=layouts)


def _per_buffer(buffer: BufferPlan, params, indices, name_of, dp_size: int) -> PerBufferParamLayout:
    where = {p.name: p for p in buffer.placements}
    missing = [name_of[p] for p in params if name_of[p] not in where]
    if missing or len(params) != len(where):
        raise ValueError(f"plan and model disagree on parameters (missing from plan: {missing[:3]}); re-plan for this model")
    fields = dict(
        param_index_map={p: (where[name_of[p]].start, where[name_of[p]].end, where[name_of[p]].bucket) for p in params},
        bucket_indices=[(b.start, b.end) for b in buffer.buckets],
        per_bucket_numel_unpadded=[b.numel_unpadded for b in buffer.buckets],
        param_indices=list(indices),
        num_optimizer_shards=dp_size,
    )
    if all(b.uniform for b in buffer.buckets):
        return PerBufferParamLayout(**fields)
    bounds = [tuple(x - b.start for x in b.shard_bounds) for b in buffer.buckets]
    return ShardedParamLayout(**fields, shard_bounds=bounds)


def gather_in_forward_order(ddp: Any) -> None:
    """Chain DDP's overlapped parameter all-gathers in the order forward first uses their
    bucket groups.

    Megatron links each bucket group to the next one to prefetch (``next_param_gather_bucket_
    group``) in reverse bucket order over the chunk's buffers one after another. Canzona's plan
    gives the matrices a buffer of their own, so that order gathers every bucket of the
    elementwise buffer before the first matrix bucket, which the first layer needs at once: its
    all-gather is then issued late and waited for, and the chain warns that "the next bucket's
    parameter all-gather operation has already been dispatched". Ordered by the first parameter
    each group holds (registration order, which is forward order in a GPT), each all-gather is
    issued while the previous group's layers compute. Only the order changes: the same
    collectives, bitwise the same parameters, no cost in the step."""
    if not ddp.ddp_config.overlap_param_gather:
        return
    position = {param: index for index, param in enumerate(ddp.module.parameters())}
    for groups in (ddp.bucket_groups, ddp.expert_parallel_bucket_groups):
        chain = sorted(groups, key=lambda group: min(position[p] for b in group.buckets for p in b.params_list))
        for group, following in zip(chain, [*chain[1:], None]):
            group.next_param_gather_bucket_group = following
