"""Configuration of the Canzona runtime: which optimizer, how to plan, how to run TP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.canzona.optim import MATRIX_OPTIMIZERS, AdamWConfig, MuonConfig, ShampooConfig, SOAPConfig
from megatron.canzona.planning import DEFAULT_ALPHA, LAYOUTS, OPTIMIZERS, CostModel
from megatron.canzona.planning.balance import TP_TOGETHER
from megatron.canzona.planning.memory import EARLY_COMPUTE_BYTES
from megatron.canzona.planning.speculation import (
    EARLY_COMPUTE_SETTINGS,
    SPECULATION_RULES,
    EarlyComputeSetting,
    SpeculationRule,
)
from megatron.canzona.runtime.host_groups import MODES as TP_MODES
MatrixConfig = MuonConfig | ShampooConfig | SOAPConfig
COSTS = ("flops", "numel")
"""What the planner balances: the optimizer's FLOPs per matrix, or its element count."""
LAYOUT_CHOICES = (*LAYOUTS, "auto")
"""DP layouts of the matrix buffers, and ``auto``: the one projected faster."""
FSDP_MICRO_GROUPS = ("auto", "one", "budget")
"""``--canzona-fsdp-micro-groups``: ``one`` micro-group, the planner's ``budget`` of cost per host
and group (``--canzona-tp-group-budget``, else about four groups on the busiest host), or ``auto``:
the one whose slower projected iteration, the clip idle or acting, is faster
(:func:`~megatron.canzona.planning.sim.choose.faster_fsdp_groups`)."""


