"""``--canzona-fsdp-micro-groups``: under Megatron-FSDP every matrix in one micro-group, the
planner's groups, or ``auto``, the one whose slower projected iteration (the clip idle, or acting
every iteration) is faster where the early gathers ride FSDP's link.

At Qwen3-8B FSDP 64 on H100s with 400 Gb/s per GPU, the recipe's batch: the planner's two groups
load different ranks (FSDP cuts every layer's bucket at the same offsets, so a rank's shard lies in
the same matrix of every layer, and the group of the large matrices loads only the ranks holding
them and their hosts), one fused gather holds the link for its busiest rank's bytes once. Gathered
in fp32, one group is faster both ways and ``auto`` takes it; gathered in bf16 (the default), the
clip acting every iteration makes the step gather, normalise and pack in the step, which the
planner's groups pipeline and one group cannot: ``auto`` takes the planner's. The runtime's
choice (``fsdp_group_budget``) is the projection's."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from megatron.canzona.planning import WireConfig, make_plan, qwen3_specs
from megatron.canzona.planning.fsdp import FSDP_LAYOUT
from megatron.canzona.planning.sim import Workload, load_cluster
from megatron.canzona.planning.sim.choose import ONE_GROUP_BUDGET, faster_fsdp_groups, project_fsdp_groups
from megatron.canzona.runtime.config import CanzonaConfig

from canzona_patches.integration.layout import fsdp_group_budget

pytestmark = pytest.mark.quick

RECIPE = Workload(global_batch=128, micro_batch=1, seq_length=4096)
DDP = SimpleNamespace(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params", bucket_size=None,
                      overlap_grad_reduce=True)
"""The fields of Megatron's DistributedDataParallelConfig the choice reads."""


@pytest.fixture(scope="module")
def specs():
    return qwen3_specs("qwen3-8b", split_qkv=True)


def test_one_budget_puts_every_matrix_in_one_group(specs) -> None:
    groups = {b: len({h.group for h in make_plan(specs, dp_size=64, layout=FSDP_LAYOUT, tp_budget=b).hosts})
              for b in (None, ONE_GROUP_BUDGET)}
    assert groups[ONE_GROUP_BUDGET] == 1 and groups[None] > 1, groups


def test_one_fused_gather_is_projected_faster_at_8b_fsdp_64_in_fp32(specs) -> None:
    results = project_fsdp_groups(specs, cluster=load_cluster("h100-ib400"), dp_size=64, workload=RECIPE,
                                  early_compute=True)
    (one, one_acting), (budget, budget_acting) = results["one"], results["budget"]
    assert one.details["num_groups"] == 1 and budget.details["num_groups"] > 1
    # the gathers hold the link for less, and the iteration is shorter, the clip idle and acting
    assert one.details["early_gather_link_seconds"] < budget.details["early_gather_link_seconds"]
    assert one.iteration_seconds < budget.iteration_seconds
    assert one_acting.iteration_seconds < budget_acting.iteration_seconds
    assert faster_fsdp_groups(results) == "one"
    swapped = {"one": results["budget"], "budget": results["one"]}  # the faster one is taken, whichever it is
    assert faster_fsdp_groups(swapped) == "budget"


def test_narrow_gathers_take_the_planners_groups_at_8b_fsdp_64_for_the_clip_acting(specs) -> None:
    """The default's bf16 gathers: one group is faster while the clip stays idle, the planner's
    when it acts every iteration (the step then makes and packs each group's pieces before its
    gather, pipelined with the previous group's compute), and that worse case decides."""
    results = project_fsdp_groups(specs, cluster=load_cluster("h100-ib400"), dp_size=64, workload=RECIPE,
                                  early_compute=True, narrow_gathers=True)
    (one, one_acting), (budget, budget_acting) = results["one"], results["budget"]
    assert one.iteration_seconds < budget.iteration_seconds
    assert budget_acting.iteration_seconds < one_acting.iteration_seconds
    assert max(budget.iteration_seconds, budget_acting.iteration_seconds) < one_acting.iteration_seconds
    assert faster_fsdp_groups(results) == "budget"


def test_the_runtime_takes_the_projections_choice_where_the_gathers_ride_the_link(specs) -> None:
    cfg = CanzonaConfig(optimizer="muon", cluster="h100-ib400")
    kwargs = dict(wire=WireConfig(), dp_size=64, tp_size=1, ep_size=1, expert_tp_size=1, workload=RECIPE)
    budget, line = fsdp_group_budget(specs, cfg, DDP, cuda=True, **kwargs)
    assert budget == ONE_GROUP_BUDGET and line.startswith("[canzona] micro-groups under Megatron-FSDP: one "), line
    # without CUDA (gloo: the gathers are synchronous, no link to share), the run's batch, or with a
    # budget given, the planner's groups; "one" and "budget" as given
    narrow = CanzonaConfig(optimizer="muon", cluster="h100-ib400", narrow_gathers=True)
    budget, line = fsdp_group_budget(specs, narrow, DDP, cuda=True, **kwargs)
    assert budget is None and line.startswith("[canzona] micro-groups under Megatron-FSDP: budget "), line
    assert fsdp_group_budget(specs, cfg, DDP, cuda=False, **kwargs) == (None, None)
    assert fsdp_group_budget(specs, cfg, DDP, cuda=True, **{**kwargs, "workload": None}) == (None, None)
    given = CanzonaConfig(optimizer="muon", cluster="h100-ib400", tp_group_budget=5.0)
    assert fsdp_group_budget(specs, given, DDP, cuda=True, **kwargs) == (5.0, None)
    for setting, expected in (("one", ONE_GROUP_BUDGET), ("budget", None)):
        fixed = CanzonaConfig(optimizer="muon", cluster="h100-ib400", fsdp_micro_groups=setting)
        assert fsdp_group_budget(specs, fixed, DDP, cuda=True, **kwargs) == (expected, None)
    assert math.isinf(ONE_GROUP_BUDGET)
