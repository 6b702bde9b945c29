"""Start local ranks of a script the way ``torchrun --standalone`` does, forked from one process
that imported ``pretrain_gpt`` (Megatron, torch) once.

A ``torchrun`` of N ranks costs N + 1 interpreters importing torch, and N importing Megatron
(about 4 s of CPU each, measured here): on two cores, most of a short test run. This server is
started once per test session (``support.py``'s ``launch_ranks``). For each request it forks a
job leader; the leader forks the ranks, each with torchrun's rank variables and a free port,
running the script as ``__main__`` (``runpy``: its imports are already in ``sys.modules``). What the
ranks compute is what they compute under torchrun. Not torchrun's agent: no
``TORCHELASTIC_RUN_ID`` (so no parent watch, no dead-peer line naming torchrun's command);
tests of those keep torchrun.

Protocol, one JSON object per line. Request on stdin:
``{"script": path, "args": [...], "nproc": N, "env": {...}, "output": path}``, and ``"errors": path``
for stderr apart (else stderr goes to ``output`` too).
Replies on stdout: ``{"pid": leader}`` once the job started (its process group is the leader's
pid: kill it at a deadline), then ``{"returncode": rc}``: 0, or the first failing rank's code
(a signal as a negative number), after the other ranks were stopped as torchrun stops them.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

from megatron.canzona.runtime.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]
PRELOAD = (
    "megatron.core.tokenizers.text", "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.datasets.gpt_dataset", "megatron.core.datasets.helpers_cpp",
    "megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader", "torch._dynamo", "numpy.random",
    "canzona_patches.integration.optimizer", "canzona_patches.integration.setup", "canzona_patches.integration.layout",
    "canzona_patches.integration.profile", "canzona_patches.integration.megatron_fixes",
    "canzona_patches.checkpoints.state", "megatron.canzona.planning.sim",
)
"""What a run imports after ``pretrain_gpt``'s own imports (its tokenizer's transformers, the data
sets, the planner's simulator, ...: 1.5 s of a one-rank run's 3.2 s, measured), imported here once."""
STOP_GRACE_S = 5.0
"""Between SIGTERM and SIGKILL for the ranks still running once one failed (torchrun waits too)."""


def _rank(request: dict, rank: int, port: int, output_fd: int, errors_fd: int) -> int:
    """In a rank's process: torchrun's variables (the request's ``env`` may override them: a rank
    that stands for one of a larger job), the output files, the script as ``__main__``."""
    os.dup2(output_fd, 1)
    os.dup2(errors_fd, 2)
    faulthandler.enable()  # a crash in C (a fatal signal, glibc's abort) prints each thread's Python stack
    nproc = request["nproc"]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                      WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(request.get("env", {}))
    script = str(ROOT / request["script"])
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (reported through the output and the exit code)
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter runs at a normal exit (checkpoint waits, locks)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _leader(request: dict) -> int:
    """In the job's leader: fork the ranks, wait; on a failure stop the others; the job's code."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    output_fd = os.open(request["output"], flags)
    errors_fd = os.open(request["errors"], flags) if request.get("errors") else output_fd
    port = free_port()
    ranks = {}
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            os._exit(_rank(request, rank, port, output_fd, errors_fd))
        ranks[pid] = rank
    code, deadline = 0, None
    while ranks:
        if deadline is None:
            pid, status = os.waitpid(-1, 0)
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() > deadline:
                    for other in ranks:
                        os.kill(other, signal.SIGKILL)
                    deadline = float("inf")
                time.sleep(0.05)
                continue
        ranks.pop(pid, None)
        exit_code = os.waitstatus_to_exitcode(status)
        if exit_code != 0 and code == 0:
            code = exit_code
            for other in ranks:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
    return code


def main() -> None:
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    import importlib

    import pretrain_gpt  # noqa: F401  (the import every rank shares)

    for name in PRELOAD:
        importlib.import_module(name)
    # Every rank inherits these objects and none becomes garbage: out of the collector's view, a full
    # collection in a rank scans only what the rank allocates (0.6 s less each, measured)
    gc.collect()
    gc.freeze()
    threads = len(os.listdir("/proc/self/task"))
    assert threads == 1, f"the rank server runs {threads} threads after its imports: forking it is unsafe"

    stdin = os.dup(0)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the ranks read nothing; requests come on the copy
    requests = os.fdopen(stdin)

    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setsid()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                code = _leader(request)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
                code = 1
            os._exit(code & 0xFF if code >= 0 else 128 - code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"returncode": code if code < 128 else -(code - 128)}), flush=True)


if __name__ == "__main__":
    main()
