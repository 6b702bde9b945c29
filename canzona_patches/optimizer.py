"""Canzona on Megatron-Core's data parallelism: planned layouts and the matrix optimizer.

Hooks (megatron-core 0.19.2):
* ``DistributedDataParallel(full_param_layout=...)`` receives the α-balanced plan, so the
  stock reduce-scatter delivers every matrix gradient whole to the one rank that owns it.
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

from canzona_patches.arguments import CanzonaArgumentError
from canzona_patches.layout import (
    BUFFER_ROUTING_ATTR,
    specs_from_model,
    tag_params_for_buffers,
    to_full_param_layout,
)
from canzona_patches.tensor_parallel import bind_tensor_parallel
from canzona_patches.version import require_pinned_megatron
from megatron.canzona.optim import GateUpLayout, QKVLayout
from megatron.canzona.planning import CanzonaPlan, CostModel, ParamSpec, make_plan
from megatron.canzona.planning.geometry import default_bucket_size
from megatron.canzona.planning.metrics import (
    lower_bound,
    makespan_over_lower_bound,
    padding_overhead,
    tp_summary,
)
from megatron.canzona.runtime.config import CanzonaConfig
from megatron.canzona.runtime.sharded import SHARDED_OPTIMIZERS, MatrixInfo, init_state_fn
from megatron.canzona.runtime.tp_sharded import TP_SHARDED_OPTIMIZERS

require_pinned_megatron()

from megatron.core.optimizer import (  # noqa: E402
    _get_param_groups_and_buffers,
    get_standard_config_overrides,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.utils import get_pg_rank  # noqa: E402

logger = logging.getLogger(__name__)

SINGLE_BUCKET = 2**62
"""Bucket size meaning "one bucket" (Megatron's ``bucket_size=None`` without overlap)."""


# --------------------------------------------------------------------------- layouts


def plan_bucket_size(ddp_config: Any, dp_size: int) -> int:
    """The bucket size DDP would use: the configured one, Megatron's default when gradient
    reduction overlaps backward, else a single bucket."""
    if ddp_config.bucket_size is not None:
        return int(ddp_config.bucket_size)
    return default_bucket_size(dp_size) if ddp_config.overlap_grad_reduce else SINGLE_BUCKET


def check_bucket_size(specs: list[ParamSpec], bucket_size: int) -> None:
    """Every matrix must fit whole in one rank's shard of one bucket."""
    largest = max((s for s in specs if s.family == "matrix"), key=lambda s: s.numel, default=None)
    if largest is not None and bucket_size < largest.numel:
        raise CanzonaArgumentError(
            f"--ddp-bucket-size {bucket_size} is smaller than the largest matrix {largest.name} "
            f"({largest.numel} elements); --canzona keeps matrices whole, so pass --ddp-bucket-size "
            f">= {largest.numel} or leave it unset"
        )


def model_specs(chunk: torch.nn.Module, cfg: CanzonaConfig, tp_size: int) -> list[ParamSpec]:
    """Planner descriptions of one (unwrapped) model chunk's trainable parameters."""
    tc = chunk.config
    named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
    return specs_from_model(
        named, tp_size=tp_size, num_attention_heads=tc.num_attention_heads,
        num_query_groups=tc.num_query_groups or tc.num_attention_heads, kv_channels=tc.kv_channels,
        gated_linear_unit=tc.gated_linear_unit, split_qkv=cfg.split_qkv, split_gate_up=cfg.split_gate_up,
    )


def build_full_param_layouts(
    model_chunks: list[torch.nn.Module], ddp_config: Any, cfg: CanzonaConfig, *, dp_size: int, tp_size: int
) -> list[Any]:
    """Plan each (unwrapped) chunk, tag its parameters into the matrix buffer, and return
    the ``FullParamLayout`` per chunk. The plan is kept on the chunk as ``canzona_plan``."""
    if not ddp_config.use_distributed_optimizer:
        raise ValueError("--canzona needs the distributed optimizer: pass --use-distributed-optimizer")
    bucket_size = plan_bucket_size(ddp_config, dp_size)
    layouts = []
    for chunk in model_chunks:
        specs = model_specs(chunk, cfg, tp_size)
        check_bucket_size(specs, bucket_size)
        plan = make_plan(
            specs, dp_size=dp_size, tp_size=tp_size, cost_model=CostModel(kind=cfg.cost_kind),
            alpha=cfg.alpha, bucket_size=bucket_size, tp_budget=cfg.tp_group_budget,
        )
        named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
        tag_params_for_buffers(named, specs)
        layouts.append(to_full_param_layout(plan.dp, named, grad_reduce_in_fp32=ddp_config.grad_reduce_in_fp32))
        chunk.canzona_plan = plan
        _log_plan(plan, specs, CostModel(kind=cfg.cost_kind), dp_size * tp_size)
    return layouts


def _log_plan(plan: CanzonaPlan, specs: list[ParamSpec], cost_model: CostModel, num_ranks: int) -> None:
    """One line on global rank 0: how well the plan balances the optimizer's work."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    dp = plan.dp
    bound = lower_bound(specs, cost_model, dp.dp_size)
    line = (
        f"[canzona] plan: {len(dp.matrix.placements)} matrices over DP {dp.dp_size}, "
        f"{len(dp.matrix.buckets)} bucket(s), alpha {dp.alpha}, cost {dp.cost_kind} | "
        f"makespan / lower bound {makespan_over_lower_bound(dp, bound):.3f} | "
        f"padding {100 * padding_overhead(dp):.1f}%"
    )
    if plan.tp and plan.tp[0].tp_size > 1:
        line += f" | DP x TP makespan / lower bound {tp_summary(plan)['dp_x_tp_makespan_over_lower_bound']:.3f}"
    print(line, flush=True)


# --------------------------------------------------------------------------- optimizer


class CanzonaDistributedOptimizer(DistributedOptimizer):
    """Megatron's DistributedOptimizer owning every bucket, the matrix buffer included, and
    skipping steps with inf/NaN gradients when no loss scaler checks for them."""

    def start_param_sync_for_bucket_group_subset(self) -> None:
        """All-gather every bucket group. Upstream skips groups tagged for the layer-wise
        optimizer; Canzona tags its matrix buffer only so DDP gives it a buffer of its own."""
        for chunk in self.model_chunks:
            for bucket_group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                if bucket_group.buckets:
                    chunk._start_bucket_group_param_sync(bucket_group, force_sync=False)

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        found_inf = super().prepare_grads()
        if self.grad_scaler is None:
            found_inf = self._nonfinite_grads()
            if found_inf:
                logger.warning("Canzona: skipping the optimizer step, a gradient holds inf or NaN")
        return found_inf

    # Checkpoints (canzona_patches/checkpoint.py): name-keyed global tensors, any DP/TP layout.
    def sharded_state_dict(self, model_sharded_state_dict: Any = None, is_loading: bool = False,
                           sharding_type: str | None = None, metadata: dict | None = None) -> dict:
        """Every Canzona optimizer state as name-keyed ``ShardedTensor``s (``sharding_type`` is
        ignored: this one format reshards across DP and TP)."""
        from canzona_patches.checkpoint import optimizer_sharded_state_dict

        return optimizer_sharded_state_dict(self, is_loading=is_loading, metadata=metadata)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`sharded_state_dict` described, after ``dist_checkpointing.load``."""
        from canzona_patches.checkpoint import load_optimizer_state_dict

        load_optimizer_state_dict(self, state_dict)

    def state_dict(self) -> dict:
        """The layout-independent part only; tensors go through :meth:`sharded_state_dict`."""
        from canzona_patches.checkpoint import common_state

        return {"canzona": common_state(self)}

    def save_parameter_state(self, filename: str) -> None:
        raise CanzonaArgumentError("--canzona checkpoints need --ckpt-format torch_dist (the default)")

    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False) -> None:
        raise CanzonaArgumentError("--canzona checkpoints need --ckpt-format torch_dist (the default)")

    def _nonfinite_grads(self) -> bool:
        grads = [] if self.is_stub_optimizer else self._collect_main_grad_data_for_unscaling()
        device = grads[0].device if grads else torch.device("cpu")
        flag = torch.zeros(1, device=device)
        for g in grads:
            if not torch.isfinite(g).all():
                flag.fill_(1.0)
                break
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.get_grad_stats_parallel_group())
        return bool(flag.item() > 0)


