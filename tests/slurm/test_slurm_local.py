"""SLURM for real: tools/slurm_local.sh brings up munged, slurmctld and slurmd on loopback and
submits the qwen3-tiny recipe (Muon with --canzona, torch_dist checkpoints) with
examples/qwen3/slurm_pretrain.sbatch three times: a job that stops at --exit-interval after
saving a checkpoint, a job that resumes from it with the optimizer state, and an
uninterrupted run whose printed lm loss and grad norm the two must reproduce; then a fourth
job, requeued with ``scontrol requeue`` while it trains, whose second start must take over its
own --save lock. It checks the logs and checkpoints and takes it all down.

Skipped only when SLURM is missing and apt-get cannot install it (the script exits 77).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "slurm_local.sh"
RUN_TIMEOUT_S = 540  # apt-get install (first time), four jobs of ~15-35 s, teardown
TEARDOWN_GRACE_S = 30
SKIPPED = 77

pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(600)]


def processes_with(marker: bytes) -> list[int]:
    """PIDs whose environment contains ``marker`` (SLURM_CONF=<this run's slurm.conf>)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            entries = environ.read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in entries and int(environ.parent.name) != os.getpid():
            found.append(int(environ.parent.name))
    return found


def run_script(work: Path) -> subprocess.CompletedProcess:
    """The script with a deadline; past it, SIGTERM lets its teardown run before SIGKILL."""
    env = {**os.environ, "SLURM_LOCAL_DIR": str(work), "OMP_NUM_THREADS": "1"}
    env.pop("SLURM_CONF", None)
    process = subprocess.Popen(["bash", str(SCRIPT)], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=TEARDOWN_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        pytest.fail(f"tools/slurm_local.sh did not finish in {RUN_TIMEOUT_S} s:\n{output[-6000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, output, None)


def test_tiny_recipe_trains_checkpoints_and_resumes_under_slurm(tmp_path: Path) -> None:
    work = tmp_path / "slurm"
    marker = f"SLURM_CONF={work / 'etc' / 'slurm.conf'}".encode()
    try:
        result = run_script(work)
    finally:
        leftovers = processes_with(marker)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    if result.returncode == SKIPPED:
        pytest.skip(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout[-8000:]
    assert "PASS" in result.stdout
    assert "train + resume match the straight job" in result.stdout, result.stdout[-8000:]
    assert not leftovers, f"processes of the SLURM run left behind: {leftovers}"
    assert not work.exists(), "the work directory was not removed"
