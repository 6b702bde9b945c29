"""The TP engine alone, on plain tensors: host-rank compute equals single-device math.

Each rank builds Megatron-style TP shards of a few full matrices (a fused QKV and a fused
SwiGLU fc1, both column-parallel, and row-parallel projections), gives them to
:class:`~megatron.canzona.runtime.tp_async.TPEngine` with Muon as the host math, and takes
two steps. The single-device reference runs the same Muon on the full matrices in the same
process; every rank's shards must then equal the reference's slices bit for bit, in both
``async`` and ``sync`` mode. Shards are cut here by hand, the way Megatron lays them out,
not with the engine's own helpers. Uneven host loads force padded all-to-all chunks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.canzona.optim import (
    GateUpLayout,
    MuonConfig,
    MuonState,
    QKVLayout,
    apply_update,
    merge_pieces,
    muon_update,
    split_pieces,
)
from megatron.canzona.runtime import LaunchConfig, launch
from megatron.canzona.runtime.tp_async import MatrixShard, ShardedMatrix, TPEngine

pytestmark = pytest.mark.multirank

LAUNCH_TIMEOUT_S = 90.0
TEST_TIMEOUT_S = 2 * LAUNCH_TIMEOUT_S
CONFIG = MuonConfig(ns_dtype="float32", scale_mode="spectral")
LR, WEIGHT_DECAY, STEPS = 0.02, 0.1, 2
HEAD_DIM, HEADS_PER_GROUP = 4, 2


def _matrices(tp_size: int) -> dict[str, dict]:
    """Full-matrix descriptions: global shape, TP dim, fused kind, host, micro-group."""
    groups = 2 * tp_size  # query groups; a QKV shard holds whole ones
    qkv_rows = groups * (HEADS_PER_GROUP + 2) * HEAD_DIM
    ffn = 6 * tp_size
    last = tp_size - 1
    return {
        # group 0: everything on host 0 (the other ranks' chunks are pure padding)
        "qkv": dict(shape=(qkv_rows, 12), tp_dim=0, fused="qkv", host=0, group=0),
        "fc1": dict(shape=(2 * ffn, 12), tp_dim=0, fused="gate_up", host=0, group=0),
        # group 1: uneven host loads and an unfused column-parallel matrix
        "proj": dict(shape=(12, 3 * tp_size), tp_dim=1, fused=None, host=last, group=1),
        "fc2": dict(shape=(12, ffn), tp_dim=1, fused=None, host=0, group=1),
        "col": dict(shape=(5 * tp_size, 7), tp_dim=0, fused=None, host=last, group=1),
        # group 2: a second fused fc1 on the last host, split into gate and up
        "fc1_split": dict(shape=(4 * tp_size, 9), tp_dim=0, fused="gate_up_split", host=last, group=2),
    }


def _layout(spec: dict, tp_size: int):
    """How the host splits the full matrix (global layouts)."""
    if spec["fused"] == "qkv":
        return QKVLayout(num_query_groups=2 * tp_size, heads_per_group=HEADS_PER_GROUP, head_dim=HEAD_DIM)
    if spec["fused"] == "gate_up_split":
        return GateUpLayout(num_partitions=1)
    return None


def _megatron_shard(full: torch.Tensor, spec: dict, rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard as Megatron holds it."""
    if spec["fused"] in ("gate_up", "gate_up_split"):
        gate, up = full.chunk(2, dim=0)  # the global fc1 is [gate; up], a shard [gate_r; up_r]
        return torch.cat([gate.chunk(tp_size)[rank], up.chunk(tp_size)[rank]]).clone()
    if spec["fused"] == "qkv":  # rows grouped by query group; each rank gets whole groups
        per_group = full.reshape(2 * tp_size, -1, full.shape[1])
        return per_group.chunk(tp_size)[rank].reshape(-1, full.shape[1]).clone()
    return full.chunk(tp_size, dim=spec["tp_dim"])[rank].clone()


