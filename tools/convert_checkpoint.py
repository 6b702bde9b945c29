#!/usr/bin/env python
"""Move a ``--canzona`` run between ``--use-distributed-optimizer`` and ``--use-megatron-fsdp``:
rewrite its checkpoint in the other layout's format, then resume there.

    python tools/convert_checkpoint.py --load CKPT_DIR --save NEW_DIR --to fsdp_dtensor [--ckpt-step N]
    python tools/convert_checkpoint.py --load CKPT_DIR --save NEW_DIR --to torch_dist
    torchrun --nproc-per-node 8 tools/convert_checkpoint.py ...   # each process its share of the tensors

A ``torch_dist`` checkpoint (the distributed optimizer's) becomes an ``fsdp_dtensor`` one
(Megatron-FSDP's), or back: the model weights, the Canzona optimizer's state (Muon's momentum moved
between its hosts' pieces and Megatron-FSDP's holders), the iteration, the learning-rate schedule,
the arguments and the RNG states, written to ``NEW_DIR/iter_N`` with its checksums and tracker.
``pretrain_gpt.py --load NEW_DIR`` with the other layout's flags then resumes at any DP, TP, CP
or EP size, as from its own checkpoints (``canzona_patches.checkpoints.convert`` says how the
two formats differ). Megatron's own optimizers' state is refused (its two forms are not mapped):
``--no-load-optim`` converts the model alone, to resume with ``--no-load-optim``.

Bad input exits 2 with one line that names the fix.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

from megatron.canzona.cli import ArgumentParser, at_least


def parse_args(argv: list[str] | None) -> object:
    parser = ArgumentParser(prog="convert_checkpoint.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="the checkpoint directory (its tracked iteration)")
    parser.add_argument("--ckpt-step", type=at_least(0), default=None, help="convert this iteration instead")
    parser.add_argument("--save", required=True, help="where the converted checkpoint goes (a new directory)")
    parser.add_argument("--to", required=True, choices=("torch_dist", "fsdp_dtensor"),
                        help="torch_dist for --use-distributed-optimizer, fsdp_dtensor for --use-megatron-fsdp")
    parser.add_argument("--no-load-optim", action="store_true",
                        help="leave the optimizer state out (resume with --no-load-optim); Megatron's own optimizers need it")
    options = parser.parse_args(argv)
    if Path(options.save).resolve() == Path(options.load).resolve():
        parser.error("--save is --load: write the converted checkpoint to a new directory")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    warnings.filterwarnings("ignore")  # Megatron's import-time notes (no transformer-engine, no apex)
    import torch

    from canzona_patches.checkpoints.convert import convert
    from canzona_patches.checkpoints.files import CanzonaCheckpointError

    start = time.perf_counter()
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    scratch = None
    if not launched:  # one process: a world of one, for the checkpoint writers' collectives
        scratch = tempfile.NamedTemporaryFile(prefix="convert_checkpoint_", delete=False)
        torch.distributed.init_process_group("gloo", init_method=f"file://{scratch.name}", rank=0, world_size=1)
    else:
        torch.distributed.init_process_group("gloo")
    first = torch.distributed.get_rank() == 0
    try:
        convert(options.load, options.save, to=options.to, step=options.ckpt_step, optimizer=not options.no_load_optim,
                progress=(lambda line: print(f"[convert] {line}", flush=True)) if first else None)
    except CanzonaCheckpointError as error:
        if first:
            print(f"convert_checkpoint.py: error: {error}", file=sys.stderr, flush=True)
        return 2
    finally:
        torch.distributed.destroy_process_group()
        if scratch is not None:
            Path(scratch.name).unlink(missing_ok=True)
    if first:
        print(f"[convert] done in {time.perf_counter() - start:.1f} s; resume with --load {options.save} and the "
              f"{'--use-megatron-fsdp --ckpt-format fsdp_dtensor' if options.to == 'fsdp_dtensor' else '--use-distributed-optimizer --ckpt-format torch_dist'} flags",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
