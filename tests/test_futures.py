"""gradcomm.comm.futures.when_all: the one way hooks combine several collectives' futures.

On CUDA its future must be CUDA-aware (checked on a GPU by benchmarks/gpu_checks.sh, where the quantization
hooks diverged replicas before it was); here, what holds on every device: order, completion, failure.
"""

from __future__ import annotations

import pytest
import torch

from gradcomm.comm.futures import when_all

CPU = torch.device("cpu")


def _pending(n: int) -> list[torch.futures.Future[torch.Tensor]]:
    return [torch.futures.Future() for _ in range(n)]


@pytest.mark.parametrize("count", [0, 1, 3])
def test_values_in_order_once_all_are_done(count: int) -> None:
    futures = _pending(count)
    combined = when_all(futures, CPU)
    for index in reversed(range(count)):  # completed last to first
        assert not combined.done()
        futures[index].set_result(torch.tensor([float(index)]))
    assert combined.done()
    assert [value.item() for value in combined.wait()] == list(range(count))


def test_a_failure_reaches_the_chained_callback_with_its_message() -> None:
    futures = _pending(3)
    reached = []

    def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reached.append(True)
        return fut.value()[0]  # re-raises

    result = when_all(futures, CPU).then(finish)
    futures[0].set_result(torch.zeros(1))
    futures[2].set_exception(RuntimeError("collective 2 timed out"))
    assert not result.done()  # still waits for the others
    futures[1].set_result(torch.zeros(1))
    with pytest.raises(RuntimeError, match="collective 2 timed out"):
        result.wait()
    assert reached == [True]
