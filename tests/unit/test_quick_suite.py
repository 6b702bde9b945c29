"""`make test` (the tests marked ``quick``) reaches every library module.

A module of ``megatron/canzona`` or ``canzona_patches`` is reached when a quick test file imports
it (a name imported from a package counts for the module that defines it), or when it is imported,
at the top or inside a function, by a module reached so, or by an entry point that a quick test
starts (``pretrain_gpt.py``, a ``tools/`` script or a ``tests/e2e/`` wrapper of an entry point, the
demo's recipe). A new module that nothing quick reaches fails here: mark a test of it ``quick``, or
list it in :data:`NOT_QUICK` with the reason.
"""

from __future__ import annotations

import ast
import importlib
import re
import types
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("megatron/canzona", "canzona_patches")
ENTRY_POINTS = {"pretrain_gpt.py": "pretrain_gpt.py", "pretrain_qwen3_tiny_cpu.sh": "pretrain_gpt.py"}
"""Text in a quick test file that means it starts this script."""
NAMED_IN = {"canzona_patches.registry": "canzona_patches/patches.toml"}
"""Modules that import the library modules a data file names (the patch table's ``module:attribute``)."""
NOT_QUICK = {
    "canzona_patches.harness.pretrain_with_fault": "pretrain_gpt.py with an injected checkpoint fault: the "
                                                   "resume and failure tests of make test-all",
}


def library_modules() -> dict[str, Path]:
    modules = {}
    for base in LIBRARIES:
        for path in (ROOT / base).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _defining_modules(module: str, name: str) -> set[str]:
    """``from module import name``: the module, and the module that defines ``name`` (or that is ``name``)."""
    try:
        value = getattr(importlib.import_module(module), name, None)
    except Exception:  # noqa: BLE001  (a module that does not import here reaches nothing)
        return {module}
    if isinstance(value, types.ModuleType):
        return {module, value.__name__}
    owner = getattr(value, "__module__", None)
    return {module, f"{module}.{name}"} | ({owner} if isinstance(owner, str) else set())


def imported_by(path: Path, resolve: bool, name: str = "") -> set[str]:
    """Every module ``path`` (the module ``name``) imports anywhere in it (``resolve``: through
    packages' re-exports)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{module}" if module else base
            for alias in node.names:
                found |= _defining_modules(module, alias.name) if resolve else {module, f"{module}.{alias.name}"}
    if name in NAMED_IN:
        found |= set(re.findall(r"\b((?:canzona_patches|megatron\.canzona)(?:\.\w+)+)", (ROOT / NAMED_IN[name]).read_text()))
    return found


def _is_quick(path: Path) -> bool:
    text = path.read_text()
    return "mark.quick" in text or re.search(r"^pytestmark\s*=.*quick", text, re.M) is not None


def reached_by_quick_tests() -> set[str]:
    modules = library_modules()
    roots: set[str] = set()
    scripts: set[Path] = set()
    for test in (ROOT / "tests").rglob("test_*.py"):
        if not _is_quick(test):
            continue
        roots |= imported_by(test, resolve=True)
        text = test.read_text()
        scripts |= {ROOT / script for mention, script in ENTRY_POINTS.items() if mention in text}
        scripts |= {ROOT / name for name in re.findall(r"(?:tools|tests/e2e)/\w+\.py", text) if (ROOT / name).is_file()}
    for script in scripts:
        roots |= imported_by(script, resolve=False)
    reached, todo = set(), [name for name in roots if name in modules]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += [other for other in imported_by(modules[name], resolve=False, name=name)
                     if other in modules and other not in reached]
    return reached


def test_every_library_module_is_reached_by_the_quick_suite() -> None:
    modules = library_modules()
    assert len(modules) > 50 and set(NOT_QUICK) <= set(modules), sorted(set(NOT_QUICK) - set(modules))
    # a package counts with its modules: `import megatron.canzona.optim.muon` runs the package's __init__
    reached = reached_by_quick_tests()
    reached |= {name.rsplit(".", depth)[0] for name in reached for depth in (1, 2, 3) if name.count(".") >= depth}
    missing = sorted(name for name in modules if name not in reached and name not in NOT_QUICK)
    assert not missing, f"no quick test reaches {missing}: mark one quick, or list it in NOT_QUICK with why"
    assert not set(NOT_QUICK) & reached, f"listed as not quick but reached: {sorted(set(NOT_QUICK) & reached)}"
