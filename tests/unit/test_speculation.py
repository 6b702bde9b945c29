"""When early compute runs: the per-run rule and the per-iteration speculation policy
(``megatron/canzona/planning/speculation.py``), decided from sequences of norms."""

from __future__ import annotations

import pytest

from megatron.canzona.planning.speculation import (
    MAX_BACKOFF,
    SpeculationPolicy,
    early_compute_decision,
    expected_rates,
    policy_outcomes,
)

pytestmark = pytest.mark.quick

CLIP = 1.0


def _acted(norms: list[float]) -> list[bool]:
    """Whether the clip acts at each norm (Megatron's factor ``clip / (norm + 1e-6)`` under 1)."""
    return [CLIP / (norm + 1.0e-6) < 1.0 for norm in norms]


def test_a_clip_idle_run_commits_every_step() -> None:
    outcomes = policy_outcomes(_acted([0.4, 0.6, 0.9, 0.5] * 25))
    assert outcomes == ["committed"] * 100


def test_not_in_the_iteration_after_the_clip_acted_and_backing_off_after_repeated_misses() -> None:
    # The clip acts at every step: tries at iterations 1, 4, 9, 18, 35 (waits 2, 4, 8, 16, 32)
    outcomes = policy_outcomes(_acted([5.9, 24.0, 8.0, 12.0] * 13)[:50])
    tried = [i + 1 for i, o in enumerate(outcomes) if o != "not speculated"]
    assert tried == [1, 4, 9, 18, 35]
    assert set(outcomes[i - 1] for i in tried) == {"recomputed"}
    assert outcomes.count("recomputed") / len(outcomes) <= 0.15  # the target: 10% here


def test_an_idle_clip_ends_the_wait_and_a_commit_resets_the_backoff() -> None:
    norms = [2.0, 2.0, 0.5, 0.5, 2.0, 0.5, 0.5]
    #        try   wait  idle: try next
    assert policy_outcomes(_acted(norms)) == [
        "recomputed", "not speculated", "not speculated", "committed", "recomputed", "not speculated", "committed"]
    policy = SpeculationPolicy()
    for acted in _acted([2.0, 0.5, 0.5, 2.0]):
        policy.record(speculated=policy.speculate, acted=acted)
    assert policy.failures == 1 and policy.wait == 2  # the commit in between reset the count


def test_the_wait_is_capped() -> None:
    policy = SpeculationPolicy()
    for _ in range(20):
        policy.record(speculated=True, acted=True)
    assert policy.wait == MAX_BACKOFF


def test_always_speculates_and_the_state_round_trips() -> None:
    assert policy_outcomes([True, True, False], rule="always") == ["recomputed", "recomputed", "committed"]
    policy = SpeculationPolicy()
    policy.record(speculated=True, acted=True)
    policy.record(speculated=True, acted=True)
    resumed = SpeculationPolicy()
    resumed.load(policy.state())
    assert (resumed.failures, resumed.wait, resumed.speculate) == (2, 4, False)
    with pytest.raises(ValueError, match="backoff, always"):
        SpeculationPolicy("sometimes")


def test_expected_rates_price_the_policy() -> None:
    assert expected_rates(0.0).committed == 1.0
    every = expected_rates(1.0, iterations=64)
    assert every.committed == 0.0 and every.recomputed == 5 / 64  # tries at 1, 4, 9, 18, 35 (then 68)
    half = expected_rates(0.5)
    assert half == expected_rates(0.5)  # seeded: the same numbers every time
    assert abs(half.committed + half.recomputed + half.not_speculated - 1.0) < 1e-12
    assert half.recomputed < 0.5 * (half.committed + half.recomputed)  # fewer misses than speculating always
    with pytest.raises(ValueError):
        expected_rates(1.5)


@pytest.mark.parametrize("setting,dp,overlap,cuda,on,why", [
    ("auto", 4, True, True, True, "reduce-scatters' tail"),
    ("auto", 1, True, True, False, "data-parallel size 1"),
    ("auto", 4, False, True, False, "--overlap-grad-reduce"),
    ("auto", 4, True, False, False, "gloo"),
    ("on", 1, False, False, True, "--canzona-early-compute on"),
    ("off", 8, True, True, False, "--canzona-early-compute off"),
])
def test_the_per_run_rule(setting: str, dp: int, overlap: bool, cuda: bool, on: bool, why: str) -> None:
    decision = early_compute_decision(setting, dp_size=dp, overlap=overlap, early_gather=True, cuda=cuda)
    assert decision.on == on and why in decision.reason
    assert decision.line().startswith("on (" if on else "off (")
    assert not early_compute_decision(setting, dp_size=dp, overlap=overlap, early_gather=False, cuda=cuda).on
    assert not early_compute_decision(setting, dp_size=dp, overlap=overlap, early_gather=True, cuda=cuda,
                                      async_mode=False).on
