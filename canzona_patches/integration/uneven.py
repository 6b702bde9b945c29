"""Variable-size DP shards on Megatron-Core's buckets: the whole layout's collectives.

A bucket of Canzona's whole layout (:mod:`megatron.canzona.planning.whole`) is cut at
parameter boundaries, so its DP shards differ in size. Megatron-Core 0.19.2 cuts every bucket
into equal shards in four places; each is a row of :data:`canzona_patches.registry.PATCHES`
(group ``uneven``, installed by :func:`canzona_patches.integration.layout.full_param_layouts` for a plan
with such buckets) or an override of :class:`canzona_patches.integration.optimizer.CanzonaDistributedOptimizer`:

* ``_ParamAndGradBuffer.__init__`` receives the layout (:class:`ShardedParamLayout`, which
  carries each bucket's shard bounds) and tags the bucket's ``grad_data`` and ``param_data``
  views with their shard sizes;
* ``shard_buffer`` (rank r's view of a bucket) returns the tagged sizes' views;
* ``dist_reduce_scatter_func`` and ``dist_all_gather_func`` run a tagged bucket through
  torch's list-form collectives: ``reduce_scatter(out, [in_0, .., in_R-1])`` and, on NCCL,
  ``all_gather([out_0, ..], in)``. ProcessGroupNCCL (``reduce_scatter`` and ``allgather`` in
  torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp) runs unequal sizes as one NCCL group of
  ``ncclReduce`` (root r, rank r's shard) or ``ncclBroadcast`` calls: each rank sends about
  the bucket's bytes, as a ring reduce-scatter does. Gloo reduce-scatters unequal lists
  itself but refuses an unequal all-gather; there each shard is broadcast from its rank
  (the same bytes, exact: a copy);
* ``_coalescing_manager``: torch's manager batches only the ``*_tensor`` forms; the works of
  the list-form collectives issued inside it join its handle, so Megatron's
  ``finish_grad_sync`` and ``finish_param_sync`` wait for them (overlap unchanged).
* ``DistributedOptimizer._build_model_gbuf_range`` (overridden): rank r's range of a tagged
  bucket is its planned shard.

Nothing is padded and no extension is compiled. Per step and rank: one collective call per
shard of each bucket inside one NCCL group, no host synchronisation, no allocation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from canzona_patches.version import require_pinned_megatron

require_pinned_megatron()

from megatron.core.optimizer.param_layout import PerBufferParamLayout  # noqa: E402

_SHARD_SIZES: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""A bucket's ``grad_data``/``param_data`` view -> its shards' sizes, in DP rank order (only
where they differ). Canzona's own tables, by identity: nothing is set on Megatron's buckets
or tensors, and an entry goes with its object."""
_SHARD_BOUNDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""A bucket -> its ``dp_size + 1`` shard offsets from the bucket's start."""

_pending: list[list[Any]] = []
"""Works of list-form collectives issued inside each open coalescing manager (innermost last)."""


@dataclass
class ShardedParamLayout(PerBufferParamLayout):
    """A ``PerBufferParamLayout`` whose buckets have planned, possibly unequal, DP shards."""

    shard_bounds: list[tuple[int, ...]] = field(default_factory=list)
    """Per bucket, ``dp_size + 1`` offsets from the bucket's start: rank r's shard is
    ``[bounds[r], bounds[r + 1])``."""


class _Works:
    """Several works as one handle."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def shard_sizes(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The unequal shard sizes of a tagged bucket view; ``None`` for any other tensor."""
    return _SHARD_SIZES.get(tensor)


def shard_bounds(bucket: Any) -> tuple[int, ...] | None:
    """The planned shard offsets of a tagged bucket; ``None`` for any other bucket."""
    return _SHARD_BOUNDS.get(bucket)


def tag_buckets(buffer: Any, shard_bounds: list[tuple[int, ...]]) -> None:
    """Give each bucket of a built ``_ParamAndGradBuffer`` its planned shards. A bucket whose
    shards happen to be equal keeps the stock collectives (the list forms would flatten it
    into a temporary of the bucket's size on NCCL every step)."""
    assert len(shard_bounds) == len(buffer.buckets), (len(shard_bounds), len(buffer.buckets))
    for bucket, bounds in zip(buffer.buckets, shard_bounds):
        sizes = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        if bounds[0] != 0 or bounds[-1] != bucket.grad_data.numel() or min(sizes) < 0:
            raise ValueError(f"bucket {bucket.bucket_id}: shard bounds {bounds[:3]}... do not cut its "
                             f"{bucket.grad_data.numel()} elements; re-plan for this model")
        _SHARD_BOUNDS[bucket] = tuple(bounds)
        if len(set(sizes)) == 1:
            continue
        for data in (bucket.grad_data, bucket.param_data):
            if data is not None:
                _SHARD_SIZES[data] = sizes


