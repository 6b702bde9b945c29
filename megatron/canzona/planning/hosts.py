"""A host for every matrix over all DP × TP ranks, and the micro-groups the hosts run in.

Hosts (:func:`assign_hosts`): a matrix whole in one DP shard is hosted on that DP rank (by
the TP rank that balances best when it is TP-sharded); a split matrix may be hosted
anywhere. Matrices go largest cost first (the whole ones before the split ones, which have
more freedom) to the rank that least grows the plan's objective

    α · busiest compute load / compute lower bound + (1 − α) · busiest wire cost / byte scale

and among equals to the rank with the least α-weighted load and wire cost after. A rank's
wire cost is what it sends in the step: its stock collectives, the pieces it sends to
hosts, as a host the slices it sends back, and ``WireConfig.latency_bytes`` per message. A
rank holding a piece of the matrix saves sending it and receiving it back, so holders win
ties. Candidates for a split matrix are its holders with the largest pieces, the least
loaded rank and the rank with the least α-weighted total.

Under Megatron-FSDP a host keeps its matrices' optimizer state (all of Shampoo's and SOAP's,
AdaMuon's second moment), so there hosts are chosen again for that state, each rank's compute
held within :data:`STATE_SLACK` of the busiest's above (``balance_state``).

Micro-groups (:func:`schedule_groups`): each host's matrices, those it holds whole first,
then in the order their buckets reduce (the bucket whose reduce-scatter backward starts
first leads), then largest first, are cut into runs of at most ``budget`` cost (a larger
matrix alone); micro-group k is every host's k-th run. Bucket order lets the early
gathers of the first groups go while backward still runs. The default budget gives a host
about :data:`GROUPS_PER_HOST` groups, and never fewer than two when it has two matrices or
more, so the next group's gather is in flight while a group computes; hosts of a single
matrix compute it in the first group if it is small and in the second if it is large, so
the small ones' scatters are on the wire while the large ones compute.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .comm import WireConfig

GROUPS_PER_HOST = 4
"""Micro-groups the default budget aims at for the busiest host."""
SINGLE_LARGE = 0.5
"""Hosts of one matrix: those costing at least this fraction of the largest such matrix
compute in the second micro-group, the others in the first."""
HOLDER_CANDIDATES = 8
"""Holders of a split matrix (largest pieces first) considered as its host besides the best
rank overall."""
STATE_SLACK = 1.02
"""With ``balance_state``: how far the busiest rank's compute may grow over the compute-only
assignment's so that the busiest rank keeps less optimizer state (:func:`assign_hosts`)."""


@dataclass(frozen=True, kw_only=True)
class HostItem:
    """One matrix as the host assignment sees it."""

    cost: float
    """Compute of its update."""
    dp_rank: int | None
    """DP rank whose shard holds it whole, or ``None`` when split across shards."""
    tp_sharded: bool
    """Whether each TP rank holds a slice (else every TP rank holds it and computes it)."""
    pieces: tuple[tuple[int, int], ...]
    """``(dp_rank, numel)`` per DP shard holding part of it (one entry when whole)."""
    chunk: int = 0
    """Model chunk of its parameter."""
    name: str = ""
    """Its parameter's name."""
    part: int = 0
    """Which part of the parameter (:attr:`~megatron.canzona.planning.specs.ParamSpec.parts`)."""
    span: tuple[int, int] | None = None
    """Elements of the local tensor the part covers; ``None``: the whole parameter."""
    bucket: int = 0
    """Bucket of its parameter in the matrix buffer (bucket 0 reduces first)."""
    update_bytes: int | None = None
    """Bytes per element its host scatters when narrower than the wire's update
    (:func:`~megatron.canzona.planning.comm.narrow_bytes`); ``None``: the wire's."""
    gather_bytes: int | None = None
    """Bytes per element its holders send its host when narrower than the wire's main gradients
    (``--canzona-narrow-gathers``); ``None``: the wire's."""
    state: int = 0
    """Elements of optimizer state its host keeps (what ``balance_state`` evens out)."""
    together: bool = False
    """A TP-sharded matrix its TP ranks compute together, each its own shard (placed as one every
    TP rank computes, ``tp_sharded`` False, at each TP rank's cost)."""


