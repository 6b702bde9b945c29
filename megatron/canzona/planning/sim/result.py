"""What a simulation returns: times per strategy and a per-rank timeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

@dataclass(frozen=True)
class Segment:
    """One span of a rank's timeline, in seconds from the start of the iteration."""

    rank: int
    """Stage-local rank ``dp_rank * tp_size + tp_rank``."""
    lane: str
    """``compute`` or ``comm``."""
    kind: str
    """``forward_backward``, ``bubble``, ``grad_reduce``, ``param_gather``, ``gather``,
    ``compute``, ``scatter``, ``apply`` or ``adamw``."""
    start: float
    end: float
    label: str = ""
    """Micro-group or bucket index, for the plot."""


@dataclass(frozen=True, kw_only=True)
class StrategyResult:
    """One strategy's simulated iteration on the busiest pipeline stage."""

    strategy: str
    optimizer_step_seconds: float
    """From the end of gradient reduction to the last rank's last update (before the
    parameter all-gather, which overlaps the next forward)."""
    iteration_seconds: float
    """Forward/backward, pipeline bubble, exposed collectives and the optimizer step."""
    exposed_comm_seconds: float
    """Communication nothing hides: exposed gradient reduction and parameter all-gather, and
    the optimizer step's time beyond its busiest rank's own work."""
    forward_backward_seconds: float = 0.0
    """Compute of every micro-batch, at the cluster's MFU."""
    bubble_seconds: float = 0.0
    """Pipeline bubble, (PP − 1) micro-batches' forward and backward."""
    grad_reduce_seconds: float = 0.0
    """Whole duration of the gradient reduce-scatters (all-reduces for ``sync``)."""
    grad_reduce_exposed_seconds: float = 0.0
    """Of it, the part after backward ends."""
    param_gather_seconds: float = 0.0
    """Whole duration of the parameter all-gathers."""
    param_gather_exposed_seconds: float = 0.0
    """Of it, the part the first forward waits for."""
    step_compute_seconds: float = 0.0
    """Busiest rank's own optimizer work (matrix updates, applying them, AdamW)."""
    step_comm_exposed_seconds: float = 0.0
    """``optimizer_step_seconds - step_compute_seconds``: waiting on the network (or on a peer)."""
    step_bytes_per_rank: float = 0.0
    """Most bytes one rank sends during the optimizer step (host groups, TP gathers)."""
    details: dict[str, Any] = field(default_factory=dict)
    """Strategy-specific facts (micro-groups, tasks, assumptions)."""
    timeline: tuple[Segment, ...] = ()
    """Per-rank spans of one iteration, for a Gantt chart."""

    @property
    def exposed_optimizer_seconds(self) -> float:
        """What the iteration spends between the end of backward and the first forward layer
        (``tools/bench_step.py --iteration``): the gradient reduction's exposed tail, the
        step, and the part of the parameter all-gather the next forward waits for."""
        return self.grad_reduce_exposed_seconds + self.optimizer_step_seconds + self.param_gather_exposed_seconds

    def to_dict(self, with_timeline: bool = False) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "timeline"}
        out["exposed_optimizer_seconds"] = self.exposed_optimizer_seconds
        if with_timeline:
            out["timeline"] = [vars(s) for s in self.timeline]
        return out
