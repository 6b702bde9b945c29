"""Every patch of Megatron-Core internals goes through one table (canzona_patches/patches.toml,
installed by canzona_patches/registry.py).

Source scans (no Megatron import): no module of ``canzona_patches`` but the registry assigns an
attribute of an imported module or class; every scoped swap names a scoped row; the package
has no import cycle and never reaches test code; docs/patches.md shows the table as it is.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from canzona_patches import registry

pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "canzona_patches"
TABLE_BEGIN, TABLE_END = "<!-- patches:begin -->", "<!-- patches:end -->"


def _modules(*, harness: bool = True) -> dict[str, pathlib.Path]:
    """Every module of canzona_patches by dotted name (the test harness too, unless ``harness=False``)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if path.stem != "__init__" and (harness or parts[1] != "harness"):
            modules[".".join(parts)] = path
    return modules


# --------------------------------------------------------------------------- the table


def test_every_row_names_its_targets_condition_and_reason():
    seen: set[str] = set()
    for patch in registry.PATCHES:
        assert patch.targets, patch
        for target in patch.targets:
            assert re.fullmatch(r"[\w.]+:[\w.]+", target), target
            assert target not in seen, f"{target} is patched by two rows"
            seen.add(target)
        assert (patch.make is None) == (patch.group == registry.SCOPED), patch.targets
        if patch.make is not None:
            assert re.fullmatch(r"canzona_patches\.[\w.]+:\w+", patch.make), patch.make
        for text in (patch.condition, patch.reason):
            assert text and "\n" not in text and "|" not in text, patch.targets


def test_the_table_file_reads_into_rows_and_a_bad_row_is_named(tmp_path):
    lists, rows = registry.load_table()
    assert rows == registry.PATCHES and lists["cpu_torch_modules"] == registry.CPU_TORCH_MODULES
    cpu_torch = next(p for p in rows if p.make == "canzona_patches.emulation.cpu:cpu_torch" and p.group == registry.CPU)
    assert cpu_torch.targets == tuple(f"{m}:torch" for m in registry.CPU_TORCH_MODULES)
    assert cpu_torch.label.startswith(f"`torch` of {len(registry.CPU_TORCH_MODULES)} ")
    assert cpu_torch.when is registry.CONDITIONS["no_cuda"]  # the group's default
    text = registry.TABLE.read_text()
    bad = tmp_path / "patches.toml"
    bad.write_text(text.replace('when = "layer_wise_muon"', 'when = "layer_wise_moun"', 1))
    with pytest.raises(ValueError, match=r"\[\[patch\]\] number \d+ .*LayerWiseDistributedOptimizer.*layer_wise_moun"):
        registry.load_table(bad)
    bad.write_text(text.replace('[groups."baseline"]', '[groups."baseline-typo"]', 1))
    with pytest.raises(ValueError, match="must be registry.GROUPS"):
        registry.load_table(bad)


def test_the_docs_show_the_table():
    """Regenerate with ``python -m canzona_patches.registry --markdown``."""
    doc = (ROOT / "docs" / "patches.md").read_text()
    assert TABLE_BEGIN in doc and TABLE_END in doc
    shown = doc.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0]
    assert shown.strip() == registry.markdown_table().strip()


def test_a_scoped_swap_needs_a_row():
    with pytest.raises(KeyError, match="no scoped row"):
        with registry.swapped("megatron.training.checkpointing:save_checkpoint", lambda original: original):
            pass


# --------------------------------------------------------------------------- source scans


def assigned_foreign_attributes(source: str) -> list[str]:
    """``X.attr = ...``, ``X.attr += ...`` and ``setattr(X, ...)`` where ``X`` (the root of the
    target) is an imported name, or a name bound to ``importlib.import_module(...)``: an
    attribute of another module or of a class it defines. ``self``, arguments and other
    objects made here are not foreign."""
    tree = ast.parse(source)
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _is_import_module(node.value):
            imported.update(t.id for t in node.targets if isinstance(t, ast.Name))

    def foreign(expr: ast.expr) -> bool:
        while isinstance(expr, (ast.Attribute, ast.Subscript)):
            expr = expr.value
        return (isinstance(expr, ast.Name) and expr.id in imported) or (
            isinstance(expr, ast.Call) and _is_import_module(expr))

    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if foreign(node.args[0]):
                found.append(ast.unparse(node))
            continue
        found += [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute) and foreign(t.value)]
    return found


