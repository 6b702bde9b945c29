"""Canzona on Megatron-Core: the run's plan, its layouts, and the matrix optimizer.

Hooks (megatron-core 0.19.2):
* ``DistributedDataParallel(full_param_layout=...)`` receives the plan's layouts: stock
  equal shards, each matrix whole in one rank's shard or across shards; the stock
  reduce-scatter delivers the pieces, the host-group engine takes them to each matrix's
  host.
* ``megatron.core.optimizer._get_param_groups_and_buffers`` and
  ``get_standard_config_overrides`` build the same parameter groups (lr/wd multipliers)
  Megatron's own optimizers get.
* ``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer`` wraps the Canzona
  inner optimizer unchanged: fp32 main weights for bf16 parameters, gradient clipping by
  the global norm, and the stock parameter all-gather (overlapped when asked).
  :class:`CanzonaDistributedOptimizer` changes two things: it all-gathers the matrix buffer
  too (``DistributedOptimizer.start_param_sync_for_bucket_group_subset`` skips buffers tagged
  ``is_managed_by_layer_wise_optimizer``, the tag DDP's buffer grouping reads), and a step
  whose gradients hold inf or NaN is skipped also when no loss scaler would catch it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from canzona_patches.integration.arguments import CanzonaArgumentError, canzona_config_from_args, check_expert_sizes
from canzona_patches.integration.binding import bind_plan, group_coordinates
from canzona_patches.checkpoints.state import common_state, load_optimizer_state_dict, optimizer_sharded_state_dict
from canzona_patches.integration.early_gather import attach as attach_early_gathers
from canzona_patches.integration.layout import (
    BUFFER_ROUTING_ATTR,
    build_canzona_plan,
    full_param_layouts,
    is_expert_param,
    node_note,
    stacked_expert_blocks,
    wire_config,
)
from canzona_patches.integration.uneven import SHARD_BOUNDS_ATTR
from canzona_patches.version import require_pinned_megatron
from megatron.canzona.optim import ExpertStackLayout, GateUpLayout, QKVLayout
from megatron.canzona.planning import CanzonaPlan, CostModel, summarize_canzona
from megatron.canzona.planning.sim import Workload
from megatron.canzona.runtime.config import CanzonaConfig
from megatron.canzona.runtime.host_groups import HostGroupEngine
from megatron.canzona.runtime.optimizer import CanzonaOptimizer

require_pinned_megatron()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.optimizer import (  # noqa: E402
    _get_param_groups_and_buffers,
    get_standard_config_overrides,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range  # noqa: E402
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler  # noqa: E402
from megatron.core.optimizer.optimizer import ChainedOptimizer  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.utils import get_pg_rank  # noqa: E402

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- plan


def plan_and_layouts(
    model_chunks: list[torch.nn.Module], ddp_config: Any, cfg: CanzonaConfig, *, dp_size: int, tp_size: int,
    ep_size: int = 1,
) -> tuple[CanzonaPlan, list[Any]]:
    """The run's plan (:func:`canzona_patches.integration.layout.build_canzona_plan`), logged once per
    pipeline stage, and the ``FullParamLayout`` per (unwrapped) chunk that DDP must be built with."""
    plan, layouts, _ = _plan_layouts_summary(model_chunks, ddp_config, cfg, dp_size=dp_size, tp_size=tp_size,
                                             ep_size=ep_size)
    return plan, layouts


def _plan_layouts_summary(
    model_chunks: list[torch.nn.Module], ddp_config: Any, cfg: CanzonaConfig, *, dp_size: int, tp_size: int,
    ep_size: int = 1, summarize_here: bool = False, workload: Any = None,
) -> tuple[CanzonaPlan, list[Any], dict | None]:
    """:func:`plan_and_layouts` and the plan's summary (:func:`summarize_canzona`), computed on
    the first rank of each pipeline stage (DP and TP rank 0), which logs it, and where
    ``summarize_here`` asks for it (else ``None``)."""
    plan, specs, choice = build_canzona_plan(model_chunks, ddp_config, cfg, dp_size=dp_size, tp_size=tp_size,
                                             ep_size=ep_size, workload=workload)
    named = [(n, p) for chunk in model_chunks for n, p in chunk.named_parameters() if p.requires_grad]
    first, stage = _stage_first_rank()
    summary = None
    if first or summarize_here:
        summary = summarize_canzona(plan, specs, CostModel(kind=cfg.cost_kind), wire_config(named, ddp_config))
    if first:
        if choice is not None:
            print(choice if stage is None else choice.replace("[canzona]", f"[canzona] stage {stage}:"), flush=True)
        _log_plan(plan, summary, stage)
        note = node_note(tp_size, ep_size, plan.experts.tp_size if plan.experts is not None else 1)
        if note is not None:
            print(note, flush=True)
    return plan, full_param_layouts(plan, model_chunks, ddp_config), summary


def _stage_first_rank() -> tuple[bool, int | None]:
    """Whether this rank logs its pipeline stage's plan (DP and TP rank 0 of the stage), and
    the stage's index when there are several."""
    if not torch.distributed.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0), None
    first = (parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
             and parallel_state.get_tensor_model_parallel_rank() == 0)
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    return first, (parallel_state.get_pipeline_model_parallel_rank() if stages > 1 else None)


