"""The FSDP projection (``tools/simulate.py --fsdp``): FSDP's own collectives by hand, Canzona's early
gathers on their queue and the plan's bucket keys, each design's step on toy shards, the ordering and
bounds at Qwen3 scale, PyTorch FSDP2's geometry, the CLI."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest

from megatron.canzona.planning import CostModel, ParamSpec, WireConfig, make_plan, qwen3_specs
from megatron.canzona.planning.fsdp import PER_PARAMETER, fsdp_buckets
from megatron.canzona.planning.sim import ClusterSpec, Workload, load_cluster
from megatron.canzona.planning.sim.fsdp import (FSDP_STRATEGIES, STEP_GATHER, FsdpUnit, fsdp_phases,
                                                plan_bucket_index, simulate_fsdp)
from megatron.canzona.planning.sim.iteration import Rider
from megatron.canzona.planning.sim.step import (ADAMW_BYTES_PER_ELEMENT, EXACT_NORM_BYTES_PER_ELEMENT,
                                                NARROW_PACK_BYTES_PER_ELEMENT, PACK_BYTES_PER_ELEMENT,
                                                SOURCE_BYTES_PER_ELEMENT)

pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOY = ClusterSpec.from_dict({
    "name": "toy", "gpus_per_node": 8,
    "gpu": {"bf16_tflops": 100.0, "fp32_tflops": 10.0, "memory_gb_per_s": 1000.0, "matmul_efficiency": 0.5,
            "memory_efficiency": 1.0},
    "training": {"mfu": 0.5},
    "intra_node": {"bandwidth_gb_per_s": 100.0, "latency_us": 10.0},
    "collectives": {"ring_efficiency": 1.0, "alltoall_efficiency": 0.5},
})


# ------------------------------------------------------------------------------ FSDP's collectives


def test_per_micro_batch_gathers_and_reduces_by_hand():
    """Two units, 3 s of compute a micro-batch (forward 1 s, backward 2 s, split 1:3 between
    them), gathers of 0.5 s, reduce-scatters of 0.2 s, two micro-batches, optim_grads_params."""
    units = [FsdpUnit("0", 0.25, 0.5, 0.2), FsdpUnit("1", 0.75, 0.5, 0.2)]
    p = fsdp_phases(units, micro=3.0, count=2, sharding="optim_grads_params")
    # forward: gather 0 [0, .5], compute 0 [.5, .75] beside gather 1 [.5, 1]; compute 1 [1, 1.75]
    # backward: gather 1 [1.75, 2.25], compute 1 [2.25, 3.75] beside gather 0 [2.25, 2.75];
    # reduce 1 [3.75, 3.95]; compute 0 [3.75, 4.25]; reduce 0 [4.25, 4.45]: 4.45 s a micro-batch,
    # whose backward ends at 4.25 (the second micro-batch starts its forward gather at 4.25, after
    # reduce 0 ends on the one queue at 4.45).
    assert p.compute == pytest.approx(6.0)
    # second micro-batch: forward gather 0 waits for reduce 0: [4.45, 4.95], the rest as before
    assert p.backward_end == pytest.approx(4.95 + 4.25 - 0.5)
    assert p.reduced == pytest.approx(p.backward_end + 0.2)
    assert p.reduce_exposed == pytest.approx(0.2)
    assert p.gather_exposed == pytest.approx(p.backward_end - 6.0)
    assert p.gather_seconds == pytest.approx(8 * 0.5) and p.reduce_seconds == pytest.approx(4 * 0.2)


@pytest.mark.parametrize("sharding, gathers, reduces", [("optim", 2, 2), ("optim_grads", 2, 4),
                                                        ("optim_grads_params", 8, 4)])
def test_what_each_sharding_strategy_moves(sharding, gathers, reduces):
    """optim: parameters gathered once (the first forward), gradients reduced once (the last
    backward); optim_grads: reduced every micro-batch; optim_grads_params: gathered for every
    forward and backward too."""
    units = [FsdpUnit("0", 0.5, 1.0, 1.0), FsdpUnit("1", 0.5, 1.0, 1.0)]
    p = fsdp_phases(units, micro=0.0, count=2, sharding=sharding)
    assert p.gather_seconds == pytest.approx(gathers) and p.reduce_seconds == pytest.approx(reduces)
    assert p.reduced == pytest.approx(gathers + reduces)  # nothing to hide behind: all on the queue


def test_an_early_gather_rides_the_queue_after_its_last_reduce_scatter_by_hand():
    """``optim``, one micro-batch of 3 s (forward 1 s, backward 2 s, the units half each), no
    parameter gathers. Backward: unit 1 computes [1, 2] and reduces [2, 3]; the two gathers waiting
    on its bucket go then, their loads added per rank (rank 0: 0.3 + 0.2, rank 1: 0.4), the heavier
    0.5 s [3, 3.5]; unit 0 computes [2, 3] and its reduce-scatter, issued at 3, waits for them:
    [3.5, 3.7] instead of [3, 3.2]. The gather waiting on both buckets goes after the last
    reduce-scatter: the step's own gather, it starts the step no later."""
    units = [FsdpUnit("0", 0.5, 0.0, 0.2, key=(0, 1)), FsdpUnit("1", 0.5, 0.0, 1.0, key=(0, 0))]
    riders = [Rider(frozenset({(0, 0)}), {0: 0.3}), Rider(frozenset({(0, 0)}), {0: 0.2, 1: 0.4}),
              Rider(frozenset({(0, 0), (0, 1)}), {2: 0.7})]
    alone = fsdp_phases(units, micro=3.0, count=1, sharding="optim")
    p = fsdp_phases(units, micro=3.0, count=1, sharding="optim", riders=riders)
    assert alone.reduced == pytest.approx(3.2) and p.reduced == pytest.approx(3.7)
    assert p.reduced_at == pytest.approx({(0, 0): 3.0 - 3.7, (0, 1): 0.0})
    assert alone.reduced_at == pytest.approx({(0, 0): 3.0 - 3.2, (0, 1): 0.0})
    rides = [t for s in p.segments if s.kind == STEP_GATHER for t in (s.start, s.end)]
    assert rides == pytest.approx([3.0, 3.5, 3.7, 4.4])
    assert p.ride_seconds == pytest.approx(1.2) and p.reduce_seconds == alone.reduce_seconds
    assert p.backward_end == alone.backward_end == pytest.approx(3.0)


