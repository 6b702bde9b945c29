"""Every patch of Megatron-Core (and torch) internals, in one table: what, when and why.

A :class:`Patch` replaces attributes named ``"module:Attr.path"`` with ``make(original,
run)``: a wrapper of the original, or a stand-in. :data:`PATCHES` is the table.
:func:`install` installs the rows whose condition holds for a run's parsed flags
(``pretrain_gpt.py``); the CPU entry points (:func:`canzona_patches.emulation.cpu.enable_cpu_mode`,
:func:`~canzona_patches.emulation.cpu.enable_cpu_training_mode`,
:func:`canzona_patches.checkpoints.files.enable_cpu_checkpointing`) install their group with
:func:`install_group`. Either way each attribute is replaced once per process: installing
again finds the replacement in place and leaves it. A *scoped* row (no ``make``) is swapped
in for one call only, by :func:`swapped`.

Factories are named ``"module:function"`` and imported when their row is installed, so
this module imports no patch module, and a patch module may import it (to install its group
or swap a scoped row) without an import cycle.

``python -m canzona_patches.registry`` prints the table; ``--markdown`` prints docs/patches.md's.

The rows are data, in ``patches.toml`` beside this module (:data:`TABLE`; its fields are
described at its top). How to add a patch: write ``make(original, run) -> replacement`` next
to the code it serves; add a row to the table (targets, factory, condition in words and as a
predicate of :data:`CONDITIONS`, the upstream behaviour it changes in one line); paste
``--markdown`` into docs/patches.md.
``tests/unit/test_patch_registry.py`` fails on any Megatron or torch attribute assigned
elsewhere in ``canzona_patches``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import tomllib
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Groups: the rows one entry point installs together.
CPU = "cpu"  # cpu.enable_cpu_mode: Megatron-Core on CPU (or on meta, for dry runs)
CPU_TRAINING = "cpu-training"  # cpu.enable_cpu_training_mode: megatron.training on CPU
CPU_CHECKPOINT = "cpu-checkpoint"  # checkpoint_files.enable_cpu_checkpointing
CPU_SYNC_SAVE = "cpu-sync-save"  # the same, for synchronous saves
ARGUMENTS = "arguments"  # pretrain_gpt.py, before it parses the command line
CHECKSUMS = "checksums"  # a checksum per checkpoint file (pretrain_gpt.py unless --canzona-no-checksums; save_distributed)
PRETRAIN = "pretrain"  # pretrain_gpt.py's loop and checkpoints
CANZONA = "canzona"  # --canzona: its layout, optimizer and checkpoint metadata
UNEVEN = "uneven"  # layout.full_param_layouts, for a plan with variable-size DP shards (the whole layout)
EARLY_GATHER = "early-gather"  # early_gather.attach, when an async Canzona optimizer has gathers to issue
BASELINE = "baseline"  # upstream fixes only Megatron's own optimizers need
NORM = "norm"  # Megatron's gradient norm without Apex or Transformer Engine (pretrain_gpt.py and the harness)
CONTEXT_PARALLEL = "context-parallel"  # pretrain_gpt.py with --context-parallel-size > 1 and no transformer-engine
SCOPED = "scoped"  # swapped in for one call (:func:`swapped`), never installed
GROUPS = (CPU, CPU_TRAINING, CPU_CHECKPOINT, CPU_SYNC_SAVE, ARGUMENTS, CHECKSUMS, PRETRAIN, NORM, CONTEXT_PARALLEL,
          CANZONA, UNEVEN, EARLY_GATHER, BASELINE, SCOPED)


class Run:
    """What the patches installed together share: the run's parsed flags, and objects made
    once for several hooks (the interval metrics, the plan handed from DDP to the optimizer)."""

    def __init__(self, args: Any = None) -> None:
        self.args = args
        self._shared: dict[str, Any] = {}

    def shared(self, key: str, make: Callable[[], Any]) -> Any:
        """The object ``key``, made by ``make()`` on first use."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One row of the table."""

    targets: tuple[str, ...]
    """Every attribute replaced, as ``"module:Attr.path"``."""
    make: str | None
    """``"module:function"``; ``function(original, run)`` returns the replacement. ``None``
    for a scoped row, whose replacement the caller of :func:`swapped` makes."""
    condition: str
    """When it is installed, in words."""
    when: Callable[[Any], bool]
    """The same condition on a run's parsed flags (``pretrain_gpt.py``'s ``args``)."""
    reason: str
    """The upstream behaviour it changes, in one line."""
    group: str
    """The entry point that installs it (see the group constants above)."""
    label: str = ""
    """How the table names several targets at once (default: the targets themselves)."""


# --------------------------------------------------------------------------- conditions


def _always(args: Any) -> bool:
    return True


