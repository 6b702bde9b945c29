"""The simulator on toy cases whose times are computed by hand, its properties, its errors and its CLI."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.canzona.planning import Calibration, CostModel, ParamSpec, WireConfig, make_plan, muon_flops, plan_zero1
from megatron.canzona.planning.cost import gram_reductions, ns_flops, sharded_ns_flops
from megatron.canzona.planning.lean import balanced_homes
from megatron.canzona.planning.sim import ClusterSpec, Workload, load_calibration, load_cluster, simulate
from megatron.canzona.planning.sim.step import SimTask, StepRun, run_host_groups

pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOY = {
    "name": "toy", "gpus_per_node": 8,
    "gpu": {"bf16_tflops": 100.0, "fp32_tflops": 10.0, "memory_gb_per_s": 1000.0, "matmul_efficiency": 0.5,
            "memory_efficiency": 1.0},
    "training": {"mfu": 0.5},
    "intra_node": {"bandwidth_gb_per_s": 100.0, "latency_us": 10.0},
    "inter_node": {"bandwidth_gb_per_s": 10.0, "latency_us": 20.0},
    "collectives": {"ring_efficiency": 1.0, "alltoall_efficiency": 0.5},
}
M, N = 256, 512  # 131072 elements: a multiple of every bucket alignment below
NUMEL = M * N
COMPUTE = muon_flops(M, N) / (100e12 * 0.5) + 12 * NUMEL / 1e12  # Newton-Schulz + momentum
WIRE = WireConfig(grad_bytes=4)


def cluster(**changes) -> ClusterSpec:
    return ClusterSpec.from_dict({**TOY, **changes})


def matrix(tp_size: int = 1, name: str = "w", order: int = 0, shape: tuple[int, int] = (M, N)) -> ParamSpec:
    return ParamSpec(name=name, global_shape=shape, tp_dim=0 if tp_size > 1 else None, tp_size=tp_size, order=order)


# ----------------------------------------------------------------------------------- hand-computed


def test_one_bucket_zero1_over_two_dp_ranks():
    """One matrix split over two DP shards: reduce-scatter and all-gather are one ring step;
    both holders all-gather the matrix (one ring step) and compute it."""
    r = simulate([matrix()], strategy="zero1", cluster=cluster(), dp_size=2, wire=WIRE)
    rs = 10e-6 + 0.5 * NUMEL * 4 / 100e9
    ag = 10e-6 + 0.5 * NUMEL * 2 / 100e9
    gather = 10e-6 + 0.5 * NUMEL * 4 / 100e9
    apply = NUMEL / 2 * 14 / 1e12
    assert r.grad_reduce_seconds == pytest.approx(rs, rel=1e-12)
    assert r.param_gather_seconds == pytest.approx(ag, rel=1e-12)
    assert r.optimizer_step_seconds == pytest.approx(gather + COMPUTE + apply, rel=1e-12)
    # No forward/backward to hide behind: both collectives are exposed.
    assert r.iteration_seconds == pytest.approx(ag + rs + gather + COMPUTE + apply, rel=1e-12)
    assert r.exposed_comm_seconds == pytest.approx(ag + rs + gather, rel=1e-12)


def test_one_matrix_canzona_host_over_tp():
    """TP 2, DP 1: the host gets the other TP shard (fp32, one all-to-all), computes, scatters
    its slice back (the Muon direction iterated in bf16, in bf16; fp32 when iterated in fp32);
    each rank applies its half."""
    r = simulate([matrix(tp_size=2)], strategy="canzona", cluster=cluster(), dp_size=1, tp_size=2, wire=WIRE)
    a2a, back = (10e-6 + NUMEL / 2 * size / (100e9 * 0.5) for size in (4, 2))
    apply = NUMEL / 2 * 14 / 1e12
    assert r.optimizer_step_seconds == pytest.approx(a2a + COMPUTE + back + apply, rel=1e-12)
    assert r.step_compute_seconds == pytest.approx(COMPUTE + apply, rel=1e-12)
    assert r.step_bytes_per_rank == NUMEL / 2 * 4  # the holder's fp32 gradient; the host sends half that back
    fp32 = simulate([matrix(tp_size=2)], strategy="canzona", cluster=cluster(gpu={**TOY["gpu"], "optimizer_dtype": "fp32"}),
                    dp_size=1, tp_size=2, wire=WIRE)
    compute32 = muon_flops(M, N) / (10e12 * 0.5) + 12 * NUMEL / 1e12
    assert fp32.optimizer_step_seconds == pytest.approx(2 * a2a + compute32 + apply, rel=1e-12)
    assert r.grad_reduce_seconds == 0.0 and r.param_gather_seconds == 0.0  # DP 1: nothing to reduce


def test_inter_node_link_when_the_tp_group_spans_nodes():
    r = simulate([matrix(tp_size=2)], strategy="canzona", cluster=cluster(gpus_per_node=1), dp_size=1, tp_size=2,
                 wire=WIRE)
    a2a, back = (20e-6 + NUMEL / 2 * size / (10e9 * 0.5) for size in (4, 2))  # the bf16 direction back
    assert r.optimizer_step_seconds == pytest.approx(a2a + back + COMPUTE + NUMEL / 2 * 14 / 1e12, rel=1e-12)


def layout(spec: ParamSpec, dp_size: int = 1):
    """A whole-matrix DP layout standing in for Megatron's layer-wise one (needs no Megatron)."""
    return plan_zero1([spec], dp_size=dp_size, cost_model=CostModel(), bucket_size=None)


def test_duplicated_and_layer_sharded_tp_modes():
    """Megatron's duplicated mode: a ring all-gather of the whole fp32 matrix over TP, then
    both TP ranks compute it; layer_sharded: one home, a fused all-to-all each way."""
    spec = matrix(tp_size=2)
    apply = NUMEL / 2 * 14 / 1e12
    dup = simulate([spec], strategy="megatron_layerwise", cluster=cluster(), dp_size=1, tp_size=2, wire=WIRE,
                   plan=layout(spec))
    ring = 10e-6 + 0.5 * NUMEL * 4 / 100e9
    assert dup.optimizer_step_seconds == pytest.approx(ring + COMPUTE + apply, rel=1e-12)
    homed = simulate([spec], strategy="layer_sharded", cluster=cluster(), dp_size=1, tp_size=2, wire=WIRE,
                     plan=layout(spec))
    a2a = 10e-6 + NUMEL / 2 * 4 / (100e9 * 0.5)
    assert homed.optimizer_step_seconds == pytest.approx(2 * a2a + COMPUTE + apply, rel=1e-12)


