"""Early gathers under Megatron-FSDP: its reduce pipeline tells :class:`EarlyGathers` when each
bucket group's gradient shard is final, and when backward ends.

Hooks (megatron-core 0.19.2):
* ``GradReducePipeline._bucket_group_gradient_reduce`` (a registry row) reduce-scatters one
  bucket group (``bucket_to_bucket_group``) and, dispatched asynchronously, queues the event
  that marks its end on the reduce stream in ``grad_reduce_queue``; the reduction of the last
  micro-batch (``MegatronFSDP.is_last_microbatch``, set by its ``no_sync``; or any, under
  ``optim``, which reduces only then) leaves this rank's gradient shard final, in the bucket
  group's ``main_grad_buffer`` (``get_item(..., only_shard=True)``: what
  ``update_main_grads`` hands the optimizer, cast to the main weights' dtype). Its listeners
  are told then. ``MegatronFSDP.finish_grad_sync`` (a registry row) ends backward: its
  listeners are told before it waits and once it has.

On gloo, where Megatron-FSDP's reduce-scatters are synchronous, each group's gathers go at the
reduction, during backward; on CUDA from its dispatch, on the early gathers' side stream, as under
DDP (:mod:`canzona_patches.integration.early_gather`). A bucket group whose last reduction went
unreported (a training loop without Megatron-FSDP's ``no_sync``, so no micro-batch is known to be
the last) is gathered when ``finish_grad_sync`` has waited. Where the holders keep Muon's
momentum, what goes is its source, speculating that no clip acts (:class:`EarlySources`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from canzona_patches.integration.early_gather import (EarlyCompute, EarlyGathers, EarlySources, Told, gathers_apply,
                                                      listen, listeners)


def announcing_fsdp_reduce(original: Callable, run: Any) -> Callable:
    """Megatron-FSDP's ``_bucket_group_gradient_reduce`` that tells the bucket group's listeners
    when it has dispatched (CUDA) or done (gloo) the reduction that leaves its shard final."""

    @functools.wraps(original)
    def _bucket_group_gradient_reduce(self: Any, bucket_group: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, bucket_group, *args, **kwargs)
        group = _FSDP_GROUPS.get(self, {}).get(tuple(bucket_group))
        if group is not None and group.final():
            queued = kwargs.get("async_op", args[0] if args else False) and self.grad_reduce_queue
            group.grad_reduce_handle = self.grad_reduce_queue[-1][0] if queued else None
            for listener in listeners(group):
                listener.on_fsdp_reduce(group)
        return result

    return _bucket_group_gradient_reduce


def announcing_fsdp_finish(original: Callable, run: Any) -> Callable:
    """``MegatronFSDP.finish_grad_sync`` that tells its listeners that backward's work is queued,
    then, once every reduce-scatter is waited for, that every bucket group has reduced."""

    @functools.wraps(original)
    def finish_grad_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        told = _FSDP_FINISHING.of(self)
        for listener in told:
            listener.on_finishing()
        result = original(self, *args, **kwargs)
        for listener in told:
            listener.on_fsdp_finished()
        return result

    return finish_grad_sync


class FsdpBucketGroup:
    """One bucket group of a Megatron-FSDP model chunk's gradient reduce pipeline (the buckets
    it reduce-scatters together), as the early gathers name it; made once, at attach."""

    def __init__(self, module: Any, buckets: tuple[int, ...]) -> None:
        self._module, self.buckets = weakref.ref(module), buckets  # the module holds the table that holds this
        self.grad_reduce_handle: Any = None
        """The event marking its last reduction's end on the reduce stream (CUDA), else ``None``."""

    def final(self) -> bool:
        """Whether the reduction now leaves the gradient shard final: the last micro-batch's
        (Megatron-FSDP's ``no_sync`` marks it), or under ``optim`` any (it reduces only then)."""
        module = self._module()
        if module is None:
            return False
        last = getattr(module, "is_last_microbatch", False)
        return bool(module.is_delay_grad_reduce or module.model_auto_sync or last)


_FSDP_GROUPS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Megatron-FSDP ``GradReducePipeline`` -> ``{bucket ids: FsdpBucketGroup}`` (:func:`attach_fsdp`)."""
_FSDP_FINISHING = Told()
"""``MegatronFSDP`` module -> the early gathers told around its ``finish_grad_sync``."""


def attach_fsdp(engine: Any, binding: Any, model_chunks: Sequence[Any], compute: EarlyCompute | None = None,
                source: EarlySources | None = None) -> EarlyGathers | None:
    """:func:`attach` for an optimizer over Megatron-FSDP-wrapped ``model_chunks``: this rank's
    pieces are views of each bucket's gradient shard (``main_grad_buffer``, made once: the
    buffer is kept for the whole run), a micro-group needs the bucket groups of its matrices,
    and its listener is told by the chunks' reduce pipelines and ``finish_grad_sync``.
    ``source``: the holders keep Muon's momentum, gathered early only speculating (:class:`EarlySources`)."""
    if not gathers_apply(engine, binding, compute):
        return None
    group_of: dict[int, FsdpBucketGroup] = {}
    raw: dict[tuple[str, int], torch.Tensor] = {}
    finishing = []
    for chunk in model_chunks:
        module = chunk.module
        buffer, groups = module.param_and_grad_buffer, _FSDP_GROUPS.setdefault(module.grad_reduce_pipeline, {})
        for param, bucket_id in buffer.param_to_param_group.items():
            members = tuple(i for i in buffer.bucket_to_bucket_group[bucket_id]
                            if buffer.parameter_groups[i].main_grad_buffer is not None)
            if members not in groups:
                groups[members] = FsdpBucketGroup(module, members)
            group_of[id(param)] = groups[members]
        raw.update(_fsdp_pieces(buffer, binding))
        finishing.append(module)
    needs = [sorted({group_of[id(binding.params[task.key].orig_param)] for task in exchange.tasks},
                    key=lambda group: group.buckets) for exchange in engine.exchanges]
    parts: list[dict[int, frozenset[str]]] = []
    for exchange in engine.exchanges:
        keys: dict[int, set[str]] = {}
        for task in exchange.tasks:
            keys.setdefault(id(group_of[id(binding.params[task.key].orig_param)]), set()).add(task.key)
        parts.append({group: frozenset(names) for group, names in keys.items()})
    early = listen(engine, raw, needs, next(iter(raw.values()), None), compute, source, parts)
    for module in finishing:
        _FSDP_FINISHING.add(module, early)
    return early


def _fsdp_pieces(buffer: Any, binding: Any) -> dict[tuple[str, int], torch.Tensor]:
    """``(task key, lo)`` -> this rank's piece as a view of its bucket's gradient shard, for the
    binding's parameters in ``buffer``."""
    raw = {}
    for shard, refs in binding.pieces.items():
        orig = shard.orig_param
        if not refs or orig not in buffer.param_to_param_group:
            continue
        grads = buffer.parameter_groups[buffer.param_to_param_group[orig]].main_grad_buffer
        flat = grads.get_item(grads.param_idx[orig], only_shard=True).view(-1)
        if flat.numel() != shard.to_local().numel():
            raise RuntimeError(f"{binding.names[refs[0].key]}: Megatron-FSDP's gradient shard holds {flat.numel()} "
                               f"elements, its weight shard {shard.to_local().numel()}; the buffers disagree")
        for ref in refs:
            raw[(ref.key, ref.lo)] = flat[ref.offset : ref.offset + ref.hi - ref.lo]
    return raw
