"""What --canzona does not support stops with one line that names the fix (library calls too)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from canzona_patches.arguments import CanzonaArgumentError
from canzona_patches.optimizer import build_canzona_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import pretrain_gpt  # noqa: E402


class _Chunk(torch.nn.Module):
    """A model chunk with one dense matrix and one expert matrix (Megatron marks experts
    with ``allreduce = False``: they reduce over the expert-data-parallel group)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Parameter(torch.zeros(4, 4))
        self.expert = torch.nn.Parameter(torch.zeros(4, 4))
        self.expert.allreduce = False


def test_the_optimizer_builder_refuses_expert_parameters():
    config = types.SimpleNamespace(use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="mixture-of-experts parameters yet .expert and 0 more"):
        build_canzona_optimizer(config, [_Chunk()], cfg=None, plan=None)


def test_a_gpu_run_without_transformer_engine_names_the_fix():
    with pytest.raises(CanzonaArgumentError, match=r"pip install -e '\.\[gpu\]', or pass --transformer-impl local"):
        pretrain_gpt.check_transformer_engine("transformer_engine", importable=False)
    pretrain_gpt.check_transformer_engine("local", importable=False)
    pretrain_gpt.check_transformer_engine("transformer_engine", importable=True)
