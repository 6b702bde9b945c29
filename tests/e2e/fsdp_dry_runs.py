#!/usr/bin/env python
"""``tools/dry_run.py`` for several flag lists in one process (its imports, 5 s, once): reads a JSON
list of argument lists on stdin, prints one JSON line per list, ``{"code": exit code, "report":
the --json report or null, "errors": what it printed on stderr}``. Used by
``tests/e2e/test_canzona_fsdp.py`` to hold ``dry_run.py --fsdp``'s prediction to the runs."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    sys.path.insert(0, str(ROOT / "tools"))
    import torch.distributed as dist

    import dry_run
    from megatron.core import parallel_state

    for argv in json.loads(sys.stdin.read()):
        out, errors = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(errors):
            code = dry_run.main([*argv, "--json"])
        parallel_state.destroy_model_parallel()  # each list builds its own fake world
        if dist.is_initialized():
            dist.destroy_process_group()
        lines = out.getvalue().strip().splitlines()
        print(json.dumps({"code": code, "report": json.loads(lines[-1]) if lines else None,
                          "errors": errors.getvalue()[-3000:]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
