"""Megatron-Core's own argument checks, answered in one line.

Megatron's ``validate_args`` checks the flags with bare ``assert`` statements: a failed one
prints a traceback on every rank, sometimes with no message at all. :func:`one_line` turns
the ``AssertionError`` into a :class:`~canzona_patches.integration.arguments.CanzonaArgumentError`
naming what failed and the flags involved, read from the failing statement itself (its
source, found through the traceback, and the values of the flags and locals it names), with
the fix for the checks a user commonly trips. Nothing of Megatron's checks is repeated here:
they run, and this only words their failure.
"""

from __future__ import annotations

import argparse
import ast
import functools
import linecache
import os
import re
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from canzona_patches.errors import CanzonaArgumentError


@dataclass(frozen=True)
class FailedCheck:
    """The ``assert`` that failed: where, its condition and message as written, what it names."""

    file: str
    line: int
    condition: str
    message: str
    flags: tuple[str, ...]
    """``args`` attributes the condition reads, in order."""
    local_values: dict[str, Any]
    """Other names of the condition and their values where it failed."""
    environment: tuple[str, ...] = ()
    """Environment variables the condition reads (``os.environ.get('X')``, ``os.environ['X']``,
    ``os.getenv('X')``), in order."""


def _statement(file: str, line: int) -> ast.Assert | None:
    """The ``assert`` statement of ``file`` spanning ``line``."""
    tree = _parsed(file)
    if tree is None:
        return None
    found = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and node.lineno <= line <= (node.end_lineno or node.lineno):
            found = node
    return found


@functools.lru_cache(maxsize=8)
def _parsed(file: str) -> ast.Module | None:
    source = "".join(linecache.getlines(file))
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def failed_check(error: BaseException) -> FailedCheck | None:
    """The innermost ``assert`` of ``error``'s traceback, read from its source (None when the
    source cannot be found)."""
    frames: list[tuple[str, int, dict]] = []
    tb: TracebackType | None = error.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_locals))
        tb = tb.tb_next
    for file, line, local in reversed(frames):
        node = _statement(file, line)
        if node is None:
            continue
        source = "".join(linecache.getlines(file))
        condition = ast.get_source_segment(source, node.test) or ""
        flags: list[str] = []
        names: dict[str, Any] = {}
        for sub in sorted(ast.walk(node.test), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "args":
                if sub.attr not in flags:
                    flags.append(sub.attr)
            elif isinstance(sub, ast.Name) and sub.id not in ("args",) and sub.id in local:
                value = local[sub.id]
                if isinstance(value, (int, float, str, bool, type(None))):
                    names[sub.id] = value
        return FailedCheck(file=file, line=line, condition=" ".join(condition.replace("\\\n", " ").split()),
                           message=str(error),
                           flags=tuple(flags), local_values=names, environment=_environment_read(node.test))
    return None


def _environment_read(test: ast.expr) -> tuple[str, ...]:
    """The environment variables an ``assert`` condition reads by name."""
    found: list[str] = []
    for sub in ast.walk(test):
        name = None
        if isinstance(sub, ast.Call) and sub.args and isinstance(sub.args[0], ast.Constant):
            func = ast.unparse(sub.func)
            if func in ("os.environ.get", "os.getenv", "environ.get", "getenv"):
                name = sub.args[0].value
        elif isinstance(sub, ast.Subscript) and ast.unparse(sub.value) in ("os.environ", "environ") \
                and isinstance(sub.slice, ast.Constant):
            name = sub.slice.value
        if isinstance(name, str) and name not in found:
            found.append(name)
    return tuple(found)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fix(check: FailedCheck, args: argparse.Namespace) -> str:
    """What to change, for the checks users trip; else: the flags named, so that it holds."""
    condition = check.condition
    if "world_size %" in condition:
        size = check.local_values.get("total_model_size")
        if size:
            return (f"start a multiple of TP x PP x CP = {size} processes (torchrun --nproc-per-node x --nnodes), or "
                    "change the TP, PP or CP size")
    if "num_layers %" in condition and "pipeline" in condition:
        return (f"--num-layers {args.num_layers} does not split over {args.pipeline_model_parallel_size} stages: pick a "
                "--pipeline-model-parallel-size that divides it, or set --decoder-first-pipeline-num-layers")
    if "max_position_embeddings" in condition:
        return (f"raise --max-position-embeddings (now {args.max_position_embeddings}) to at least --seq-length "
                f"{args.seq_length}, or lower --seq-length")
    positive = re.fullmatch(r"args\.(\w+) > 0", condition)
    if positive:
        return f"{_flag(positive.group(1))} must be 1 or more"
    named = [f"{_flag(f)} ({getattr(args, f, None)})" for f in check.flags if not f.startswith("_")]
    named += [f"the environment variable {name} ({_environment_value(name)})" for name in check.environment]
    return f"change {', '.join(named)} so that it holds" if named else "change the flags it reads so that it holds"


def _environment_value(name: str) -> str:
    value = os.environ.get(name)
    return "unset" if value is None else f"now {value!r}"


SET_UP = ("megatron/core/parallel_state.py",)
"""Where Megatron lays out its process groups: sizes that cannot be laid out fail there, after
``validate_args`` has passed them, with a ``RuntimeError`` or an ``assert`` on every rank."""


def raised_in_set_up(error: BaseException) -> bool:
    """Whether ``error`` was raised inside Megatron's parallel-state set-up (:data:`SET_UP`)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.endswith(SET_UP)


def _set_up_fix(text: str, args: argparse.Namespace) -> str:
    sizes = re.search(r"world_size \((\d+)\) is not divisible by expert_tensor_model_pipeline_parallel size \((\d+)\)",
                      text)
    if sizes:
        return (f"the number of processes ({sizes[1]}) must be a multiple of expert TP x EP x PP = {sizes[2]}: change "
                f"--expert-model-parallel-size ({getattr(args, 'expert_model_parallel_size', None)}) or "
                f"--expert-tensor-parallel-size ({getattr(args, 'expert_tensor_parallel_size', None)})")
    return "change the parallel sizes it names"


def one_line(error: BaseException, args: argparse.Namespace) -> CanzonaArgumentError:
    """``error`` from Megatron's checks as one line: what failed (Megatron's message, else its
    condition), where, and the fix. An error of the parallel-state set-up that is not an
    ``assert`` is worded from its message."""
    check = failed_check(error) if isinstance(error, AssertionError) else None
    if check is None:
        text = " ".join(str(error).split()) or traceback.format_exception_only(error)[-1].strip()
        if raised_in_set_up(error):
            return CanzonaArgumentError(f"Megatron's parallel layout failed: {text}; {_set_up_fix(text, args)}")
        return CanzonaArgumentError(f"Megatron's flag check failed: {text}")
    what = " ".join(check.message.split()) or f"`{check.condition}` does not hold"
    where = f"{re.sub(r'^.*/site-packages/(megatron/)?', '', check.file)}:{check.line}"
    return CanzonaArgumentError(f"Megatron's flag check failed: {what} ({where}); {_fix(check, args)}")
