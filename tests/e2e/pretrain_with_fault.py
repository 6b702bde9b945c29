#!/usr/bin/env python
"""``pretrain_gpt.py`` with the checkpoint fault of ``CANZONA_CKPT_FAULT`` armed in this rank
(``canzona_patches/harness/faults.py``). Launch it in place of the entry point::

    CANZONA_CKPT_FAULT=write@8:1 torchrun ... tests/e2e/pretrain_with_fault.py <pretrain_gpt.py flags>
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[0] = str(ROOT)  # the entry point's directory, not this one (its modules are tests' helpers)

import pretrain_gpt  # noqa: E402
from canzona_patches.harness.faults import arm_from_environment  # noqa: E402

if __name__ == "__main__":
    arm_from_environment()
    sys.exit(pretrain_gpt.main())
