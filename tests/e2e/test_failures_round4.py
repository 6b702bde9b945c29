"""How a job fails, fourth round: a rank that stops answering is named in one line.

A rank is frozen (SIGSTOP: what a swapped-out node, a hung NFS read or a stopped process looks
like to its peers) under ``--distributed-timeout-seconds-after-init 5``: its peer's collective
times out, the survivors' roll call names the silent rank with the last complete checkpoint, and
the resume command follows on a line of its own. The job is ended once the line is out (torchrun
would SIGKILL the stopped rank after its own shutdown timeout).
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from megatron.canzona.runtime.lifetime import ranks_of

from .support import DemoData
from .test_failures import RANK_TRACEBACK, START_TIMEOUT_S, Job, recipe_env

pytestmark = [pytest.mark.slow, pytest.mark.alone]

LINE_AFTER_FREEZE_S = 60  # the 5 s timeout, the 10 s roll call, and slack for a loaded machine


def test_a_rank_that_stops_answering_is_named_with_the_way_on(demo_data: DemoData, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    job = Job(recipe_env(demo_data, tmp_path, VARIANT="canzona", TRAIN_ITERS="100000", CKPT_DIR=str(ckpt),
                         SAVE_INTERVAL="2", EVAL_ITERS="0"), "--distributed-timeout-seconds-after-init", "5")
    try:
        job.wait_for(r"iteration +3/ +100000 \|", START_TIMEOUT_S)
        frozen = ranks_of(job.process.pid)["1"]
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.monotonic()
        match = job.wait_for(r"pretrain_gpt\.py: error: (.*)\n(.*)\n", LINE_AFTER_FREEZE_S)
        took_s = time.monotonic() - stopped_at
    finally:
        job.kill()
    line, command = match[1], match[2]
    assert line.startswith("rank 1 did not answer after a collective timed out (frozen, swapped out, stuck in I/O, "
                           "node lost?; gloo: "), line
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert line.endswith(f"; the last complete checkpoint is {ckpt}/iter_{saved:07d} (resume command below)"), line
    assert len(line) < 300 - len("pretrain_gpt.py: error: ") + len(str(ckpt)), line
    assert command.startswith("  resume: ") and "torch.distributed.run" in command, command
    assert took_s < LINE_AFTER_FREEZE_S and len(re.findall(r"pretrain_gpt\.py: error: ", job.output)) == 1
    assert not RANK_TRACEBACK.search(job.output), job.output[-6000:]
