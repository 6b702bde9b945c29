"""A job told to stop saves: SIGTERM (``scancel``, preemption, a SIGTERM to ``torchrun``) under
``--exit-signal-handler`` saves a checkpoint at the next iteration boundary, and the resume is
bitwise the uninterrupted run; without the flag, one line says nothing was saved and names it.

Each runs the qwen3-tiny recipe (Muon with ``--canzona``, 2 gloo ranks) under torchrun, whose
relaying of SIGTERM is what is tested; launches are shared between assertions.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch

from megatron.canzona.runtime.lifetime import ranks_of
from tools.chaos import checkpoint_tensors

from .support import DemoData
from .test_failures import RANK_TRACEBACK, START_TIMEOUT_S, Job, recipe_env
from .test_resume import metrics_of

pytestmark = [pytest.mark.slow, pytest.mark.alone]

ITERS = 8
RUN_TIMEOUT_S = 240
TRACKER = "latest_checkpointed_iteration.txt"
ERROR_LINE = re.compile(r"^pretrain_gpt\.py: error: .*$", re.MULTILINE)


def _env(data: DemoData, out: Path, **extra: str) -> dict[str, str]:
    return recipe_env(data, out, VARIANT="canzona", TRAIN_ITERS=str(ITERS), CKPT_DIR=str(out / "ckpt"),
                      SAVE_INTERVAL="1000", EVAL_ITERS="0", **extra)


def _stopped(env: dict[str, str], at: int, *, to: str) -> tuple[int, str]:
    """The recipe, sent SIGTERM once iteration ``at`` is logged: to torchrun (which relays it) or
    to every rank (as scancel and preemption send it); its exit status and output."""
    job = Job(env)
    try:
        job.wait_for(rf"iteration +{at}/ +{ITERS} \|", START_TIMEOUT_S)
        targets = [job.process.pid] if to == "torchrun" else list(ranks_of(job.process.pid).values())
        for pid in targets:
            os.kill(pid, signal.SIGTERM)
        return job.finish(RUN_TIMEOUT_S)
    finally:
        job.kill()


def _run(env: dict[str, str]) -> str:
    code, out = Job(env).finish(RUN_TIMEOUT_S)
    assert code == 0, out[-6000:]
    return out


@pytest.fixture(scope="module")
def preempted(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted run; the same run sent SIGTERM to torchrun at iteration 3 with the recipe's
    --exit-signal SIGUSR1, then resumed to the end; the same, SIGTERM to every rank under
    Megatron's default exit signal; and one without --exit-signal-handler."""
    root = tmp_path_factory.mktemp("preemption")
    out: dict = {"straight": root / "straight", "stopped": root / "stopped"}
    out["straight_out"] = _run(_env(demo_data, out["straight"]))
    env = _env(demo_data, out["stopped"])
    out["code"], out["stop_out"] = _stopped(env, 3, to="torchrun")
    out["saved_at"] = int((out["stopped"] / "ckpt" / TRACKER).read_text())
    out["resume_out"] = _run(env)
    out["ranks_code"], out["ranks_out"] = _stopped(_env(demo_data, root / "ranks", EXIT_SIGNAL="SIGTERM"), 3,
                                                   to="ranks")
    out["ranks_ckpt"] = root / "ranks" / "ckpt"
    out["unhandled_code"], out["unhandled_out"] = _stopped(_env(demo_data, root / "unhandled", EXIT_SIGNAL="none"),
                                                           3, to="torchrun")
    out["unhandled_ckpt"] = root / "unhandled" / "ckpt"
    return out


def test_sigterm_to_torchrun_saves_at_the_next_iteration_boundary(preempted):
    out, saved = preempted["stop_out"], preempted["saved_at"]
    assert 3 <= saved < ITERS, out[-6000:]
    assert f"successfully saved checkpoint from iteration {saved:7d}" in out, out[-6000:]
    # Said once, by the first rank; not anchored at a line's start: the handler runs between two
    # bytecodes of whatever the rank was printing, so its line may follow a half-written one.
    assert len(re.findall(r"\[canzona\] SIGTERM after iteration \d+: every rank saves a checkpoint", out)) == 1
    assert not re.search(rf"iteration +{saved + 1}/ +{ITERS} \|", out), "trained on past the save"
    # Every rank exited 0 (Megatron's code after an exit-signal save); torchrun reports its signal.
    assert "got signal: 15" in out and "exitcode" not in out, out[-6000:]
    assert not ERROR_LINE.search(out) and not RANK_TRACEBACK.search(out), out[-6000:]


def test_the_resume_after_a_preemption_is_bitwise_the_uninterrupted_run(preempted):
    saved = preempted["saved_at"]
    assert re.search(rf"iteration +{saved + 1}/ +{ITERS} \|", preempted["resume_out"])
    straight, stopped = metrics_of(preempted["straight"]), metrics_of(preempted["stopped"])
    assert sorted(stopped) == sorted(straight) == list(range(1, ITERS + 1))  # both runs' lines, appended
    for iteration in straight:
        for key in ("lm_loss", "grad_norm", "consumed_samples"):
            assert stopped[iteration][key] == straight[iteration][key], (iteration, key)
    reference = checkpoint_tensors(preempted["straight"] / "ckpt")
    resumed = checkpoint_tensors(preempted["stopped"] / "ckpt")
    assert sorted(reference) == sorted(resumed)
    # The saved RNG states aside: on CPU a resumed generator drifts from the uninterrupted one
    # (tools/chaos.py's compare), which nothing here depends on with dropout off.
    compared = [key for key in reference if not key.startswith("rng_state/")]
    different = [key for key in compared if not torch.equal(reference[key], resumed[key])]
    assert len(compared) > 10 and not different, different[:5]


def test_sigterm_to_every_rank_saves_under_megatrons_default_exit_signal(preempted):
    out, ckpt = preempted["ranks_out"], preempted["ranks_ckpt"]
    saved = int((ckpt / TRACKER).read_text())
    assert saved >= 3 and f"successfully saved checkpoint from iteration {saved:7d}" in out, out[-6000:]
    assert preempted["ranks_code"] == 0, out[-6000:]  # every rank saved and exited 0: so does torchrun


def test_sigterm_without_the_exit_handler_says_nothing_was_saved_and_names_the_flag(preempted):
    out = preempted["unhandled_out"]
    lines = ERROR_LINE.findall(out)
    assert len(lines) == 1, out[-6000:]
    assert re.match(r"pretrain_gpt\.py: error: stopped by SIGTERM after iteration \d+: nothing was saved", lines[0])
    assert "--exit-signal-handler" in lines[0] and len(lines[0]) < 300, lines[0]
    assert preempted["unhandled_code"] != 0 and not (preempted["unhandled_ckpt"] / TRACKER).exists()
    assert not RANK_TRACEBACK.search(out), out[-6000:]
