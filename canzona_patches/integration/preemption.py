"""A job told to stop (SIGTERM: ``scancel``, preemption, a SIGTERM to ``torchrun``) saves if it can.

Megatron's ``--exit-signal-handler`` makes every rank finish its iteration, save a checkpoint
to ``--save`` and exit 0 when ``--exit-signal`` (default SIGTERM) arrives. Under torchrun,
SIGTERM is also what a job's surviving ranks get when one rank died; those are told apart by
:func:`megatron.canzona.runtime.peers.watch_for_lost_peers`, which asks :func:`stop_on_sigterm`
only when every rank of the node runs, i.e. when the job was told to stop.

Then, with ``--exit-signal-handler``, SIGTERM is taken as the exit signal whatever
``--exit-signal`` names (the recipes listen for SIGUSR1, which SLURM sends before the time limit;
preemption and ``scancel`` send SIGTERM): Megatron's handler for the exit signal is called, and
the job saves at the next iteration boundary. Without it, nothing can be saved: the job says so
in one line naming the flag, and ends.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from typing import Any

from canzona_patches.checkpoints.recovery import last_complete_checkpoint


def sigterm_handler() -> Any:
    """What handles SIGTERM now (read before the lost-peer watch takes it over)."""
    return signal.getsignal(signal.SIGTERM)


def exit_handler_of(args: argparse.Namespace) -> Callable[[int, Any], Any] | None:
    """Megatron's handler of ``--exit-signal`` (installed as the flags are set), or ``None``
    without ``--exit-signal-handler``. Read before anything else takes SIGTERM over."""
    if not args.exit_signal_handler:
        return None
    handler = signal.getsignal(args.exit_signal)
    return handler if callable(handler) else None


def stop_on_sigterm(args: argparse.Namespace, exit_handler: Callable[[int, Any], Any] | None,
                    previous: Any, first: bool) -> bool:
    """On a SIGTERM that tells the job to stop: hand it to Megatron's exit handler, which saves at
    the next iteration boundary (return ``True``: the rank goes on), or say in one line, on the
    ``first`` rank only, that nothing is saved and which flag would have (``False``: it ends),
    then hand it to the handler SIGTERM had before (``previous``: Megatron's orderly shutdown of
    ``--exit-signal-handler-for-training``), if it had one."""
    # Megatron sets curr_iteration as a step begins: that many iterations are done at least (the
    # step under way, or just logged, is the next); "before training" while the model is built.
    iteration = getattr(args, "curr_iteration", None)
    at = f" after iteration {iteration}" if iteration is not None else " before training"
    if exit_handler is not None:
        exit_handler(args.exit_signal, None)
        if first:
            if args.save:
                print(f"[canzona] SIGTERM{at}: every rank saves a checkpoint to --save {args.save} at the next "
                      "iteration boundary, then exits (--exit-signal-handler)", flush=True)
            else:
                print(f"pretrain_gpt.py: warning: SIGTERM{at}: the job stops at the next iteration boundary and "
                      "saves nothing: there is no --save", file=sys.stderr, flush=True)
        return True
    if first:
        print(f"pretrain_gpt.py: error: {_nothing_saved(args, at)}", file=sys.stderr, flush=True)
    if callable(previous):
        previous(signal.SIGTERM, None)
    return False


def _nothing_saved(args: argparse.Namespace, at: str) -> str:
    if not args.save:
        return (f"stopped by SIGTERM{at}: nothing was saved (there is no --save); pass --save DIR with "
                "--exit-signal-handler to save a checkpoint at the next iteration boundary when SIGTERM comes")
    checkpoint = last_complete_checkpoint(args.save)
    since = f"since {checkpoint}" if checkpoint is not None else f"(no checkpoint under --save {args.save} yet)"
    return (f"stopped by SIGTERM{at}: nothing was saved {since}; pass --exit-signal-handler to save a checkpoint "
            "at the next iteration boundary when SIGTERM comes")
