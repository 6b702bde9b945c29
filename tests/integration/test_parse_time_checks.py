"""What can be checked before training is checked while the flags are: a flag without the switch
it needs, an optimizer setting out of its range, a checkpoint format that cannot be saved, a
``--save`` that cannot hold checkpoints. One line each, naming the flag and a value that works.

The cases are generated: the dependent flags from :data:`DEPENDENT_FLAGS` (and from the help of
every Canzona flag that says it works "With --X"), the ranges from the fields of the optimizers'
config dataclasses, so that a new flag or field is covered without a list to keep.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal

import pytest

from canzona_patches.integration.arguments import MATRIX_FLAGS, CanzonaArgumentError, flag_groups, validate_canzona_args
from canzona_patches.integration.dependent_flags import DEPENDENT_FLAGS
from canzona_patches.integration.optimizer_ranges import MUON_WITHOUT_FLAG, field_flag
from megatron.canzona.optim import AdamWConfig, AdaptiveMuonConfig, MuonConfig, ShampooConfig, SOAPConfig
from megatron.canzona.runtime.save_lock import SaveDirectoryLocked, check_save_directory

from test_flags_need_their_run import CANZONA, in_tmp, parse

OPTIMIZER_OF = {MuonConfig: "muon", AdaptiveMuonConfig: "adaptive_muon", ShampooConfig: "shampoo",
                SOAPConfig: "soap", AdamWConfig: "muon"}
"""The ``--optimizer`` under which each config is built from the flags (AdamW: any matrix optimizer's)."""


def _megatron_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    from canzona_patches.integration.arguments import add_canzona_args

    return add_canzona_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


# --------------------------------------------------------------------------- dependent flags


def test_each_dependent_flags_default_is_its_parsers() -> None:
    """The table's defaults are the parser's: a flag given at its default is taken as not given."""
    defaults = vars(_megatron_parser().parse_args([]))
    for entry in DEPENDENT_FLAGS:
        assert defaults[entry.dest] == entry.default, entry.flag


@pytest.mark.parametrize("entry", DEPENDENT_FLAGS, ids=lambda entry: entry.flag)
def test_a_flag_without_its_switch_is_refused_naming_both(entry, tmp_path: Path) -> None:
    canzona = list(CANZONA) if entry.flag.startswith("--canzona") else []
    base = [*canzona, "--swiglu"] if entry.switch != "--swiglu" else canzona
    with pytest.raises(CanzonaArgumentError) as refused:
        validate_canzona_args(parse(*base, *in_tmp(list(entry.example), tmp_path)))
    line = str(refused.value)
    assert "\n" not in line and line.startswith(entry.flag) and f"does nothing without {entry.switch}" in line, line
    assert f"add {entry.switch}, or drop {entry.flag}" in line
    # with its switch on, the flag is taken (a later check may still answer other flags)
    args = parse(*base, *in_tmp([*entry.example, *entry.switch_words], tmp_path))
    try:
        validate_canzona_args(args)
    except CanzonaArgumentError as error:
        assert "does nothing without" not in str(error), str(error)


HELP_NEEDS = re.compile(r"^With (--[a-z0-9-]+)")


def _flags_whose_help_needs_another() -> list[tuple[str, str, argparse.Action]]:
    found = []
    for actions in flag_groups().values():
        for action in actions:
            match = HELP_NEEDS.match(action.help or "")
            if match:
                found.append((action.option_strings[0], match[1], action))
    return found


def test_the_help_of_a_flag_names_the_switch_it_needs() -> None:
    """The generated case below covers something: a Canzona flag's help says "With --X"."""
    assert any(flag == "--canzona-profile-file" for flag, _, _ in _flags_whose_help_needs_another())


@pytest.mark.parametrize(("flag", "switch", "action"), _flags_whose_help_needs_another(), ids=lambda x: str(x)[:40])
def test_a_flag_whose_help_needs_another_is_refused_without_it(flag: str, switch: str, action: argparse.Action,
                                                                tmp_path: Path) -> None:
    words = [flag] if action.nargs == 0 else [flag, str(tmp_path / "value")]
    with pytest.raises(CanzonaArgumentError, match=re.escape(switch)):
        validate_canzona_args(parse(*CANZONA, *words))


def test_early_compute_forced_on_without_a_budget_is_refused() -> None:
    with pytest.raises(CanzonaArgumentError, match="would compute nothing early.*--canzona-early-compute-budget 1"):
        validate_canzona_args(parse(*CANZONA, "--canzona-early-compute", "on", "--canzona-early-compute-budget", "0"))
    validate_canzona_args(parse(*CANZONA, "--canzona-early-compute", "on", "--canzona-early-compute-budget", "0.5"))


# --------------------------------------------------------------------------- optimizer ranges


def _bad_value(config_class: type, field: dataclasses.Field) -> tuple[Any, int | None] | None:
    """A value out of the field's range, by its type and name as ``check_fields`` reads them (and
    for a pair, which element), or ``None`` for a field without a range (a bool, free text)."""
    kind = typing.get_type_hints(config_class)[field.name]
    if typing.get_origin(kind) is Literal or kind is bool or kind is str or field.name == "ns_measured":
        return None  # argparse's choices and the coefficient names are checked where they are parsed
    if kind is int:
        return 0, None
    if kind is float:
        return (1.5 if field.name == "momentum" or "beta" in field.name else -1.0), None
    if kind == tuple[float, float]:
        return 1.5, 1
    raise AssertionError(f"{config_class.__name__}.{field.name}: no bad value for {kind}")


FIELDS = [(config_class, field) for config_class in OPTIMIZER_OF for field in dataclasses.fields(config_class)
          if field.init]


@pytest.mark.parametrize(("config_class", "field"), FIELDS, ids=lambda x: getattr(x, "__name__", getattr(x, "name", "")))
def test_every_optimizer_field_has_a_flag_or_a_reason(config_class: type, field: dataclasses.Field) -> None:
    names = {action.dest for action in _megatron_parser()._actions}
    for index in ((0, 1) if isinstance(field.default, tuple) and field.name == "betas" else (None,)):
        flag = field_flag(config_class, field.name, index, MATRIX_FLAGS)
        if flag is None:
            assert field.name in MUON_WITHOUT_FLAG
            continue
        assert flag.removeprefix("--").replace("-", "_").removeprefix("canzona_no_") in {
            n.removeprefix("canzona_") for n in names} | names, flag


RANGED = [(c, f) for c, f in FIELDS if _bad_value(c, f) is not None
          and field_flag(c, f.name, _bad_value(c, f)[1], MATRIX_FLAGS) is not None]  # MUON_WITHOUT_FLAG: no flag to give it


def test_the_generated_range_cases_cover_every_optimizer() -> None:
    assert {c for c, _ in RANGED} == set(OPTIMIZER_OF) and len(RANGED) >= 20


@pytest.mark.parametrize(("config_class", "field"), RANGED, ids=lambda x: getattr(x, "__name__", getattr(x, "name", "")))
def test_an_optimizer_setting_out_of_range_is_one_line_naming_its_flag(config_class: type,
                                                                       field: dataclasses.Field) -> None:
    value, index = _bad_value(config_class, field)
    flag = field_flag(config_class, field.name, index, MATRIX_FLAGS)
    optimizer = OPTIMIZER_OF[config_class]
    with pytest.raises(CanzonaArgumentError) as refused:
        validate_canzona_args(parse("--canzona", "--use-distributed-optimizer", "--optimizer", optimizer, flag, str(value)))
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{flag} {value}") and f"pass e.g. {flag} " in line, line


@pytest.mark.parametrize(("flags", "message"), [
    (["--optimizer", "adam", "--adam-beta2", "1.5"], r"^--adam-beta2 1.5 is outside \[0, 1\): pass e.g. --adam-beta2"),
    (["--optimizer", "adam", "--adam-eps=-1e-8"], r"^--adam-eps -1e-08 must be 0 or more"),
    (["--optimizer", "adam", "--lr", "-0.1"], r"^--lr -0.1 must be 0 or more"),
    (["--optimizer", "sgd", "--sgd-momentum", "-1"], r"^--sgd-momentum -1.0 must be 0 or more"),
    (["--optimizer", "adam", "--weight-decay", "nan"], r"^--weight-decay nan must be 0 or more"),
])
def test_megatrons_own_optimizer_settings_are_checked_too(flags: list[str], message: str) -> None:
    with pytest.raises(CanzonaArgumentError, match=message):
        validate_canzona_args(parse(*flags))


def test_settings_in_range_pass() -> None:
    for optimizer in ("muon", "shampoo", "soap", "adaptive_muon"):
        validate_canzona_args(parse(*CANZONA[:1], "--use-distributed-optimizer", "--optimizer", optimizer))
    validate_canzona_args(parse("--optimizer", "adam", "--adam-eps", "0"))  # torch's Adam takes 0


# --------------------------------------------------------------------------- checkpoints


def test_a_checkpoint_format_that_cannot_be_saved_is_refused_at_parse_time(tmp_path: Path) -> None:
    with pytest.raises(CanzonaArgumentError, match=r"^--ckpt-format torch cannot hold --canzona's optimizer state.*"
                       r"pass --ckpt-format torch_dist"):
        validate_canzona_args(parse(*CANZONA, "--save", str(tmp_path), "--ckpt-format", "torch"))
    validate_canzona_args(parse(*CANZONA, "--save", str(tmp_path)))
    validate_canzona_args(parse("--optimizer", "adam", "--save", str(tmp_path), "--ckpt-format", "torch"))


def test_a_save_path_that_is_a_file_is_named(tmp_path: Path) -> None:
    file = tmp_path / "ckpt"
    file.write_text("")
    with pytest.raises(SaveDirectoryLocked, match=rf"^--save {re.escape(str(file))} is a file, not a directory: "
                       r"pass a directory \(e.g. --save .*ckpt.d\)"):
        check_save_directory(file)
    with pytest.raises(SaveDirectoryLocked, match="cannot hold checkpoints: Not a directory"):
        check_save_directory(file / "below")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory; the immutable case covers root")
def test_a_read_only_save_directory_is_named(tmp_path: Path) -> None:
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(SaveDirectoryLocked, match="cannot hold checkpoints: Permission denied"):
            check_save_directory(tmp_path)
    finally:
        tmp_path.chmod(0o755)


def test_an_immutable_save_directory_is_named(tmp_path: Path) -> None:
    """``chattr +i`` (root only, where the filesystem supports it): even root cannot write there."""
    import subprocess

    if os.geteuid() != 0 or subprocess.run(["chattr", "+i", str(tmp_path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i needs root and a filesystem that has the attribute (the read-only case covers users)")
    try:
        with pytest.raises(SaveDirectoryLocked, match=r"cannot hold checkpoints: Operation not permitted.*an immutable"):
            check_save_directory(tmp_path)
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path)], check=True)
    check_save_directory(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
