"""Every optimizer setting in its range at parse time, in one line naming the flag.

The config dataclasses of ``megatron.canzona.optim`` check their fields in ``__post_init__``
(:func:`~megatron.canzona.optim.config.check_fields`: decay rates in [0, 1), epsilons and scales
above 0, counts of 1 or more, one of a ``Literal``'s values). Under ``--canzona`` the configs are
built from the flags while the flags are checked (``arguments.py``), and a :class:`FieldError` is
said with the flag that sets the field (:func:`field_error_line`): a field added to a config is checked without a list to keep, and
:func:`field_flag` names its flag (``tests/integration/test_parse_time_checks.py`` generates a
bad value for every field and requires its flag in the line).

Megatron's own optimizers (no ``--canzona``) are held to the rules torch's Adam and SGD would
raise on when the optimizer is built, after the model: betas in [0, 1), epsilon and learning rate
and weight decay 0 or more.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from canzona_patches.errors import CanzonaArgumentError
from megatron.canzona.optim import AdamWConfig, MuonConfig
from megatron.canzona.optim.config import FieldError

MUON_FLAGS = {"momentum": "--muon-momentum", "nesterov": "--muon-nesterov",
              "coefficients": "--muon-coefficient-type", "num_ns_steps": "--muon-num-ns-steps",
              "ns_dtype": "--muon-fp32-matmul-prec", "ns_method": "--muon-ns-method",
              "scale_mode": "--muon-scale-mode", "extra_scale_factor": "--muon-extra-scale-factor",
              "exact_norm": "--canzona-exact-norm"}
"""The flags of :class:`MuonConfig`'s fields (Megatron's ``--muon-*`` and Canzona's ``--muon-ns-method``)."""
MUON_WITHOUT_FLAG = {"eps": "Megatron's Muon has no flag for it: 1e-7, as its Newton-Schulz",
                     "ns_measured": "read from --canzona-calibration"}
"""Fields of :class:`MuonConfig` no flag sets, and why."""
ADAMW_FLAGS = {("betas", 0): "--adam-beta1", ("betas", 1): "--adam-beta2", ("eps", None): "--adam-eps"}
"""The flags of :class:`AdamWConfig`'s fields (Megatron's ``--adam-*``), by (field, element)."""
SHARED_FLAGS = {"stagger_refresh": "--canzona-no-stagger-refresh"}
"""Fields of Shampoo's and SOAP's configs set by one flag of the ``canzona`` group for both."""


def field_flag(config_class: type, name: str, index: int | None, matrix_flags: dict[str, Any]) -> str | None:
    """The command-line flag that sets field ``name`` (element ``index`` of a pair) of
    ``config_class``, the optimizers' generated flags being ``matrix_flags`` (the ``ConfigFlags``
    of ``arguments.MATRIX_FLAGS``); ``None`` for a field no flag sets (:data:`MUON_WITHOUT_FLAG`)."""
    if config_class is AdamWConfig:
        return ADAMW_FLAGS[(name, index)]
    for flags in matrix_flags.values():
        if flags.src_cfg_class is not config_class:
            continue
        if name in {f.name for f in flags.singles}:
            return flags._format_arg_name(name)
        if name in {f.name for f in flags.pairs}:
            return f"--{flags.prefix}-{flags.renames[name][index]}".replace("_", "-")
    if name in SHARED_FLAGS:
        return SHARED_FLAGS[name]
    if issubclass(config_class, MuonConfig) and name in {f.name for f in dataclasses.fields(MuonConfig)}:
        return MUON_FLAGS.get(name)
    raise KeyError(f"no flag known for {config_class.__name__}.{name}")


def field_error_line(error: FieldError, matrix_flags: dict[str, Any]) -> str:
    """A config field out of range (raised while the configs are built from the flags) as one
    line naming its flag, the value and a valid one."""
    flag = field_flag(error.config_class, error.name, error.index, matrix_flags)
    field = error.name if error.index is None else f"{error.name}[{error.index}]"
    return (f"{flag} {_shown(error.value)} {error.expected} ({error.config_class.__name__.removesuffix('Config')}'s "
            f"{field}): pass e.g. {flag} {_shown(error.example)}")


def check_megatron_optimizer_ranges(args: argparse.Namespace) -> None:
    """What torch's optimizers refuse when Megatron builds them (after the model, on every rank,
    in a traceback): said at parse time. Every run."""
    rules = [("--lr", getattr(args, "lr", None), "must be 0 or more", "3e-4", lambda v: v >= 0),
             ("--min-lr", getattr(args, "min_lr", None), "must be 0 or more", "3e-5", lambda v: v >= 0),
             ("--weight-decay", getattr(args, "weight_decay", None), "must be 0 or more", "0.1", lambda v: v >= 0)]
    if args.optimizer in ("adam", "muon", "adaptive_muon", "soap", "shampoo") and not args.canzona:
        rules += [("--adam-beta1", args.adam_beta1, "is outside [0, 1)", "0.9", lambda v: 0 <= v < 1),
                  ("--adam-beta2", args.adam_beta2, "is outside [0, 1)", "0.95", lambda v: 0 <= v < 1),
                  ("--adam-eps", args.adam_eps, "must be 0 or more", "1e-8", lambda v: v >= 0)]
    if args.optimizer in ("muon", "adaptive_muon") and not args.canzona:
        rules += [("--muon-momentum", args.muon_momentum, "is outside [0, 1)", "0.95", lambda v: 0 <= v < 1),
                  ("--muon-num-ns-steps", args.muon_num_ns_steps, "must be 1 or more", "5", lambda v: v >= 1)]
    if args.optimizer == "sgd":
        rules.append(("--sgd-momentum", args.sgd_momentum, "must be 0 or more", "0.9", lambda v: v >= 0))
    for flag, value, expected, example, valid in rules:
        if value is not None and not valid(value):  # NaN is invalid too
            raise CanzonaArgumentError(f"{flag} {_shown(value)} {expected}: pass e.g. {flag} {example}")


def _shown(value: object) -> str:
    return str(value) if not isinstance(value, str) else value
