"""Canzona tensor parallelism on Megatron-Core: the plan's host ranks bound to live shards.

Hooks (megatron-core 0.19.2):
* Megatron's TP attributes on parameters: ``tensor_model_parallel`` and ``partition_dim``
  (0 for column-parallel ``linear_qkv``/``linear_fc1``, 1 for row-parallel
  ``linear_proj``/``linear_fc2``).
* The fused layouts Megatron shards: a ``linear_qkv`` shard holds whole query groups
  (plain concatenation rebuilds the global rows), a gated ``linear_fc1`` shard is
  ``[gate_r; up_r]`` of the global ``[gate; up]`` (``stride=2`` for the engine).
* ``DistributedOptimizer``'s pairs of model parameters and flat fp32 shard parameters
  (``model_float16_groups``/``shard_fp32_from_float16_groups``,
  ``model_fp32_groups``/``shard_fp32_groups``).
* The ``CanzonaPlan`` that ``canzona_patches.optimizer.build_full_param_layouts`` keeps on
  each unwrapped chunk as ``canzona_plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from canzona_patches.layout import BUFFER_ROUTING_ATTR
from megatron.canzona.planning import CanzonaPlan
from megatron.canzona.runtime.tp_async import ShardedMatrix
from megatron.canzona.runtime.tp_sharded import TPFlatMatrixViews, TPMatrixInfo

LayoutOf = Callable[[str, torch.nn.Module], Any]
"""``(param name, unwrapped chunk) -> fused layout of the full matrix, or None``."""


def bind_tensor_parallel(
    inner: TPFlatMatrixViews, optimizer: Any, model_chunks: list, *, dp_rank: int, tp_group: Any,
    mode: str, full_layout: LayoutOf,
) -> None:
    """Give ``inner`` every TP-sharded matrix this rank's shards hold, with the host TP rank
    and micro-group the plan of ``dp_rank`` assigns; builds the TP engine (collective)."""
    where = {p: (i, n, c.module) for i, c in enumerate(model_chunks) for n, p in c.module.named_parameters()}
    owned: dict[int, dict[str, tuple[torch.Tensor, torch.nn.Parameter]]] = {}
    for model_param, shard in _shard_pairs(optimizer):
        is_matrix = getattr(model_param, BUFFER_ROUTING_ATTR, False)
        if not is_matrix or not getattr(model_param, "tensor_model_parallel", False):
            continue  # elementwise, or a matrix every TP rank holds whole: updated locally
        index, name, _ = where[model_param]
        owned.setdefault(index, {})[name] = (shard, model_param)
    infos: dict[torch.Tensor, TPMatrixInfo] = {}
    first_group = 0
    for index, chunk in enumerate(model_chunks):
        shards = owned.get(index, {})
        entries = _plan_entries(_plan_of(chunk.module), dp_rank, shards, chunk.module)
        for name, (shard, model_param) in shards.items():
            host, group = entries[name]
            infos[shard] = TPMatrixInfo(
                matrix=ShardedMatrix(
                    name=name if len(model_chunks) == 1 else f"chunk{index}.{name}",
                    local_shape=tuple(model_param.shape), tp_dim=model_param.partition_dim,
                    host=host, group=first_group + group, stride=_stride(name, chunk.module),
                ),
                layout=full_layout(name, chunk.module),
            )
        first_group += len({g for _, g in entries.values()})
    inner.bind_tensor_parallel(infos, tp_group=tp_group, mode=mode)


def _plan_entries(plan: CanzonaPlan, dp_rank: int, shards: dict, module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """``name -> (host, dense micro-group index)`` for the TP-sharded matrices of ``dp_rank``."""
    tp_sharded = {n for n, p in module.named_parameters() if getattr(p, "tensor_model_parallel", False)}
    planned = {n for n, h in plan.dp.owners().items() if h == dp_rank and n in tp_sharded}
    if planned != set(shards):
        raise RuntimeError(
            f"DP rank {dp_rank} holds TP-sharded matrices {sorted(set(shards) ^ planned)[:3]} differently "
            "from its Canzona plan; the plan and the DDP layout must come from build_full_param_layouts"
        )
    entries: dict[str, tuple[int, int]] = {}
    index = 0
    for group in plan.tp[dp_rank].groups:
        members = [(n, h) for n, h in zip(group.names, group.hosts) if n in planned]
        for name, host in members:
            entries[name] = (host, index)
        index += bool(members)
    return entries


def _plan_of(module: torch.nn.Module) -> CanzonaPlan:
    """The plan on the unwrapped chunk (looking through wrappers such as Float16Module)."""
    while module is not None:
        plan = getattr(module, "canzona_plan", None)
        if plan is not None:
            return plan
        module = getattr(module, "module", None)
    raise RuntimeError("model chunk has no canzona_plan; build the DDP layout with build_full_param_layouts first")


def _stride(name: str, module: torch.nn.Module) -> int:
    """2 for a gated fc1, whose shard is [gate_r; up_r]; 1 for every other TP-sharded matrix."""
    return 2 if name.endswith("linear_fc1.weight") and module.config.gated_linear_unit else 1


def _shard_pairs(optimizer: Any) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model parameter, flat fp32 shard parameter) for every parameter this rank updates."""
    return [
        (model_param, shard)
        for model_groups, shard_groups in (
            (optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups),
            (optimizer.model_fp32_groups, optimizer.shard_fp32_groups),
        )
        for models, shards in zip(model_groups, shard_groups)
        for model_param, shard in zip(models, shards)
        if shard is not None
    ]
