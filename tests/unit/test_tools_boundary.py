"""Tools apart from tests: a tool runs as ``python tools/x.py`` from any directory (the
packages and ``pretrain_gpt`` are installed, editable), imports neither ``tests/`` nor another
tool (what two of them share lives in the library: ``canzona_patches.harness``,
``megatron.canzona.curves``, ``megatron.canzona.provenance``), and no test or tool imports a
private name across the boundary: a test uses a tool's public functions only, and neither uses
the harness's private ones."""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS = sorted((ROOT / "tools").glob("*.py"))
TOOL_NAMES = {path.stem for path in TOOLS}
TESTS = sorted((ROOT / "tests").rglob("*.py"))
HARNESS = "canzona_patches.harness"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def imported_modules(tree: ast.AST) -> set[str]:
    """Every module a file imports, at any depth (``from x import y`` gives ``x`` and ``x.y``)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def private_imports(tree: ast.AST, *, across: set[str]) -> list[str]:
    """``from M import _x`` with ``M`` (or its first part) in ``across``, and ``A._x`` where ``A``
    names a module of ``across`` (``import M as A``, ``from tools import M``, a module loaded by
    ``importlib.util.module_from_spec``, or a name equal to a tool's)."""
    aliases = set(across)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if any(node.module == m or node.module.startswith(m + ".") for m in across):
                found += [f"from {node.module} import {a.name}" for a in node.names if _private(a.name)]
            if node.module == "tools":
                aliases.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            aliases.update(a.asname or a.name for a in node.names if a.name in across or a.name.startswith("tools."))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and ast.unparse(node.value.func).endswith("module_from_spec"):
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in aliases and _private(node.attr):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def _parse(path: pathlib.Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def test_tools_edit_no_sys_path_and_import_neither_tests_nor_tools():
    offenders = {}
    for path in TOOLS:
        text = path.read_text()
        reached = {m for m in imported_modules(_parse(path))
                   if m.split(".")[0] in {"tests", "tools", "conftest"} | (TOOL_NAMES - {path.stem})}
        if "sys.path" in text or reached:
            offenders[path.name] = sorted(reached) or ["sys.path"]
    assert not offenders, (f"{offenders}: move what tools share into the library (canzona_patches.harness, "
                           "megatron.canzona) and import it from there")


def test_no_private_name_crosses_the_tools_tests_boundary():
    offenders = {}
    for path in TESTS:
        found = private_imports(_parse(path), across=TOOL_NAMES | {"tools", HARNESS})
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    for path in TOOLS:
        found = private_imports(_parse(path), across={HARNESS})
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, f"private names used across the tools/tests boundary: {offenders}; make them public"


def test_the_scan_finds_each_form():
    sample = ast.parse(
        "import importlib.util\n"
        "from tools import bench_step\n"
        "import simulate as cli\n"
        "from canzona_patches.harness.tiny_gpt import _build, TinyRun\n"
        "m = importlib.util.module_from_spec(spec)\n"
        "bench_step._rank(); cli._main(); m._x(); convert_hf._copy(); ok._fine(); m.public(); m.__name__\n")
    found = private_imports(sample, across={"simulate", "convert_hf", "tools", HARNESS})
    assert sorted(found) == sorted(["from canzona_patches.harness.tiny_gpt import _build", "bench_step._rank",
                                    "cli._main", "m._x", "convert_hf._copy"])
    assert {"tests.multirank", "plot_loss"} <= imported_modules(ast.parse(
        "def f():\n    from tests.multirank import x\n    import plot_loss\n"))
