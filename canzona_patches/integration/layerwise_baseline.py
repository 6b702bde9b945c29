"""Measure Megatron-Core's own layer-wise layout on the planner's parameter descriptions.

Hooks ``LayerWiseDistributedOptimizer._compute_per_buffer_param_layout``
(megatron/core/optimizer/layer_wise_optimizer.py, megatron-core 0.19.2): the installed
function is called on meta tensors of the same local shapes, in registration order, and
its ``PerBufferParamLayout`` is read back as a :class:`DPPlan` so both layouts are scored
by the same metrics. Nothing of the peer is re-implemented here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from canzona_patches.version import require_pinned_megatron
from megatron.canzona.planning import CostModel, DPPlan, ParamSpec, matrix_specs, split_experts
from megatron.canzona.planning.geometry import default_bucket_size
from megatron.canzona.planning.grid import expert_dp_size
from megatron.canzona.planning.partition import check_inputs, elementwise_buffer
from megatron.canzona.planning.plan import Bucket, BufferPlan, Placement

require_pinned_megatron()

from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer  # noqa: E402

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def plan_megatron_layerwise(
    specs: Sequence[ParamSpec], *, dp_size: int, cost_model: CostModel, bucket_size: int | None = None
) -> DPPlan:
    """Megatron-Core 0.19.2's layer-wise (Muon) layout of the matrix buffer, as a DPPlan."""
    check_inputs(dp_size, bucket_size=bucket_size)
    bucket_size = default_bucket_size(dp_size) if bucket_size is None else bucket_size
    mats = matrix_specs(specs)
    forward = list(reversed(mats))  # Megatron takes parameters in registration order
    params = [
        torch.nn.Parameter(torch.empty(s.local_shape, device="meta", dtype=_DTYPES.get(s.dtype, torch.bfloat16)))
        for s in forward
    ]
    layout = LayerWiseDistributedOptimizer._compute_per_buffer_param_layout(
        params, bucket_size, dp_size, DistributedDataParallelConfig(use_distributed_optimizer=True)
    )
    costs = {s.name: cost_model.cost(s) for s in mats}
    buckets = []
    for k, (start, end) in enumerate(layout.bucket_indices):
        shard = (end - start) // dp_size
        bounds = tuple(start + r * shard for r in range(dp_size + 1))
        buckets.append(Bucket(start=start, end=end, numel_unpadded=layout.per_bucket_numel_unpadded[k], shard_bounds=bounds))
    placements = []
    loads = [0.0] * dp_size
    for spec, param in zip(forward, params):
        start, end, bucket = layout.param_index_map[param]
        b = buckets[bucket]
        host = (start - b.start) // ((b.end - b.start) // dp_size)
        loads[host] += costs[spec.name]
        placements.append(Placement(name=spec.name, start=start, end=end, bucket=bucket, host=host, cost=costs[spec.name]))
    placements.sort(key=lambda p: p.start)
    return DPPlan(
        strategy="megatron_layerwise",
        dp_size=dp_size,
        alpha=None,
        cost_kind=cost_model.kind,
        bucket_size=bucket_size,
        matrix=BufferPlan(placements=tuple(placements), buckets=tuple(buckets)),
        elementwise=elementwise_buffer(specs, dp_size, bucket_size),
        loads=tuple(loads),
    )


def plan_megatron_layerwise_stage(
    specs: Sequence[ParamSpec], *, dp_size: int, tp_size: int, cost_model: CostModel, ep_size: int = 1,
    expert_tp_size: int = 1, bucket_size: int | None = None,
) -> tuple[DPPlan, DPPlan | None]:
    """Megatron's layer-wise layouts of a stage: its dense buffers over DP and, with experts,
    its expert buffers over expert-DP (``None`` without experts)."""
    dense, experts = split_experts(specs)
    plan = plan_megatron_layerwise(dense, dp_size=dp_size, cost_model=cost_model, bucket_size=bucket_size)
    if not experts:
        return plan, None
    edp = expert_dp_size(dp_size=dp_size, tp_size=tp_size, ep_size=ep_size, expert_tp_size=expert_tp_size)
    return plan, plan_megatron_layerwise(experts, dp_size=edp, cost_model=cost_model, bucket_size=bucket_size)
