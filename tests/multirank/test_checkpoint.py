"""Canzona checkpoints: resume exactness, resharding across DP sizes, atomic saves, clear errors.

Multi-rank part (gloo, the tiny GPT of ``tiny_gpt.py`` through ``tiny_checkpoint.py``):
train 6 steps straight at DP 2, and 3 steps + save (at DP 2) + load in new processes + 3
more steps at DP 2, 1 and 4, for Muon, Shampoo, SOAP and Megatron's own Adam. Same layout:
losses and parameters are bitwise equal. Another DP size: the resumed steps sum gradient
shards in another order, the only difference (tolerances below). Shampoo and SOAP refresh
their preconditioners every 2 steps, so resuming after step 3 also checks the saved refresh
phase (step counters). Eight damaged or mismatched checkpoints must each fail with one line
naming the file.

A Muon run saved at TP 2 (world 2) resumes at TP 2 (bitwise), TP 1 x DP 2 and TP 2 x DP 2,
and across ``--canzona-tp-mode`` async and sync (bitwise both ways). A Shampoo run whose
layout splits matrices across DP shards (small buckets, α = 1), saved at DP 2, resumes at
DP 2 (bitwise), DP 4 and TP 2 x DP 2 (other splits, other hosts).

The Muon checkpoint directory also holds a save that was killed: rank 1 is SIGKILLed after
writing its files of iteration 4; the tracker must still name iteration 3, which must load.

Single-process part: the geometry of :mod:`megatron.canzona.runtime.state_io`, and the
commit steps of an atomic save killed at each point (subprocesses with a fault of
``canzona_patches/harness/faults.py`` armed).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron.canzona.runtime import LaunchConfig, RankError, launch
from megatron.canzona.runtime.state_io import Placement, flat_chunks, flat_range_boxes, to_global_boxes

from canzona_patches.harness.tiny_checkpoint import ResumeJob, run_resume_jobs
from canzona_patches.harness.tiny_gpt import TinyRun

ROOT = Path(__file__).resolve().parents[2]
LR = 2e-3
STEPS, HALF = 6, 3
OPTIMIZERS = ("muon", "shampoo", "soap", "adam")
"""The Canzona optimizers, and Megatron's own Adam DistributedOptimizer (``dp_reshardable``
format, with the DistributedOptimizer fixes of canzona_patches/integration/megatron_fixes.py)."""
SPLITS = {  # both fused layouts, as in test_canzona_dp.py
    "muon": dict(split_qkv=True, split_gate_up=False),
    "shampoo": dict(split_qkv=True, split_gate_up=True),
    "soap": dict(split_qkv=False, split_gate_up=False),
    "adam": dict(layout="megatron"),
}
# A resumed run at another DP size differs from the DP 2 run only in the reduction order of
# its last 3 steps. Measured worst parameter difference (DP 2 -> DP 1 and DP 4): 1.2e-7 for
# every optimizer. Bounds: 1e-3 lr as in test_canzona_dp.py; SOAP 1e-2 lr, since it amplifies
# rounding where its eigenbasis is ill-determined (see there); a lost or doubled update moves
# elements by ~lr.
RESHARD_ATOL = {"muon": 1e-3 * LR, "shampoo": 1e-3 * LR, "soap": 1e-2 * LR, "adam": 1e-3 * LR}
SPLIT_BUCKET = 20_000
"""Elements per DDP bucket that put the tiny GPT's fc1 (16,384) across two DP shards."""
LAUNCH_TIMEOUT_S = 240.0
WRITE_FAULT = "write@4:1"  # rank 1 dies after writing its files of iteration 4


def multirank(test):
    """Marks of the tests that share the module's launches."""
    for mark in (
        pytest.mark.multirank,
        pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo runs of the CUDA->CPU redirect"),
        pytest.mark.timeout(6 * LAUNCH_TIMEOUT_S),
    ):
        test = mark(test)
    return test