def test_fsdp_phases_refuses_an_unknown_sharding():
    with pytest.raises(ValueError, match="optim_grads_params"):
        fsdp_phases([], micro=1.0, count=1, sharding="no_shard")


def test_narrow_gathers_halve_the_early_gathers_time_on_the_link():
    """``narrow_gathers`` (the runtime's default under Megatron-FSDP): Muon's whole matrices go to their hosts in bf16, so the
    early gathers hold the link half as long where every matrix is a whole one (Qwen3-0.6B without
    split QKV, bf16 Newton-Schulz); the scatters and the peers are unchanged, and SOAP's (fp32
    directions) gathers stay fp32."""
    specs = qwen3_specs("qwen3-0.6b")
    kwargs = dict(strategy="canzona", cluster=H100, dp_size=32, workload=Workload(global_batch=64, seq_length=256),
                  wire=WireConfig(grad_bytes=4))
    fp32, bf16 = (simulate_fsdp(specs, narrow_gathers=narrow, **kwargs) for narrow in (False, True))
    assert bf16.details["early_gather_link_seconds"] == pytest.approx(fp32.details["early_gather_link_seconds"] / 2,
                                                                      rel=0.05)
    assert bf16.iteration_seconds < fp32.iteration_seconds
    soap = [simulate_fsdp(specs, optimizer="soap", narrow_gathers=narrow, **kwargs).to_dict() for narrow in (False, True)]
    assert soap[0] == soap[1]


# ------------------------------------------------------------------------------ the step, on toy shards


def _toy_specs() -> list[ParamSpec]:
    """Two layers of a 256 x 512 and a 512 x 256 matrix and a norm each, in registration order."""
    names = [(f"decoder.layers.{layer}.{name}", shape) for layer in range(2)
             for name, shape in (("w0", (256, 512)), ("w1", (512, 256)), ("norm", (512,)))]
    return [ParamSpec(name=name, global_shape=shape, order=len(names) - 1 - i,
                      family="elementwise" if name.endswith("norm") else "matrix")
            for i, (name, shape) in enumerate(names)]


