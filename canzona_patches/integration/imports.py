"""Importing Megatron-Core without importing torch's compiler.

Megatron-Core's ``jit_fuser`` is ``torch.compile``, applied at import to the fused kernels
(bias-GeLU, bias-SwiGLU, bias-dropout-add, ...). Each ``torch.compile(fn)`` call imports
dynamo and inductor: 3.5 s of an 8.3 s ``import pretrain_gpt`` on a CPU core, paid by every
rank of every launch, although a run with those fusions off (every CPU run) never calls them.
:func:`import_megatron_core` imports Megatron-Core with ``torch.compile`` swapped for
:func:`compiling_on_first_call` (the registry's scoped row ``torch:compile``): the kernels are
compiled by the real ``torch.compile`` on their first call, with the same arguments, and a
run that never calls them never imports the compiler.
:func:`~canzona_patches.version.require_pinned_megatron`, which every patch module calls
before its Megatron imports, calls it: the first of them in a process imports Megatron-Core.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

from canzona_patches import registry


def compiling_on_first_call(compile_: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` that hands back a function compiling ``fn`` (with ``compile_`` and the
    given options) when it is first called; used bare (``@torch.compile``) or with options
    (``@torch.compile(mode=...)``)."""

    def deferred(model: Callable[..., Any] | None = None, **options: Any) -> Any:
        if model is None:
            return lambda fn: deferred(fn, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_(model, **options)
            return compiled(*args, **kwargs)

        return call

    return deferred


def import_megatron_core() -> None:
    """Import ``megatron.core`` (once per process) with ``torch.compile`` deferred to first calls."""
    if "megatron.core.jit" in sys.modules:
        return
    with registry.swapped("torch:compile", compiling_on_first_call):
        importlib.import_module("megatron.core")
