"""Helpers of the end-to-end tests: tiny demo data and running torchrun with a deadline."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
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
