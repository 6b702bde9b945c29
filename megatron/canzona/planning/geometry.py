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
PADDING_FLOOR = 0.9
"""Whole-parameter buckets grow until raw elements reach this fraction of dp_size × largest
parameter, which caps the padding a dominating parameter forces at 1/0.9 − 1 ≈ 11%."""


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


def whole_param_bucket_ranges(
    numels: list[int], bucket_size: int | None, dp_size: int
) -> list[tuple[int, int]]:
    """Bucket ranges for layouts that keep every parameter whole inside one shard.

    One shard must fit a bucket's largest parameter and the other dp_size − 1 shards are
    padded to match, so a bucket also waits until it holds PADDING_FLOOR × dp_size × its
    largest parameter. A short tail left at the end would be padded the same way, so it is
    merged into the bucket before it while it is still above that padding level.
    """
    ranges, first, total, largest = [], 0, 0, 0
    for i, numel in enumerate(numels):
        total += numel
        largest = max(largest, numel)
        if bucket_size is not None and total >= max(bucket_size, int(dp_size * largest * PADDING_FLOOR)):
            ranges.append((first, i + 1))
            first, total, largest = i + 1, 0, 0
    if first < len(numels):
        ranges.append((first, len(numels)))
    while len(ranges) > 1 and _padded_estimate(numels, ranges[-1], dp_size) * PADDING_FLOOR > sum(
        numels[ranges[-1][0] : ranges[-1][1]]
    ):
        (a, _), (_, b) = ranges[-2], ranges[-1]
        ranges[-2:] = [(a, b)]
    return ranges


def _padded_estimate(numels: list[int], span: tuple[int, int], dp_size: int) -> int:
    """Lower bound on a whole-parameter bucket's padded size."""
    part = numels[span[0] : span[1]]
    return max(dp_size * max(part), sum(part))