def _run(optimizer: str, **changes) -> TinyRun:
    base = TinyRun(lr=LR, num_steps=STEPS, layout="canzona", optimizer=optimizer, weight_decay=0.1)
    return replace(base, **{**SPLITS[optimizer], **changes})


def _launch(world_size: int, jobs: list[ResumeJob]) -> list[list[dict]]:
    """Per job, the results of every rank."""
    per_rank = launch(run_resume_jobs, LaunchConfig(world_size=world_size, timeout_s=LAUNCH_TIMEOUT_S), jobs)
    return [[rank[i] for rank in per_rank] for i in range(len(jobs))]


def _damaged_copies(root: Path) -> dict[str, Path]:
    """Copies of the Shampoo checkpoint with one defect each."""
    source = root / "shampoo"
    cases: dict[str, Path] = {}
    for case in ("missing_file", "truncated", "garbled", "flipped", "garbled_unlisted", "bad_tracker", "missing_dir"):
        target = root / f"damaged_{case}"
        shutil.copytree(source, target)
        cases[case] = target
    (cases["missing_file"] / "iter_0000003" / "__1_0.distcp").unlink()
    truncated = cases["truncated"] / "iter_0000003" / "__0_0.distcp"
    os.truncate(truncated, truncated.stat().st_size // 2)
    for case in ("garbled", "garbled_unlisted"):
        garbled = cases[case] / "iter_0000003" / "__0_0.distcp"
        garbled.write_bytes(bytes(garbled.stat().st_size))  # same length, every byte zero
    shutil.rmtree(cases["garbled_unlisted"] / "iter_0000003" / "checksums")  # only Megatron's integrity.json left
    flipped = cases["flipped"] / "iter_0000003" / "__1_0.distcp"
    with open(flipped, "r+b") as stream:  # 16 random bytes in the middle, the size kept
        stream.seek(flipped.stat().st_size // 2)
        stream.write(os.urandom(16))
    (cases["bad_tracker"] / "latest_checkpointed_iteration.txt").write_text("3\x00garbage")
    shutil.rmtree(cases["missing_dir"] / "iter_0000003")
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every launch of this module; keys name the run (each job carries its key in ``extra``)."""
    root = tmp_path_factory.mktemp("checkpoints")
    out: dict = {"root": root}

    def job(key, run: TinyRun, **kwargs) -> ResumeJob:
        return ResumeJob(run=run, extra={"key": key}, **kwargs)

    def collect(world_size: int, jobs: list[ResumeJob]) -> None:
        for per_rank in _launch(world_size, jobs):
            out[per_rank[0]["key"]] = per_rank[0]["error"] if "error" in per_rank[0] else per_rank

    tp2 = _run("muon", tp_size=2, split_gate_up=True)  # Q/K/V and the strided gate/up shards of fc1
    tp2_sync = replace(tp2, tp_mode="sync")  # --canzona-tp-mode sync: every TP rank computes every matrix
    split = _run("shampoo", bucket_size=SPLIT_BUCKET, alpha=1.0, canzona_layout="lean")  # fc1 lies across DP shards
    collect(2, [job(("straight", o), _run(o)) for o in OPTIMIZERS] + [
        job(("straight", "split"), split),
        job(("saved", "split"), split, save_dir=str(root / "split"), save_after=(HALF,))] + [
        # Shampoo's checkpoint (the damaged copies' source) also records SHA-256 hashes.
        job(("saved", o), _run(o), save_dir=str(root / o), save_after=(HALF,), verify_integrity=o == "shampoo")
        for o in OPTIMIZERS if o != "muon"
    ] + [job(("straight", "tp2"), tp2), job(("saved", "tp2"), tp2, save_dir=str(root / "tp2"), save_after=(HALF,)),
         job(("saved", "tp2_sync"), tp2_sync, save_dir=str(root / "tp2_sync"), save_after=(HALF,))])
    # Muon: save iteration 3, then die while saving iteration 4.
    try:
        _launch(2, [ResumeJob(run=_run("muon"), save_dir=str(root / "muon"), save_after=(HALF, HALF + 1), fault=WRITE_FAULT)])
        out["fault"] = "the rank was not killed"
    except RankError as error:
        out["fault"] = error
    out["after_fault"] = sorted(p.name for p in (root / "muon").iterdir())
    out["tracker_after_fault"] = (root / "muon" / "latest_checkpointed_iteration.txt").read_text()
    tp_jobs = {  # world size -> resumes of the TP 2 checkpoint
        2: [job(("resumed", "tp2", "tp2"), tp2, load_dir=str(root / "tp2")),
            job(("resumed", "tp2", "tp1_dp2"), replace(tp2, tp_size=1), load_dir=str(root / "tp2")),
            job(("resumed", "tp2", "tp2_sync"), tp2_sync, load_dir=str(root / "tp2")),
            job(("resumed", "tp2", "from_sync"), tp2, load_dir=str(root / "tp2_sync"))],
        4: [job(("resumed", "tp2", "tp2_dp2"), tp2, load_dir=str(root / "tp2")),
            job(("resumed", "split", "dp4"), split, load_dir=str(root / "split")),
            job(("resumed", "split", "tp2_dp2"), replace(split, tp_size=2), load_dir=str(root / "split"))],
    }
    tp_jobs[2].append(job(("resumed", "split", "dp2"), split, load_dir=str(root / "split")))
    # Between the layouts: the lean checkpoint (fc1 split) resumed whole, a whole one resumed lean.
    tp_jobs[2].append(job(("resumed", "split", "whole_dp2"), replace(split, canzona_layout="whole"),
                          load_dir=str(root / "split")))
    tp_jobs[2].append(job(("resumed", "shampoo", "lean_dp2"), replace(split, canzona_layout="lean"),
                          load_dir=str(root / "shampoo")))
    # The damaged copies load at DP 1, but the zeroed file at DP 2: its checksum is rank 1's share
    # to re-hash, and rank 0 (whose error is kept) must report it too.
    errors = _error_jobs(root)
    error_jobs = {2: [j for j in errors if j.extra["key"] == ("error", "garbled")]}
    error_jobs[1] = [j for j in errors if j not in error_jobs[2]]
    for dp in (2, 1, 4):
        resumes = [job(("resumed", o, dp), _run(o), load_dir=str(root / o)) for o in OPTIMIZERS]
        collect(dp, resumes + tp_jobs.get(dp, []) + error_jobs.get(dp, []))
    return out


def _error_jobs(root: Path) -> list[ResumeJob]:
    damaged = _damaged_copies(root)
    jobs = [
        ResumeJob(run=_run("shampoo"), load_dir=str(path), expect_error=True, extra={"key": ("error", case)})
        for case, path in damaged.items()
    ]
    for case, run, source in (
        ("model_shape", _run("shampoo", hidden=96), "shampoo"),
        ("other_optimizer", _run("soap"), "muon"),
        ("other_split", _run("shampoo", split_gate_up=False), "shampoo"),
    ):
        jobs.append(ResumeJob(run=run, load_dir=str(root / source), expect_error=True, extra={"key": ("error", case)}))
    return jobs


@multirank
@pytest.mark.quick  # the quick suite's checkpoints: this module's one launch per world size, resumed
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resume_at_the_same_layout_is_bitwise(results, optimizer):
    (straight, *_), resumed = results[("straight", optimizer)], results[("resumed", optimizer, 2)]
    for rank, result in enumerate(resumed):
        assert result["start"] == HALF
        assert result["losses"] == straight["losses"][HALF:], f"rank {rank}"
        for name, expected in straight["params"].items():
            assert torch.equal(result["params"][name], expected), f"{optimizer} rank {rank} {name}"


@multirank
@pytest.mark.parametrize("optimizer", ["muon", "shampoo", "soap"])
def test_a_resume_reads_into_the_live_optimizer_state(results, optimizer):
    """No second copy of the state while loading: the loader writes the whole-matrix state and
    the flat state of whole rows straight into the live tensors (only boxes of part of a row
    and the step counters go through a buffer: measured 99.99% of the elements in place)."""
    for rank, result in enumerate(results[("resumed", optimizer, 2)]):
        ((in_place, loaded),) = result["loaded_in_place"]
        assert in_place >= 0.9 * loaded, f"rank {rank}: {in_place} of {loaded} elements in place"


@multirank
@pytest.mark.quick
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dp", [1, 4])
def test_resume_at_another_dp_size(results, optimizer, dp):
    (straight, *_), resumed = results[("straight", optimizer)], results[("resumed", optimizer, dp)]
    for rank, result in enumerate(resumed):
        assert result["losses"] == pytest.approx(straight["losses"][HALF:], rel=1e-4)
        for name, expected in straight["params"].items():
            torch.testing.assert_close(
                result["params"][name], expected, rtol=0, atol=RESHARD_ATOL[optimizer],
                msg=lambda m: f"{optimizer} saved at DP 2, resumed at DP {dp}, rank {rank}, {name}: {m}",
            )


@multirank
@pytest.mark.parametrize("layout", ["tp2", "tp1_dp2", "tp2_dp2", "tp2_sync", "from_sync"])
def test_resume_across_tp_sizes(results, layout):
    """Saved at TP 2: each TP-sharded matrix's state is on its host TP rank at full size, the
    elementwise state and main parameters in TP shards. Resumed at TP 2 (bitwise), TP 1 x DP 2
    and TP 2 x DP 2 (measured worst difference: 1.2e-7); resumed at TP 2 with
    ``--canzona-tp-mode sync`` (``tp2_sync``), and a sync-mode save resumed in async mode
    (``from_sync``): the two modes compute the same bits, so both are bitwise."""
    bitwise = layout in ("tp2", "tp2_sync", "from_sync")
    (straight, *_), resumed = results[("straight", "tp2")], results[("resumed", "tp2", layout)]
    for rank, result in enumerate(resumed):
        if bitwise:
            assert result["losses"] == straight["losses"][HALF:]
        assert result["losses"] == pytest.approx(straight["losses"][HALF:], rel=1e-4)
        for name, expected in straight["params"].items():
            atol = 0.0 if bitwise else RESHARD_ATOL["muon"]
            torch.testing.assert_close(result["params"][name], expected, rtol=0, atol=atol,
                                       msg=lambda m: f"TP 2 -> {layout}, rank {rank}, {name}: {m}")


@multirank
@pytest.mark.parametrize("layout", ["dp2", "dp4", "tp2_dp2"])
def test_a_layout_with_split_matrices_resumes_at_other_dp_and_tp_sizes(results, layout):
    """The Shampoo state of a matrix split across DP shards lives whole on its host; the
    checkpoint keys it by name, so another layout (other splits, other hosts) reads it."""
    (straight, *_), resumed = results[("straight", "split")], results[("resumed", "split", layout)]
    assert straight["split_matrices"], "the small buckets must split a matrix across DP shards"
    for rank, result in enumerate(resumed):
        atol = 0.0 if layout == "dp2" else RESHARD_ATOL["shampoo"]
        assert result["losses"] == pytest.approx(straight["losses"][HALF:], rel=0 if layout == "dp2" else 1e-4)
        for name, expected in straight["params"].items():
            torch.testing.assert_close(result["params"][name], expected, rtol=0, atol=atol,
                                       msg=lambda m: f"split layout DP 2 -> {layout}, rank {rank}, {name}: {m}")


@multirank
@pytest.mark.parametrize(("source", "layout"), [("split", "whole_dp2"), ("shampoo", "lean_dp2")])
def test_checkpoints_reshard_between_the_whole_and_lean_layouts(results, source, layout):
    """The lean checkpoint (fc1 across DP shards, its state whole on its host) resumed in the
    whole layout, and the whole one resumed lean with small buckets: the state is keyed by
    name, so either reads the other within the resharding bounds."""
    (straight, *_), resumed = results[("straight", source)], results[("resumed", source, layout)]
    assert bool(resumed[0]["split_matrices"]) == (layout == "lean_dp2")
    assert bool(straight["split_matrices"]) == (source == "split")
    for rank, result in enumerate(resumed):
        assert result["losses"] == pytest.approx(straight["losses"][HALF:], rel=1e-4)
        for name, expected in straight["params"].items():
            torch.testing.assert_close(result["params"][name], expected, rtol=0, atol=RESHARD_ATOL["shampoo"],
                                       msg=lambda m: f"{source} -> {layout}, rank {rank}, {name}: {m}")


@multirank
def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(results):
    assert isinstance(results["fault"], RankError), results["fault"]
    assert results["tracker_after_fault"] == str(HALF)
    assert "iter_0000004" not in results["after_fault"]
    assert "iter_0000003" in results["after_fault"]
    assert ".staging-iter_0000004" in results["after_fault"]  # the torn write, never tracked
    # ... and iteration 3 of that directory resumed bitwise (test above, optimizer "muon").


@multirank
@pytest.mark.parametrize("case, expected", [
    ("missing_file", r"__1_0\.distcp is missing"),
    ("truncated", r"__0_0\.distcp is truncated: \d+ bytes, the index needs \d+"),
    ("garbled", r"iter_0000003/__0_0\.distcp is corrupt: its SHA-256 is [0-9a-f]{16}\.\.\., the save recorded "
                r"[0-9a-f]{16}\.\.\. \(.*checksums/__0_0\.distcp\.sha256, and SHA256SUMS agrees\); restore the file"),
    ("flipped", r"iter_0000003/__1_0\.distcp is corrupt: its SHA-256 is"),
    ("garbled_unlisted", r"iter_0000003/__0_0\.distcp is corrupt: its SHA-256 differs from .*integrity\.json"),
    ("bad_tracker", r"latest_checkpointed_iteration\.txt holds .* not an iteration number"),
    ("missing_dir", r"iter_0000003 does not exist"),
    ("model_shape", r"has shape \(.*\) in the checkpoint, this run expects \(.*\)"),
    ("other_optimizer", r"holds muon state, this run uses --optimizer soap: resume with --optimizer muon, or pass "
                        r"--no-load-optim"),
    ("other_split", r"split as gate_up, qkv, this run as qkv"),
])
def test_a_bad_checkpoint_gives_one_line_naming_the_file(results, case, expected):
    message = results[("error", case)]
    assert message is not None, f"{case}: loading did not fail"
    assert "\n" not in message, message
    assert re.search(expected, message), message
    assert str(results["root"]) in message, message


# --------------------------------------------------------------------------- single process


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_flat_range_boxes_cover_the_range_exactly_once(shape, data):
    numel = int(torch.tensor(shape).prod())
    start = data.draw(st.integers(0, numel))
    end = data.draw(st.integers(start, numel))
    seen = torch.zeros(shape, dtype=torch.int)
    for offset, size in flat_range_boxes(shape, start, end):
        seen[tuple(slice(o, o + s) for o, s in zip(offset, size))] += 1
    expected = torch.zeros(numel, dtype=torch.int)
    expected[start:end] = 1
    assert torch.equal(seen.reshape(-1), expected)
    assert len(flat_range_boxes(shape, start, end)) <= 2 * len(shape) - 1


@given(
    dims=st.tuples(st.integers(1, 4), st.integers(1, 4)), tp_size=st.sampled_from([1, 2, 4]),
    tp_dim=st.sampled_from([0, 1]), stride=st.sampled_from([1, 2]), cut=st.floats(0, 1), dp_size=st.integers(1, 3),
)
def test_dp_and_tp_shards_reassemble_the_global_tensor(dims, tp_size, tp_dim, stride, cut, dp_size):
    """Megatron's TP shard of a strided parameter (rank r holds pieces r, r+tp, ... of the
    stride blocks), cut into flat DP shards, lands back in place through the chunks."""
    local = list(dims)
    local[tp_dim] *= stride
    global_shape = list(local)
    global_shape[tp_dim] *= tp_size
    full = torch.arange(int(torch.tensor(global_shape).prod()), dtype=torch.float32).reshape(global_shape)
    pieces = full.chunk(stride * tp_size, dim=tp_dim)
    rebuilt = torch.full_like(full, -1.0)
    for tp_rank in range(tp_size):
        shard = torch.cat([pieces[j * tp_size + tp_rank] for j in range(stride)], dim=tp_dim).reshape(-1)
        bounds = sorted({0, shard.numel(), int(cut * shard.numel())} | {shard.numel() * k // dp_size for k in range(dp_size)})
        for start, end in zip(bounds, bounds[1:]):
            placement = Placement(local_shape=tuple(local), flat_start=start, flat_end=end, tp_dim=tp_dim,
                                  tp_stride=stride, tp_rank=tp_rank, tp_size=tp_size)
            for chunk in flat_chunks("x", shard[start:end].clone(), placement):
                assert chunk.global_shape == tuple(global_shape)
                region = tuple(slice(o, o + s) for o, s in zip(chunk.global_offset, chunk.data.shape))
                assert (rebuilt[region] == -1).all(), "two chunks wrote the same element"
                rebuilt[region] = chunk.data
    assert torch.equal(rebuilt, full)


def test_restore_writes_into_the_flat_shard():
    flat = torch.zeros(7)
    placement = Placement(local_shape=(3, 4), flat_start=3, flat_end=10)
    for chunk in flat_chunks("x", flat, placement):
        chunk.restore(torch.ones_like(chunk.data))
    assert torch.equal(flat, torch.ones(7))


def test_a_placement_outside_the_parameter_is_refused():
    with pytest.raises(ValueError, match="outside"):
        Placement(local_shape=(2, 2), flat_start=0, flat_end=5)
    assert to_global_boxes(((0, 0), (2, 2)), Placement(local_shape=(2, 2), flat_start=0, flat_end=4)) == [
        (((0, 0), (2, 2)), ((0, 0), (2, 2)))
    ]


_COMMIT = """
import sys
from canzona_patches.harness.faults import arm
from canzona_patches.checkpoints.files import commit_checkpoint
if len(sys.argv) > 2:
    arm(sys.argv[2])
commit_checkpoint(sys.argv[1], 4)
"""


@pytest.mark.timeout(120)
@pytest.mark.quick
@pytest.mark.parametrize("phase", ["commit", "tracker"])
def test_a_commit_killed_at_any_point_keeps_the_previous_checkpoint_tracked(tmp_path, phase):
    """Iteration 3 is committed; iteration 4 is fully written in staging when the rank dies."""
    save = tmp_path / "save"
    (save / "iter_0000003").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    staging = save / ".staging-iter_0000004"
    staging.mkdir()
    (staging / "metadata.json").write_text("{}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ["PYTHONPATH"]])}
    killed = subprocess.run([sys.executable, "-c", _COMMIT, str(save), f"{phase}@4"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=110)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (save / "iter_0000003").is_dir()
    # The same commit without the fault publishes iteration 4.
    if phase == "commit":
        done = subprocess.run([sys.executable, "-c", _COMMIT, str(save)], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=110)
        assert done.returncode == 0, done.stderr[-2000:]
        assert (save / "latest_checkpointed_iteration.txt").read_text() == "4"
        assert (save / "iter_0000004" / "metadata.json").is_file()
        assert not staging.exists()