def _log_plan(plan: CanzonaPlan, s: dict, stage: int | None = None) -> None:
    """One line: layout, balance, padding, buckets, split matrices, bytes per rank."""
    prefix = "[canzona] plan:" if stage is None else f"[canzona] stage {stage} plan:"
    print(
        f"{prefix} {plan.layout} layout, {len(plan.hosts)} matrices over DP {plan.dp_size} x TP {plan.tp_size}, "
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
            f"x EP {plan.ep_size}, {experts['num_buckets']} bucket(s), {experts['split_params']} split | "
            f"makespan / lower bound {experts['makespan_over_lower_bound']:.3f} | padding "
            f"{100 * experts['padding_overhead']:.1f}% | dense + experts per rank "
            f"{s.get('combined_makespan_over_lower_bound', float('nan')):.3f}",
            flush=True,
        )


# --------------------------------------------------------------------------- optimizer


class CanzonaDistributedOptimizer(DistributedOptimizer):
    """Megatron's DistributedOptimizer owning every bucket, the matrix buffer included, and
    skipping steps with inf/NaN gradients when no loss scaler checks for them. A bucket of the
    whole layout (tagged by :mod:`canzona_patches.integration.uneven`) gives each rank its planned shard."""

    @classmethod
    def _build_model_gbuf_range(cls, param_and_grad_buffer: Any, bucket_index: int) -> dict:
        """This rank's parameter ranges in a bucket: its planned shard where the bucket has one."""
        bucket = param_and_grad_buffer.buckets[bucket_index]
        bounds = getattr(bucket, SHARD_BOUNDS_ATTR, None)
        if bounds is None:
            return super()._build_model_gbuf_range(param_and_grad_buffer, bucket_index)
        rank = param_and_grad_buffer.data_parallel_group.rank()
        shard = Range(bucket.offset + bounds[rank], bucket.offset + bounds[rank + 1])
        return {"param_map": cls._build_model_gbuf_param_range_map(param_and_grad_buffer.param_index_map, shard,
                                                                  bucket.offset)}

    def start_param_sync_for_bucket_group_subset(self) -> None:
        """All-gather every bucket group. Upstream skips groups tagged for the layer-wise
        optimizer; Canzona tags its matrix buffer only so DDP gives it a buffer of its own."""
        for chunk in self.model_chunks:
            for bucket_group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                if bucket_group.buckets:
                    chunk._start_bucket_group_param_sync(bucket_group, force_sync=False)

    early_gathers: Any = None
    """:class:`canzona_patches.integration.early_gather.EarlyGathers`: host-group gathers issued as buckets reduce."""
    _clip_factor: float | None = None

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        found_inf = super().prepare_grads()
        if self.grad_scaler is None:
            found_inf = self._nonfinite_grads()
            if found_inf:
                logger.warning("Canzona: skipping the optimizer step, a gradient holds inf or NaN")
        if found_inf and self.early_gathers is not None:
            self.early_gathers.drop()  # the staged gradients go before any state is touched
        self._clip_factor = None
        return found_inf

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Megatron's norm and clip; the factor it applied (its own expression on the same
        floats) is kept for the hosts, which apply it to gradients gathered before the step."""
        grad_norm = super().clip_grad_norm(clip_grad)
        factor = clip_grad / (grad_norm + 1.0e-6)
        self._clip_factor = factor if self.get_parameters() and factor < 1.0 else None
        return grad_norm

    def step_with_ready_grads(self) -> bool:
        """The step, its hosts scaling what was gathered early as the holders' gradients were:
        the loss scale's inverse, then the clip factor (Megatron's order)."""
        scale: list[Any] = []
        if self.grad_scaler is not None:
            scale.append(self.grad_scaler.inv_scale)
        if self._clip_factor is not None:
            scale.append(self._clip_factor)
        self.optimizer.gather_scale = tuple(scale)
        try:
            return super().step_with_ready_grads()
        finally:
            self.optimizer.gather_scale = ()
            if self.early_gathers is not None:
                self.early_gathers.stepped()

    # Checkpoints (canzona_patches/checkpoints/state.py): name-keyed global tensors, any DP/TP layout.
    def sharded_state_dict(self, model_sharded_state_dict: Any = None, is_loading: bool = False,
                           sharding_type: str | None = None, metadata: dict | None = None) -> dict:
        """Every Canzona optimizer state as name-keyed ``ShardedTensor``s (``sharding_type`` is
        ignored: this one format reshards across DP and TP)."""
        return optimizer_sharded_state_dict(self, is_loading=is_loading, metadata=metadata)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`sharded_state_dict` described, after ``dist_checkpointing.load``."""
        load_optimizer_state_dict(self, state_dict)

    def state_dict(self) -> dict:
        """The layout-independent part only; tensors go through :meth:`sharded_state_dict`."""
        return {"canzona": common_state(self)}

    def save_parameter_state(self, filename: str) -> None:
        raise CanzonaArgumentError("--canzona checkpoints need --ckpt-format torch_dist (the default)")

    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False) -> None:
        raise CanzonaArgumentError("--canzona checkpoints need --ckpt-format torch_dist (the default)")

    def _nonfinite_grads(self) -> bool:
        """Whether a gradient on any rank holds inf or NaN. One fused norm per rank on the
        gradients' device, one all-reduce, one host read per step, whatever the number of
        parameters (an inf or NaN element makes its tensor's norm non-finite)."""
        return _any_rank(self._local_nonfinite_flag(), self.get_grad_stats_parallel_group())

    def _local_nonfinite_flag(self) -> torch.Tensor:
        """1.0 where one of this rank's gradients holds inf or NaN, else 0.0 (on the device)."""
        grads = [] if self.is_stub_optimizer else self._collect_main_grad_data_for_unscaling()
        if not grads:
            return torch.zeros(1, device=_collective_device())
        norms = torch.stack(torch._foreach_norm(grads))
        return (~torch.isfinite(norms).all()).to(torch.float32).reshape(1)


