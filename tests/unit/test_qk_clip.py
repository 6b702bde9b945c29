"""QK-clip's single-device math (megatron/canzona/optim/qk_clip.py) against Megatron-Core 0.19.2's
``SelfAttention.clip_qk`` on the same weight and logits (bitwise), its application to pieces of a
matrix (bitwise the whole), and the parse-time checks of --qk-clip."""

from __future__ import annotations

import argparse
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona_patches.errors import CanzonaArgumentError
from canzona_patches.integration.qk_clip import check_qk_clip_args, qk_clip_line, record_max_logits
from megatron.canzona.optim.qk_clip import QKClipConfig, QKVRows, clip_qkv_, group_eta, row_scales, scale_rows_
from megatron.core.transformer.attention import SelfAttention

pytestmark = pytest.mark.quick

# Qwen3-32B's attention on one of TP 8's ranks: 8 heads in 1 query group, head dim 128, is too big
# for a unit test; the same structure, smaller: 3 groups of 2 heads of dim 4, hidden 8.
ROWS = QKVRows(groups=3, heads_per_group=2, head_dim=4)
HIDDEN = 8


class _MegatronAttention:
    """The attributes ``SelfAttention.clip_qk`` reads, around Megatron's own two functions."""

    clip_qk = SelfAttention.clip_qk
    _clip_linear_qkv = SelfAttention._clip_linear_qkv

    def __init__(self, weight: torch.Tensor, logits: torch.Tensor, config: QKClipConfig) -> None:
        self.config = types.SimpleNamespace(qk_clip=True, qk_clip_threshold=config.threshold,
                                            qk_clip_alpha=config.alpha)
        self.core_attention = types.SimpleNamespace(current_max_attn_logits=logits)
        self.linear_qkv = types.SimpleNamespace(weight=torch.nn.Parameter(weight, requires_grad=False))
        self.num_attention_heads_per_partition = ROWS.heads
        self.num_query_groups_per_partition = ROWS.groups
        self.query_projection_size = ROWS.heads * ROWS.head_dim
        self.kv_projection_size = ROWS.groups * ROWS.head_dim


def _logits(threshold: float) -> torch.Tensor:
    """Group 0 over the threshold by its second head, group 1 under it, group 2 far over it."""
    return torch.tensor([0.5, 2.0, 0.3, 0.9, 7.0, 3.0]) * threshold


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha", [0.5, 0.25])
def test_clip_is_megatrons_formula_bitwise(dtype: torch.dtype, alpha: float) -> None:
    config = QKClipConfig(threshold=1.5, alpha=alpha)
    weight = torch.randn(ROWS.rows, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits = _logits(config.threshold)
    megatron = _MegatronAttention(weight.clone(), logits, config)
    megatron.clip_qk()
    ours = weight.clone()
    clip_qkv_(ours, logits, ROWS, config)
    assert torch.equal(ours, megatron.linear_qkv.weight.data)
    # Group 1 (under the threshold) and every value row are bitwise unchanged; groups 0 and 2 moved.
    blocks, before = ours.view(ROWS.groups, ROWS.rows_per_group, HIDDEN), weight.view_as(ours.view(3, -1, HIDDEN))
    assert torch.equal(blocks[1], before[1])
    assert torch.equal(blocks[:, ROWS.query_rows + ROWS.head_dim:], before[:, ROWS.query_rows + ROWS.head_dim:])
    assert not torch.equal(blocks[0, :ROWS.query_rows], before[0, :ROWS.query_rows])
    assert not torch.equal(blocks[2, ROWS.query_rows:ROWS.query_rows + ROWS.head_dim],
                           before[2, ROWS.query_rows:ROWS.query_rows + ROWS.head_dim])


def test_eta_is_one_where_nothing_exceeds() -> None:
    eta = group_eta(torch.tensor([-3.0, 0.5, float("nan"), float("nan"), float("-inf"), float("-inf")]), ROWS, 1.0)
    assert torch.equal(eta, torch.ones(3))
    eta = group_eta(torch.tensor([4.0, 2.0, 1.0, 1.0, 0.0, 8.0]), ROWS, 2.0)
    assert torch.equal(eta, torch.tensor([0.5, 1.0, 0.25]))
    scales = row_scales(torch.tensor([4.0, 2.0, 1.0, 1.0, 0.0, 8.0]), ROWS, QKClipConfig(threshold=2.0, alpha=0.5))
    assert scales.shape == (ROWS.rows,)
    assert torch.equal(scales[:ROWS.query_rows], torch.full((ROWS.query_rows,), 0.5 ** 0.5))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=ROWS.rows * HIDDEN), min_size=0, max_size=6))
def test_pieces_scale_as_the_whole(cuts: list[int]) -> None:
    """Any cut of the row-major matrix into runs (the lean layout's shards): each run scaled on
    its own is bitwise the whole matrix scaled."""
    config = QKClipConfig(threshold=1.5, alpha=0.3)
    weight = torch.randn(ROWS.rows, HIDDEN, generator=torch.Generator().manual_seed(1))
    scales = row_scales(_logits(config.threshold), ROWS, config)
    whole = weight.clone()
    clip_qkv_(whole, _logits(config.threshold), ROWS, config)
    flat = weight.clone().view(-1)
    bounds = sorted({0, flat.numel(), *cuts})
    for start, end in zip(bounds, bounds[1:]):
        piece = flat[start:end].clone()
        scale_rows_(piece, start, HIDDEN, scales)
        flat[start:end] = piece
    assert torch.equal(flat.view_as(whole), whole)


