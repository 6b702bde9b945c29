"""Start N local processes with torch.distributed initialized, for tests and CPU tools.

:func:`launch` is a small torchrun for one machine: it spawns ``world_size`` fresh Python
processes, gives each the usual ``RANK``/``WORLD_SIZE``/``MASTER_*`` environment, joins them
into one process group, runs ``fn(*args, **kwargs)`` on every rank and returns the per-rank
results in rank order. A rank that raises fails the launch at once with that rank's
traceback; a rank still running at the deadline fails it with :class:`TimeoutError`. Either
way every child process is stopped before :func:`launch` returns or raises.
"""

from __future__ import annotations

import contextlib
import gc
import io
import multiprocessing
import os
import pickle
import queue
import random
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_POLL_S = 0.5
_DEAD_PEER_S = 5.0
"""How long a rank's broken-connection error waits for a dead peer's exit code to show, so the
dead rank is the one reported (its death is the likely root cause). Waited only on that error path,
and only until a dead peer shows: a failure with every peer alive costs the whole wait, once."""
_STOP_GRACE_S = 5.0
PRELOAD_ENV = "CANZONA_LAUNCH_PRELOAD"
"""Comma-separated module names. When set, ranks are forked from one server process that imported
these modules once (multiprocessing's ``forkserver``, kept for the life of the calling process)
instead of each rank being a fresh interpreter that imports them again (``spawn``): a test session
of many launches pays Megatron's import once, not once per rank and launch. The server starts at
the first launch, before any rank initializes a process group, so every rank still starts from a
process that has only imported modules."""


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How :func:`launch` starts and supervises its ranks."""

    world_size: int
    """Number of processes (ranks) to start."""
    timeout_s: float = 120.0
    """Wall-clock limit for the whole run; also the process group's collective timeout."""
    backend: str = "gloo"
    """torch.distributed backend every rank initializes."""
    num_threads: int = 1
    """torch intra-op threads per rank; ranks share the machine's cores."""
    master_addr: str = "127.0.0.1"
    """Address of the rendezvous store (rank 0 hosts it)."""


class RankError(RuntimeError):
    """A rank raised or died; the message carries its traceback as seen in the child."""

    def __init__(self, rank: int, remote_traceback: str) -> None:
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback


def launch(
    fn: Callable[..., Any], config: LaunchConfig, /, *args: Any, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``config.world_size`` new processes; return their results.

    ``fn`` runs after ``torch.distributed.init_process_group`` and before
    ``destroy_process_group``. It must be importable by name (a module-level function),
    because ranks are started with the ``spawn`` method (or forked from a server process, see
    :data:`PRELOAD_ENV`); its arguments must pickle and its
    return value must go through ``torch.save``. A script that calls :func:`launch` needs the
    ``if __name__ == "__main__":`` guard, since ``spawn`` re-imports the main module.

    Raises:
        ValueError: ``config.world_size`` is below 1.
        RankError: a rank raised (chained from the original exception when it pickles) or
            exited without reporting.
        TimeoutError: some rank had not finished after ``config.timeout_s`` seconds.
    """
    if config.world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {config.world_size}.")
    context = _context()
    results: multiprocessing.Queue = context.Queue()
    port = free_port(config.master_addr)
    processes = [
        context.Process(
            target=_run_rank,
            args=(fn, args, kwargs, rank, port, config, results),
            name=f"canzona-rank{rank}",
            daemon=True,
        )
        for rank in range(config.world_size)
    ]
    for process in processes:
        process.start()
    try:
        by_rank = _collect(processes, results, config)
    except BaseException:
        _stop(processes, grace_s=0.0)  # peers of a failed rank may sit in a collective
        raise
    _stop(processes, grace_s=_STOP_GRACE_S)
    return by_rank


def _context() -> multiprocessing.context.BaseContext:
    """``spawn``; or ``forkserver`` preloading the modules :data:`PRELOAD_ENV` names."""
    preload = [name.strip() for name in os.environ.get(PRELOAD_ENV, "").split(",") if name.strip()]
    if not preload:
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)  # no effect once this process's server runs
    return context


LOWEST_PORT = 10000
"""The lowest rendezvous port :func:`free_port` picks."""


def free_port(address: str = "127.0.0.1") -> int:
    """A port free on ``address`` now, for a rendezvous that listens on it a moment later.

    Taken below the kernel's ephemeral range (``ip_local_port_range``), at random: a port the
    kernel handed out (``bind`` to 0) is released to that range, where any of the many outgoing
    connections gloo's ranks open may take it before the rendezvous listens (``EADDRINUSE``, seen
    with two jobs running at once); below it, only another explicit bind can."""
    try:
        lowest_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        lowest_ephemeral = 32768
    candidates = list(range(LOWEST_PORT, max(lowest_ephemeral, LOWEST_PORT + 1000)))
    for port in random.Random().sample(candidates, min(200, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # every candidate taken: the kernel's
        probe.bind((address, 0))
        return probe.getsockname()[1]


def _run_rank(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    rank: int,
    port: int,
    config: LaunchConfig,
    results: multiprocessing.Queue,
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(config.world_size),
        LOCAL_WORLD_SIZE=str(config.world_size),
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(config.num_threads)
    # What the rank inherited (torch, Megatron: millions of objects, none of them garbage) leaves the
    # collector's view: a full collection (Python's own, or a harness's between runs) then scans only
    # what the rank allocates, 0.6 s less per collection after Megatron's imports (measured).
    gc.freeze()
    try:
        dist.init_process_group(
            config.backend,
            rank=rank,
            world_size=config.world_size,
            timeout=timedelta(seconds=config.timeout_s),
        )
        message = (rank, True, _dumps(fn(*args, **kwargs)))
    except BaseException as error:  # noqa: BLE001  (reported to the parent, not swallowed)
        message = (rank, False, (_pickled_error(error), traceback.format_exc()))
    results.put(message)
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()


def _dumps(result: Any) -> bytes:
    # Serialize here, not in the queue's feeder thread, so a bad result is reported. torch.save
    # stores tensor storages itself: plain pickle would defer to torch.storage._load_from_bytes,
    # which `import megatron.core` replaces, and the parent would need megatron to unpickle.
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def _loads(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=False)


def _pickled_error(error: BaseException) -> bytes | None:
    try:
        return pickle.dumps(error)
    except Exception:  # noqa: BLE001  (any pickling failure means: send the text only)
        return None


def _unpickled_error(payload: bytes | None) -> BaseException | None:
    """The child's exception object, or None where it cannot be rebuilt here."""
    if payload is None:
        return None
    try:
        return pickle.loads(payload)
    except Exception:  # noqa: BLE001  (the traceback text still carries the failure)
        return None


