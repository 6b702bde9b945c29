"""Checkpoints at scale: one rank checks a checkpoint for all; deleting holds up no barrier.

* **One verdict** (gloo, 3 ranks): each rank saves its shard of a small tensor through
  ``save_distributed``; rank 0 then damages copies of the checkpoint. Every rank asks
  ``verified_checkpoint`` for each copy: all get the same path or the same one-line error,
  and ranks 1 and 2 make no filesystem call while asking (counted by patching ``os.stat``,
  ``os.listdir``, ``os.scandir`` and ``open`` in those processes).
* **Deleting in the background** (gloo, 2 ranks): rank 0's ``shutil.rmtree`` sleeps
  ``SLOW_RMTREE_S``; a save that clears a killed save's staging directory and re-saves a
  committed iteration (two deletions), then a second save started while they run, must each
  pass their barriers in a fraction of that, on both ranks; the deletions happen on the
  remover thread, and the directory ends clean.
"""

from __future__ import annotations

import builtins
import io
import os
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from megatron.canzona.runtime import LaunchConfig, launch
from . import CPU_RANKS

LAUNCH_TIMEOUT_S = 120.0
SLOW_RMTREE_S = 6.0
TRACKER = "latest_checkpointed_iteration.txt"
DAMAGES = ("intact", "truncated", "missing_file", "missing_dir", "bad_tracker", "no_tracker")

pytestmark = [
    *CPU_RANKS,
    pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S),
]


@contextmanager
def counted_filesystem_calls(calls: list[str]):
    """Every stat, directory listing and open of this process is appended to ``calls``."""
    patched = [(os, "stat"), (os, "lstat"), (os, "listdir"), (os, "scandir"), (io, "open"), (builtins, "open")]
    originals = [getattr(owner, name) for owner, name in patched]

    def counting(name, function):
        def counted(*args, **kwargs):
            calls.append(f"{name}({args[0] if args else ''})")
            return function(*args, **kwargs)
        return counted

    for (owner, name), original in zip(patched, originals):
        setattr(owner, name, counting(name, original))
    try:
        yield
    finally:
        for (owner, name), original in zip(patched, originals):
            setattr(owner, name, original)


