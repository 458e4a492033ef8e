"""Small helpers on ``torch.futures.Future``, in one place.

Hooks return futures, collectives produce them, and the reducer waits on them. These helpers build new
futures on the right device, combine several into one, adapt a ``torch.distributed`` work handle (on a
background thread where it has no future of its own: gloo's sends and receives), and wait for leftovers
without raising. (torchft keeps the same kind of helpers in a single ``futures.py``.)
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["completed", "future_of", "future_of_works", "new_future", "wait_quietly", "when_all"]

T = TypeVar("T")


def new_future(device: torch.device) -> torch.futures.Future[Any]:
    """An empty future whose value will live on ``device`` (CUDA futures must know their device)."""
    return torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()


def completed(value: T) -> torch.futures.Future[T]:
    """A future already holding ``value``."""
    future: torch.futures.Future[T] = torch.futures.Future()
    future.set_result(value)
    return future


def when_all(futures: Sequence[torch.futures.Future[Any]], device: torch.device) -> torch.futures.Future[list[Any]]:
    """A future of the values of ``futures``, in order, whose tensors live on ``device``; it fails with the
    first of them that fails.

    On CUDA it is a CUDA-aware future, which ``torch.futures.collect_all``'s is not: a callback chained to it
    with ``.then`` runs on a stream that waits for the collectives' work, and whoever waits for that
    callback's result waits for its kernels too. Chained to ``collect_all`` directly, the callback's kernels
    run on whatever stream the completing thread has, and a reader of the result on another stream can see
    the bucket before they have written it (found on 2 gloo ranks with CUDA tensors: replicas diverged).
    """
    if len(futures) == 1:
        return futures[0].then(lambda fut: [fut.value()])
    result = new_future(device)

    def finish(all_done: torch.futures.Future[list[torch.futures.Future[Any]]]) -> None:
        try:
            values = [each.value() for each in all_done.value()]  # on CUDA: the current stream waits for each
        except Exception as exc:
            result.set_exception(exc)
        else:
            result.set_result(values)  # on CUDA: marked complete on the current stream

    torch.futures.collect_all(list(futures)).add_done_callback(finish)
    return result


def future_of(work: dist.Work, result: T) -> torch.futures.Future[T]:
    """A future that completes with ``result`` when ``work`` does, and fails with its error.

    Some backend/collective pairs (gloo's reduce-scatter) have no future: those are waited for here.
    """
    try:
        future = work.get_future()
    except RuntimeError:
        work.wait()
        return completed(result)

    def done(fut: torch.futures.Future[Any]) -> T:
        fut.value()  # re-raises the collective's error, if any
        return result

    return future.then(done)


def future_of_works(works: Sequence[dist.Work], result: T) -> torch.futures.Future[T]:
    """A future that completes with ``result`` once every one of ``works`` is done, for work that has no
    future of its own (gloo's sends and receives). A background thread waits for them in order, each with the
    backend's own timeout, and completes the future, failing it with the first error; the future's callbacks
    then run on that thread, as they run on the backend's thread for a collective's future."""
    future: torch.futures.Future[T] = torch.futures.Future()
    _WAITERS.submit(_complete_when_done, works, future, result)
    return future


def _complete_when_done(works: Sequence[dist.Work], future: torch.futures.Future[T], result: T) -> None:
    try:
        for work in works:
            work.wait()
    except Exception as exc:  # handed on whole to whoever waits for the future
        future.set_exception(exc)
    else:
        future.set_result(result)


class _Waiters:
    """Daemon threads that run blocking waits, as many as are waiting at once and reused once idle (starting
    a thread costs several times as much as handing a job to an idle one). A job never queues behind a busy
    thread, so a callback that itself waits for a later job cannot deadlock; being daemons, they never keep
    the interpreter from exiting (``concurrent.futures`` joins its threads at exit)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """No threads yet. Also called in a forked child, where the parent's threads are gone (and its lock may
        be held)."""
        self._jobs: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[..., None], *args: Any) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        self._jobs.put((job, args))
        if start:
            threading.Thread(target=self._serve, name="gradcomm-waiter", daemon=True).start()

    def _serve(self) -> None:
        while True:
            job, args = self._jobs.get()
            job(*args)
            # an idle thread keeps nothing: the works waited for hold their group's connections (gloo's TCP
            # loop), which must go with the group, not at this thread's next job
            del job, args
            with self._lock:
                self._idle += 1


_WAITERS = _Waiters()
os.register_at_fork(after_in_child=_WAITERS._reset)


def wait_quietly(futures: Iterable[torch.futures.Future[Any] | None]) -> None:
    """Wait for every future that is not done, ignoring errors (already reported elsewhere), so that no
    collective outlives the step that launched it."""
    for future in futures:
        if future is not None and not future.done():
            try:
                future.wait()
            except Exception:
                pass
