"""canzona_patches.emulation.cpu and canzona_patches.version: what the redirect does, and when not.

The CPU-mode facts are observed in a spawned rank: enable_cpu_mode() patches Megatron for
the life of its process, which must not be pytest's own.
"""

import importlib
from importlib import metadata
from unittest import mock

import pytest
import torch

from canzona_patches import version
from megatron.canzona.runtime import LaunchConfig, launch

LAUNCH_TIMEOUT_S = 90.0


def _observe_cpu_mode() -> dict[str, object]:
    import canzona_patches.emulation.cpu as cpu
    import megatron.core.distributed.param_and_grad_buffer as buffer_module
    from canzona_patches import registry
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    facts: dict[str, object] = {}
    real_type = torch.Tensor.type
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        facts["enabled_when_cuda"] = cpu.enable_cpu_mode()
    facts["untouched_when_cuda"] = buffer_module.torch is torch and torch.Tensor.type is real_type
    facts["enabled"] = cpu.enable_cpu_mode()
    wrapped_init = DistributedOptimizer.__init__
    facts["enabled_again"] = cpu.enable_cpu_mode()
    facts["not_wrapped_twice"] = (DistributedOptimizer.__init__ is wrapped_init
                                  and not hasattr(wrapped_init.__wrapped__, "__wrapped__"))
    facts["all_modules_redirected"] = all(
        importlib.import_module(name).torch is not torch for name in registry.CPU_TORCH_MODULES
    )
    facts.update(_observe_stand_ins(buffer_module.torch))
    facts.update(_observe_pretend_cuda(cpu))
    facts.update(_observe_rng_tracker())
    return facts


def _observe_stand_ins(megatron_torch) -> dict[str, object]:
    stream = megatron_torch.cuda.current_stream()
    stream.wait_stream(megatron_torch.cuda.Stream())
    event = stream.record_event()
    event.record()
    event.wait()
    megatron_torch.cuda.synchronize()
    return {
        "current_device": str(megatron_torch.cuda.current_device()),
        "cuda_literal_device": str(megatron_torch.zeros(2, device="cuda").device),
        "current_device_alloc": str(
            megatron_torch.empty(2, device=megatron_torch.cuda.current_device()).device
        ),
        "event_done": event.query() and event.elapsed_time(event) == 0.0,
        "memory_allocated": megatron_torch.cuda.memory_allocated(),
    }


def _observe_pretend_cuda(cpu) -> dict[str, object]:
    tensor = torch.zeros(1)
    inside = cpu.pretending_cuda(
        lambda: (tensor.type(), tensor.cuda() is tensor, tensor.type(torch.float64).dtype)
    )()
    return {
        "type_outside": tensor.type(),
        "type_inside": inside[0],
        "cuda_inside_is_identity": inside[1],
        "cast_inside": inside[2],
    }


def _observe_rng_tracker() -> dict[str, object]:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(7)
    tracker = get_cuda_rng_tracker()
    outer = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    outer_restored = torch.equal(outer, torch.get_rng_state())
    with tracker.fork():
        second = torch.rand(4)
    model_parallel_cuda_manual_seed(7)
    with get_cuda_rng_tracker().fork():
        again = torch.rand(4)
    parallel_state.destroy_model_parallel()
    return {
        "tracker": type(tracker).__name__,
        "fork_restores_outer_state": outer_restored,
        "fork_state_advances": not torch.equal(first, second),
        "reseed_reproduces": torch.equal(first, again),
    }


@pytest.fixture(scope="module")
def facts() -> dict[str, object]:
    (observed,) = launch(_observe_cpu_mode, LaunchConfig(world_size=1, timeout_s=LAUNCH_TIMEOUT_S))
    return observed


@pytest.mark.skipif(torch.cuda.is_available(), reason="observes the CPU redirect")
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_cpu_mode(facts: dict[str, object]) -> None:
    assert facts == {
        "enabled_when_cuda": False,
        "untouched_when_cuda": True,
        "enabled": True,
        "enabled_again": True,
        "not_wrapped_twice": True,
        "all_modules_redirected": True,
        "current_device": "cpu",
        "cuda_literal_device": "cpu",
        "current_device_alloc": "cpu",
        "event_done": True,
        "memory_allocated": 0,
        "type_outside": "torch.FloatTensor",
        "type_inside": "torch.cuda.FloatTensor",
        "cuda_inside_is_identity": True,
        "cast_inside": torch.float64,
        "tracker": "CpuRNGStatesTracker",
        "fork_restores_outer_state": True,
        "fork_state_advances": True,
        "reseed_reproduces": True,
    }


def test_pinned_megatron_is_installed() -> None:
    assert version.installed_megatron_version() == version.PINNED_MEGATRON_CORE
    version.require_pinned_megatron()


def test_other_megatron_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(version.metadata, "version", lambda name: "0.20.0")
    with pytest.raises(ImportError, match=r"megatron-core==0\.19\.2.*version 0\.20\.0"):
        version.require_pinned_megatron()


def test_missing_megatron_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(version.metadata, "version", not_installed)
    with pytest.raises(version.MegatronVersionError, match="is not installed"):
        version.require_pinned_megatron()
