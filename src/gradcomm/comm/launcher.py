"""Launching a hook's collectives in one order on every rank, without ever blocking the hook's thread.

Every rank must enter a process group's collectives in the same order, or unrelated collectives pair up
(mixing data, or failing on mismatched sizes). A hook launches its first collectives while DDP calls it, but
many algorithms have a second stage that needs the first one's result (PowerSGD's ``Q`` after ``P``, the
all-gather after a compressed reduce-scatter). Launched from the first stage's completion callback, the second
collective would start from a backend thread at a moment that differs between ranks, so it could overtake,
or be overtaken by, the next bucket's first stage on one rank and not on another. Waiting for the first stage
on the hook's thread instead keeps the order but stops the hook from overlapping with backward.

:class:`OrderedLauncher` does neither: every collective *reserves* its place in order when the hook is called
(so the order is the order of hook calls, the same on every rank) and is *launched* when it is ready and every
earlier reservation has been launched, from whichever thread made it ready. Nothing waits.

A collective that cannot be launched (its input failed, or launching raised) stops the launcher for good:
the collectives after it would pair with the peers' version of the missing one, so they fail without
launching. The peers then wait for a collective this rank never enters and fail when the process group's
timeout passes, instead of exchanging mismatched data.

One launcher per hook state: its order is that state's hook calls.

**What a backend thread releases.** A collective's callbacks run on the backend's thread that completes it
(one of gloo's worker threads), and torch releases a callback there only after the future it completes, so
after the training loop may have gone on and dropped the DDP, the hook state and the process group. A group
whose last reference goes on one of its own worker threads is destroyed there, and gloo's destructor joins
that very thread: ``std::system_error: Resource deadlock avoided``, and the process aborts. So the closures
the launcher is given (a prepare function, a launch: they hold the hook's state or its group) are released
before the collective they lead to can complete: a prepare function as soon as it has run, a launch as soon
as its collective has started, before anything is chained to its result. Callbacks that hooks chain with
``Future.then`` themselves must hold tensors and plain values only, never a state or a group.
"""

from __future__ import annotations

import contextvars
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from gradcomm.comm.futures import new_future

__all__ = ["Launch", "OrderedLauncher", "Slot"]

Launch = Callable[[], torch.futures.Future[Any]]
"""Starts one collective (asynchronously) and returns its future."""


class Slot:
    """A reserved place in the launch order; :attr:`future` completes with its collective's result."""

    __slots__ = ("context", "future", "launch")

    def __init__(self, device: torch.device) -> None:
        self.launch: Launch | None = None
        self.future: torch.futures.Future[Any] = new_future(device)
        # launched in the context it was reserved in (whichever thread launches it): its traffic is counted
        # for the DDP whose hook call reserved it
        self.context = contextvars.copy_context()

    def _run(self) -> BaseException | None:
        """Launch the collective; return the exception if launching it failed.

        The launch closure (it holds buffers and the group) is released here, before the slot's future can
        complete: see the module's docstring.
        """
        assert self.launch is not None
        launch, self.launch = self.launch, None
        try:
            collective = self.context.run(launch)
        except BaseException as exc:
            del launch
            self._fail(exc)
            return exc
        del launch
        collective.then(self._complete)
        return None

    def _fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)

    def _complete(self, collective: torch.futures.Future[Any]) -> None:
        try:
            value = collective.value()
        except BaseException as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(value)


class OrderedLauncher:
    """Launches collectives in the order they were reserved, from whichever thread makes the next one ready.

    * :meth:`launch`: a collective ready now (reserved and released at once);
    * :meth:`launch_after`: a collective that needs another future's result first: its place is reserved now,
      and it is prepared and launched when that future completes;
    * :meth:`reserve`, :meth:`release`, :meth:`cancel`: the same in two steps, for callers that prepare the
      collective themselves;
    * :meth:`wait_until_launched`: for the end of an iteration (see there).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._all_launched = threading.Condition(self._lock)
        self._queue: deque[Slot] = deque()
        self._draining = False
        self._stopped_by: BaseException | None = None

    def reserve(self, device: torch.device) -> Slot:
        """The next place in order, for a collective whose result will live on ``device``."""
        slot = Slot(device)
        with self._lock:
            self._queue.append(slot)
            if self._stopped_by is not None:
                self._drain()
        return slot

    def release(self, slot: Slot, launch: Launch) -> None:
        """``slot``'s collective is ready: ``launch`` starts it as soon as every earlier one has started."""
        with self._lock:
            slot.launch = launch
            self._drain()

    def cancel(self, slot: Slot, error: BaseException) -> None:
        """``slot`` will never be launched (``error`` says why): fail it and stop the launcher."""
        with self._lock:
            if slot in self._queue:
                self._queue.remove(slot)
            slot._fail(error)
            self._stop(error)
            self._drain()

    def launch(self, launch: Launch, device: torch.device) -> torch.futures.Future[Any]:
        """Launch a collective that is ready now, in order; its future holds the collective's result."""
        slot = self.reserve(device)
        self.release(slot, launch)
        return slot.future

    def launch_after(
        self,
        future: torch.futures.Future[Any],
        prepare: Callable[[torch.futures.Future[Any]], Launch],
        device: torch.device,
    ) -> torch.futures.Future[Any]:
        """Reserve a place now; when ``future`` completes, ``prepare(future)`` (local work: decode, compute)
        returns the collective to launch there. If ``future`` failed or ``prepare`` raises, the place is
        cancelled (stopping the launcher) and the returned future fails with that error."""
        slot = self.reserve(device)
        # ready() is released by the thread that runs it only after the future it completes: it must not
        # keep prepare (and what prepare holds) once it has run; see the module's docstring
        pending = [prepare]
        del prepare

        def ready(done: torch.futures.Future[Any]) -> None:
            prepare = pending.pop()
            try:
                launch = prepare(done)
            except BaseException as exc:
                del prepare
                self.cancel(slot, exc)
                return
            del prepare
            with self._lock:
                slot.launch, launch = launch, None  # the slot holds it alone: _run releases it
                self._drain()

        future.then(ready)
        return slot.future

    def wait_until_launched(self) -> None:
        """Block until every reserved collective is launched or failed (not finished).

        For the last bucket of an iteration only: DDP may issue collectives of its own as soon as that hook
        call returns (torch's map of used parameters, with ``find_unused_parameters=True``), and they must
        come after the hook's on every rank. DDP waits for every bucket right after anyway.
        """
        with self._all_launched:
            self._all_launched.wait_for(lambda: not self._queue)

    def _stop(self, error: BaseException) -> None:
        if self._stopped_by is None:
            self._stopped_by = error

    def _not_launched(self) -> RuntimeError:
        return RuntimeError(
            "collective not launched: an earlier collective of this hook failed on this rank "
            f"({type(self._stopped_by).__name__}: {self._stopped_by}), and launching later ones would pair "
            "them with different collectives on the other ranks"
        )

    def _drain(self) -> None:
        if self._draining:  # a collective completed inline, inside _run(): the loop below continues
            return
        self._draining = True
        try:
            while self._queue and (self._stopped_by is not None or self._queue[0].launch is not None):
                slot = self._queue.popleft()
                if self._stopped_by is not None:
                    slot._fail(self._not_launched())
                    continue
                error = slot._run()
                if error is not None:
                    self._stop(error)
        finally:
            self._draining = False
        if not self._queue:
            self._all_launched.notify_all()
