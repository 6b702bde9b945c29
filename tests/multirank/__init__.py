"""Tests that launch several gloo ranks of Megatron and Canzona on this machine's CPUs."""

import pytest
import torch

CPU_RANKS = [
    pytest.mark.multirank,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo runs of the CUDA->CPU redirect"),
]
"""Marks of a module of CPU/gloo rank launches (on a CUDA machine the GPU checks run instead)."""
