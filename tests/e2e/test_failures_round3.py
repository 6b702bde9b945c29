"""How a job fails, third round: a dead peer in one line, NaN runs that say so, failed saves
cleaned up at the next start.

Each runs the qwen3-tiny recipe (test_failures.py's :class:`Job`: torchrun, gloo ranks, a
deadline on every wait) on the demo data; launches are shared between assertions.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from megatron.canzona.runtime.launcher import free_port
from megatron.canzona.runtime.lifetime import ranks_of

from .support import DemoData
from .test_failures import EXIT_AFTER_KILL_S, RANK_TRACEBACK, START_TIMEOUT_S, Job, recipe_env

pytestmark = [pytest.mark.slow, pytest.mark.alone]

RUN_TIMEOUT_S = 240
ERROR_LINE = re.compile(r"^pretrain_gpt\.py: error: .*$", re.MULTILINE)
FAULT_LINE = "[test fault] CANZONA_CKPT_FAULT: killing rank 1 during 'write' of iteration 4"



def _digests(directory: Path) -> dict[str, str]:
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file()}


def _bytes(directory: Path) -> int:
    return sum(f.lstat().st_size for f in directory.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def save_killed_on_another_node(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two "nodes" on this host (NNODES=2, one rank each, static rendezvous), AdamW saving every 2
    iterations; rank 1 (node 1) SIGKILLs itself in iteration 4's save, after writing its files.
    Rank 0 learns it from gloo (its torchrun saw nothing die)."""
    tmp = tmp_path_factory.mktemp("dead_peer")
    ckpt = tmp / "ckpt"
    env = recipe_env(demo_data, tmp, TRAIN_ITERS="6", SAVE_INTERVAL="2", CKPT_DIR=str(ckpt), EVAL_ITERS="0",
                     NPROC_PER_NODE="1", NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                     ENTRY="canzona_patches/harness/pretrain_with_fault.py", CANZONA_CKPT_FAULT="write@4:1")
    nodes = [Job({**env, "NODE_RANK": str(node)}) for node in (0, 1)]
    try:
        nodes[1].wait_for(re.escape(FAULT_LINE), START_TIMEOUT_S)
        killed_at = time.monotonic()
        code = nodes[0].wait(EXIT_AFTER_KILL_S)
        took_s = time.monotonic() - killed_at
        nodes[1].wait(EXIT_AFTER_KILL_S)
    finally:
        for job in nodes:
            job.kill()
    staging = ckpt / ".staging-iter_0000004"
    return {"ckpt": ckpt, "code": code, "took_s": took_s, "survivor": nodes[0].output, "victim": nodes[1].output,
            "staging_bytes": _bytes(staging) if staging.is_dir() else None, "env": env,
            "kept": _digests(ckpt / "iter_0000002")}


def test_a_dead_peer_on_another_node_is_one_line(save_killed_on_another_node: dict) -> None:
    """The survivor stops within the deadline and prints one line: the rank gone, gloo's words,
    the last complete checkpoint and the command that resumes from it; no traceback of its own."""
    run = save_killed_on_another_node
    survivor, ckpt = run["survivor"], run["ckpt"]
    assert run["code"] != 0 and run["took_s"] < EXIT_AFTER_KILL_S, survivor[-6000:]
    lines = ERROR_LINE.findall(survivor + run["victim"])
    assert len(lines) == 1, lines or survivor[-6000:]
    assert lines[0].startswith("pretrain_gpt.py: error: rank 1 is gone ("), lines[0]
    assert re.search(r"gloo: .*(Connection (reset|closed) by peer)", lines[0]), lines[0]
    assert lines[0].endswith(f"; the last complete checkpoint is {ckpt}/iter_0000002 (resume command below)"), lines[0]
    assert len(lines[0]) < 300 + len(str(ckpt)), lines[0]  # under 300 but for the path
    command = survivor.split(lines[0] + "\n", 1)[1].splitlines()[0]
    assert command.startswith("  resume: "), command
    assert "torch.distributed.run" in command and "--node-rank 0" in command and f"--load {ckpt}" in command, command
    assert not RANK_TRACEBACK.search(survivor), survivor[-6000:]
    assert "ChildFailedError" in survivor  # torchrun's own report follows, as before
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert run["staging_bytes"], "the killed save left no staging directory to clean up"


