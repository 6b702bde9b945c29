"""tools/validate_simulate.py's verdicts: a ranking is judged only where the measurement orders it."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

_PATH = Path(__file__).resolve().parents[2] / "tools" / "validate_simulate.py"
_spec = importlib.util.spec_from_file_location("validate_simulate", _PATH)
validate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(validate)
MIN_ROUNDS, measured_order, pair_verdicts = validate.MIN_ROUNDS, validate.measured_order, validate.pair_verdicts
ranking_right, round_medians, step_seconds = validate.ranking_right, validate.round_medians, validate.step_seconds


def test_measured_order_needs_every_paired_round():
    a = [1.0] * MIN_ROUNDS
    assert measured_order(a, [1.1] * MIN_ROUNDS) == 1
    assert measured_order(a, [0.9] * MIN_ROUNDS) == -1
    assert measured_order(a, [1.1] * (MIN_ROUNDS - 1) + [0.99]) == 0  # one round the other way: not ordered
    assert measured_order(a[:-1], [1.1] * (MIN_ROUNDS - 1)) == 0  # too few rounds to order anything


def test_pair_verdicts():
    n = MIN_ROUNDS
    rounds = {"canzona": [1.0] * n, "sync": [2.0] * n, "megatron": [1.0, 1.2, 0.9, 1.1, 1.05][:n] + [1.0] * (n - 5)}
    verdicts = pair_verdicts({"canzona": 1.0, "sync": 2.1, "megatron": 1.0}, rounds)
    assert verdicts == {"canzona/sync": "right", "canzona/megatron": "unresolved", "sync/megatron": "right"}
    assert ranking_right(verdicts)
    rounds["megatron"] = [1.2] * n  # now measured slower in every round: the predicted tie is not right
    verdicts = pair_verdicts({"canzona": 1.0, "sync": 2.1, "megatron": 1.0}, rounds)
    assert verdicts["canzona/megatron"] == "tie" and not ranking_right(verdicts)
    verdicts = pair_verdicts({"canzona": 1.0, "sync": 2.1, "megatron": 0.8}, rounds)
    assert verdicts["canzona/megatron"] == "wrong" and not ranking_right(verdicts)


def test_pooled_steps_and_rounds_from_reports():
    new = {"median_step_ms": {"canzona": 15.0}, "round_step_ms": {"canzona": [[10.0, 20.0, 30.0], [40.0]]}}
    old = {"median_step_ms": {"canzona": 50.0}}  # an older report: its median stands for the run
    assert step_seconds([new, old], "canzona") == [0.01, 0.02, 0.03, 0.04, 0.05]
    assert round_medians([new, old], "canzona") == [0.02, 0.04, 0.05]


def test_early_compute_is_validated_with_the_iteration():
    """bench_step --iteration's early-compute variant is predicted as Canzona's strategy with
    early compute; the step mode has no such variant."""
    assert validate.EARLY not in validate.variants_for(False)
    assert validate.variants_for(True)[-1] == validate.EARLY
    assert validate.strategy_of(validate.EARLY, 2) == "canzona"
