"""The whole layout: every matrix whole in its owner's shard, shards cut at parameter
boundaries, no padding, balance at the planner's cases up to DP 256; no layout pads."""

from __future__ import annotations

import pytest

from megatron.canzona.planning import (
    LAYOUTS,
    CostModel,
    ParamSpec,
    WireConfig,
    make_plan,
    qwen3_specs,
    summarize_canzona,
)
from megatron.canzona.planning.geometry import PARAM_ALIGNMENT, bucket_end_divisor
from megatron.canzona.planning.sim import ClusterSpec, StrategyResult
from megatron.canzona.planning.sim.choose import faster_layout, layout_line, project_layouts

pytestmark = pytest.mark.quick

COST = CostModel(kind="muon")
PLANNER_CASES = [
    ("qwen3-1.7b", 1, dp) for dp in (8, 32, 64, 128, 256)
] + [("qwen3-8b", 2, dp) for dp in (16, 64, 128, 256)] + [
    ("qwen3-14b", 4, dp) for dp in (8, 32, 64, 128)
] + [("qwen3-32b", 8, dp) for dp in (8, 16, 32, 64, 128, 256)]


def small_model(tp_size: int = 1, *, layers: int = 3, hidden: int = 96, ffn: int = 256) -> list[ParamSpec]:
    """A user's first model: 3 layers, hidden 96, 4 heads in 2 query groups."""
    head = hidden // 4
    shapes = []
    for layer in range(layers):
        shapes += [(f"decoder.layers.{layer}.self_attention.linear_qkv.weight", (hidden + 2 * 2 * head, hidden), 0),
                   (f"decoder.layers.{layer}.self_attention.linear_proj.weight", (hidden, hidden), 1),
                   (f"decoder.layers.{layer}.mlp.linear_fc1.weight", (2 * ffn, hidden), 0),
                   (f"decoder.layers.{layer}.mlp.linear_fc2.weight", (hidden, ffn), 1)]
    return [ParamSpec(name=name, global_shape=shape, tp_dim=dim if tp_size > 1 else None, tp_size=tp_size,
                      dtype="float32", family="matrix", order=len(shapes) - 1 - i)
            for i, (name, shape, dim) in enumerate(shapes)]


def _check_whole(plan, specs) -> None:
    numel = {s.name: s.numel for s in specs}
    for layout in plan.layouts:
        buffer = layout.matrix
        for bucket in buffer.buckets:
            bounds = bucket.shard_bounds
            assert bounds[0] == bucket.start and bounds[-1] == bucket.end and list(bounds) == sorted(bounds)
            assert (bucket.end - bucket.start) % bucket_end_divisor(plan.dp_size) == 0  # Megatron's bucket rule
        for p in buffer.placements:
            bounds = buffer.buckets[p.bucket].shard_bounds
            assert p.host is not None and p.end - p.start == numel[p.name]
            assert bounds[p.host] <= p.start and p.end <= bounds[p.host + 1], p.name
            assert p.start % PARAM_ALIGNMENT == 0
    hosts = {(h.chunk, h.name): h for h in plan.hosts}
    for chunk, layout in enumerate(plan.layouts):
        for p in layout.matrix.placements:  # the host computes what its DP rank holds: no DP traffic
            assert hosts[(chunk, p.name)].dp_rank == p.host


@pytest.mark.parametrize(("model", "tp", "dp"), PLANNER_CASES)
def test_whole_meets_the_planner_targets(model: str, tp: int, dp: int) -> None:
    """Padding 0 and compute makespan / lower bound <= 1.10 (the bound from whole matrices)."""
    specs = qwen3_specs(model, tp_size=tp)
    plan = make_plan(specs, dp_size=dp, tp_size=tp, cost_model=COST, layout="whole")
    _check_whole(plan, specs)
    record = summarize_canzona(plan, specs, COST, WireConfig())
    assert record["split_params"] == 0
    assert record["padding_overhead"] < 1e-3  # alignment only
    assert record["makespan_over_lower_bound"] <= 1.10


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dp", [2, 3, 4, 8])
@pytest.mark.parametrize("bucket_size", [2_000, 5_000, 10_000, 20_000])
def test_no_layout_pads_a_small_model(tp: int, dp: int, bucket_size: int) -> None:
    """Small buckets (one matrix or less each) used to pad the lean layout by 140-300%."""
    specs = small_model(tp)
    for layout in LAYOUTS:
        plan = make_plan(specs, dp_size=dp, tp_size=tp, cost_model=COST, bucket_size=bucket_size, layout=layout)
        padding = summarize_canzona(plan, specs, COST, WireConfig())["padding_overhead"]
        assert padding <= 0.05, (layout, padding)
        if layout == "whole":
            _check_whole(plan, specs)


