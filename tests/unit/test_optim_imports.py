"""megatron.canzona.optim is pure math: no collectives, no Megatron, no runtime.

tests/unit/test_layering.py checks absolute imports of every pure package; this adds
what it leaves out for optim: relative imports (resolved to absolute names) and what
importing the package actually loads, transitively, in a fresh interpreter.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "megatron" / "canzona" / "optim"
FORBIDDEN = ("torch.distributed", "megatron.core", "megatron.training", "canzona_patches", "megatron.canzona.runtime")


def package_of(path: pathlib.Path) -> str:
    """Dotted name of the package a file's relative imports are relative to."""
    return ".".join(path.relative_to(ROOT).parent.parts)


def imported_modules(source: str, package: str) -> set[str]:
    """Absolute names of everything ``source`` imports, relative imports resolved."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def forbidden(names: set[str]) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN))


@pytest.mark.parametrize("path", sorted(PACKAGE_DIR.rglob("*.py")), ids=lambda p: p.name)
def test_no_forbidden_imports(path):
    assert not forbidden(imported_modules(path.read_text(), package_of(path)))


def test_the_checker_resolves_relative_imports():
    source = "from ..runtime import engine\nfrom . import muon\nimport torch.distributed as dist\n"
    names = imported_modules(source, "megatron.canzona.optim")
    assert "megatron.canzona.runtime.engine" in names and "megatron.canzona.optim.muon" in names
    assert forbidden(names) == ["megatron.canzona.runtime", "megatron.canzona.runtime.engine", "torch.distributed"]


@pytest.mark.timeout(120)
def test_importing_the_package_loads_nothing_forbidden():
    probe = (
        "import sys, megatron.canzona.optim\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('megatron.core', 'megatron.training',"
        " 'canzona_patches', 'megatron.canzona.runtime')))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""