def _damage(root: Path) -> None:
    """Rank 0: one defect per copy of the saved checkpoint."""
    iteration = "iter_0000003"
    truncated = root / "truncated" / iteration / "__1_0.distcp"
    os.truncate(truncated, truncated.stat().st_size // 2)
    (root / "missing_file" / iteration / "__2_0.distcp").unlink()
    shutil.rmtree(root / "missing_dir" / iteration)
    (root / "bad_tracker" / TRACKER).write_text("three")
    (root / "no_tracker" / TRACKER).unlink()


def _ask_every_rank(root: str) -> dict[str, dict]:
    import torch.distributed as dist

    from canzona_patches.checkpoints.state import save_distributed, verified_checkpoint
    from canzona_patches.errors import CanzonaCheckpointError
    from canzona_patches.emulation.cpu import enable_cpu_mode
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    enable_cpu_mode()
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in DAMAGES:
        shard = torch.arange(64, dtype=torch.float32) + 64 * rank
        save_distributed({"w": ShardedTensor.from_rank_offsets("w", shard, (0, rank, world))}, Path(root) / case, 3)
    if rank == 0:
        _damage(Path(root))
    dist.barrier()
    results = {}
    for case in DAMAGES:
        calls: list[str] = []
        with counted_filesystem_calls(calls):
            try:  # the files and the tracker: one rank
                found, error = verified_checkpoint(Path(root) / case, checksums=False), None
            except CanzonaCheckpointError as failure:
                found, error = None, str(failure)
        results[case] = {"path": None if found is None else str(found), "error": error, "calls": calls}
    calls = []
    with counted_filesystem_calls(calls):  # then the checksums: every rank, its share
        verified_checkpoint(Path(root) / "intact")
    results["hashed"] = sorted({Path(c[c.index("(") + 1:-1]).name for c in calls if c.startswith("open(")
                                and c.endswith(".distcp)")})
    return results


@pytest.fixture(scope="module")
def asked(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Where the checkpoints are, and each rank's answers (one launch of 3 ranks for the two tests below)."""
    root = tmp_path_factory.mktemp("asked")
    return root, launch(_ask_every_rank, LaunchConfig(world_size=3, timeout_s=LAUNCH_TIMEOUT_S), str(root))


def test_one_rank_checks_a_checkpoint_and_every_rank_gets_its_verdict(asked):
    """Without checksums (they are every rank's job: the test below), rank 0 alone reads the
    tracker and the files, and every rank gets its verdict."""
    tmp_path, per_rank = asked
    expected = {
        "intact": (str(tmp_path / "intact" / "iter_0000003"), None),
        "truncated": (None, r"__1_0\.distcp is truncated: \d+ bytes, the index needs \d+"),
        "missing_file": (None, r"__2_0\.distcp is missing \(the index .*\.metadata refers to it\)"),
        "missing_dir": (None, r"iter_0000003 does not exist"),
        "bad_tracker": (None, r"holds 'three', not an iteration number"),
        "no_tracker": (None, None),
    }
    for case, (path, error) in expected.items():
        answers = [rank[case] for rank in per_rank]
        assert all(a["path"] == answers[0]["path"] and a["error"] == answers[0]["error"] for a in answers), answers
        if path is not None or error is None:
            assert answers[0]["path"] == path and answers[0]["error"] is None, (case, answers[0])
        else:
            assert answers[0]["path"] is None and "\n" not in answers[0]["error"], (case, answers[0])
            assert __import__("re").search(error, answers[0]["error"]), (case, answers[0]["error"])
        assert answers[0]["calls"], f"{case}: rank 0 checked nothing"
        for rank, answer in enumerate(answers[1:], start=1):
            assert answer["calls"] == [], f"{case}: rank {rank} touched the filesystem: {answer['calls'][:5]}"



def test_every_rank_rehashes_its_share_of_the_checksums(asked):
    """With checksums the ranks split the re-hashing: 3 ranks, 3 data files (plus the index and
    metadata.json, 5 lists in all): each data file is read by exactly one rank."""
    hashed = [rank["hashed"] for rank in asked[1]]
    assert sorted(name for names in hashed for name in names) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert sum(1 for names in hashed if names) >= 2, hashed  # spread, not one rank reading everything

# --------------------------------------------------------------------------- background deletion


def _fill(directory: Path, marker: str) -> None:
    directory.mkdir(parents=True)
    for k in range(20):
        (directory / f"__{k}_0.distcp").write_bytes(bytes(1024))
    (directory / "marker").write_text(marker)


def _save_while_deleting_slowly(root: str) -> dict:
    import torch.distributed as dist

    from canzona_patches.checkpoints.files import commit_checkpoint, prepare_staging, wait_for_removals

    save, rank = Path(root), dist.get_rank()
    if rank == 0:
        _fill(save / ".staging-iter_0000002", "killed save")  # a save killed mid-write
        _fill(save / "iter_0000004", "old copy")  # committed, about to be saved again
        (save / TRACKER).write_text("4")
    dist.barrier()
    deleted_on: list[str] = []
    real_rmtree = shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):
        deleted_on.append(threading.current_thread().name)
        time.sleep(SLOW_RMTREE_S)
        return real_rmtree(path, *args, **kwargs)

    shutil.rmtree = slow_rmtree
    seconds = {}
    for iteration in (4, 8):  # the second save starts while the first one's deletions run
        began = time.perf_counter()
        staging = prepare_staging(save, iteration)
        seconds[f"prepare {iteration}"] = time.perf_counter() - began
        if rank == 0:
            (staging / "marker").write_text(f"new {iteration}")
        dist.barrier()
        began = time.perf_counter()
        commit_checkpoint(save, iteration)
        seconds[f"commit {iteration}"] = time.perf_counter() - began
    listed_at_once = sorted(p.name for p in save.iterdir())
    wait_for_removals()
    return {"seconds": seconds, "deleted_on": deleted_on, "listed_at_once": listed_at_once,
            "listed_after": sorted(p.name for p in save.iterdir()),
            "iteration_4": (save / "iter_0000004" / "marker").read_text()}


@pytest.mark.alone
def test_deleting_old_checkpoints_holds_up_no_barrier(tmp_path):
    per_rank = launch(_save_while_deleting_slowly, LaunchConfig(world_size=2, timeout_s=LAUNCH_TIMEOUT_S),
                      str(tmp_path))
    for rank, result in enumerate(per_rank):
        for step, seconds in result["seconds"].items():
            assert seconds < SLOW_RMTREE_S / 3, f"rank {rank}: {step} took {seconds:.1f} s (a deletion in its barrier)"
    first = per_rank[0]
    assert first["deleted_on"] == ["canzona-checkpoint-remover"] * 2, first["deleted_on"]
    assert first["iteration_4"] == "new 4"
    # Still deleting when both saves were done; both leftovers renamed out of the way at once.
    assert [n for n in first["listed_at_once"] if not n.startswith(".staging-deleting-")] == [
        "iter_0000004", "iter_0000008", TRACKER], first["listed_at_once"]
    assert first["listed_after"] == ["iter_0000004", "iter_0000008", TRACKER]


def test_a_retired_checkpoint_is_renamed_at_once_and_deleted_later(tmp_path, monkeypatch):
    from canzona_patches.checkpoints import files as checkpoint_files

    _fill(tmp_path / "iter_0000004", "retired")
    release = threading.Event()
    real_rmtree = shutil.rmtree

    def held_rmtree(path, *args, **kwargs):
        release.wait(LAUNCH_TIMEOUT_S)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", held_rmtree)
    checkpoint_files._retire(tmp_path / "iter_0000004", 8, retain_interval=3)
    assert not (tmp_path / "iter_0000004").exists()  # out of every loader's sight already
    assert [p.name.startswith(".staging-deleting-") for p in tmp_path.iterdir()] == [True]
    release.set()
    checkpoint_files.wait_for_removals()
    assert list(tmp_path.iterdir()) == []
