"""QK-clip (``--qk-clip``) and the max-logit log (``--log-max-attention-logit``) under ``--canzona``.

Megatron-Core 0.19.2's ``clip_qk`` reads the logits from transformer-engine >= 2.9 only, and
rescales ``main_param`` as if it were the whole weight: under the distributed optimizer it is a
shard (Megatron-LM #7382). Here:

* **The logits.** Each attention layer keeps its heads' largest pre-softmax logit over the
  iteration's micro-batches in ``core_attention.current_max_attn_logits`` (transformer-engine's
  attribute): transformer-engine >= 2.9 fills it itself; Megatron's local ``DotProductAttention``
  through a forward pre-hook on its softmax (the scores it is given, masked as it masks them);
  the CPU context-parallel attention (:mod:`canzona_patches.emulation.context_parallel`) from the
  scores it masks. A rank holds its tensor-parallel rank's heads of its stage's layers, over its
  own tokens.
* **One all-reduce per iteration.** Each rank writes its layers' heads into a ``(layers, heads)``
  table (its stage's layers, its tensor-parallel rank's heads) and the table is max-reduced over
  the DP x CP group: every rank holding a piece of a layer's ``linear_qkv`` then has the same
  per-head maxima, those of one process. ``4 * layers/PP * heads/TP`` bytes (Qwen3-32B at TP 8:
  2 KiB), no host read (the clip applies ``eta = 1`` where a group stays under the threshold
  instead of testing it). The model's largest logit, for the log, is max-reduced over all ranks
  at log iterations only, with the step time's reduction.
* **The clip**, inside the optimizer step, after the update and before the main parameters are
  copied to the model's: every rank scales the rows of ``linear_qkv``'s fp32 main weight it holds
  (:func:`megatron.canzona.optim.qk_clip.scale_rows_`: the whole matrix in the whole layout, a run
  of its elements in the lean one). The model's weights follow through the usual copy and
  parameter all-gather, so no rank is left with a half-clipped matrix. A skipped step (inf/NaN or
  ``grad_norm_skip_threshold``) clips nothing: its weights did not move, and a non-finite logit
  would scale a weight to NaN. Optimizer state is untouched.
* **The log.** Megatron's ``clip_qk(model, log_max_only)`` in ``train_step`` becomes
  :func:`canzona_clip_qk`: it reduces if the step did not (a skipped step, or ``--log-max-attention-logit``
  alone), resets the layers' maxima and returns this rank's largest logit as a 0-d tensor (read
  at log iterations only), which ``training_log`` writes as ``max_attention_logit`` (a rank's, as
  Megatron's is); Canzona's log line and metrics file give the model's, reduced over all ranks
  at log iterations.

Parse-time checks (:func:`check_qk_clip_args`) replace Megatron's asserts; so that Megatron's
transformer-engine assert does not fire for a Canzona run, the two flags are held back from
``validate_args`` and restored after it (:func:`hold_qk_clip_args`, :func:`restore_qk_clip_args`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from canzona_patches.errors import CanzonaArgumentError
from canzona_patches.version import require_pinned_megatron
from megatron.canzona.optim.qk_clip import QKClipConfig, QKVRows, row_scales, scale_rows_

require_pinned_megatron()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.utils import get_default_causal_mask, get_sliding_window_causal_mask  # noqa: E402
from megatron.core.utils import get_attr_wrapped_model  # noqa: E402

TE_LOGITS_VERSION = (2, 9)
"""The first transformer-engine whose attention returns its largest logits."""
_HELD: dict[int, tuple[bool, bool]] = {}
"""The flags held back from ``validate_args``, by the identity of the parsed flags."""


# --------------------------------------------------------------------------- flags


def _te_version() -> tuple[int, ...] | None:
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        text = importlib.metadata.version("transformer_engine")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def check_qk_clip_args(args: argparse.Namespace, te_version: tuple[int, ...] | None = None) -> None:
    """``--qk-clip-alpha``/``--qk-clip-threshold`` in range (Megatron's wording, every run), and,
    with ``--qk-clip`` or ``--log-max-attention-logit``, an attention that gives the logits."""
    clip, log = getattr(args, "qk_clip", False), getattr(args, "log_max_attention_logit", False)
    if not (clip or log):
        return
    if clip and not 0.0 < args.qk_clip_alpha < 1.0:
        raise CanzonaArgumentError(
            f"--qk-clip-alpha must be between 0.0 and 1.0 when using --qk-clip (got {args.qk_clip_alpha})")
    if clip and not args.qk_clip_threshold > 0:
        raise CanzonaArgumentError(
            f"--qk-clip-threshold must be greater than 0 when using --qk-clip (got {args.qk_clip_threshold})")
    flag = "--qk-clip" if clip else "--log-max-attention-logit"
    te_version = _te_version() if te_version is None else te_version
    te = "not installed" if te_version is None else ".".join(map(str, te_version))
    if not args.canzona:
        if te_version is None or te_version < TE_LOGITS_VERSION:
            raise CanzonaArgumentError(
                f"{flag} without --canzona is Megatron-Core's, which reads the logits from transformer-engine >= 2.9's "
                f"attention (transformer-engine: {te}): add --canzona (with --use-distributed-optimizer), whose "
                "clip reads them from the local attention too")
        return
    if getattr(args, "multi_latent_attention", False):
        raise CanzonaArgumentError(
            f"{flag} under --canzona clips SelfAttention's linear_qkv; multi-latent attention "
            "(--multi-latent-attention) gives no logits to it: drop one of the two")
    if getattr(args, "experimental_attention_variant", None):
        raise CanzonaArgumentError(
            f"{flag} under --canzona needs the logits of dot-product attention; --experimental-attention-variant "
            f"{args.experimental_attention_variant} gives none: drop one of the two")
    if args.transformer_impl == "transformer_engine" and te_version is not None and te_version < TE_LOGITS_VERSION:
        raise CanzonaArgumentError(
            f"{flag}: transformer-engine {te}'s attention gives no logits (2.9 is the first that does): upgrade it, "
            "or pass --transformer-impl local")


def hold_qk_clip_args(args: argparse.Namespace) -> None:
    """Hold ``--qk-clip`` and ``--log-max-attention-logit`` back from Megatron's ``validate_args``
    (its transformer-engine assert) for a Canzona run; :func:`restore_qk_clip_args` after it."""
    if args.canzona:
        _HELD[id(args)] = (args.qk_clip, args.log_max_attention_logit)
        args.qk_clip = args.log_max_attention_logit = False


def restore_qk_clip_args(args: argparse.Namespace) -> None:
    held = _HELD.pop(id(args), None)
    if held is not None:
        args.qk_clip, args.log_max_attention_logit = held


# --------------------------------------------------------------------------- logits


def record_max_logits(core_attention: Any, scores: torch.Tensor) -> None:
    """Keep ``scores``' per-head maximum (``[b, heads, sq, sk]``, masked positions ``-inf``) in
    ``core_attention.current_max_attn_logits`` (the running maximum over micro-batches)."""
    batch = scores.detach().amax(dim=(0, 2, 3)).float()
    current = getattr(core_attention, "current_max_attn_logits", None)
    core_attention.current_max_attn_logits = batch if current is None else torch.maximum(current, batch)


def _local_softmax_hook(core_attention: DotProductAttention):
    """A forward pre-hook on a local ``DotProductAttention``'s softmax: the scores it receives,
    masked as ``FusedScaleMaskSoftmax`` masks them, scaled as it scales them."""
    softmax = core_attention.scale_mask_softmax

    def hook(module: Any, inputs: tuple) -> None:
        if not core_attention.training:  # validation's forwards are not the step's
            return
        scores, mask = inputs[0], inputs[1] if len(inputs) > 1 else None
        sq, sk = scores.shape[2], scores.shape[3]
        if softmax.window_size is not None:
            mask = get_sliding_window_causal_mask(sq, sk, softmax.window_size)
        elif mask is None and softmax.attn_mask_type == AttnMaskType.causal and sq > 1:
            mask = get_default_causal_mask(sq)
        with torch.no_grad():
            masked = scores if mask is None else scores.masked_fill(mask.to(scores.device), float("-inf"))
            batch = masked.amax(dim=(0, 2, 3)).float()
            if softmax.scale is not None:  # max(fl(x * s)) = fl(max(x) * s): rounding is monotonic
                batch = batch * softmax.scale
        current = getattr(core_attention, "current_max_attn_logits", None)
        core_attention.current_max_attn_logits = batch if current is None else torch.maximum(current, batch)

    return hook


def watch_logits(core_attention: Any) -> Any:
    """Make ``core_attention`` keep its largest logits; the hook's handle, or ``None`` where the
    module keeps them itself (transformer-engine >= 2.9, the CPU context-parallel attention)."""
    if isinstance(core_attention, DotProductAttention):
        return core_attention.scale_mask_softmax.register_forward_pre_hook(_local_softmax_hook(core_attention))
    if type(core_attention).__name__ in ("ContextParallelAttention", "TEDotProductAttention"):
        return None
    raise CanzonaArgumentError(
        f"--qk-clip under --canzona: the core attention {type(core_attention).__name__} gives no logits; "
        "run --transformer-impl local (or transformer-engine >= 2.9)")


# --------------------------------------------------------------------------- the clip


@dataclass(frozen=True)
class _Layer:
    """One attention layer of this rank (``index``: its number in the model, from 0), and the part of its
    ``linear_qkv`` main weight this rank holds (``main`` 1-D, from element ``start``)."""

    core: Any
    index: int
    rows: QKVRows
    columns: int
    main: torch.Tensor | None
    start: int


class QkClip:
    """The run's QK-clip and max-logit log (module docstring): built with the optimizer."""

    def __init__(self, model_chunks: list, optimizer: Any, *, clip: bool, device: torch.device) -> None:
        config = get_attr_wrapped_model(model_chunks[0], "config")
        self.config = QKClipConfig(threshold=config.qk_clip_threshold, alpha=config.qk_clip_alpha) if clip else None
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.group = group if torch.distributed.get_world_size(group) > 1 else None
        self._reduced = False
        self._hooks = []
        main = _main_shards(optimizer)
        self.layers: list[_Layer] = []
        for chunk in model_chunks:
            for layer in get_attr_wrapped_model(chunk, "decoder").layers:
                attention = layer.self_attention
                if not hasattr(attention, "linear_qkv"):
                    raise CanzonaArgumentError(
                        f"--qk-clip under --canzona clips SelfAttention's linear_qkv; layer {layer.layer_number}'s "
                        f"{type(attention).__name__} has none")
                hook = watch_logits(attention.core_attention)
                if hook is not None:
                    self._hooks.append(hook)
                rows = QKVRows(groups=attention.num_query_groups_per_partition,
                               heads_per_group=(attention.num_attention_heads_per_partition
                                                // attention.num_query_groups_per_partition),
                               head_dim=attention.hidden_size_per_attention_head)
                weight = attention.linear_qkv.weight
                shard = main.get(weight)
                self.layers.append(_Layer(
                    core=attention.core_attention, index=layer.layer_number - 1, rows=rows,
                    columns=weight.shape[-1], main=None if shard is None else shard[0].view(-1),
                    start=0 if shard is None else shard[1]))
        heads = self.layers[0].rows.heads if self.layers else 0
        self.table = torch.full((len(self.layers), heads), float("-inf"), device=device)

    def reduce(self) -> torch.Tensor:
        """This rank's layers' heads' largest logits over DP x CP, ``(layers, heads)`` (once per
        iteration)."""
        if not self._reduced:
            self.table.fill_(float("-inf"))
            for row, layer in enumerate(self.layers):
                logits = getattr(layer.core, "current_max_attn_logits", None)
                if logits is not None:
                    self.table[row] = logits.detach().float().view(-1)
            if self.group is not None:
                torch.distributed.all_reduce(self.table, op=torch.distributed.ReduceOp.MAX, group=self.group)
            self._reduced = True
        return self.table

    @torch.no_grad()
    def clip(self) -> None:
        """Scale the query and key rows of every ``linear_qkv`` main weight this rank holds (after
        the update, before the copy to the model's weights). Called on every rank."""
        table = self.reduce()
        if self.config is None:
            return
        for row, layer in enumerate(self.layers):
            if layer.main is not None and layer.main.numel():
                scales = row_scales(table[row], layer.rows, self.config)
                scale_rows_(layer.main, layer.start, layer.columns, scales)

    def finish(self) -> torch.Tensor:
        """The iteration's largest logit over this rank's layers and heads (0-d; 0 where none was
        seen), after which the layers start the next iteration's maxima."""
        largest = self.reduce().amax() if self.layers else torch.tensor(float("-inf"), device=self.table.device)
        largest = torch.where(torch.isfinite(largest), largest, torch.zeros_like(largest))
        for layer in self.layers:
            layer.core.current_max_attn_logits = None
        self._reduced = False
        return largest


def _main_shards(optimizer: Any) -> dict[Any, tuple[torch.Tensor, int]]:
    """Model parameter -> (this rank's main shard of it, its first element) for a Megatron
    ``DistributedOptimizer``: bf16 parameters' fp32 copies, fp32 parameters' own slices. Under
    Megatron-FSDP: each matrix's ``DTensor`` parameter (and the model parameter behind it) -> its
    local elements in the main-weight buffer, from where the binding found them."""
    shards = {}
    if optimizer.fsdp:
        starts = optimizer.canzona.binding.shard_starts
        for group in optimizer.optimizer.param_groups:
            for param in group["params"]:
                if param in starts:
                    shards[param] = shards[param.orig_param] = (param.to_local().view(-1), starts[param])
        return shards
    pairs = ((optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups),
             (optimizer.model_fp32_groups, optimizer.shard_fp32_groups))
    for model_groups, main_groups in pairs:
        for model_group, main_group in zip(model_groups, main_groups):
            for param, main in zip(model_group, main_group):
                shards[param] = (main, optimizer._get_model_param_range_map(param)["param"].start)
    return shards


LOGIT_SOURCES = {"DotProductAttention": "Megatron's local attention",
                 "ContextParallelAttention": "the CPU context-parallel attention",
                 "TEDotProductAttention": "transformer-engine's attention"}
"""Where the logits come from, by the core attention's class (the start-up line)."""


def qk_clip_line(*, clip: bool, threshold: float, alpha: float, attention: str, qk_layernorm: bool) -> str:
    """The start-up line of ``--qk-clip`` (or of ``--log-max-attention-logit`` alone)."""
    source = LOGIT_SOURCES.get(attention, attention)
    if not clip:
        return f"[canzona] max attention logit: logged from {source}, no clip"
    line = f"[canzona] QK-clip: threshold {threshold:g}, alpha {alpha:g}, logits from {source}"
    if qk_layernorm:
        line += ("; with --qk-layernorm the QK norms undo the scaling of query and key rows, so the clip cannot "
                 "lower the logits (docs/qk_clip.md)")
    return line


def attach_qk_clip(optimizer: Any, model_chunks: list, run: Any) -> None:
    """Give the run's dense Canzona optimizer a :class:`QkClip` when the model's config asks for
    the clip or the log (``--qk-clip``, ``--log-max-attention-logit``), and say so in one line."""
    config = get_attr_wrapped_model(model_chunks[0], "config")
    if not (config.qk_clip or config.log_max_attention_logit):
        return
    dense = getattr(optimizer, "chained_optimizers", [optimizer])[0]
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    clip = QkClip(model_chunks, dense, clip=config.qk_clip, device=device)
    dense.qk_clip = _clips(run).clip = clip
    if clip.layers and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        print(qk_clip_line(clip=config.qk_clip, threshold=config.qk_clip_threshold, alpha=config.qk_clip_alpha,
                           attention=type(clip.layers[0].core).__name__, qk_layernorm=config.qk_layernorm), flush=True)


class _Holder:
    clip: QkClip | None = None


def _clips(run: Any) -> _Holder:
    return run.shared("qk clip", _Holder)


def canzona_clip_qk(clip_qk: Any, run: Any) -> Any:
    """Megatron's ``clip_qk(model, log_max_only)`` in ``train_step``: the clip is done in the step
    (:meth:`QkClip.clip`); this returns the iteration's largest logit and resets the maxima."""
    holder = _clips(run)

    def clip_qk_under_canzona(model: list, log_max_only: bool = False) -> torch.Tensor | float:
        return 0.0 if holder.clip is None else holder.clip.finish()

    return clip_qk_under_canzona
