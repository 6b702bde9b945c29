"""``make demo``'s path: ``examples/qwen3/pretrain_qwen3_tiny_cpu.sh`` at TP 2 x DP 2 (4 gloo
ranks, Muon under ``--canzona``), shortened to 30 iterations, then the loss plot. The script
makes ``data/demo/`` first where it is missing, as ``make demo`` does."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from megatron.canzona.runtime.launcher import free_port

from .support import ROOT, run_with_deadline

pytestmark = [pytest.mark.slow, pytest.mark.quick]

ITERS = 30
"""Three log intervals of the script's 10, past its 20 warm-up iterations (Megatron needs fewer)."""
TIMEOUT_S = 600.0



def test_the_demo_script_trains_and_plots(tmp_path: Path) -> None:
    env = {"TP": "2", "ITERS": str(ITERS), "OUT_DIR": str(tmp_path), "PYTHON": sys.executable,
           "MASTER_PORT": str(free_port())}
    result = run_with_deadline(["bash", str(ROOT / "examples/qwen3/pretrain_qwen3_tiny_cpu.sh")],
                               timeout_s=TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stdout[-6000:]
    log = (tmp_path / "train.log").read_text()
    assert re.search(r"\[canzona\] plan: \w+ layout, \d+ matrices over DP 2 x TP 2,", log), log[-4000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [m["iteration"] for m in metrics] == [1, 10, 20, 30], metrics
    assert all(m["canzona"] for m in metrics), metrics
    assert 0 < metrics[-1]["lm_loss"] < metrics[0]["lm_loss"] < 7.5, metrics  # 6.94 (ln 1024) at the start
    assert (tmp_path / "loss.png").stat().st_size > 0
