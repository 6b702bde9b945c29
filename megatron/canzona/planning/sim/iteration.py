"""Forward/backward of one iteration and the bucket collectives that overlap it.

* Forward and backward of one micro-batch on a rank take its model FLOPs over
  ``bf16 peak · MFU``; backward is two thirds of it. An iteration runs
  ``global_batch / (dp_size · micro_batch)`` micro-batches, and a pipeline of PP stages
  idles ``(PP − 1)`` micro-batches' worth (1F1B: a fraction (PP − 1)/microbatches).
* Gradients are reduced bucket by bucket during the last micro-batch's backward (Megatron
  reduces only once every micro-batch is accumulated): a bucket is ready when backward
  has produced its last gradient, backward order being ``ParamSpec.order`` and backward
  time spread over parameters by their matmul work; the reductions run one at a time.
  What runs past the end of backward is exposed. :func:`reduced_at` tells when each
  bucket's reduction ends, from which Canzona's early host-group gathers may start.
* Those gathers share each rank's inter-node link with the reductions (:class:`Rider`): a
  gather issued as its buckets reduce delays the next reduction by its heaviest rank's
  inter-node seconds, less the time the reductions leave the links idle before it starts.
* Parameters are all-gathered bucket by bucket, in forward order, all issued when the
  first forward starts; forward waits at a bucket's first parameter until its all-gather
  is done. The wait is exposed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .result import Segment

BACKWARD_SHARE = 2.0 / 3.0
"""Backward's share of a micro-batch's forward and backward compute (2 of 6 · params FLOPs)."""


@dataclass(frozen=True)
class BucketSync:
    """One bucket's collective and where in backward it becomes ready."""

    seconds: float
    """Duration of the collective."""
    ready: float
    """Fraction of backward done when its last gradient is produced (forward needs its first
    parameter after ``1 - ready`` of the forward)."""
    label: str = ""
    key: Any = None
    """What :func:`reduced_at` reports its end under (``None``: not reported)."""


@dataclass(frozen=True)
class Rider:
    """Traffic issued as buckets reduce that shares the ranks' inter-node links with the
    reductions still to come: an early host-group gather (``planning.sim.step``)."""

    keys: frozenset
    """Keys of the buckets it waits for (:attr:`BucketSync.key`); it goes when the last ends."""
    loads: Mapping[int, float]
    """Per rank, seconds of its inter-node link the gather takes (out or in, the larger)."""


def _reduce_spans(buckets: Sequence[BucketSync], backward: float,
                  riders: Sequence[Rider] = ()) -> list[tuple[BucketSync, float, float]]:
    """``(bucket, start, end)`` of each reduction from backward's start, one at a time in
    readiness order; a rider, issued when its last bucket ends, lengthens the next reduction
    by its heaviest rank's load, less the idle time before that reduction starts."""
    free, spans = 0.0, []
    waiting = [(set(r.keys), r.loads) for r in riders if r.keys]
    debt: dict[int, float] = {}  # per rank, rider seconds its link still owes
    for b in sorted(buckets, key=lambda b: b.ready):
        start = max(free, b.ready * backward)
        idle = start - free
        extra = max((d - idle for d in debt.values()), default=0.0)
        debt = {}
        free = start + max(b.seconds, 0.0) + max(extra, 0.0)
        spans.append((b, start, free))
        if b.key is None or not waiting:
            continue
        for keys, loads in waiting:
            keys.discard(b.key)
            if not keys:
                for r, seconds in loads.items():
                    debt[r] = debt.get(r, 0.0) + seconds
        waiting = [(keys, loads) for keys, loads in waiting if keys]
    return spans


def overlap_backward(buckets: Sequence[BucketSync], backward: float, rank: int = 0,
                     origin: float = 0.0, riders: Sequence[Rider] = ()) -> tuple[float, list[Segment]]:
    """Exposed seconds after a backward of ``backward`` seconds starting at ``origin``, and
    the collectives' spans (lengthened by ``riders``' traffic)."""
    spans = _reduce_spans(buckets, backward, riders)
    segments = [Segment(rank, "comm", "grad_reduce", origin + start, origin + end, b.label)
                for b, start, end in spans if b.seconds > 0]
    free = spans[-1][2] if spans else 0.0
    return max(0.0, free - backward), segments


def reduced_at(buckets: Sequence[BucketSync], backward: float, riders: Sequence[Rider] = ()) -> dict[Any, float]:
    """``key -> when its reduction ends``, in seconds from the end of backward (negative:
    during backward), for every bucket with a key."""
    return {b.key: end - backward for b, _, end in _reduce_spans(buckets, backward, riders) if b.key is not None}


def overlap_forward(buckets: Sequence[BucketSync], forward: float, rank: int = 0,
                    origin: float = 0.0) -> tuple[float, list[Segment]]:
    """Exposed seconds of a forward of ``forward`` seconds whose parameters are all-gathered
    bucket by bucket from ``origin``, and the collectives' spans."""
    done, clock, reached, segments = 0.0, 0.0, 0.0, []
    for b in sorted(buckets, key=lambda b: -b.ready):  # forward order
        if b.seconds <= 0:
            continue
        need = 1.0 - b.ready
        clock += (need - reached) * forward
        reached = need
        start, done = done, done + b.seconds
        segments.append(Segment(rank, "comm", "param_gather", origin + start, origin + done, b.label))
        clock = max(clock, done)
    clock += (1.0 - reached) * forward
    return max(0.0, clock - forward), segments
