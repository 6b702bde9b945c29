"""Replacing a Megatron-Core attribute with a wrapper of it, exactly once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MARK = "__canzona_hook__"


def install_hook(owner: Any, name: str, make_hook: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """``owner.name = make_hook(owner.name)``; a no-op when ``owner.name`` is a hook already, so
    installing twice (a second ``pretrain`` in one process, tests) never wraps twice."""
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    hook = make_hook(original)
    setattr(hook, _MARK, True)
    setattr(owner, name, hook)
