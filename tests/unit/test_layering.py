"""The pure layers stay pure: planning/ and optim/ never import distribution or Megatron."""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[2]
PURE_PACKAGES = ("megatron/canzona/planning", "megatron/canzona/optim")
FORBIDDEN = ("torch.distributed", "megatron.core", "megatron.training", "canzona_patches", "megatron.canzona.runtime")


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` statement in the file names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Attribute) and ast.unparse(node).startswith("torch.distributed"):
            found.add("torch.distributed")  # e.g. torch.distributed.all_reduce(...) without an import
    return found


def violations(path: pathlib.Path) -> list[str]:
    return sorted(m for m in imported_modules(path) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_pure_package_imports_nothing_distributed(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package} has no Python files"
    bad = {str(f.relative_to(ROOT)): violations(f) for f in files if violations(f)}
    assert not bad, f"forbidden imports in pure layers: {bad}"


def test_the_checker_catches_a_violation(tmp_path):
    sample = tmp_path / "bad.py"
    sample.write_text("import torch\nfrom megatron.core import parallel_state\nx = torch.distributed.get_rank()\n")
    assert violations(sample) == ["megatron.core", "megatron.core.parallel_state", "torch.distributed"]


def test_no_megatron_init_shadows_the_namespace_package():
    assert not (ROOT / "megatron" / "__init__.py").exists()


def test_checkpoints_do_not_import_the_integration():
    """``integration`` builds the optimizer and reads ``checkpoints``; ``checkpoints`` reads only
    what both share (``canzona_patches.errors``, ``canzona_patches.params``): the two folders do
    not import each other."""
    files = sorted((ROOT / "canzona_patches" / "checkpoints").rglob("*.py"))
    assert files
    bad = {str(f.relative_to(ROOT)): sorted(m for m in imported_modules(f) if m.startswith("canzona_patches.integration"))
           for f in files}
    assert not {f: m for f, m in bad.items() if m}, bad
