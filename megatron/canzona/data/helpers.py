"""Megatron-Core's C++ dataset helpers (``megatron.core.datasets.helpers_cpp``).

``GPTDataset`` builds its sample index with ``helpers_cpp``. The registry's
megatron-core 0.19.2 wheel ships it prebuilt, but without the Makefile that
``megatron.core.datasets.utils.compile_helpers`` runs (``make -C <datasets dir>``), so that
function fails there and ``megatron.training.initialize`` exits. ``ensure_dataset_helpers``
is the replacement: it uses the prebuilt module when it imports and otherwise compiles
``helpers.cpp`` with pybind11 and the system C++ compiler.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"


def dataset_helpers_available() -> bool:
    """True if ``megatron.core.datasets.helpers_cpp`` imports."""
    try:
        importlib.import_module(HELPERS_MODULE)
    except ImportError:
        return False
    return True


def ensure_dataset_helpers() -> None:
    """Make ``megatron.core.datasets.helpers_cpp`` importable, compiling it only if it is missing.

    Takes no arguments so it can stand in for Megatron's ``compile_helpers``. In a
    multi-rank job call it on one rank before the others import the module.
    """
    if dataset_helpers_available():
        return
    datasets_dir = Path(importlib.import_module("megatron.core.datasets").__file__).parent
    if not os.access(datasets_dir, os.W_OK):
        raise ValueError(
            f"{HELPERS_MODULE} is missing and {datasets_dir} is not writable: reinstall megatron-core "
            "from a wheel that ships it, or run once as a user who can write there"
        )
    build_dataset_helpers(datasets_dir)
    importlib.invalidate_caches()
    importlib.import_module(HELPERS_MODULE)


def build_dataset_helpers(output_dir: str | Path, source: str | Path | None = None) -> Path:
    """Compile Megatron-Core's ``helpers.cpp`` into ``output_dir`` and return the module path.

    Needs a C++ compiler and the ``pybind11`` package (``pip install pybind11``).
    """
    if source is None:
        source = Path(importlib.import_module("megatron.core.datasets").__file__).parent / "helpers.cpp"
    source = Path(source)
    if not source.is_file():
        raise ValueError(f"{source} not found: reinstall megatron-core")
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise ValueError("no C++ compiler found to build Megatron's dataset helpers: install g++ (apt-get install g++)")
    try:
        import pybind11
    except ImportError:
        raise ValueError("building Megatron's dataset helpers needs pybind11: pip install pybind11") from None
    target = Path(output_dir) / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    # Build under a temporary name and rename, so a concurrent import never sees half a file.
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    command = [
        compiler, "-O3", "-shared", "-std=c++17", "-fPIC",
        f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
        str(source), "-o", str(partial),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = " ".join(result.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"compiling {source} failed ({' '.join(command)}): {tail}")
    partial.replace(target)
    return target
