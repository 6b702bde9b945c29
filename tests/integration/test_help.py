"""``pretrain_gpt.py --help``: the first command a user runs prints every flag, Canzona's in their own group."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.quick
def test_help_lists_megatron_and_canzona_flags():
    out = subprocess.run([sys.executable, "pretrain_gpt.py", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # A help string of Megatron-Core made from a config docstring with a literal "%".
    assert "(e.g. 1.10 = 10%)" in out.stdout
    canzona = out.stdout[out.stdout.index("\ncanzona:\n"):]
    for flag in ("--canzona ", "--canzona-alpha", "--canzona-tp-mode", "--canzona-no-stagger-refresh"):
        assert flag in canzona
    assert "--tensor-model-parallel-size" in out.stdout and "--optimizer" in out.stdout
