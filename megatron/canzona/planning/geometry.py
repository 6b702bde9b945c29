"""Buffer geometry of Megatron-Core's data-parallel buffers, restated as pure arithmetic.

Megatron-Core 0.19.2 (``megatron/core/optimizer/param_layout.py``) starts every parameter
on a 64-element boundary, pads every bucket end to a multiple of lcm(dp_size, 128) so it
splits into dp_size equal shards, and by default closes a bucket once it holds at least
``max(40M, 1M · dp_size)`` elements. Plans must honour the same rules so that the layout
they describe is accepted by ``DistributedDataParallel(full_param_layout=...)``.
"""

from __future__ import annotations

import math

PARAM_ALIGNMENT = 64
"""Every parameter starts on a multiple of this many elements."""
BUCKET_ALIGNMENT = 128
"""Bucket ends are padded to a multiple of lcm(dp_size, this)."""
HIGH_BUSBW_ALIGNMENT = 2**16
"""Extra bucket-end alignment when ``pad_buckets_for_high_nccl_busbw`` is set."""
BUCKET_GROWTH = 1.5
"""A lean-layout bucket never grows past this many times the bucket size by taking one more
parameter, so buckets stay near the configured size (and under twice it with padding)."""


def round_up(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def align_param_start(index: int) -> int:
    return round_up(index, PARAM_ALIGNMENT)


def bucket_end_divisor(dp_size: int, high_busbw: bool = False) -> int:
    divisor = math.lcm(dp_size, BUCKET_ALIGNMENT)
    return math.lcm(divisor, HIGH_BUSBW_ALIGNMENT) if high_busbw else divisor


def shard_divisor(dp_size: int, high_busbw: bool = False) -> int:
    """Shard sizes are multiples of this, so dp_size shards fill an aligned bucket and every
    shard starts on a parameter boundary."""
    return math.lcm(PARAM_ALIGNMENT, bucket_end_divisor(dp_size, high_busbw) // dp_size)


def default_bucket_size(dp_size: int) -> int:
    """Megatron-Core's default bucket size when gradient reduction overlaps backward."""
    return max(40_000_000, 1_000_000 * dp_size)


def packed_size(numels: list[int] | tuple[int, ...]) -> int:
    """Elements a run of parameters occupies when each starts on an aligned boundary."""
    cursor = 0
    for numel in numels:
        cursor = align_param_start(cursor) + numel
    return cursor


def stock_bucket_ranges(numels: list[int], bucket_size: int | None) -> list[tuple[int, int]]:
    """Index ranges [i, j) of parameters (in backprop order) per stock Megatron bucket: a
    bucket closes once its aligned extent reaches ``bucket_size``."""
    ranges, first, cursor = [], 0, 0
    for i, numel in enumerate(numels):
        cursor = align_param_start(cursor) + numel
        if bucket_size is not None and cursor >= bucket_size:
            ranges.append((first, i + 1))
            first, cursor = i + 1, 0
    if first < len(numels):
        ranges.append((first, len(numels)))
    return ranges


def lean_bucket_ranges(numels: list[int], bucket_size: int | None) -> list[tuple[int, int]]:
    """Bucket ranges for layouts that may split a matrix across shards: stock buckets that
    stay near ``bucket_size`` so gradient reduction still overlaps backward.

    A bucket closes once it reaches ``bucket_size`` (as Megatron's), or before a parameter
    that would take it past ``BUCKET_GROWTH`` × ``bucket_size`` (a parameter that large
    alone is a bucket of its own). A last bucket under half ``bucket_size`` joins the one
    before it when the two stay within that limit.
    """
    if bucket_size is None:
        return [(0, len(numels))] if numels else []
    limit = BUCKET_GROWTH * bucket_size
    ranges, first, cursor = [], 0, 0
    for i, numel in enumerate(numels):
        grown = align_param_start(cursor) + numel
        if cursor and grown > limit:
            ranges.append((first, i))
            first, grown = i, numel
        cursor = grown
        if cursor >= bucket_size:
            ranges.append((first, i + 1))
            first, cursor = i + 1, 0
    if first < len(numels):
        ranges.append((first, len(numels)))
    if len(ranges) > 1:
        (a, _), (c, d) = ranges[-2], ranges[-1]
        if packed_size(numels[c:d]) < bucket_size // 2 and packed_size(numels[a:d]) <= limit:
            ranges[-2:] = [(a, d)]
    return ranges