def test_whole_shards_are_uneven_and_can_be_empty() -> None:
    plan = make_plan(small_model(), dp_size=4, cost_model=COST, bucket_size=10_000, layout="whole")
    sizes = [b - a for bucket in plan.dp.matrix.buckets for a, b in zip(bucket.shard_bounds, bucket.shard_bounds[1:])]
    assert 0 in sizes and len(set(sizes)) > 2
    assert not all(bucket.uniform for bucket in plan.dp.matrix.buckets)


def test_alpha_trades_compute_for_equal_shards() -> None:
    """α = 0 evens the elements each DP rank holds; α = 1 the compute."""
    specs = qwen3_specs("qwen3-8b", tp_size=2)

    def held(plan) -> list[int]:
        out = [0] * plan.dp_size
        for bucket in plan.dp.matrix.buckets:
            for rank, (a, b) in enumerate(zip(bucket.shard_bounds, bucket.shard_bounds[1:])):
                out[rank] += b - a
        return out

    memory = make_plan(specs, dp_size=16, tp_size=2, cost_model=COST, alpha=0.0, layout="whole")
    compute = make_plan(specs, dp_size=16, tp_size=2, cost_model=COST, alpha=1.0, layout="whole")
    spread = [max(held(p)) / min(held(p)) for p in (memory, compute)]
    assert spread[0] <= spread[1]
    assert max(compute.combined_loads()) <= max(memory.combined_loads())


def test_unknown_layout_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"unknown Canzona layout 'wide'; choose one of whole, lean"):
        make_plan(small_model(), dp_size=2, cost_model=COST, layout="wide")


def _result(step: float, iteration: float) -> StrategyResult:
    return StrategyResult(strategy="canzona", optimizer_step_seconds=step, iteration_seconds=iteration,
                          exposed_comm_seconds=0.0)


def test_auto_never_picks_the_slower_layout() -> None:
    assert faster_layout({"whole": _result(1.0, 10.0), "lean": _result(2.0, 11.0)}) == "whole"
    assert faster_layout({"whole": _result(3.0, 12.0), "lean": _result(2.0, 11.0)}) == "lean"
    assert faster_layout({"whole": _result(1.0, 10.0), "lean": _result(1.0, 10.0)}) == "whole"  # tie: first
    assert faster_layout({"whole": _result(2.0, 10.0), "lean": _result(1.0, 10.0)}) == "lean"  # then the step


def test_projection_of_both_layouts_at_scale() -> None:
    """Qwen3-8B on 256 H100s (TP 2 x DP 128): the lean layout splits every matrix and its hosts
    pull them over the inter-node links in the step; the whole layout moves nothing there, and
    pays for its unequal shards in the bucket collectives instead."""
    from megatron.canzona.planning.sim import load_cluster

    specs = qwen3_specs("qwen3-8b", tp_size=2)
    plans = {layout: make_plan(specs, dp_size=128, tp_size=2, cost_model=COST, layout=layout) for layout in LAYOUTS}
    cluster = load_cluster("h100-ib400")
    results = project_layouts(specs, plans, cluster=cluster, optimizer="muon", wire=WireConfig(grad_bytes=4))
    assert results["whole"].optimizer_step_seconds < results["lean"].optimizer_step_seconds
    # The whole layout's unequal collectives cost a little more than equal ones (a rank with an
    # empty shard forwards the whole bucket): here that outweighs its shorter step, so auto
    # takes the lean layout.
    assert results["whole"].grad_reduce_seconds > results["lean"].grad_reduce_seconds
    choice = faster_layout(results)
    assert choice == min(results, key=lambda n: results[n].iteration_seconds)
    line = layout_line(choice, results, cluster, iteration=False)
    assert line.startswith(f"[canzona] layout auto -> {choice} (projected on h100-ib400): whole step ")
    assert "| lean step" in line and "\n" not in line
    assert isinstance(cluster, ClusterSpec)


