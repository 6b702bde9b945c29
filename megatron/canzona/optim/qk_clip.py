"""QK-clip (MuonClip's stabiliser) as single-device math on a fused ``linear_qkv`` weight.

After a step, a query group whose largest pre-softmax attention logit ``S`` (``q·k / sqrt(d)``,
over the iteration's tokens and the group's heads) exceeds the threshold ``tau`` has its query
rows scaled by ``eta ** alpha`` and its key rows by ``eta ** (1 - alpha)``, with
``eta = tau / S``: the group's next logits shrink by ``eta`` at most. Value rows, biases and the
optimizer state are untouched. This is Megatron-Core 0.19.2's ``SelfAttention.clip_qk``
(``--qk-clip``), on the same floats: ``eta`` is ``tau / S`` where ``S > tau`` and exactly 1
elsewhere (a multiplication by 1 leaves a weight bitwise as it was), the powers in fp32.

The weight is one tensor-parallel rank's ``linear_qkv``: ``groups`` query groups, each
``heads_per_group * head_dim`` query rows, then ``head_dim`` key rows, then ``head_dim`` value
rows (:class:`QKVRows`). :func:`scale_rows_` scales any contiguous run of its row-major elements,
so a rank holding a whole matrix and one holding a slice of it (the lean layout) apply the same
factors to the same elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QKClipConfig:
    """Megatron's ``--qk-clip-threshold`` (``tau``) and ``--qk-clip-alpha`` (the query's share)."""

    threshold: float = 100.0
    alpha: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"qk-clip alpha must be between 0.0 and 1.0, got {self.alpha}")
        if not self.threshold > 0.0:
            raise ValueError(f"qk-clip threshold must be greater than 0, got {self.threshold}")


@dataclass(frozen=True)
class QKVRows:
    """The rows of one tensor-parallel rank's fused ``linear_qkv`` weight."""

    groups: int
    heads_per_group: int
    head_dim: int

    @property
    def query_rows(self) -> int:
        """Query rows per group."""
        return self.heads_per_group * self.head_dim

    @property
    def rows_per_group(self) -> int:
        return self.query_rows + 2 * self.head_dim

    @property
    def rows(self) -> int:
        return self.groups * self.rows_per_group

    @property
    def heads(self) -> int:
        return self.groups * self.heads_per_group


def group_eta(max_logits: torch.Tensor, rows: QKVRows, threshold: float) -> torch.Tensor:
    """Each query group's ``eta`` from its heads' largest logits (``(heads,)``, fp32): ``tau / S``
    where the group's ``S`` exceeds ``tau``, else 1 (also where ``S`` is NaN or no logit was seen)."""
    grouped = max_logits.float().view(rows.groups, rows.heads_per_group).amax(dim=1)
    return torch.where(grouped > threshold, threshold / grouped, torch.ones_like(grouped))


def row_scales(max_logits: torch.Tensor, rows: QKVRows, config: QKClipConfig) -> torch.Tensor:
    """The factor of every row of the weight (``(rows,)``, fp32): ``eta ** alpha`` on a group's
    query rows, ``eta ** (1 - alpha)`` on its key rows, 1 on its value rows."""
    eta = group_eta(max_logits, rows, config.threshold)[:, None]
    query = torch.pow(eta, config.alpha).expand(rows.groups, rows.query_rows)
    key = torch.pow(eta, 1.0 - config.alpha).expand(rows.groups, rows.head_dim)
    value = torch.ones(rows.groups, rows.head_dim, dtype=eta.dtype, device=eta.device)
    return torch.cat([query, key, value], dim=1).reshape(-1)


def scale_rows_(flat: torch.Tensor, start: int, columns: int, scales: torch.Tensor) -> None:
    """Scale, in place, elements ``start .. start + flat.numel()`` of a row-major matrix with
    ``columns`` columns (``flat`` holds them, 1-D) by their rows' ``scales``: a partial first
    row, whole rows as one broadcast multiply, a partial last row. Nothing full-size is made;
    the products are formed in fp32 (the scales' type) and stored in ``flat``'s."""
    end = start + flat.numel()
    if end == start:
        return
    first_full = -(-start // columns)
    last_full = end // columns
    if first_full > last_full:  # inside one row
        flat.mul_(scales[start // columns:start // columns + 1])
        return
    head = first_full * columns - start
    if head:
        flat[:head].mul_(scales[start // columns:first_full])
    body = flat[head:head + (last_full - first_full) * columns]
    if body.numel():
        body.view(last_full - first_full, columns).mul_(scales[first_full:last_full, None])
    tail = flat[head + body.numel():]
    if tail.numel():
        tail.mul_(scales[last_full:last_full + 1])


def clip_qkv_(weight: torch.Tensor, max_logits: torch.Tensor, rows: QKVRows, config: QKClipConfig) -> None:
    """QK-clip one whole ``(rows, hidden)`` weight in place (the single-device formula)."""
    scale_rows_(weight.view(-1), 0, weight.shape[-1], row_scales(max_logits, rows, config))
