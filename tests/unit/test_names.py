"""One definition per name: the matrix optimizers' names, the TP modes, the provenance
helpers and the Qwen3 architecture live in one place each, and everything else reads them
from there."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

from megatron.canzona.optim import MATRIX_OPTIMIZERS
from megatron.canzona.planning import COST_KINDS, OPTIMIZERS
from megatron.canzona.provenance import git_revision
from megatron.canzona.runtime.config import TP_MODES
from megatron.canzona.runtime.host_groups import MODES

pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted(p for d in ("tools", "canzona_patches", "megatron/canzona") for p in (ROOT / d).rglob("*.py"))


def test_the_optimizer_names_are_the_maths_and_the_cost_kinds():
    assert tuple(MATRIX_OPTIMIZERS) == OPTIMIZERS
    assert COST_KINDS[: len(OPTIMIZERS)] == OPTIMIZERS
    assert TP_MODES is MODES


def test_no_module_spells_the_lists_out_again():
    """A literal ``("muon", "shampoo", "soap")`` or ``("async", "sync")`` outside the module
    defining it is a second definition (``Literal[...]`` type hints aside)."""
    lists = {r"""\(\s*["']muon["'],\s*["']shampoo["'],\s*["']soap["']\s*[,)]""": "megatron/canzona/planning/cost.py",
             r"""\(\s*["']async["'],\s*["']sync["']\s*\)""": "megatron/canzona/runtime/host_groups.py"}
    for path in SOURCES:
        text = re.sub(r"Literal\[[^\]]*\]", "", path.read_text())
        for pattern, home in lists.items():
            if str(path.relative_to(ROOT)) != home:
                assert not re.search(pattern, text), f"{path.relative_to(ROOT)} defines {pattern} again; import it"


def test_git_revision_is_head_and_defined_once():
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode == 0:  # a git checkout (CI clones one)
        assert git_revision() == done.stdout.strip()
    defining = [p.relative_to(ROOT) for p in SOURCES if re.search(r"^def git_revision\(", p.read_text(), flags=re.M)]
    assert [str(p) for p in defining] == ["megatron/canzona/provenance.py"]


def test_one_class_describes_a_qwen3_architecture():
    """The planner's catalog, the dry run and the Hugging Face conversion share
    ``planning.qwen3.Qwen3Config``: no other class declares the fields that describe one
    (``num_query_groups`` and ``kv_channels`` beside ``num_layers``)."""
    import ast

    declaring = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                declared = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
                if {"num_layers", "num_query_groups", "kv_channels"} <= declared:
                    declaring.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert declaring == ["megatron/canzona/planning/qwen3.py:Qwen3Config"], declaring
