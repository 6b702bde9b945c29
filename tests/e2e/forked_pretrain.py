"""Run ``pretrain_gpt.main()`` as one rank for several flag lists, each in a forked child of one process.

Importing Megatron costs seconds per process; forking after one import makes each run cost
only its own setup and iterations. Each child is a world of one rank (``torchrun``'s
environment variables, a fresh port) with its output in its own file. Usage::

    python tests/e2e/forked_pretrain.py '{"name": ["--flag", ...], ...}'

prints ``{"name": {"returncode": int, "output": str}, ...}`` as JSON on stdout's last line.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_case(pretrain_gpt, flags: list[str], output_path: str) -> int:
    """In the child: stdout and stderr to a file, one rank's environment, run main(), its exit code."""
    descriptor = os.open(output_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    sys.argv = ["pretrain_gpt.py", *flags]
    try:
        code = pretrain_gpt.main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001  (reported through the exit code and the output)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main() -> None:
    """Fork one child per case after a single import of pretrain_gpt."""
    cases = json.loads(sys.argv[1])
    sys.path.insert(0, str(ROOT))
    import pretrain_gpt

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in cases.items():
            output_path = os.path.join(tmp, f"{name}.out")
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                os._exit(_run_case(pretrain_gpt, flags, output_path))
            _, status = os.waitpid(pid, 0)
            results[name] = {"returncode": os.waitstatus_to_exitcode(status),
                             "output": Path(output_path).read_text() if os.path.exists(output_path) else ""}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
