"""Run ``pretrain_gpt.main()`` as one rank for several flag lists, each in a forked child of one process.

Importing Megatron costs seconds per process; forking after one import makes each run cost
only its own setup and iterations. Each child is a world of one rank (``torchrun``'s
environment variables, a fresh port) with its stdout and stderr in files of its own. Usage::

    python tests/e2e/forked_pretrain.py '{"name": ["--flag", ...], ...}'

A case may also be ``{"flags": [...], "env": {"WORLD_SIZE": "4"}}``: its rank sees that environment
(the world size of a job the case stands for, without starting its other ranks).

prints ``{"name": {"returncode": int, "stdout": str, "stderr": str, "output": str}, ...}``
(``output``: stdout, then stderr) as JSON on stdout's last line.
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


def _run_case(pretrain_gpt, flags: list[str], stdout_path: str, stderr_path: str, env: dict | None = None) -> int:
    """In the child: stdout and stderr to files, one rank's environment, run main(), its exit code."""
    for stream, path in ((1, stdout_path), (2, stderr_path)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), stream)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    os.environ.update(env or {})
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
            paths = {stream: os.path.join(tmp, f"{name}.{stream}") for stream in ("stdout", "stderr")}
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                case = flags if isinstance(flags, dict) else {"flags": flags}
                os._exit(_run_case(pretrain_gpt, case["flags"], paths["stdout"], paths["stderr"], case.get("env")))
            _, status = os.waitpid(pid, 0)
            result = {stream: Path(path).read_text() if os.path.exists(path) else "" for stream, path in paths.items()}
            results[name] = {"returncode": os.waitstatus_to_exitcode(status), **result,
                             "output": result["stdout"] + result["stderr"]}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
