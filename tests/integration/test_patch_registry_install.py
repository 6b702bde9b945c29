"""The registry on parsed flags: the baselines' upstream fixes only for Megatron's own
optimizers (never for ``--canzona``), the Canzona hooks only for ``--canzona``, and a second
install wraps nothing twice (``patch_conditions.py``, in a process of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from canzona_patches import registry

ROOT = Path(__file__).resolve().parents[2]

TIMEOUT_S = 240
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "10", "--eval-interval", "10", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "512"]
CASES = {  # the first case is also installed twice
    "canzona": [*TINY, "--optimizer", "muon", "--canzona", "--use-distributed-optimizer"],
    "layerwise": [*TINY, "--optimizer", "muon", "--use-distributed-optimizer"],
    "adam": [*TINY, "--optimizer", "adam", "--use-distributed-optimizer"],
    "adam_legacy": [*TINY, "--optimizer", "adam", "--use-distributed-optimizer", "--ckpt-format", "torch"],
}
LAYER_WISE_FIX = "megatron.core.optimizer.layer_wise_optimizer:LayerWiseDistributedOptimizer.__init__"
DISTOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"


def _first_targets(group: str) -> set[str]:
    return {p.targets[0] for p in registry.PATCHES if p.group == group}


@pytest.fixture(scope="module")
def report() -> dict:
    done = subprocess.run([sys.executable, "tests/integration/patch_conditions.py", json.dumps(CASES)], cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_importing_pretrain_gpt_leaves_the_compiler_unimported(report):
    """Megatron's fused kernels are compiled on their first call, not at import
    (``canzona_patches/integration/imports.py``): importing the entry point imports neither
    dynamo nor inductor, and ``torch.compile`` is torch's own again afterwards."""
    assert report["import"] == {"compiler_imported": False, "compile_restored": True, "jit_fuser_deferred": True}


def test_a_deferred_compile_compiles_once_on_first_call_with_its_options():
    from canzona_patches.integration.imports import compiling_on_first_call

    calls = []

    def fake_compile(fn, **options):
        calls.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    deferred = compiling_on_first_call(fake_compile)

    @deferred
    def double(x):
        """Twice x."""
        return 2 * x

    @deferred(mode="max-autotune")
    def square(x):
        return x * x

    assert calls == [] and double.__name__ == "double" and double.__doc__ == "Twice x."
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8) and square(3) == ("compiled", 9)
    assert calls == [("double", {}), ("square", {"mode": "max-autotune"})]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_canzona_run_gets_no_baseline_fix(report):
    holds = set(report["conditions"]["canzona"])
    assert not holds & _first_targets(registry.BASELINE), sorted(holds & _first_targets(registry.BASELINE))
    assert _first_targets(registry.CANZONA) <= holds
    assert _first_targets(registry.PRETRAIN) <= holds


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_the_baselines_get_their_fixes_and_no_canzona_hook(report):
    layerwise, adam, legacy = (set(report["conditions"][n]) for n in ("layerwise", "adam", "adam_legacy"))
    assert LAYER_WISE_FIX in layerwise and LAYER_WISE_FIX not in adam
    assert f"{DISTOPT}.load_state_dict" in adam and f"{DISTOPT}.load_state_dict" in layerwise
    assert f"{DISTOPT}.load_parameter_state" in legacy and f"{DISTOPT}.load_parameter_state" not in adam
    if not torch.cuda.is_available():  # torch's AdamW (no Apex or Transformer Engine here)
        assert f"{DISTOPT}.sharded_state_dict" in adam
    for holds in (layerwise, adam, legacy):
        assert not holds & _first_targets(registry.CANZONA)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_installing_twice_wraps_once(report):
    assert report["unresolved"] == []
    twice = report["twice"]
    assert twice["rows"] > 20 and twice["all_in_place"]
    assert twice["changed_by_second_install"] == []
    assert twice["wrapping_a_wrapper"] == []


def test_the_fusion_warm_up_runs_only_with_a_fused_kernel_in_use(monkeypatch):
    """On CPU ``pretrain_gpt.py`` turns the fused bias kernels off; Megatron's warm-up of them
    (torch.compile, seconds a rank) is skipped then, and runs as soon as one is on."""
    import argparse

    from megatron.training import global_vars

    from canzona_patches.emulation.cpu import warming_fused_kernels_only_in_use

    calls = []
    set_options = warming_fused_kernels_only_in_use(lambda **kwargs: calls.append(kwargs))
    kernels = ("bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion")
    for fused in (None, *kernels):
        flags = {kernel: kernel == fused for kernel in kernels}
        monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", argparse.Namespace(**flags))
        set_options(tp_size=2)
    assert calls == [{"tp_size": 2}] * 3
