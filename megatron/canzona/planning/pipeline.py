"""Transformer layers per pipeline stage, as Megatron-Core 0.19.2 splits them.

Without ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``
every stage gets ``num_layers / pp_size`` layers (Megatron requires it to divide). With
them, the first and/or last stage get the given counts and the stages between share the
rest evenly (``get_transformer_layer_offset`` in ``transformer_layer.py``).
"""

from __future__ import annotations

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"


def stage_layer_counts(
    num_layers: int, pp_size: int, *, first_stage_layers: int | None = None, last_stage_layers: int | None = None,
) -> tuple[int, ...]:
    """Transformer layers of each pipeline stage, first stage first."""
    if not isinstance(pp_size, int) or pp_size < 1:
        raise ValueError(f"pp_size must be a positive integer, got {pp_size!r}; pass --pp 1 or more")
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot fill {pp_size} pipeline stages; pass --pp {num_layers} or less")
    if first_stage_layers is None and last_stage_layers is None:
        if num_layers % pp_size:
            first, last = suggest_uneven_split(num_layers, pp_size)
            raise ValueError(
                f"{num_layers} layers do not split evenly over {pp_size} pipeline stages; pass "
                f"{FIRST_FLAG} and/or {LAST_FLAG} (e.g. {FIRST_FLAG} {first} {LAST_FLAG} {last})"
            )
        return (num_layers // pp_size,) * pp_size
    if pp_size == 1:
        raise ValueError(f"{FIRST_FLAG}/{LAST_FLAG} need pipeline parallelism; drop them or pass --pp 2 or more")
    for flag, value in ((FIRST_FLAG, first_stage_layers), (LAST_FLAG, last_stage_layers)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    middle_stages = pp_size - (first_stage_layers is not None) - (last_stage_layers is not None)
    middle_layers = num_layers - (first_stage_layers or 0) - (last_stage_layers or 0)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers) or (middle_stages and middle_layers % middle_stages):
        first, last = suggest_uneven_split(num_layers, pp_size)
        raise ValueError(
            f"{FIRST_FLAG} {first_stage_layers} / {LAST_FLAG} {last_stage_layers} leave {middle_layers} layers for "
            f"{middle_stages} middle stage(s), not an even split; e.g. {FIRST_FLAG} {first} {LAST_FLAG} {last}"
        )
    middle = (middle_layers // middle_stages,) * middle_stages if middle_stages else ()
    head = (first_stage_layers,) if first_stage_layers is not None else ()
    tail = (last_stage_layers,) if last_stage_layers is not None else ()
    return head + middle + tail  # type: ignore[return-value]


def suggest_uneven_split(num_layers: int, pp_size: int) -> tuple[int, int]:
    """First and last stage layer counts that leave the middle stages an even split with the
    smallest busiest stage; among those, first and last as equal as possible and no larger
    than they must be (they also hold the embedding and the output layer)."""
    if pp_size <= 2:
        return num_layers // 2, num_layers - num_layers // 2
    best: tuple[tuple[int, int, int], tuple[int, int]] | None = None
    for first in range(1, num_layers):
        for last in range(1, num_layers - first):
            rest = num_layers - first - last
            if rest % (pp_size - 2):
                continue
            middle = rest // (pp_size - 2)
            key = (max(first, middle, last), abs(first - last), -min(first, last))
            if best is None or key < best[0]:
                best = (key, (first, last))
    assert best is not None, (num_layers, pp_size)
    return best[1]
