"""tools/compare_optimizers.py's reading, plotting and table on synthetic runs (no training)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("compare_optimizers", ROOT / "tools" / "compare_optimizers.py")
compare = importlib.util.module_from_spec(_spec)
sys.modules["compare_optimizers"] = compare  # dataclasses look their module up while being defined
_spec.loader.exec_module(compare)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Megatron's evaluation lines as they reach the log, one with another process's warning glued on,
# and the end-of-training lines, which are not part of the curve.
LOG = """\
 [2026-01-01 00:00:01] iteration        5/      10 | lm loss: 6.900000E+00 |
 validation loss at iteration 5 | lm loss value: 6.500000E+00 | lm loss PPL: 6.6E+02 | 
 validation loss at iteration 10 | lm loss value: 5.250000E+00 | lm loss PPL: 1.9E+02 | WARNING:megatron.core:x
 validation loss at iteration 10 on validation set | lm loss value: 5.100000E+00 | lm loss PPL: 1.6E+02 | 
 validation loss at iteration 10 on test set | lm loss value: 5.000000E+00 | lm loss PPL: 1.5E+02 | 
"""


def write_run(run_dir: Path, losses: dict[int, float], iteration_ms: dict[int, float], log: str = LOG,
              wall_s: float | None = 12.5) -> Path:
    """A run directory as tools/compare_optimizers.py leaves it (iteration 1 logged off the interval)."""
    run_dir.mkdir(parents=True)
    lines = [json.dumps({"iteration": i, "lm_loss": loss, "iteration_ms": iteration_ms[i],
                         "optimizer_step_ms": 2.0}) for i, loss in losses.items()]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "train.log").write_text(log)
    if wall_s is not None:
        (run_dir / "run.json").write_text(json.dumps({"wall_s": wall_s}))
    return run_dir


def test_validation_lines_of_the_curve_only(tmp_path: Path) -> None:
    (tmp_path / "train.log").write_text(LOG)
    assert compare.read_validation(tmp_path / "train.log") == {5: 6.5, 10: 5.25}


def test_time_counts_the_first_interval_from_the_start(tmp_path: Path) -> None:
    # Iteration 1 is printed without resetting Megatron's interval timer, so the line at 5
    # averages iterations 1-5; later lines average their own 5 iterations.
    run = write_run(tmp_path / "a", {1: 7.0, 5: 6.8, 10: 6.0}, {1: 300.0, 5: 100.0, 10: 200.0})
    elapsed, step_ms = compare.read_timing(run / "metrics.jsonl")
    assert elapsed == pytest.approx({1: 0.3, 5: 0.5, 10: 1.5})
    assert step_ms == pytest.approx(2.0)


def test_time_with_a_log_interval_of_one(tmp_path: Path) -> None:
    run = write_run(tmp_path / "a", {1: 7.0, 2: 6.8, 3: 6.0}, {1: 300.0, 2: 100.0, 3: 200.0})
    elapsed, _ = compare.read_timing(run / "metrics.jsonl")
    assert elapsed == pytest.approx({1: 0.3, 2: 0.4, 3: 0.6})


def test_read_run_places_validation_on_the_time_axis(tmp_path: Path) -> None:
    run = write_run(tmp_path / "adam", {1: 7.0, 5: 6.8, 10: 6.0}, {1: 300.0, 5: 100.0, 10: 200.0})
    result = compare.read_run("adam", run, "AdamW")
    assert result.label == "AdamW" and result.wall_s == 12.5
    assert (result.valid_iterations, result.valid_losses) == ([5, 10], [6.5, 5.25])
    assert result.valid_seconds() == pytest.approx([0.5, 1.5])
    assert compare.interpolate([10, 20], [1.0, 3.0], 15) == pytest.approx(2.0)
    assert compare.interpolate([10, 20], [1.0, 3.0], 5) == pytest.approx(0.5)


def test_missing_files_and_logs_without_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="train it first"):
        compare.read_run("muon", tmp_path / "muon")
    run = write_run(tmp_path / "soap", {1: 7.0, 5: 6.0}, {1: 1.0, 5: 1.0}, log="no evaluation here\n")
    with pytest.raises(ValueError, match="--eval-interval"):
        compare.read_run("soap", run)


def test_plot_and_markdown_table(tmp_path: Path) -> None:
    adam = write_run(tmp_path / "adam", {1: 7.0, 5: 6.8, 10: 6.0}, {1: 300.0, 5: 100.0, 10: 200.0})
    muon = write_run(tmp_path / "muon", {1: 7.0, 5: 6.5, 10: 5.5}, {1: 300.0, 5: 150.0, 10: 300.0}, wall_s=None)
    results = [compare.read_run("adam", adam, "AdamW"), compare.read_run("muon", muon, "Muon")]
    png = tmp_path / "out" / "compare.png"
    compare.plot_runs(results, png, "synthetic")
    assert png.read_bytes()[:8] == PNG_MAGIC
    rows = compare.summarize(results)
    assert rows[1]["train_s"] == pytest.approx(2.25) and rows[1]["train_s_vs_first"] == pytest.approx(1.5)
    table = compare.markdown_table(rows).splitlines()
    assert table[0].startswith("| optimizer | lr | final validation loss") and "time vs AdamW" in table[0]
    assert len(table) == 4 and all(line.count("|") == table[0].count("|") for line in table)
    assert table[2] == "| AdamW | 3e-3 | 5.250 (iteration 10) | iteration 10 | 6.000 | 1.5 | 1.00x | 2.0 | 12 |"
    assert table[3].endswith("| 1.50x | 2.0 | – |")
    assert [row["reaches_first_final_at"] for row in rows] == [10, 10]
    slow = compare.RunResult(**{**vars(results[1]), "valid_losses": [6.9, 6.8]})
    assert compare.summarize([results[0], slow])[1]["reaches_first_final_at"] is None
    assert "| Muon | 3e-3 | 6.800 (iteration 10) | – |" in compare.markdown_table(compare.summarize([results[0], slow]))
    assert not math.isnan(rows[0]["best_valid_loss"])


@pytest.mark.quick
def test_no_train_reads_existing_runs_and_writes_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for name in ("adam", "soap"):
        write_run(tmp_path / name, {1: 7.0, 25: 6.8, 50: 6.0}, {1: 300.0, 25: 100.0, 50: 200.0})
    png = tmp_path / "plot.png"
    assert compare.main(["--no-train", "--runs", "adam", "soap", "--out-dir", str(tmp_path),
                         "--output", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| SOAP | 3e-3 |" in out and png.is_file()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [row["run"] for row in summary["results"]] == ["adam", "soap"]
    assert summary["runs"]["soap"]["optimizer"] == "soap" and summary["machine"]["cpu_count"] >= 1
    assert compare.main(["--no-train", "--runs", "muon", "--out-dir", str(tmp_path)]) == 2
    assert "train it first" in capsys.readouterr().err


def test_runs_reuse_the_demo_script_and_its_flags() -> None:
    args = compare.parse_args(["--iters", "40", "--out-dir", "/tmp/x"])
    command, env = compare.run_command(compare.RUNS["muon"], args)
    assert command[1].endswith("examples/qwen3/pretrain_qwen3_tiny_cpu.sh")
    assert (env["OPTIMIZER"], env["CANZONA"], env["ITERS"], env["TP"]) == ("muon", "1", "40", "1")
    assert command[command.index("--lr") + 1] == "3e-3"
    assert command[-4:] == ["--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "0.2"]
    assert compare.run_command(compare.RUNS["adam"], args)[1]["CANZONA"] == "0"
    with pytest.raises(SystemExit):
        compare.parse_args(["--iters", "20"])
