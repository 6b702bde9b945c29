"""The host-group engine alone, on plain tensors: host-rank compute equals single-device math.

Ranks form a DP x TP grid. Each builds Megatron-style TP shards of a few full matrices (a
fused QKV and a fused SwiGLU fc1, column-parallel, row-parallel projections, and a matrix
every TP rank holds whole), cuts each local shard into flat DP pieces the way equal DP
shards would (uneven, some matrices whole on one DP rank, one hosted by a rank that holds
none of it), gives them to :class:`~megatron.canzona.runtime.host_groups.HostGroupEngine`
with Muon as the host math, and takes two steps. The single-device reference runs the same
Muon on the full matrices in the same process; every rank's pieces must then equal the
reference's slices bit for bit, in both ``async`` and ``sync`` mode, and with Newton-Schulz in
bf16 when every whole matrix's direction is scattered in bf16 and scaled by its receivers.
Shards and pieces are cut here by hand, not with the engine's own helpers.
"""

from __future__ import annotations

import contextlib

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
from megatron.canzona.optim.muon import MuonSourceState, muon_from_normalized, muon_from_source, muon_scale
from megatron.canzona.runtime import LaunchConfig, launch
from megatron.canzona.planning.schedule import Task
from megatron.canzona.runtime.host_groups import HostGroupEngine, LocalPiece, MatrixTask, StepFactors
from megatron.canzona.runtime.optimizer import narrow_gathers, narrow_updates, unscaled

pytestmark = pytest.mark.multirank

LAUNCH_TIMEOUT_S = 90.0
TEST_TIMEOUT_S = 2 * LAUNCH_TIMEOUT_S
CONFIG = MuonConfig(ns_dtype="float32", scale_mode="spectral")
CONFIG_BF16 = MuonConfig(ns_dtype="bfloat16", scale_mode="spectral")
CONFIG_EXACT = MuonConfig(ns_dtype="bfloat16", scale_mode="spectral", exact_norm=True)
"""Newton-Schulz in bf16 with the exact norm, whose narrow gathers the holders normalise."""
LR, WEIGHT_DECAY, STEPS = 0.02, 0.1, 2
HEAD_DIM, HEADS_PER_GROUP = 4, 2


def _matrices(dp: int, tp: int) -> dict[str, dict]:
    """Full-matrix descriptions: global shape, TP dim, fused kind, DP cuts, host, micro-group."""
    groups = 2 * tp  # query groups; a QKV shard holds whole ones
    qkv_rows = groups * (HEADS_PER_GROUP + 2) * HEAD_DIM
    ffn = 6 * tp
    last_dp, last_tp = dp - 1, tp - 1
    return {
        # group 0: split over every DP rank, hosted by the first and by the last rank
        "qkv": dict(shape=(qkv_rows, 12), tp_dim=0, fused="qkv", cuts="even", host=(0, 0), group=0),
        "fc1": dict(shape=(2 * ffn, 12), tp_dim=0, fused="gate_up", cuts="uneven", host=(last_dp, last_tp), group=0),
        # group 1: row-parallel, whole on one DP rank, and a matrix every TP rank holds whole
        "proj": dict(shape=(12, 3 * tp), tp_dim=1, fused=None, cuts=last_dp, host=(last_dp, last_tp), group=1),
        "fc2": dict(shape=(12, ffn), tp_dim=1, fused=None, cuts="uneven", host=(0, 0), group=1),
        "router": dict(shape=(5, 7), tp_dim=None, fused=None, cuts="even", host=(last_dp, None), group=1),
        "local": dict(shape=(6, 5), tp_dim=None, fused=None, cuts=0, host=(0, None), group=1),
        # group 2: a fused fc1 split into gate and up, hosted by a rank holding none of it
        "fc1_split": dict(shape=(4 * tp, 9), tp_dim=0, fused="gate_up_split", cuts=0, host=(last_dp, 0), group=2),
    }