@dataclass(frozen=True, kw_only=True)
class CanzonaConfig:
    """What ``--canzona`` runs: the matrix optimizer and how work is split across ranks."""

    optimizer: Literal["muon", "shampoo", "soap", "adaptive_muon"] = "muon"
    """Matrix optimizer for 2-D weights; embeddings, output layer and vectors use AdamW."""
    matrix: MatrixConfig | None = None
    """Hyperparameters of the matrix optimizer (type must match ``optimizer``; default: that
    optimizer's defaults)."""
    adamw: AdamWConfig = AdamWConfig()
    """Hyperparameters of AdamW for the elementwise parameters."""
    alpha: float = DEFAULT_ALPHA
    """Planner balance knob: 0 favours the fewest bytes sent per rank, 1 equal compute."""
    cost: Literal["flops", "numel"] = "flops"
    """Balance the optimizer's FLOPs or plain element counts."""
    split_qkv: bool = True
    """Optimize Q, K and V of the fused QKV weight as separate matrices."""
    split_qkv_per_head: bool = False
    """Optimize every attention head's query, key and value block as its own matrix
    (``num_heads + 2 * num_query_groups`` matrices of ``kv_channels`` rows per QKV weight)."""
    split_gate_up: bool = False
    """Optimize gate and up of the fused SwiGLU fc1 weight as separate matrices."""
    tp_mode: Literal["async", "sync"] = "async"
    """``async``: one host rank per matrix; ``sync``: every rank holding a piece of a matrix
    gathers and computes it (synchronous compute)."""
    tp_group_budget: float | None = None
    """Most cost one host takes in one micro-group (default: the planner's)."""
    fsdp_micro_groups: Literal["auto", "one", "budget"] = "auto"
    """Under Megatron-FSDP: every matrix in ``one`` micro-group, the planner's groups
    (``budget``: ``tp_group_budget`` or its default), or ``auto``: ``one`` where it is projected
    faster on ``cluster`` with the run's batch (the clip idle and acting, added), where the early
    gathers ride FSDP's link (CUDA, ``async``), else ``budget`` (:func:`~megatron.canzona.planning.sim.choose.project_fsdp_groups`)."""
    tp_together: Literal["off", "auto", "all"] = "off"
    """Under Megatron-FSDP with Muon: the TP-sharded matrices whose TP ranks compute them together,
    each gathering and computing its own shard, their Newton-Schulz summing the shards' Gram
    matrices over the TP group (:data:`~megatron.canzona.planning.balance.TP_TOGETHER`; equal to
    one host's to rounding, not bitwise); ``off``: one host per matrix."""
    narrow_gathers: bool = False
    """Under Megatron-FSDP with Muon iterating in bf16: each whole matrix's holders send its
    Newton-Schulz input to its host divided by the matrix's Frobenius norm, in bf16 (half of fp32's
    bytes; the norm summed in integers over the holders, two small all-reduces per micro-group, so
    bitwise the one-device math with :attr:`MuonConfig.exact_norm <megatron.canzona.optim.config.MuonConfig.exact_norm>`,
    which ``matrix`` must then take: :attr:`~megatron.canzona.runtime.host_groups.MatrixTask.gather_dtype`).
    ``pretrain_gpt.py`` turns it on wherever it applies."""
    early_gather: bool = True
    """``async``: issue each micro-group's gather to its hosts as soon as the buckets holding
    its matrices have reduced, before the step (the hosts apply the loss scale and the clip
    factor; bitwise the same). The dense and the expert optimizer alike."""
    early_compute: EarlyComputeSetting = "auto"
    """With the early gathers: compute each micro-group's updates before the step, once its
    gather has landed and backward is over, leaving the state as it was; the step commits them
    if the clip did not act, else computes them again (exact either way). ``auto``: where the run
    has a reduce-scatter tail to hide them in (:func:`~megatron.canzona.planning.speculation.
    early_compute_decision`); ``on``: wherever the early gathers run, gloo and DP 1 included;
    ``off``: never."""
    speculation: SpeculationRule = "backoff"
    """In which iterations early compute speculates that the clip stays idle: ``backoff`` (not
    after the clip acted, longer after each failure: :class:`~megatron.canzona.planning.
    speculation.SpeculationPolicy`) or ``always``."""
    matrices_first: bool | None = None
    """With early compute: reduce the dense buckets without a matrix (the output layer's, the
    norms') after the last one with a matrix, so the matrices' early compute runs beside them.
    Bitwise the same. ``None``: where the iteration is projected shorter on ``cluster`` (the
    run's batch known), else off."""
    early_compute_bytes: int = EARLY_COMPUTE_BYTES
    """Most bytes early compute keeps per rank and optimizer (directions, and Shampoo's and
    SOAP's staging state): the micro-groups that become ready first and fit are computed early,
    the rest in the step."""
    layout: Literal["whole", "lean", "auto"] = "auto"
    """DP layout of the matrix buffers: ``whole`` (variable-size shards, every matrix whole on
    one DP rank, no DP traffic in the step), ``lean`` (Megatron's equal shards, split matrices
    gathered to a host in the step) or ``auto`` (the one projected faster on ``cluster``)."""
    cluster: str | None = None
    """Cluster ``auto`` projects on: a preset name or a TOML/JSON file (default: ``h100-ib400``
    on CUDA, the local gloo probe on CPU)."""

    def __post_init__(self) -> None:
        if self.optimizer not in MATRIX_OPTIMIZERS:
            raise ValueError(f"unknown matrix optimizer {self.optimizer!r}; choose one of {OPTIMIZERS}")
        expected = MATRIX_OPTIMIZERS[self.optimizer].config_type
        narrow = self.narrow_gathers and self.optimizer == "muon"
        if self.matrix is None:
            object.__setattr__(self, "matrix", expected(exact_norm=True) if narrow else expected())
        if not isinstance(self.matrix, expected):
            raise TypeError(f"optimizer={self.optimizer!r} needs a {expected.__name__}, got {type(self.matrix).__name__}")
        if narrow and not self.matrix.exact_norm:
            raise ValueError("narrow_gathers divides Muon's input by the norm summed in integers: build its "
                             "MuonConfig with exact_norm=True, as every other matrix of the run must take it too")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}")
        if self.cost not in COSTS:
            raise ValueError(f"cost must be one of {', '.join(COSTS)}, got {self.cost!r}")
        if self.layout not in LAYOUT_CHOICES:
            raise ValueError(f"layout must be one of {', '.join(LAYOUT_CHOICES)}, got {self.layout!r}")
        if self.fsdp_micro_groups not in FSDP_MICRO_GROUPS:
            raise ValueError(f"fsdp_micro_groups must be one of {', '.join(FSDP_MICRO_GROUPS)}, "
                             f"got {self.fsdp_micro_groups!r}")
        if self.tp_together not in TP_TOGETHER:
            raise ValueError(f"tp_together must be one of {', '.join(TP_TOGETHER)}, got {self.tp_together!r}")
        if self.early_compute not in EARLY_COMPUTE_SETTINGS:
            raise ValueError(f"early_compute must be one of {', '.join(EARLY_COMPUTE_SETTINGS)}, got {self.early_compute!r}")
        if self.speculation not in SPECULATION_RULES:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION_RULES)}, got {self.speculation!r}")
        if self.tp_mode not in TP_MODES:
            raise ValueError(f"tp_mode must be 'async' or 'sync', got {self.tp_mode!r}")

    @property
    def cost_kind(self) -> str:
        """Planner cost kind: the optimizer's FLOP formula, or ``numel``."""
        return "numel" if self.cost == "numel" else self.optimizer

    def cost_model(self) -> CostModel:
        """The planner's cost model of this optimizer as configured (Newton-Schulz steps,
        method and dtype; refresh frequency and largest preconditioned side)."""
        if isinstance(self.matrix, MuonConfig):
            return CostModel(kind=self.cost_kind, ns_steps=self.matrix.num_ns_steps,
                             ns_method=self.matrix.ns_method, ns_dtype=self.matrix.ns_dtype,
                             ns_measured=self.matrix.ns_measured)
        return CostModel(kind=self.cost_kind, precond_every=self.matrix.precondition_frequency,
                         max_precond_dim=self.matrix.max_precond_dim)
