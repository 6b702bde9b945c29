"""tools/plan.py as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/plan.py", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_json_has_every_strategy_and_what_a_user_pays():
    out = plan("--model", "qwen3-32b", "--tp", "8", "--dp", "32", "--compare", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert set(rep["strategies"]) == {"canzona", "eq1", "megatron_layerwise", "zero1"}
    fields = {"makespan_over_lower_bound", "padding_overhead", "split_params", "loads", "num_buckets",
              "largest_bucket_elements", "comm_bytes_per_rank"}
    for s in rep["strategies"].values():
        assert fields <= set(s)
        assert len(s["loads"]) == 32 and len(s["gpu_loads"]) == 32 * 8
        assert s["num_buckets"] >= 1 and s["largest_bucket_elements"] > 0 and s["comm_bytes_per_rank"] > 0
    assert rep["lower_bound"] > 0 and rep["host_groups"]["num_groups"] >= 1
    assert rep["strategies"]["eq1"]["split_params"] == 0  # whole matrices, variable-size shards
    assert rep["strategies"]["canzona"]["uniform_collectives"] and not rep["strategies"]["eq1"]["uniform_collectives"]


def test_plot_writes_a_png(tmp_path):
    png = tmp_path / "loads.png"
    out = plan("--model", "qwen3-tiny", "--dp", "2", "--compare", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "canzona" in out.stdout


@pytest.mark.parametrize("args,hint", [(("--dp", "0"), "--dp 1 or more"), (("--alpha", "-0.5"), "[0, 1]"),
                                       (("--model", "gpt-9"), "choose one of"), (("--model", "qwen3-8b", "--tp", "16"), "divides")])
def test_bad_input_is_one_line_with_the_fix(args, hint):
    out = plan(*args)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("plan.py: error:") and hint in lines[0]
