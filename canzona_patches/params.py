"""Parameters as both the optimizer and the checkpoints see them: names independent of the
parallel layout (what a checkpoint keys state by, and what the optimizer derives per-matrix
schedules from: Shampoo/SOAP refresh offsets), the TP shard layout of a fused weight, and the
walk over a distributed optimizer's shard. ``integration`` and ``checkpoints`` both import it.

Hooks (megatron-core 0.19.2): a transformer layer's ``layer_number`` (1-based, global over
pipeline stages) and an MoE layer's ``local_expert_indices`` (the global index of each local
expert of ``SequentialMLP``'s ``local_experts.J`` and transformer-engine's ``weightJ``);
``DistributedOptimizer.gbuf_ranges`` and ``model_param_group_index_map`` (this rank's shard).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch


_LAYER = re.compile(r"^(?P<stack>.*?\blayers)\.(?P<index>\d+)\.")


def global_param_names(model_chunks: list) -> dict[torch.nn.Parameter, str]:
    """Parameter -> name independent of the parallel layout: wrapper prefixes (``module.``)
    dropped, a transformer layer's local index replaced by its global ``layer_number - 1``
    (pipeline stages number their layers from 0) and a local expert's by its global index
    (each EP rank numbers its experts from 0)."""
    names: dict[torch.nn.Parameter, str] = {}
    for chunk in model_chunks:
        module = chunk
        while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
            module = module.module
        layers = {
            name: sub.layer_number - 1
            for name, sub in module.named_modules()
            if isinstance(getattr(sub, "layer_number", None), int) and _LAYER.match(name + ".")
        }
        experts = {name: tuple(sub.local_expert_indices) for name, sub in module.named_modules()
                   if isinstance(getattr(sub, "local_expert_indices", None), (list, tuple))}
        for name, param in module.named_parameters():
            name = _global_expert_name(name, experts)
            match = _LAYER.match(name)
            if match:
                prefix = f"{match['stack']}.{match['index']}"
                if prefix in layers:
                    name = f"{match['stack']}.{layers[prefix]}." + name[match.end():]
            if names.setdefault(param, name) != name:
                raise RuntimeError(f"parameter named both {names[param]} and {name}")
    if len(set(names.values())) != len(names):
        raise RuntimeError("two parameters share a global name; checkpoint keys would collide")
    return names


_LOCAL_EXPERT = re.compile(r"^(?P<moe>.*)\.experts\.(?:local_experts\.(?P<module>\d+)\.(?P<rest>.*)|(?P<flat>.*\.weight)(?P<weight>\d+))$")


def _global_expert_name(name: str, experts: dict[str, tuple[int, ...]]) -> str:
    """A local expert's parameter named by its global expert index (``local_experts.J`` of
    ``SequentialMLP``, ``weightJ`` of transformer-engine's ``GroupedLinear``): the MoE layer's
    ``local_expert_indices`` maps J to it, so a checkpoint loads at another EP size."""
    match = _LOCAL_EXPERT.match(name)
    if match is None or match["moe"] not in experts:
        return name
    indices = experts[match["moe"]]
    if match["module"] is not None:
        return f"{match['moe']}.experts.local_experts.{indices[int(match['module'])]}.{match['rest']}"
    return f"{match['moe']}.experts.{match['flat']}{indices[int(match['weight'])]}"


def tp_stride(name: str, gated_linear_unit: bool) -> int:
    """Blocks per TP shard along its TP dim: 2 for a gated fc1 (weight or bias), whose shard
    is ``[gate_r; up_r]`` of the global ``[gate; up]``; 1 for every other parameter. The one
    source of it (binding and checkpoints): derived from the model, not read from Megatron's
    ``partition_stride``, which the kitchen option sets to 1 for the same shard layout."""
    return 2 if gated_linear_unit and name.endswith(("linear_fc1.weight", "linear_fc1.bias")) else 1


def shard_entries(optimizer: Any) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor, dict, Any]]:
    """``(model param, flat main param, inner group, range in the param)`` for this rank's shard."""
    inner = optimizer.optimizer
    for gbuf_range_maps in optimizer.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket in per_bucket:
                for model_param, ranges in bucket["param_map"].items():
                    group_index, order = optimizer.model_param_group_index_map[model_param]
                    group = inner.param_groups[group_index]
                    yield model_param, group["params"][order], group, ranges["param"]
