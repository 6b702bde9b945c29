"""A checkpoint that cannot be loaded is named with the way on: the complete checkpoints that are
there and the ``--ckpt-step N`` that resumes from the latest (a shard cut short or missing, a
tracker naming a missing iteration or holding garbage, a ``--ckpt-step`` with no such
checkpoint, a tracker deleted), and a checkpoint without optimizer state names ``--no-load-optim``.

The checkpoints are real ``torch.distributed.checkpoint`` directories written by one process
(what ``torch_dist`` writes: ``.metadata`` and ``__R_0.distcp`` shards), read by the same checks
a run's load goes through (``verified_checkpoint``, one process).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from canzona_patches.checkpoints.recovery import complete_checkpoints, way_on
from canzona_patches.checkpoints.state import _check_nothing_to_resume, verified_checkpoint
from canzona_patches.errors import CanzonaCheckpointError

pytestmark = pytest.mark.quick

TRACKER = "latest_checkpointed_iteration.txt"


def _save(root: Path, iteration: int) -> Path:
    path = root / f"iter_{iteration:07d}"
    dcp.save({"weight": torch.arange(64.0) + iteration, "bias": torch.ones(8)}, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """Checkpoints of iterations 2, 4 and 6, the tracker at 6."""
    for iteration in (2, 4, 6):
        _save(tmp_path, iteration)
    (tmp_path / TRACKER).write_text("6")
    return tmp_path


def _refusal(load_dir: Path, step: int | None = None) -> str:
    with pytest.raises(CanzonaCheckpointError) as refused:
        verified_checkpoint(load_dir, step=step, checksums=False)
    line = str(refused.value)
    assert "\n" not in line
    return line


def _shard(path: Path) -> Path:
    return next(path.glob("*.distcp"))


def test_complete_checkpoints_are_those_whose_files_are_all_there(saved: Path) -> None:
    assert complete_checkpoints(saved) == [2, 4, 6]
    _shard(saved / "iter_0000004").unlink()
    assert complete_checkpoints(saved) == [2, 6]
    assert verified_checkpoint(saved, checksums=False) == saved / "iter_0000006"


def test_a_shard_cut_short_names_the_file_and_the_step_that_resumes(saved: Path) -> None:
    shard = _shard(saved / "iter_0000006")
    shard.write_bytes(shard.read_bytes()[:100])
    line = _refusal(saved)
    assert f"{shard} is truncated" in line
    assert line.endswith("iterations 2, 4 are complete: resume from the latest with --ckpt-step 4"), line


def test_a_missing_shard_names_it_and_the_step_that_resumes(saved: Path) -> None:
    _shard(saved / "iter_0000006").unlink()
    _shard(saved / "iter_0000004").unlink()
    line = _refusal(saved)
    assert re.search(r"iter_0000006/\S+\.distcp is missing", line)
    assert line.endswith("iteration 2 is complete: resume from it with --ckpt-step 2"), line


def test_a_tracker_naming_a_missing_iteration(saved: Path) -> None:
    (saved / TRACKER).write_text("8")
    line = _refusal(saved)
    assert f"{saved / 'iter_0000008'} does not exist (named by {saved / TRACKER})" in line
    assert line.endswith("iterations 2, 4, 6 are complete: resume from the latest with --ckpt-step 6"), line


def test_a_tracker_holding_garbage(saved: Path) -> None:
    (saved / TRACKER).write_text("\x00\x00garbage")
    line = _refusal(saved)
    assert "not an iteration number: the tracker is corrupt" in line and line.endswith("--ckpt-step 6"), line


def test_a_ckpt_step_without_such_a_checkpoint_names_the_flag_not_the_tracker(saved: Path) -> None:
    line = _refusal(saved, step=5)
    assert line.startswith(f"--ckpt-step 5: there is no {saved / 'iter_0000005'}") and TRACKER not in line, line
    assert line.endswith("--ckpt-step 6")
    assert verified_checkpoint(saved, step=4, checksums=False) == saved / "iter_0000004"


def test_nothing_complete_says_so(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    (tmp_path / TRACKER).write_text("2")
    _shard(tmp_path / "iter_0000002").unlink()
    assert _refusal(tmp_path).endswith(f"no complete checkpoint under --load {tmp_path}: restore one, or drop --load "
                                       "to train from scratch")
    assert way_on(tmp_path / "nothing-here").startswith("no complete checkpoint")


def test_checkpoints_without_their_tracker_are_not_trained_over(saved: Path) -> None:
    """A requeued job whose tracker went missing must not start from iteration 0 over its checkpoints."""
    (saved / TRACKER).unlink()
    with pytest.raises(CanzonaCheckpointError, match=rf"has checkpoints but no {TRACKER} .*--ckpt-step 6$"):
        _check_nothing_to_resume(str(saved), str(saved))