def test_blockwise_and_distributed_tp_modes():
    """Megatron's default ``blockwise``: each TP rank orthogonalises its own (M/2) × N slice, nothing
    moves; ``distributed``: each TP rank its slice of the whole matrix's Newton-Schulz (the N × N
    products on both), one all-reduce (ring reduce-scatter and all-gather) of the bf16 N × N Gram
    matrix a step. Muon's only."""
    spec = matrix(tp_size=2)
    apply = NUMEL / 2 * 14 / 1e12
    momentum = 12 * NUMEL / 2 / 1e12
    block = simulate([spec], strategy="megatron_tp_blockwise", cluster=cluster(), dp_size=1, tp_size=2, wire=WIRE,
                     plan=layout(spec))
    assert block.optimizer_step_seconds == pytest.approx(muon_flops(M // 2, N) / 50e12 + momentum + apply, rel=1e-12)
    assert block.step_bytes_per_rank == 0.0
    dist = simulate([spec], strategy="megatron_tp_distributed", cluster=cluster(), dp_size=1, tp_size=2, wire=WIRE,
                    plan=layout(spec))
    a, b = min(M, N), max(M, N)  # the TP-split side (M rows) is the short one here: the Gram matrix is N × N
    assert sharded_ns_flops(M, N, 2) == 5 * (4 * N * N * M / 2 + 2 * N**3)
    all_reduce = 2 * (10e-6 + 0.5 * N * N * 2 / 100e9)
    assert dist.optimizer_step_seconds == pytest.approx(
        5 * all_reduce + sharded_ns_flops(M, N, 2) / 50e12 + momentum + apply, rel=1e-12)
    assert dist.step_bytes_per_rank == 5 * 2 * 0.5 * N * N * 2
    assert sharded_ns_flops(N, M, 1) == ns_flops(M, N) == muon_flops(a, b)  # one shard, long side split: the whole
    tall = ParamSpec(name="w", global_shape=(N, M), tp_dim=0, tp_size=2)  # the long side split: the small Gram
    dist = simulate([tall], strategy="megatron_tp_distributed", cluster=cluster(), dp_size=1, tp_size=2, wire=WIRE,
                    plan=layout(tall))
    assert dist.step_bytes_per_rank == 5 * 2 * 0.5 * M * M * 2
    assert sharded_ns_flops(N, M, 2) < muon_flops(N, M)
    for method in ("standard", "gram"):
        assert sharded_ns_flops(N, M, 1, method=method) == ns_flops(N, M, method=method)
    assert (gram_reductions(), gram_reductions(method="gram"), gram_reductions(method="gram", dtype="float32")) == (5, 3, 1)
    with pytest.raises(ValueError, match="Muon's"):
        simulate([spec], strategy="megatron_tp_blockwise", cluster=cluster(), dp_size=1, tp_size=2, wire=WIRE,
                 plan=layout(spec), optimizer="shampoo")


def test_sync_all_reduces_and_every_rank_computes():
    r = simulate([matrix()], strategy="sync", cluster=cluster(), dp_size=2, wire=WIRE)
    assert r.grad_reduce_seconds == pytest.approx(2 * (10e-6 + 0.5 * NUMEL * 4 / 100e9), rel=1e-12)
    assert r.param_gather_seconds == 0.0
    assert r.optimizer_step_seconds == pytest.approx(COMPUTE + NUMEL * 14 / 1e12, rel=1e-12)


def test_adamw_is_memory_bound_on_each_shard():
    r = simulate([matrix()], strategy="adamw", cluster=cluster(), dp_size=2, wire=WIRE)
    assert r.optimizer_step_seconds == pytest.approx(NUMEL / 2 * 30 / 1e12, rel=1e-12)


def test_calibration_replaces_the_formula():
    calibration = Calibration(optimizer="muon", seconds={(M, N): 0.25})
    r = simulate([matrix()], strategy="canzona", cluster=cluster(), dp_size=1, calibration=calibration, wire=WIRE)
    assert r.optimizer_step_seconds == pytest.approx(0.25 + NUMEL * 14 / 1e12, rel=1e-12)


def test_fewer_compute_slots_than_ranks_slow_compute_down():
    base = simulate([matrix()], strategy="sync", cluster=cluster(), dp_size=2, wire=WIRE)
    shared = simulate([matrix()], strategy="sync", cluster=cluster(compute_slots=1), dp_size=2, wire=WIRE)
    assert shared.optimizer_step_seconds == pytest.approx(2 * base.optimizer_step_seconds, rel=1e-12)


def test_forward_backward_microbatches_and_pipeline_bubble():
    work = Workload(global_batch=8, micro_batch=2, seq_length=16, flops_per_token=1e9)
    r = simulate([matrix()], strategy="adamw", cluster=cluster(), dp_size=2, pp_size=3, workload=work, wire=WIRE)
    micro = 1e9 * 2 * 16 / (100e12 * 0.5)
    assert r.details["microbatches"] == 2
    assert r.forward_backward_seconds == pytest.approx(2 * micro, rel=1e-12)
    assert r.bubble_seconds == pytest.approx(2 * micro, rel=1e-12)


def test_reduction_hides_behind_a_long_backward():
    work = Workload(global_batch=2, micro_batch=1, seq_length=4096, flops_per_token=1e12)
    r = simulate([matrix()], strategy="zero1", cluster=cluster(), dp_size=2, workload=work, wire=WIRE)
    # One bucket, ready when backward ends (its only matrix is the last gradient of none
    # other): the reduce-scatter runs after backward, the all-gather before the forward.
    assert r.grad_reduce_exposed_seconds == pytest.approx(r.grad_reduce_seconds, rel=1e-12)
    two = [matrix(name="a", order=0), matrix(name="b", order=1)]
    r2 = simulate(two, strategy="zero1", cluster=cluster(), dp_size=2, workload=work, wire=WIRE, bucket_size=NUMEL)
    assert r2.grad_reduce_exposed_seconds < r2.grad_reduce_seconds  # the first bucket overlapped backward


def test_early_gathers_go_in_backward_on_nccl_and_once_it_ends_on_gloo():
    """Canzona's dense gathers are issued as their buckets reduce: on NCCL during backward
    (from the step's start, negative times), on gloo only once backward has ended; either
    way no later than in the step, so the step is no longer."""
    specs = [matrix(tp_size=2, name=f"w{i}", order=i) for i in range(8)]  # two per host: two micro-groups
    work = Workload(global_batch=2, micro_batch=1, seq_length=4096, flops_per_token=1e10)
    kwargs = dict(strategy="canzona", dp_size=2, tp_size=2, workload=work, wire=WIRE, bucket_size=NUMEL // 2)
    nccl, gloo = simulate(specs, cluster=cluster(), **kwargs), simulate(specs, cluster=cluster(backend="gloo"), **kwargs)
    late = simulate(specs, cluster=cluster(), overlap=False, **kwargs)
    assert nccl.details["early_gather"] and not late.details["early_gather"]
    for r in (nccl, gloo):
        origin = r.iteration_seconds - r.optimizer_step_seconds
        starts = [s.start - origin for s in r.timeline if s.kind == "gather"]
        backward_end = -r.grad_reduce_exposed_seconds
        assert starts and r.grad_reduce_exposed_seconds < r.grad_reduce_seconds  # buckets reduce in backward
        if r is nccl:
            assert min(starts) < backward_end  # a gather went while backward ran
        else:
            assert min(starts) >= backward_end - 1e-12
    assert nccl.optimizer_step_seconds <= gloo.optimizer_step_seconds * (1 + 1e-12)
    assert gloo.optimizer_step_seconds < late.optimizer_step_seconds


def test_early_compute_runs_once_gathered_and_commits_at_the_step():
    """Speculative early compute: each micro-group computed once its gather has landed and
    backward is over, in the reduce-scatters' tail; its scatter and apply wait for the step
    (the norm). It never lengthens the step, and it shortens this one."""
    specs = [matrix(tp_size=2, name=f"w{i}", order=i) for i in range(8)]
    work = Workload(global_batch=2, micro_batch=1, seq_length=4096, flops_per_token=1e10)
    kwargs = dict(strategy="canzona", dp_size=2, tp_size=2, workload=work, wire=WIRE, bucket_size=NUMEL // 2,
                  cluster=cluster())
    today = simulate(specs, **kwargs)
    early = simulate(specs, early_compute=True, **kwargs)
    assert early.details["early_compute"] and not today.details.get("early_compute")
    assert early.optimizer_step_seconds < today.optimizer_step_seconds
    origin = early.iteration_seconds - early.optimizer_step_seconds
    assert min(s.start for s in early.timeline if s.kind == "scatter") >= origin - 1e-12  # commits at the step
    assert min(s.start for s in early.timeline if s.kind == "compute") < origin  # computed before it
    with pytest.raises(ValueError, match="clip_rate"):
        simulate(specs, early_compute=True, clip_rate=1.5, **kwargs)


def test_early_compute_waits_for_the_end_of_backward():
    """The runtime computes nothing beside backward's GEMMs: a group whose buckets reduce (and
    whose gather lands) mid-backward is computed only once backward is over, from its end."""
    specs = [matrix(tp_size=2, name=f"w{i}", order=i) for i in range(8)]
    work = Workload(global_batch=2, micro_batch=1, seq_length=4096, flops_per_token=1e10)
    r = simulate(specs, strategy="canzona", dp_size=2, tp_size=2, workload=work, wire=WIRE, bucket_size=NUMEL // 2,
                 cluster=cluster(), early_compute=True)
    origin = r.iteration_seconds - r.optimizer_step_seconds
    backward_end = origin - r.grad_reduce_exposed_seconds
    gathers = [s for s in r.timeline if s.kind == "gather"]
    assert gathers and min(s.end for s in gathers) < backward_end  # a group landed mid-backward
    computes = [s for s in r.timeline if s.kind == "compute"]
    assert computes and min(s.start for s in computes) >= backward_end - 1e-12
    assert min(s.start for s in computes) < origin  # and still went before the step, in the tail
    assert min(s.start for s in computes) == pytest.approx(backward_end, abs=1e-12)  # at once when backward ends


def test_clip_rate_prices_the_speculation_policy():
    """``clip_rate`` is the chance the clip acts in an iteration; the step is priced as the
    runtime's policy decides: committed · early step + the rest · the step without early
    compute. A clip that always acts commits nothing (today's step); one that never acts
    commits every iteration (the early step); the shares go to the details."""
    from megatron.canzona.planning.speculation import expected_rates

    specs = [matrix(tp_size=2, name=f"w{i}", order=i) for i in range(8)]
    work = Workload(global_batch=2, micro_batch=1, seq_length=4096, flops_per_token=1e10)
    kwargs = dict(strategy="canzona", dp_size=2, tp_size=2, workload=work, wire=WIRE, bucket_size=NUMEL // 2,
                  cluster=cluster())
    today = simulate(specs, **kwargs)
    never, half, always = (simulate(specs, early_compute=True, clip_rate=c, **kwargs) for c in (0.0, 0.5, 1.0))
    assert never.optimizer_step_seconds < today.optimizer_step_seconds
    assert never.details["speculation"] == {"committed": 1.0, "recomputed": 0.0, "not_speculated": 0.0}
    assert always.details["speculation"]["committed"] == 0.0
    assert always.optimizer_step_seconds == pytest.approx(today.optimizer_step_seconds, rel=1e-12)
    rates = expected_rates(0.5)
    assert half.details["speculation"] == pytest.approx(
        {"committed": rates.committed, "recomputed": rates.recomputed, "not_speculated": rates.not_speculated})
    assert sum(half.details["speculation"].values()) == pytest.approx(1.0)
    assert half.details["clip_rate"] == 0.5
    assert half.optimizer_step_seconds == pytest.approx(
        rates.committed * never.optimizer_step_seconds + (1 - rates.committed) * today.optimizer_step_seconds,
        rel=1e-12)
    # backing off after failures, the policy commits fewer than the 1 - clip_rate an every-iteration speculation did
    assert rates.committed < 0.5


def test_matrices_reduced_first_hold_back_only_dense_buckets_without_a_matrix():
    """``--canzona-matrices-reduce-first``: a dense bucket without a matrix that is ready before
    the last dense matrix bucket (the output layer's) is reduced right after it, in its order;
    one ready after it (the embedding's) and the expert buffers' (their own group) stay."""
    from megatron.canzona.planning.sim.iteration import BucketSync, reduced_at
    from megatron.canzona.planning.sim.simulate import matrices_reduced_first

    reduce = [BucketSync(1.0, 0.1, "out"), BucketSync(1.0, 0.5, "m0", key=(0, 0)), BucketSync(1.0, 0.2, "norms"),
              BucketSync(1.0, 0.9, "m1", key=(0, 1)), BucketSync(1.0, 1.0, "emb"), BucketSync(1.0, 0.05, "expert")]
    moved = matrices_reduced_first(reduce, dense=5)
    order = [b.label for b in sorted(moved, key=lambda b: b.ready)]
    assert order == ["expert", "m0", "m1", "out", "norms", "emb"]
    assert reduced_at(moved, 1.0)[(0, 1)] < reduced_at(reduce, 1.0)[(0, 1)]  # the last matrices land earlier
    assert matrices_reduced_first(reduce[:1]) == reduce[:1]  # no matrix bucket: nothing to hold for


def test_early_gathers_share_the_inter_node_links_with_the_reductions_after_them():
    """A gather issued when its last bucket reduces lengthens the next reduction by its
    heaviest rank's inter-node seconds (summed per rank over gathers), less the idle time the
    reductions leave before it; one released by the last reduction charges nothing (the step
    holds it)."""
    from megatron.canzona.planning.sim.iteration import BucketSync, Rider, overlap_backward, reduced_at

    a, b, c = BucketSync(1.0, 0.1, "a", key="a"), BucketSync(1.0, 0.2, "b", key="b"), BucketSync(1.0, 0.5, "c", key="c")
    riders = [Rider(frozenset({"a"}), {0: 0.3, 1: 0.1}), Rider(frozenset({"a"}), {0: 0.2}),
              Rider(frozenset({"a", "c"}), {0: 9.0})]
    plain = reduced_at([a, b, c], 10.0)
    ends = reduced_at([a, b, c], 10.0, riders)
    assert plain == {"a": -8.0, "b": -7.0, "c": -4.0}
    assert ends == {"a": -8.0, "b": -6.5, "c": -4.0}  # b: rank 0's 0.5 s; the rider on c goes in the step
    exposed, segments = overlap_backward([a, BucketSync(1.0, 0.22, "b", key="b")], 10.0, riders=riders)
    assert exposed == 0.0 and [s.end for s in segments] == pytest.approx([2.0, 3.5])  # 0.2 s idle of 0.5: 0.3


def test_lean_gathers_across_nodes_lengthen_the_reduce_scatter_tail():
    """Qwen3-32B, TP 8 x DP 8 on h100-ib400: the lean layout's early gathers cross nodes (its DP
    neighbours are a node apart) and lengthen the reduce-scatters' tail against the same plan
    without early gathers (no overlap); the whole layout's stay in the node (TP): no change."""
    from megatron.canzona.planning import qwen3_specs

    specs = qwen3_specs("qwen3-32b", tp_size=8, split_qkv=True)
    work = Workload(global_batch=128, micro_batch=1, seq_length=4096)
    kwargs = dict(cluster=load_cluster("h100-ib400"), dp_size=8, tp_size=8, workload=work, wire=WireConfig(grad_bytes=4))
    for strategy in ("canzona_lean", "canzona"):
        early, late = (simulate(specs, strategy=strategy, overlap=o, **kwargs) for o in (True, False))
        assert early.details["early_gather"] and not late.details["early_gather"]
        if strategy == "canzona":
            assert early.grad_reduce_exposed_seconds == late.grad_reduce_exposed_seconds
        else:
            assert early.grad_reduce_exposed_seconds > late.grad_reduce_exposed_seconds + 0.01


def test_matrices_reduced_first_shorten_the_qwen3_14b_step_at_256_gpus():
    """Qwen3-14B, TP 4 x DP 64 on h100-ib400, early compute: with the output layer's reduce-scatter
    after the matrices', the last matrices' Newton-Schulz runs beside it and the embedding's
    instead of after the tail (docs/projection.md); without early compute it changes nothing."""
    from megatron.canzona.planning import qwen3_specs

    specs = qwen3_specs("qwen3-14b", tp_size=4, split_qkv=True)
    work = Workload(global_batch=128, micro_batch=1, seq_length=4096)
    kwargs = dict(strategy="canzona", cluster=load_cluster("h100-ib400"), dp_size=64, tp_size=4, workload=work,
                  wire=WireConfig(grad_bytes=4))
    backward, first = (simulate(specs, early_compute=True, matrices_first=m, **kwargs) for m in (False, True))
    assert first.optimizer_step_seconds < 0.5 * backward.optimizer_step_seconds
    assert first.iteration_seconds < backward.iteration_seconds
    assert first.details["matrices_first"] and not backward.details["matrices_first"]
    plain = simulate(specs, matrices_first=True, **kwargs)
    assert plain.iteration_seconds == simulate(specs, **kwargs).iteration_seconds


def test_early_compute_inline_on_gloo_leaves_the_step_only_its_commit():
    """gloo with the gathers forced to the reduce-scatters' dispatch (bench_step's canzona_early):
    the host waits there and computes each landed group inside backward, so nothing of the
    reduce-scatters is exposed and every group is computed before the step; the step keeps the
    scatters and applies, less than the step that computes them."""
    specs = [matrix(tp_size=2, name=f"w{i}", order=i) for i in range(8)]
    work = Workload(global_batch=2, micro_batch=1, seq_length=4096, flops_per_token=1e10)
    kwargs = dict(strategy="canzona", dp_size=2, tp_size=2, workload=work, wire=WIRE, bucket_size=NUMEL // 2,
                  cluster=cluster(backend="gloo"), early_compute=True)
    queued, inline = simulate(specs, **kwargs), simulate(specs, early_inline=True, **kwargs)
    assert inline.grad_reduce_exposed_seconds == 0.0 < queued.grad_reduce_exposed_seconds
    origin = inline.iteration_seconds - inline.optimizer_step_seconds
    computes = [seg for seg in inline.timeline if seg.kind == "compute"]
    assert computes and all(seg.end < origin for seg in computes)
    assert inline.optimizer_step_seconds < simulate(specs, **{**kwargs, "early_compute": False}).optimizer_step_seconds
    assert inline.details["early_inline"] and not queued.details["early_inline"]


def test_early_compute_keeps_to_each_ranks_memory_budget():
    """Each rank computes early only the micro-groups that fit ``early_compute_bytes`` (what the
    runtime picks: in the order their last bucket reduces), the others in the step: no budget
    gives the step back as without early compute, a budget of two matrices lies in between. (A
    slow link: the reduce-scatters' tail after backward, where early compute runs, must hold
    more than two matrices' compute for the budget to show.)"""
    specs = [matrix(name=f"w{i}", order=i) for i in range(16)]
    work = Workload(global_batch=2, micro_batch=1, seq_length=4096, flops_per_token=1e10)
    kwargs = dict(strategy="canzona", dp_size=2, tp_size=1, workload=work, wire=WIRE, bucket_size=NUMEL // 2,
                  cluster=cluster(intra_node={"bandwidth_gb_per_s": 1.0, "latency_us": 10.0}))
    today = simulate(specs, **kwargs)
    unbounded = simulate(specs, early_compute=True, early_compute_bytes=None, **kwargs)
    none = simulate(specs, early_compute=True, early_compute_bytes=0, **kwargs)
    two = 2 * NUMEL * 2 * 4  # bytes: two matrices' momentum and direction in fp32
    some = simulate(specs, early_compute=True, early_compute_bytes=two, **kwargs)
    assert none.optimizer_step_seconds == pytest.approx(today.optimizer_step_seconds, rel=1e-12)
    assert unbounded.optimizer_step_seconds < some.optimizer_step_seconds < today.optimizer_step_seconds

    def early_groups(result) -> int:  # (rank, group) computed before the step's start
        origin = result.iteration_seconds - result.optimizer_step_seconds
        return sum(s.kind == "compute" and s.start < origin for s in result.timeline)

    assert early_groups(none) == 0 < early_groups(some) < early_groups(unbounded)
    assert unbounded.details["early_compute_bytes"] is None and some.details["early_compute_bytes"] == two


def test_experts_are_computed_early_too_in_the_time_the_dense_work_leaves():
    """The runtime attaches early compute to the expert optimizer as to the dense one: the
    experts' micro-groups go once their buckets reduce (at expert TP 1 nothing moves), in the
    compute time each rank's dense early compute and dense step leave free, never beside them."""
    import dataclasses

    dense = [matrix(name=f"w{i}", order=i) for i in range(4)]
    experts = [dataclasses.replace(matrix(name=f"e{i}", order=4 + i), is_expert=True) for i in range(8)]
    work = Workload(global_batch=4, micro_batch=1, seq_length=4096, flops_per_token=1e10)
    kwargs = dict(strategy="canzona", dp_size=4, tp_size=1, workload=work, wire=WIRE, bucket_size=NUMEL // 2,
                  cluster=cluster())

    def early(result) -> list:  # compute spans before the step's start
        origin = result.iteration_seconds - result.optimizer_step_seconds
        return [s for s in result.timeline if s.kind == "compute" and s.start < origin]

    today = simulate(dense + experts, ep_size=2, **kwargs)
    both = simulate(dense + experts, ep_size=2, early_compute=True, **kwargs)
    alone = simulate(dense, early_compute=True, **kwargs)
    assert both.optimizer_step_seconds < today.optimizer_step_seconds
    assert len(early(both)) > len(early(alone))  # the experts' groups went early as well
    assert simulate(dense + experts, ep_size=2, early_compute=True, clip_rate=1.0,
                    **kwargs).optimizer_step_seconds == pytest.approx(today.optimizer_step_seconds, rel=1e-12)
    for rank in range(4):
        spans = sorted((s.start, s.end) for s in both.timeline if s.rank == rank and s.kind == "compute")
        assert all(end <= start + 1e-15 for (_, end), (start, _) in zip(spans, spans[1:]))


def test_cluster_backend_is_nccl_or_gloo(tmp_path):
    assert load_cluster(write(tmp_path, "c.toml", toml_of(TOY))).backend == "nccl"
    assert ClusterSpec.from_dict({**TOY, "backend": "gloo"}).to_dict()["backend"] == "gloo"
    with pytest.raises(ValueError, match=r"^c.toml: backend must be one of nccl, gloo, got 'mpi'$"):
        ClusterSpec.from_dict({**TOY, "backend": "mpi"}, source="c.toml")


# ----------------------------------------------------------------------------------- properties

shapes = st.tuples(st.sampled_from([64, 128, 192, 256]), st.sampled_from([64, 128, 320, 512]))


@settings(max_examples=25, deadline=None)
@given(st.lists(shapes, min_size=1, max_size=6), st.integers(1, 4), st.sampled_from([1, 2]),
       st.sampled_from([None, 20000, 60000]))
def test_overlap_never_lengthens_the_step(dims, dp_size, tp_size, bucket_size):
    specs = [matrix(tp_size=tp_size, name=f"w{i}", order=i, shape=s) for i, s in enumerate(dims)]
    plan = make_plan(specs, dp_size=dp_size, tp_size=tp_size, bucket_size=bucket_size, wire=WIRE)
    kwargs = dict(strategy="canzona", cluster=cluster(gpus_per_node=2), dp_size=dp_size, tp_size=tp_size, plan=plan,
                  wire=WIRE)
    on, off = simulate(specs, overlap=True, **kwargs), simulate(specs, overlap=False, **kwargs)
    assert on.optimizer_step_seconds <= off.optimizer_step_seconds * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-4, 1e-2), st.integers(1, 10**6)), min_size=1, max_size=12),
       st.integers(1, 6))