class _Ranks:
    """Per-rank load, bytes, messages and kept state, with lazy heaps of ranks by load and by score."""

    def __init__(self, dp_size: int, tp_size: int, alpha: float, load_scale: float, byte_scale: float,
                 wire: WireConfig) -> None:
        self.dp_size, self.tp_size, self.wire = dp_size, tp_size, wire
        self.alpha, self.load_scale, self.byte_scale = alpha, load_scale or 1.0, byte_scale or 1.0
        size = dp_size * tp_size
        self.load = [0.0] * size
        self.bytes = [0.0] * size
        self.messages = [0] * size
        self.state = [0] * size
        self.max_load = 0.0
        self.max_wire = 0.0
        self._version = [0] * size
        self._by_load: list[tuple[float, int, int]] = []
        self._by_score: list[tuple[float, int, int]] = []

    def wire_cost(self, rank: int, sent: float = 0.0, messages: int = 0) -> float:
        """Bytes plus message latency ``rank`` sends, in bytes."""
        return self.bytes[rank] + sent + self.wire.latency_bytes * (self.messages[rank] + messages)

    def score(self, rank: int, load: float = 0.0, sent: float = 0.0, messages: int = 0) -> float:
        """α-weighted load and wire cost of ``rank`` after taking the given extra."""
        load_term = (self.load[rank] + load) / self.load_scale
        return self.alpha * load_term + (1 - self.alpha) * self.wire_cost(rank, sent, messages) / self.byte_scale

    def increase(self, rank: int, load: float, sent: float, messages: int) -> float:
        """How much the plan's objective (α · busiest load + (1 − α) · busiest wire) grows."""
        grown_load = max(0.0, self.load[rank] + load - self.max_load) / self.load_scale
        grown_wire = max(0.0, self.wire_cost(rank, sent, messages) - self.max_wire) / self.byte_scale
        return self.alpha * grown_load + (1 - self.alpha) * grown_wire

    def add(self, rank: int, load: float, sent: float, messages: int, state: int = 0) -> None:
        self.load[rank] += load
        self.bytes[rank] += sent
        self.messages[rank] += messages
        self.state[rank] += state
        self.touch(rank)

    def touch(self, rank: int) -> None:
        self.max_load = max(self.max_load, self.load[rank])
        self.max_wire = max(self.max_wire, self.wire_cost(rank))
        self._version[rank] += 1
        heapq.heappush(self._by_load, (self.load[rank], self._version[rank], rank))
        heapq.heappush(self._by_score, (self.score(rank), self._version[rank], rank))

    def build_heaps(self) -> None:
        for rank in range(len(self.load)):
            self.touch(rank)

    def least_loaded(self) -> int:
        return self._top(self._by_load)

    def best_scored(self) -> int:
        return self._top(self._by_score)

    def _top(self, heap: list[tuple[float, int, int]]) -> int:
        while True:
            _, version, rank = heap[0]
            if version == self._version[rank]:
                return rank
            heapq.heappop(heap)


