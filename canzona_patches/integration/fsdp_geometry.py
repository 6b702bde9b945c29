"""Megatron-FSDP's buffers as built, read into the planner's :class:`FsdpBucket` (one per bucket).

What the runtime binds a plan to under ``--use-megatron-fsdp``: every parameter's offset in its
bucket, the bucket's chunk and padded size and its shards, read from Megatron-FSDP's own indexes
(``ParamAndGradBuffer.parameter_groups``: each group's main-weight buffer, or its model-weight
buffer where the weights are the main weights), so that nothing re-derives them;
``megatron.canzona.planning.fsdp`` predicts the same for the planner, and
``tests/e2e/test_megatron_fsdp.py`` checks the two against each other.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from megatron.canzona.planning.fsdp import FsdpBucket, FsdpItem, fsdp_unit


def fsdp_param_buffer(fsdp_model: Any) -> Any:
    """The ``ParamAndGradBuffer`` of a Megatron-FSDP-wrapped model chunk (``megatron.core``'s
    ``FullyShardedDataParallel``, or the ``MegatronFSDP`` it wraps)."""
    inner = getattr(fsdp_model, "module", fsdp_model)
    return getattr(inner, "param_and_grad_buffer", None) or fsdp_model.param_and_grad_buffer


def _indexed(buffer: Any) -> Iterator[tuple[Any, Any, str, Any]]:
    """``(group, its indexed buffer, parameter name, the parameter's index)`` for every parameter:
    the main-weight buffer, or the model-weight one where the weights are the main weights."""
    for group in buffer.parameter_groups:
        data = group.main_weight_buffer or group.model_weight_buffer or group.main_grad_buffer
        for item_id, index in data.item_index_map.items():
            yield group, data, buffer.param_to_name[group.params[item_id]], index


def read_fsdp_buckets(fsdp_model: Any) -> tuple[FsdpBucket, ...]:
    """The buckets of a Megatron-FSDP-wrapped model chunk, in bucket order."""
    found: dict[int, tuple[Any, Any, list[FsdpItem]]] = {}
    for group, data, name, index in _indexed(fsdp_param_buffer(fsdp_model)):
        item = FsdpItem(name=name, offset=index.global_data_index, numel=index.size,
                        row=math.prod(int(d) for d in tuple(index.shape)[1:]))
        found.setdefault(id(group), (group, data, []))[2].append(item)
    buckets = []
    for group, data, items in found.values():
        items.sort(key=lambda item: item.offset)
        buckets.append(FsdpBucket(
            unit=None if group.fsdp_unit_id is None else fsdp_unit(items[0].name), expert=bool(group.is_expert_param),
            dtype=str(group.dtype).removeprefix("torch."), chunk=int(group.chunk_size_factor),
            size=int(data.bucket_index.size), dp_size=int(data.dp_world_size), items=tuple(items)))
    return tuple(buckets)


def read_fsdp_shapes(fsdp_model: Any) -> dict[str, tuple[int, ...]]:
    """Each parameter's local shape (TP-sharded, before FSDP's sharding) as its buffer indexes
    it: the ``DTensor`` parameters Megatron-FSDP hands the optimizer report the TP-global shape."""
    return {name: tuple(int(d) for d in index.shape) for _, _, name, index in _indexed(fsdp_param_buffer(fsdp_model))}


def local_spans(model_chunks: list) -> dict[Any, tuple[tuple[int, str], tuple[int, int] | None]]:
    """Every ``DTensor`` parameter Megatron-FSDP hands the optimizer -> ``((chunk, name), span)``:
    the elements ``[lo, hi)`` of its local (TP-sharded) tensor, flattened, that this rank's shard
    of its bucket holds (``None``: none). The rank is the one the bucket's buffer is sharded by:
    this rank's place in the data-parallel group, or in the expert-data-parallel group for an
    expert bucket."""
    out = {}
    for c, chunk in enumerate(model_chunks):
        buffer = fsdp_param_buffer(chunk)
        rank_of = {name: int(data.dp_rank) for _, data, name, _ in _indexed(buffer)}
        held = {item.name: next(((lo, hi) for rank, lo, hi in bucket.pieces(item) if rank == rank_of[item.name]), None)
                for bucket in read_fsdp_buckets(chunk) for item in bucket.items}
        for name, dist_param in buffer.optimizer_named_parameters:
            out[dist_param] = ((c, name), held[name])
    return out