def test_adding_a_rank_never_lengthens_a_balanced_step(items, dp_size):
    """Whole matrices on homes from list scheduling (the planner's balanced_homes), each
    costing its update and applying it: one more DP rank never makes the step longer."""
    spec_cluster = cluster()

    def step(ranks: int) -> float:
        run = StepRun(range(ranks), {}, spec_cluster, WIRE)
        apply = [run.elementwise_seconds(n, 14) for _, n in items]
        homes = balanced_homes([s + a for (s, _), a in zip(items, apply)], ranks)
        tasks = [SimTask(f"w{i}", ((h, n),), h, s) for i, ((s, n), h) in enumerate(zip(items, homes))]
        run_host_groups(run, tasks, pipelined=True)
        return run.end

    assert step(dp_size + 1) <= step(dp_size) * (1 + 1e-12)


# ----------------------------------------------------------------------------------- errors


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def toml_of(data: dict) -> str:
    lines = [f"{k} = {json.dumps(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for table, fields in ((k, v) for k, v in data.items() if isinstance(v, dict)):
        lines.append(f"[{table}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("table", "field", "value", "message"), [
    ("gpu", "bf16_tflops", "abc", "h100.toml: gpu.bf16_tflops must be a positive number, got 'abc'"),
    ("gpu", "memory_gb_per_s", -1, "h100.toml: gpu.memory_gb_per_s must be a positive number, got -1"),
    ("gpu", "matmul_efficiency", 1.5, "h100.toml: gpu.matmul_efficiency must be a fraction in (0, 1], got 1.5"),
    ("gpu", "optimizer_dtype", "fp8", "h100.toml: gpu.optimizer_dtype must be one of ('bf16', 'fp32'), got 'fp8'"),
    ("intra_node", "latency_us", "fast", "h100.toml: intra_node.latency_us must be a number >= 0, got 'fast'"),
    ("training", "mfu", 0, "h100.toml: training.mfu must be a positive number, got 0"),
])
def test_bad_cluster_file_names_the_field(tmp_path, table, field, value, message):
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in TOY.items()}
    data[table][field] = value
    with pytest.raises(ValueError) as err:
        load_cluster(write(tmp_path, "h100.toml", toml_of(data)))
    assert str(err.value) == message


