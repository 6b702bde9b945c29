"""Tools run as ``python tools/x.py`` from anywhere: the package is installed (editable), so
a tool edits ``sys.path`` only to reach ``tests/`` or another tool, which the tools that
still share the tiny-GPT harness do (moving it into the library is the way out)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
REACHES = re.compile(r"^\s*(?:from|import) (?:tests|tools)\b|^\s*(?:from|import) (?:plot_loss|pretrain_gpt)\b", re.M)


def test_only_tools_reaching_tests_or_tools_edit_sys_path():
    editing = []
    for path in sorted((ROOT / "tools").glob("*.py")):
        text = path.read_text()
        if "sys.path.insert" in text and not REACHES.search(text):
            editing.append(path.name)
    assert not editing, f"{editing} edit sys.path without needing it: megatron.canzona and canzona_patches are installed"
