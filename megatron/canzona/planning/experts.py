"""Expert-parallel buffers planned beside the dense ones, and balanced with them per GPU.

Megatron-Core keeps expert-parallel parameters (``allreduce = False``; ``ParamSpec.is_expert``)
in buffers of their own, reduce-scattered over the expert-data-parallel group of
``dp_size * tp_size / (ep_size * expert_tp_size)`` GPUs and sharded over the expert TP
group. Canzona plans them by the same rules as the dense buffers
(:func:`~megatron.canzona.planning.balance.plan_canzona`: lean buckets, each matrix whole or
split with one host, balanced, little padding), over expert DP x expert TP. Every EP rank
holds the same local expert names and shapes, so one expert plan serves every EP rank.

A GPU does both its dense and its expert work in one optimizer step, so the two are balanced
together, in three passes (:func:`plan_with_experts`):

1. the experts alone: many small matrices, a near-even plan;
2. the dense matrices with each GPU's expert load as its base load: the few large dense
   matrices go where the expert work leaves the most room;
3. the experts again, each expert rank's base load being the dense load of the busiest GPU
   that runs it (every EP rank of an expert rank's group runs the same expert work), so the
   expert plan gives less to groups whose GPUs host dense matrices. It is kept only if it
   lowers the stage's combined makespan.

Dense matrices are coarse (Qwen3-30B-A3B has 96 attention matrices for 256 GPUs at DP 256;
one of them is 0.45 TFLOP of Muon where a GPU's expert work is 3.9): pass 2 alone cannot
even that out, pass 3 can (combined makespan / lower bound 1.069 -> 1.008 there).

Under Megatron-FSDP a host keeps its matrices' optimizer state (Shampoo's, SOAP's, AdaMuon's
second moment), so there the passes also balance the state a GPU keeps, dense and expert
together, within a compute slack (:func:`plan_with_experts`' ``state``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .balance import plan_canzona
from .comm import WireConfig
from .cost import CostModel
from .fsdp import FSDP_LAYOUT
from .geometry import default_bucket_size
from .grid import dense_to_expert, expert_dp_size
from .hosts import STATE_SLACK
from .memory import StateLayout, fsdp_host_state, keeps_host_state
from .partition import check_inputs, check_tp_size
from .plan import CanzonaPlan
from .specs import ParamSpec


def split_experts(specs: Sequence[ParamSpec]) -> tuple[list[ParamSpec], list[ParamSpec]]:
    """``(dense, expert)`` parameters: expert ones live in the expert-parallel buffers."""
    return [s for s in specs if not s.is_expert], [s for s in specs if s.is_expert]


def check_expert_specs(experts: Sequence[ParamSpec], expert_tp_size: int) -> None:
    """Expert parameters must be sharded over the expert TP group the plan is made for."""
    for s in experts:
        if s.tp_sharded and s.tp_size != expert_tp_size:
            raise ValueError(
                f"{s.name} is sharded over {s.tp_size} expert TP ranks but the plan is for expert_tp_size="
                f"{expert_tp_size}; pass the expert tensor-parallel size the model was built with"
            )


def expert_base_loads(experts: CanzonaPlan, *, dp_size: int, tp_size: int, ep_size: int) -> list[list[float]]:
    """``[dp_rank][tp_rank]``: the expert compute of the GPU at each dense coordinate."""
    loads = experts.rank_loads()
    coords = iter(dense_to_expert(dp_size=dp_size, tp_size=tp_size, ep_size=ep_size, expert_tp_size=experts.tp_size))
    return [[loads[edp][etp] for edp, etp in (next(coords) for _ in range(tp_size))] for _ in range(dp_size)]


def expert_base_state(experts: CanzonaPlan, specs: Sequence[ParamSpec], state: StateLayout, *, dp_size: int,
                      tp_size: int, ep_size: int) -> list[list[int]]:
    """``[dp_rank][tp_rank]``: the state the GPU at each dense coordinate keeps as a host of its
    expert rank's matrices under Megatron-FSDP (``specs``: the expert ones)."""
    kept = fsdp_host_state(experts, specs, state)
    coords = iter(dense_to_expert(dp_size=dp_size, tp_size=tp_size, ep_size=ep_size, expert_tp_size=experts.tp_size))
    return [[kept[edp][etp] for edp, etp in (next(coords) for _ in range(tp_size))] for _ in range(dp_size)]


