"""tests/hidden_modules: the processes a test starts do not find the test-only packages Megatron
would import at every start (``transformers``, ``wandb``), unless the test asks for them; the
pytest process itself finds them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from tests.e2e.support import WITH_HIDDEN_MODULES

PROBE = """
import importlib, json
found = {}
for name in ("transformers", "wandb", "json"):
    try:
        importlib.import_module(name)
        found[name] = True
    except ModuleNotFoundError:
        found[name] = False
print(json.dumps(found))
"""


def _found(env: dict[str, str]) -> dict[str, bool]:
    import json

    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_started_process_finds_the_hidden_packages_only_when_asked() -> None:
    assert importlib.util.find_spec("transformers") is not None  # installed, and seen here
    assert _found(dict(os.environ)) == {"transformers": False, "wandb": False, "json": True}
    assert _found({**os.environ, **WITH_HIDDEN_MODULES}) == {"transformers": True, "wandb": True, "json": True}