def _never(args: Any) -> bool:
    return False


def _no_cuda(args: Any) -> bool:
    return not torch.cuda.is_available()


def _checksums(args: Any) -> bool:
    return getattr(args, "canzona_checksums", True)


def _synchronous_saves_on_cpu(args: Any) -> bool:
    return _no_cuda(args) and not getattr(args, "async_save", False)


def _canzona(args: Any) -> bool:
    return bool(args.canzona)


def _layer_wise_muon(args: Any) -> bool:
    """Megatron's own layer-wise Muon (``validate_args`` turns ``--use-distributed-optimizer``
    into it for every optimizer but adam and sgd)."""
    return not args.canzona and bool(args.use_layer_wise_distributed_optimizer)


def _megatron_distributed_optimizer(args: Any) -> bool:
    """Megatron's own ``DistributedOptimizer`` runs: Adam with ``--use-distributed-optimizer``,
    or the Adam part of its layer-wise Muon. (Canzona's subclass overrides all three methods.)"""
    return not args.canzona and bool(args.use_distributed_optimizer or args.use_layer_wise_distributed_optimizer)


def _megatron_distributed_optimizer_on_torch(args: Any) -> bool:
    distrib_optimizer = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    return _megatron_distributed_optimizer(args) and not distrib_optimizer.HAVE_APEX_OR_TE


def _local_norm_fallback(args: Any) -> bool:
    """Megatron computes gradient norms with its local fallback (no Apex or Transformer Engine)."""
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    utils = importlib.import_module("megatron.core.utils")
    return clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm


def _context_parallel_without_te(args: Any) -> bool:
    """``--context-parallel-size`` > 1 where transformer-engine (Megatron's CP attention) is absent."""
    return getattr(args, "context_parallel_size", 1) > 1 and importlib.util.find_spec("transformer_engine") is None


def _megatron_distributed_optimizer_legacy_format(args: Any) -> bool:
    return _megatron_distributed_optimizer(args) and args.ckpt_format == "torch"


def _megatron_fsdp_checkpoints(args: Any) -> bool:
    """Megatron's own optimizers under Megatron-FSDP, saving or loading ``fsdp_dtensor``."""
    return not args.canzona and bool(getattr(args, "use_megatron_fsdp", False)) and args.ckpt_format == "fsdp_dtensor"


# --------------------------------------------------------------------------- the table

CONDITIONS: dict[str, Callable[[Any], bool]] = {
    predicate.__name__.removeprefix("_"): predicate for predicate in (
        _always, _never, _no_cuda, _checksums, _synchronous_saves_on_cpu, _canzona, _layer_wise_muon,
        _megatron_distributed_optimizer, _megatron_distributed_optimizer_on_torch,
        _megatron_distributed_optimizer_legacy_format, _megatron_fsdp_checkpoints, _local_norm_fallback,
        _context_parallel_without_te,
    )
}
"""The predicates a row's ``when`` names, by their function's name."""

TABLE = Path(__file__).with_name("patches.toml")
"""The table: one ``[[patch]]`` per row, its fields described at the top of the file."""


