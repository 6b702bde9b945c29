"""The local launcher: results in rank order; a failing, hung or crashed rank fails fast."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron.canzona.runtime import LaunchConfig, RankError, launch
from megatron.canzona.runtime.launcher import PRELOAD_ENV

LAUNCH_TIMEOUT_S = 60.0


def _sum_of_ranks(scale: int) -> tuple[int, int]:
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    return dist.get_rank(), int(total) * scale


def _rank_one_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # the healthy ranks wait for a peer that never comes


def _rank_zero_hangs() -> None:
    if dist.get_rank() == 0:
        time.sleep(3600)


def _rank_one_dies() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


@pytest.mark.timeout(LAUNCH_TIMEOUT_S)
@pytest.mark.quick
def test_results_come_back_in_rank_order() -> None:
    results = launch(_sum_of_ranks, LaunchConfig(world_size=3, timeout_s=LAUNCH_TIMEOUT_S), 10)
    assert results == [(0, 30), (1, 30), (2, 30)]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S)
def test_a_failing_rank_raises_its_own_error() -> None:
    with pytest.raises(RankError, match="rank one is broken") as caught:
        launch(_rank_one_raises, LaunchConfig(world_size=2, timeout_s=LAUNCH_TIMEOUT_S))
    assert caught.value.rank == 1
    assert isinstance(caught.value.__cause__, ValueError)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S)
@pytest.mark.alone
def test_a_hung_rank_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\]"):
        launch(_rank_zero_hangs, LaunchConfig(world_size=2, timeout_s=6.0))
    assert time.monotonic() - start < 20.0


@pytest.mark.timeout(LAUNCH_TIMEOUT_S)
def test_a_rank_dying_silently_is_reported() -> None:
    with pytest.raises(RankError, match="exited with code 3"):
        launch(_rank_one_dies, LaunchConfig(world_size=2, timeout_s=LAUNCH_TIMEOUT_S))


def _parent_pid() -> int:
    return os.getppid()


@pytest.mark.timeout(LAUNCH_TIMEOUT_S)
def test_ranks_fork_from_one_server_that_preloaded_megatron() -> None:
    """tests/multirank/conftest.py sets PRELOAD_ENV: every rank of every launch is a child of one
    fork server (not of this process, as spawned ranks are), which imported the modules once."""
    assert PRELOAD_ENV in os.environ and "megatron.core" in os.environ[PRELOAD_ENV].split(",")
    first = launch(_parent_pid, LaunchConfig(world_size=2, timeout_s=LAUNCH_TIMEOUT_S))
    second = launch(_parent_pid, LaunchConfig(world_size=3, timeout_s=LAUNCH_TIMEOUT_S))
    assert len(set(first + second)) == 1 and first[0] != os.getpid(), (first, second, os.getpid())