def assign_hosts(
    items: Sequence[HostItem], *, dp_size: int, tp_size: int, alpha: float, wire: WireConfig,
    base_bytes: float, byte_scale: float, load_scale: float, base_loads: Sequence[float] | None = None,
    prefer_holders: bool = False, balance_state: bool = False, base_state: Sequence[int] | None = None,
) -> tuple[list[tuple[int, int | None]], _Ranks]:
    """``(dp_rank, tp_rank)`` per item (``tp_rank`` None: every TP rank computes it), and the
    per-rank totals. ``base_bytes``: what every rank sends for the stock collectives;
    ``base_loads``: compute each rank (index ``dp_rank * tp_size + tp_rank``) already has
    (its expert work), which the hosts fill around and the returned loads include.

    ``balance_state``: where the items keep state on their hosts (:attr:`HostItem.state`), a
    second assignment lowers the busiest rank's state while every rank's compute stays within
    :data:`STATE_SLACK` of the first's busiest. Three starts -- the first assignment itself, and
    largest state first (:func:`_place_by_state`: holders first where the busiest state does
    not grow, or to the least state) -- each improved by moves and swaps off the busiest rank
    (:func:`_level_state`); the one of least busiest state is kept if below the first's, else
    the first. Items without state leave the first assignment as it is. ``base_state``:
    state each rank already keeps (its expert matrices'), which the hosts fill around."""
    def start() -> _Ranks:
        ranks = _start_ranks(items, dp_size=dp_size, tp_size=tp_size, alpha=alpha, wire=wire, base_bytes=base_bytes,
                             byte_scale=byte_scale, load_scale=load_scale, base_loads=base_loads)
        if base_state is not None:
            assert len(base_state) == dp_size * tp_size, (len(base_state), dp_size, tp_size)
            ranks.state = list(base_state)
        return ranks

    ranks = start()
    order = sorted(range(len(items)), key=lambda i: (items[i].dp_rank is None, -items[i].cost, i))
    hosts: list[tuple[int, int | None]] = [(0, None)] * len(items)
    for i in order:
        hosts[i] = _place(items[i], ranks, prefer_holders)
    if not balance_state or not any(item.state for item in items):
        return hosts, ranks
    return _hosts_by_state(items, hosts, ranks, start)


def _hosts_by_state(items: Sequence[HostItem], hosts: list[tuple[int, int | None]], ranks: _Ranks,
                    start: Callable[[], _Ranks]) -> tuple[list[tuple[int, int | None]], _Ranks]:
    """:func:`assign_hosts`' second assignment, or the first (``hosts``, totals ``ranks``) where
    none lowers its busiest state within the slack; ``start``: fresh totals, no host chosen."""
    cap = STATE_SLACK * max(ranks.load)
    best = (max(ranks.state), hosts, ranks)
    for first in (None, True, False):  # the compute-only hosts, or largest state first, holders first or not
        host_of, totals = _state_start(items, hosts, start(), cap, first)
        _level_state(items, host_of, totals, cap)
        even = start()  # the final hosts' totals, bytes included, counted afresh
        placed = [_account(item, even, host, _pieces_at(item, ranks.tp_size)) for item, host in zip(items, host_of)]
        if max(even.load) <= cap * (1 + 1e-9) and max(even.state) < best[0]:
            best = (max(even.state), placed, even)
    return best[1], best[2]


def _state_start(items: Sequence[HostItem], hosts: list[tuple[int, int | None]], ranks: _Ranks, cap: float,
                 holders_first: bool | None) -> tuple[list[int], _Ranks]:
    """Host rank per item, charged to ``ranks``: ``hosts`` (``holders_first`` None), else largest
    state first (those whole in one DP shard first: their host is fixed) by :func:`_place_by_state`."""
    tp_size = ranks.tp_size
    if holders_first is None:
        host_of = [d * tp_size + (t or 0) for d, t in hosts]
        for item, host in zip(items, host_of):
            _account(item, ranks, host, _pieces_at(item, tp_size))
        return host_of, ranks
    host_of = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: (items[i].dp_rank is None, -items[i].state, -items[i].cost, i)):
        d, t = _place_by_state(items[i], ranks, cap, holders_first)
        host_of[i] = d * tp_size + (t or 0)
    return host_of, ranks