def test_layouts_are_projected_as_the_run_takes_them_with_early_compute() -> None:
    """``--canzona-layout auto`` on a run that computes early (CUDA's default) projects each layout
    with early compute and, the reduce order left to its default, the shorter of both orders:
    Qwen3-14B on 256 H100s, where the whole layout's step is its early-computed one."""
    from megatron.canzona.planning.sim import Workload, load_cluster, simulate

    specs = qwen3_specs("qwen3-14b", tp_size=4)
    plans = {layout: make_plan(specs, dp_size=64, tp_size=4, cost_model=COST, layout=layout) for layout in LAYOUTS}
    kwargs = dict(cluster=load_cluster("h100-ib400"), optimizer="muon", wire=WireConfig(grad_bytes=4),
                  workload=Workload(global_batch=128, micro_batch=1, seq_length=4096))
    plain = project_layouts(specs, plans, **kwargs)
    early = project_layouts(specs, plans, early_compute=True, matrices_first=None, **kwargs)
    whole = plans["whole"]
    orders = [simulate(specs, strategy="canzona", dp_size=64, tp_size=4, plan=whole, early_compute=True,
                       matrices_first=first, **kwargs).iteration_seconds for first in (False, True)]
    assert early["whole"].iteration_seconds == min(orders) < orders[0]  # the reduce order auto takes
    assert early["whole"].optimizer_step_seconds < plain["whole"].optimizer_step_seconds
    assert early["whole"].details["early_compute"] and "early_compute" not in plain["whole"].details


def test_megatron_main_model_keeps_matrices_whole_in_equal_shards() -> None:
    """The peer's layout as modelled: equal shards, whole matrices, the padding floor closing a
    bucket only once it holds 0.9 x DP x its largest matrix, and a bucket past its floor
    still taking a parameter that fits in its shards' padding."""
    from megatron.canzona.planning.megatron_main import PADDING_FLOOR, main_bucket_ranges, plan_megatron_main

    m = 1_000_000
    assert main_bucket_ranges([m, m, 10 * m, m, m], dp_size=2, bucket_size=2 * m) == [(0, 2), (2, 5)]
    assert main_bucket_ranges([10] * 5, dp_size=2, bucket_size=1000) == [(0, 5)]
    # Past the floor (7.2M) after 7.5M: the next 0.5M fills shard 1 up to shard 0's 4M, one more does not.
    small = 499_968  # a multiple of the 64-element alignment
    assert main_bucket_ranges([4 * m, 3 * m, small, small], dp_size=2, bucket_size=1) == [(0, 4)]
    assert main_bucket_ranges([4 * m, 3 * m, small, small, small], dp_size=2, bucket_size=1) == [(0, 4), (4, 5)]
    specs = qwen3_specs("qwen3-1.7b")
    plan = plan_megatron_main(specs, dp_size=8, cost_model=COST)
    buffer = plan.matrix
    assert plan.strategy == "megatron_main" and all(bucket.uniform for bucket in buffer.buckets)
    for p in buffer.placements:
        bounds = buffer.buckets[p.bucket].shard_bounds
        assert bounds[p.host] <= p.start and p.end <= bounds[p.host + 1]
    record = summarize_canzona(make_plan(specs, dp_size=8, cost_model=COST, layout="whole"), specs, COST, WireConfig())
    padding = buffer.numel / buffer.param_numel - 1
    assert 0 < padding <= 1 / PADDING_FLOOR - 1 + 0.01  # many matrices per bucket: the floor holds
    for bucket in buffer.buckets:  # no shard beyond 1.3 x the bucket's mean while another had room
        width = bucket.shard_bounds[1] - bucket.shard_bounds[0]
        assert width <= 1.3 * bucket.numel_unpadded / 8 + max(p.end - p.start for p in buffer.placements)
    assert record["padding_overhead"] < padding