def _targets(spec: Any, lists: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    if isinstance(spec, list):
        return tuple(spec)
    if "of_modules" in spec:
        return tuple(f"{module}:{spec['attribute']}" for module in lists[spec["of_modules"]])
    return lists[spec["list"]]


def load_table(path: Path = TABLE) -> tuple[dict[str, tuple[str, ...]], tuple[Patch, ...]]:
    """The named lists and the rows of the table at ``path``."""
    with open(path, "rb") as f:
        table = tomllib.load(f)
    lists = {name: tuple(entries) for name, entries in table["lists"].items()}
    groups = table["groups"]
    if set(groups) != set(GROUPS):
        raise ValueError(f"{path}: its groups {sorted(groups)} must be registry.GROUPS {sorted(GROUPS)}")
    rows = []
    for number, row in enumerate(table["patch"], 1):
        try:
            group = groups[row["group"]]
            targets = _targets(row["targets"], lists)
            rows.append(Patch(
                targets=targets, make=row.get("make"), condition=row.get("condition", group.get("condition")),
                when=CONDITIONS[row.get("when", group.get("when"))], reason=row["reason"], group=row["group"],
                label=row.get("label", "").format(count=len(targets)),
            ))
        except (KeyError, TypeError) as err:
            raise ValueError(f"{path}: [[patch]] number {number} ({row.get('targets')}): missing or unknown {err}") from None
    return lists, tuple(rows)


_LISTS, PATCHES = load_table()
"""Every patch of Megatron-Core and torch internals (``tests/unit/test_patch_registry.py``)."""

CPU_TORCH_MODULES = _LISTS["cpu_torch_modules"]
"""Megatron-Core modules whose ``torch`` global is CPU mode's stand-in."""
CPU_TORCH_FSDP_MODULES = _LISTS["cpu_torch_fsdp_modules"]
"""Megatron-FSDP's modules, whose ``torch`` global is the CPU stand-in with device index 0."""
CPU_TORCH_TRAINING_MODULES = _LISTS["cpu_torch_training_modules"]
"""``megatron.training`` modules whose ``torch`` global is the one-device CPU stand-in."""
CHECKPOINT_WRITER_MODULES = _LISTS["checkpoint_writer_modules"]
"""The ``torch_dist`` writer's modules, redirected like :data:`CPU_TORCH_MODULES`."""
PRETEND_CUDA_WINDOWS = _LISTS["pretend_cuda_windows"]
"""Functions inside which a CPU tensor answers as a CUDA one."""

_SCOPED_TARGETS = frozenset(t for patch in PATCHES if patch.group == SCOPED for t in patch.targets)

# --------------------------------------------------------------------------- installing

_installed: dict[str, Any] = {}
"""Target -> the value this process put there; the one record of what is installed."""


def install(args: Any, *, groups: Collection[str] | None = None) -> list[Patch]:
    """Install every row (of ``groups``, default all) whose condition holds for ``args``, in
    table order; each attribute once per process. Returns the rows now in place."""
    run = Run(args)
    chosen = [p for p in PATCHES if p.make is not None and (groups is None or p.group in groups) and p.when(args)]
    for patch in chosen:
        _install(patch, run)
    return chosen


def install_group(group: str) -> None:
    """Install every row of ``group`` whatever its condition (its entry point has checked it)."""
    run = Run()
    for patch in PATCHES:
        if patch.group == group:
            _install(patch, run)


def installed(patch_or_group: Patch | str) -> bool:
    """Whether the row (every row of the group) is in place in this process."""
    rows = [patch_or_group] if isinstance(patch_or_group, Patch) else [p for p in PATCHES if p.group == patch_or_group]
    return bool(rows) and all(_in_place(target) for patch in rows for target in patch.targets)


def _install(patch: Patch, run: Run) -> None:
    assert patch.make is not None, f"{patch.targets[0]} is scoped: use swapped()"
    make = _resolve_factory(patch.make)
    for target in patch.targets:
        if _in_place(target):
            continue
        owner, name = _owner(target)
        replacement = make(getattr(owner, name), run)
        # A static method stays one (the class's attribute reads back as the plain function).
        static = isinstance(owner, type) and isinstance(owner.__dict__.get(name), staticmethod)
        setattr(owner, name, staticmethod(replacement) if static else replacement)
        _installed[target] = replacement


def _in_place(target: str) -> bool:
    if target not in _installed:
        return False
    owner, name = _owner(target)
    return getattr(owner, name) is _installed[target]


@contextmanager
def swapped(target: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """Within the ``with`` block ``target`` (a scoped row of :data:`PATCHES`) is
    ``make(original)``; the original is put back however the block ends."""
    if target not in _SCOPED_TARGETS:
        raise KeyError(f"{target} is no scoped row of canzona_patches.registry.PATCHES: add one")
    owner, name = _owner(target)
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _owner(target: str) -> tuple[Any, str]:
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


def _resolve_factory(reference: str) -> Callable[[Any, Run], Any]:
    module_name, _, name = reference.partition(":")
    return getattr(importlib.import_module(module_name), name)


# --------------------------------------------------------------------------- the printed table


def _what(patch: Patch) -> str:
    return patch.label or ", ".join(f"`{target}`" for target in patch.targets)


def markdown_table() -> str:
    """The table as docs/patches.md shows it."""
    lines = ["| patched | installed when | why |", "|---|---|---|"]
    lines += [f"| {_what(p)} | {p.condition} | {p.reason} |" for p in PATCHES]
    return "\n".join(lines) + "\n"


def text_table(*, every_target: bool = False) -> str:
    """The table for a terminal: one block per row (with ``every_target``, each target named)."""
    blocks = []
    for patch in PATCHES:
        what = list(patch.targets) if every_target or not patch.label else [patch.label]
        lines = [*what, f"    installed when: {patch.condition}", f"    why: {patch.reason}"]
        blocks.append("\n".join(lines).replace("`", ""))
    return "\n\n".join(blocks) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print every patch of Megatron-Core internals: what, when, why.")
    parser.add_argument("--markdown", action="store_true", help="docs/patches.md's table")
    parser.add_argument("--targets", action="store_true", help="name every attribute of a row that replaces several")
    options = parser.parse_args(argv)
    sys.stdout.write(markdown_table() if options.markdown else text_table(every_target=options.targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
