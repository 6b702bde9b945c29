"""Counting host synchronisations: every Python-level read of a tensor's value.

``Tensor.item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__`` and ``__index__`` copy a
value to the host, which on CUDA waits for every queued kernel. Inside
:func:`count_host_syncs` each call is counted (C++-internal reads are not: this counts what
Python code asks for). On CUDA, ``torch.cuda.set_sync_debug_mode`` is the stricter check.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def count_host_syncs() -> Iterator[list[str]]:
    """Yield a list that collects the name of every value read made inside the block."""
    seen: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name: str, original):
        @functools.wraps(original)
        def read(self, *args, **kwargs):
            seen.append(name)
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
