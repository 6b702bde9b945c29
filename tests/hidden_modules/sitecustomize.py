"""Started by every Python process whose ``PYTHONPATH`` holds this folder (``tests/conftest.py`` puts
it there for the processes a test starts): the top-level modules named in
``CANZONA_TESTS_HIDDEN_MODULES`` (comma-separated) are not found, as if they were not installed.

The suite installs test-only packages that Megatron imports when it finds them: ``transformers``
(its Hugging Face tokenizer module, imported for every tokenizer) and ``wandb`` (its timers). A
process that imports ``pretrain_gpt`` spends 1.6 s of its 5.2 s on them (measured here), and the
suite starts a couple of hundred such processes (torchrun's ranks, the tools' command lines). The
tests that use those packages in the processes they start say so (``support.py``'s
``WITH_HIDDEN_MODULES``); the pytest processes themselves see every module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

VARIABLE = "CANZONA_TESTS_HIDDEN_MODULES"


class HiddenModules(importlib.abc.MetaPathFinder):
    """Finds the hidden top-level modules (and their submodules) as missing."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by {VARIABLE})", name=name)
        return None


def _chain_the_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this one shadows, if the interpreter has one further on the path."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_names = {name.strip() for name in os.environ.get(VARIABLE, "").split(",") if name.strip()}
if _names:
    sys.meta_path.insert(0, HiddenModules(_names))
_chain_the_next_sitecustomize()
