"""``canzona_patches.checkpoints.convert``'s mapping between ``torch_dist`` and ``fsdp_dtensor``
keys and tensors, on small tensors in one process (the converted checkpoints themselves, and runs
resumed from them bitwise: ``tests/e2e/test_canzona_fsdp.py``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from canzona_patches.checkpoints.convert import (
    FSDP_MODEL,
    FSDP_OPTIMIZER,
    TORCH_DIST_OPTIMIZER,
    Contents,
    Unit,
    _flatten,
    _layer_names,
    _nest,
    _stacked_key,
    batches,
    fused_layouts,
    model_units,
    optimizer_units,
    share,
)
from canzona_patches.checkpoints.files import CanzonaCheckpointError

pytestmark = pytest.mark.quick

ARGS = SimpleNamespace(transformer_impl="local", swiglu=True, num_attention_heads=4, group_query_attention=True,
                       num_query_groups=2, kv_channels=3, hidden_size=12)


def _apply(units: list[Unit], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for unit in units:
        out.update(unit.transform({s: tensors[s] for s in unit.sources}))
    return out


def _contents(fmt: str, tensors: dict[str, torch.Tensor]) -> Contents:
    return Contents(path=Path("."), format=fmt, tensors={k: (tuple(t.shape), t.dtype) for k, t in tensors.items()})


def test_layer_stacked_names_and_per_layer_names_are_inverse() -> None:
    """A ``torch_dist`` stacked key names each layer's (expert's) parameter, the local spec's fused
    layer-norm keys by their modules' names, and back."""
    cases = {"decoder.layers.self_attention.linear_qkv.layer_norm_weight": "decoder.layers.1.input_layernorm.weight",
             "decoder.layers.mlp.linear_fc1.layer_norm_weight": "decoder.layers.1.pre_mlp_layernorm.weight",
             "decoder.layers.mlp.linear_fc2.weight": "decoder.layers.1.mlp.linear_fc2.weight",
             "decoder.layers.mlp.experts.experts.linear_fc1.weight": "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"}
    for stacked, name in cases.items():
        index = (1, 2) if "experts" in stacked else (1,)
        names = dict(_layer_names(stacked, (2, 3, 4, 5), local_spec=True))
        assert names[index] == name
        assert _stacked_key(name, local_spec=True) == (stacked, index)
    # transformer-engine's spec names the fused modules as the checkpoint does: nothing renamed
    assert _stacked_key("decoder.layers.0.pre_mlp_layernorm.weight", local_spec=False) == \
        ("decoder.layers.pre_mlp_layernorm.weight", (0,))


def test_the_model_round_trips_through_both_formats_with_fc1_cut_into_gate_and_up() -> None:
    torch.manual_seed(0)
    dist = {"decoder.layers.mlp.linear_fc1.weight": torch.randn(2, 8, 3),  # [gate; up] per layer
            "decoder.layers.self_attention.linear_qkv.weight": torch.randn(2, 24, 12),
            "decoder.layers.mlp.experts.experts.linear_fc1.weight": torch.randn(2, 3, 4, 5),
            "embedding.word_embeddings.weight": torch.randn(7, 3)}
    fsdp = _apply(model_units(_contents("torch_dist", dist), ARGS, "fsdp_dtensor"), dist)
    gate, up = fsdp[f"{FSDP_MODEL}decoder.layers.1.mlp.linear_fc1.weight_w"], fsdp[f"{FSDP_MODEL}decoder.layers.1.mlp.linear_fc1.weight_v"]
    assert torch.equal(torch.cat([gate, up]), dist["decoder.layers.mlp.linear_fc1.weight"][1])
    assert torch.equal(fsdp[f"{FSDP_MODEL}decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight_v"],
                       dist["decoder.layers.mlp.experts.experts.linear_fc1.weight"][1, 2, 2:])
    assert len(fsdp) == 2 * 2 + 2 + 2 * 3 * 2 + 1
    back = _apply(model_units(_contents("fsdp_dtensor", fsdp), ARGS, "torch_dist"), fsdp)
    assert sorted(back) == sorted(dist)
    assert all(torch.equal(back[k], dist[k]) for k in dist)


