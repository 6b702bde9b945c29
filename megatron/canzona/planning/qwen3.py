"""Qwen3 architectures (dense and mixture-of-experts) as parameter descriptions with
Megatron-Core naming.

Names, shapes and registration order follow Megatron-Core's GPT model with the local
layer spec (``input_layernorm``, then attention ``linear_proj`` before the fused
``linear_qkv`` and the QK RMSNorms, then ``pre_mlp_layernorm`` and the fused gate/up
``linear_fc1`` and ``linear_fc2``; in MoE layers the router and the experts instead,
:mod:`~megatron.canzona.planning.qwen3_moe`). Backprop order is the reverse of
registration. One call describes what one rank of one pipeline stage holds: layer indices
in names are local to the stage, as Megatron names them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .geometry import round_up
from .pipeline import stage_layer_counts
from .qwen3_moe import EXPERT_LAYOUTS, check_experts, moe_rows
from .specs import ParamSpec, qkv_blocks


@dataclass(frozen=True, kw_only=True)
class Qwen3Config:
    """Architecture of one Qwen3 model (dense, or mixture-of-experts when ``num_experts`` > 0):
    the one definition the planner's catalog, the dry run and the Hugging Face conversion
    (:mod:`megatron.canzona.hf`) share."""

    name: str = dataclasses.field(default="qwen3", compare=False)
    """Catalog key, e.g. ``qwen3-8b`` (a converted checkpoint's is ``qwen3``; not compared)."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """SwiGLU inner width of a dense MLP (gate and up each have this many rows); unused by an
    MoE model whose every layer is MoE (its HF ``intermediate_size``)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int = 8
    """Key/value heads (grouped-query attention)."""
    kv_channels: int = 128
    """Head dimension."""
    vocab_size: int = 151936
    """Rows of the embedding (and output layer) of the published model, Hugging Face's
    ``vocab_size``; Megatron pads it further to a multiple of its divisor times TP unless
    ``--make-vocab-size-divisible-by`` says otherwise (:func:`megatron.canzona.hf.vocab_divisor`)."""
    tied_embeddings: bool = False
    """Whether the output layer reuses the input embedding."""
    seq_length: int = 4096
    """Sequence length of the published recipes."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 is a dense model."""
    moe_ffn_hidden_size: int = 0
    """SwiGLU inner width of one expert (HF ``moe_intermediate_size``)."""
    moe_router_topk: int = 0
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    moe_norm_topk_prob: bool = True
    """The chosen experts' router probabilities renormalized to sum to 1 (HF ``norm_topk_prob``,
    Qwen3-MoE's; Megatron's softmax after the top-k, without ``--moe-router-pre-softmax``)."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon of every norm, QK-norms included."""
    rotary_base: float = 1_000_000.0
    """RoPE theta."""
    max_position_embeddings: int = 40960
    """Longest sequence the model was trained on."""
    init_method_std: float = 0.02
    """Standard deviation of the weight initialization (recorded, not used by the weights)."""

    def __post_init__(self) -> None:
        if self.num_experts < 0:
            raise ValueError(f"{self.name}: num_experts must be >= 0 (0 is dense), got {self.num_experts}")
        if self.num_experts and (self.moe_ffn_hidden_size < 1 or not 1 <= self.moe_router_topk <= self.num_experts):
            raise ValueError(
                f"{self.name}: an MoE model needs moe_ffn_hidden_size >= 1 and 1 <= moe_router_topk <= "
                f"num_experts={self.num_experts}, got {self.moe_ffn_hidden_size} and {self.moe_router_topk}"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


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
        # Mixture of experts, every layer MoE, no shared expert (HF config.json of each model;
        # its dense intermediate_size is kept as ffn_hidden_size but no layer uses it).
        Qwen3Config(
            name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
            num_query_groups=4, num_experts=128, moe_ffn_hidden_size=768, moe_router_topk=8,
        ),
        Qwen3Config(
            name="qwen3-235b-a22b", num_layers=94, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=64,
            num_query_groups=4, num_experts=128, moe_ffn_hidden_size=1536, moe_router_topk=8,
        ),
        # The MoE sibling of qwen3-tiny, for CPU runs.
        Qwen3Config(
            name="qwen3-moe-tiny", num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
            num_query_groups=2, kv_channels=16, vocab_size=1024, tied_embeddings=False, seq_length=64,
            num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
        ),
    )
}
"""Catalog of Qwen3 architectures. To add one, append a Qwen3Config with a new name."""


