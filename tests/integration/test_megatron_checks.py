"""canzona_patches/integration/megatron_checks.py words a failed Megatron ``assert`` from the
failing statement itself: its message, else its condition; the flags it reads, with their values."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from canzona_patches.integration.megatron_checks import failed_check, one_line


CHECK = """def check(args):
    heads = args.num_attention_heads
    assert heads % args.num_query_groups == 0 and \\
        args.kv_channels > 0
"""
"""A Megatron-like check, in a module of its own (pytest rewrites the asserts of test modules)."""


def test_a_bare_assert_names_its_condition_and_flags(tmp_path) -> None:
    source = tmp_path / "megatron_like.py"
    source.write_text(CHECK)
    spec = importlib.util.spec_from_file_location("megatron_like", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = argparse.Namespace(num_attention_heads=4, num_query_groups=3, kv_channels=16)
    with pytest.raises(AssertionError) as raised:
        module.check(args)
    check = failed_check(raised.value)
    assert check.condition == "heads % args.num_query_groups == 0 and args.kv_channels > 0"  # both lines, joined
    assert check.flags == ("num_query_groups", "kv_channels") and check.local_values == {"heads": 4}
    message = str(one_line(raised.value, args))
    assert message.startswith("Megatron's flag check failed: `heads % args.num_query_groups == 0 and "
                              "args.kv_channels > 0` does not hold (")
    assert message.endswith("change --num-query-groups (3), --kv-channels (16) so that it holds") and "\n" not in message


ENVIRONMENT_CHECK = """import os


def check(args):
    assert os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS') != "1" or not args.use_megatron_fsdp, \\
        'FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset.'
"""
"""Megatron's FSDP check: it reads an environment variable, which the fix must name."""


def test_a_check_of_the_environment_names_the_variable(tmp_path, monkeypatch) -> None:
    source = tmp_path / "megatron_env_like.py"
    source.write_text(ENVIRONMENT_CHECK)
    spec = importlib.util.spec_from_file_location("megatron_env_like", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = argparse.Namespace(use_megatron_fsdp=True)
    with pytest.raises(AssertionError) as raised:
        module.check(args)
    assert failed_check(raised.value).environment == ("CUDA_DEVICE_MAX_CONNECTIONS",)
    message = str(one_line(raised.value, args))
    assert message.endswith("change --use-megatron-fsdp (True), the environment variable CUDA_DEVICE_MAX_CONNECTIONS "
                            "(now '1') so that it holds"), message


def test_an_assert_without_source_still_gives_one_line() -> None:
    exec_globals: dict = {}
    exec(compile("def f():\n    assert False, 'some\\nmessage'\n", "<nowhere>", "exec"), exec_globals)
    with pytest.raises(AssertionError) as raised:
        exec_globals["f"]()
    message = str(one_line(raised.value, argparse.Namespace()))
    assert message == "Megatron's flag check failed: some message"


class _AnyArgs(argparse.Namespace):
    """Flags as a failed check sees them (any value will do for the wording)."""

    def __getattr__(self, name: str):
        return 8


@pytest.mark.quick
def test_every_assert_of_validate_args_is_worded_in_one_line() -> None:
    """Generated from Megatron's source: each ``assert`` statement of ``validate_args`` fails in
    turn (an AssertionError raised at its very line, in its file, as if it had failed there), and
    each is worded in one line that says where it is and names the flags its condition reads."""
    import ast
    import re

    import megatron.training.arguments as megatron_arguments

    path = megatron_arguments.__file__
    tree = ast.parse(open(path).read())
    validate = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "validate_args")
    asserts = [n for n in ast.walk(validate) if isinstance(n, ast.Assert)]
    assert len(asserts) > 50, len(asserts)
    for node in asserts:
        scope: dict = {}
        exec(compile("\n" * (node.lineno - 2) + "def failed():\n    raise AssertionError()\n", path, "exec"), scope)
        with pytest.raises(AssertionError) as raised:
            scope["failed"]()
        message = str(one_line(raised.value, _AnyArgs()))
        assert "\n" not in message and message.startswith("Megatron's flag check failed: "), message
        assert f"arguments.py:{node.lineno})" in message, (node.lineno, message)
        read = dict.fromkeys(sub.attr for sub in ast.walk(node.test) if isinstance(sub, ast.Attribute)
                             and isinstance(sub.value, ast.Name) and sub.value.id == "args")
        special = re.search(r"(start a multiple of|does not split over|raise --max-position-embeddings|"
                            r"must be 1 or more)", message)
        if read and not special:
            for flag in read:
                assert "--" + flag.replace("_", "-") in message, (node.lineno, flag, message)