def test_adamw_step_is_each_ranks_shard_at_memory_speed():
    specs = _toy_specs()
    r = simulate_fsdp(specs, strategy="adamw", cluster=TOY, dp_size=4)
    shard = max(sum(hi - lo for bucket in fsdp_buckets(specs, dp_size=4) for item in bucket.items
                    for d, lo, hi in bucket.pieces(item) if d == rank) for rank in range(4))
    assert r.optimizer_step_seconds == pytest.approx(shard * ADAMW_BYTES_PER_ELEMENT / 1e12, rel=1e-12)
    assert r.step_bytes_per_rank == 0


@pytest.mark.parametrize("dp_size", [2, 4])
def test_every_design_computes_every_matrix_and_canzona_once(dp_size):
    """Canzona and the uniform-owner peer compute each matrix once; #4486 on every holder; the
    bytes a Canzona rank sends stay within 2 x its matrix elements x 4 bytes."""
    specs = _toy_specs()
    results = {name: simulate_fsdp(specs, strategy=name, cluster=TOY, dp_size=dp_size) for name in FSDP_STRATEGIES}
    matrices = sum(s.family == "matrix" for s in specs)
    assert results["canzona"].details["num_tasks"] == matrices
    assert results["owner_uniform"].details["num_tasks"] == matrices
    holders = sum(len(b.pieces(i)) for b in fsdp_buckets(specs, dp_size=dp_size) for i in b.items
                  if not i.name.endswith("norm"))
    assert results["every_holder"].details["num_tasks"] == matrices  # one task, computed by each of its holders
    assert holders > matrices  # every matrix crosses a shard boundary here
    assert results["every_holder"].step_compute_seconds > results["canzona"].step_compute_seconds
    bound = 2 * 4 * sum(s.numel for s in specs if s.family == "matrix") / dp_size
    assert 0 < results["canzona"].step_bytes_per_rank <= bound
    # every design pays the same forward and backward
    assert len({round(r.iteration_seconds - r.optimizer_step_seconds, 12) for r in results.values()}) == 1


@pytest.mark.parametrize("optimizer, narrow", [("muon", False), ("muon", True), ("soap", False)])
def test_holders_make_and_pack_their_pieces_before_each_gather(optimizer, narrow):
    """Gathered in the step, each rank first makes its pieces of every matrix that moves: Muon's
    source (its holders keep the momentum), its share of the exact norm (narrow gathers) and the
    packing, at memory speed; SOAP's raw gradients are only packed."""
    specs = _toy_specs()
    r = simulate_fsdp(specs, strategy="canzona", cluster=TOY, dp_size=4, optimizer=optimizer, early_gather=False,
                      narrow_gathers=narrow)
    per = {("muon", False): SOURCE_BYTES_PER_ELEMENT + PACK_BYTES_PER_ELEMENT,
           ("muon", True): SOURCE_BYTES_PER_ELEMENT + EXACT_NORM_BYTES_PER_ELEMENT + NARROW_PACK_BYTES_PER_ELEMENT,
           ("soap", False): PACK_BYTES_PER_ELEMENT}[(optimizer, narrow)]
    held = {}
    for bucket in fsdp_buckets(specs, dp_size=4):
        for item in bucket.items:
            pieces = bucket.pieces(item)
            if not item.name.endswith("norm") and len(pieces) > 1:  # every matrix here moves
                for rank, lo, hi in pieces:
                    held[rank] = held.get(rank, 0) + hi - lo
    prep = {}
    for seg in r.timeline:
        if seg.kind == "prep":
            prep[seg.rank] = prep.get(seg.rank, 0.0) + seg.end - seg.start
    reduces = 2 * 10e-6 * 2 if narrow else 0.0  # two all-reduces a group, a tree over 4 ranks on the node
    assert held and prep.keys() == held.keys()
    for rank, numel in held.items():
        assert prep[rank] == pytest.approx(numel * per / 1e12 + reduces * r.details["num_groups"], rel=1e-9)