def test_experts_are_dealt_whole_into_equal_shards() -> None:
    """Experts' fc1 is twice their fc2: 11 fc1 and 10 fc2 fill 8 equal shards with every matrix
    whole (5 shards of two fc1, one of an fc1 and two fc2, two of four fc2); 9 and 9 cannot
    (13.5 fc1-sizes over 8 shards), nor fewer matrices than shards, nor a size off the 64-element
    alignment."""
    from megatron.canzona.planning.whole import even_shards

    fc1, fc2 = 2 * 768 * 2048, 768 * 2048
    numels = [fc2, fc1] * 10 + [fc1]
    shards = even_shards(numels, 8)
    assert shards is not None and sorted(i for shard in shards for i in shard) == list(range(21))
    assert {sum(numels[i] for i in shard) for shard in shards} == {2 * fc1}
    assert even_shards([fc2, fc1] * 9, 8) is None
    assert even_shards([fc1] * 7, 8) is None and even_shards([fc1 + 1] * 8, 8) is None
    assert even_shards([fc1] * 8, 8) == [[i] for i in range(8)]


@pytest.mark.parametrize("ep_dp", [(8, 8), (8, 16), (8, 32)])
def test_expert_buckets_close_where_their_shards_can_be_equal(ep_dp: tuple[int, int]) -> None:
    """Qwen3-30B-A3B, EP 8 at expert DP 8, 16, 32 (64 to 256 GPUs): Megatron's closing point
    (e.g. 14 experts per 64M bucket on 64 GPUs) leaves unequal shards, so each expert bucket closes at the first
    later matrix that lets them be equal, within 1.5x the bucket size: every expert bucket then
    runs the stock equal-shard collectives, each matrix still whole in its owner's shard, and
    the experts' compute stays within 10% of the bound. The dense buffers keep Megatron's
    buckets (their few matrices per bucket cannot be equal over 64 shards)."""
    from megatron.canzona.planning.geometry import BUCKET_GROWTH, default_bucket_size, stock_bucket_ranges

    ep, expert_dp = ep_dp
    specs = qwen3_specs("qwen3-30b-a3b", tp_size=1, ep_size=ep, split_qkv=True)
    plan = make_plan(specs, dp_size=expert_dp * ep, cost_model=COST, ep_size=ep, layout="whole")
    experts = plan.experts
    _check_whole(experts, [s for s in specs if s.is_expert])
    buckets = experts.layouts[0].matrix.buckets
    assert all(bucket.uniform for bucket in buckets)
    size = experts.layouts[0].bucket_size
    assert size == default_bucket_size(expert_dp * ep)  # Megatron sizes every bucket by the DP group
    assert all(b.numel_unpadded <= BUCKET_GROWTH * size for b in buckets[:-1])
    loads = [sum(p.cost for p in experts.layouts[0].matrix.placements if p.host == d) for d in range(expert_dp)]
    assert max(loads) <= 1.1 * sum(loads) / expert_dp
    dense = sorted((s for s in specs if not s.is_expert and s.family == "matrix"), key=lambda s: s.order)
    assert len(plan.layouts[0].matrix.buckets) == len(stock_bucket_ranges([s.numel for s in dense],
                                                                          default_bucket_size(expert_dp * ep)))


@pytest.mark.parametrize("bucket_size", [5_000, 20_000, 100_000])
def test_whole_buckets_close_where_megatron_closes_them(bucket_size: int) -> None:
    """The whole layout pads nothing, so its matrix buckets are Megatron's own: a bucket closes
    once it reaches the size, the last holds what remains (not merged into the one before,
    which would delay that bucket's reduce-scatter to the end of backward)."""
    from megatron.canzona.planning.geometry import stock_bucket_ranges

    specs = small_model(layers=5)
    plan = make_plan(specs, dp_size=4, cost_model=COST, layout="whole", bucket_size=bucket_size)
    mats = sorted(specs, key=lambda s: s.order)
    expected = stock_bucket_ranges([s.numel for s in mats], bucket_size)
    buckets = {p.name: p.bucket for p in plan.layouts[0].matrix.placements}
    got = [buckets[s.name] for s in mats]
    assert got == [k for k, (a, b) in enumerate(expected) for _ in range(a, b)]
    assert len(plan.layouts[0].matrix.buckets) == len(expected)
