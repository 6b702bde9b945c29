"""Megatron-FSDP (``--use-megatron-fsdp``) on CPU with gloo, as Megatron-Core 0.19.2 has it.

Megatron-FSDP (``megatron/core/distributed/fsdp/``) names CUDA devices and streams in its own
modules and builds its ``DeviceMesh`` for CUDA. On a machine without CUDA, the rows of the
``cpu-training`` group (``canzona_patches/patches.toml``) redirect them, and nothing else:

* its modules (``registry.CPU_TORCH_FSDP_MODULES``) see :data:`CPU_TORCH_FSDP`, the CPU stand-in
  of :mod:`canzona_patches.emulation.cpu` whose ``torch.cuda.current_device()`` is ``0``:
  Megatron-FSDP spells devices ``torch.device(f"cuda:{torch.cuda.current_device()}")``, which
  is a valid (unused) device object then, where the index-less stand-in gave ``'cuda:cpu'``;
  streams and events are no-ops, tensor factories allocate on the CPU, the CUDA RNG is the CPU's;
* the adapter's ``FullyShardedDataParallel`` is built on the CPU device when ``megatron.training``
  passes none (:func:`on_the_cpu_device`), without Megatron-FSDP's warning that it is not on
  ``cuda:0``;
* its ``DeviceMesh.from_group(..., device_type="cuda")`` builds a CPU mesh (:class:`CpuDeviceMesh`),
  or ``DTensor.from_local`` would move every local shard to CUDA.

``pretrain_gpt.py`` leaves ``CUDA_DEVICE_MAX_CONNECTIONS`` unset under Megatron-FSDP (Megatron
refuses 1 there) and turns the gradient reduce's division fusion off (gloo has no
``PREMUL_SUM``: the gradients are scaled, then summed, as Megatron does without the fusion).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from canzona_patches.emulation.cpu import _CpuCuda, _CpuTorch


class _CpuCudaIndexZero(_CpuCuda):
    """``torch.cuda`` for Megatron-FSDP's modules: device index 0, the rest as in CPU mode."""

    current_device = staticmethod(lambda: 0)


CPU_TORCH_FSDP = _CpuTorch(cuda=_CpuCudaIndexZero())
"""The ``torch`` Megatron-FSDP's modules see on CPU."""


def cpu_torch_fsdp(original: Any, run: Any = None) -> _CpuTorch:
    """The ``torch`` stand-in of ``registry.CPU_TORCH_FSDP_MODULES``."""
    return CPU_TORCH_FSDP


class CpuDeviceMesh:
    """``DeviceMesh`` as Megatron-FSDP's adapter builds it, on the CPU (gloo's device)."""

    @staticmethod
    def from_group(*args: Any, **kwargs: Any) -> DeviceMesh:
        kwargs["device_type"] = "cpu"
        return DeviceMesh.from_group(*args, **kwargs)


def device_mesh_on_cpu(original: type, run: Any = None) -> type:
    """The adapter's ``DeviceMesh``: :class:`CpuDeviceMesh`."""
    return CpuDeviceMesh


def on_the_cpu_device(init: Callable[..., None], run: Any = None) -> Callable[..., None]:
    """``FullyShardedDataParallel.__init__`` on the CPU device where the caller names none (its
    default is ``torch.device(f"cuda:{torch.cuda.current_device()}")``)."""

    @functools.wraps(init)
    def init_on_cpu(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("device") is None and len(args) < 6:  # (config, ddp_config, module, fsdp_unit_modules, ...)
            kwargs["device"] = torch.device("cpu")
        _quiet_device_notice()
        init(self, *args, **kwargs)

    return init_on_cpu


class _WithoutDeviceNotice(logging.Filter):
    """Drops Megatron-FSDP's warning that its device (the CPU) is not ``cuda:{current_device()}``:
    true of every CPU rank, and of nothing to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "instead of the current device cuda:0" not in record.getMessage()


def _quiet_device_notice() -> None:
    fsdp_logger = logging.getLogger("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp")
    if not any(isinstance(f, _WithoutDeviceNotice) for f in fsdp_logger.filters):
        fsdp_logger.addFilter(_WithoutDeviceNotice())
