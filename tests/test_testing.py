"""gradcomm.testing: results in rank order, failures carry the rank's traceback, nothing hangs."""

import os

import pytest
import torch
import torch.distributed as dist

from gradcomm.testing import RankError, run_on_ranks


def _sum_of_ranks(offset: float) -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item() + offset


def _tensor_result() -> torch.Tensor:
    return torch.full((3,), float(dist.get_rank()))


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def _exit_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _stall() -> None:
    import time

    time.sleep(60)


@pytest.mark.timeout(60)
def test_results_in_rank_order():
    assert run_on_ranks(_sum_of_ranks, 3, args=(0.5,)) == [3.5, 3.5, 3.5]


@pytest.mark.timeout(60)
def test_tensors_can_be_returned():
    first, second = run_on_ranks(_tensor_result, 2)
    assert torch.equal(first, torch.zeros(3)) and torch.equal(second, torch.ones(3))


@pytest.mark.timeout(60)
def test_failing_rank_traceback_is_reported():
    with pytest.raises(RankError, match=r"(?s)failed on rank 1 of 2.*ValueError: boom on purpose.*_raise_on_rank_one"):
        run_on_ranks(_raise_on_rank_one, 2, collective_timeout=10)


@pytest.mark.timeout(60)
def test_dead_rank_and_stuck_rank_fail_within_timeout():
    with pytest.raises(RankError, match=r"rank 1 of 2 exited with code 3"):
        run_on_ranks(_exit_on_rank_one, 2, collective_timeout=10)
    with pytest.raises(RankError, match=r"did not finish within 8 s"):
        run_on_ranks(_stall, 2, timeout=8)
