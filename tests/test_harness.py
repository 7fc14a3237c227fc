"""The multi-rank harness itself: results, failures, hangs and restarts."""

import os

import pytest
import torch
import torch.distributed as dist
from support.multirank import RankFailure


def _rank_and_sum() -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")


def _hang_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        dist.barrier()


def _die_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_every_rank_runs_in_one_group(ranks, world_size):
    results = ranks.run(world_size, _rank_and_sum)
    expected_sum = float(sum(range(world_size)))
    assert results == [(r, world_size, expected_sum) for r in range(world_size)]


def test_exception_on_one_rank_fails_with_its_traceback(ranks):
    with pytest.raises(RankFailure, match=r"(?s)rank 1.*boom on rank one"):
        ranks.run(2, _raise_on_rank_one)
    assert ranks.run(2, _rank_and_sum)[1] == (1, 2, 1.0)


@pytest.mark.slow
def test_hang_fails_in_bounded_time_with_each_rank_stack(ranks):
    with pytest.raises(RankFailure, match=r"(?s)timed out.*rank 0 stack.*_hang_on_rank_zero"):
        ranks.run(2, _hang_on_rank_zero, timeout_s=2)
    assert ranks.run(2, _rank_and_sum)[0] == (0, 2, 1.0)


@pytest.mark.slow
def test_dead_rank_fails_and_pool_restarts(ranks):
    with pytest.raises(RankFailure, match="rank 1 died with exit code 3"):
        ranks.run(2, _die_on_rank_one)
    assert ranks.run(2, _rank_and_sum)[1] == (1, 2, 1.0)