def test_early_gathers_make_each_buckets_pieces_as_it_reduces():
    """Gathered as their buckets reduce, the holders make each bucket's pieces (Muon's source, the
    norm's share) then, on the gathers' side stream: in one micro-group over every bucket, more
    than 90% of that work lies before the step's start, beside backward and the reduce-scatters."""
    specs = qwen3_specs("qwen3-0.6b")
    kwargs = dict(strategy="canzona", cluster=H100, dp_size=32, workload=Workload(global_batch=64, seq_length=256),
                  wire=WireConfig(grad_bytes=4), narrow_gathers=True, tp_budget=math.inf)
    r = simulate_fsdp(specs, **kwargs)
    preps = [seg for seg in r.timeline if seg.kind == "prep"]
    assert r.details["num_groups"] == 1 and preps
    # every bucket's share made as it reduces, during backward: most of it before the step's start
    start = r.iteration_seconds - r.optimizer_step_seconds
    before = sum(max(0.0, min(seg.end, start) - seg.start) for seg in preps)
    assert before > 0.9 * sum(seg.end - seg.start for seg in preps)


def test_unknown_strategy_and_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="every_holder"):
        simulate_fsdp(_toy_specs(), strategy="zero1", cluster=TOY, dp_size=2)
    with pytest.raises(ValueError, match="must divide"):
        simulate_fsdp(_toy_specs(), strategy="adamw", cluster=TOY, dp_size=3, ep_size=2)


# ------------------------------------------------------------------------------ Canzona's early gathers


H100 = load_cluster("h100-ib400")


@pytest.mark.parametrize("model, ep_size, tp_size, sharding, bucket_size", [
    ("qwen3-tiny", 1, 1, "optim_grads_params", None), ("qwen3-tiny", 1, 2, "optim", 20_000),
    ("qwen3-moe-tiny", 2, 1, "optim_grads_params", None), ("qwen3-moe-tiny", 1, 1, "optim_grads", 30_000)])
def test_every_planned_bucket_has_its_reduce_scatter_reported(model, ep_size, tp_size, sharding, bucket_size):
    """The plan numbers the buckets holding a matrix as ``fsdp_buffer`` does (by readiness);
    :func:`plan_bucket_index` maps Megatron-FSDP's buckets onto those numbers, and
    ``simulate_fsdp`` asserts that every Canzona task's ``reduced_by`` has a reported end (at
    EP 1 the experts are dense, in buckets of their own)."""
    specs = qwen3_specs(model, tp_size=tp_size, ep_size=ep_size, split_gate_up=True)
    dp = 8 // tp_size
    plan = make_plan(specs, dp_size=dp, tp_size=tp_size, ep_size=ep_size, cost_model=CostModel(kind="muon"),
                     layout="fsdp", fsdp_strategy=sharding, fsdp_bucket_size=bucket_size)
    dense = [s for s in specs if not s.is_expert]
    buckets = fsdp_buckets(dense, dp_size=dp, strategy=sharding, bucket_size=bucket_size)
    index = plan_bucket_index(buckets, dense)
    planned = {p.name: p.bucket for p in plan.layouts[0].matrix.placements}
    assert {item.name: index[i] for i, b in enumerate(buckets) for item in b.items if item.name in planned} == planned
    assert sorted(set(index.values())) == list(range(len(plan.layouts[0].matrix.buckets)))
    r = simulate_fsdp(specs, strategy="canzona", cluster=H100, dp_size=dp, tp_size=tp_size, ep_size=ep_size,
                      sharding=sharding, bucket_size=bucket_size, workload=Workload(global_batch=16, seq_length=64))
    assert r.details["early_gather"] and r.details["num_tasks"] > 0


