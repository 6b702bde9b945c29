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


def test_an_assert_without_source_still_gives_one_line() -> None:
    exec_globals: dict = {}
    exec(compile("def f():\n    assert False, 'some\\nmessage'\n", "<nowhere>", "exec"), exec_globals)
    with pytest.raises(AssertionError) as raised:
        exec_globals["f"]()
    message = str(one_line(raised.value, argparse.Namespace()))
    assert message == "Megatron's flag check failed: some message"
