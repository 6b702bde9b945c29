"""Context-parallel attention without transformer-engine, so that CP runs (and is tested) on CPU.

Megatron-Core's local ``DotProductAttention`` refuses ``--context-parallel-size`` > 1: its CP
attention is transformer-engine's. Where transformer-engine is absent, the local spec's
core attention becomes :class:`ContextParallelAttention` (a row of
:data:`canzona_patches.registry.PATCHES`, group ``context-parallel``). What it does is what CP
attention computes, in the plainest way:

* **Sequence layout.** Megatron cuts each sequence into ``2 · CP`` equal chunks and gives CP
  rank r chunks r and ``2 · CP − 1 − r`` (``get_batch_on_this_cp_rank``: causal work balanced
  across ranks); its rotary embedding follows the same layout. :func:`zigzag_positions` says
  which global positions a rank's local rows are.
* **Keys and values** are all-gathered over the CP group (:class:`_GatherSequence`); in
  backward each rank's share of their gradient is the sum over the group of the gradient of
  its rows (an all-reduce, then its rows: the reduce-scatter of the gather).
* **Masking** is causal by global position: a query attends to keys at its position or before.

Softmax in fp32 at least, dropout as Megatron's local attention draws it. Under ``--qk-clip`` or
``--log-max-attention-logit`` each head's largest masked score is kept, as transformer-engine >= 2.9
keeps it (:mod:`canzona_patches.integration.qk_clip` reduces it over DP x CP). Cost per layer and rank:
the all-gather of K and V (``(CP − 1)/CP`` of the sequence's keys and values) and an
all-reduce of their gradients; scores for the local queries against every key. An
emulation for CPU tests and CPU runs, not a fast kernel.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from canzona_patches.version import require_pinned_megatron

require_pinned_megatron()

from canzona_patches.integration.qk_clip import record_max_logits  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402


def zigzag_positions(rank: int, cp_size: int, local_length: int) -> torch.Tensor:
    """Global positions of CP rank ``rank``'s ``local_length`` rows: chunks ``rank`` and
    ``2 · cp_size − 1 − rank`` of a sequence cut into ``2 · cp_size`` chunks."""
    if local_length % 2:
        raise ValueError(f"a CP rank holds two chunks of equal length; got {local_length} rows")
    chunk = local_length // 2
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - rank) * chunk, (2 * cp_size - rank) * chunk)
    return torch.cat([first, second])


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_positions: torch.Tensor,
                     key_positions: torch.Tensor, scale: float, dropout: torch.nn.Module | None = None,
                     logits: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """``softmax(scale · q kᵀ, causal by position) v`` for ``[s, b, heads, dim]`` inputs (keys
    and values with as many heads as the queries); ``[sq, b, heads · dim]`` out. ``logits``, if
    given, sees the masked scores (``[b, heads, sq, sk]``, ``-inf`` where masked)."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    future = key_positions.to(scores.device)[None, :] > query_positions.to(scores.device)[:, None]
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).masked_fill(future, float("-inf"))
    if logits is not None:
        logits(scores)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    if dropout is not None:
        probs = dropout(probs)
    context = torch.matmul(probs, v)  # [b, heads, sq, dim]
    sq, b = query.shape[0], query.shape[1]
    return context.permute(2, 0, 1, 3).reshape(sq, b, -1)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 0) over ``group``, in rank order; backward: the
    sum over the group of the gradient of this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=0)[rank].contiguous(), None


class ContextParallelAttention(MegatronModule):
    """The local spec's core attention under context parallelism (module docstring); the
    constructor and ``forward`` take what ``DotProductAttention``'s take."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if config.window_size is not None or getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("CPU context-parallel attention supports causal attention with the vanilla softmax only")
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp_size
        self.groups = config.num_query_groups // tp_size
        head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= max(1, layer_number)
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)
        self.cp_group = parallel_state.get_context_parallel_group()
        self.keeps_logits = bool(config.qk_clip or config.log_max_attention_logit)
        """Whether the heads' largest logits are kept (``current_max_attn_logits``, as
        transformer-engine keeps them) for QK-clip or its log."""
        self.current_max_attn_logits: torch.Tensor | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("CPU context-parallel attention takes neither packed sequences nor an attention bias")
        cp_size, cp_rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        local = query.shape[0]
        key = _GatherSequence.apply(key, self.cp_group)
        value = _GatherSequence.apply(value, self.cp_group)
        if self.heads > self.groups:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        key_positions = torch.cat([zigzag_positions(r, cp_size, local) for r in range(cp_size)])
        dropout = self.dropout if self.training and self.dropout.p > 0 else None
        # As Megatron's local attention: the dropout draws from the tracked RNG unless sequence-parallel.
        tracked = dropout is not None and not self.config.sequence_parallel
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if tracked else contextlib.nullcontext()
        with rng:
            return causal_attention(query, key, value, zigzag_positions(cp_rank, cp_size, local), key_positions,
                                    self.softmax_scale, dropout,
                                    logits=functools.partial(record_max_logits, self) if self.keeps_logits and self.training else None)


def local_core_attention(original: Any, run: Any) -> Any:
    """``LocalSpecProvider.core_attention`` answering :class:`ContextParallelAttention`."""

    def core_attention(self: Any) -> type:
        return ContextParallelAttention

    return core_attention