def _layout(spec: dict, tp: int):
    """How the host splits the full matrix (global layouts)."""
    if spec["fused"] == "qkv":
        return QKVLayout(num_query_groups=2 * tp, heads_per_group=HEADS_PER_GROUP, head_dim=HEAD_DIM)
    if spec["fused"] == "gate_up_split":
        return GateUpLayout(num_partitions=1)
    return None


def _megatron_shard(full: torch.Tensor, spec: dict, rank: int, tp: int) -> torch.Tensor:
    """TP rank ``rank``'s tensor as Megatron holds it."""
    if spec["tp_dim"] is None:
        return full.clone()
    if spec["fused"] in ("gate_up", "gate_up_split"):
        gate, up = full.chunk(2, dim=0)  # the global fc1 is [gate; up], a shard [gate_r; up_r]
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]).clone()
    if spec["fused"] == "qkv":  # rows grouped by query group; each rank gets whole groups
        per_group = full.reshape(2 * tp, -1, full.shape[1])
        return per_group.chunk(tp)[rank].reshape(-1, full.shape[1]).clone()
    return full.chunk(tp, dim=spec["tp_dim"])[rank].clone()


def _pieces(numel: int, cuts, dp: int) -> tuple[tuple[int, int, int], ...]:
    """``(dp_rank, lo, hi)``: the flat local tensor cut over DP ranks (or whole on one)."""
    if isinstance(cuts, int):
        return ((cuts, 0, numel),)
    if cuts == "even":
        bounds = [numel * d // dp for d in range(dp + 1)]
    else:  # uneven: the first DP rank holds a sliver, the rest share the remainder
        bounds = [0] + [min(numel, 3 + (numel - 3) * d // max(dp - 1, 1)) for d in range(1, dp)] + [numel]
    return tuple((d, bounds[d], bounds[d + 1]) for d in range(dp) if bounds[d] < bounds[d + 1])


def _task(key: str, *, local_shape: tuple, tp_dim: int | None, pieces: tuple, host: tuple, group: int,
          stride: int = 1, column: int = 0) -> MatrixTask:
    """A schedule task with its local shape, as the binding makes them."""
    task = Task(key=key, name=key, pieces=pieces, tp_sharded=tp_dim is not None, column=column, host=host, group=group)
    return MatrixTask(task=task, local_shape=local_shape, tp_dim=tp_dim, stride=stride)


def _narrowed(tasks: list[MatrixTask], specs: dict, tp: int) -> list[MatrixTask]:
    """The runtime's marking (``narrow_updates``): every task whose host computes one whole
    matrix (no split layout) and sends it gets its bf16 Newton-Schulz output back in bf16."""
    layouts = {t.key: _layout(specs[t.key.split("@")[0]], tp) for t in tasks}
    marked = list(narrow_updates(tasks, math="muon", config=CONFIG_BF16, layouts=layouts, tp_size=tp, mode="async"))
    for task in marked:  # the scale is the whole matrix's, as single-device Muon computes it
        if task.update_dtype is not None:
            assert task.update_scale == muon_scale(*task.full_shape(tp), CONFIG_BF16.scale_mode)
    assert any(t.update_dtype is not None for t in marked) and any(t.update_dtype is None for t in marked)
    return marked


def _tasks(specs: dict, dp: int, tp: int) -> list[MatrixTask]:
    tasks = []
    for name, s in specs.items():
        local = _megatron_shard(torch.zeros(s["shape"]), s, 0, tp).shape
        pieces = _pieces(local.numel(), s["cuts"], dp)
        stride = 2 if s["fused"] in ("gate_up", "gate_up_split") else 1
        if s["tp_dim"] is not None:
            tasks.append(_task(name, local_shape=tuple(local), tp_dim=s["tp_dim"], pieces=pieces,
                               host=s["host"], group=s["group"], stride=stride))
            continue
        for column in range(tp):  # one task per TP rank's copy
            tasks.append(_task(f"{name}@tp{column}", local_shape=tuple(local), tp_dim=None, pieces=pieces,
                               host=(s["host"][0], column), group=s["group"], column=column))
    return tasks


class _Muon:
    """Host math: Muon per matrix (pieces of split fused ones), state kept by key."""

    def __init__(self, layouts: dict, config: MuonConfig = CONFIG, narrow: frozenset = frozenset()) -> None:
        self.layouts, self.config, self.narrow = layouts, config, narrow
        self.states: dict[str, list[MuonState]] = {}

    def __call__(self, keys, grads):
        directions = []
        for key, grad in zip(keys, grads):
            layout = self.layouts[key.split("@")[0]]
            pieces = split_pieces(grad, layout)
            states = self.states.setdefault(key, [MuonState.create(p.shape, device=p.device) for p in pieces])
            config = unscaled(self.config) if key in self.narrow else self.config
            directions.append(merge_pieces([muon_update(p, st, config) for p, st in zip(pieces, states)], layout))
        return directions


class _Sources:
    """Host math of holders that keep the momentum (Megatron-FSDP): the gradients are Muon's
    Newton-Schulz input; a narrow-gathered matrix's arrives divided by its exact norm, in bf16."""

    def __init__(self, layouts: dict, narrow: frozenset = frozenset(), gathered: frozenset = frozenset()) -> None:
        self.layouts, self.narrow, self.gathered = layouts, narrow, gathered
        self.states: dict[str, list[MuonSourceState]] = {}

    def __call__(self, keys, grads):
        directions = []
        for key, grad in zip(keys, grads):
            config = unscaled(CONFIG_EXACT) if key in self.narrow else CONFIG_EXACT
            if key in self.gathered:
                state = self.states.setdefault(key, [MuonSourceState()])[0]
                directions.append(muon_from_normalized(grad, state, config))
                continue
            layout = self.layouts[key.split("@")[0]]
            pieces = split_pieces(grad, layout)
            states = self.states.setdefault(key, [MuonSourceState() for _ in pieces])
            directions.append(merge_pieces([muon_from_source(p, st, config) for p, st in zip(pieces, states)], layout))
        return directions


def _full_tensors(specs: dict, seed: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s["shape"], generator=gen).to(device) for n, s in specs.items()}
    grads = [{n: torch.randn(s["shape"], generator=gen).to(device) for n, s in specs.items()} for _ in range(STEPS)]
    return params, grads


def _single_device(params: dict, grads: list[dict], layouts: dict, config: MuonConfig = CONFIG,
                   sources: bool = False) -> dict[str, torch.Tensor]:
    """The reference: the same Muon on the full matrices, no ranks involved (``sources``: the
    gradients are its Newton-Schulz input, :class:`_Sources`)."""
    reference, math = {n: p.clone() for n, p in params.items()}, (_Sources(layouts) if sources else _Muon(layouts, config))
    names = list(params)
    for step_grads in grads:
        for name, direction in zip(names, math(names, [step_grads[n] for n in names])):
            apply_update(reference[name], direction, lr=LR, weight_decay=WEIGHT_DECAY)
    return reference


UNSCALE, CLIP = 2.0**-7, 0.3
"""What turns the staged run's raw gradients into its main gradients: a loss scale's inverse,
then a clip factor (``(raw * UNSCALE) * CLIP``, Megatron's order)."""


def engine_body(dp: int, tp: int, device: str = "cpu") -> dict[str, dict]:
    """Rank body: rank r is (DP rank r // tp, TP rank r % tp) of one DP x TP grid."""
    rank = dist.get_rank()
    if device == "cuda":  # one GPU per NCCL rank; gloo ranks may share one
        torch.cuda.set_device(rank % torch.cuda.device_count())
    out = {mode: _train(dp, tp, mode, torch.device(device)) for mode in ("async", "sync")}
    out["staged"] = _train(dp, tp, "async", torch.device(device), staged=True)
    out["early"] = _train(dp, tp, "async", torch.device(device), staged=True, early=True)
    out["narrow"] = _train(dp, tp, "async", torch.device(device), narrow=True)
    out["early_narrow"] = _train(dp, tp, "async", torch.device(device), staged=True, early=True, narrow=True)
    out["gathered"] = _train(dp, tp, "async", torch.device(device), narrow=True, gathered=True)
    out["prenormed"] = _train(dp, tp, "async", torch.device(device), narrow=True, gathered=True, prenormed=True)
    return out


def _train(dp: int, tp: int, mode: str, device: torch.device, staged: bool = False, narrow: bool = False,
           early: bool = False, gathered: bool = False, prenormed: bool = False) -> dict:
    """Two engine steps on this rank's pieces, checked against the full-matrix reference.
    ``staged``: every gather is issued before the step from raw (bf16, unscaled, unclipped)
    pieces, the host scaling what it receives; step 0's staged gathers are dropped first (a
    skipped step) and issued again. ``early`` too: no clip, and every group is computed
    before the step (``precompute``; on CUDA on a side stream, as the early gathers run it),
    the step committing what it computed. ``narrow``: Newton-Schulz in bf16, whole matrices'
    directions scattered in bf16 (:func:`_narrowed`). ``gathered`` too: the gradients are Muon's
    input its holders keep (Megatron-FSDP's), a whole matrix's sent divided by its exact norm in bf16
    (``narrow_gathers``: two all-reduces over the group, on CUDA on the engine's side stream).
    ``prenormed`` too: before each step the norms of every other narrow matrix of each micro-group
    are taken ahead (``prenorm``, as the early gathers take them per bucket), the gather the rest."""
    rank = dist.get_rank()
    coord = (rank // tp, rank % tp)
    specs = _matrices(dp, tp)
    layouts = {n: _layout(s, tp) for n, s in specs.items()}
    params, grads = _full_tensors(specs, seed=100, device=device)
    raw_grads = None
    if staged:  # raw gradients as a bf16 buffer holds them; the main ones are scaled fp32 copies
        raw_grads = [{n: g.to(torch.bfloat16) for n, g in step.items()} for step in grads]
        clip = 1.0 if early else CLIP
        grads = [{n: (g.float() * UNSCALE) * clip for n, g in step.items()} for step in raw_grads]
    tasks = _narrowed(_tasks(specs, dp, tp), specs, tp) if narrow else _tasks(specs, dp, tp)
    if gathered:
        tasks = list(narrow_gathers(tasks, math="muon", config=CONFIG_EXACT, momentum_on_holders=True))
    config = CONFIG_BF16 if narrow else CONFIG
    engine = HostGroupEngine(tasks, group=None, rank_of={(d, t): d * tp + t for d in range(dp) for t in range(tp)},
                             coord=coord, tp_size=tp, mode=mode)
    mine = {}  # (key, lo) -> (name, flat parameter piece, hi)
    for task in tasks:
        name = task.key.split("@")[0]
        for lo, hi in engine.holds(task):
            mine[(task.key, lo)] = (name, _megatron_shard(params[name], specs[name], coord[1], tp).reshape(-1)[lo:hi], hi)
    narrow_keys = frozenset(t.key for t in tasks if t.update_dtype is not None)
    gathered_keys = frozenset(t.key for t in tasks if t.gather_dtype is not None)
    host_math = _Sources(layouts, narrow_keys, gathered_keys) if gathered else _Muon(layouts, config, narrow_keys)
    stats, side_streams = [], set()
    kept: dict[str, str] = {}  # task key -> dtype of the direction precompute keeps for the step
    for step in range(STEPS):
        pieces = {
            (key, lo): LocalPiece(
                param=flat, lr=LR, weight_decay=WEIGHT_DECAY,
                grad=_megatron_shard(grads[step][name], specs[name], coord[1], tp).reshape(-1)[lo:hi].clone(),
            )
            for (key, lo), (name, flat, hi) in mine.items()
        }
        if prenormed:
            for index, exchange in enumerate(engine.exchanges):  # the same keys on every rank
                ahead = list(exchange.normalized)[::2]
                engine.prenorm(index, ahead, lambda key, lo: pieces[(key, lo)].grad, device)
        if not staged:
            stats.append(engine.step(pieces, host_math))
            side_streams.add(id(engine._side))
            continue
        raw = {(key, lo): _megatron_shard(raw_grads[step][name], specs[name], coord[1], tp).reshape(-1)[lo:hi].clone()
               for (key, lo), (name, _, hi) in mine.items()}
        rounds = 2 if step == 0 else 1
        for attempt in range(rounds):  # step 0: issue, drop (a skipped step), issue again
            for index in reversed(range(len(engine.exchanges))):  # any order, the same on every rank
                engine.prestart(index, raw)
            if attempt + 1 < rounds:
                engine.drop_staged()
        assert engine.staged
        if early:
            side = torch.cuda.Stream(device=device) if device.type == "cuda" else None
            for index in range(len(engine.exchanges)):
                if side is not None:
                    side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    engine.precompute(index, raw, host_math, scale=(UNSCALE,))
            kept.update((key, str(d.dtype)) for e in engine._early.values() for key, d in e.directions.items())
            stats.append(engine.step(pieces, host_math, StepFactors(scale=(UNSCALE,), commit_early=True)))
            assert stats[-1].early == len(engine.exchanges) and not engine.precomputed
        else:
            stats.append(engine.step(pieces, host_math, StepFactors(scale=(UNSCALE, CLIP))))
        assert not engine.staged
        side_streams.add(id(engine._side))

    reference = _single_device(params, grads, layouts, config, sources=gathered)
    expected = {
        (key, lo): _megatron_shard(reference[name], specs[name], coord[1], tp).reshape(-1)[lo:hi]
        for (key, lo), (name, _, hi) in mine.items()
    }
    return {
        "mismatched": [k for k, (_, flat, _) in mine.items() if not torch.equal(flat, expected[k])],
        "max_error": max((float((flat - expected[k]).abs().max()) for k, (_, flat, _) in mine.items()), default=0.0),
        "held": sorted(mine),
        "computed": [st.computed for st in stats],
        "bytes_sent": [st.bytes_sent for st in stats],
        "stages": sorted({(stage, group) for stage, group, _, _ in stats[-1].timeline}),
        "params": {f"{k[0]}:{k[1]}": flat.cpu() for k, (_, flat, _) in mine.items()},
        "side_streams": len(side_streams),
        "kept": kept,
        "narrow_keys": sorted(narrow_keys),
        "gathered_keys": sorted(gathered_keys),
        "norms": (engine.norms_ahead, engine.norms_at_gather),
    }


def _expected_bytes(dp: int, tp: int, coord: tuple[int, int], mode: str, narrow: bool = False,
                    gathered: bool = False) -> int:
    """Bytes this rank sends per step: real elements only, each piece once each way, in fp32
    (``narrow``: a whole matrix's direction back in bf16, each piece rounded up to 4 bytes;
    ``gathered``: its pieces to the host in bf16 too)."""
    sent = 0
    specs = _matrices(dp, tp)
    tasks = _tasks(specs, dp, tp)
    for task in _narrowed(tasks, specs, tp) if narrow else tasks:
        holders = task.holders(tp)
        back = 4 if task.update_dtype is None else 2
        there = 2 if gathered and task.update_dtype is not None else 4
        for holder, lo, hi in holders:
            if mode == "async" and holder != task.host:
                sent += -(-there * (hi - lo) // 4) * 4 * (holder == coord) + -(-back * (hi - lo) // 4) * 4 * (task.host == coord)
            if mode == "sync" and holder == coord:
                sent += 4 * (hi - lo) * (len(holders) - 1)  # to every other holder
    return sent


def _launch(dp: int, tp: int) -> list[dict[str, dict]]:
    return launch(engine_body, LaunchConfig(world_size=dp * tp, timeout_s=LAUNCH_TIMEOUT_S), dp, tp)


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize(("dp", "tp"), [(1, 2), (1, 3), (3, 1), (2, 2)])
def test_engine_equals_single_device_muon(dp: int, tp: int) -> None:
    per_rank = _launch(dp, tp)
    async_ranks, sync_ranks = [r["async"] for r in per_rank], [r["sync"] for r in per_rank]
    tasks = _tasks(_matrices(dp, tp), dp, tp)
    for rank, (a, s) in enumerate(zip(async_ranks, sync_ranks)):
        coord = (rank // tp, rank % tp)
        assert a["mismatched"] == [] and s["mismatched"] == [], f"rank {rank}"
        staged = per_rank[rank]["staged"]  # gathered before the step, scaled by the host: bitwise the same
        assert staged["mismatched"] == [], f"rank {rank} staged"
        early = per_rank[rank]["early"]  # computed before the step too, committed: bitwise the same
        assert early["mismatched"] == [] and early["bytes_sent"] == staged["bytes_sent"], f"rank {rank} early"
        assert staged["bytes_sent"] == [_expected_bytes(dp, tp, coord, "async")] * STEPS
        narrow = per_rank[rank]["narrow"]  # bf16 Newton-Schulz, whole matrices scattered in bf16: bitwise
        assert narrow["mismatched"] == [], f"rank {rank} narrow"
        assert narrow["bytes_sent"] == [_expected_bytes(dp, tp, coord, "async", narrow=True)] * STEPS
        # computed before the step in bf16 Newton-Schulz: a whole matrix's direction is kept in bf16
        # until its scatter (half the bytes), bitwise the step's own
        gathered = per_rank[rank]["gathered"]  # each whole matrix's pieces divided by its exact norm, in bf16
        assert gathered["mismatched"] == [] and gathered["gathered_keys"] == narrow["narrow_keys"], f"rank {rank}"
        assert gathered["bytes_sent"] == [_expected_bytes(dp, tp, coord, "async", narrow=True, gathered=True)] * STEPS
        # half the norms taken ahead of the gathers (prenorm), the rest by them: the same bits and bytes
        prenormed = per_rank[rank]["prenormed"]
        assert prenormed["mismatched"] == [] and prenormed["bytes_sent"] == gathered["bytes_sent"], f"rank {rank}"
        ahead, at_gather = prenormed["norms"]
        assert ahead > 0 and at_gather > 0 and ahead + at_gather == gathered["norms"][1], (rank, prenormed["norms"])
        early_narrow = per_rank[rank]["early_narrow"]
        assert early_narrow["mismatched"] == [] and early_narrow["bytes_sent"] == narrow["bytes_sent"], rank
        hosted = {t.key for t in tasks if t.host == coord}
        assert set(early_narrow["kept"]) == hosted, rank
        assert {k: str(torch.bfloat16 if k in early_narrow["narrow_keys"] else torch.float32) for k in hosted} \
            == early_narrow["kept"], rank
        for name in a["params"]:  # async and sync: bit-identical
            assert torch.equal(a["params"][name], s["params"][name]), f"rank {rank} {name}"
        assert a["side_streams"] == s["side_streams"] == 1, "one side stream per engine, made once"
        assert a["bytes_sent"] == [_expected_bytes(dp, tp, coord, "async")] * STEPS
        assert s["bytes_sent"] == [_expected_bytes(dp, tp, coord, "sync")] * STEPS
        computes = {g for stage, g in a["stages"] if stage == "compute"}
        assert computes == {t.group for t in tasks if t.host == coord}
        for stage in ("gather", "scatter", "apply"):
            assert {g for st, g in a["stages"] if st == stage} == {0, 1, 2}, stage
    assert per_rank[0]["early_narrow"]["narrow_keys"], "some whole matrix moves, its direction in bf16"
    for step in range(STEPS):
        computed = [k for r in async_ranks for k in r["computed"][step]]
        assert sorted(computed) == sorted(t.key for t in tasks), "each task computed exactly once"
        sync_computed = [k for r in sync_ranks for k in r["computed"][step]]
        assert sorted(sync_computed) == sorted(t.key for t in tasks for _ in {h for h, _, _ in t.holders(tp)})
    for rank, a in enumerate(async_ranks):
        coord = (rank // tp, rank % tp)
        assert set(a["computed"][0]) == {t.key for t in tasks if t.host == coord}


def test_engine_rejects_a_bad_schedule() -> None:
    with pytest.raises(ValueError, match="tp_dim"):
        _task("w", local_shape=(4, 4), tp_dim=2, pieces=((0, 0, 16),), host=(0, 0), group=0)
    with pytest.raises(ValueError, match="disagrees with the schedule"):
        MatrixTask(task=Task(key="w", name="w", pieces=((0, 0, 12),), tp_sharded=False, host=(0, 0)),
                   local_shape=(3, 4), tp_dim=0)
    with pytest.raises(ValueError, match="stride"):
        _task("w", local_shape=(3, 4), tp_dim=0, pieces=((0, 0, 12),), host=(0, 0), group=0, stride=2)
    with pytest.raises(ValueError, match="cover"):
        _task("w", local_shape=(3, 4), tp_dim=0, pieces=((0, 0, 5), (1, 6, 12)), host=(0, 0), group=0)
    with pytest.raises(ValueError, match="cover"):
        _task("w", local_shape=(3, 4), tp_dim=0, pieces=((0, 0, 5), (1, 5, 10)), host=(0, 0), group=0)
    with pytest.raises(ValueError, match="not in the group"):
        task = _task("w", local_shape=(3, 4), tp_dim=None, pieces=((1, 0, 12),), host=(1, 0), group=0)
        HostGroupEngine([task], group=None, rank_of={(0, 0): 0}, coord=(0, 0), tp_size=1)


@pytest.mark.gpu
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL, side stream)")
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_engine_on_cuda_side_stream(backend: str) -> None:
    """Host compute on the side CUDA stream equals the reference: NCCL with one rank per GPU
    (TP up to 2), and gloo with CUDA tensors at DP 2 x TP 2 (NCCL refuses two ranks on one GPU,
    gloo does not), so the multi-rank CUDA path runs on a single GPU too."""
    dp, tp = (1, min(torch.cuda.device_count(), 2)) if backend == "nccl" else (2, 2)
    per_rank = launch(
        engine_body, LaunchConfig(world_size=dp * tp, timeout_s=LAUNCH_TIMEOUT_S, backend=backend),
        dp, tp, "cuda",
    )
    for rank, result in enumerate(per_rank):
        for mode in ("async", "sync", "early"):
            # cuBLAS may pick other kernels on another stream: allow rounding, not bits
            assert result[mode]["max_error"] <= 1e-5, f"rank {rank} {mode}"
        # bf16 Newton-Schulz, whole matrices' directions scattered in bf16 over NCCL (a uint8
        # all-to-all): another kernel's bf16 roundings carry through the iteration (the bound of
        # test_canzona_whole.py's bf16 runs); a lost, doubled or unscaled update moves by ~lr
        assert result["narrow"]["max_error"] <= 0.5 * LR, f"rank {rank} narrow"
        assert result["early_narrow"]["max_error"] <= 0.5 * LR, f"rank {rank} early narrow"
        # the holders' exact norms (a maximum and an int64 sum over the group) on the side stream
        assert result["gathered"]["max_error"] <= 0.5 * LR, f"rank {rank} gathered"
        assert result["prenormed"]["max_error"] <= 0.5 * LR, f"rank {rank} prenormed"
