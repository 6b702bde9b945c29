"""Parameter names independent of the parallel layout: the names a checkpoint keys state by
and the optimizer derives per-matrix schedules from (Shampoo/SOAP refresh offsets).

Hooks (megatron-core 0.19.2): a transformer layer's ``layer_number`` (1-based, global over
pipeline stages) and an MoE layer's ``local_expert_indices`` (the global index of each local
expert of ``SequentialMLP``'s ``local_experts.J`` and transformer-engine's ``weightJ``).
"""

from __future__ import annotations

import re

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
