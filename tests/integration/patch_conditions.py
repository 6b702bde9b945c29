"""Which rows of canzona_patches.registry.PATCHES hold for parsed flag lists, and what
installing them twice does; run by ``test_patch_registry_install.py`` in a process of its own
(``pretrain_gpt.parse_and_validate`` switches this CPU process to CPU mode, and installing
patches Megatron for the life of the process). Usage::

    python tests/integration/patch_conditions.py '{"name": ["--flag", ...], ...}'

prints ``{"conditions": {name: [first target of each row that holds]}, "twice": {...},
"import": {...}}``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _value(target: str):
    module, _, path = target.partition(":")
    owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return getattr(owner, name)


def main() -> None:
    cases = json.loads(sys.argv[1])
    sys.path.insert(0, str(ROOT))
    with contextlib.redirect_stdout(io.StringIO()):
        import torch

        compile_before = torch.compile
        import pretrain_gpt
        from canzona_patches import registry
        from canzona_patches.emulation import cpu
        from megatron.core import jit
    imported = {
        "compiler_imported": "torch._dynamo" in sys.modules or "torch._inductor.compile_fx" in sys.modules,
        "compile_restored": torch.compile is compile_before,
        "jit_fuser_deferred": jit.jit_fuser is not compile_before and jit.jit_fuser.__qualname__.startswith(
            "compiling_on_first_call"),
    }

    pretrain_gpt.set_global_variables = lambda args, **_: None  # parse several flag lists in one process
    os.environ.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    conditions, parsed = {}, {}
    for name, flags in cases.items():
        sys.argv = ["pretrain_gpt.py", *flags]
        with contextlib.redirect_stdout(io.StringIO()):
            parsed[name] = pretrain_gpt.parse_and_validate()
        conditions[name] = [p.targets[0] for p in registry.PATCHES if p.make is not None and p.when(parsed[name])]
    unresolved = [p.make for p in registry.PATCHES if p.make is not None
                  and not callable(getattr(importlib.import_module(p.make.split(":")[0]), p.make.split(":")[1], None))]

    args = parsed[next(iter(cases))]
    rows = registry.install(args)
    first = {t: _value(t) for p in rows for t in p.targets}
    registry.install(args)
    cpu.enable_cpu_training_mode()
    second = {t: _value(t) for p in rows for t in p.targets}
    ours = {id(v) for v in first.values()}
    twice = {
        "rows": len(rows),
        "changed_by_second_install": sorted(t for t in first if second[t] is not first[t]),
        "wrapping_a_wrapper": sorted(t for t, v in first.items() if id(getattr(v, "__wrapped__", None)) in ours),
        "all_in_place": all(registry.installed(p) for p in rows),
    }
    print(json.dumps({"conditions": conditions, "unresolved": unresolved, "twice": twice, "import": imported}))


if __name__ == "__main__":
    main()