def get_qwen3_config(model: str) -> Qwen3Config:
    key = model.lower()
    if key not in QWEN3_MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of: {', '.join(QWEN3_MODELS)}")
    return QWEN3_MODELS[key]


def recipe_variables(model: str | None) -> dict[str, str]:
    """The architecture of catalog ``model`` as the shell variables of the Qwen3 recipes
    (``examples/qwen3/common.sh`` reads them from here: the catalog is their one definition).
    ``None``: only what every Qwen3 shares (norm epsilon, RoPE base, init std: the
    :class:`Qwen3Config` defaults), for an architecture of one's own given in the environment."""
    if model is None:
        return _shared_variables(Qwen3Config)  # a dataclass's class attributes are its defaults
    cfg = get_qwen3_config(model)
    out = {
        "NUM_LAYERS": cfg.num_layers, "HIDDEN_SIZE": cfg.hidden_size, "FFN_HIDDEN_SIZE": cfg.ffn_hidden_size,
        "NUM_HEADS": cfg.num_attention_heads, "NUM_QUERY_GROUPS": cfg.num_query_groups,
        "KV_CHANNELS": cfg.kv_channels, "VOCAB_SIZE": cfg.vocab_size, "TIED_EMBEDDINGS": int(cfg.tied_embeddings),
    }
    if cfg.is_moe:
        out |= {"NUM_EXPERTS": cfg.num_experts, "MOE_TOPK": cfg.moe_router_topk,
                "MOE_FFN_HIDDEN_SIZE": cfg.moe_ffn_hidden_size}
    return {**{name: str(value) for name, value in out.items()}, **_shared_variables(cfg)}


