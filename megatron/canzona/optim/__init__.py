"""Matrix-based optimizers as pure single-device math (no ranks, no collectives).

Update functions take a gradient of shape ``(..., m, n)`` (leading dims: a stack of
same-shape matrices), a state dataclass updated in place and a frozen config, and return
the direction ``D`` of ``p <- p - lr*wd*p - lr*D`` (see :func:`apply_update`).
"""

from megatron.canzona.optim.adamw import AdamWState, adamw_foreach, adamw_update
from megatron.canzona.optim.adaptive_muon import AdaptiveMuonConfig, AdaptiveMuonState, adaptive_muon_update
from megatron.canzona.optim.common import (
    OptimizerState,
    apply_update,
)
from megatron.canzona.optim.config import AdamWConfig, MuonConfig, ShampooConfig, SOAPConfig
from megatron.canzona.optim.muon import MuonState, muon_scale, muon_update
from megatron.canzona.optim.newton_schulz import (
    EMERGING_OPTIMIZERS_COEFFICIENTS,
    NS_COEFFICIENTS,
    NSSchedule,
    newton_schulz,
    singular_value_band,
)
from megatron.canzona.optim.optimizers import MATRIX_OPTIMIZERS, SOAP, AdaptiveMuon, MatrixOptimizer, Muon, Shampoo
from megatron.canzona.optim.shampoo import ShampooState, inverse_root, shampoo_update
from megatron.canzona.optim.soap import SOAPState, soap_update
from megatron.canzona.optim.split import (
    ExpertStackLayout,
    GateUpLayout,
    ParamRouting,
    QKVLayout,
    build_param_groups,
    classify_parameter,
    merge_pieces,
    split_pieces,
)

__all__ = [
    "SOAP",
    "AdamWConfig",
    "AdamWState",
    "AdaptiveMuon",
    "AdaptiveMuonConfig",
    "AdaptiveMuonState",
    "EMERGING_OPTIMIZERS_COEFFICIENTS",
    "ExpertStackLayout",
    "GateUpLayout",
    "MATRIX_OPTIMIZERS",
    "MatrixOptimizer",
    "Muon",
    "MuonConfig",
    "MuonState",
    "NSSchedule",
    "NS_COEFFICIENTS",
    "OptimizerState",
    "ParamRouting",
    "QKVLayout",
    "SOAPConfig",
    "SOAPState",
    "Shampoo",
    "ShampooConfig",
    "ShampooState",
    "adamw_foreach",
    "adamw_update",
    "adaptive_muon_update",
    "apply_update",
    "build_param_groups",
    "classify_parameter",
    "inverse_root",
    "merge_pieces",
    "muon_scale",
    "muon_update",
    "newton_schulz",
    "shampoo_update",
    "singular_value_band",
    "soap_update",
    "split_pieces",
]