def test_cluster_file_structure_errors(tmp_path):
    data = {k: v for k, v in TOY.items() if k != "gpu"}
    with pytest.raises(ValueError, match=r"^c\.toml: missing \[gpu\] table"):
        load_cluster(write(tmp_path, "c.toml", toml_of(data)))
    with pytest.raises(ValueError, match=r"^c\.toml: gpus_per_node must be a positive integer, got 0$"):
        load_cluster(write(tmp_path, "c.toml", toml_of({**TOY, "gpus_per_node": 0})))
    with pytest.raises(ValueError, match=r"^bad\.toml: not valid TOML: "):
        load_cluster(write(tmp_path, "bad.toml", "gpu = [\n"))
    with pytest.raises(ValueError, match=r"cannot read it"):
        load_cluster(str(tmp_path / "missing.toml"))
    one_node = ClusterSpec.from_dict({k: v for k, v in TOY.items() if k != "inter_node"} | {"gpus_per_node": 1})
    with pytest.raises(ValueError, match=r"no \[inter_node\] link"):
        simulate([matrix(tp_size=2)], strategy="canzona", cluster=one_node, dp_size=1, tp_size=2)


@pytest.mark.parametrize(("data", "message"), [
    ({"optimizer": "muon", "timings": [{"m": 4, "n": 4, "seconds": "x"}]},
     "muon.json: timings[0].seconds must be a positive number, got 'x'"),
    ({"optimizer": "muon", "timings": [{"m": 4, "seconds": 1.0}]},
     "muon.json: timings[0].n must be a positive integer, got None"),
    ({"optimizer": "adam", "timings": [{"m": 4, "n": 4, "seconds": 1.0}]},
     "muon.json: optimizer must be one of muon, shampoo, soap, got 'adam'"),
    ({"optimizer": "muon", "timings": []},
     "muon.json: timings must be a non-empty list of {m, n, seconds}, got []"),
    ({"optimizer": "muon", "ns_method": "fast", "timings": [{"m": 4, "n": 4, "seconds": 1.0}]},
     "muon.json: ns_method must be one of standard, gram, auto (or absent), got 'fast'"),
])
def test_bad_calibration_file_names_the_field(tmp_path, data, message):
    with pytest.raises(ValueError) as err:
        load_calibration(write(tmp_path, "muon.json", json.dumps(data)))
    assert str(err.value) == message and "\n" not in str(err.value)