def _collect(
    processes: Sequence[multiprocessing.Process],
    results: multiprocessing.Queue,
    config: LaunchConfig,
) -> list[Any]:
    deadline = time.monotonic() + config.timeout_s
    by_rank: dict[int, Any] = {}
    while len(by_rank) < len(processes):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(len(processes))) - set(by_rank))
            raise TimeoutError(
                f"ranks {missing} of {len(processes)} still running after "
                f"{config.timeout_s:.0f} s (LaunchConfig.timeout_s); likely a hung collective."
            )
        try:
            rank, ok, payload = results.get(timeout=min(remaining, _POLL_S))
        except queue.Empty:
            _raise_if_died_silently(processes, by_rank, results)
            continue
        if not ok:
            error, remote_traceback = payload
            _raise_if_died_silently(processes, by_rank, None, also_failed=(rank, remote_traceback))
            raise RankError(rank, remote_traceback) from _unpickled_error(error)
        by_rank[rank] = _loads(payload)
    return [by_rank[rank] for rank in range(len(processes))]


def _raise_if_died_silently(
    processes: Sequence[multiprocessing.Process],
    by_rank: dict[int, Any],
    results: multiprocessing.Queue | None,
    also_failed: tuple[int, str] | None = None,
) -> None:
    """Raise for a rank that exited with a nonzero code without sending a message.

    A rank that raises still exits with code 0 after reporting, so a nonzero exit code
    (``os._exit``, a signal, a segfault) means the rank died without a word. Such a death is
    the likely root cause when a peer then reports a broken connection (``also_failed``).
    """
    if also_failed is not None:  # let a dead peer's exit code become visible (slower on a loaded machine)
        deadline = time.monotonic() + _DEAD_PEER_S
        while time.monotonic() < deadline and not any(
                rank not in by_rank and process.exitcode not in (None, 0) for rank, process in enumerate(processes)):
            time.sleep(_POLL_S / 5)
    for rank, process in enumerate(processes):
        if rank in by_rank or process.exitcode in (None, 0):
            continue
        if results is not None:
            with contextlib.suppress(queue.Empty):
                # It may have reported just before exiting: prefer its own message.
                late_rank, ok, payload = results.get(timeout=_POLL_S)
                if not ok:
                    raise RankError(late_rank, payload[1]) from _unpickled_error(payload[0])
                by_rank[late_rank] = _loads(payload)
                continue
        reason = f"process exited with code {process.exitcode} without reporting"
        if also_failed is not None:
            reason += f"; rank {also_failed[0]} then failed:\n{also_failed[1]}"
        raise RankError(rank, reason)


def _stop(processes: Sequence[multiprocessing.Process], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