def _start_ranks(
    items: Sequence[HostItem], *, dp_size: int, tp_size: int, alpha: float, wire: WireConfig, base_bytes: float,
    byte_scale: float, load_scale: float, base_loads: Sequence[float] | None,
) -> _Ranks:
    """Per-rank totals before any host is chosen: the stock collectives' bytes, every holder
    sending its pieces, and the base loads."""
    ranks = _Ranks(dp_size, tp_size, alpha, load_scale, byte_scale, wire)
    ranks.bytes = [base_bytes] * (dp_size * tp_size)
    if base_loads is not None:
        assert len(base_loads) == dp_size * tp_size, (len(base_loads), dp_size, tp_size)
        ranks.load = [float(load) for load in base_loads]
    for item in items:  # every holder sends its piece unless it becomes the host
        for d, numel, t in _holders(item, tp_size, every_copy=True):
            ranks.bytes[d * tp_size + t] += numel * (item.gather_bytes or wire.main_grad_bytes)
            ranks.messages[d * tp_size + t] += 1
    ranks.build_heaps()
    return ranks


def _holders(item: HostItem, tp_size: int, every_copy: bool = False) -> list[tuple[int, int, int]]:
    """``(dp_rank, numel, tp_rank)`` of every piece, on each TP rank if TP-sharded. A matrix
    every TP rank holds whole is one task per TP rank, all of the same shape: unless
    ``every_copy``, TP rank 0's stands for all."""
    columns = range(tp_size) if item.tp_sharded or every_copy else (0,)
    return [(d, n, t) for d, n in item.pieces for t in columns]


def _pieces_at(item: HostItem, tp_size: int) -> dict[int, int]:
    """Elements of the item each rank holds (TP rank 0's copy for a matrix every TP rank holds)."""
    return {d * tp_size + t: n for d, n, t in _holders(item, tp_size)}


def _host_delta(item: HostItem, piece_at: dict[int, int], rank: int, wire: WireConfig) -> tuple[float, int]:
    """Bytes and messages ``rank`` sends more as the item's host than as a plain holder."""
    own = piece_at.get(rank, 0)
    held = rank in piece_at
    sent = (sum(piece_at.values()) - own) * (item.update_bytes or wire.update_bytes) \
        - own * (item.gather_bytes or wire.main_grad_bytes)
    return sent, len(piece_at) - 2 * held


def _account(item: HostItem, ranks: _Ranks, host: int, piece_at: dict[int, int]) -> tuple[int, int | None]:
    """Charge the item to ``host`` (to every TP rank of its DP rank unless TP-sharded)."""
    tp_size = ranks.tp_size
    sent, messages = _host_delta(item, piece_at, host, ranks.wire)
    d = host // tp_size
    for t in range(tp_size) if not item.tp_sharded else (host % tp_size,):
        ranks.add(d * tp_size + t, item.cost, sent, messages, item.state)
    return d, (host % tp_size if item.tp_sharded else None)


