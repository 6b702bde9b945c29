"""Tensor-parallel micro-groups: one host TP rank per matrix, work batched into groups.

Greedy rollback (largest cost first): add matrices one at a time to a candidate group and
re-assign the candidate largest-first onto tp_size slots; once the largest slot would
exceed the budget, roll the last matrix back, seal the group, and start the next group
with it. A matrix costlier than the budget alone gets a group of its own. Within a group,
ties between slots go to the TP rank with less work so far, so totals balance too.
"""

from __future__ import annotations

from collections.abc import Sequence

from .plan import MicroGroup, TPPlan


def check_tp_size(tp_size: int) -> None:
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}; pass --tp 1 or more")


def default_budget(costs: Sequence[float]) -> float:
    """The largest single matrix: a group then spreads about tp_size matrices of that size."""
    return max(costs, default=0.0)


def schedule_microgroups(
    names: Sequence[str], costs: Sequence[float], *, tp_size: int, budget: float | None = None
) -> TPPlan:
    """Micro-groups and host TP ranks for the matrices one DP rank owns."""
    check_tp_size(tp_size)
    if len(names) != len(costs):
        raise ValueError("names and costs must have the same length")
    if budget is None:
        budget = default_budget(costs)
    if budget < 0:
        raise ValueError(f"micro-group budget must be >= 0, got {budget}")
    order = sorted(range(len(names)), key=lambda i: (-costs[i], names[i]))
    totals = [0.0] * tp_size
    groups: list[MicroGroup] = []
    members: list[int] = []
    for i in order:
        hosts, slots = _assign(members + [i], costs, totals)
        if members and max(slots) > budget:
            groups.append(_seal(members, names, costs, totals))
            members = [i]
        else:
            members.append(i)
    if members:
        groups.append(_seal(members, names, costs, totals))
    return TPPlan(tp_size=tp_size, budget=budget, groups=tuple(groups))


def _assign(members: list[int], costs: Sequence[float], totals: list[float]) -> tuple[list[int], list[float]]:
    """Largest first onto the least-loaded slot of this group (then of the run so far)."""
    slots = [0.0] * len(totals)
    hosts = []
    for i in members:
        rank = min(range(len(slots)), key=lambda r: (slots[r], totals[r], r))
        hosts.append(rank)
        slots[rank] += costs[i]
    return hosts, slots


def _seal(members: list[int], names: Sequence[str], costs: Sequence[float], totals: list[float]) -> MicroGroup:
    hosts, slots = _assign(members, costs, totals)
    for r, load in enumerate(slots):
        totals[r] += load
    return MicroGroup(names=tuple(names[i] for i in members), hosts=tuple(hosts), slot_loads=tuple(slots))
