"""Suite-wide settings.

Property tests run derandomized by default so CI is reproducible; explore fresh
examples locally with ``pytest --hypothesis-profile=explore``.
"""

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile("ci")


# --- one intra-op thread per xdist worker ---------------------------------------------------------
# `make test-all` runs the single-process tests in two workers on two cores. With torch's default
# (a thread per core) each worker's OpenMP team spins while the other's runs: a 200-step MLP test
# took 41 s there against 1.8 s alone. One thread each keeps both cores busy without that.
import os  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch  # noqa: E402

    torch.set_num_threads(1)


# --- the share of each comparison's bound a test used (CANZONA_BOUND_SHARES=<file>) -------------
# Exactness bounds are measured on one machine; another CPU's BLAS rounds differently. With the
# variable set, every torch.testing.assert_close of a test records max |actual - expected| /
# (atol + rtol |expected|) over its elements, and the test's largest share is appended to the file
# as a JSON line {"test": nodeid, "share": s, "checks": n} (0: bitwise wherever a bound of 0 was
# asked). Bounds checked with plain asserts (means, pytest.approx) are not recorded.
import json  # noqa: E402

import pytest  # noqa: E402

BOUND_SHARES = os.environ.get("CANZONA_BOUND_SHARES")


@pytest.fixture(autouse=True)
def _bound_shares(request, monkeypatch):
    if not BOUND_SHARES:
        yield
        return
    import torch

    original = torch.testing.assert_close
    seen = {"share": 0.0, "checks": 0}

    def recording(actual, expected, *args, rtol=None, atol=None, **kwargs):
        original(actual, expected, *args, rtol=rtol, atol=atol, **kwargs)  # raises first when over
        if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor) and actual.is_floating_point() \
                and atol is not None:
            diff = (actual.double() - expected.double()).abs()
            bound = atol + (rtol or 0.0) * expected.double().abs()
            # where the bound is 0 a difference would have raised: 0 * inf -> NaN -> a share of 0
            shares = torch.where(bound > 0, diff / bound.clamp_min(1e-300), diff * float("inf")).nan_to_num(0.0)
            share = float(shares.max()) if diff.numel() else 0.0
            seen["share"] = max(seen["share"], share)
            seen["checks"] += 1

    monkeypatch.setattr(torch.testing, "assert_close", recording)
    yield
    if seen["checks"]:
        with open(BOUND_SHARES, "a") as out:
            out.write(json.dumps({"test": request.node.nodeid, **seen}) + "\n")


# --- test-only packages hidden from the processes the tests start -------------------------------
# tests/hidden_modules/sitecustomize.py: a process started with that folder on PYTHONPATH does
# not find the modules CANZONA_TESTS_HIDDEN_MODULES names. Megatron imports transformers and
# wandb whenever they are installed (1.6 s of a rank's 5.2 s start); the suite installs them only
# for the tests that use them, which pass ``support.WITH_HIDDEN_MODULES`` to what they start.
# The pytest processes themselves (xdist's workers too) see every module.
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

HIDDEN_MODULES_DIR = str(Path(__file__).resolve().parent / "hidden_modules")
HIDDEN_MODULES = "transformers,wandb"
sys.meta_path[:] = [finder for finder in sys.meta_path if type(finder).__name__ != "HiddenModules"]
if HIDDEN_MODULES_DIR not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HIDDEN_MODULES_DIR, os.environ.get("PYTHONPATH")]))
os.environ.setdefault("CANZONA_TESTS_HIDDEN_MODULES", HIDDEN_MODULES)


# --- the modules of tools/ -------------------------------------------------------------------------
@pytest.fixture(scope="session")
def import_tool():
    """``import_tool("bench_step")``: the module ``tools/bench_step.py``, imported with the repository
    root on ``sys.path`` for the import only (tools/ is scripts, not an installed package)."""
    import importlib
    import pathlib
    import sys

    root = str(pathlib.Path(__file__).resolve().parents[1])

    def load(name: str):
        sys.path.insert(0, root)
        try:
            return importlib.import_module(f"tools.{name}")
        finally:
            sys.path.remove(root)

    return load
