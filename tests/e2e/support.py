"""Helpers of the end-to-end tests: tiny demo data and running torchrun with a deadline."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "data" / "books" / "carroll-alice.txt"
VOCAB_SIZE = 512


@dataclass(frozen=True)
class DemoData:
    """A tokenizer and an indexed dataset made from one shipped book."""

    tokenizer_model: Path
    data_prefix: str


def make_demo_data(out: Path) -> DemoData:
    """Alice in Wonderland (38 documents, ~69k tokens, vocabulary 512) in ``out``, made in ~5 s."""
    spec = importlib.util.spec_from_file_location("prepare_demo_data", ROOT / "tools" / "prepare_demo_data.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    argv = ["--books", str(BOOK), "--output-dir", str(out), "--vocab-size", str(VOCAB_SIZE)]
    assert prepare.main(argv) == 0
    return DemoData(tokenizer_model=out / "tokenizer.model", data_prefix=str(out / "demo_text_document"))


def run_with_deadline(command: list[str], *, timeout_s: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` from the repository root; kill its whole process group at the deadline.

    torchrun's ranks are grandchildren, so the command gets its own session and a hang is
    ended with ``killpg`` (then reported as a test failure with the output's tail).
    """
    # Unbuffered: each print reaches the shared pipe in one write, so lines of different ranks
    # do not cut into each other mid-text.
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(command[:6])} ... did not finish in {timeout_s} s:\n{output[-4000:]}")
    return subprocess.CompletedProcess(command, process.returncode, output, None)


def torchrun(nproc: int, script: str, *args: str) -> list[str]:
    """The command that starts ``nproc`` local gloo ranks of ``script`` (a free port each time)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), script, *args]


WITH_HIDDEN_MODULES = {"CANZONA_TESTS_HIDDEN_MODULES": ""}
"""Environment for a process that needs the test-only packages ``tests/conftest.py`` hides from the
processes tests start (``transformers``, ``wandb``)."""

IMPORT_TIME_ENV = ("HF_", "TRANSFORMERS_", "MKL_", "ATEN_", "TORCH_", "PYTORCH_", "CUDA_", "NCCL_")
"""Prefixes of variables that modules read when imported: a launch whose ``env`` sets one gets a
rank server started with it (the ranks of the shared one imported with the test session's)."""


class _RankServer:
    """``rank_server.py`` processes, one per set of import-time variables, started at first use and
    stopped at exit."""

    processes: dict[tuple, subprocess.Popen] = {}

    @classmethod
    def get(cls, env: dict[str, str]) -> subprocess.Popen:
        key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)))
        process = cls.processes.get(key)
        if process is None or process.poll() is not None:
            # It imports them all once, so its ranks have every module (WITH_HIDDEN_MODULES).
            full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **WITH_HIDDEN_MODULES, **dict(key)}
            process = subprocess.Popen([sys.executable, "-u", str(ROOT / "tests" / "e2e" / "rank_server.py")],
                                       cwd=ROOT, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL, text=True)
            atexit.register(process.kill)
            cls.processes[key] = process
        return process

    @staticmethod
    def reply(process: subprocess.Popen, timeout_s: float) -> dict | None:
        """The server's next line, or None at the deadline."""
        ready, _, _ = select.select([process.stdout], [], [], max(timeout_s, 0.0))
        if not ready:
            return None
        line = process.stdout.readline()
        if not line:
            raise RuntimeError("tests/e2e/rank_server.py exited")
        return json.loads(line)