def busiest_dense_loads(dense: CanzonaPlan, *, ep_size: int, expert_tp_size: int) -> list[list[float]]:
    """``[expert_dp_rank][expert_tp_rank]``: the dense load of the busiest GPU running each
    expert rank's work (its EP ranks)."""
    coords = dense_to_expert(dp_size=dense.dp_size, tp_size=dense.tp_size, ep_size=ep_size,
                             expert_tp_size=expert_tp_size)
    expert_dp = max(edp for edp, _ in coords) + 1
    out = [[0.0] * expert_tp_size for _ in range(expert_dp)]
    for load, (edp, etp) in zip((x for row in dense.rank_loads() for x in row), coords):
        out[edp][etp] = max(out[edp][etp], load)
    return out


def plan_with_experts(
    specs: Sequence[ParamSpec],
    *,
    dp_size: int,
    tp_size: int,
    ep_size: int,
    expert_tp_size: int,
    cost_model: CostModel,
    alpha: float,
    bucket_size: int | None,
    wire: WireConfig | None,
    budget: float | None,
    joint_balance: bool = True,
    layout: str = "lean",
    fsdp_strategy: str = "optim_grads_params",
    fsdp_bucket_size: int | None = None,
    state: StateLayout | None = None,
    tp_together: str = "off",
    narrow_gathers: bool = False,
) -> CanzonaPlan:
    """The plan of a stage whose ``specs`` may hold expert-parallel parameters: expert buffers
    over expert DP x expert TP (``plan.experts``), dense ones over DP x TP, balanced together
    (module docstring; ``joint_balance`` off plans each as if the other were not there).

    ``state`` (``layout="fsdp"`` only): each plan's hosts balance the state they keep
    (:func:`~megatron.canzona.planning.balance.plan_canzona`), the dense ones around the expert
    state each GPU keeps. Jointly balanced, the stage is planned with and without it, and from
    the compute-only plan: its expert hosts balanced over its dense loads, and the dense hosts
    around either expert plan. Of these, the plan whose busiest GPU keeps the least host state
    (dense and expert) is taken among those whose busiest GPU computes at most
    :data:`~megatron.canzona.planning.hosts.STATE_SLACK` times the compute-only plan's (each
    plan's own slack could otherwise add up)."""
    check_inputs(dp_size, alpha, bucket_size)
    check_tp_size(tp_size)
    dense, experts = split_experts(specs)
    # Elsewhere the state lies in the DP shards; Muon's hosts keep none (its plan is the compute-only one).
    state = state if layout == FSDP_LAYOUT and state is not None and keeps_host_state(state) else None
    # Megatron sizes every buffer's buckets by the dense DP group, expert buffers included.
    bucket_size = default_bucket_size(dp_size) if bucket_size is None else bucket_size
    stage = _ExpertStage(dense, experts, dp_size=dp_size, tp_size=tp_size, ep_size=ep_size, expert_tp_size=expert_tp_size,
                         common=dict(cost_model=cost_model, alpha=alpha, bucket_size=bucket_size, wire=wire, budget=budget,
                                     layout=layout, fsdp_strategy=fsdp_strategy, fsdp_bucket_size=fsdp_bucket_size,
                                     tp_together=tp_together, narrow_gathers=narrow_gathers))
    if not experts:
        return dataclasses.replace(stage.dense_plan(None, state), ep_size=ep_size)
    check_expert_specs(experts, expert_tp_size)
    if not joint_balance:
        return dataclasses.replace(stage.dense_plan(None, state), experts=stage.expert_plan(None, state),
                                   ep_size=ep_size)
    alone = stage.joint(None)
    return alone if state is None else stage.least_state(alone, state)