def _is_import_module(call: ast.Call) -> bool:
    return ast.unparse(call.func) in ("importlib.import_module", "import_module", "__import__")


def test_no_module_but_the_registry_patches_megatron_or_torch():
    # The harness's instruments (checkpoint faults, the host-sync counter) patch for one test
    # and undo it; they are no part of a run, so they are no rows of the table.
    offenders = {name: found for name, path in _modules(harness=False).items() if name != "canzona_patches.registry"
                 for found in [assigned_foreign_attributes(path.read_text())] if found}
    assert not offenders, f"attributes assigned outside canzona_patches/registry.py: {offenders}"


def test_the_scan_catches_every_form_of_patch():
    sample = """
import importlib
import torch
import megatron.training.training as training
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
training.save_checkpoint = None
torch.Tensor.type = None
DistributedOptimizer.step = None
setattr(training, "train_step", None)
importlib.import_module("megatron.core.utils").torch = None
module = importlib.import_module("megatron.core.timers")
module.torch = None
def fine(self, args, optimizer):
    self.x = args.y = optimizer.step = 1
"""
    assert sorted(assigned_foreign_attributes(sample)) == sorted([
        "training.save_checkpoint", "torch.Tensor.type", "DistributedOptimizer.step",
        "setattr(training, 'train_step', None)", "importlib.import_module('megatron.core.utils').torch",
        "module.torch",
    ])


def test_every_scoped_swap_names_a_scoped_row():
    scoped = {t for p in registry.PATCHES if p.group == registry.SCOPED for t in p.targets}
    swapped = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("swapped"):
                assert isinstance(node.args[0], ast.Constant), f"{path.name}: {ast.unparse(node)}"
                swapped.add(node.args[0].value)
    assert swapped == scoped


def imports_of(path: pathlib.Path) -> set[str]:
    """Every module an import statement anywhere in the file names (function bodies too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_canzona_patches_has_no_import_cycle():
    modules = _modules()
    graph = {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for dependency in sorted(graph[name]):
            assert state.get(dependency) != "open", " -> ".join([*trail, name, dependency])
            if dependency not in state:
                visit(dependency, [*trail, name])
        state[name] = "done"

    for name in modules:
        if name not in state:
            visit(name, [])


def test_one_way_to_install_once():
    """No install helpers or marks of their own beside the registry's record."""
    for name, path in _modules().items():
        if name != "canzona_patches.registry":
            assert not re.search(r"install_hook|__canzona\w*__|_installed\b", path.read_text()), name


def test_the_product_reaches_no_test_code():
    """Fault injection lives in canzona_patches/harness/faults.py, armed by the tests themselves."""
    for name, path in _modules(harness=False).items():
        text = path.read_text()
        assert not any(m.split(".")[0] in ("tests", "checkpoint_faults", "conftest") for m in imports_of(path)), name
        assert not re.search(r"\bfault|SIGKILL|os\.kill\(", text, re.IGNORECASE), name


def test_canzona_keeps_its_state_off_megatron_objects():
    """Canzona's own state lives in its own objects (``CanzonaSetup``, the optimizer's
    ``canzona`` part) and tables keyed by identity (``uneven``'s shard tables, the early
    gathers' listeners), never as attributes set on Megatron's buckets, groups or tensors. The
    one ``setattr`` is Megatron's own routing tag (``is_managed_by_layer_wise_optimizer``),
    which its DDP reads to give the matrices a buffer of their own."""
    found = {}
    for name, path in _modules(harness=False).items():
        if name == "canzona_patches.registry":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr":
                found.setdefault(name, []).append(ast.unparse(node.args[1]))
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                for target in getattr(node, "targets", [getattr(node, "target", None)]):
                    if isinstance(target, ast.Attribute) and target.attr.startswith("canzona"):
                        if ast.unparse(target.value) != "self":
                            found.setdefault(name, []).append(ast.unparse(target))
    assert found == {"canzona_patches.integration.layout": ["BUFFER_ROUTING_ATTR"]}, found
