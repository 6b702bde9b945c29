"""Qwen3 in two layouts: Megatron-Core's GPT and Hugging Face's ``Qwen3ForCausalLM``.

Pure tensor and dictionary work (no Megatron-Core, no process groups), used by
``tools/convert_hf.py``. Names on the Megatron side are those of its ``torch_dist``
checkpoints with the layer number put back, e.g.
``decoder.layers.3.self_attention.linear_qkv.weight``: the checkpoint stacks every layer's
tensor along a leading dimension of global layer numbers, whatever the TP and PP sizes,
and names the input norms after the fused transformer-engine layers
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) even for the local
spec, whose modules call them ``input_layernorm`` and ``pre_mlp_layernorm``.

Two tensors are fused differently:

* ``linear_qkv.weight`` holds, for each of the ``num_query_groups`` key/value groups in
  turn, the rows of that group's query heads, then its key head, then its value head
  (``[g0: q q k v | g1: q q k v | ...]`` with two query heads per group). Hugging Face keeps
  ``q_proj`` (all query heads in order), ``k_proj`` and ``v_proj`` apart; query head ``j``
  belongs to group ``j // (num_attention_heads // num_query_groups)`` in both.
* ``linear_fc1.weight`` is ``[gate; up]`` (SwiGLU applies SiLU to the first half), which is
  Hugging Face's ``gate_proj`` stacked on ``up_proj``.

A checkpoint's global tensors have these layouts at every TP size (each TP rank saves its
whole query groups, and the gate and up halves of its fc1 shard at their global offsets),
which are those of an unsharded model: ``megatron.canzona.optim``'s ``QKVLayout`` and
``GateUpLayout(num_partitions=1)``, the layouts the optimizers split, split them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from megatron.canzona.optim.split import GateUpLayout, QKVLayout
from megatron.canzona.planning.qwen3 import Qwen3Config

ARCHITECTURE = "Qwen3ForCausalLM"
"""The Hugging Face class a converted directory loads as."""
MODEL_TYPE = "qwen3"
MOE_ARCHITECTURE = "Qwen3MoeForCausalLM"
"""The class of an exported mixture-of-experts model (every layer's MLP a mixture: Qwen3-30B-A3B, 235B-A22B)."""
MOE_MODEL_TYPE = "qwen3_moe"

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
LAYER_PREFIX = "decoder.layers."

# Per-layer tensors: Megatron name (after ``decoder.layers.N.``) -> Hugging Face names (after
# ``model.layers.N.``), one for a plain copy, several for a fused tensor.
LAYER_TENSORS: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
MOE_LAYER_TENSORS: dict[str, tuple[str, ...]] = {
    **{name: hf for name, hf in LAYER_TENSORS.items() if not name.startswith(("mlp.linear_fc1.weight", "mlp.linear_fc2"))},
    "mlp.router.weight": ("mlp.gate.weight",),
}
"""A mixture-of-experts layer's tensors besides its experts: the router instead of the dense MLP
(its pre-MLP norm is stored as ``mlp.linear_fc1.layer_norm_weight`` there too)."""
EXPERT_TENSORS: dict[str, tuple[str, ...]] = {
    "linear_fc1.weight": ("gate_proj.weight", "up_proj.weight"),
    "linear_fc2.weight": ("down_proj.weight",),
}
"""Per expert (after ``mlp.experts.local_experts.E.``, E the global expert index) -> Hugging Face's
(after ``mlp.experts.E.``: the per-expert names of the published checkpoints, which transformers
5 merges into its fused expert tensors on load)."""
_KNOWN_LAYER_TENSORS = LAYER_TENSORS | MOE_LAYER_TENSORS
STACKED_EXPERTS = "mlp.experts.experts."
"""How ``torch_dist`` stores a SequentialMLP's experts: one tensor per name, ``(layers, experts, ...)``."""
GLOBAL_TENSORS: dict[str, str] = {
    EMBEDDING: "model.embed_tokens.weight",
    FINAL_NORM: "model.norm.weight",
    OUTPUT_LAYER: "lm_head.weight",
}
LOCAL_SPEC_NAMES: dict[str, str] = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
"""Module names of Megatron's local layer spec -> the checkpoint's (transformer-engine) names."""

_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT_NAME = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")


class ConversionError(ValueError):
    """A checkpoint or directory that cannot be converted; the message names the fix."""


def layer_tensors(arch: Qwen3Config) -> dict[str, tuple[str, ...]]:
    """The per-layer tensors (besides the experts) of ``arch``: :data:`LAYER_TENSORS` or :data:`MOE_LAYER_TENSORS`."""
    return MOE_LAYER_TENSORS if arch.is_moe else LAYER_TENSORS


def megatron_shapes(arch: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Global shape of every Megatron tensor of a Qwen3 model, per-layer (and per-expert) names included."""
    h, d, f = arch.hidden_size, arch.kv_channels, arch.ffn_hidden_size
    per_layer = {
        "self_attention.linear_qkv.layer_norm_weight": (h,),
        "self_attention.linear_qkv.weight": ((arch.num_attention_heads + 2 * arch.num_query_groups) * d, h),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        "self_attention.linear_proj.weight": (h, arch.num_attention_heads * d),
        "mlp.linear_fc1.layer_norm_weight": (h,),
        "mlp.linear_fc1.weight": (2 * f, h),
        "mlp.linear_fc2.weight": (h, f),
    }
    if arch.is_moe:
        m = arch.moe_ffn_hidden_size
        per_layer = {name: shape for name, shape in per_layer.items() if name in MOE_LAYER_TENSORS}
        per_layer["mlp.router.weight"] = (arch.num_experts, h)
        per_layer.update({f"mlp.experts.local_experts.{e}.{name}": shape for e in range(arch.num_experts)
                          for name, shape in (("linear_fc1.weight", (2 * m, h)), ("linear_fc2.weight", (h, m)))})
    shapes = {EMBEDDING: (arch.vocab_size, h)}
    for layer in range(arch.num_layers):
        shapes.update({f"{LAYER_PREFIX}{layer}.{name}": shape for name, shape in per_layer.items()})
    shapes[FINAL_NORM] = (h,)
    if not arch.tied_embeddings:
        shapes[OUTPUT_LAYER] = (arch.vocab_size, h)
    return shapes


def num_parameters(arch: Qwen3Config) -> int:
    return sum(math.prod(shape) for shape in megatron_shapes(arch).values())


# --------------------------------------------------------------------------- names


def hf_names(megatron_name: str) -> tuple[str, ...]:
    """The Hugging Face tensors one Megatron tensor becomes (in the order :func:`to_hf` returns)."""
    if megatron_name in GLOBAL_TENSORS:
        return (GLOBAL_TENSORS[megatron_name],)
    match = _LAYER_NAME.fullmatch(megatron_name)
    expert = _EXPERT_NAME.fullmatch(match[2]) if match is not None else None
    if expert is not None and expert[2] in EXPERT_TENSORS:
        return tuple(f"model.layers.{match[1]}.mlp.experts.{expert[1]}.{name}" for name in EXPERT_TENSORS[expert[2]])
    if match is None or match[2] not in _KNOWN_LAYER_TENSORS:
        raise ConversionError(f"{megatron_name} is not a tensor of a Qwen3 GPT model")
    return tuple(f"model.layers.{match[1]}.{name}" for name in _KNOWN_LAYER_TENSORS[match[2]])


def checkpoint_name(module_name: str) -> str:
    """A parameter name of a local-spec model (``decoder.layers.0.input_layernorm.weight``)
    as the checkpoint names it (``decoder.layers.0.self_attention.linear_qkv.layer_norm_weight``)."""
    match = _LAYER_NAME.fullmatch(module_name)
    if match is None or match[2] not in LOCAL_SPEC_NAMES:
        return module_name
    return f"{LAYER_PREFIX}{match[1]}.{LOCAL_SPEC_NAMES[match[2]]}"


# --------------------------------------------------------------------------- tensors


def to_hf(megatron_name: str, tensor: torch.Tensor, arch: Qwen3Config) -> dict[str, torch.Tensor]:
    """One Megatron tensor as its Hugging Face tensor(s), keyed by name. The embedding and
    output layer keep their first ``arch.vocab_size`` rows (all of them unless trimmed)."""
    names = hf_names(megatron_name)
    layout = _fused_layout(megatron_name, arch)
    if layout is not None:
        parts = layout.split(tensor)
    elif megatron_name in (EMBEDDING, OUTPUT_LAYER):
        parts = (tensor[: arch.vocab_size],)
    else:
        parts = (tensor,)
    return dict(zip(names, parts, strict=True))


def from_hf(megatron_name: str, tensors: Mapping[str, torch.Tensor], arch: Qwen3Config) -> torch.Tensor:
    """The Megatron tensor made of Hugging Face ``tensors`` (which hold at least its :func:`hf_names`)."""
    parts = [tensors[name] for name in hf_names(megatron_name)]
    layout = _fused_layout(megatron_name, arch)
    return parts[0] if layout is None else layout.merge(parts)


def _fused_layout(megatron_name: str, arch: Qwen3Config) -> QKVLayout | GateUpLayout | None:
    """How a checkpoint tensor splits into Hugging Face's: a whole (TP-unsharded) fused QKV or fc1."""
    if megatron_name.endswith("linear_qkv.weight"):
        return QKVLayout(num_query_groups=arch.num_query_groups, heads_per_group=arch.heads_per_group,
                         head_dim=arch.kv_channels)
    if megatron_name.endswith("linear_fc1.weight"):
        return GateUpLayout(num_partitions=1)
    return None


# --------------------------------------------------------------------------- configs

# Megatron arguments a Qwen3 model has at one value: (attribute, that value, the flag that sets
# it). Read with that value as default: older checkpoints may lack an attribute.
_QWEN3_ARGS: tuple[tuple[str, Any, str], ...] = (
    ("normalization", "RMSNorm", "--normalization RMSNorm"),
    ("swiglu", True, "--swiglu"),
    ("qk_layernorm", True, "--qk-layernorm"),
    ("position_embedding_type", "rope", "--position-embedding-type rope"),
    ("add_bias_linear", False, "--disable-bias-linear"),
    ("rotary_percent", 1.0, "--rotary-percent 1.0"),
)
# Megatron arguments a Qwen3 model leaves off (false or unset), each set by the flag of its name.
_QWEN3_OFF: tuple[str, ...] = (
    "add_qkv_bias", "multi_latent_attention", "rotary_interleaved", "use_rope_scaling",
    "rotary_seq_len_interpolation_factor", "apply_layernorm_1p", "layernorm_zero_centered_gamma",
    "apply_residual_connection_post_layernorm", "qk_l2_norm", "attention_output_gate", "squared_relu", "window_size",
    "no_rope_freq", "mtp_num_layers", "heterogeneous_layers_config_path",
)


# A Qwen3-MoE router and MLP, as Megatron's flags give them: (attribute, Qwen3-MoE's value, the flag).
_QWEN3_MOE_ARGS: tuple[tuple[str, Any, str], ...] = (
    ("moe_router_score_function", "softmax", "--moe-router-score-function softmax"),
    ("moe_layer_freq", 1, "--moe-layer-freq 1 (every layer a mixture)"),
    ("moe_shared_expert_intermediate_size", None, "no --moe-shared-expert-intermediate-size"),
    ("moe_router_enable_expert_bias", False, "no --moe-router-enable-expert-bias"),
    ("moe_router_topk_scaling_factor", None, "no --moe-router-topk-scaling-factor"),
    ("moe_router_num_groups", None, "no --moe-router-num-groups"),
    ("moe_grouped_gemm", False, "no --moe-grouped-gemm (the export reads SequentialMLP experts)"),
)


def arch_from_megatron_args(args: Any) -> Qwen3Config:
    """The architecture of a checkpoint saved by ``pretrain_gpt.py`` (its Megatron ``args``);
    ``vocab_size`` is Megatron's padded vocabulary."""
    wrong = [(attribute, getattr(args, attribute, qwen3), flag) for attribute, qwen3, flag in _QWEN3_ARGS
             if getattr(args, attribute, qwen3) != qwen3]
    wrong += [(attribute, getattr(args, attribute), "no --" + attribute.replace("_", "-"))
              for attribute in _QWEN3_OFF if getattr(args, attribute, None)]
    if wrong:
        attribute, value, flag = wrong[0]
        raise ConversionError(
            f"the checkpoint was trained with {attribute}={value!r}; a Qwen3 model needs {flag}: "
            "only Qwen3-architecture checkpoints export (examples/qwen3/common.sh has the flags)")
    experts = getattr(args, "num_experts", None) or 0
    if experts:
        for attribute, qwen3, flag in _QWEN3_MOE_ARGS:
            if getattr(args, attribute, qwen3) != qwen3:
                raise ConversionError(
                    f"the checkpoint was trained with {attribute}={getattr(args, attribute)!r}; a Qwen3-MoE model "
                    f"needs {flag}: only Qwen3-architecture checkpoints export")
    heads = args.num_attention_heads
    return Qwen3Config(
        num_experts=experts,
        moe_ffn_hidden_size=(getattr(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size) if experts else 0,
        moe_router_topk=args.moe_router_topk if experts else 0,
        moe_norm_topk_prob=not getattr(args, "moe_router_pre_softmax", False),
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else heads,
        kv_channels=args.kv_channels or args.hidden_size // heads,
        vocab_size=args.padded_vocab_size,
        norm_epsilon=args.norm_epsilon if hasattr(args, "norm_epsilon") else args.layernorm_epsilon,
        rotary_base=args.rotary_base,
        tied_embeddings=not args.untie_embeddings_and_output_weights,
        max_position_embeddings=args.max_position_embeddings,
        init_method_std=args.init_method_std,
    )


def _not_qwen3(path: str, what: str) -> ConversionError:
    return ConversionError(f"{path}: {what}; only Qwen3 dense models ({ARCHITECTURE}) import: pass a Qwen3 "
                           "model directory")


def _rope_theta(config: Mapping[str, Any], path: str) -> float:
    """RoPE theta from a transformers 4 (``rope_theta``, ``rope_scaling``) or 5 (``rope_parameters``) config."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    for rope in (parameters, scaling):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise _not_qwen3(path, f"RoPE scaling {kind!r} has no Megatron flag here (use a config without rope_scaling)")
    theta = parameters.get("rope_theta", config.get("rope_theta"))
    if theta is None or not float(theta).is_integer():
        # Megatron's --rotary-base is an integer (Qwen3's is 1000000).
        raise _not_qwen3(path, f"rope_theta {theta!r} is not a whole number")
    return float(theta)


def arch_from_hf_config(config: Mapping[str, Any], path: str = "config.json") -> Qwen3Config:
    """The architecture of a Hugging Face Qwen3 ``config.json`` (as a dict)."""
    model_type, architectures = config.get("model_type"), config.get("architectures")
    if model_type != MODEL_TYPE or ARCHITECTURE not in (architectures or [ARCHITECTURE]):
        raise _not_qwen3(path, f"model_type {model_type!r}" + (f", architectures {architectures}" if architectures else ""))
    checks = (
        (config.get("hidden_act", "silu") == "silu", f"hidden_act {config.get('hidden_act')!r} (Qwen3 uses silu)"),
        (not config.get("attention_bias", False), "attention_bias is true (Qwen3 has no biases)"),
        (not config.get("use_sliding_window", False), "use_sliding_window is true"),
        (set(config.get("layer_types") or ["full_attention"]) == {"full_attention"}, "some layers are not full attention"),
    )
    for ok, what in checks:
        if not ok:
            raise _not_qwen3(path, what)
    heads = config["num_attention_heads"]
    return Qwen3Config(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        kv_channels=config.get("head_dim") or config["hidden_size"] // heads,
        vocab_size=config["vocab_size"],
        norm_epsilon=config.get("rms_norm_eps", 1e-6),
        rotary_base=_rope_theta(config, path),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=config.get("max_position_embeddings", 40960),
        init_method_std=config.get("initializer_range", 0.02),
    )


def hf_config(arch: Qwen3Config, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of a Hugging Face Qwen3 model with this architecture.

    RoPE and the dtype are written the transformers 4 way (``rope_theta``, ``torch_dtype``)
    and the transformers 5 way (``rope_parameters``, ``dtype``), so either version reads them."""
    dtype_name = str(dtype).removeprefix("torch.")
    moe = {}
    if arch.is_moe:  # every layer a mixture of num_experts, top-k renormalized unless pre-softmax
        moe = {"num_experts": arch.num_experts, "num_local_experts": arch.num_experts,
               "num_experts_per_tok": arch.moe_router_topk, "moe_intermediate_size": arch.moe_ffn_hidden_size,
               "norm_topk_prob": arch.moe_norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": [],
               "output_router_logits": False, "router_aux_loss_coef": 0.0}
    return {
        "architectures": [MOE_ARCHITECTURE if arch.is_moe else ARCHITECTURE],
        "model_type": MOE_MODEL_TYPE if arch.is_moe else MODEL_TYPE,
        **moe,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.ffn_hidden_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_query_groups,
        "head_dim": arch.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.norm_epsilon,
        "rope_theta": arch.rotary_base,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": arch.rotary_base},
        "tie_word_embeddings": arch.tied_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": arch.num_layers,
        "initializer_range": arch.init_method_std,
        "use_cache": True,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


def vocab_divisor(vocab_size: int) -> int:
    """A ``--make-vocab-size-divisible-by`` that makes Megatron pad a tokenizer to exactly
    ``vocab_size`` rows: ``vocab_size / gcd(vocab_size, 128)``.

    Megatron pads to a multiple of divisor × TP; with this divisor ``vocab_size`` is such a
    multiple for every TP size that divides ``gcd(vocab_size, 128)``, so a tokenizer of more
    than ``vocab_size - divisor * TP`` entries pads to it (Qwen3's 151,669 tokens -> 151,936
    rows: divisor 1187, TP up to 128; examples/qwen3/common.sh uses the same rule)."""
    return vocab_size // math.gcd(vocab_size, 128)


def megatron_flags(arch: Qwen3Config) -> list[str]:
    """The ``pretrain_gpt.py`` flags of this architecture, as examples/qwen3/common.sh spells
    them (without ``--seq-length``/``--max-position-embeddings``: those are the run's choice)."""
    flags = [
        "--num-layers", str(arch.num_layers), "--hidden-size", str(arch.hidden_size),
        "--ffn-hidden-size", str(arch.ffn_hidden_size),
        "--num-attention-heads", str(arch.num_attention_heads), "--group-query-attention",
        "--num-query-groups", str(arch.num_query_groups), "--kv-channels", str(arch.kv_channels),
        "--normalization", "RMSNorm", "--norm-epsilon", _number(arch.norm_epsilon), "--swiglu",
        "--qk-layernorm", "--disable-bias-linear",
        "--position-embedding-type", "rope", "--rotary-base", _number(arch.rotary_base),
        "--make-vocab-size-divisible-by", str(vocab_divisor(arch.vocab_size)),
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    ]
    if not arch.tied_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    return flags


def _number(value: float) -> str:
    """``1000000`` and ``1e-06`` rather than ``1000000.0`` and ``1e-06``: integers without a point."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