@dataclasses.dataclass(frozen=True)
class _ExpertStage:
    """A stage's dense and expert matrices at their parallel sizes, planned one around the other
    (:func:`plan_with_experts`); ``common``: :func:`~.balance.plan_canzona`'s other arguments."""

    dense: Sequence[ParamSpec]
    experts: Sequence[ParamSpec]
    dp_size: int
    tp_size: int
    ep_size: int
    expert_tp_size: int
    common: dict

    @property
    def sizes(self) -> dict:
        return dict(dp_size=self.dp_size, tp_size=self.tp_size, ep_size=self.ep_size)

    def dense_plan(self, base: list[list[float]] | None, kept: StateLayout | None,
                   base_state: list[list[int]] | None = None) -> CanzonaPlan:
        return plan_canzona(self.dense, dp_size=self.dp_size, tp_size=self.tp_size, base_loads=base, state=kept,
                            base_state=base_state, **self.common)

    def expert_plan(self, base: list[list[float]] | None, kept: StateLayout | None) -> CanzonaPlan:
        expert_dp = expert_dp_size(dp_size=self.dp_size, tp_size=self.tp_size, ep_size=self.ep_size,
                                   expert_tp_size=self.expert_tp_size)
        return plan_canzona(self.experts, dp_size=expert_dp, tp_size=self.expert_tp_size, base_loads=base, state=kept,
                            **self.common)

    def around(self, expert_plan: CanzonaPlan, kept: StateLayout | None) -> CanzonaPlan:
        """The dense plan filling around ``expert_plan``'s compute (and state, with ``kept``)."""
        base_state = None if kept is None else expert_base_state(expert_plan, self.experts, kept, **self.sizes)
        plan = self.dense_plan(expert_base_loads(expert_plan, **self.sizes), kept, base_state)
        return dataclasses.replace(plan, experts=expert_plan, ep_size=self.ep_size)

    def over_dense(self, plan: CanzonaPlan, kept: StateLayout | None) -> CanzonaPlan:
        """``plan`` with its expert hosts planned again over its dense plan's busiest loads."""
        base = busiest_dense_loads(plan, ep_size=self.ep_size, expert_tp_size=self.expert_tp_size)
        return dataclasses.replace(plan, experts=self.expert_plan(base, kept))

    def joint(self, kept: StateLayout | None) -> CanzonaPlan:
        """Experts first, the dense plan around them, then the experts again over the dense
        loads where that lowers the busiest GPU's compute."""
        first = self.around(self.expert_plan(None, kept), kept)
        second = self.over_dense(first, kept)
        return second if max(second.combined_loads()) < max(first.combined_loads()) else first

    def least_state(self, alone: CanzonaPlan, state: StateLayout) -> CanzonaPlan:
        """Of the plans balancing ``state`` (jointly; from the compute-only plan ``alone``: its
        expert hosts by state over its dense loads, the dense hosts around either expert plan),
        and ``alone`` itself, the one whose busiest GPU keeps the least host state among those
        computing within :data:`~megatron.canzona.planning.hosts.STATE_SLACK` of ``alone``."""
        assert alone.experts is not None
        refined = self.over_dense(alone, state)
        assert refined.experts is not None
        limit = STATE_SLACK * max(alone.combined_loads())
        candidates = (alone, self.joint(state), self.around(alone.experts, state), refined,
                      self.around(refined.experts, state))
        fits = [p for p in candidates if max(p.combined_loads()) <= limit]
        return min(fits, key=lambda p: busiest_host_state(p, self.dense, self.experts, state, **self.sizes))


def busiest_host_state(plan: CanzonaPlan, dense: Sequence[ParamSpec], experts: Sequence[ParamSpec],
                       state: StateLayout, *, dp_size: int, tp_size: int, ep_size: int) -> int:
    """State elements the busiest GPU keeps as a host under Megatron-FSDP: of its dense matrices
    and its expert rank's."""
    assert plan.experts is not None
    kept = expert_base_state(plan.experts, experts, state, dp_size=dp_size, tp_size=tp_size, ep_size=ep_size)
    own = fsdp_host_state(plan, dense, state)
    return max(a + b for row_a, row_b in zip(own, kept) for a, b in zip(row_a, row_b))