class _Muon:
    """Host math: Muon per matrix (pieces of split fused ones), state kept by name."""

    def __init__(self, layouts: dict) -> None:
        self.layouts = layouts
        self.states: dict[str, list[MuonState]] = {}
        self.calls: list[str] = []

    def __call__(self, names, grads):
        directions = []
        for name, grad in zip(names, grads):
            pieces = split_pieces(grad, self.layouts[name])
            states = self.states.setdefault(name, [MuonState.create(p.shape) for p in pieces])
            updates = [muon_update(p, s, CONFIG) for p, s in zip(pieces, states)]
            directions.append(merge_pieces(updates, self.layouts[name]))
            self.calls.append(name)
        return directions


def _full_tensors(specs: dict, seed: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s["shape"], generator=gen).to(device) for n, s in specs.items()}
    grads = [{n: torch.randn(s["shape"], generator=gen).to(device) for n, s in specs.items()} for _ in range(STEPS)]
    return params, grads


def _single_device(params: dict, grads: list[dict], layouts: dict) -> dict[str, torch.Tensor]:
    """The reference: the same Muon on the full matrices, no ranks involved."""
    reference, math = {n: p.clone() for n, p in params.items()}, _Muon(layouts)
    names = list(params)
    for step_grads in grads:
        for name, direction in zip(names, math(names, [step_grads[n] for n in names])):
            apply_update(reference[name], direction, lr=LR, weight_decay=WEIGHT_DECAY)
    return reference


def engine_body(tp_size: int, device: str = "cpu") -> dict[str, dict]:
    """Rank body: TP groups of ``tp_size`` consecutive ranks, each with its own matrices."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(rank)
    groups = [dist.new_group(list(range(s, s + tp_size))) for s in range(0, world, tp_size)]
    tp_group = groups[rank // tp_size]
    return {mode: _train(tp_group, tp_size, mode, torch.device(device)) for mode in ("async", "sync")}


def _train(tp_group, tp_size: int, mode: str, device: torch.device) -> dict:
    """Two engine steps on this rank's shards, checked against the full-matrix reference."""
    tp_rank, team = dist.get_rank(tp_group), dist.get_rank() // tp_size
    specs = _matrices(tp_size)
    layouts = {n: _layout(s, tp_size) for n, s in specs.items()}
    params, grads = _full_tensors(specs, seed=100 + team, device=device)  # each TP group its own

    matrices = [
        ShardedMatrix(
            name=n, local_shape=tuple(_megatron_shard(params[n], s, 0, tp_size).shape), tp_dim=s["tp_dim"],
            host=s["host"], group=s["group"], stride=2 if s["fused"] in ("gate_up", "gate_up_split") else 1,
        )
        for n, s in specs.items()
    ]
    engine = TPEngine(matrices, tp_group=tp_group, mode=mode)
    local = {n: _megatron_shard(params[n], s, tp_rank, tp_size) for n, s in specs.items()}
    host_math, stats = _Muon(layouts), []
    for step in range(STEPS):
        shards = {
            n: MatrixShard(
                param=local[n], grad=_megatron_shard(grads[step][n], s, tp_rank, tp_size),
                lr=LR, weight_decay=WEIGHT_DECAY,
            )
            for n, s in specs.items()
        }
        stats.append(engine.step(shards, host_math))

    reference = _single_device(params, grads, layouts)
    expected = {n: _megatron_shard(reference[n], s, tp_rank, tp_size) for n, s in specs.items()}
    initial = {n: _megatron_shard(params[n], s, tp_rank, tp_size) for n, s in specs.items()}
    return {
        "mismatched": [n for n in specs if not torch.equal(local[n], expected[n])],
        "max_error": max(float((local[n] - expected[n]).abs().max()) for n in specs),
        "moved": all(not torch.equal(local[n], initial[n]) for n in specs),
        "computed": [st.computed for st in stats],
        "bytes_sent": [st.bytes_sent for st in stats],
        "padding_bytes": [st.padding_bytes for st in stats],
        "stages": sorted({(stage, group) for stage, group, _, _ in stats[-1].timeline}),
        "params": {n: t.cpu() for n, t in local.items()},
    }


