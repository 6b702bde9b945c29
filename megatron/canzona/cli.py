"""The tools' command lines: a parser whose errors are one line, and value types for their numeric
options (``type=`` of ``argparse``): counts, sizes, budgets and timeouts are refused at parse time
when negative (or zero, where zero means nothing), as ``pretrain_gpt.py`` refuses its own; ``inf``
is a budget without a bound, NaN none.

How to use them: ``parser = ArgumentParser(...)``, ``parser.add_argument("--steps",
type=at_least(1))``; a new option that takes a number picks the type here that says what it is
(``tests/unit/test_tools_args.py`` reads every tool's options and refuses a bare ``int`` or
``float``, but for :data:`SIGNED_OPTIONS`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

SIGNED_OPTIONS = ("--seed", "--master-port")
"""Numeric options of the tools where any integer is a value (a seed; a port, checked by the OS)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors, ``<tool>: error: <what is wrong and the fix>``,
    without the usage block argparse prints first (``--help`` shows it), and, as Megatron's own
    parser, no abbreviated flags: a prefix is an error instead of another flag taken silently
    (``tools/plan.py --fsdp`` was once ``--fsdp-cases``)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def at_least(minimum: int) -> Callable[[str], int]:
    """A whole number of ``minimum`` or more (a count, a size, a number of steps)."""

    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}: pass a whole number of {minimum} or more")
        return value

    whole.__name__ = f"at_least_{minimum}"
    return whole


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError("nan is not a number: pass one")
    return value


def non_negative(text: str) -> float:
    """A budget, a rate or a norm: 0 or more (``inf``: no bound)."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value:g} is negative: pass 0 or more")
    return value


def positive(text: str) -> float:
    """A timeout, a size in units or a tolerance: above 0 (``inf``: no bound)."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value:g} is not above 0: pass a positive number")
    return value


def fraction(text: str) -> float:
    """A share or a balance weight in [0, 1]."""
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value:g} is outside [0, 1]: pass a value in [0, 1]")
    return value