def test_running_maximum_over_micro_batches() -> None:
    core = types.SimpleNamespace()
    first = torch.tensor([[[[1.0, float("-inf")], [2.0, 0.0]], [[-1.0, float("-inf")], [0.5, 0.25]]]])
    record_max_logits(core, first)  # [b=1, heads=2, sq=2, sk=2]
    assert torch.equal(core.current_max_attn_logits, torch.tensor([2.0, 0.5]))
    record_max_logits(core, first * torch.tensor([0.5, 4.0]).view(1, 2, 1, 1))
    assert torch.equal(core.current_max_attn_logits, torch.tensor([2.0, 2.0]))


def _args(**given) -> argparse.Namespace:
    args = dict(qk_clip=True, log_max_attention_logit=False, qk_clip_alpha=0.5, qk_clip_threshold=100.0, canzona=True,
                multi_latent_attention=False, experimental_attention_variant=None, transformer_impl="local")
    return argparse.Namespace(**{**args, **given})


@pytest.mark.parametrize(("given", "words"), [
    ({"qk_clip_alpha": 0.0}, "--qk-clip-alpha must be between 0.0 and 1.0 when using --qk-clip (got 0.0)"),
    ({"qk_clip_alpha": 1.0}, "--qk-clip-alpha must be between 0.0 and 1.0"),
    ({"qk_clip_threshold": 0.0}, "--qk-clip-threshold must be greater than 0 when using --qk-clip (got 0.0)"),
    ({"qk_clip_threshold": -5.0}, "--qk-clip-threshold must be greater than 0"),
    ({"multi_latent_attention": True}, "multi-latent attention (--multi-latent-attention) gives no logits"),
    ({"experimental_attention_variant": "dsa"}, "--experimental-attention-variant dsa gives none"),
    ({"transformer_impl": "transformer_engine", "te": (2, 8)}, "transformer-engine 2.8's attention gives no logits"),
    ({"canzona": False}, "--qk-clip without --canzona is Megatron-Core's"),
    ({"canzona": False, "qk_clip": False, "log_max_attention_logit": True},
     "--log-max-attention-logit without --canzona is Megatron-Core's"),
])
def test_bad_input_is_one_line(given: dict, words: str) -> None:
    te = given.pop("te", None)
    with pytest.raises(CanzonaArgumentError) as error:
        check_qk_clip_args(_args(**given), te_version=te)
    assert words in str(error.value)
    assert "\n" not in str(error.value)


def test_good_input_passes() -> None:
    check_qk_clip_args(_args())
    check_qk_clip_args(_args(transformer_impl="transformer_engine"), te_version=(2, 9))
    check_qk_clip_args(_args(canzona=False), te_version=(2, 10))
    check_qk_clip_args(_args(qk_clip=False, qk_clip_alpha=7.0))  # neither flag: nothing is read


def test_projected_cost_at_qwen3_32b_tp8_dp32() -> None:
    """The numbers docs/qk_clip.md quotes, from the model's shapes and the cluster's link."""
    from megatron.canzona.planning.sim.cluster import load_cluster
    from megatron.canzona.planning.sim.qk_clip import main, qk_clip_cost

    cluster = load_cluster("h100-ib400")
    cost = qk_clip_cost("qwen3-32b", tp=8, dp=32, cluster=cluster)
    assert cost.table_bytes == 4 * 64 * 64 // 8  # 64 layers, 8 of the 64 heads per TP rank
    assert cost.ranks == 32
    assert cost.clip_bytes == 8 * 2 * (64 + 2 * 8) * 128 // 8 * 5120  # 2 of the 64 matrices per DP rank
    link = cluster.inter_node  # a DP group of TP 8 spans nodes
    assert cost.tree_s == pytest.approx(2 * 5 * link.latency_s + 2 * cost.table_bytes / link.bytes_per_s)
    assert cost.ring_s > cost.tree_s > 0 and cost.host_syncs == 0
    alone = qk_clip_cost("qwen3-32b", tp=8, dp=1, cluster=cluster)
    assert alone.ring_s == alone.tree_s == 0.0 and alone.clip_bytes == 64 * cost.clip_bytes // 2
    with pytest.raises(SystemExit):
        main(["--dp", "0"])


def test_start_up_line() -> None:
    line = qk_clip_line(clip=True, threshold=0.1, alpha=0.5, attention="DotProductAttention", qk_layernorm=False)
    assert line == "[canzona] QK-clip: threshold 0.1, alpha 0.5, logits from Megatron's local attention"
    line = qk_clip_line(clip=True, threshold=100.0, alpha=0.5, attention="TEDotProductAttention", qk_layernorm=True)
    assert "transformer-engine's attention" in line and "cannot lower the logits" in line and "\n" not in line
    line = qk_clip_line(clip=False, threshold=100.0, alpha=0.5, attention="ContextParallelAttention", qk_layernorm=True)
    assert line == "[canzona] max attention logit: logged from the CPU context-parallel attention, no clip"
