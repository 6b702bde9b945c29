"""tools/chaos.py, short: two faults (a rank killed inside the optimizer step, the launcher killed
while a save is written) in a Muon run with --async-save at TP 2 x DP 2, each resumed, and the
final checkpoint compared bitwise with the uninterrupted run's. The long soak (60 faults of six kinds over
Muon and Shampoo, saves synchronous and asynchronous) is a command in README.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .support import ROOT, DemoData, run_with_deadline

pytestmark = [pytest.mark.slow, pytest.mark.alone]

CHAOS_TIMEOUT_S = 600


def test_a_short_chaos_soak_loses_nothing(demo_data: DemoData, tmp_path: Path) -> None:
    report_file = tmp_path / "chaos.json"
    result = run_with_deadline(
        [sys.executable, str(ROOT / "tools" / "chaos.py"), "--faults", "2", "--kinds", "rank-in-step,launcher-in-save",
         "--scenarios", "muon-async", "--tp", "1", "--dp", "2", "--train-iters", "9", "--save-interval", "3", "--seed", "1",
         "--data-path", demo_data.data_prefix, "--tokenizer-model", str(demo_data.tokenizer_model),
         "--dir", str(tmp_path / "runs"), "--json", str(report_file)],
        timeout_s=CHAOS_TIMEOUT_S)
    out = result.stdout + (result.stderr or "")
    assert result.returncode == 0, out[-6000:]
    tally = json.loads(report_file.read_text())["scenarios"]["muon-async"]
    assert tally["faults"]["rank-in-step"] == 1 and tally["faults"]["launcher-in-save"] == 1, tally
    assert tally["resumes"] == 2 and tally["failures"] == [] and tally["lost"] == [], tally
    assert tally["mismatches"] == [] and tally["compared"] > 50, tally
    assert "total" in out and "mismatch" in out  # the table


def test_bad_inputs_get_one_line_each(tmp_path: Path) -> None:
    """--bad-input on three of its inputs, one of each way the tool damages a run (a flag Megatron
    checks; an edited checksum file in the seed checkpoint a resume reads; a .bin cut short while
    the job reads it): each ends in one line under 300 characters, printed once, that says the way
    on, and the checkpoint is whole. (A rank that stops answering: test_failures_round4.py; a cut
    dataset index and a --ckpt-step with no such checkpoint, the other lines of the table, are held
    where they are made: tests/integration/test_data_pipeline.py, test_checkpoint_way_on.py.)"""
    cases = ("micro-batch-0", "edited-checksum-file", "bin-cut-short-while-running")
    report_file = tmp_path / "bad.json"
    result = run_with_deadline(
        [sys.executable, str(ROOT / "tools" / "chaos.py"), "--bad-input", "--bad-cases", ",".join(cases),
         "--dir", str(tmp_path / "runs"), "--json", str(report_file)], timeout_s=CHAOS_TIMEOUT_S)
    out = result.stdout + (result.stderr or "")
    assert result.returncode == 0, out[-6000:]
    report = json.loads(report_file.read_text())
    assert report["counts"] == {"one line": 3, "saved": 0, "traceback": 0, "silent": 0, "hang": 0, "loss": 0}, report
    assert report["repeated"] == 0 and [row["printed"] for row in report["cases"]] == [1] * 3
    assert report["long_lines"] == 0, [row["line"] for row in report["cases"] if row["chars"] > 300]
    lines = {row["name"]: row["line"] for row in report["cases"]}
    assert "--micro-batch-size must be 1 or more" in lines["micro-batch-0"]
    assert "was changed after the save" in lines["edited-checksum-file"] and "(the data is intact)" in out
    assert "copy_text_document.bin changed while the job read it" in lines["bin-cut-short-while-running"]