# --------------------------------------------------------------------------- patches


def tagging_buckets(original, run):
    """``_ParamAndGradBuffer.__init__`` that tags the buckets of a :class:`ShardedParamLayout`."""

    def __init__(self, *args, param_layout=None, **kwargs):
        original(self, *args, param_layout=param_layout, **kwargs)
        if isinstance(param_layout, ShardedParamLayout):
            tag_buckets(self, param_layout.shard_bounds)

    return __init__


def uneven_shard_buffer(original, run):
    def shard_buffer(buffer: torch.Tensor, data_parallel_world_size: int):
        sizes = shard_sizes(buffer)
        if sizes is None:
            return original(buffer, data_parallel_world_size)
        assert len(sizes) == data_parallel_world_size, (sizes, data_parallel_world_size)
        return list(buffer.split(sizes))

    return shard_buffer


def uneven_reduce_scatter(original, run):
    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        sizes = shard_sizes(input)
        if sizes is None:
            return original(output, input, op=op, group=group, async_op=async_op)
        work = dist.reduce_scatter(output, list(input.split(sizes)), op=op, group=group, async_op=async_op)
        return _collected([work] if work is not None else [])

    return reduce_scatter


def uneven_fp32_reduce_scatter(original, run):
    """Megatron's ``reduce_scatter_with_fp32_accumulation`` (an all-to-all of every rank's shards,
    then each rank sums what it received in fp32) for a tagged bucket: the all-to-all's splits are
    the planned shards, so rank r receives every rank's shard r and sums it over the ranks as
    Megatron does (the same sum of each element, in the same rank order). Received per rank and
    step: ``DP x`` its shard (Megatron's equal shards: the bucket), allocated per call as Megatron
    allocates its own; one all-to-all per bucket, no host synchronisation."""

    def reduce_scatter_with_fp32_accumulation(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        sizes = shard_sizes(input)
        if sizes is None:
            return original(output, input, op, group, async_op)
        assert op == dist.ReduceOp.SUM, op
        rank, world = dist.get_rank(group), len(sizes)
        received = torch.empty(world * sizes[rank], dtype=input.dtype, device=input.device)
        work = dist.all_to_all_single(received, input, output_split_sizes=[sizes[rank]] * world,
                                      input_split_sizes=list(sizes), group=group, async_op=async_op)
        handle = _SummedInFp32(work, received.view(world, sizes[rank]), output)
        if async_op:
            return handle
        handle.wait()
        return None

    return reduce_scatter_with_fp32_accumulation


@dataclass
class _SummedInFp32:
    """The handle of :func:`uneven_fp32_reduce_scatter`: the first ``wait`` waits for the
    all-to-all and writes the fp32 sum over the ranks into this rank's shard (on CUDA on the
    stream current then: the early gathers' side stream, where they wait first); a later one
    (Megatron's ``finish_grad_sync``) finds it done."""

    work: Any
    received: torch.Tensor | None
    output: torch.Tensor

    def wait(self) -> None:
        if self.received is None:
            return
        if self.work is not None:
            self.work.wait()
        self.output.copy_(torch.sum(self.received, dim=0, dtype=torch.float32))
        self.work = self.received = None


def uneven_all_gather(original, run):
    def all_gather(output, input, group=None, async_op=False):
        sizes = shard_sizes(output)
        if sizes is None:
            return original(output, input, group=group, async_op=async_op)
        outputs = list(output.split(sizes))
        if dist.get_backend(group) == "nccl":
            works = [dist.all_gather(outputs, input, group=group, async_op=async_op)]
        else:  # gloo refuses unequal sizes: each shard from its rank
            rank = dist.get_rank(group)
            if outputs[rank].data_ptr() != input.data_ptr():
                outputs[rank].copy_(input)
            works = [dist.broadcast(out, group_src=r, group=group, async_op=async_op)
                     for r, out in enumerate(outputs)]
        return _collected([w for w in works if w is not None])

    return all_gather


def joining_uneven_works(original, run):
    @contextmanager
    def _coalescing_manager(group=None, device=None, async_ops=False) -> Iterator[Any]:
        works: list[Any] = []
        _pending.append(works)
        try:
            with original(group, device=device, async_ops=async_ops) as cm:
                yield cm
        finally:
            _pending.pop()
        cm.works.extend(works)

    return _coalescing_manager


def _collected(works: list[Any]) -> _Works | None:
    """Inside a coalescing manager the works join its handle; else one handle for them."""
    if _pending:
        _pending[-1].extend(works)
        return None
    return _Works(works) if works else None
