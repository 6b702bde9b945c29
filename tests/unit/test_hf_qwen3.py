"""megatron.canzona.hf and the file side of tools/convert_hf.py (no Megatron-Core, no transformers).

The layouts are checked against tensors whose every row says which head it belongs to; the
end-to-end check of the same mapping against real Megatron and transformers forward passes
is tests/e2e/test_convert_hf.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.canzona.hf import ConversionError, arch_from_hf_config, arch_from_megatron_args, checkpoint_name
from megatron.canzona.hf import from_hf, hf_config, hf_names, megatron_flags, megatron_shapes, num_parameters
from megatron.canzona.hf import to_hf, vocab_divisor
from megatron.canzona.planning import Qwen3Config

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[2]
TINY = Qwen3Config(num_layers=2, hidden_size=8, ffn_hidden_size=12, num_attention_heads=4, num_query_groups=2,
                 kv_channels=3, vocab_size=16, norm_epsilon=1e-6, rotary_base=1000000.0, tied_embeddings=False,
                 max_position_embeddings=32)


def _converter():
    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "tools" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _labelled_rows(num_heads: int, head_dim: int, label: int) -> torch.Tensor:
    """Rows ``label*1000 + head*10 + row-in-head`` (one column): each row names its head."""
    return torch.tensor([[label * 1000 + head * 10 + row] for head in range(num_heads) for row in range(head_dim)],
                        dtype=torch.float64)


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 4), per_group=st.integers(1, 4), head_dim=st.integers(1, 4))
def test_qkv_rows_go_to_the_heads_of_their_group(groups: int, per_group: int, head_dim: int) -> None:
    arch = replace(TINY, num_attention_heads=groups * per_group, num_query_groups=groups, kv_channels=head_dim)
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    hf = {"model.layers.1.self_attn.q_proj.weight": _labelled_rows(groups * per_group, head_dim, 1),
          "model.layers.1.self_attn.k_proj.weight": _labelled_rows(groups, head_dim, 2),
          "model.layers.1.self_attn.v_proj.weight": _labelled_rows(groups, head_dim, 3)}
    fused = from_hf(name, hf, arch)
    # Megatron's order: per group g, query heads g*per_group.., then key head g, then value head g.
    expected = []
    for g in range(groups):
        expected += [(1, g * per_group + j) for j in range(per_group)] + [(2, g), (3, g)]
    heads = [(int(row // 1000), int(row % 1000 // 10)) for row in fused[::head_dim, 0]]
    assert heads == expected
    back = to_hf(name, fused, arch)
    assert back.keys() == hf.keys() and all(torch.equal(back[key], hf[key]) for key in hf)


def test_fc1_is_gate_then_up() -> None:
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    gate, up = torch.randn(12, 8), torch.randn(12, 8)
    fused = from_hf(name, {"model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up}, TINY)
    assert torch.equal(fused[:12], gate) and torch.equal(fused[12:], up)


@pytest.mark.parametrize("tied", [False, True])
def test_every_tensor_round_trips_bitwise(tied: bool) -> None:
    arch = replace(TINY, tied_embeddings=tied)
    shapes = megatron_shapes(arch)
    assert ("output_layer.weight" in shapes) is not tied
    assert sum(t.numel() for t in map(torch.empty, shapes.values())) == num_parameters(arch)
    for name, shape in shapes.items():
        tensor = torch.randn(shape)
        hf = to_hf(name, tensor, arch)
        assert tuple(hf) == hf_names(name)
        assert torch.equal(from_hf(name, hf, arch), tensor), name


def test_trimmed_vocabulary_keeps_the_first_rows() -> None:
    embedding = torch.randn(16, 8)
    trimmed = to_hf("embedding.word_embeddings.weight", embedding, replace(TINY, vocab_size=11))
    assert torch.equal(trimmed["model.embed_tokens.weight"], embedding[:11])


def test_local_spec_norms_take_the_checkpoint_names() -> None:
    assert checkpoint_name("decoder.layers.4.input_layernorm.weight") == "decoder.layers.4.self_attention.linear_qkv.layer_norm_weight"
    assert checkpoint_name("decoder.layers.4.pre_mlp_layernorm.weight") == "decoder.layers.4.mlp.linear_fc1.layer_norm_weight"
    assert checkpoint_name("decoder.final_layernorm.weight") == "decoder.final_layernorm.weight"
    assert hf_names("decoder.layers.4.mlp.linear_fc1.layer_norm_weight") == ("model.layers.4.post_attention_layernorm.weight",)
    with pytest.raises(ConversionError, match="not a tensor of a Qwen3"):
        hf_names("decoder.layers.0.mlp.shared_experts.linear_fc1.weight")


# --- configs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_hf_config_reads_back_as_the_same_architecture(tied: bool) -> None:
    arch = replace(TINY, tied_embeddings=tied)
    config = hf_config(arch, torch.bfloat16)
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 1000000.0
    assert arch_from_hf_config(config) == arch


def test_transformers_4_and_5_rope_fields_both_read() -> None:
    config = hf_config(TINY, torch.float32)
    config.pop("rope_parameters")
    assert arch_from_hf_config(config).rotary_base == 1000000.0
    config = hf_config(TINY, torch.float32)
    del config["rope_theta"], config["rope_scaling"]
    assert arch_from_hf_config(config).rotary_base == 1000000.0


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "model_type 'llama'"),
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}, "qwen3_moe"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True}, "sliding_window"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.5}}, "not a whole number"),
])
def test_non_qwen3_configs_are_refused_with_the_reason(change: dict, message: str) -> None:
    with pytest.raises(ConversionError, match="only Qwen3 dense models") as error:
        arch_from_hf_config({**hf_config(TINY, torch.float32), **change}, "x/config.json")
    assert message in str(error.value) and "\n" not in str(error.value)


def _megatron_args(**changes) -> argparse.Namespace:
    """The attributes a pretrain_gpt.py checkpoint records, for :data:`TINY`."""
    args = argparse.Namespace(
        num_layers=2, hidden_size=8, ffn_hidden_size=12, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, kv_channels=3, padded_vocab_size=16, layernorm_epsilon=1e-6, rotary_base=1000000,
        untie_embeddings_and_output_weights=True, max_position_embeddings=32, init_method_std=0.02,
        normalization="RMSNorm", swiglu=True, qk_layernorm=True, position_embedding_type="rope",
        add_bias_linear=False, add_qkv_bias=False, num_experts=None, rotary_percent=1.0)
    for key, value in changes.items():
        setattr(args, key, value)
    return args


def test_megatron_args_give_the_architecture() -> None:
    assert arch_from_megatron_args(_megatron_args()) == TINY
    no_gqa = arch_from_megatron_args(_megatron_args(group_query_attention=False, num_query_groups=None))
    assert no_gqa.num_query_groups == 4


@pytest.mark.parametrize("change, flag", [
    ({"normalization": "LayerNorm"}, "--normalization RMSNorm"),
    ({"swiglu": False}, "--swiglu"),
    ({"qk_layernorm": False}, "--qk-layernorm"),
    ({"add_bias_linear": True}, "--disable-bias-linear"),
    ({"num_experts": 8, "moe_router_score_function": "sigmoid", "moe_router_topk": 2},
     "Qwen3-MoE model needs --moe-router-score-function softmax"),
    ({"num_experts": 8, "moe_shared_expert_intermediate_size": 16, "moe_router_topk": 2},
     "needs no --moe-shared-expert-intermediate-size"),
    ({"apply_layernorm_1p": True}, "needs no --apply-layernorm-1p"),
    ({"position_embedding_type": "learned_absolute"}, "--position-embedding-type rope"),
])
def test_non_qwen3_checkpoints_are_refused_with_the_flag(change: dict, flag: str) -> None:
    with pytest.raises(ConversionError, match="only Qwen3-architecture checkpoints export") as error:
        arch_from_megatron_args(_megatron_args(**change))
    assert flag in str(error.value)


def test_a_mixture_maps_its_router_and_every_expert() -> None:
    """Qwen3-MoE (every layer a mixture): the router is ``mlp.gate``, expert E's fc1 its gate and up
    projections, its fc2 ``down_proj``, by global index; no dense MLP; ``config.json`` the
    Qwen3-MoE one, top-k renormalized unless the run routed with ``--moe-router-pre-softmax``."""
    arch = arch_from_megatron_args(_megatron_args(num_experts=4, moe_ffn_hidden_size=6, moe_router_topk=2,
                                                  moe_router_score_function="softmax"))
    assert arch.is_moe and (arch.num_experts, arch.moe_ffn_hidden_size, arch.moe_router_topk) == (4, 6, 2)
    shapes = megatron_shapes(arch)
    assert "decoder.layers.0.mlp.linear_fc1.weight" not in shapes
    assert shapes["decoder.layers.1.mlp.router.weight"] == (4, 8)
    assert shapes["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"] == (12, 8)
    assert hf_names("decoder.layers.1.mlp.router.weight") == ("model.layers.1.mlp.gate.weight",)
    fc1 = torch.arange(12 * 8, dtype=torch.float32).view(12, 8)
    out = to_hf("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", fc1, arch)
    assert list(out) == ["model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight"]
    assert torch.equal(out["model.layers.1.mlp.experts.3.gate_proj.weight"], fc1[:6])
    assert hf_names("decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight") == \
        ("model.layers.0.mlp.experts.2.down_proj.weight",)
    config = hf_config(arch, torch.float32)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
            config["norm_topk_prob"]) == (4, 2, 6, True)
    pre = arch_from_megatron_args(_megatron_args(num_experts=4, moe_ffn_hidden_size=6, moe_router_topk=2,
                                                 moe_router_pre_softmax=True))
    assert hf_config(pre, torch.float32)["norm_topk_prob"] is False


def test_flags_describe_the_architecture() -> None:
    flags = megatron_flags(TINY)
    text = " ".join(flags)
    assert "--num-query-groups 2 --kv-channels 3" in text and "--rotary-base 1000000 " in text
    assert "--norm-epsilon 1e-06" in text and "--untie-embeddings-and-output-weights" in flags
    assert "--untie-embeddings-and-output-weights" not in megatron_flags(replace(TINY, tied_embeddings=True))


def _megatron_padding(tokenizer_size: int, divisor: int, tp_size: int) -> int:
    multiple = divisor * tp_size
    return -(-tokenizer_size // multiple) * multiple


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(1, 300_000), tp_power=st.integers(0, 7))
def test_vocab_divisor_pads_a_nearly_full_tokenizer_to_the_saved_rows(vocab: int, tp_power: int) -> None:
    divisor, tp_size = vocab_divisor(vocab), 2**tp_power
    if vocab % (divisor * tp_size):
        return  # TP sizes that do not divide gcd(vocab, 128) cannot pad to vocab
    for tokenizer_size in (vocab, max(1, vocab - divisor * tp_size + 1)):
        assert _megatron_padding(tokenizer_size, divisor, tp_size) == vocab


def test_vocab_divisor_of_qwen3_is_the_recipes() -> None:
    assert vocab_divisor(151936) == 151936 // 128 == 1187
    assert _megatron_padding(151669, 1187, 8) == 151936


# --- the tool's file handling ----------------------------------------------------------------


def test_weights_are_sharded_with_an_index_above_the_shard_size(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    convert_hf = _converter()
    writer = convert_hf.SafetensorsWriter(tmp_path, max_shard_bytes=100)
    tensors = {f"t{i}": torch.randn(5, 2) for i in range(5)}  # 40 bytes each: two per shard
    for name, tensor in tensors.items():
        writer.add(name, tensor, torch.float32)
    files = writer.close()
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 200 and index["weight_map"]["t4"] == files[2].name
    loaded = {name: tensor for f in files for name, tensor in load_file(str(f)).items()}
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())
    assert not list(tmp_path.glob(".shard-*"))


def test_one_file_below_the_shard_size_and_stacked_views_are_copied(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    convert_hf = _converter()
    writer = convert_hf.SafetensorsWriter(tmp_path, max_shard_bytes=10**6)
    stacked = torch.randn(3, 4)
    for layer, row in enumerate(stacked.unbind(0)):  # views of one storage
        writer.add(f"layer{layer}", row, torch.bfloat16)
    assert [f.name for f in writer.close()] == ["model.safetensors"]
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert loaded["layer2"].dtype == torch.bfloat16 and torch.equal(loaded["layer2"], stacked[2].bfloat16())


def test_checkpoint_directory_follows_the_tracker(tmp_path: Path) -> None:
    convert_hf = _converter()
    for name in ("iter_0000004", "iter_0000008", "release"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(b"")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("8")
    assert convert_hf.checkpoint_dir(tmp_path, None).name == "iter_0000008"
    assert convert_hf.checkpoint_dir(tmp_path, 4).name == "iter_0000004"
    assert convert_hf.checkpoint_dir(tmp_path / "iter_0000004", None).name == "iter_0000004"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    assert convert_hf.checkpoint_dir(tmp_path, None).name == "release"
    (tmp_path / "iter_0000004" / "mp_rank_00").mkdir()
    with pytest.raises(ConversionError, match="--ckpt-format torch checkpoint"):
        convert_hf.checkpoint_dir(tmp_path, 4)


def _llama_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    return path


def _qwen3_dir_without_weights(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config(TINY, torch.float32)))
    return path


BAD_INPUT = {
    "export-not-a-checkpoint": (lambda tmp: ["export", "--load", str(tmp), "--save", str(tmp / "hf")],
                                "is not a Megatron checkpoint directory (no latest_checkpointed_iteration.txt): pass"),
    "export-no-such-dir": (lambda tmp: ["export", "--load", str(tmp / "nope"), "--save", str(tmp / "hf")],
                           "does not exist: pass the --save directory"),
    "export-missing-iteration": (lambda tmp: ["export", "--load", str(tmp), "--iteration", "7", "--save", str(tmp / "hf")],
                                 "pass --iteration N of a saved iteration"),
    "import-not-qwen3": (lambda tmp: ["import", "--hf", str(_llama_dir(tmp / "llama")), "--save", str(tmp / "ckpt")],
                         "model_type 'llama'"),
    "import-no-config": (lambda tmp: ["import", "--hf", str(tmp), "--save", str(tmp / "ckpt")],
                         "has no config.json: pass a Hugging Face model directory"),
    "import-no-weights": (lambda tmp: ["import", "--hf", str(_qwen3_dir_without_weights(tmp / "q")), "--save",
                                       str(tmp / "ckpt")], "save_pretrained(..., safe_serialization=True)"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_returns_2_with_one_line_naming_the_fix(tmp_path: Path, case: str, capsys) -> None:
    make_args, fix = BAD_INPUT[case]
    assert _converter().main(make_args(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("convert_hf.py: error: ") and fix in err[0], err


def test_tokenizer_files_are_copied_when_present(tmp_path: Path) -> None:
    convert_hf = _converter()
    source, destination = tmp_path / "tokenizer", tmp_path / "hf"
    source.mkdir()
    destination.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "notes.txt"):
        (source / name).write_text(name)
    assert convert_hf.copy_tokenizer(source, destination) == ["tokenizer.json", "tokenizer_config.json",
                                                                "generation_config.json"]
    assert (destination / "tokenizer.json").read_text() == "tokenizer.json" and not (destination / "notes.txt").exists()
    assert convert_hf.copy_tokenizer(None, destination) == []
    run = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(source))
    assert convert_hf.run_tokenizer(run) == source
    assert convert_hf.run_tokenizer(argparse.Namespace(tokenizer_type="SentencePieceTokenizer",
                                                        tokenizer_model=str(source))) is None
