"""The ranks of one pipeline stage seen two ways: the dense grid (DP x TP) and the expert
grid (expert DP x EP x expert TP), as Megatron-Core 0.19.2 lays them out with context
parallelism 1.

Inside a stage, local rank ``r = tp_rank + tp_size * dp_rank`` (TP fastest). The same GPU's
expert coordinates (Megatron's expert order ``etp-ep-dp``, expert TP fastest) are

    etp = r % expert_tp_size,  ep = (r // expert_tp_size) % ep_size,
    edp = r // (expert_tp_size * ep_size).

Every EP rank holds the same number of local experts with the same shapes, so one expert
plan (over expert DP x expert TP) serves every EP rank.
"""

from __future__ import annotations


def expert_dp_size(*, dp_size: int, tp_size: int, ep_size: int, expert_tp_size: int) -> int:
    """Size of the expert-data-parallel group: the stage's GPUs over EP x expert TP."""
    for name, flag, value in (("dp_size", "--dp", dp_size), ("tp_size", "--tp", tp_size), ("ep_size", "--ep", ep_size),
                              ("expert_tp_size", "--etp", expert_tp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}; pass {flag} 1 or more")
    ranks = dp_size * tp_size
    if ranks % (ep_size * expert_tp_size):
        raise ValueError(
            f"EP {ep_size} x expert TP {expert_tp_size} does not divide the {ranks} GPUs of a stage "
            f"(DP {dp_size} x TP {tp_size}); choose --ep and --etp whose product divides DP x TP"
        )
    return ranks // (ep_size * expert_tp_size)


def expert_coordinates(dp_rank: int, tp_rank: int, *, tp_size: int, ep_size: int,
                       expert_tp_size: int) -> tuple[int, int, int]:
    """``(expert_dp_rank, ep_rank, expert_tp_rank)`` of the GPU at dense ``(dp_rank, tp_rank)``."""
    rank = tp_rank + tp_size * dp_rank
    return rank // (expert_tp_size * ep_size), (rank // expert_tp_size) % ep_size, rank % expert_tp_size


def dense_to_expert(*, dp_size: int, tp_size: int, ep_size: int, expert_tp_size: int) -> list[tuple[int, int]]:
    """``(expert_dp_rank, expert_tp_rank)`` per local rank ``r = tp_rank + tp_size * dp_rank``:
    whose expert work each GPU of the stage does."""
    expert_dp_size(dp_size=dp_size, tp_size=tp_size, ep_size=ep_size, expert_tp_size=expert_tp_size)
    out = []
    for dp_rank in range(dp_size):
        for tp_rank in range(tp_size):
            edp, _, etp = expert_coordinates(dp_rank, tp_rank, tp_size=tp_size, ep_size=ep_size,
                                             expert_tp_size=expert_tp_size)
            out.append((edp, etp))
    return out
