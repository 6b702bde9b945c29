"""What --canzona does not support stops with one line that names the fix (library calls too)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from canzona_patches.integration.arguments import CanzonaArgumentError, check_expert_sizes
from canzona_patches.integration.optimizer import build_canzona_optimizer

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


def test_the_optimizer_builder_refuses_experts_the_plan_does_not_lay_out():
    config = types.SimpleNamespace(use_distributed_optimizer=True)
    with pytest.raises(ValueError, match=r"expert-parallel parameters \(expert and 0 more\) but the Canzona plan has no "
                                         "expert layout: plan with the run's --expert-model-parallel-size"):
        build_canzona_optimizer(config, [_Chunk()], types.SimpleNamespace(plan=types.SimpleNamespace(experts=None)))


@pytest.mark.parametrize(("tp", "ep", "etp", "fix"), [
    (2, 4, 2, "needs --expert-tensor-parallel-size 1 .it is 2; Megatron defaults it to --tensor-model-parallel-size"),
    (2, 1, 1, "at --expert-model-parallel-size 1 needs --expert-tensor-parallel-size equal to --tensor-model-parallel-size 2"),
])
def test_expert_tensor_parallelism_canzona_cannot_host_names_the_fix(tp, ep, etp, fix):
    with pytest.raises(CanzonaArgumentError, match=fix):
        check_expert_sizes(tp, ep, etp)
    check_expert_sizes(tp, ep, 1 if ep > 1 else tp)


def test_a_gpu_run_without_transformer_engine_names_the_fix():
    with pytest.raises(CanzonaArgumentError, match=r"pip install -e '\.\[gpu\]', or pass --transformer-impl local"):
        pretrain_gpt.check_transformer_engine("transformer_engine", importable=False)
    pretrain_gpt.check_transformer_engine("local", importable=False)
    pretrain_gpt.check_transformer_engine("transformer_engine", importable=True)
