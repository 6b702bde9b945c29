"""One call from parameter descriptions to the whole Canzona plan of a pipeline stage."""

from __future__ import annotations

from collections.abc import Sequence

from .comm import WireConfig
from .cost import CostModel
from .experts import plan_with_experts
from .memory import StateLayout
from .partition import DEFAULT_ALPHA
from .plan import CanzonaPlan
from .specs import ParamSpec


def make_plan(
    specs: Sequence[ParamSpec],
    *,
    dp_size: int,
    tp_size: int = 1,
    cost_model: CostModel | None = None,
    alpha: float = DEFAULT_ALPHA,
    bucket_size: int | None = None,
    tp_budget: float | None = None,
    wire: WireConfig | None = None,
    ep_size: int = 1,
    expert_tp_size: int = 1,
    joint_balance: bool = True,
    layout: str = "lean",
    fsdp_strategy: str = "optim_grads_params",
    fsdp_bucket_size: int | None = None,
    state: StateLayout | None = None,
    tp_together: str = "off",
    narrow_gathers: bool = False,
) -> CanzonaPlan:
    """DP layouts (``layout``: ``whole`` or ``lean``, :data:`~megatron.canzona.planning.balance.LAYOUTS`) and one host (DP rank, TP rank) per matrix, in pipelined micro-groups.

    ``layout="fsdp"``: the buffers are Megatron-FSDP's as it builds them (``fsdp_strategy``,
    ``fsdp_bucket_size``: ``--data-parallel-sharding-strategy`` and ``--ddp-bucket-size``,
    :mod:`~megatron.canzona.planning.fsdp`); the plan chooses the hosts and micro-groups only.
    There a matrix's host keeps its optimizer state but for the momentum its holders keep, so with
    ``state`` (the optimizer's :class:`~megatron.canzona.planning.memory.StateLayout`, as the
    runtime builds it) the hosts balance that state too, within
    :data:`~megatron.canzona.planning.hosts.STATE_SLACK` of the compute-only makespan; Muon's
    hosts keep none, so its plan is the compute-only one. The other layouts ignore ``state``.

    Each matrix's update is computed once, by its host; ``tp_budget`` caps one host's cost per
    micro-group (default: about four groups on the busiest host, two at least wherever a host
    has two matrices).

    Expert-parallel parameters (``is_expert``) are planned the same way over the expert-data-
    parallel group, ``dp_size * tp_size / (ep_size * expert_tp_size)`` GPUs, and expert TP
    ``expert_tp_size`` (``plan.experts``); the dense plan then fills around each GPU's expert
    work (``joint_balance``; off plans the dense matrices as if there were no experts).

    ``tp_together`` (:data:`~megatron.canzona.planning.balance.TP_TOGETHER`): which TP-sharded
    matrices their TP ranks compute together, each its own shard, instead of one host.
    ``narrow_gathers``: the run's ``--canzona-narrow-gathers``, which the host choice prices.
    """
    return plan_with_experts(
        specs, dp_size=dp_size, tp_size=tp_size, ep_size=ep_size, expert_tp_size=expert_tp_size,
        cost_model=cost_model or CostModel(), alpha=alpha, bucket_size=bucket_size, wire=wire, budget=tp_budget,
        joint_balance=joint_balance, layout=layout, fsdp_strategy=fsdp_strategy, fsdp_bucket_size=fsdp_bucket_size,
        state=state, tp_together=tp_together, narrow_gathers=narrow_gathers,
    )
