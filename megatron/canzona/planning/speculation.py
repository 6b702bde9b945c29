"""When early compute runs: per run (is there idle time to hide it in?) and per iteration (will
the clip stay idle, so that what is computed before the step is the step's own?).

Early compute (``--canzona-early-compute``) computes each micro-group's directions before the
step from gradients not yet clipped, speculating that the clip will not act. The result is
bitwise the step's own whenever the clip factor is 1; when it is not, the step computes the
group again and the early work is lost. Two decisions say when the speculation is worth it:

* **Per run** (:func:`early_compute_decision`): ``auto`` computes early only where the run
  has an exposed reduce-scatter tail for it to run in, on a device with a stream of its own
  for it: data parallel (times context parallel) above 1, ``--overlap-grad-reduce``, the early
  gathers, CUDA. At DP 1 there is no tail, and everything it computed would run beside
  backward's GEMMs, which it slows more than it hides (``tools/bench_overlap.py``: 3% hidden,
  the GEMMs 1.80x as long, on an H100). On gloo the host computes serially: nothing hides it.
* **Per iteration** (:class:`SpeculationPolicy`): not in the iteration after the clip acted
  (or a step was skipped); after ``k`` failed speculations in a row, none for the next
  ``2**k`` iterations (at most :data:`MAX_BACKOFF`), then one try. An iteration in which the
  clip stayed idle ends the wait at once. Every rank sees the same global norm, so every rank
  decides the same.

Pure: no torch, no ``torch.distributed``; the runtime and the simulator both run this code.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

EarlyComputeSetting = Literal["auto", "on", "off"]
EARLY_COMPUTE_SETTINGS: tuple[str, ...] = ("auto", "on", "off")
SpeculationRule = Literal["backoff", "always"]
SPECULATION_RULES: tuple[str, ...] = ("backoff", "always")
"""``backoff``: :class:`SpeculationPolicy`; ``always``: speculate in every iteration (what
``--canzona-early-compute on`` did before the policy; the bitwise tests use it to reach every
outcome in a few steps)."""
MAX_BACKOFF = 64
"""Most iterations the policy waits before it speculates again."""


@dataclass(frozen=True, kw_only=True)
class EarlyComputeDecision:
    """Whether one optimizer of a run computes early, and why (the start-up line's words)."""

    on: bool
    reason: str
    """The setting and why (the start-up line's words)."""

    def line(self) -> str:
        return f"{'on' if self.on else 'off'} ({self.reason})"


def early_compute_decision(setting: str, *, dp_size: int, overlap: bool, early_gather: bool, cuda: bool,
                           async_mode: bool = True) -> EarlyComputeDecision:
    """The per-run rule (module docstring) for an optimizer reduced over ``dp_size`` ranks (the
    data-parallel times context-parallel group; the expert-data-parallel one for experts)."""
    if setting not in EARLY_COMPUTE_SETTINGS:
        raise ValueError(f"early compute must be one of {', '.join(EARLY_COMPUTE_SETTINGS)}, got {setting!r}")
    if setting == "off":
        return EarlyComputeDecision(on=False, reason="--canzona-early-compute off")
    if not (early_gather and async_mode):
        return EarlyComputeDecision(on=False, reason="no early gathers to compute where they land "
                                    "(--canzona-no-early-gather or --canzona-tp-mode sync)")
    if setting == "on":
        return EarlyComputeDecision(on=True, reason="--canzona-early-compute on")
    if dp_size <= 1:
        return EarlyComputeDecision(on=False, reason="auto: data-parallel size 1, no reduce-scatter tail to hide it in")
    if not overlap:
        return EarlyComputeDecision(on=False, reason="auto: without --overlap-grad-reduce no reduce-scatter is "
                                    "dispatched in backward to leave a tail for it")
    if not cuda:
        return EarlyComputeDecision(on=False, reason="auto: on gloo the host computes serially, nothing hides it "
                                    "(--canzona-early-compute on forces it)")
    return EarlyComputeDecision(on=True, reason=f"auto: data-parallel size {dp_size}, computed in the reduce-scatters' "
                                "tail after backward, in the iterations where the clip is likely idle")


class SpeculationPolicy:
    """The per-iteration rule (module docstring). Call :attr:`speculate` before an iteration's
    backward and :meth:`record` once its step is decided."""

    def __init__(self, rule: str = "backoff", max_backoff: int = MAX_BACKOFF) -> None:
        if rule not in SPECULATION_RULES:
            raise ValueError(f"speculation rule must be one of {', '.join(SPECULATION_RULES)}, got {rule!r}")
        if max_backoff < 1:
            raise ValueError(f"max_backoff must be 1 or more, got {max_backoff}")
        self.rule, self.max_backoff = rule, max_backoff
        self.failures = 0
        """Failed speculations in a row (the clip acted, or the step was skipped)."""
        self.wait = 0
        """Iterations still to go without speculating."""

    @property
    def speculate(self) -> bool:
        """Whether the coming iteration computes early."""
        return self.rule == "always" or self.wait == 0

    def record(self, *, speculated: bool, acted: bool) -> str:
        """One iteration's outcome: ``acted`` when the clip scaled the gradients or the step was
        skipped (inf/NaN, the norm over a skip threshold). Returns the outcome's name:
        ``committed``, ``recomputed`` (a failed speculation, whatever undid it), ``not
        speculated``."""
        if speculated:
            if acted:
                self.failures += 1
                self.wait = min(2**self.failures, self.max_backoff)
                return "recomputed"
            self.failures, self.wait = 0, 0
            return "committed"
        self.wait = max(self.wait - 1, 0) if acted else 0
        return "not speculated"

    def state(self) -> dict[str, int]:
        """What a checkpoint keeps (a resumed run decides as the uninterrupted one)."""
        return {"failures": self.failures, "wait": self.wait}

    def load(self, state: dict[str, int]) -> None:
        self.failures, self.wait = int(state.get("failures", 0)), int(state.get("wait", 0))


def policy_outcomes(acted: list[bool], rule: str = "backoff") -> list[str]:
    """The outcome of each iteration of a run whose clip acts as ``acted`` says, as the runtime
    decides it (:class:`SpeculationPolicy`)."""
    policy = SpeculationPolicy(rule)
    return [policy.record(speculated=policy.speculate, acted=a) for a in acted]


@dataclass(frozen=True, kw_only=True)
class SpeculationRates:
    """Shares of iterations by outcome under the policy, for a clip that acts at random."""

    committed: float
    recomputed: float
    not_speculated: float


def expected_rates(clip_rate: float, *, rule: str = "backoff", iterations: int = 4096, seed: int = 0) -> SpeculationRates:
    """The policy's outcome shares when the clip acts in each iteration with probability
    ``clip_rate``, independently (a seeded sequence of ``iterations``: the same numbers every
    time)."""
    if not 0.0 <= clip_rate <= 1.0:
        raise ValueError(f"clip_rate must lie in [0, 1], got {clip_rate}")
    rng = random.Random(seed)
    outcomes = policy_outcomes([rng.random() < clip_rate for _ in range(iterations)], rule)
    share = {name: outcomes.count(name) / iterations for name in ("committed", "recomputed", "not speculated")}
    return SpeculationRates(committed=share["committed"], recomputed=share["recomputed"],
                            not_speculated=share["not speculated"])