@pytest.mark.parametrize("model, ep_size", [("qwen3-0.6b", 1), ("qwen3-moe-tiny", 2)])
@pytest.mark.parametrize("sharding", ["optim", "optim_grads", "optim_grads_params"])
def test_early_gathers_cost_the_iteration_at_most_their_link_time(model, ep_size, sharding):
    """Over four nodes: gathering each group as its buckets reduce makes the iteration at most the
    gathers' seconds on the link longer than gathering in the step (``--canzona-no-early-gather``;
    under ``optim`` and ``optim_grads`` at Qwen3-0.6B one bucket holds every matrix, so the gathers
    go at the step's start either way, all before the first scatter: a little longer). Early compute
    shortens the step, and a clip acting every iteration gives it back (the policy then computes,
    and for Muon gathers, in the step)."""
    specs = qwen3_specs(model, ep_size=ep_size)
    kwargs = dict(strategy="canzona", cluster=H100, dp_size=32, ep_size=ep_size, sharding=sharding,
                  workload=Workload(global_batch=64, seq_length=256), wire=WireConfig(grad_bytes=4))
    late, early = simulate_fsdp(specs, early_gather=False, **kwargs), simulate_fsdp(specs, **kwargs)
    computed = simulate_fsdp(specs, early_compute=True, **kwargs)
    clipped = simulate_fsdp(specs, early_compute=True, clip_rate=1.0, **kwargs)
    assert not late.details["early_gather"] and late.details["early_gather_link_seconds"] == 0.0
    assert early.details["early_gather_link_seconds"] > 0
    assert early.iteration_seconds <= late.iteration_seconds + early.details["early_gather_link_seconds"] + 1e-12
    assert computed.optimizer_step_seconds < early.optimizer_step_seconds
    assert computed.iteration_seconds < early.iteration_seconds
    assert computed.details["early_compute"] and not early.details.get("early_compute")
    # Muon's gathers carry its source (momentum on the holders): with the clip acting they mostly wait for the step
    assert computed.optimizer_step_seconds < clipped.optimizer_step_seconds <= late.optimizer_step_seconds + 1e-12
    assert clipped.details["speculation"]["committed"] < 0.05 and clipped.details["speculative_gathers"]
    # SOAP's gathers carry raw gradients, which its hosts scale: the clip changes nothing of them
    soap = {rate: simulate_fsdp(specs, optimizer="soap", clip_rate=rate, **kwargs) for rate in (0.0, 1.0)}
    assert soap[0.0].to_dict() == soap[1.0].to_dict() and "speculation" not in soap[1.0].details


def test_early_compute_is_canzonas_alone_and_checks_its_clip_rate():
    """The peers gather in the step whatever the flags say; a clip rate outside [0, 1] is refused."""
    specs = qwen3_specs("qwen3-tiny")
    kwargs = dict(cluster=H100, dp_size=32, workload=Workload(global_batch=64, seq_length=64))
    for name in ("every_holder", "owner_uniform", "adamw"):
        plain, flagged = (simulate_fsdp(specs, strategy=name, early_compute=e, **kwargs) for e in (False, True))
        assert plain.to_dict() == flagged.to_dict() and not flagged.details["early_gather"]
    with pytest.raises(ValueError, match=r"clip_rate 1.5 must lie in \[0, 1\]"):
        simulate_fsdp(specs, strategy="canzona", early_compute=True, clip_rate=1.5, **kwargs)


# ------------------------------------------------------------------------------ PyTorch FSDP2's geometry


def test_per_parameter_geometry_shards_every_parameter_alone_by_rows():
    specs = [ParamSpec(name="a", global_shape=(10, 6), order=1), ParamSpec(name="b", global_shape=(7,), order=0,
                                                                           family="elementwise")]
    buckets = fsdp_buckets(specs, dp_size=4, strategy=PER_PARAMETER)
    assert [[i.name for i in b.items] for b in buckets] == [["a"], ["b"]]
    a = buckets[0]
    assert a.chunk == 6 and a.shard_size == math.ceil(10 / 4) * 6  # torch.chunk's ceil(rows / dp) rows a rank
    assert [hi - lo for _, lo, hi in a.pieces(a.items[0])] == [18, 18, 18, 6]


# ------------------------------------------------------------------------------ at scale


@pytest.fixture(scope="module")
def qwen3_8b_fsdp64():
    cluster = load_cluster("h100-ib400")
    workload = Workload(global_batch=128)
    wire = WireConfig(grad_bytes=4)
    fused = qwen3_specs("qwen3-8b", split_qkv=True)
    split = qwen3_specs("qwen3-8b", split_qkv=True, split_gate_up=True)
    # Canzona as the runtime runs it on CUDA: early gathers, early compute (``auto``)
    out = {name: simulate_fsdp(fused, strategy=name, cluster=cluster, dp_size=64, workload=workload, wire=wire,
                               early_compute=True) for name in FSDP_STRATEGIES}
    out["canzona_split"] = simulate_fsdp(split, strategy="canzona", cluster=cluster, dp_size=64, workload=workload,
                                         wire=wire, early_compute=True)
    return out, fused