def test_muon_momentum_moves_between_host_pieces_and_holders_exactly() -> None:
    """The distributed optimizer keeps a fused matrix's momentum as the pieces the optimizer splits
    it into (Q, K, V; gate, up); Megatron-FSDP on the holders, in the parameter's layout."""
    torch.manual_seed(1)
    layout_of = fused_layouts(ARGS, ["gate_up", "qkv"])
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    holders = {f"{FSDP_OPTIMIZER}{qkv}.holder_momentum": torch.randn(24, 12),
               f"{FSDP_OPTIMIZER}{fc1}.holder_momentum": torch.randn(8, 3),
               f"{FSDP_OPTIMIZER}{fc1}.main_param": torch.randn(8, 3)}
    dist = _apply(optimizer_units(_contents("fsdp_dtensor", holders), layout_of, "torch_dist"), holders)
    assert {k: tuple(v.shape) for k, v in dist.items()} == {
        f"{TORCH_DIST_OPTIMIZER}{qkv}.piece0.momentum": (12, 12), f"{TORCH_DIST_OPTIMIZER}{qkv}.piece1.momentum": (6, 12),
        f"{TORCH_DIST_OPTIMIZER}{qkv}.piece2.momentum": (6, 12), f"{TORCH_DIST_OPTIMIZER}{fc1}.piece0.momentum": (4, 3),
        f"{TORCH_DIST_OPTIMIZER}{fc1}.piece1.momentum": (4, 3), f"{TORCH_DIST_OPTIMIZER}{fc1}.main_param": (8, 3)}
    # Q is the query heads of each KV group: rows 0-5 and 12-17 of the fused matrix
    q = holders[f"{FSDP_OPTIMIZER}{qkv}.holder_momentum"]
    assert torch.equal(dist[f"{TORCH_DIST_OPTIMIZER}{qkv}.piece0.momentum"], torch.cat([q[0:6], q[12:18]]))
    back = _apply(optimizer_units(_contents("torch_dist", dist), layout_of, "fsdp_dtensor"), dist)
    assert sorted(back) == sorted(holders)
    assert all(torch.equal(back[k], holders[k]) for k in holders)


def test_several_momentum_pieces_of_an_unsplit_matrix_are_refused() -> None:
    dist = {f"{TORCH_DIST_OPTIMIZER}decoder.layers.0.mlp.linear_fc2.weight.piece{k}.momentum": torch.zeros(2, 2)
            for k in range(2)}
    with pytest.raises(CanzonaCheckpointError, match="2 momentum pieces of a matrix the saved run does not split"):
        _apply(optimizer_units(_contents("torch_dist", dist), fused_layouts(ARGS, []), "fsdp_dtensor"), dist)


def test_a_tensor_the_converter_cannot_place_is_named() -> None:
    dist = {"mtp.layers.0.eh_proj.weight": torch.zeros(2, 2)}
    with pytest.raises(CanzonaCheckpointError, match="mtp.layers.0.eh_proj.weight: this converter does not know"):
        model_units(_contents("torch_dist", dist), ARGS, "fsdp_dtensor")


def test_rng_states_flatten_and_nest_as_torch_dcp_names_them() -> None:
    state = [{"torch_rng_state": torch.arange(3), "rng_tracker_states": {"model-parallel-rng": torch.arange(2)},
              "random_rng_state": (3, (1, 2), None)}]
    flat: dict = {}
    _flatten("rng_state.(0, 1)", state, flat)
    assert sorted(flat) == ["rng_state.(0, 1).0.random_rng_state", "rng_state.(0, 1).0.rng_tracker_states.model-parallel-rng",
                            "rng_state.(0, 1).0.torch_rng_state"]
    nested: list = []
    for key, value in flat.items():
        _nest(nested, key.split(".", 2)[2].split("."), value)
    assert nested[0]["random_rng_state"] == state[0]["random_rng_state"]
    assert torch.equal(nested[0]["rng_tracker_states"]["model-parallel-rng"], torch.arange(2))


def test_processes_share_the_tensors_by_bytes() -> None:
    units = [Unit((str(i),), lambda loaded: loaded, nbytes) for i, nbytes in enumerate([90, 50, 40, 30, 20, 10])]
    mine = [share(units, rank, 2) for rank in range(2)]
    assert sorted(u.sources for part in mine for u in part) == sorted(u.sources for u in units)
    assert sorted(sum(u.nbytes for u in part) for part in mine) == [120, 120]


def test_reads_are_batched_by_bytes_in_order() -> None:
    units = [Unit((str(i),), lambda loaded: loaded, nbytes) for i, nbytes in enumerate([40, 50, 200, 10, 30, 60])]
    cut = batches(units, 100)
    assert [[u.sources[0] for u in batch] for batch in cut] == [["0", "1"], ["2"], ["3", "4", "5"]]
    assert batches([], 100) == []
