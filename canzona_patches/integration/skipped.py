"""Skipped iterations, said as they are (``training_log``, megatron-core 0.19.2).

An iteration is skipped when its gradient norm is inf or NaN (an fp16 overflow, or, with
Megatron's NaN check off, ``--no-check-for-nan-in-loss-and-grad``, a run gone non-finite) or over
``--grad-norm-skip-threshold``. Megatron's ``training_log`` leaves a skipped iteration's loss out
of its interval sums and divides by the trained iterations, at least one: an interval whose every
iteration was skipped logs ``lm loss: 0.000000E+00``. :class:`SkippedLosses` keeps the skipped
losses of the interval and, for such an interval only, hands ``training_log`` their mean: the loss
those iterations had (NaN where it was NaN, which Megatron then leaves off the line and counts
among the "nan iterations"). The interval metrics' ``lm_loss`` falls back to the same mean.
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

ADVANCED = "advanced iterations"
"""Megatron's count of the interval's trained iterations in ``total_loss_dict``."""


class SkippedLosses:
    """The losses of the skipped iterations of one log interval, per key, kept on the device."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0
        self._trained = 0

    def record(self, loss_dict: dict[str, torch.Tensor], skipped_iter: int) -> None:
        if not skipped_iter:
            self._trained += 1
            return
        self._count += 1
        for key, loss in loss_dict.items():
            value = loss.detach().float().sum()
            self._sums[key] = value if key not in self._sums else self._sums[key] + value

    @property
    def all_skipped(self) -> int:
        """How many iterations the interval skipped, when it trained none; 0 otherwise."""
        return 0 if self._trained else self._count

    @contextlib.contextmanager
    def honest(self, total_loss_dict: dict[str, Any], *, logging_now: bool, reset: bool) -> Iterator[None]:
        """Around one ``training_log`` call: at a log iteration of an interval that trained
        nothing, its sums hold the skipped iterations' mean loss (divided by one, as Megatron
        does with no trained iteration); afterwards they are as Megatron left them, or as they
        were where it keeps them (``reset`` false: the first iteration, logged off the interval)."""
        swap = logging_now and self._count and not self._trained and not total_loss_dict.get(ADVANCED, 0)
        before = {key: total_loss_dict.get(key) for key in self._sums} if swap else {}
        for key in before:
            total_loss_dict[key] = (self._sums[key] / self._count).reshape(1)
        try:
            yield
        finally:
            if not reset:
                for key, value in before.items():
                    if value is None:
                        total_loss_dict.pop(key, None)
                    else:
                        total_loss_dict[key] = value
            if logging_now and reset:
                self._sums, self._count, self._trained = {}, 0, 0


SKIP_REASONS = ("overflow", "nonfinite", "threshold")
"""Why an iteration was skipped: an fp16 loss-scale overflow, a gradient norm that is inf or NaN,
a finite norm over ``--grad-norm-skip-threshold``."""


def skip_reason(grad_norm: float | None, args: Any) -> str:
    """Which of :data:`SKIP_REASONS` skipped an iteration whose gradient norm was ``grad_norm``
    (``None``: Megatron's fp16 step found an inf and computed none). A finite norm is skipped only
    over the threshold; an fp16 run's inf or NaN is its loss scaler's (it skips and lowers the
    scale); a non-finite norm otherwise is the run's own."""
    norm = None if grad_norm is None else float(grad_norm)
    if norm is not None and math.isfinite(norm):
        return "threshold"
    return "overflow" if getattr(args, "fp16", False) else "nonfinite"


def why_skipped(reasons: collections.Counter, args: Any, *, last_norm: float | None = None) -> str:
    """Why the skipped iterations of ``reasons`` (a count per :data:`SKIP_REASONS`) were skipped,
    and what to do, in words: ``"the fp16 loss scale overflowed each time ...; pass a lower
    --initial-loss-scale (...)"``; several reasons are counted."""
    threshold = getattr(args, "grad_norm_skip_threshold", math.inf)
    what = {
        "overflow": ("the fp16 loss scale overflowed", "pass a lower --initial-loss-scale"
                     + (f" (this run's: {args.initial_loss_scale:g})" if getattr(args, "initial_loss_scale", None) else "")),
        "nonfinite": ("the gradient norm was inf or NaN",
                      "--no-check-for-nan-in-loss-and-grad let the run go on: drop it to stop at the first NaN (and see "
                      "where it starts), then lower --lr or fix the input"
                      if not getattr(args, "check_for_nan_in_loss_and_grad", True) else "lower --lr or fix the input"),
        "threshold": (f"the gradient norm was over --grad-norm-skip-threshold {threshold:g}"
                      + (f" (last: {last_norm:.4g})" if last_norm is not None and math.isfinite(last_norm) else ""),
                      "raise --grad-norm-skip-threshold (or drop it), or lower --lr"),
    }
    given = [reason for reason in SKIP_REASONS if reasons.get(reason)]
    if len(given) == 1:
        cause, fix = what[given[0]]
        return f"{cause} each time and nothing trained; {fix}"
    causes = ", ".join(f"{reasons[reason]} because {what[reason][0]}" for reason in given)
    return f"{causes}; nothing trained: " + "; ".join(what[reason][1] for reason in given)


def interval_skipped_warning(skipped: int, reasons: collections.Counter, args: Any, last_norm: float | None) -> str:
    """The log line of an interval whose every iteration was skipped."""
    return f"[canzona] warning: all {skipped} iteration(s) of this log interval were skipped: " \
           f"{why_skipped(reasons, args, last_norm=last_norm)}"


def run_skipped_warning(skipped: int, reasons: collections.Counter, args: Any, last_norm: float | None,
                        loss_scale: float | None = None) -> str:
    """The log line of a run whose every iteration so far was skipped."""
    scale = f" (the loss scale is now {loss_scale:g})" if reasons.get("overflow") and loss_scale is not None else ""
    return (f"[canzona] warning: all {skipped} iteration(s) so far were skipped{scale}: "
            f"{why_skipped(reasons, args, last_norm=last_norm)}")


def nothing_trained_line(skipped: int, reasons: collections.Counter, args: Any, last_norm: float | None) -> str:
    """The error line of a finished run whose every iteration was skipped."""
    return f"all {skipped} iterations were skipped: {why_skipped(reasons, args, last_norm=last_norm)}"