def _fused_layout(name: str, chunk: torch.nn.Module, cfg: CanzonaConfig, tp_size: int):
    """How a fused local weight splits into the matrices the optimizer treats separately."""
    tc = chunk.config
    groups = tc.num_query_groups or tc.num_attention_heads
    if cfg.split_qkv and name.endswith("linear_qkv.weight"):
        return QKVLayout(num_query_groups=groups // tp_size, heads_per_group=tc.num_attention_heads // groups, head_dim=tc.kv_channels)
    if cfg.split_gate_up and tc.gated_linear_unit and name.endswith("linear_fc1.weight"):
        return GateUpLayout(num_partitions=1)
    return None


def _route_groups(
    groups: list[dict], model_chunks: list, cfg: CanzonaConfig, tp_size: int, weight_decay: float
) -> list[dict]:
    """Split each Megatron param group into matrix groups (one per fused layout) and an
    elementwise group; every rank makes the same groups, as checkpoints require.

    Each group starts with the weight decay Megatron's scheduler would give it
    (``weight_decay * wd_mult``: none for norms and biases), so the first step is right
    also when no ``OptimizerParamScheduler`` drives the optimizer."""
    where = {p: (n, c.module) for c in model_chunks for n, p in c.module.named_parameters()}
    routed = []
    for group in groups:
        buckets: dict[Any, list] = {}
        for p in group["params"]:
            name, chunk = where[p]
            key = ("matrix", _fused_layout(name, chunk, cfg, tp_size)) if getattr(p, BUFFER_ROUTING_ATTR) else ("elementwise", None)
            buckets.setdefault(key, []).append(p)
        for (kind, layout), params in buckets.items():
            routed.append({
                **group, "params": params, "matrix": kind == "matrix", "fused_layout": layout,
                "weight_decay": weight_decay * group.get("wd_mult", 1.0),
            })
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


def _matrix_infos(optimizer: DistributedOptimizer, model_chunks: list) -> dict[torch.Tensor, MatrixInfo]:
    """Flat shard parameter -> (name, shape) for every matrix this rank owns."""
    names = {p: n for c in model_chunks for n, p in c.module.named_parameters()}
    pairs = [
        pair
        for model_groups, shard_groups in (
            (optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups),
            (optimizer.model_fp32_groups, optimizer.shard_fp32_groups),
        )
        for models, shards in zip(model_groups, shard_groups)
        for pair in zip(models, shards)
    ]
    infos = {}
    for model_param, shard in pairs:
        if shard is None or not getattr(model_param, BUFFER_ROUTING_ATTR, False):
            continue
        if shard.numel() != model_param.numel():
            raise RuntimeError(f"{names[model_param]} is split across DP shards; the Canzona layout was not applied")
        infos[shard] = MatrixInfo(name=names[model_param], shape=model_param.shape)
    return infos


def build_canzona_optimizer(optimizer_config: Any, model_chunks: list, cfg: CanzonaConfig, *, tp_size: int = 1):
    """The Canzona optimizer for DDP-wrapped chunks laid out by :func:`build_full_param_layouts`."""
    if not optimizer_config.use_distributed_optimizer:
        raise ValueError("--canzona needs the distributed optimizer: pass --use-distributed-optimizer")
    pgs = ProcessGroupCollection.setup_process_groups_for_optimizer(None, model_chunks, True)
    groups, buffers = _get_param_groups_and_buffers(
        model_chunks, model_chunk_offset=0, config=optimizer_config,
        config_overrides=get_standard_config_overrides(optimizer_config),
        filter_fn=lambda g: not g["is_expert_parallel"], buffer_name="buffers",
    )
    inner = (TP_SHARDED_OPTIMIZERS if tp_size > 1 else SHARDED_OPTIMIZERS)[cfg.optimizer](
        _route_groups(groups, model_chunks, cfg, tp_size, optimizer_config.weight_decay), lr=optimizer_config.lr,
        weight_decay=optimizer_config.weight_decay, config=cfg.matrix, adamw_config=cfg.adamw, batch_same_shape=True,
    )
    optimizer = CanzonaDistributedOptimizer(
        inner, optimizer_config, _grad_scaler(optimizer_config), init_state_fn,
        model_chunks=model_chunks, per_model_buffers=buffers, data_parallel_group=pgs["dp_cp_group"],
        data_parallel_group_gloo=pgs["intra_dp_cp_group_gloo"], data_parallel_group_idx=get_pg_rank(pgs["mp_group"]),
        distributed_optimizer_instance_id=0,
    )
    optimizer.grad_stats_parallel_group = pgs["intra_dist_opt_group"]
    optimizer.tp_group = ProcessGroupCollection.use_mpu_process_groups().tp
    inner.bind_matrices(_matrix_infos(optimizer, model_chunks))
    if tp_size > 1:  # TP-sharded matrices: gathered to a host TP rank, updated there once
        bind_tensor_parallel(
            inner, optimizer, model_chunks, dp_rank=get_pg_rank(pgs["dp_cp_group"]), tp_group=optimizer.tp_group,
            mode=cfg.tp_mode, full_layout=lambda name, chunk: _fused_layout(name, chunk, cfg, 1),
        )
    return optimizer


# --------------------------------------------------------------------------- training entry points


def _parallel_sizes() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()


def canzona_full_param_layouts(model_chunks: list[torch.nn.Module], ddp_config: Any, args: Any) -> list[Any]:
    """:func:`build_full_param_layouts` configured from ``pretrain_gpt.py``'s flags."""
    from canzona_patches.arguments import canzona_config_from_args

    dp_size, tp_size = _parallel_sizes()
    return build_full_param_layouts(
        model_chunks, ddp_config, canzona_config_from_args(args), dp_size=dp_size, tp_size=tp_size
    )


def get_canzona_optimizer(optimizer_config: Any, model_chunks: list, args: Any):
    """:func:`build_canzona_optimizer` configured from ``pretrain_gpt.py``'s flags."""
    from canzona_patches.arguments import canzona_config_from_args

    _, tp_size = _parallel_sizes()
    return build_canzona_optimizer(optimizer_config, model_chunks, canzona_config_from_args(args), tp_size=tp_size)