def _any_rank(flag: torch.Tensor, group: Any) -> bool:
    """Whether ``flag`` is set on any rank of ``group``: one all-reduce, one host read."""
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


class CanzonaChainedOptimizer(ChainedOptimizer):
    """The dense and the expert Canzona optimizers of an expert-parallel run, stepped as
    Megatron chains its own, checkpointed as one: a single name-keyed state (experts by
    global index), the same as at EP 1, where experts are dense parameters of one optimizer."""

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Both optimizers' gradients, with one inf/NaN check for the two when no loss scaler
        checks (the dense and expert flags max-reduced together: one host read per step)."""
        found_inf = False
        flags = []
        for part in self.chained_optimizers:
            found_inf |= DistributedOptimizer.prepare_grads(part)
            if part.grad_scaler is None:
                flags.append(part._local_nonfinite_flag())
        if flags:
            group = self.chained_optimizers[0].get_grad_stats_parallel_group()
            if _any_rank(torch.stack(flags).amax().reshape(1), group):
                logger.warning("Canzona: skipping the optimizer step, a gradient holds inf or NaN")
                found_inf = True
        for part in self.chained_optimizers:
            part._clip_factor = None
            if found_inf and part.early_gathers is not None:
                part.early_gathers.drop()  # the staged gradients go before any state is touched
        return found_inf

    def get_grad_norm(self) -> float:
        """The joint norm Megatron clips both optimizers by; each keeps the factor it applies
        (Megatron's expression on the same floats) for its hosts, which apply it to the
        gradients gathered before the step."""
        grad_norm = super().get_grad_norm()
        for part in self.chained_optimizers:
            clip = part.config.clip_grad
            factor = clip / (grad_norm + 1.0e-6) if clip > 0.0 else 1.0
            part._clip_factor = factor if part.get_parameters() and factor < 1.0 else None
        return grad_norm

    def sharded_state_dict(self, model_sharded_state_dict: Any = None, is_loading: bool = False,
                           sharding_type: str | None = None, metadata: dict | None = None) -> dict:
        """One :func:`optimizer_sharded_state_dict` over both optimizers (no ``chained_i.``
        prefixes: keys must not depend on how many optimizers a layout has)."""
        return optimizer_sharded_state_dict(self, is_loading=is_loading, metadata=metadata)

    def load_state_dict(self, state_dict: dict) -> None:
        load_optimizer_state_dict(self, state_dict)

    def state_dict(self) -> dict:
        return {"canzona": common_state(self)}


def _collective_device() -> torch.device:
    """Where a rank's small collective tensors live: its CUDA device (NCCL) or the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _fused_layout(name: str, module: torch.nn.Module, cfg: CanzonaConfig):
    """How a full (TP-global) fused weight splits into the matrices optimized separately."""
    tc = module.config
    groups = tc.num_query_groups or tc.num_attention_heads
    if cfg.split_qkv and name.endswith("linear_qkv.weight"):
        return QKVLayout(num_query_groups=groups, heads_per_group=tc.num_attention_heads // groups, head_dim=tc.kv_channels)
    if cfg.split_gate_up and tc.gated_linear_unit and name.endswith("linear_fc1.weight"):
        return GateUpLayout(num_partitions=1)
    if name.endswith(("experts.weight1", "experts.weight2")):  # legacy GroupedMLP: one matrix per expert
        shape = tuple(module.get_parameter(name).shape)
        num_local = tc.num_moe_experts // tc.expert_model_parallel_size
        blocks = stacked_expert_blocks(name, shape, num_local)
        return ExpertStackLayout(num_experts=num_local, expert_shape=blocks[0], shape=shape)
    return None


def _route_groups(groups: list[dict], weight_decay: float) -> list[dict]:
    """Split each Megatron param group into a matrix group and an elementwise group; every
    rank makes the same groups, as checkpoints require.

    Each group starts with the weight decay Megatron's scheduler would give it
    (``weight_decay * wd_mult``: none for norms and biases), so the first step is right
    also when no ``OptimizerParamScheduler`` drives the optimizer."""
    routed = []
    for group in groups:
        for matrix in (True, False):
            params = [p for p in group["params"] if bool(getattr(p, BUFFER_ROUTING_ATTR)) == matrix]
            if params:
                routed.append({**group, "params": params, "matrix": matrix,
                               "weight_decay": weight_decay * group.get("wd_mult", 1.0)})
    return routed


def _grad_scaler(config: Any):
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale, growth_factor=2.0,
            backoff_factor=0.5, growth_interval=config.loss_scale_window, hysteresis=config.hysteresis,
        )
    return None


def build_canzona_optimizer(
    optimizer_config: Any, model_chunks: list, cfg: CanzonaConfig, plan: CanzonaPlan, *,
    host_ranks: dict[tuple[int, int], int] | None = None,
):
    """The Canzona optimizer for DDP-wrapped chunks laid out by ``plan``'s layouts.

    Megatron's DistributedOptimizer wraps one :class:`CanzonaOptimizer` (the matrix
    optimizer's math plus a host-group engine over the tensor-and-data-parallel group).
    ``host_ranks`` maps (DP rank, TP rank) to the rank in that group; by default the ranks
    tell each other (a collective).

    With expert parallelism, as in Megatron, a second one over the expert buffers and the
    expert-data-parallel group (its host group; expert TP must be 1) is chained after it
    (:class:`CanzonaChainedOptimizer`)."""
    if not optimizer_config.use_distributed_optimizer:
        raise ValueError("--canzona needs the distributed optimizer: pass --use-distributed-optimizer")
    experts = [n for chunk in model_chunks for n, p in chunk.named_parameters() if is_expert_param(p)]
    if experts and plan.experts is None:
        raise ValueError(
            f"the model has expert-parallel parameters ({experts[0]} and {len(experts) - 1} more) but the Canzona "
            "plan has no expert layout: plan with the run's --expert-model-parallel-size")
    pgs = ProcessGroupCollection.setup_process_groups_for_optimizer(None, model_chunks, True)
    dense_tp = ProcessGroupCollection.use_mpu_process_groups().tp
    coord = (get_pg_rank(pgs["dp_cp_group"]), get_pg_rank(dense_tp))
    host_group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    dense = _canzona_dist_optimizer(
        optimizer_config, model_chunks, cfg, plan, expert=False, dp_group=pgs["dp_cp_group"],
        dp_group_gloo=pgs["intra_dp_cp_group_gloo"], dp_group_idx=get_pg_rank(pgs["mp_group"]), tp_group=dense_tp,
        host_group=host_group, coord=coord,
        rank_of=host_ranks if host_ranks is not None else group_coordinates(host_group, coord),
    )
    dense.grad_stats_parallel_group = pgs["intra_dist_opt_group"]
    if cfg.early_gather:
        dense.early_gathers = attach_early_gathers(dense, model_chunks)
    if not experts:
        return dense
    check_expert_sizes(plan.tp_size, plan.ep_size, parallel_state.get_expert_tensor_parallel_world_size())
    edp_group = pgs["intra_expt_dp_group"]
    edp_rank, edp_size = get_pg_rank(edp_group), plan.experts.dp_size
    expert = _canzona_dist_optimizer(
        optimizer_config, model_chunks, cfg, plan.experts, expert=True, dp_group=edp_group,
        dp_group_gloo=pgs["intra_expt_dp_group_gloo"], dp_group_idx=get_pg_rank(pgs["expt_tp_pp_group"]),
        tp_group=parallel_state.get_expert_tensor_parallel_group(), host_group=edp_group, coord=(edp_rank, 0),
        # Expert TP 1: a host (expert-DP rank, 0) is that rank of the expert-DP group.
        rank_of={(d, 0): d for d in range(edp_size)},
    )
    expert.grad_stats_parallel_group = pgs["intra_dist_opt_group"]
    if cfg.early_gather:  # the chained optimizer gives both the joint clip factor (get_grad_norm)
        expert.early_gathers = attach_early_gathers(expert, model_chunks)
    return CanzonaChainedOptimizer([dense, expert])


def _canzona_dist_optimizer(
    optimizer_config: Any, model_chunks: list, cfg: CanzonaConfig, plan: CanzonaPlan, *, expert: bool,
    dp_group: Any, dp_group_gloo: Any, dp_group_idx: int, tp_group: Any, host_group: Any, coord: tuple[int, int],
    rank_of: dict[tuple[int, int], int],
) -> CanzonaDistributedOptimizer:
    """One DistributedOptimizer around a :class:`CanzonaOptimizer`: the dense buffers over the
    data-parallel group, or (``expert``) the expert buffers over the expert-data-parallel one."""
    groups, buffers = _get_param_groups_and_buffers(
        model_chunks, model_chunk_offset=0, config=optimizer_config,
        config_overrides=get_standard_config_overrides(optimizer_config),
        filter_fn=lambda g: g["is_expert_parallel"] == expert,
        buffer_name="expert_parallel_buffers" if expert else "buffers",
    )
    inner = CanzonaOptimizer(
        _route_groups(groups, optimizer_config.weight_decay), math=cfg.optimizer, lr=optimizer_config.lr,
        weight_decay=optimizer_config.weight_decay, config=cfg.matrix, adamw_config=cfg.adamw,
    )
    optimizer = CanzonaDistributedOptimizer(
        inner, optimizer_config, _grad_scaler(optimizer_config), lambda opt, config=None: opt.init_state(),
        model_chunks=model_chunks, per_model_buffers=buffers, data_parallel_group=dp_group,
        data_parallel_group_gloo=dp_group_gloo, data_parallel_group_idx=dp_group_idx,
        distributed_optimizer_instance_id=0,
    )
    optimizer.tp_group = tp_group
    binding = bind_plan(plan, optimizer, model_chunks, coord=coord,
                        full_layout=lambda name, module: _fused_layout(name, module, cfg))
    engine = HostGroupEngine(binding.tasks, group=host_group, rank_of=rank_of, coord=coord, tp_size=plan.tp_size,
                             mode=cfg.tp_mode)
    inner.bind(binding.pieces, engine, binding.layouts, binding.names, binding.parts)
    optimizer.canzona_binding = binding
    return optimizer


# --------------------------------------------------------------------------- training entry points


def _parallel_sizes() -> tuple[int, int, int]:
    """DP (with context parallelism), TP and EP sizes of this run."""
    return (parallel_state.get_data_parallel_world_size(with_context_parallel=True),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size())


def canzona_plan_and_layouts(
    model_chunks: list[torch.nn.Module], ddp_config: Any, args: Any, *, summarize_here: bool = False,
) -> tuple[CanzonaPlan, list[Any], dict | None]:
    """:func:`plan_and_layouts` configured from ``pretrain_gpt.py``'s flags, with the plan's
    summary where it is logged (rank 0) or ``summarize_here`` asks for it."""
    dp_size, tp_size, ep_size = _parallel_sizes()
    if args.num_experts:
        check_expert_sizes(tp_size, ep_size, parallel_state.get_expert_tensor_parallel_world_size())
    workload = Workload(global_batch=args.global_batch_size, micro_batch=args.micro_batch_size,
                        seq_length=args.seq_length)
    return _plan_layouts_summary(model_chunks, ddp_config, canzona_config_from_args(args), dp_size=dp_size,
                                 tp_size=tp_size, ep_size=ep_size, summarize_here=summarize_here, workload=workload)


def get_canzona_optimizer(optimizer_config: Any, model_chunks: list, args: Any, plan: CanzonaPlan):
    """:func:`build_canzona_optimizer` configured from ``pretrain_gpt.py``'s flags."""
    return build_canzona_optimizer(optimizer_config, model_chunks, canzona_config_from_args(args), plan)
