"""Pure planning: parameter descriptions, cost model, DP layouts, hosts and micro-groups.

Imports neither ``torch.distributed`` nor Megatron-Core nor ``canzona_patches``.
"""

from .balance import LAYOUTS, plan_canzona, plan_hosts
from .comm import RankTraffic, WireConfig, traffic
from .cost import (
    COST_KINDS, NS_METHODS, OPTIMIZERS, Calibration, CostModel, muon_flops, ns_flops, ns_method_for, shampoo_flops,
    soap_flops,
)
from .experts import plan_with_experts, split_experts
from .grid import dense_to_expert, expert_coordinates, expert_dp_size
from .hosts import GROUPS_PER_HOST, schedule_groups
from .metrics import (
    combined_lower_bound,
    lower_bound,
    makespan_over_lower_bound,
    padding_overhead,
    split_params,
    summarize_canzona,
    summarize_plan,
    summarize_sync,
    with_experts,
)
from .partition import DEFAULT_ALPHA, check_inputs, plan_eq1, plan_zero1
from .pipeline import stage_layer_counts, suggest_uneven_split
from .plan import Bucket, BufferPlan, CanzonaPlan, DPPlan, Host, Placement
from .planner import make_plan
from .qwen3 import QWEN3_MODELS, Qwen3Config, get_qwen3_config, qwen3_specs
from .qwen3_moe import EXPERT_LAYOUTS
from .schedule import Schedule, Task, buffer_schedule, plan_schedule
from .specs import FUSED_LAYOUTS, ParamSpec, elementwise_specs, matrix_specs

__all__ = [
    "COST_KINDS", "OPTIMIZERS", "DEFAULT_ALPHA", "LAYOUTS", "EXPERT_LAYOUTS", "FUSED_LAYOUTS", "GROUPS_PER_HOST", "QWEN3_MODELS", "Bucket",
    "BufferPlan", "Calibration", "CanzonaPlan", "CostModel", "DPPlan", "Host", "ParamSpec", "Placement", "Qwen3Config",
    "RankTraffic", "Task", "WireConfig", "check_inputs", "combined_lower_bound", "dense_to_expert",
    "elementwise_specs", "expert_coordinates", "expert_dp_size", "get_qwen3_config", "lower_bound", "make_plan",
    "makespan_over_lower_bound", "matrix_specs", "muon_flops", "NS_METHODS", "ns_flops", "ns_method_for",
    "padding_overhead", "plan_canzona", "plan_eq1",
    "plan_hosts", "plan_schedule", "plan_with_experts", "plan_zero1", "qwen3_specs", "schedule_groups", "shampoo_flops",
    "soap_flops", "split_experts", "split_params", "stage_layer_counts", "suggest_uneven_split", "summarize_canzona",
    "summarize_plan", "summarize_sync", "buffer_schedule", "Schedule", "traffic", "with_experts",
]
