"""Megatron-Core and ``megatron.training`` on CPU with gloo (and on ``meta`` for dry runs):
the stand-ins for CUDA-only calls, installed by :func:`canzona_patches.emulation.cpu.enable_cpu_mode`."""