def _shared_variables(cfg: Qwen3Config | type[Qwen3Config]) -> dict[str, str]:
    return {"NORM_EPSILON": repr(cfg.norm_epsilon), "ROTARY_BASE": str(int(cfg.rotary_base)),
            "INIT_METHOD_STD": repr(cfg.init_method_std)}


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of divisible_by × tp_size."""
    return round_up(vocab_size, divisible_by * tp_size)


def _check_tp(cfg: Qwen3Config, tp_size: int) -> None:
    checks = [("num_attention_heads", cfg.num_attention_heads), ("num_query_groups", cfg.num_query_groups)]
    if not cfg.is_moe:  # an MoE model has no dense MLP to shard
        checks.append(("ffn_hidden_size", cfg.ffn_hidden_size))
    for what, value in checks:
        if not isinstance(tp_size, int) or tp_size < 1 or value % tp_size:
            raise ValueError(
                f"{cfg.name}: {what}={value} is not divisible by tp_size={tp_size}; "
                f"choose a tensor-parallel size that divides it"
            )


def qwen3_specs(
    model: str | Qwen3Config,
    *,
    tp_size: int = 1,
    ep_size: int = 1,
    expert_tp_size: int = 1,
    pp_size: int = 1,
    pp_rank: int = 0,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    split_qkv: bool = False,
    split_qkv_per_head: bool = False,
    split_gate_up: bool = False,
    dtype: str = "bfloat16",
    expert_layout: str = "sequential",
) -> list[ParamSpec]:
    """Parameter descriptions of what one rank of pipeline stage ``pp_rank`` holds, in
    registration order.

    ``split_qkv`` / ``split_gate_up`` make the optimizer treat the fused QKV and gate/up
    weights as separate Q, K, V and gate, up matrices (the buffer still holds one tensor);
    ``split_qkv_per_head`` makes every attention head's query, key and value block its own matrix.
    MoE models: ``ep_size`` experts-parallel ranks hold ``num_experts / ep_size`` local
    experts each, sharded over ``expert_tp_size``; ``expert_layout`` is Megatron's module
    holding them (:data:`~megatron.canzona.planning.qwen3_moe.EXPERT_LAYOUTS`).
    ``first_stage_layers`` / ``last_stage_layers`` are Megatron's
    ``--decoder-first/last-pipeline-num-layers``.
    """
    cfg = model if isinstance(model, Qwen3Config) else get_qwen3_config(model)
    _check_tp(cfg, tp_size)
    check_experts(cfg, ep_size=ep_size, expert_tp_size=expert_tp_size, expert_layout=expert_layout)
    counts = stage_layer_counts(cfg.num_layers, pp_size, first_stage_layers=first_stage_layers,
                                last_stage_layers=last_stage_layers)
    if not isinstance(pp_rank, int) or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must lie in [0, {pp_size}), got {pp_rank!r}")
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    h = cfg.hidden_size
    vocab = padded_vocab_size(cfg.vocab_size, tp_size)
    rows: list[ParamSpec] = []
    if first:
        rows.append(_spec("embedding.word_embeddings.weight", (vocab, h), tp_size=tp_size, tp_dim=0,
                          family="elementwise"))
    for i in range(counts[pp_rank]):
        rows += _layer_rows(cfg, f"decoder.layers.{i}.", tp_size=tp_size, split_qkv=split_qkv,
                            per_head=split_qkv_per_head, split_gate_up=split_gate_up, ep_size=ep_size, expert_tp_size=expert_tp_size,
                            expert_layout=expert_layout)
    if last:
        rows.append(_spec("decoder.final_layernorm.weight", (h,), tp_size=tp_size, family="elementwise"))
        # Tied models keep a copy of the embedding as the output layer on a later stage.
        if not cfg.tied_embeddings or not first:
            rows.append(_spec("output_layer.weight", (vocab, h), tp_size=tp_size, tp_dim=0, family="elementwise"))
    top = len(rows) - 1
    return [dataclasses.replace(spec, dtype=dtype, order=top - k) for k, spec in enumerate(rows)]


def _spec(name: str, shape: tuple[int, ...], *, tp_size: int, tp_dim: int | None = None, family: str = "matrix",
          blocks: tuple[tuple[int, int], ...] = (), fused: str | None = None) -> ParamSpec:
    """A dense parameter before its dtype and backprop order are known."""
    return ParamSpec(name=name, global_shape=shape, tp_dim=tp_dim, tp_size=tp_size,
                     family=family, blocks=blocks, fused=fused)  # type: ignore[arg-type]


def _layer_rows(cfg: Qwen3Config, p: str, *, tp_size: int, split_qkv: bool, per_head: bool, split_gate_up: bool,
                ep_size: int, expert_tp_size: int, expert_layout: str) -> list[ParamSpec]:
    """One transformer layer's parameters in registration order."""
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.kv_channels
    q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d
    rows = [
        _spec(p + "input_layernorm.weight", (h,), tp_size=tp_size, family="elementwise"),
        _spec(p + "self_attention.linear_proj.weight", (h, q), tp_size=tp_size, tp_dim=1),
        _spec(p + "self_attention.linear_qkv.weight", (q + 2 * kv, h), tp_size=tp_size, tp_dim=0,
              blocks=qkv_blocks(cfg.num_attention_heads, cfg.num_query_groups, d, h, per_head=per_head)
              if split_qkv or per_head else (), fused="qkv"),
        _spec(p + "self_attention.q_layernorm.weight", (d,), tp_size=tp_size, family="elementwise"),
        _spec(p + "self_attention.k_layernorm.weight", (d,), tp_size=tp_size, family="elementwise"),
        _spec(p + "pre_mlp_layernorm.weight", (h,), tp_size=tp_size, family="elementwise"),
    ]
    if cfg.is_moe:
        return rows + moe_rows(cfg, p + "mlp.", tp_size=tp_size, ep_size=ep_size, expert_tp_size=expert_tp_size,
                               split_gate_up=split_gate_up, layout=expert_layout)
    return rows + [
        _spec(p + "mlp.linear_fc1.weight", (2 * f, h), tp_size=tp_size, tp_dim=0,
              blocks=((f, h), (f, h)) if split_gate_up else (), fused="gate_up"),
        _spec(p + "mlp.linear_fc2.weight", (h, f), tp_size=tp_size, tp_dim=1),
    ]
