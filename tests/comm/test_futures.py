"""gradcomm.comm.futures.when_all: the one way hooks combine several collectives' futures; and
``future_of_works``, the future of work that has none of its own (gloo's sends and receives).

On CUDA its future must be CUDA-aware (checked on a GPU by benchmarks/gpu_checks.sh, where the quantization
hooks diverged replicas before it was); here, what holds on every device: order, completion, failure.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import gradcomm.comm.futures as futures_module
from gradcomm.comm.futures import future_of_works, when_all

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


class _Work:
    """Stands in for a ``torch.distributed.Work``: ``wait`` blocks until :meth:`finish`, then raises its error."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def wait(self) -> bool:
        assert self._done.wait(timeout=30), "never finished"
        if self._error is not None:
            raise self._error
        return True


def _waiters() -> int:
    return sum(thread.name == "gradcomm-waiter" for thread in threading.enumerate())


def _until_a_waiter_is_idle(timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while futures_module._WAITERS._idle == 0:
        assert time.monotonic() < deadline, "no waiter thread became idle"
        time.sleep(0.001)


@pytest.mark.timeout(60)
def test_future_of_works_completes_once_every_work_is_done_and_reuses_its_thread() -> None:
    for _ in range(3):
        works = [_Work(), _Work()]
        result = torch.ones(2)
        future = future_of_works(works, result)
        works[1].finish()
        assert not future.done()
        works[0].finish()
        assert future.wait() is result
    _until_a_waiter_is_idle()
    idle = _waiters()
    for _ in range(5):  # one at a time: an idle thread takes each, none is added
        works = [_Work()]
        future = future_of_works(works, None)
        works[0].finish()
        future.wait()
        _until_a_waiter_is_idle()  # the future completes inside the job, just before its thread is idle again
    assert _waiters() == idle, (idle, _waiters())


@pytest.mark.timeout(60)
def test_future_of_works_fails_with_the_first_failure() -> None:
    works = [_Work(), _Work()]
    future = future_of_works(works, None)
    works[0].finish(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
    with pytest.raises(RuntimeError, match="Timed out waiting 3000ms for recv"):
        future.wait()


@pytest.mark.timeout(60)
def test_a_callback_may_wait_for_a_later_work_without_deadlock() -> None:
    """The thread that completes the first future runs its callback, which waits for a second future: another
    thread must complete that one (a single waiting thread would deadlock here)."""
    first, second = _Work(), _Work()
    chained = future_of_works([first], None).then(lambda _: future_of_works([second], 7).wait())
    first.finish()
    threading.Timer(0.2, second.finish).start()
    assert chained.wait() == 7
