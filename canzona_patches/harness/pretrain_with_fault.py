#!/usr/bin/env python
"""``pretrain_gpt.py`` with the fault of ``CANZONA_CKPT_FAULT`` armed in this rank
(:mod:`canzona_patches.harness.faults`). Launch it in place of the entry point::

    CANZONA_CKPT_FAULT=write@8:1 torchrun ... canzona_patches/harness/pretrain_with_fault.py <pretrain_gpt.py flags>
    ENTRY=canzona_patches/harness/pretrain_with_fault.py CANZONA_CKPT_FAULT=step@5:1 examples/qwen3/pretrain_qwen3_tiny.sh

``CANZONA_START_DELAY=<rank>:<seconds>`` makes that rank sleep before ``pretrain_gpt.py`` starts, so that
the others are already waiting for it in torch's rendezvous.
"""

from __future__ import annotations

import os
import sys
import time

START_DELAY_ENV = "CANZONA_START_DELAY"


def main() -> int:
    import pretrain_gpt
    from canzona_patches.harness.faults import arm_from_environment

    arm_from_environment()
    rank, _, seconds = os.environ.get(START_DELAY_ENV, "").partition(":")
    if rank and int(rank) == int(os.environ.get("RANK", "0")):
        time.sleep(float(seconds))
    return pretrain_gpt.main()


if __name__ == "__main__":
    del sys.path[0]  # this file's folder: its neighbours are imported by their package's name
    sys.exit(main())
