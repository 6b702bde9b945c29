"""`make gpu-check`'s plumbing on CPU: every step is listed, the CUDA ones skipped with their
reason and the commands they would run, and the CPU forms run for real (the Newton-Schulz
benchmark of both methods and its calibration; each one-GPU recipe's command), so the tool
cannot rot between the rare sessions with a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.canzona.planning.cost import ns_method_for
from megatron.canzona.planning.sim import load_calibration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU `make gpu-check` runs the real thing")
@pytest.mark.timeout(300)
def test_gpu_check_plumbing_on_cpu(tmp_path: Path) -> None:
    docs = (ROOT / "docs" / "gpu_check.md").read_text()
    done = subprocess.run([sys.executable, "tools/gpu_check.py", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = report["steps"]
    assert list(steps) == ["environment", "one_gpu", "tp2dp2", "cuda_tests", "bench", "overlap"]
    assert steps["environment"]["status"] == "ran" and steps["environment"]["details"]["megatron_core"] == "0.19.2"
    for name in ("cuda_tests", "tp2dp2", "overlap"):
        assert steps[name]["status"] == "skipped" and steps[name]["summary"] == "no CUDA device"
    assert "-m gpu" in steps["cuda_tests"]["commands"][0]
    assert [("CUDA_VISIBLE_DEVICES=''" in c) for c in steps["tp2dp2"]["commands"]] == [True, False]

    bench = steps["bench"]
    assert bench["status"] == "skipped" and bench["summary"].startswith("no CUDA device (its CPU form ran")
    rows = bench["details"]["rows"]
    assert {r["matrix"] for r in rows} == {"qkv", "proj", "fc1", "fc2"}
    assert all(r["gram_ms"] > 0 and r["standard_ms"] > 0 for r in rows)
    calibration = load_calibration(bench["details"]["calibration"], "muon")
    assert (352, 64) in calibration.seconds  # qwen3-tiny's fc1
    # both methods ran: auto's timings are, per shape, those of the method it picks
    by_method = {m: load_calibration(bench["details"]["calibration"], "muon", m) for m in ("standard", "gram", "auto")}
    assert [c.ns_method for c in by_method.values()] == ["standard", "gram", "auto"]
    for (m, n), seconds in by_method["auto"].seconds.items():
        assert seconds == by_method[ns_method_for(m, n, 5, "auto", "float32")].seconds[(m, n)]

    one_gpu = steps["one_gpu"]
    variants = ("adamw", "layerwise", "canzona", "canzona_auto", "canzona_no_early", "canzona_no_early_idle",
                "canzona_early_idle", "canzona_early")
    assert len(one_gpu["commands"]) == len(variants)
    for variant in variants:
        printed = (tmp_path / f"one_gpu_{variant}.log").read_text()
        assert "pretrain_gpt.py" in printed and "--num-layers 4 --transformer-impl local --timing-log-level 1" in printed
        assert ("--canzona " in printed) == variant.startswith("canzona")
        assert printed.rstrip().endswith("--muon-ns-method auto") == (variant == "canzona_auto")
        assert ("--canzona-no-early-compute" in printed) == ("no_early" in variant)
        assert ("--canzona-early-compute on" in printed) == variant.startswith("canzona_early")
        assert printed.rstrip().endswith("--clip-grad 1e9") == variant.endswith("_idle")
        assert "--bf16" in printed and "--nproc-per-node 1" in printed and "--log-interval 1 " in printed

    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("| skipped |") == 5 and "| qwen3-tiny | fc1 | 352x64 |" in table
    assert (ROOT / "docs" / "gpu_check.md").read_text() == docs  # published only from a GPU run

    # A later, shorter run keeps the steps it does not run (a device session too short for all)
    again = subprocess.run([sys.executable, "tools/gpu_check.py", "--steps", "environment", "--out", str(tmp_path / "b"),
                            "--keep", str(tmp_path / "gpu_check.json")], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    later = json.loads((tmp_path / "b" / "gpu_check.json").read_text())
    assert list(later["steps"]) == ["one_gpu", "tp2dp2", "cuda_tests", "bench", "overlap", "environment"]
    assert later["steps"]["bench"] == {**steps["bench"], "kept_from": report["date"]}
    assert "kept_from" not in later["steps"]["environment"]
    assert (tmp_path / "b" / "gpu_check.md").read_text().count(f"(run of {report['date']})") == 5


def test_megatron_timer_reports_are_read_as_megatron_writes_them(tmp_path: Path) -> None:
    """The one-GPU step reads where an iteration's time goes from Megatron's timer reports
    (``--timing-log-level 1``, one per logged iteration): the median of each timer over the reports
    after the warm-up ones, the slowest rank's in the min/max form, and the max-only form reads."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_check  # tools/gpu_check.py
    finally:
        sys.path.remove(str(ROOT / "tools"))
    name = "forward-backward "  # Megatron pads each name with dots to 48 characters
    log = tmp_path / "run.log"
    log.write_text("\n".join([
        "(min, max) time across ranks (ms):", f"    {name.ljust(48, '.')}: (300.00, 301.00)",
        " [2026-11-26] iteration       20/      20 | lm loss: 4.6 |",
        "(min, max) time across ranks (ms):", f"    {name.ljust(48, '.')}: (310.50, 311.25)",
        f"    {'optimizer '.ljust(48, '.')}: (140.00, 142.00)",
        "max time across ranks (ms):", f"    {'optimizer-inner-step '.ljust(48, '.')}: 131.00",
    ]) + "\n")
    assert gpu_check.megatron_timers(log) == {"forward-backward": (301.0 + 311.25) / 2, "optimizer": 142.0,
                                              "optimizer-inner-step": 131.0}
    assert gpu_check.megatron_timers(log, skip=2) == {"optimizer-inner-step": 131.0}
    log.write_text("\n".join(log.read_text().splitlines()[:-2]) + "\n")
    assert gpu_check.megatron_timers(log, skip=1) == {"forward-backward": 311.25, "optimizer": 142.0}
    assert gpu_check.megatron_timers(log, skip=5) == {"forward-backward": 311.25, "optimizer": 142.0}  # the last


