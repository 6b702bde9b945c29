"""Qwen3 catalog: shapes and parameter counts against the published model cards."""

import pytest

from megatron.canzona.planning import QWEN3_MODELS, qwen3_specs
from megatron.canzona.planning.qwen3 import get_qwen3_config

pytestmark = pytest.mark.quick

# Published non-embedding parameter counts (billions, as rounded on the model cards).
PUBLISHED_NON_EMBEDDING = {
    "qwen3-0.6b": 0.44, "qwen3-1.7b": 1.4, "qwen3-4b": 3.6, "qwen3-8b": 6.95, "qwen3-14b": 13.2, "qwen3-32b": 31.2,
}
ROUNDING = 0.05  # the cards round to 2-3 significant digits


@pytest.mark.parametrize("model", sorted(PUBLISHED_NON_EMBEDDING))
def test_non_embedding_parameters_match_model_card(model):
    specs = qwen3_specs(model)
    count = sum(s.global_numel for s in specs if "embedding" not in s.name and "output_layer" not in s.name)
    assert count / 1e9 == pytest.approx(PUBLISHED_NON_EMBEDDING[model], rel=ROUNDING)


def test_backprop_order_is_reverse_registration_and_unique():
    specs = qwen3_specs("qwen3-8b")
    assert [s.order for s in specs] == list(range(len(specs) - 1, -1, -1))
    assert len({s.name for s in specs}) == len(specs)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_local_shapes(tp):
    by_name = {s.name: s for s in qwen3_specs("qwen3-32b", tp_size=tp)}
    qkv = by_name["decoder.layers.0.self_attention.linear_qkv.weight"]
    proj = by_name["decoder.layers.0.self_attention.linear_proj.weight"]
    assert qkv.global_shape == ((64 + 16) * 128, 5120) and qkv.local_shape == ((64 + 16) * 128 // tp, 5120)
    assert proj.local_shape == (5120, 64 * 128 // tp)
    emb = by_name["embedding.word_embeddings.weight"]
    assert emb.family == "elementwise" and emb.global_shape[0] % (128 * tp) == 0


def test_split_blocks_cover_the_fused_tensor():
    for s in qwen3_specs("qwen3-14b", split_qkv=True, split_gate_up=True):
        if s.blocks:
            assert sum(m for m, _ in s.blocks) == s.global_shape[0]
            assert all(n == s.global_shape[1] for _, n in s.blocks)
    names = [s.name for s in qwen3_specs("qwen3-14b") if s.family == "matrix"]
    assert all(n.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")) for n in names)


def test_tied_models_have_no_output_layer():
    for name, cfg in QWEN3_MODELS.items():
        has_output = any(s.name == "output_layer.weight" for s in qwen3_specs(name))
        assert has_output == (not cfg.tied_embeddings)


def test_bad_model_and_tp_errors_say_what_to_do():
    with pytest.raises(ValueError, match="choose one of"):
        get_qwen3_config("llama-7b")
    with pytest.raises(ValueError, match="divisible by tp_size=16"):
        qwen3_specs("qwen3-8b", tp_size=16)