def test_qwen3_8b_at_fsdp_64_canzona_beats_both_peers_and_stays_within_its_bytes(qwen3_8b_fsdp64):
    r, specs = qwen3_8b_fsdp64
    canzona = r["canzona_split"]
    assert canzona.optimizer_step_seconds < r["owner_uniform"].optimizer_step_seconds
    assert canzona.optimizer_step_seconds < r["every_holder"].optimizer_step_seconds / 10
    bound = 2 * 4 * sum(s.numel for s in specs if s.family == "matrix") / 64
    assert canzona.step_bytes_per_rank <= bound and r["canzona"].step_bytes_per_rank <= bound
    # #4486 sends each piece to every other holder: many times the bound
    assert r["every_holder"].step_bytes_per_rank > 10 * bound
    # the iteration: within the 1% of AdamW-FSDP's (docs/fsdp.md)
    assert canzona.iteration_seconds / r["adamw"].iteration_seconds < 1.01
    assert r["every_holder"].iteration_seconds / r["adamw"].iteration_seconds > 1.3


def test_fsdp_hosts_prefer_a_rank_holding_rows():
    """Under the fsdp layout a split matrix goes to one of its holders wherever that does not grow
    the plan's objective: at Qwen3-8B FSDP 256 nearly all of them (measured with the preference turned off: 75 of 180)."""
    specs = qwen3_specs("qwen3-8b", split_qkv=True, split_gate_up=True)
    plan = make_plan(specs, dp_size=256, cost_model=CostModel(kind="muon"), layout="fsdp")
    buffer = plan.layouts[0].matrix
    placed = {p.name: p for p in buffer.placements}
    split = [h for h in plan.hosts if placed[h.name].host is None]
    held = sum(h.dp_rank in {d for d, _, _ in buffer.pieces(placed[h.name])} for h in split)
    assert held >= 0.9 * len(split)


# ------------------------------------------------------------------------------ the CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "simulate.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_cli_prints_every_design_and_refuses_what_fsdp_does_not_run():
    out = _cli("--model", "qwen3-1.7b", "--gpus", "64", "--fsdp")
    assert out.returncode == 0, out.stderr
    assert "Megatron-FSDP optim_grads_params" in out.stdout
    for name in FSDP_STRATEGIES:
        assert f" {name} " in out.stdout
    assert "early compute on (auto: data-parallel size 64" in out.stdout  # the runtime's auto on a CUDA cluster
    bad = _cli("--model", "qwen3-1.7b", "--gpus", "64", "--fsdp", "--pp", "2")
    assert bad.returncode == 2 and "pass --pp 1 --cp 1" in bad.stderr


def test_cli_takes_early_compute_under_fsdp():
    """``--fsdp --early-compute`` forces it on where ``auto`` (gloo) leaves it off, and prices the
    clip rate; ``--no-early-compute`` turns it off."""
    tiny = ("--model", "qwen3-tiny", "--gpus", "4", "--fsdp", "--cluster", "cpu-gloo-local", "--json")
    runs = [_cli(*tiny, *extra) for extra in ((), ("--early-compute",), ("--no-early-compute",),
                                              ("--early-compute", "--clip-rate", "0.5"))]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    auto, forced, off, clipped = (json.loads(r.stdout) for r in runs)
    assert not auto["config"]["early_compute"] and "on gloo" in auto["config"]["early_compute_decision"]
    assert forced["config"]["early_compute"] and clipped["config"]["speculation"]["committed"] < 1.0
    assert not off["config"]["early_compute"] and "off" in off["config"]["early_compute_decision"]
    step = {name: r["strategies"]["canzona"]["optimizer_step_seconds"] for name, r in (("auto", auto), ("forced", forced))}
    assert step["forced"] < step["auto"]
