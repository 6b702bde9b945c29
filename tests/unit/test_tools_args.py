"""The tools take sizes, counts and budgets as ``pretrain_gpt.py`` does: a negative one (or zero,
where zero means nothing) is refused at parse time in one line. Every numeric option of every
tool is read from the tools' sources, so an option added later with a bare ``int`` or ``float``
fails here, and the shared types of ``megatron.canzona.cli`` are checked on their own."""

from __future__ import annotations

import argparse
import ast
import math
import pathlib
import subprocess
import sys

import pytest

from megatron.canzona.cli import SIGNED_OPTIONS, at_least, fraction, non_negative, positive

pytestmark = pytest.mark.quick

pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS = sorted((ROOT / "tools").glob("*.py"))


def numeric_options(path: pathlib.Path) -> list[tuple[str, str]]:
    """``(flag, type)`` of every ``add_argument`` of ``path`` with a ``type=``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            kind = next((k.value for k in node.keywords if k.arg == "type"), None)
            if kind is not None and node.args:
                found.append((ast.unparse(node.args[0]).strip("'\""), ast.unparse(kind)))
    return found


def test_every_numeric_option_of_the_tools_has_a_checked_type() -> None:
    options = [(path.name, flag, kind) for path in TOOLS for flag, kind in numeric_options(path)]
    bare = [f"{name} {flag}: type={kind}" for name, flag, kind in options
            if kind in ("int", "float") and flag not in SIGNED_OPTIONS]
    assert bare == [], "give these a type of megatron.canzona.cli: " + "; ".join(bare)
    checked = [o for o in options if o[2].startswith(("at_least(", "fraction", "non_negative", "positive"))]
    assert len(checked) >= 100  # the tools' counts, sizes, budgets and timeouts (120 today)


@pytest.mark.parametrize(("kind", "text", "message"), [
    (at_least(1), "-3", "-3 is below 1: pass a whole number of 1 or more"),
    (at_least(1), "0", "0 is below 1"),
    (at_least(0), "-1", "-1 is below 0"),
    (at_least(1), "2.5", "'2.5' is not a whole number"),
    (non_negative, "-0.5", "-0.5 is negative: pass 0 or more"),
    (non_negative, "nan", "nan is not a number"),
    (positive, "0", "0 is not above 0"),
    (positive, "-600", "-600 is not above 0"),
    (fraction, "1.5", "1.5 is outside \\[0, 1\\]"),
    (fraction, "-0.1", "-0.1 is outside"),
])
def test_a_bad_value_is_refused_naming_it(kind, text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        kind(text)


def test_good_values_pass() -> None:
    assert at_least(0)("0") == 0 and at_least(1)("7") == 7
    assert non_negative("0") == 0.0 and math.isinf(non_negative("inf"))
    assert positive("1e-3") == 1e-3 and fraction("0") == 0.0 and fraction("1") == 1.0


@pytest.mark.parametrize("argv", [["tools/plan.py", "--bucket-size", "-5"],
                                  ["tools/simulate.py", "--early-compute-budget", "-1"]])
def test_a_tool_refuses_a_negative_size_in_one_line(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert f"argument {argv[1]}" in errors[0] and "-" in errors[0] and "Traceback" not in done.stderr


def test_the_tools_take_no_abbreviated_flag() -> None:
    """As Megatron's parser: ``--fsdp-c`` is not ``--fsdp-cases``, it is an error naming it."""
    from megatron.canzona.cli import ArgumentParser

    parser = ArgumentParser(prog="tool")
    parser.add_argument("--fsdp-cases", action="store_true")
    assert parser.parse_args(["--fsdp-cases"]).fsdp_cases
    with pytest.raises(SystemExit):
        parser.parse_args(["--fsdp-c"])
    result = subprocess.run([sys.executable, "tools/plan.py", "--fsdp-c"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "unrecognized arguments: --fsdp-c" in result.stderr, result.stderr