def _expected_bytes(tp_size: int, rank: int) -> tuple[int, int]:
    """(bytes sent to peers, of which padding) per step in async mode, from the schedule."""
    specs, sent, padding = _matrices(tp_size), 0, 0
    for group in sorted({s["group"] for s in specs.values()}):
        members = [s for s in specs.values() if s["group"] == group]
        numel = [s["shape"][0] * s["shape"][1] // tp_size for s in members]
        per_host = [sum(n for n, s in zip(numel, members) if s["host"] == h) for h in range(tp_size)]
        chunk, peers = max(per_host), [h for h in range(tp_size) if h != rank]
        sent += 2 * len(peers) * chunk * 4  # gather + scatter, fp32
        padding += sum(chunk - per_host[h] for h in peers) * 4  # gather: to each peer host
        padding += len(peers) * (chunk - per_host[rank]) * 4  # scatter: my slices to each peer
    return sent, padding


def _launch(world_size: int, tp_size: int) -> list[dict[str, dict]]:
    return launch(engine_body, LaunchConfig(world_size=world_size, timeout_s=LAUNCH_TIMEOUT_S), tp_size)


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize(("world_size", "tp_size"), [(2, 2), (3, 3), (4, 2)])
def test_engine_equals_single_device_muon(world_size: int, tp_size: int) -> None:
    per_rank = _launch(world_size, tp_size)
    async_ranks, sync_ranks = [r["async"] for r in per_rank], [r["sync"] for r in per_rank]
    names = list(_matrices(tp_size))
    for rank, (a, s) in enumerate(zip(async_ranks, sync_ranks)):
        assert a["mismatched"] == [] and s["mismatched"] == [], f"rank {rank}"
        assert a["moved"] and s["moved"]
        for name in names:  # async and sync: bit-identical
            assert torch.equal(a["params"][name], s["params"][name]), f"rank {rank} {name}"
        assert a["bytes_sent"] == [_expected_bytes(tp_size, rank % tp_size)[0]] * 2
        assert a["padding_bytes"] == [_expected_bytes(tp_size, rank % tp_size)[1]] * 2
        assert a["padding_bytes"][0] > 0, "the schedule is built to need padding"
        for stage in ("gather", "compute", "scatter", "apply"):
            assert {g for st, g in a["stages"] if st == stage} == {0, 1, 2}, stage
    for team in range(world_size // tp_size):
        members = range(team * tp_size, (team + 1) * tp_size)
        for step in range(2):
            async_computed = [n for r in members for n in async_ranks[r]["computed"][step]]
            assert sorted(async_computed) == sorted(names), "each matrix computed exactly once"
            sync_computed = [n for r in members for n in sync_ranks[r]["computed"][step]]
            assert sorted(sync_computed) == sorted(names * tp_size), "sync: by every TP rank"
        hosts = {n: s["host"] for n, s in _matrices(tp_size).items()}
        for r in members:
            assert set(async_ranks[r]["computed"][0]) == {n for n, h in hosts.items() if h == r % tp_size}


def test_engine_rejects_a_bad_schedule() -> None:
    with pytest.raises(ValueError, match="tp_dim"):
        ShardedMatrix(name="w", local_shape=(4, 4), tp_dim=2, host=0, group=0)
    with pytest.raises(ValueError, match="stride"):
        ShardedMatrix(name="w", local_shape=(3, 4), tp_dim=0, host=0, group=0, stride=2)


@pytest.mark.gpu
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL, side stream)")
def test_engine_on_cuda_side_stream() -> None:
    """One NCCL rank per GPU: host compute on the side CUDA stream equals the reference."""
    world_size = min(torch.cuda.device_count(), 2)
    per_rank = launch(
        engine_body, LaunchConfig(world_size=world_size, timeout_s=LAUNCH_TIMEOUT_S, backend="nccl"),
        world_size, "cuda",
    )
    for rank, result in enumerate(per_rank):
        for mode in ("async", "sync"):
            # cuBLAS may pick other kernels on another stream: allow rounding, not bits
            assert result[mode]["max_error"] <= 1e-5, f"rank {rank} {mode}"
            assert result[mode]["moved"]
