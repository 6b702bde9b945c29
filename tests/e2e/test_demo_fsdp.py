"""``FSDP=S examples/qwen3/pretrain_qwen3_tiny_cpu.sh``: the CPU demo under Megatron-FSDP instead of the
distributed optimizer (FSDP 2 on two gloo ranks, Muon under ``--canzona``, 30 iterations; TP 2 x DP 2
is tests/e2e/test_megatron_fsdp.py's), and the script's one-line refusals of what cannot run there."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from megatron.canzona.runtime.launcher import free_port

from .support import ROOT, run_with_deadline

pytestmark = [pytest.mark.slow]

SCRIPT = ROOT / "examples/qwen3/pretrain_qwen3_tiny_cpu.sh"


def _run(tmp_path: Path, timeout_s: float = 600.0, **env: str):
    env = {"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "MASTER_PORT": str(free_port()), **env}
    return run_with_deadline(["bash", str(SCRIPT)], timeout_s=timeout_s, env=env)


def test_the_demo_trains_under_megatron_fsdp(tmp_path: Path) -> None:
    result = _run(tmp_path, FSDP="optim_grads_params", NPROC="2", ITERS="30")
    assert result.returncode == 0, result.stdout[-6000:]
    log = (tmp_path / "train.log").read_text()
    assert re.search(r"\[canzona\] plan: fsdp layout, \d+ matrices over DP 2 x TP 1,", log), log[-4000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [m["iteration"] for m in metrics] == [1, 10, 20, 30], metrics
    assert all(m["canzona"] for m in metrics), metrics
    assert 0 < metrics[-1]["lm_loss"] < metrics[0]["lm_loss"] < 7.5, metrics
    assert "Megatron-FSDP optim_grads_params" in result.stdout and (tmp_path / "loss.png").stat().st_size > 0


@pytest.mark.parametrize(("env", "message"), [
    ({"FSDP": "full"}, "FSDP=full is not one of optim, optim_grads, optim_grads_params"),
    ({"FSDP": "optim", "CANZONA": "0"}, "Megatron's own Muon does not run under Megatron-FSDP"),
])
def test_the_demo_refuses_what_megatron_fsdp_cannot_run_in_one_line(tmp_path: Path, env: dict, message: str) -> None:
    result = _run(tmp_path, timeout_s=60.0, **env)
    assert result.returncode == 2 and message in result.stdout, result.stdout[-2000:]
    assert not (tmp_path / "train.log").exists()  # nothing launched
