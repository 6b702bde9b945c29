#!/usr/bin/env python
"""What checkpoint checksums cost: SHA-256 while saving, and re-hashing before a load.

    python tools/bench_checksums.py                 # 512 MiB of state, 3 saves each way
    python tools/bench_checksums.py --mib 2048 --repeats 5 --json checksums.json

One process (a gloo world of one) saves ``--mib`` MiB of fp32 tensors with
``save_distributed`` (``torch_dist``, staged and committed, as ``pretrain_gpt.py --save``
writes them) ``--repeats`` times without checksums, then as often with them (recording them
stays on once on, so the order is fixed), then times the load-time check
(``agreed_mismatch``: here one rank re-hashes everything; with W ranks each re-hashes 1/W)
and the load itself. Also the bare SHA-256 rate of this CPU on an in-memory buffer. Prints a
table and one JSON object with the configuration, git revision and machine; medians.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from canzona_patches.version import quiet_megatron_notices
from megatron.canzona.cli import ArgumentParser, at_least
from megatron.canzona.provenance import git_revision, machine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=at_least(1), default=512, help="MiB of state saved (default 512)")
    parser.add_argument("--tensors", type=at_least(1), default=16, help="tensors the state is split into")
    parser.add_argument("--repeats", type=at_least(1), default=3, help="saves (and loads) per variant")
    parser.add_argument("--dir", help="where checkpoints go (default: a temporary directory, removed)")
    parser.add_argument("--json", metavar="FILE", help="also write the JSON result here")
    args = parser.parse_args(argv)
    if args.mib < 1 or args.tensors < 1 or args.repeats < 1:
        parser.error("--mib, --tensors and --repeats must be at least 1")
    return args


def timed(action) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_megatron_notices()
    logging.getLogger("megatron").setLevel(logging.ERROR)  # its note that MCore's async save is deprecated
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    import torch

    from canzona_patches.checkpoints.checksums import agreed_mismatch
    from canzona_patches.checkpoints.state import load_distributed, save_distributed
    from megatron.core.dist_checkpointing import ShardedTensor

    torch.distributed.init_process_group("gloo")
    numel = args.mib * 2**20 // 4 // args.tensors
    state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.randn(numel), replica_id=0)
             for i in range(args.tensors)}
    gib = args.mib / 1024
    buffer = os.urandom(256 << 20)
    hash_s = min(timed(lambda: hashlib.sha256(buffer).digest()) for _ in range(3))
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_checksums_"))
    print(f"bench_checksums: {args.mib} MiB in {args.tensors} tensors, {args.repeats} saves each way ...", flush=True)
    try:
        iteration = iter(range(1, 4 * args.repeats + 1))
        plain = [timed(lambda: save_distributed(state, root / "plain", next(iteration), checksums=False))
                 for _ in range(args.repeats)]
        hashed = [timed(lambda: save_distributed(state, root / "hashed", next(iteration))) for _ in range(args.repeats)]
        checkpoint = max((root / "hashed").glob("iter_*"))
        verify = [timed(lambda: agreed_mismatch(checkpoint)) for _ in range(args.repeats)]
        load = [timed(lambda: load_distributed(state, root / "hashed")) for _ in range(args.repeats)]
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
        torch.distributed.destroy_process_group()
    median = statistics.median
    rows = {
        "sha256_gib_per_s": (256 / 1024) / hash_s,
        "save_plain_s": median(plain), "save_checksummed_s": median(hashed),
        "save_extra_s_per_gib": (median(hashed) - median(plain)) / gib,
        "verify_s": median(verify), "verify_s_per_gib": median(verify) / gib,
        "load_s": median(load), "load_with_verify_s": median(load) + median(verify),
    }
    print(f"{'SHA-256 GiB/s':>14} {'save plain s':>13} {'save +sums s':>13} {'extra s/GiB':>12} "
          f"{'verify s':>9} {'verify s/GiB':>13} {'load s':>7}")
    print(f"{rows['sha256_gib_per_s']:>14.2f} {rows['save_plain_s']:>13.2f} {rows['save_checksummed_s']:>13.2f} "
          f"{rows['save_extra_s_per_gib']:>12.2f} {rows['verify_s']:>9.2f} {rows['verify_s_per_gib']:>13.2f} "
          f"{rows['load_s']:>7.2f}")
    print("verify: one rank re-hashing the whole checkpoint; with W ranks each does 1/W of it")
    report = {"config": vars(args) | {"format": "torch_dist, staged + atomic commit"}, "git_revision": git_revision(),
              "machine": {**machine(), "device": "cpu"}, "result": rows}
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
