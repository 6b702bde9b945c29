"""What --canzona does not support stops with one line that names the fix (library calls too)."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import pytest
import torch

from canzona_patches.errors import CanzonaArgumentError
from canzona_patches.integration.arguments import check_expert_sizes
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


@pytest.mark.parametrize(("tp", "ep", "etp", "fsdp", "fix"), [
    (2, 4, 2, True, "--use-megatron-fsdp with --expert-model-parallel-size 4 needs --expert-tensor-parallel-size 1 "
                    ".it is 2; Megatron defaults it to --tensor-model-parallel-size"),
    (2, 1, 1, False, "at --expert-model-parallel-size 1 needs --expert-tensor-parallel-size equal to "
                     "--tensor-model-parallel-size 2"),
])
def test_expert_tensor_parallelism_canzona_cannot_host_names_the_fix(tp, ep, etp, fsdp, fix):
    with pytest.raises(CanzonaArgumentError, match=fix):
        check_expert_sizes(tp, ep, etp, fsdp=fsdp)
    check_expert_sizes(tp, ep, 1 if ep > 1 else tp, fsdp=fsdp)


def test_expert_tensor_parallelism_runs_under_the_distributed_optimizer():
    """Megatron's default expert TP (the TP size) and any other at EP > 1: hosted over expert-DP x expert TP."""
    for etp in (1, 2, 4):
        check_expert_sizes(2, 4, etp)


def test_a_gpu_run_without_transformer_engine_names_the_fix():
    with pytest.raises(CanzonaArgumentError, match=r"pip install -e '\.\[gpu\]', or pass --transformer-impl local"):
        pretrain_gpt.check_transformer_engine("transformer_engine", importable=False)
    pretrain_gpt.check_transformer_engine("local", importable=False)
    pretrain_gpt.check_transformer_engine("transformer_engine", importable=True)


def test_local_layers_on_a_gpu_turn_off_the_kernels_of_missing_extensions():
    """Seen on an H100 without transformer-engine or apex: Megatron's default rope, softmax, wgrad
    and persistent-norm kernels stop a ``--transformer-impl local`` run; each is turned off when
    (and only when) its module is missing, with a note."""
    defaults = {"apply_rope_fusion": True, "masked_softmax_fusion": True, "gradient_accumulation_fusion": True,
                "no_persist_layer_norm": False}
    assert set(defaults) == {name for name, _, _ in pretrain_gpt._EXTENSION_KERNELS}
    args = argparse.Namespace(transformer_impl="local", **defaults)
    notes = pretrain_gpt.adapt_args_to_missing_kernels(args, importable=lambda m: m == "fused_weight_gradient_mlp_cuda")
    assert notes == ["apply_rope_fusion=False (no transformer_engine)",
                     "masked_softmax_fusion=False (no scaled_upper_triang_masked_softmax_cuda)",
                     "no_persist_layer_norm=True (no apex)"]
    assert vars(args) == {**defaults, "transformer_impl": "local", "apply_rope_fusion": False,
                          "masked_softmax_fusion": False, "no_persist_layer_norm": True}
    te = argparse.Namespace(transformer_impl="transformer_engine", **defaults)
    assert pretrain_gpt.adapt_args_to_missing_kernels(te, importable=lambda m: False) == [] and te.apply_rope_fusion


def test_ranks_beyond_the_gpus_share_them_on_gloo_and_name_the_fix_on_nccl():
    """Megatron puts local rank r on GPU r: 4 gloo ranks on one GPU (gpu_check's TP 2 x DP 2) failed
    with "invalid device ordinal"."""
    args = argparse.Namespace(local_rank=3, distributed_backend="gloo")
    assert pretrain_gpt.place_ranks_on_gpus(args, device_count=2) and args.local_rank == 1
    args = argparse.Namespace(local_rank=1, distributed_backend="nccl")
    assert pretrain_gpt.place_ranks_on_gpus(args, device_count=2) == [] and args.local_rank == 1
    assert pretrain_gpt.place_ranks_on_gpus(argparse.Namespace(local_rank=3, distributed_backend="gloo"), 0) == []
    with pytest.raises(CanzonaArgumentError, match=r"--nproc-per-node\), or use --distributed-backend gloo"):
        pretrain_gpt.place_ranks_on_gpus(argparse.Namespace(local_rank=2, distributed_backend="nccl"), device_count=2)
