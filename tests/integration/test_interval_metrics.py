"""The per-interval log line of pretrain_gpt.py reads nothing from the device per iteration."""

from __future__ import annotations

import argparse

import torch

from canzona_patches.integration.training import IntervalMetrics
from canzona_patches.harness.host_syncs import count_host_syncs


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        canzona_metrics_file=None, global_batch_size=8, seq_length=16, train_iters=10, consumed_train_samples=40,
        optimizer="muon", canzona=True, data_parallel_size=2, tensor_model_parallel_size=1,
    )


def test_iterations_are_recorded_without_host_reads_and_reported_exactly():
    metrics = IntervalMetrics(_args())
    losses = [torch.tensor([2.5 + k / 7]) for k in range(5)]
    step = metrics.time_step(lambda: torch.ones(3).add_(1))
    with count_host_syncs() as reads:
        for k, loss in enumerate(losses):
            step()
            metrics.record({"lm loss": loss}, skipped_iter=int(k == 2))  # the skipped one is not averaged
    assert reads == [], reads
    report = metrics.report(iteration=5, interval_s=1.0, learning_rate=1e-3, grad_norm=None, reset=True)
    expected = 0.0
    for k, loss in enumerate(losses):
        if k != 2:
            expected += float(loss.float().sum())  # what the log printed before: float64 sums
    assert report["lm_loss"] == expected / 4
    assert report["optimizer_step_ms"] > 0
    again = metrics.report(iteration=6, interval_s=1.0, learning_rate=1e-3, grad_norm=None, reset=True)
    assert again["lm_loss"] is None and again["optimizer_step_ms"] == 0.0


def test_the_line_counts_early_compute_outcomes_only_where_it_runs():
    from canzona_patches.integration.training import format_metrics

    metrics = IntervalMetrics(_args())
    report = metrics.report(iteration=5, interval_s=1.0, learning_rate=1e-3, grad_norm=None, reset=True)
    assert report["early_compute"] is None  # no optimizer computing early is watched
    assert "early compute" not in format_metrics(report)
    line = format_metrics({**report, "early_compute": {"committed": 9, "recomputed": 1, "skipped": 0,
                                                       "not speculated": 3}})
    assert " early compute committed/recomputed/skipped/not speculated: 9/1/0/3 |" in line
