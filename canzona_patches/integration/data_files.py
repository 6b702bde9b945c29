"""A data file that changes under a running job is named, not met with SIGBUS.

Megatron-Core 0.19.2 maps each ``.bin`` into memory (``_MMapBinReader``) and hands out views of
it (``numpy.frombuffer``); a file cut short while the job runs (rewritten in place, a second
``preprocess_data.py`` over the same prefix, a full disk on the writer's side) turns the next
read past its new end into SIGBUS: the rank dies without a word and its peers report it gone.
:func:`checked_bin_read` first compares the read's end with the file's size (one ``fstat`` of the
open file per sample read, about a microsecond) and raises one line naming the file instead.
A file replaced by a rename keeps the mapped inode alive and is read as it was.

A DataLoader worker (``--num-workers`` > 0) that died of SIGBUS all the same (a cut between the
check and the read) is named too, by :func:`data_worker_died_words`.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any

import numpy

from canzona_patches.errors import CanzonaRankError

_WORKER_BUS_ERROR = re.compile(r"DataLoader worker \(pid \d+\) is killed by signal: Bus error")


def checked_bin_read(read: Callable[..., numpy.ndarray], run: Any = None) -> Callable[..., numpy.ndarray]:
    """``_MMapBinReader.read`` that first checks the file still holds the bytes it reads."""

    @functools.wraps(read)
    def read_checked(self: Any, dtype: Any, count: int, offset: int) -> numpy.ndarray:
        end = offset + count * numpy.dtype(dtype).itemsize
        file = getattr(self, "_bin_file_reader", None)
        try:
            size = os.fstat(file.fileno()).st_size
        except (AttributeError, OSError, ValueError):  # not a local file (object storage): read as it is
            size = None
        if size is not None and size < end:
            name = getattr(file, "name", "the .bin file")
            raise CanzonaRankError(
                f"{name} changed while the job read it: it holds {size} bytes now, and a sample needs bytes up to "
                f"{end}; restore the dataset (never rewrite a .bin/.idx pair a job reads), then resume from the last "
                "checkpoint")
        return read(self, dtype, count, offset)

    return read_checked


def data_worker_died_words(error: BaseException, data_paths: list[str] | None) -> str | None:
    """One line for a DataLoader worker killed by SIGBUS (a memory-mapped file cut short), naming
    the data prefixes the job reads; ``None`` for any other error."""
    if not _WORKER_BUS_ERROR.search(str(error)):
        return None
    prefixes = [p for p in (data_paths or []) if not _is_number(p)]
    named = ", ".join(f"{p}.bin" for p in prefixes[:3]) or "a .bin of --data-path"
    return (f"a DataLoader worker died of SIGBUS reading the data: {named} was cut short while the job read it; "
            "restore the dataset, then resume from the last checkpoint")


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True
