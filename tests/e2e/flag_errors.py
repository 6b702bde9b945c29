"""Run ``pretrain_gpt.main()`` on several flag lists, each in a forked child of one process.

Importing Megatron costs ~6 s per process; forking after one import makes each case cost
a fraction of a second while still exercising the entry point's own parse -> validate ->
message -> exit path. Usage::

    python tests/e2e/flag_errors.py '{"name": ["--flag", ...], ...}'

prints ``{"name": {"returncode": int, "stderr": str}, ...}`` as JSON on stdout.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run_case(pretrain_gpt, flags: list[str], stderr_path: str) -> int:
    """In the child: stderr to a file, run main() as the command line would, return its exit code."""
    descriptor = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 2)
    sys.argv = ["pretrain_gpt.py", *flags]
    try:
        code = pretrain_gpt.main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001  (reported through the exit code and stderr)
        traceback.print_exc()
        code = 1
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
            stderr_path = os.path.join(tmp, f"{name}.err")
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                os._exit(_run_case(pretrain_gpt, flags, stderr_path))
            _, status = os.waitpid(pid, 0)
            results[name] = {"returncode": os.waitstatus_to_exitcode(status),
                             "stderr": Path(stderr_path).read_text() if os.path.exists(stderr_path) else ""}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