def _place(item: HostItem, ranks: _Ranks, prefer_holders: bool = False) -> tuple[int, int | None]:
    """Choose the item's host and account for it."""
    tp_size = ranks.tp_size
    piece_at = _pieces_at(item, tp_size)

    def delta(rank: int) -> tuple[float, int]:
        return _host_delta(item, piece_at, rank, ranks.wire)

    if item.dp_rank is not None:  # whole in one DP shard: a TP rank of that DP rank
        columns = range(tp_size) if item.tp_sharded else (0,)
        candidates = [item.dp_rank * tp_size + t for t in columns]
    else:
        best_holders = sorted(piece_at, key=lambda r: (-piece_at[r], r))
        best_holders = best_holders if prefer_holders else best_holders[:HOLDER_CANDIDATES]
        candidates = sorted(set(best_holders) | {ranks.least_loaded(), ranks.best_scored()})
        if not item.tp_sharded:  # TP rank 0's copy stands for every TP rank's
            candidates = sorted({(r // tp_size) * tp_size for r in candidates})
    scored = []
    for rank in candidates:  # least growth of the objective, then least α-weighted total
        sent, messages = delta(rank)
        away = prefer_holders and rank not in piece_at
        scored.append((ranks.increase(rank, item.cost, sent, messages), away, ranks.score(rank, item.cost, sent, messages),
                       rank))
    return _account(item, ranks, min(scored)[-1], piece_at)


def _place_by_state(item: HostItem, ranks: _Ranks, cap: float, holders_first: bool = True) -> tuple[int, int | None]:
    """Choose the item's host for state, and account for it: among the ranks whose compute
    stays at most ``cap`` with it, the one that least grows the busiest rank's state, a
    holder among equals (its gather saved), then the least state and load after
    (``holders_first`` off: the least state after, a holder among equals, which fills
    the ranks evenly rather than holders up to the busiest); where no rank stays under
    ``cap``, the least loaded. A matrix whole in one DP shard stays on that DP rank (it is
    computed where it lies)."""
    tp_size = ranks.tp_size
    piece_at = _pieces_at(item, tp_size)
    columns = range(tp_size) if item.tp_sharded else (0,)
    dp_ranks = range(ranks.dp_size) if item.dp_rank is None else (item.dp_rank,)
    max_state = max(ranks.state)

    def key(rank: int) -> tuple:
        takers = (rank,) if item.tp_sharded else range(rank, rank + tp_size)  # every TP rank computes it
        load = max(ranks.load[r] for r in takers) + item.cost
        state = max(ranks.state[r] for r in takers) + item.state
        if load > cap:
            return (True, load, state, rank)
        growth = max(0, state - max_state) if holders_first else state
        return (False, growth, rank not in piece_at, state, load, rank)

    host = min((d * tp_size + t for d in dp_ranks for t in columns), key=key)
    return _account(item, ranks, host, piece_at)


def default_budget(rank_loads: Sequence[float], costs: Sequence[float]) -> float:
    """About :data:`GROUPS_PER_HOST` groups on the busiest host, never below one matrix."""
    return max(max(costs, default=0.0), max(rank_loads, default=0.0) / GROUPS_PER_HOST)


def schedule_groups(
    costs: Sequence[float], hosts: Sequence[int], *, budget: float, at_least_two: bool = True,
    local: Sequence[bool] | None = None, ready: Sequence[tuple[int, ...]] | None = None,
) -> list[int]:
    """Micro-group per item: item i is hosted by rank ``hosts[i]``. Each host's items --
    those with nothing to gather (``local``) first, then by ``ready`` (when its gradient is
    reduced: lower first), then largest cost first -- are cut into
    runs of at most ``budget`` (a larger item alone); with ``at_least_two`` a host with two
    items or more gets two runs at least, and a host with a single item runs it in group 0
    when it costs less than :data:`SINGLE_LARGE` of the largest single item, else in group 1.
    Local work first lets a host compute while the next group's pieces are on the wire; the
    small single items' scatters go while the large ones compute, so the step's tail is only
    the scatter of the matrices that set its length."""
    if budget < 0:
        raise ValueError(f"micro-group budget must be >= 0, got {budget}")
    local = local or [False] * len(costs)
    ready = ready or [()] * len(costs)
    by_host: dict[int, list[int]] = {}
    for i in sorted(range(len(costs)), key=lambda i: (not local[i], ready[i], -costs[i], i)):
        by_host.setdefault(hosts[i], []).append(i)
    group = [0] * len(costs)
    single_costs = [costs[items[0]] for items in by_host.values() if len(items) == 1 and not local[items[0]]]
    large = SINGLE_LARGE * max(single_costs, default=0.0)
    for host in sorted(by_host):
        items = by_host[host]
        runs = _runs(items, costs, budget)
        if at_least_two and len(runs) == 1 and len(items) > 1:
            runs = [items[:1], items[1:]]
        offset = 0
        if at_least_two and len(items) == 1 and not local[items[0]]:
            offset = int(costs[items[0]] >= large)
        for k, run in enumerate(runs):
            for i in run:
                group[i] = offset + k
    return group


def _runs(items: list[int], costs: Sequence[float], budget: float) -> list[list[int]]:
    """``items`` in order, cut into runs of at most ``budget`` cost (a larger item alone)."""
    runs: list[list[int]] = [[]]
    load = 0.0
    for i in items:
        if runs[-1] and load + costs[i] > budget:
            runs.append([])
            load = 0.0
        runs[-1].append(i)
        load += costs[i]
    return runs


def _level_state(items: Sequence[HostItem], host_of: list[int], ranks: _Ranks, cap: float) -> None:
    """Lower the busiest rank's state, a step at a time: one of its matrices moves to another
    rank, or swaps with a smaller one there, so that neither rank's compute passes ``cap`` and
    the other's state stays below the busiest's (the step leaving the two most even, a holder
    among equals). Each step lowers the sum of the squared states, so it ends; it stops where
    the busiest rank has no such step. A matrix every TP rank computes stays where it is.
    Updates ``host_of`` (rank per item) and the loads and states of ``ranks``."""
    tp_size = ranks.tp_size
    on: dict[int, list[int]] = {}
    for i, rank in enumerate(host_of):
        if items[i].tp_sharded or tp_size == 1:
            on.setdefault(rank, []).append(i)
    for _ in range(4 * len(items) + 1):
        busiest = max(range(len(ranks.state)), key=ranks.state.__getitem__)
        step = _level_step(items, on, busiest, ranks, cap)
        if step is None:
            return
        i, rank, j = step
        for k, src, dst in ((i, busiest, rank), (j, rank, busiest)):
            if k is not None:
                on[src].remove(k)
                on.setdefault(dst, []).append(k)
                host_of[k] = dst
                for r, sign in ((src, -1), (dst, 1)):
                    ranks.load[r] += sign * items[k].cost
                    ranks.state[r] += sign * items[k].state


def _level_step(items: Sequence[HostItem], on: dict[int, list[int]], busiest: int, ranks: _Ranks,
                cap: float) -> tuple[int, int, int | None] | None:
    """``(item, rank, other item or None)``: the best move or swap of :func:`_level_state`
    off ``busiest``, or ``None``."""
    state, load, top = ranks.state, ranks.load, ranks.state[busiest]
    partners: dict[int, list[int | None]] = {}
    best: tuple | None = None
    for i in on.get(busiest, []):
        a = items[i]
        holders = _pieces_at(a, ranks.tp_size)
        for rank in _free_ranks(a, ranks):
            if rank == busiest:
                continue
            if rank not in partners:
                partners[rank] = _swap_partners(items, on.get(rank, []), busiest // ranks.tp_size)
            for j in partners[rank]:
                b = items[j] if j is not None else None
                if b is not None and b.state >= a.state:
                    continue
                shift, work = a.state - (b.state if b else 0), a.cost - (b.cost if b else 0.0)
                if state[rank] + shift >= top or load[rank] + work > cap or load[busiest] - work > cap:
                    continue
                key = (max(top - shift, state[rank] + shift), rank not in holders, load[rank] + work, rank, i, j or -1)
                if best is None or key < best[0]:
                    best = (key, (i, rank, j))
    return None if best is None else best[1]


def _swap_partners(items: Sequence[HostItem], here: list[int], dp_rank: int) -> list[int | None]:
    """``None`` (a move) and the items of ``here`` that may go to DP rank ``dp_rank``, one per
    (state, cost): those alike are alike to the busiest rank."""
    found: dict[tuple[int, float], int] = {}
    for j in here:
        if items[j].dp_rank in (None, dp_rank):
            found.setdefault((items[j].state, items[j].cost), j)
    return [None, *found.values()]


def _free_ranks(item: HostItem, ranks: _Ranks) -> range:
    """The ranks that may host a matrix one rank computes: its DP rank's TP ranks when it lies
    whole in one DP shard, else any."""
    if item.dp_rank is None:
        return range(ranks.dp_size * ranks.tp_size)
    return range(item.dp_rank * ranks.tp_size, (item.dp_rank + 1) * ranks.tp_size)
