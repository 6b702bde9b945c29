"""Model parameters → planner specs, and a Canzona ``DPPlan`` → Megatron-Core ``FullParamLayout``.

Hooks (megatron-core 0.19.2):
* ``megatron.core.distributed.param_and_grad_buffer.group_params_for_buffers`` — the grouping
  ``DistributedDataParallel`` checks a supplied layout against; matrix parameters are routed
  to their own buffer through the ``is_managed_by_layer_wise_optimizer`` attribute it reads.
* ``megatron.core.optimizer.param_layout.{FullParamLayout, PerBufferParamLayout}`` — the
  layout ``DistributedDataParallel(full_param_layout=...)`` accepts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from canzona_patches.version import require_pinned_megatron
from megatron.canzona.planning import DPPlan, ParamSpec
from megatron.canzona.planning.plan import BufferPlan

require_pinned_megatron()

from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers  # noqa: E402
from megatron.core.optimizer.param_layout import FullParamLayout, PerBufferParamLayout  # noqa: E402

BUFFER_ROUTING_ATTR = "is_managed_by_layer_wise_optimizer"
"""Parameter attribute ``group_params_for_buffers`` reads to put a parameter in its own buffer."""

NamedParams = Sequence[tuple[str, torch.nn.Parameter]]


def is_matrix_param(name: str, param: torch.nn.Parameter) -> bool:
    """Matrix optimizers take 2-D weights except embeddings and the output layer (AdamW)."""
    if param.dim() != 2 or getattr(param, "is_embedding_or_output_parameter", False):
        return False
    return not ("embedding" in name or name.startswith("output_layer") or ".output_layer." in name)


def specs_from_model(
    named_params: NamedParams,
    *,
    tp_size: int,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    kv_channels: int | None = None,
    gated_linear_unit: bool = True,
    split_qkv: bool = False,
    split_gate_up: bool = False,
) -> list[ParamSpec]:
    """Planner descriptions of a live (TP-sharded) model, in registration order."""
    specs, last = [], len(named_params) - 1
    for k, (name, p) in enumerate(named_params):
        sharded = getattr(p, "tensor_model_parallel", False) and tp_size > 1
        tp_dim = getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None
        shape = list(p.shape)
        if sharded and tp_dim is not None:
            shape[tp_dim] *= tp_size
        fused = None
        if name.endswith("linear_qkv.weight"):
            fused = "qkv"
        elif name.endswith("linear_fc1.weight") and gated_linear_unit:
            fused = "gate_up"
        blocks: tuple[tuple[int, int], ...] = ()
        if fused == "qkv" and split_qkv:
            if None in (num_attention_heads, num_query_groups, kv_channels):
                raise ValueError("splitting QKV needs num_attention_heads, num_query_groups and kv_channels")
            q, kv = num_attention_heads * kv_channels, num_query_groups * kv_channels
            blocks = ((q, shape[1]), (kv, shape[1]), (kv, shape[1]))
        elif fused == "gate_up" and split_gate_up:
            blocks = ((shape[0] // 2, shape[1]), (shape[0] // 2, shape[1]))
        specs.append(ParamSpec(
            name=name, global_shape=tuple(shape), tp_dim=tp_dim, tp_size=tp_size if sharded else 1,
            dtype=str(p.dtype).removeprefix("torch."), family="matrix" if is_matrix_param(name, p) else "elementwise",
            is_expert=not getattr(p, "allreduce", True), order=last - k, blocks=blocks, fused=fused,
        ))
    return specs


def tag_params_for_buffers(named_params: NamedParams, specs: Sequence[ParamSpec]) -> None:
    """Route matrix parameters into their own DDP buffer (the one the Canzona plan lays out)."""
    family = {s.name: s.family for s in specs}
    for name, p in named_params:
        setattr(p, BUFFER_ROUTING_ATTR, family[name] == "matrix")


def to_full_param_layout(plan: DPPlan, named_params: NamedParams, *, grad_reduce_in_fp32: bool) -> FullParamLayout:
    """The plan as the ``FullParamLayout`` that ``DistributedDataParallel`` accepts.

    Parameters must already be tagged with :func:`tag_params_for_buffers`.
    """
    name_of = {p: n for n, p in named_params}
    groups = group_params_for_buffers([p for _, p in named_params], grad_reduce_in_fp32)
    seen: set[bool] = set()
    layouts = {}
    for key, (params, indices) in groups.items():
        matrix = bool(key.is_managed_by_layer_wise_optimizer)
        if matrix in seen or key.is_expert_parallel:
            raise ValueError(
                "Canzona plans one matrix buffer and one elementwise buffer per model chunk; this model "
                f"needs more ({key}). Use a single parameter dtype and no expert parallelism with --canzona"
            )
        seen.add(matrix)
        buffer = plan.matrix if matrix else plan.elementwise
        assert buffer is not None, "plan has no elementwise buffer but the model has elementwise params"
        layouts[key] = _per_buffer(buffer, params, indices, name_of, plan.dp_size)
    return FullParamLayout(layouts=layouts)


def _per_buffer(buffer: BufferPlan, params, indices, name_of, dp_size: int) -> PerBufferParamLayout:
    where = {p.name: p for p in buffer.placements}
    missing = [name_of[p] for p in params if name_of[p] not in where]
    if missing or len(params) != len(where):
        raise ValueError(f"plan and model disagree on parameters (missing from plan: {missing[:3]}); re-plan for this model")
    return PerBufferParamLayout(
        param_index_map={p: (where[name_of[p]].start, where[name_of[p]].end, where[name_of[p]].bucket) for p in params},
        bucket_indices=[(b.start, b.end) for b in buffer.buckets],
        per_bucket_numel_unpadded=[b.numel_unpadded for b in buffer.buckets],
        param_indices=list(indices),
        num_optimizer_shards=dp_size,
    )
