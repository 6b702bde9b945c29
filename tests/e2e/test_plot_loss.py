"""tools/plot_loss.py on metrics files as pretrain_gpt.py --canzona-metrics-file writes them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron.canzona.curves import read_curve

from .support import ROOT

_spec = importlib.util.spec_from_file_location("plot_loss", ROOT / "tools" / "plot_loss.py")
plot_loss = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_loss)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(path: Path, losses: dict[int, float | None]) -> Path:
    lines = [json.dumps({"iteration": i, "lm_loss": loss, "grad_norm": 0.5}) for i, loss in losses.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_overlays_runs_with_labels(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    adam = write_run(tmp_path / "adam.jsonl", {1: 6.9, 10: 6.1, 20: 5.2})
    muon = write_run(tmp_path / "muon.jsonl", {1: 6.9, 10: 5.9, 20: None, 30: 4.8})
    png = tmp_path / "out" / "loss.png"
    assert plot_loss.main([str(adam), str(muon), "--label", "AdamW", "--output", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out
    assert "AdamW: lm loss 6.900 at iteration 1 -> 5.200 at iteration 20" in out
    assert "muon: lm loss 6.900 at iteration 1 -> 4.800 at iteration 30" in out  # file-name label


def test_read_curve_keeps_the_latest_line_per_iteration(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps({"iteration": i, "lm_loss": l}) for i, l in [(1, 7.0), (5, 6.0), (5, 5.5)]))
    curve = read_curve(path)
    assert (curve.iterations, curve.losses) == ([1, 5], [7.0, 5.5])


@pytest.mark.parametrize("content,hint", [("not json\n", "is not JSON"), ('{"iteration": 1}\n', "no lm_loss")])
def test_bad_files_give_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture, content: str, hint: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    assert plot_loss.main([str(path), "--output", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and hint in err[0] and "--canzona-metrics-file" in err[0]


def test_missing_file_and_extra_labels(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert plot_loss.main([str(tmp_path / "nope.jsonl")]) == 2
    assert "no such metrics file" in capsys.readouterr().err
    run = write_run(tmp_path / "a.jsonl", {1: 6.0})
    assert plot_loss.main([str(run), "--label", "a", "--label", "b"]) == 2
    assert "at most one --label per file" in capsys.readouterr().err
