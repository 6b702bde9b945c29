"""Pure planning: parameter descriptions, cost model, DP partitioners, TP micro-groups.

Imports neither ``torch.distributed`` nor Megatron-Core nor ``canzona_patches``.
"""

from .balance import plan_canzona, tight_capacity
from .cost import COST_KINDS, Calibration, CostModel, muon_flops, shampoo_flops, soap_flops
from .metrics import lower_bound, makespan_over_lower_bound, padding_overhead, split_params, summarize, tp_summary
from .microgroups import schedule_microgroups
from .partition import DEFAULT_ALPHA, check_inputs, plan_eq1, plan_zero1
from .plan import Bucket, BufferPlan, CanzonaPlan, DPPlan, MicroGroup, Placement, TPPlan
from .planner import make_plan, tp_schedules
from .qwen3 import QWEN3_MODELS, Qwen3Config, get_qwen3_config, qwen3_specs
from .specs import ParamSpec, elementwise_specs, matrix_specs

__all__ = [
    "COST_KINDS", "DEFAULT_ALPHA", "QWEN3_MODELS", "Bucket", "BufferPlan", "Calibration", "CanzonaPlan",
    "CostModel", "DPPlan", "MicroGroup", "ParamSpec", "Placement", "Qwen3Config", "TPPlan", "check_inputs",
    "elementwise_specs", "get_qwen3_config", "lower_bound", "make_plan", "makespan_over_lower_bound",
    "matrix_specs", "muon_flops", "padding_overhead", "plan_canzona", "plan_eq1", "plan_zero1", "qwen3_specs",
    "schedule_microgroups", "shampoo_flops", "soap_flops", "split_params", "summarize", "tight_capacity",
    "tp_schedules", "tp_summary",
]