def test_the_next_start_removes_the_killed_save_and_keeps_the_checkpoint(save_killed_on_another_node: dict,
                                                                        tmp_path: Path) -> None:
    """The resume (one node, two ranks) removes the staging directory before it writes anything,
    says so once with the bytes freed, leaves iter_0000002 as it was, and trains on to the end."""
    run = save_killed_on_another_node
    ckpt = run["ckpt"]
    env = {**run["env"], "LOG_DIR": str(tmp_path), "NPROC_PER_NODE": "2", "NNODES": "1", "NODE_RANK": "0"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "ENTRY", "CANZONA_CKPT_FAULT"):
        env.pop(name)
    code, out = Job(env).finish(RUN_TIMEOUT_S)
    assert code == 0, out[-6000:]
    freed = run["staging_bytes"]
    removed = re.findall(r"^\[canzona\] removed what a failed or killed save left under --save (\S+) "
                         r"\((\S+)\): [\d.]+ [kMG]B \((\d+) bytes\) freed$", out, re.MULTILINE)
    assert removed == [(str(ckpt), ".staging-iter_0000004", str(freed))], (removed, freed, out[-6000:])
    assert out.index("[canzona] removed what") < out.index("saving checkpoint at iteration")
    assert not any(p.name.startswith(".staging-") for p in ckpt.iterdir()), sorted(os.listdir(ckpt))
    assert _digests(ckpt / "iter_0000002") == run["kept"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert not ERROR_LINE.search(out), out[-6000:]


def test_a_dead_peer_on_this_node_is_one_line(demo_data: DemoData, tmp_path: Path) -> None:
    """One node, two ranks, no --save: rank 0 is stopped (SIGSTOP) while rank 1 is SIGKILLed, so
    torchrun's SIGTERM is waiting for it when it runs on; it prints one line naming rank 1 and
    saying there is nothing to resume from, and no traceback."""
    job = Job(recipe_env(demo_data, tmp_path, TRAIN_ITERS="100000"))
    try:
        job.wait_for(r"iteration +3/ +100000 \|", START_TIMEOUT_S)
        ranks = ranks_of(job.process.pid)
        assert set(ranks) >= {"0", "1"}, ranks
        os.kill(ranks["0"], signal.SIGSTOP)
        try:
            os.kill(ranks["1"], signal.SIGKILL)
            killed_at = time.monotonic()
            time.sleep(1.0)
        finally:
            os.kill(ranks["0"], signal.SIGCONT)
        code = job.wait(EXIT_AFTER_KILL_S)
        took_s = time.monotonic() - killed_at
    finally:
        job.kill()
    out = job.output
    assert code != 0 and took_s < EXIT_AFTER_KILL_S, out[-6000:]
    lines = ERROR_LINE.findall(out)
    assert len(lines) == 1, lines or out[-6000:]
    assert lines[0].startswith("pretrain_gpt.py: error: rank 1 is gone ("), lines[0]
    assert lines[0].endswith("; there is no --save: nothing to resume from (command to start again below)")
    assert out.split(lines[0] + "\n", 1)[1].startswith("  start again: "), out[-6000:]
    assert not RANK_TRACEBACK.search(out), out[-6000:]
    assert re.search(rf"exitcode\s*: -9 \(pid: {ranks['1']}\)", out), out[-6000:]


@pytest.fixture(scope="module")
def nan_check_off(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Muon under --canzona at lr 1e6 with Megatron's NaN check off: iterations 1-2 train, every
    later one is skipped for a non-finite gradient norm. The first run stops at 6 (--exit-interval,
    saving); the second resumes to 8 and trains nothing."""
    tmp = tmp_path_factory.mktemp("nan_check_off")
    env = recipe_env(demo_data, tmp, VARIANT="canzona", TRAIN_ITERS="8", LOG_INTERVAL="2", LR="1e6", MIN_LR="0",
                     CKPT_DIR=str(tmp / "ckpt"), SAVE_INTERVAL="100", EVAL_ITERS="0")
    first = Job(env, "--no-check-for-nan-in-loss-and-grad", "--exit-interval", "6").finish(RUN_TIMEOUT_S)
    resumed = Job(env, "--no-check-for-nan-in-loss-and-grad").finish(RUN_TIMEOUT_S)
    metrics = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    return {"first": first, "resumed": resumed, "metrics": {m["iteration"]: m for m in metrics}}


LOG_LINE = re.compile(r"\] iteration +(\d+)/ +8 \|.*?\| global batch size: +\d+ \|(?: lm loss: (\S+) \|)?.*?"
                      r"number of skipped iterations: +(\d+) \|")
WARNING = "[canzona] warning: all {} iteration(s) of this log interval were skipped"


def test_skipped_intervals_warn_and_log_their_loss(nan_check_off: dict) -> None:
    """Each log interval whose iterations were all skipped warns once, naming the flag; its
    lm loss is the skipped iterations' loss (not 0), in Megatron's line and the metrics file."""
    code, out = nan_check_off["first"]
    assert code == 0, out[-6000:]
    logged = {int(it): (loss, int(skipped)) for it, loss, skipped in LOG_LINE.findall(out)}
    assert sorted(logged) == [1, 2, 4, 6], out[-6000:]
    assert logged[2][1] == 0 and logged[4][1] == 2 and logged[6][1] == 2, logged
    for iteration in (4, 6):
        loss = logged[iteration][0]
        assert loss and float(loss) > 0.0, logged  # Megatron alone prints 0.000000E+00
        assert nan_check_off["metrics"][iteration]["lm_loss"] == pytest.approx(float(loss), rel=1e-6)
    assert out.count(WARNING.format(2)) == 2, out[-6000:]
    assert "--no-check-for-nan-in-loss-and-grad" in out.split(WARNING.format(2))[1].splitlines()[0]
    assert not ERROR_LINE.search(out)


def test_a_run_that_trained_nothing_exits_non_zero_naming_the_flag(nan_check_off: dict) -> None:
    code, out = nan_check_off["resumed"]
    assert code != 0, out[-6000:]
    lines = ERROR_LINE.findall(out)
    assert lines == ["pretrain_gpt.py: error: all 2 iterations were skipped: the gradient norm was inf or NaN each "
                     "time and nothing trained; --no-check-for-nan-in-loss-and-grad let the run go on: drop it to "
                     "stop at the first NaN (and see where it starts), then lower --lr or fix the input"], lines
    assert WARNING.format(1) in out and WARNING.format(2) in out, out[-6000:]  # iteration 7 (first), then 7-8
    assert float(nan_check_off["metrics"][8]["lm_loss"]) > 0.0
    assert not RANK_TRACEBACK.search(out), out[-6000:]
