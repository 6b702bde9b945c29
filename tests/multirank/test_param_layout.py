"""FullParamLayout geometry, checked without processes on meta tensors.

Megatron's DistributedOptimizer layout, LayerWiseDistributedOptimizer's bin-packing (called
standalone, no process group) obey the rules DDP's buffer and the distributed optimizer
rely on; the second also keeps every parameter inside one DP shard. (The Canzona planner's
geometry is checked in tests/unit and tests/integration.) See docs/megatron-cpu-notes.md for the rules.
"""

import math

import pytest
import torch

from canzona_patches.harness.tiny_gpt import layer_wise_layout

# The tiny GPT at TP1, in registration (forward) order.
_LAYER = [
    ("input_layernorm.weight", (64,)),
    ("self_attention.linear_proj.weight", (64, 64)),
    ("self_attention.linear_qkv.weight", (128, 64)),
    ("self_attention.q_layernorm.weight", (16,)),
    ("self_attention.k_layernorm.weight", (16,)),
    ("pre_mlp_layernorm.weight", (64,)),
    ("mlp.linear_fc1.weight", (256, 64)),
    ("mlp.linear_fc2.weight", (64, 128)),
]
TINY_GPT_SHAPES = [
    ("embedding.word_embeddings.weight", (128, 64)),
    *[(f"decoder.layers.{i}.{name}", shape) for i in range(2) for name, shape in _LAYER],
    ("decoder.final_layernorm.weight", (64,)),
    ("output_layer.weight", (128, 64)),
]


def _meta_params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.empty(shape, device="meta")) for _, shape in TINY_GPT_SHAPES]


def _ddp_config():
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)


def _megatron_layout(params, dp_size: int, ddp_config, *, bucket_size: int | None):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer.compute_full_param_layout(params, bucket_size, dp_size, ddp_config)


def geometry_violations(layout, params: list, dp_size: int) -> list[str]:
    """Broken rules of a PerBufferParamLayout for ``params`` (registration order)."""
    problems = []
    if set(layout.param_index_map) != set(params):
        problems.append("param_index_map keys differ from the buffer's params")
    bucket_ids = [layout.param_index_map[p][2] for p in reversed(params)]
    if bucket_ids[0] != 0 or any(b - a not in (0, 1) for a, b in zip(bucket_ids, bucket_ids[1:])):
        problems.append(f"bucket ids not contiguous in backprop order: {bucket_ids}")
    ends = [0] + [end for _, end in layout.bucket_indices[:-1]]
    if [start for start, _ in layout.bucket_indices] != ends:
        problems.append(f"buckets do not tile the buffer: {layout.bucket_indices}")
    divisor = math.lcm(dp_size, 128)
    if any(end % divisor for _, end in layout.bucket_indices):
        problems.append(f"a bucket end is not a multiple of lcm(dp, 128) = {divisor}")
    ranges = sorted(layout.param_index_map.values())
    if any(end > next_start for (_, end, _), (next_start, _, _) in zip(ranges, ranges[1:])):
        problems.append("param ranges overlap")
    for start, end, bucket in ranges:
        bucket_start, bucket_end = layout.bucket_indices[bucket]
        if start % 64 or not bucket_start <= start < end <= bucket_end:
            problems.append(f"param [{start}, {end}) misplaced in bucket {bucket}")
    if sum(layout.per_bucket_numel_unpadded) > layout.bucket_indices[-1][1]:
        problems.append("more unpadded elements than buffer")
    if layout.num_optimizer_shards != dp_size:
        problems.append(f"num_optimizer_shards {layout.num_optimizer_shards} != {dp_size}")
    return problems


def split_params(layout, dp_size: int) -> list[tuple[int, int]]:
    """(start, end) of every param that crosses a DP shard boundary of its bucket."""
    split = []
    for start, end, bucket in layout.param_index_map.values():
        bucket_start, bucket_end = layout.bucket_indices[bucket]
        shard_size = (bucket_end - bucket_start) // dp_size
        if (start - bucket_start) // shard_size != (end - 1 - bucket_start) // shard_size:
            split.append((start, end))
    return split


def _only_layout(full_layout):
    (layout,) = full_layout.layouts.values()  # fp32 params, fp32 grads: a single buffer
    return layout


@pytest.mark.parametrize("dp_size", [2, 3, 4])
@pytest.mark.parametrize("bucket_size", [None, 20_000])
@pytest.mark.parametrize("build", [_megatron_layout, layer_wise_layout])
def test_layout_geometry(build, dp_size: int, bucket_size: int | None) -> None:
    params = _meta_params()
    full_layout = build(params, dp_size, _ddp_config(), bucket_size=bucket_size)
    layout = _only_layout(full_layout)
    assert geometry_violations(layout, params, dp_size) == []
    if build is not _megatron_layout:
        assert split_params(layout, dp_size) == []


def test_megatron_default_layout_splits_params() -> None:
    layout = _only_layout(_megatron_layout(_meta_params(), 4, _ddp_config(), bucket_size=None))
    assert split_params(layout, 4) != []


def test_megatron_default_layout_is_reverse_order_and_packed() -> None:
    params = _meta_params()
    layout = _only_layout(_megatron_layout(params, 2, _ddp_config(), bucket_size=None))
    starts = [layout.param_index_map[p][0] for p in reversed(params)]
    assert starts == sorted(starts) and starts[0] == 0
    # Each start is the previous end rounded up to 64: no other gaps.
    for previous, param in zip(list(reversed(params)), list(reversed(params))[1:]):
        previous_end = layout.param_index_map[previous][1]
        assert layout.param_index_map[param][0] == -(-previous_end // 64) * 64