def test_calibration_file_round_trip(tmp_path):
    calibration = Calibration(optimizer="soap", seconds={(8, 16): 0.5, (16, 16): 1.5})
    assert load_calibration(write(tmp_path, "soap.json", calibration.to_json())) == calibration


def test_a_calibration_is_used_only_with_the_newton_schulz_method_it_measured(tmp_path):
    """Gram and standard Newton-Schulz cost differently: a projection with one method refuses
    timings of the other (a calibration that does not say, from before it was recorded, is taken)."""
    gram = load_calibration(write(tmp_path, "gram.json", Calibration(
        optimizer="muon", seconds={(8, 16): 0.25}, ns_method="gram").to_json()))
    assert gram.ns_method == "gram"
    assert CostModel(kind="muon", ns_method="gram", calibration=gram).calibration is gram
    with pytest.raises(ValueError) as err:
        CostModel(kind="muon", ns_method="standard", calibration=gram)
    assert str(err.value) == (
        "the calibration's Muon timings were measured with --muon-ns-method gram, this cost model uses standard: "
        "project with --muon-ns-method gram, or measure standard with tools/bench_optim.py --muon-ns-method "
        "standard --calibrate FILE")
    unrecorded = Calibration(optimizer="muon", seconds={(8, 16): 0.25})
    assert CostModel(kind="muon", ns_method="auto", calibration=unrecorded).calibration is unrecorded


