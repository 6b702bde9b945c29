"""Qwen3 dense architectures as parameter descriptions with Megatron-Core naming.

Names, shapes and registration order follow Megatron-Core's GPT model with the local
layer spec (``input_layernorm``, then attention ``linear_proj`` before the fused
``linear_qkv`` and the QK RMSNorms, then ``pre_mlp_layernorm`` and the fused gate/up
``linear_fc1`` and ``linear_fc2``). Backprop order is the reverse of registration.
"""

from __future__ import annotations

from dataclasses import dataclass

from .geometry import round_up
from .specs import ParamSpec


@dataclass(frozen=True, kw_only=True)
class Qwen3Config:
    """Architecture of one Qwen3 dense model."""

    name: str
    """Catalog key, e.g. ``qwen3-8b``."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """SwiGLU inner width (gate and up each have this many rows)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int = 8
    """Key/value heads (grouped-query attention)."""
    kv_channels: int = 128
    """Head dimension."""
    vocab_size: int = 151936
    """Tokenizer vocabulary before Megatron's padding."""
    tied_embeddings: bool = False
    """Whether the output layer reuses the input embedding."""
    seq_length: int = 4096
    """Sequence length of the published recipes."""


QWEN3_MODELS: dict[str, Qwen3Config] = {
    c.name: c
    for c in (
        Qwen3Config(name="qwen3-0.6b", num_layers=28, hidden_size=1024, ffn_hidden_size=3072, num_attention_heads=16, tied_embeddings=True),
        Qwen3Config(name="qwen3-1.7b", num_layers=28, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16, tied_embeddings=True),
        Qwen3Config(name="qwen3-4b", num_layers=36, hidden_size=2560, ffn_hidden_size=9728, num_attention_heads=32, tied_embeddings=True),
        Qwen3Config(name="qwen3-8b", num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32),
        Qwen3Config(name="qwen3-14b", num_layers=40, hidden_size=5120, ffn_hidden_size=17408, num_attention_heads=40),
        Qwen3Config(name="qwen3-32b", num_layers=64, hidden_size=5120, ffn_hidden_size=25600, num_attention_heads=64),
        # Small enough to train on a laptop CPU; same structure (GQA, QK-norm, SwiGLU).
        Qwen3Config(
            name="qwen3-tiny", num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
            num_query_groups=2, kv_channels=16, vocab_size=1024, tied_embeddings=False, seq_length=64,
        ),
    )
}
"""Catalog of Qwen3 architectures. To add one, append a Qwen3Config with a new name."""


def get_qwen3_config(model: str) -> Qwen3Config:
    key = model.lower()
    if key not in QWEN3_MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of: {', '.join(QWEN3_MODELS)}")
    return QWEN3_MODELS[key]


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of divisible_by × tp_size."""
    return round_up(vocab_size, divisible_by * tp_size)


def _check_tp(cfg: Qwen3Config, tp_size: int) -> None:
    for what, value in (
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_query_groups", cfg.num_query_groups),
        ("ffn_hidden_size", cfg.ffn_hidden_size),
    ):
        if tp_size < 1 or value % tp_size:
            raise ValueError(
                f"{cfg.name}: {what}={value} is not divisible by tp_size={tp_size}; "
                f"choose a tensor-parallel size that divides it"
            )


def qwen3_specs(
    model: str | Qwen3Config,
    *,
    tp_size: int = 1,
    split_qkv: bool = False,
    split_gate_up: bool = False,
    dtype: str = "bfloat16",
) -> list[ParamSpec]:
    """Parameter descriptions of a Qwen3 model, in registration order.

    ``split_qkv`` / ``split_gate_up`` make the optimizer treat the fused QKV and gate/up
    weights as separate Q, K, V and gate, up matrices (the buffer still holds one tensor).
    """
    cfg = model if isinstance(model, Qwen3Config) else get_qwen3_config(model)
    _check_tp(cfg, tp_size)
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.kv_channels
    q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d
    vocab = padded_vocab_size(cfg.vocab_size, tp_size)
    rows: list[tuple[str, tuple[int, ...], int | None, str, tuple, str | None]] = [
        ("embedding.word_embeddings.weight", (vocab, h), 0, "elementwise", (), None),
    ]
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        rows += [
            (p + "input_layernorm.weight", (h,), None, "elementwise", (), None),
            (p + "self_attention.linear_proj.weight", (h, q), 1, "matrix", (), None),
            (p + "self_attention.linear_qkv.weight", (q + 2 * kv, h), 0, "matrix",
             ((q, h), (kv, h), (kv, h)) if split_qkv else (), "qkv"),
            (p + "self_attention.q_layernorm.weight", (d,), None, "elementwise", (), None),
            (p + "self_attention.k_layernorm.weight", (d,), None, "elementwise", (), None),
            (p + "pre_mlp_layernorm.weight", (h,), None, "elementwise", (), None),
            (p + "mlp.linear_fc1.weight", (2 * f, h), 0, "matrix",
             ((f, h), (f, h)) if split_gate_up else (), "gate_up"),
            (p + "mlp.linear_fc2.weight", (h, f), 1, "matrix", (), None),
        ]
    rows.append(("decoder.final_layernorm.weight", (h,), None, "elementwise", (), None))
    if not cfg.tied_embeddings:
        rows.append(("output_layer.weight", (vocab, h), 0, "elementwise", (), None))
    last = len(rows) - 1
    return [
        ParamSpec(
            name=name, global_shape=shape, tp_dim=tp_dim, tp_size=tp_size, dtype=dtype,
            family=family, order=last - k, blocks=blocks, fused=fused,  # type: ignore[arg-type]
        )
        for k, (name, shape, tp_dim, family, blocks, fused) in enumerate(rows)
    ]