def test_one_gpu_rounds_report_ratios_counters_and_forward_backward_per_round() -> None:
    """The paired rounds' report: each ratio round by round over the rounds both variants ran,
    Megatron's forward-backward timer per round and per pair, the early-compute outcomes summed
    per run (``None`` where a run computed nothing early)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_check  # tools/gpu_check.py
    finally:
        sys.path.remove(str(ROOT / "tools"))

    def run(step: float, iteration: float, fb: float, early=None) -> dict:
        return {"optimizer_step_ms": [step] * 3, "iteration_ms": [iteration] * 3, "loss": {1: 7.0, 2: 6.5},
                "timers_ms": {"forward-backward": fb}, "early_compute": early}

    counts = {"committed": 0, "recomputed": 2, "skipped": 0, "not speculated": 11}
    runs = {"layerwise": [run(100, 400, 300), run(100, 420, 310)],
            "canzona": [run(90, 380, 297), run(92, 399, 313)],
            "canzona_no_early_idle": [run(80, 370, 290)],
            "canzona_early_idle": [run(60, 380, 300, {**counts, "committed": 13, "not speculated": 0})]}
    result = gpu_check.Result()
    gpu_check.one_gpu_result(runs, {}, None, result)
    ratios = result.details["ratios"]
    assert ratios["canzona/layerwise"]["iteration_ms"] == {"median": (0.95 + 399 / 420) / 2, "min": 0.95, "max": 0.95}
    assert ratios["canzona/layerwise"]["forward_backward_ms"]["median"] == (0.99 + 313 / 310) / 2
    assert ratios["canzona_early_idle/canzona_no_early_idle"]["optimizer_step_ms"]["median"] == 0.75
    assert "canzona_auto/layerwise" not in ratios  # not run
    rows = result.details["variants"]
    assert rows["canzona"]["forward_backward_ms_rounds"] == [297, 313]
    assert rows["canzona_early_idle"]["early_compute_rounds"] == [{**counts, "committed": 13, "not speculated": 0}]
    table = "\n".join(gpu_check.one_gpu_tables(result.details))
    assert "| canzona_early_idle | 300.0 | 13/2/0/0 |" in table and "| canzona | 297.0, 313.0 | –, – |" in table
