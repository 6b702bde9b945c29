"""tools/bench_step.py --fsdp: Canzona's Muon step, the every-holder peer's (#4486) and Megatron's
AdamW step under Megatron-FSDP in one launch, and each rank's host-group bytes (measured by the engine) equal to the plan's
(``planning.comm.traffic``): the tool exits 1 where they differ. Also the issue's bound: no rank
sends more than twice its share of the matrices' fp32 elements (group size = DP x TP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import CPU_RANKS

pytestmark = [*CPU_RANKS]

ROOT = Path(__file__).resolve().parents[2]
LAYERS, HIDDEN, FFN = 2, 128, 384


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("strategy", "dp", "tp"), [("optim_grads_params", 2, 1), ("optim_grads", 2, 2)])
def test_bench_fsdp_sends_the_plans_bytes(strategy: str, dp: int, tp: int, tmp_path: Path) -> None:
    """At TP 2 x DP 2 also with ``--canzona-narrow-gathers`` (``--narrow-gathers``): its bytes the
    plan's too (``comm.traffic``'s ``gathers``), and fewer."""
    out = tmp_path / "bench.json"
    narrow = tp > 1
    result = subprocess.run(
        [sys.executable, "tools/bench_step.py", "--fsdp", strategy, "--dp", str(dp), "--tp", str(tp), "--layers",
         str(LAYERS), "--hidden", str(HIDDEN), "--ffn-hidden", str(FFN), "--steps", "1", "--warmup", "0",
         "--rounds", "1", "--json", str(out), *(("--narrow-gathers",) if narrow else ())],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["bytes_equal_plan"] and report["host_group_bytes_per_rank"] == report["planned_host_group_bytes_per_rank"]
    assert set(report["median_step_ms"]) == {"canzona", "adamw"} | ({"every_holder"} if tp == 1 else set()) \
        | ({"canzona_narrow"} if narrow else set())
    if narrow:  # bf16 pieces and directions: fewer bytes, as planned
        sent, planned = report["narrow_gathers_bytes_per_rank"], report["planned_narrow_gathers_bytes_per_rank"]
        assert sent == planned and sum(sent) < sum(report["host_group_bytes_per_rank"]), (sent, planned)
    if tp == 1:  # the peer gathers every split matrix to all its holders: more bytes than the hosts'
        assert min(report["every_holder_bytes_per_rank"]) > max(report["host_group_bytes_per_rank"])
    q, kv = HIDDEN, HIDDEN // 2  # 4 heads in 2 query groups
    matrix_elements = LAYERS * ((q + 2 * kv) * HIDDEN + HIDDEN * HIDDEN + 2 * FFN * HIDDEN + HIDDEN * FFN)
    bound = 2 * matrix_elements / (dp * tp) * 4
    assert 0 < max(report["host_group_bytes_per_rank"]) <= bound


@pytest.mark.timeout(300)
def test_bench_fsdp_iteration_times_whole_iterations(tmp_path: Path) -> None:
    """``--fsdp --iteration``: whole iterations under Megatron-FSDP, overlapped, of every variant in one
    launch. Its parts (the slowest rank's each) cover the iteration; Canzona's default run issues its gathers in
    backward and makes Muon's sources there (its holders keep the momentum), the in-step one neither."""
    out = tmp_path / "iteration.json"
    result = subprocess.run(
        [sys.executable, "tools/bench_step.py", "--fsdp", "optim_grads_params", "--iteration", "--dp", "2",
         "--layers", str(LAYERS), "--hidden", str(HIDDEN), "--ffn-hidden", str(FFN), "--steps", "1", "--warmup", "0",
         "--rounds", "1", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = report["iteration_parts_ms"]
    assert set(parts) == {"adamw", "canzona", "canzona_late", "every_holder"}
    for name, p in parts.items():
        assert min(p.values()) > 0, (name, p)
        # the slowest rank's each: none longer than the slowest iteration, together at least as long
        assert max(p["forward_backward"], p["exposed_optimizer"], p["rest"]) < p["iteration"], (name, p)
        assert p["forward_backward"] + p["exposed_optimizer"] + p["rest"] >= p["iteration"] * (1 - 1e-9), (name, p)
        assert report["iteration_over_adamw"][name]["median"] == pytest.approx(p["iteration"] / parts["adamw"]["iteration"])
    assert min(report["early_gathers_in_backward"]["canzona"]) > 0
    assert min(report["early_sources_made"]["canzona"]) > 0
    assert not any(report["early_gathers_in_backward"]["canzona_late"] or [])
    assert not any(report["early_sources_made"]["canzona_late"] or [])
    assert "iteration / adamw" in result.stdout
