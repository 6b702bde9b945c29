"""A rank that dies: the survivors stop, and one of them says which rank is gone.

A rank killed by a signal (OOM killer, ``kill -9``, a node lost) says nothing. Its peers learn of
it in one of two ways, whichever comes first:

* a collective with it fails: gloo's ``Connection closed/reset by peer`` or NCCL's ``remote
  process exited`` (:func:`lost_peer_words` reads the error);
* torchrun, which saw its child die, sends the others SIGTERM (:func:`watch_for_lost_peers`).

Which rank is gone: a rank of this node that ended is looked up among torchrun's children (its
``LOCAL_RANK``); a rank of another node, by a roll call in the job's store (every survivor
answers; a rank that does not within :data:`ROLL_CALL_S` is named). A rank that stopped on an
error of its own, or because it was told to (SIGTERM), marks so in the store first
(:func:`mark_ended_knowingly`): it is not "gone", and a peer's SIGTERM does not report it.

A rank that stops answering (frozen, swapped out, stuck in I/O, its node lost) is learnt of when
a collective with it times out (gloo's ``Timed out waiting``, :func:`timed_out_words`): the
survivors answer the same roll call for :data:`TIMEOUT_ROLL_CALL_S`, and those that do not are
named (:func:`report_silent_peer`). A SIGTERM with every rank of the node running is a stop the
job was told (``scancel``, preemption, a SIGTERM to torchrun): :func:`watch_for_lost_peers` hands
it to the entry point, which saves under ``--exit-signal-handler``.

Of all survivors, the first to take the store's report counter prints (exactly one line per
job); the others stop quietly. Store operations are few and only on these failure paths.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megatron.canzona.runtime.lifetime import ranks_of, running

ROLL_CALL_S = 3.0
"""How long the reporting rank waits for the survivors to answer before naming the rest gone."""
_STORE_TIMEOUT_S = 10.0
_PREFIX = "canzona/peers"
# gloo's (tcp/pair.cc) and NCCL's words for a connection a dead process dropped; not a refused
# connection or a timeout (a rendezvous that failed, a hang: no rank is known to be gone).
_LOST = re.compile(r"(Connection (closed|reset) by (remote )?peer|Broken pipe|remote process exited"
                   r"|ncclRemoteError)", re.IGNORECASE)
_TIMED_OUT = re.compile(r"(Timed out waiting|timed out after|timeout caused pair closure"
                        r"|Watchdog caught collective operation timeout)", re.I)
_GLOO_WHERE = re.compile(r"pair\.cc:\d+\]\s*")
_WHERE = re.compile(r"^(RuntimeError: |DistBackendError: )?\[[^\]]*\.(cc|cpp|h):\d+\]\s*")
"""The source location gloo puts before its words (``[/__w/.../unbound_buffer.cc:78] ``)."""
WORDS_CHARS = 120
"""How much of gloo's or NCCL's words a one-line error quotes."""
TIMEOUT_ROLL_CALL_S = 10.0
"""After a collective timed out: how long the reporting rank waits for the others to answer (the
ranks waiting on the silent one time out too, within about an iteration of each other)."""

_reporting = False
_stopping = False


def lost_peer_words(error: BaseException) -> str | None:
    """gloo's or NCCL's words when ``error`` (or an error it was raised from) says a peer's
    connection broke; ``None`` otherwise."""
    return _words_of(error, _LOST)


def timed_out_words(error: BaseException) -> str | None:
    """gloo's or NCCL's words when ``error`` (or an error it was raised from) says a collective
    waited longer than the process group's timeout (``--distributed-timeout-minutes``); ``None``
    otherwise."""
    return _words_of(error, _TIMED_OUT)


def _words_of(error: BaseException, pattern: re.Pattern) -> str | None:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        texts = [str(error), *(str(f) for f in (getattr(error, "failures", None) or {}).values())]
        for text in texts:
            for line in text.splitlines():
                if pattern.search(line):
                    words = _GLOO_WHERE.split(_WHERE.sub("", line.strip()))[-1]
                    return words.split(". This is typically")[0][:WORDS_CHARS]
        error = error.__cause__ or error.__context__
    return None


def mark_ended_knowingly() -> None:
    """Note in the job's store that this rank ends of its own accord (an error it reports, a
    signal it was sent), so peers do not report it as gone. Best effort: no store, no note."""
    store = _store()
    if store is not None:
        _try(lambda: store.set(f"{_PREFIX}/ended/{dist.get_rank()}", "1"))


def claim_report() -> bool:
    """Whether this rank is the first of the job to report a failure (one line per job), for a
    failure one rank finds alone; marks it as ending knowingly, so no peer reports it gone."""
    global _reporting
    _reporting = True
    mark_ended_knowingly()
    store = _store()
    return store is None or _try(lambda: store.add(f"{_PREFIX}/reporters", 1)) in (1, None)


def report_lost_peer(words: str) -> str | None:
    """After a collective failed with ``words`` (:func:`lost_peer_words`): answer the roll call
    and, on the one rank that reports, return ``"rank R is gone (...)"``; ``None`` on the others,
    and when the rank that went away ended of its own accord (its own output says why)."""
    global _reporting
    _reporting = True
    store = _store()
    if store is None:
        return f"a peer is gone ({_gloo_or_nccl()}: {words})"
    rank, world_size, dead_here, reports = _answer_roll_call(store)
    if not reports:
        return None
    gone, how = _gone_ranks(store, rank, world_size, dead_here)
    if not gone:
        return None
    which = f"rank {gone[0]} is" if len(gone) == 1 else f"ranks {', '.join(map(str, gone))} are"
    return f"{which} gone ({how}; {_gloo_or_nccl()}: {words})"


def report_silent_peer(words: str) -> str | None:
    """After a collective timed out with ``words`` (:func:`timed_out_words`): answer the roll call
    and, on the one rank that reports, return ``"rank R did not answer (...)"``, naming the ranks
    that neither answered within :data:`TIMEOUT_ROLL_CALL_S` nor ended knowingly (a frozen,
    swapped-out or I/O-bound rank, a lost node); ``None`` on the others."""
    global _reporting
    _reporting = True
    store = _store()
    if store is None:
        return f"a collective timed out ({_gloo_or_nccl()}: {words})"
    rank, world_size, dead_here, reports = _answer_roll_call(store)
    if not reports:
        return None
    gone, how = _gone_ranks(store, rank, world_size, dead_here, window_s=TIMEOUT_ROLL_CALL_S)
    if not gone:
        return f"a collective timed out and every rank answered after it ({_gloo_or_nccl()}: {words})"
    if how.startswith("no answer"):
        which = f"rank {gone[0]} did" if len(gone) == 1 else f"ranks {', '.join(map(str, gone))} did"
        return (f"{which} not answer after a collective timed out (frozen, swapped out, stuck in I/O, node lost?; "
                f"{_gloo_or_nccl()}: {words})")
    which = f"rank {gone[0]} is" if len(gone) == 1 else f"ranks {', '.join(map(str, gone))} are"
    return f"{which} gone ({how}; {_gloo_or_nccl()}: {words})"


def watch_for_lost_peers(report: Callable[[str], None], stop: Callable[[bool], bool] | None = None) -> bool:
    """Under torchrun, take SIGTERM in one of three ways:

    * a rank of this node ended without a word (torchrun stops the others when one of its
      children dies): the one reporting rank calls ``report`` with ``"rank R is gone (...)"``,
      then every rank ends by SIGTERM as it would have;
    * a rank of this node ended of its own accord (it said why): the rank ends quietly;
    * every rank of the node runs (the job was told to stop: SIGTERM to torchrun, which relays
      it, or to every rank, as ``scancel`` and preemption send it): ``stop(first)`` decides, on
      every rank, ``first`` being true on the one rank of the job that speaks for it; it returns
      whether the rank goes on (to save at the next iteration boundary) instead of ending now.
      Without ``stop`` the rank ends, as it would have.

    The handler replaces whatever handled SIGTERM before (``stop`` may call it). Returns whether
    it was installed (under torchrun only: elsewhere nobody relays a peer's death)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False

    def on_sigterm(signum: int, frame: Any) -> None:
        global _stopping
        if _reporting:
            return  # this rank is already reporting a lost peer: let it finish its line
        line, store, ended_here = None, _store(), _ended_local_ranks()
        if store is not None and ended_here:
            dead = [r for r in ended_here if not _try(lambda r=r: store.check([f"{_PREFIX}/ended/{r}"]))]
            if dead:
                _try(lambda: store.set(f"{_PREFIX}/alive/{dist.get_rank()}", "1"))
                if _try(lambda: store.add(f"{_PREFIX}/reporters", 1)) in (1, None):
                    which = f"rank {dead[0]} is" if len(dead) == 1 else f"ranks {', '.join(map(str, dead))} are"
                    line = f"{which} gone (its process on this node ended without a word; torchrun stopped the rest)"
        if line is not None:
            report(line)
        elif not ended_here and _stopping:
            return  # a second SIGTERM of the same stop (scancel's to every rank, then torchrun's relay)
        elif not ended_here and stop is not None:
            first = store is None or _try(lambda: store.add(f"{_PREFIX}/stopping", 1)) in (1, None)
            _stopping = True
            if stop(first):
                return
        mark_ended_knowingly()
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    return True


def _answer_roll_call(store: Any) -> tuple[int, int, list[int], bool]:
    """This rank answers (``alive``) and reports this node's ended ranks (``gone``); returns its
    rank, the world size, those ranks, and whether it is the one rank that reports."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _try(lambda: store.set(f"{_PREFIX}/alive/{rank}", "1"))
    dead_here = _ended_local_ranks()
    for dead in dead_here:
        _try(lambda: store.set(f"{_PREFIX}/gone/{dead}", "1"))
    return rank, world_size, dead_here, _try(lambda: store.add(f"{_PREFIX}/reporters", 1)) in (1, None)


def _gone_ranks(store: Any, rank: int, world_size: int, dead_here: list[int],
                window_s: float = ROLL_CALL_S) -> tuple[list[int], str]:
    """The ranks gone and how that is known; ranks that ended knowingly are left out."""
    def ended(r: int) -> bool:
        return bool(_try(lambda: store.check([f"{_PREFIX}/ended/{r}"])))

    deadline = time.monotonic() + window_s
    answered = {rank}
    while True:
        reported = [r for r in range(world_size) if r not in answered
                    and _try(lambda r=r: store.check([f"{_PREFIX}/gone/{r}"]))]
        gone = sorted(set(dead_here) | set(reported))
        if gone:
            gone = [r for r in gone if not ended(r)]
            return gone, "its process ended without a word"
        answered |= {r for r in range(world_size) if r not in answered
                     and _try(lambda r=r: store.check([f"{_PREFIX}/alive/{r}"]))}
        if len(answered) == world_size or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    silent = [r for r in range(world_size) if r not in answered and not ended(r)]
    return silent, f"no answer within {window_s:.0f} s"


def _ended_local_ranks() -> list[int]:
    """Global ranks of this node's torchrun children that are no longer running (none known
    under another launcher: its children are not ranks of one agent)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return []
    try:
        local_world = int(os.environ["LOCAL_WORLD_SIZE"])
        first = int(os.environ["RANK"]) - int(os.environ["LOCAL_RANK"])
    except (KeyError, ValueError):
        return []
    children = ranks_of(os.getppid())
    return [first + local for local in range(local_world)
            if str(local) not in children or not running(children[str(local)])]


def _store() -> Any:
    """The job's store (the process group's), with a short timeout; ``None`` without one."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=_STORE_TIMEOUT_S))
        return store
    except Exception:  # noqa: BLE001 -- the store went with the node that hosted it
        return None


def _try(operation: Callable[[], Any]) -> Any:
    try:
        return operation()
    except Exception:  # noqa: BLE001 -- on a failure path: no answer is an answer
        return None


def _gloo_or_nccl() -> str:
    try:
        return dist.get_backend()
    except Exception:  # noqa: BLE001
        return "the collective"
