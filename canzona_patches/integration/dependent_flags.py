"""Flags that act only under a switch are refused without it, in one line naming both.

A flag that tunes a feature (QK-clip's threshold, the exit signal, the save interval, the early-
compute budget) does nothing when the feature's switch is off, and a run that took it would go on
without what its user asked for. :data:`DEPENDENT_FLAGS` lists them, each with the switch it needs;
``tests/integration/test_dependent_flags.py`` runs every entry without its switch (refused, naming
both) and with it (taken), reads each entry's default from the parser, and requires every flag
whose help says it works "with" another flag to be listed here or refused by its own check.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable
from dataclasses import dataclass

from canzona_patches.errors import CanzonaArgumentError


@dataclass(frozen=True)
class Dependent:
    """A flag (``dest`` at a value other than ``default``) that does nothing unless ``switch``
    is on, as ``on(args)`` tells; ``does`` says what it would do, ``example`` gives it a value."""

    flag: str
    dest: str
    default: object
    switch: str
    on: Callable[[argparse.Namespace], bool]
    does: str
    example: tuple[str, ...]
    """Command-line words that give the flag a value other than its default."""
    switch_words: tuple[str, ...]
    """Command-line words that turn the switch on (what a test adds to see the flag taken)."""


def _qk_clip(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "qk_clip", False))


DEPENDENT_FLAGS = (
    Dependent("--qk-clip-threshold", "qk_clip_threshold", 100.0, "--qk-clip", _qk_clip,
              "sets the logit above which QK-clip scales a head's query and key rows",
              ("--qk-clip-threshold", "50"), ("--qk-clip",)),
    Dependent("--qk-clip-alpha", "qk_clip_alpha", 0.5, "--qk-clip", _qk_clip,
              "splits QK-clip's scaling between the query and key rows",
              ("--qk-clip-alpha", "0.25"), ("--qk-clip",)),
    Dependent("--exit-signal", "exit_signal", signal.SIGTERM, "--exit-signal-handler",
              lambda args: bool(args.exit_signal_handler),
              "names the signal on which every rank saves a checkpoint and exits",
              ("--exit-signal", "SIGUSR1"), ("--exit-signal-handler",)),
    Dependent("--save-interval", "save_interval", None, "--save", lambda args: bool(args.save),
              "sets how often a checkpoint is saved", ("--save-interval", "100"), ("--save", "{tmp}/ckpt")),
    Dependent("--canzona-no-checksums", "canzona_checksums", True, "--save or --load",
              lambda args: bool(args.save or args.load),
              "turns off the SHA-256 of each checkpoint file, recorded at a save and verified at a load",
              ("--canzona-no-checksums",), ("--save", "{tmp}/ckpt")),
    Dependent("--canzona-split-gate-up", "canzona_split_gate_up", False, "--swiglu",
              lambda args: bool(getattr(args, "swiglu", False)),
              "splits SwiGLU's fused fc1 into its gate and up halves, which a model without --swiglu does not have",
              ("--canzona-split-gate-up",), ("--swiglu",)),
)
"""Every flag that needs a switch, and the switch (see the module docstring)."""


def check_dependent_flags(args: argparse.Namespace) -> None:
    """Refuse a flag of :data:`DEPENDENT_FLAGS` given without its switch, naming both."""
    for entry in DEPENDENT_FLAGS:
        value = getattr(args, entry.dest, entry.default)
        if value == entry.default or value is entry.default or entry.on(args):
            continue
        given = entry.flag if isinstance(value, bool) else f"{entry.flag} {_spelled(value)}"
        raise CanzonaArgumentError(
            f"{given} does nothing without {entry.switch} (it {entry.does}): add {entry.switch}, or drop {entry.flag}")


def _spelled(value: object) -> str:
    """A value as it was given: a signal by its name."""
    return getattr(value, "name", None) or str(value)