def test_calibrate_file_picks_the_newton_schulz_method(tmp_path):
    """``bench_optim --calibrate`` with standard and gram keeps Muon's timings of each method (and
    auto's) under ``muon_methods``; ``ns_method`` picks one there, else the cost model names the gap."""
    def entry(method, seconds):
        return {"optimizer": "muon", "ns_method": method, "timings": [{"m": 8, "n": 16, "seconds": seconds}]}
    methods = {"standard": entry("standard", 0.5), "gram": entry("gram", 0.25), "auto": entry("auto", 0.25)}
    path = write(tmp_path, "calib.json", json.dumps({**methods["standard"], "optimizers": {"muon": methods["standard"]},
                                                     "muon_methods": methods}))
    assert load_calibration(path).ns_method == "standard"
    for method, seconds in (("standard", 0.5), ("gram", 0.25), ("auto", 0.25)):
        picked = load_calibration(path, "muon", method)
        assert (picked.ns_method, picked.seconds) == (method, {(8, 16): seconds})
        assert CostModel(kind="muon", ns_method=method, calibration=picked).calibration is picked
    only_standard = write(tmp_path, "standard.json", json.dumps(methods["standard"]))
    with pytest.raises(ValueError, match="measured with --muon-ns-method standard, this cost model uses auto"):
        CostModel(kind="muon", ns_method="auto", calibration=load_calibration(only_standard, "muon", "auto"))


def test_calibrate_file_picks_the_optimizer(tmp_path):
    """``bench_optim --calibrate`` keeps every optimizer under ``optimizers``; the first is the top level."""
    muon = {"optimizer": "muon", "timings": [{"m": 8, "n": 16, "seconds": 0.25}]}
    soap = {"optimizer": "soap", "timings": [{"m": 8, "n": 16, "seconds": 2.0}]}
    path = write(tmp_path, "calib.json", json.dumps({**muon, "optimizers": {"muon": muon, "soap": soap}}))
    assert load_calibration(path).seconds == {(8, 16): 0.25}
    assert load_calibration(path, "muon").seconds == {(8, 16): 0.25}
    assert load_calibration(path, "soap") == Calibration(optimizer="soap", seconds={(8, 16): 2.0})
    with pytest.raises(ValueError) as err:
        load_calibration(path, "shampoo")
    assert str(err.value) == ("calib.json: optimizers has no 'shampoo' calibration (it has muon, soap); measure it "
                              "with tools/bench_optim.py --optimizer shampoo --calibrate FILE")


def test_bad_arguments_say_how_to_fix_them():
    with pytest.raises(ValueError, match="unknown strategy 'fast'; choose one of"):
        simulate([matrix()], strategy="fast", cluster=cluster(), dp_size=1)
    with pytest.raises(ValueError, match="plan_megatron_layerwise"):
        simulate([matrix()], strategy="megatron_layerwise", cluster=cluster(), dp_size=1)
    with pytest.raises(ValueError, match=r"pass --global-batch 6"):
        simulate([matrix()], strategy="adamw", cluster=cluster(), dp_size=3, workload=Workload(global_batch=4))


def test_presets_load_and_round_trip():
    for path in sorted((ROOT / "megatron" / "canzona" / "planning" / "sim" / "clusters").glob("*.toml")):
        spec = load_cluster(str(path))
        assert spec.name == path.stem
        assert ClusterSpec.from_dict(spec.to_dict(), source=path.name) == spec


# ----------------------------------------------------------------------------------- CLI


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import simulate as cli  # tools/simulate.py
    finally:
        sys.path.remove(str(ROOT / "tools"))
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_has_every_strategy_field(capsys, tmp_path):
    png = tmp_path / "gantt.png"
    code, out, _ = run_cli(["--model", "qwen3-tiny", "--gpus", "4", "--tp", "2", "--json", "--strategies", "canzona",
                            "sync", "zero1", "adamw", "--plot", str(png), "--plot-strategies", "canzona", "sync"],
                           capsys)
    assert code == 0
    report = json.loads(out)
    assert report["config"]["dp"] == 2 and report["config"]["seq_length"] == 64  # the CPU recipe's batch
    assert set(report["strategies"]) == {"canzona", "sync", "zero1", "adamw"}
    for record in report["strategies"].values():
        for key in ("optimizer_step_seconds", "iteration_seconds", "exposed_comm_seconds", "step_ratio_to_canzona",
                    "iteration_ratio_to_canzona"):
            assert isinstance(record[key], float) and record[key] >= 0
    assert report["strategies"]["canzona"]["step_ratio_to_canzona"] == 1.0
    assert png.stat().st_size > 0


