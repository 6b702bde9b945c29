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

import contextlib
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


def nonfinite_interval_warning(skipped: int, args: Any) -> str:
    """The log line of an interval whose every iteration was skipped for its gradient norm."""
    check_off = not getattr(args, "check_for_nan_in_loss_and_grad", True)
    why = ("Megatron's NaN check is off (--no-check-for-nan-in-loss-and-grad), so the run goes on without "
           "training: drop that flag to stop at the first NaN, or lower --lr" if check_off else
           "see --grad-norm-skip-threshold and --lr")
    return (f"[canzona] warning: all {skipped} iteration(s) of this log interval were skipped: the gradient norm "
            f"was inf, NaN or over the skip threshold each time and nothing trained; {why}")


def nonfinite_nothing_trained(skipped: int, args: Any) -> str | None:
    """Why a run whose every iteration was skipped, not for fp16, trained nothing; ``None`` for
    an fp16 run (its loss scale is the cause) or a run with Megatron's NaN check on."""
    if getattr(args, "fp16", False) or getattr(args, "check_for_nan_in_loss_and_grad", True):
        return None
    return (f"all {skipped} iterations were skipped: the gradient norm was inf or NaN each time and nothing "
            "trained; --no-check-for-nan-in-loss-and-grad let the run go on: drop it to stop at the first NaN "
            "(and see where it starts), then lower --lr or fix the input")