def launch_ranks(nproc: int, script: str, *args: str, timeout_s: float, env: dict[str, str] | None = None,
                 separate_stderr: bool = False) -> subprocess.CompletedProcess:
    """``run_with_deadline(torchrun(nproc, script, *args))`` without starting interpreters: the ranks
    are forked from one process that imported Megatron (``rank_server.py``; not torchrun's agent).
    Output: every rank's stdout and stderr, as torchrun passes them through (``separate_stderr``:
    stderr apart); at the deadline the job is killed and the test fails with its output's tail."""
    server = _RankServer.get(env or {})
    paths = []
    for kind in ("output", "errors")[:1 + separate_stderr]:
        with tempfile.NamedTemporaryFile(prefix=f"ranks-{kind}-", suffix=".log", delete=False) as file:
            paths.append(Path(file.name))
    request = {"script": script, "args": list(args), "nproc": nproc, "output": str(paths[0]),
               "errors": str(paths[-1]) if separate_stderr else None,
               "env": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}}
    server.stdin.write(json.dumps(request) + "\n")
    server.stdin.flush()
    deadline = time.monotonic() + timeout_s
    started = _RankServer.reply(server, 60.0)
    assert started is not None and "pid" in started, started
    done = _RankServer.reply(server, deadline - time.monotonic())
    if done is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(started["pid"], signal.SIGKILL)
        _RankServer.reply(server, 60.0)
    texts = [path.read_text(errors="replace") for path in paths]
    for path in paths:
        path.unlink()
    if done is None:
        pytest.fail(f"{nproc} ranks of {script} {' '.join(args[:4])} ... did not finish in {timeout_s} s:\n"
                    f"{''.join(texts)[-4000:]}")
    return subprocess.CompletedProcess([script, *args], done["returncode"], texts[0],
                                       texts[1] if separate_stderr else None)


HEAP_ABORT_LINES = ("malloc(): ", "free(): ", "double free or corruption", "corrupted size vs. prev_size")
"""glibc's lines when it aborts a process whose heap it found corrupted."""


def heap_aborted(result: subprocess.CompletedProcess) -> bool:
    """Whether a job stopped on glibc's heap check (SIGABRT, with one of :data:`HEAP_ABORT_LINES`), or
    on a segmentation fault its ranks' fault handler reported (the same runs once segfaulted in
    Megatron's own gloo all-reduce of ``train_step`` after an ``fsdp_dtensor`` save, in a CI run of the
    whole suite; the same test passed in the next three runs of it)."""
    if result.returncode == -signal.SIGSEGV and "Fatal Python error: Segmentation fault" in result.stdout:
        return True
    return result.returncode == -signal.SIGABRT and any(line in result.stdout for line in HEAP_ABORT_LINES)


def launch_ranks_once_more_after_heap_abort(out: Path, nproc: int, script: str, *args: str,
                                            **kwargs) -> subprocess.CompletedProcess:
    """:func:`launch_ranks`, and once more, with ``out`` (everything the job writes) emptied, when the
    first job stopped on glibc's heap check: Megatron-FSDP's CPU runs have aborted so once in a CI run
    of the whole suite (``malloc(): unaligned tcache chunk detected`` at the first gradient
    reduce-scatter of ``--ddp-bucket-size 20000``), never in 21 runs of the same job here, with
    freed memory poisoned or not, under torchrun or the rank server; or on a segmentation fault
    (:func:`heap_aborted`). The crash is reported as a warning, with the Python stack the ranks'
    fault handler printed; a second one fails the test."""
    result = launch_ranks(nproc, script, *args, **kwargs)
    if not heap_aborted(result):
        return result
    warnings.warn(f"{nproc} ranks of {script} stopped on glibc's heap check; run once more:\n"
                  f"{result.stdout[-3000:]}", stacklevel=2)
    shutil.rmtree(out, ignore_errors=True)
    return launch_ranks(nproc, script, *args, **kwargs)


def run_cases(cases: dict[str, list[str] | dict], *, timeout_s: float,
              env: dict[str, str] | None = None) -> dict[str, dict]:
    """``pretrain_gpt.py`` as one rank for each case (a flag list, or ``{"flags": [...], "env": {...}}``:
    a rank that sees that environment, e.g. the world size of a job the case stands for), one after
    another through :func:`launch_ranks`. Per case: ``returncode``, ``stdout``, ``stderr`` and
    ``output`` (stdout, then stderr)."""
    results = {}
    for name, case in cases.items():
        case = case if isinstance(case, dict) else {"flags": case}
        done = launch_ranks(1, "pretrain_gpt.py", *case["flags"], timeout_s=timeout_s,
                            env={**(env or {}), **case.get("env", {})}, separate_stderr=True)
        results[name] = {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
                         "output": done.stdout + done.stderr}
    return results