def test_cli_reports_both_layouts_against_the_physical_limit(capsys):
    """No strategy's step beats the limit (work spread perfectly, no communication); the whole
    layout moves nothing over DP in the step, so it is never slower there than the lean one."""
    code, out, _ = run_cli(["--model", "qwen3-1.7b", "--gpus", "64", "--json", "--strategies", "canzona",
                            "canzona_lean", "megatron_layerwise"], capsys)
    assert code == 0
    report = json.loads(out)
    limit = report["physical_limit_seconds"]
    assert limit > 0
    steps = {name: r["optimizer_step_seconds"] for name, r in report["strategies"].items()}
    assert all(step >= limit * (1 - 1e-9) for step in steps.values()), (limit, steps)
    assert steps["canzona"] <= steps["canzona_lean"]
    assert report["strategies"]["canzona"]["step_over_limit"] == pytest.approx(steps["canzona"] / limit)


def test_under_pipeline_parallelism_each_step_is_set_against_its_own_stages_limit(capsys):
    """Qwen3-235B-A22B at PP 8 x expert TP 2: the middle stages hold more matrix work than the last,
    whose iteration is the slowest. A step is set against the limit of the stage it was taken on,
    so no step reads below its limit (against the largest stage's limit Canzona read 0.94)."""
    code, out, _ = run_cli(["--model", "qwen3-235b-a22b", "--gpus", "256", "--etp", "2", "--json",
                            "--strategies", "canzona", "canzona_lean"], capsys)
    assert code == 0
    report = json.loads(out)
    stages = report["physical_limit_seconds_by_stage"]
    assert len(stages) == 8 and len(set(stages)) > 1
    assert report["physical_limit_seconds"] == stages[report["strategies"]["canzona"]["pipeline_stage"]]
    assert report["physical_limit_seconds"] < max(stages)
    for name, record in report["strategies"].items():
        limit = stages[record["pipeline_stage"]]
        assert record["optimizer_step_seconds"] >= limit * (1 - 1e-9), name
        assert record["step_over_limit"] == pytest.approx(record["optimizer_step_seconds"] / limit)
    assert report["strategies"]["canzona"]["step_over_limit"] <= 1.10


def test_cli_split_gate_up_hosts_gate_and_up_apart_for_canzona_only(capsys):
    """``--split-gate-up``: Canzona's largest task halves, so at TP 2 and DP 64, where that
    task sets the limit, its limit and step fall; Megatron's layer-wise optimizer keeps the
    fused fc1 and its step is unchanged."""
    argv = ["--model", "qwen3-1.7b", "--gpus", "128", "--tp", "2", "--json", "--strategies", "canzona",
            "megatron_layerwise"]
    reports = []
    for extra in ([], ["--split-gate-up"]):
        code, out, _ = run_cli(argv + extra, capsys)
        assert code == 0
        reports.append(json.loads(out))
    fused, split = reports
    assert split["config"]["split_gate_up"] and not fused["config"]["split_gate_up"]
    assert split["physical_limit_seconds"] < fused["physical_limit_seconds"]
    step = lambda r, name: r["strategies"][name]["optimizer_step_seconds"]  # noqa: E731
    assert step(split, "canzona") < step(fused, "canzona")
    assert step(split, "megatron_layerwise") == step(fused, "megatron_layerwise")


def test_cli_errors_are_one_line(capsys, tmp_path):
    bad = write(tmp_path, "h100.toml", toml_of({**TOY, "gpu": {**TOY["gpu"], "bf16_tflops": "abc"}}))
    code, _, err = run_cli(["--model", "qwen3-tiny", "--gpus", "4", "--cluster", bad], capsys)
    assert code == 2
    assert err == "simulate.py: error: h100.toml: gpu.bf16_tflops must be a positive number, got 'abc'\n"
    code, _, err = run_cli(["--model", "qwen3-tiny", "--gpus", "3", "--tp", "2"], capsys)
    assert code == 2 and "pass a multiple of 2" in err and err.count("\n") == 1
    code, _, err = run_cli(["--model", "qwen3-tiny", "--gpus", "4", "--cluster", "h900"], capsys)
    assert code == 2 and "h100-ib400" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as stopped:  # argparse's own error
        run_cli(["--model", "qwen3-tiny", "--gpus", "4", "--matrices-reduce-first", "on"], capsys)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after argparse's usage
    assert stopped.value.code == 2 and ": error: --matrices-reduce-first on" in last and "add --early-compute" in last


def test_cli_prints_the_speculation_shares_with_the_clip_rate(capsys):
    """``--early-compute --clip-rate``: the policy's shares the step is priced with, in the text
    report and in the JSON's config; ``--early-efficiency`` is gone (nothing runs beside backward)."""
    from megatron.canzona.planning.speculation import expected_rates

    argv = ["--model", "qwen3-tiny", "--gpus", "4", "--strategies", "canzona", "--early-compute", "--clip-rate", "0.5"]
    code, out, _ = run_cli(argv, capsys)
    rates = expected_rates(0.5)
    assert code == 0 and "early compute at clip rate 0.5" in out and f"commits {rates.committed:.1%}" in out
    code, out, _ = run_cli([*argv, "--json"], capsys)
    config = json.loads(out)["config"]
    assert code == 0 and config["clip_rate"] == 0.5
    assert config["speculation"] == pytest.approx(
        {"committed": rates.committed, "recomputed": rates.recomputed, "not_speculated": rates.not_speculated})
    with pytest.raises(SystemExit):
        run_cli([*argv, "--early-efficiency", "1"], capsys)


def test_layering_allows_the_simulator():
    """The simulator is part of the pure planning layer (tests/unit/test_layering.py checks it)."""
    assert (ROOT / "megatron" / "canzona" / "planning" / "sim" / "simulate.py").exists()
    assert "torch" not in open(os.path.join(ROOT, "megatron", "canzona", "planning", "sim", "step.py")).read()


# ------------------------------------------------------------ unequal shards, as NCCL runs them


def test_unequal_shards_are_priced_as_nccl_groups_them():
    """A bucket of shards of different sizes is a group of ring reduces (broadcasts), one per
    non-empty shard: the ring fills once and each further call adds a step; a rank whose shard
    is empty forwards every other shard, so the bytes are the bucket's, not (p - 1)/p of it."""
    from megatron.canzona.planning.sim.network import Topology, grouped_ring_seconds

    toy = cluster()
    link = toy.intra_node
    shards = [4000.0, 0.0, 1000.0, 3000.0]
    pipelined = (4 - 1 + 3 - 1) * 10e-6 + 8000.0 / 100e9
    assert grouped_ring_seconds(shards, link, 1.0) == pytest.approx(pipelined, rel=1e-12)
    assert grouped_ring_seconds(shards, link, 1.0, pipelined=False) == pytest.approx(
        3 * 3 * 10e-6 + 8000.0 / 100e9, rel=1e-12)
    assert grouped_ring_seconds([0.0] * 4, link, 1.0) == 0.0
    topology = Topology(toy)
    even = topology.ring(8000.0, [0, 1, 2, 3])
    assert even == pytest.approx(3 * 10e-6 + 0.75 * 8000.0 / 100e9, rel=1e-12)
    assert topology.grouped(shards, [0, 1, 2, 3]) > even  # what the whole layout pays for its shards


def test_whole_layout_buckets_pay_for_their_unequal_shards():
    """The simulator prices each whole-layout bucket from its shard bounds: the same matrices
    reduce-scatter slower in the whole layout's unequal shards than in equal ones."""
    specs = [matrix(name=f"w{i}", order=i) for i in range(3)]
    whole = make_plan(specs, dp_size=4, cost_model=CostModel(kind="muon"), layout="whole", bucket_size=10**9, wire=WIRE)
    bucket = whole.layouts[0].matrix.buckets[0]
    assert not bucket.uniform
    r = simulate(specs, strategy="canzona", cluster=cluster(), dp_size=4, wire=WIRE, plan=whole)
    sizes = [(b - a) * 4 for a, b in zip(bucket.shard_bounds, bucket.shard_bounds[1:])]
    k = sum(s > 0 for s in sizes)
    assert r.grad_reduce_seconds == pytest.approx((3 + k - 1) * 10e-6 + sum(sizes) / 100e9, rel=1e-12)


def test_context_parallel_projects_over_dp_x_cp(capsys):
    """Qwen3-8B at 32K tokens, TP 2 x CP 4 on 64 GPUs (the long-context recipe): DP 8, the
    optimizer and the bucket collectives over DP x CP = 32 ranks, 4 micro-batches of 8192
    tokens per GPU; Canzona's projected step at or below every peer's, which plan over DP x CP
    too (Megatron's layer-wise Muon shards over dp_cp)."""
    code, out, _ = run_cli(["--model", "qwen3-8b", "--gpus", "64", "--tp", "2", "--cp", "4", "--seq-length", "32768",
                            "--global-batch", "32", "--json", "--strategies", "canzona", "megatron_layerwise",
                            "layer_sharded", "megatron_main", "adamw"], capsys)
    assert code == 0
    report = json.loads(out)
    config, results = report["config"], report["strategies"]
    assert (config["dp"], config["cp"], config["dp_cp"]) == (8, 4, 32)
    assert results["canzona"]["details"]["microbatches"] == 4
    peers = [results[n]["optimizer_step_seconds"] for n in ("megatron_layerwise", "layer_sharded", "megatron_main")]
    assert results["canzona"]["optimizer_step_seconds"] <= min(peers)
    code, _, err = run_cli(["--model", "qwen3-8b", "--gpus", "64", "--tp", "2", "--cp", "3"], capsys)
    assert code != 0 and "multiple of TP 2 x CP 3 x PP 1" in err


def test_two_optimizer_instances_reduce_within_each_and_all_reduce_across():
    """DP 4 as 2 distributed-optimizer instances of DP 2 on nodes of 2 GPUs: each instance's
    reduce-scatter and all-gather stay in its node (ranks 0 and 1), each rank's shard is then
    ring all-reduced with the other instance's same rank (0 with 2: across nodes), and the step is
    one instance's, the same as DP 2's; the micro-batches are the whole DP's."""
    two = cluster(gpus_per_node=2)
    workload = Workload(global_batch=8, micro_batch=1, seq_length=16, flops_per_token=1e6)
    r = simulate([matrix()], strategy="zero1", cluster=two, dp_size=4, instances=2, wire=WIRE, workload=workload)
    alone = simulate([matrix()], strategy="zero1", cluster=two, dp_size=2, wire=WIRE)
    rs = 10e-6 + 0.5 * NUMEL * 4 / 100e9
    across = 2 * (20e-6 + 0.5 * (NUMEL // 2) * 4 / 10e9)
    assert r.grad_reduce_seconds == pytest.approx(rs + across, rel=1e-12)
    assert r.param_gather_seconds == pytest.approx(alone.param_gather_seconds, rel=1e-12)
    assert r.optimizer_step_seconds == pytest.approx(alone.optimizer_step_seconds, rel=1e-12)
    assert r.details["microbatches"] == 2 and r.details["instances"] == 2
    sent = r.details["bytes"]
    assert sent["reduce_intra"] == pytest.approx(0.5 * NUMEL * 4) and sent["reduce_inter"] == 0.0
    assert sent["instances_inter"] == pytest.approx(NUMEL // 2 * 4) and sent["instances_intra"] == 0.0
    assert sent["gather_intra"] == pytest.approx(0.5 * NUMEL * 2) and sent["gather_inter"] == 0.0
    one = simulate([matrix()], strategy="zero1", cluster=two, dp_size=4, wire=WIRE).details["bytes"]
    assert one["reduce_inter"] == pytest.approx(0.75 * NUMEL * 4) and one["instances_inter"] == 0.0


@pytest.mark.parametrize("strategy, dp_size, instances, message", [
    ("megatron_layerwise", 4, 2, "one optimizer instance"),
    ("sync", 4, 2, "one optimizer instance"),
    ("zero1", 4, 3, "not a multiple of 3 distributed-optimizer instances"),
])
def test_instances_that_megatron_refuses_are_refused(strategy, dp_size, instances, message):
    with pytest.raises(ValueError, match=message):
        simulate([matrix()], strategy=strategy, cluster=cluster(), dp_size=dp_size, instances=instances, wire=WIRE)


def test_cli_prices_optimizer_instances(capsys):
    """``--num-distributed-optimizer-instances 2`` at 64 GPUs: Canzona's and AdamW's projection for
    one instance of DP 32 (its step at least the single instance's: each instance steps the whole
    model), the strategies that run one instance named as dropped; a count that does not divide DP
    is refused in one line; ``tools/plan.py --instances 2`` plans one instance's DP."""
    code, out, _ = run_cli(["--model", "qwen3-1.7b", "--gpus", "64", "--instances", "2", "--strategies", "canzona",
                            "adamw", "megatron_layerwise"], capsys)
    assert code == 0
    assert "2 distributed-optimizer instances, each over DP x CP 32" in out and "megatron_layerwise: one instance" in out
    assert "megatron_layerwise  |" not in out
    code, out, _ = run_cli(["--model", "qwen3-1.7b", "--gpus", "64", "--instances", "2", "--json", "--strategies",
                            "canzona", "adamw"], capsys)
    two = json.loads(out)
    code, out, _ = run_cli(["--model", "qwen3-1.7b", "--gpus", "64", "--json", "--strategies", "canzona", "adamw"], capsys)
    one = json.loads(out)
    for name in ("canzona", "adamw"):
        assert two["strategies"][name]["optimizer_step_seconds"] > one["strategies"][name]["optimizer_step_seconds"]
        assert two["strategies"][name]["details"]["bytes"]["instances_inter"] > 0
        assert one["strategies"][name]["details"]["bytes"]["instances_inter"] == 0
    code, _, err = run_cli(["--model", "qwen3-1.7b", "--gpus", "64", "--instances", "3"], capsys)
    assert code == 2 and "does not divide DP x CP 64: pick one of 1, 2, 4, 8" in err
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import plan as plan_cli  # tools/plan.py
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert plan_cli.main(["--model", "qwen3-1.7b", "--dp", "8", "--instances", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["instance_dp"] == 4 and report["across_instances_bytes"] > 0
