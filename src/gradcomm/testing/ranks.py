"""Run a function on N local ranks, for tests of DDP code and communication hooks.

:func:`run_on_ranks` starts ``world_size`` fresh Python processes (``spawn``), joins them into one
``torch.distributed`` process group over a free localhost port, runs ``fn(*args)`` on each and returns
the ranks' return values in rank order. It never hangs: the whole run has a hard timeout, every
collective has the process group's timeout, and a rank that raises, dies or stalls makes the call raise
:class:`RankError` carrying that rank's traceback, after every rank process has been killed.

Example::

    import torch.distributed as dist
    from gradcomm.testing import run_on_ranks

    def check_sum() -> float:
        t = torch.ones(1) * dist.get_rank()
        dist.all_reduce(t)
        return t.item()

    assert run_on_ranks(check_sum, world_size=3) == [3.0, 3.0, 3.0]

``fn`` must be importable by the child processes (a module-level function), and its arguments and
return value picklable (tensors included).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["RankError", "free_port", "run_on_ranks"]

_POLL_SECONDS = 0.05
_GRACE_SECONDS = 3.0


class RankError(RuntimeError):
    """A rank raised, exited without reporting, or did not finish within the timeout."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    fn: Callable[..., Any],
    args: Sequence[Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    collective_timeout: float,
    results: mp.Queue,
    namespace: str | None,
    master_addr: str,
) -> None:
    if namespace is not None:
        from gradcomm.testing.network import enter_namespace

        enter_namespace(namespace)  # before torch starts any thread: threads inherit the namespace
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    ok = False
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        # Plain pickle: the queue's own pickler would send tensors as shared-memory handles that die with the rank.
        value = pickle.dumps(fn(*args))
        results.put((rank, True, value, time.time()))
        ok = True
    except BaseException as exc:  # report everything, including KeyboardInterrupt and SystemExit
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}", time.time()))
    # Flush the report, then exit without running the process groups' C++ destructors: after a lost peer,
    # gloo's can throw from a background thread and abort the process (SIGABRT) with the report unsent.
    results.close()
    results.join_thread()
    os._exit(0 if ok else 1)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout: float = 120.0,
    collective_timeout: float = 30.0,
    namespaces: Sequence[str] | None = None,
    master_addr: str = "127.0.0.1",
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks joined in one process group; return their results.

    Args:
        fn: module-level function run on every rank after ``init_process_group``; it finds its rank with
            ``torch.distributed.get_rank()``.
        world_size: number of ranks (processes).
        args: positional arguments for ``fn``, the same on every rank.
        backend: ``"gloo"`` (CPU) or ``"nccl"``.
        timeout: hard limit in seconds for the whole run, process start-up included.
        collective_timeout: the process group's timeout: a collective that waits longer fails on its rank.
        namespaces: one network namespace per rank to run it in (see :class:`gradcomm.testing.network.ShapedNetwork`);
            ``master_addr`` is then rank 0's address there.
        master_addr: address of rank 0's rendezvous store.

    Raises:
        RankError: a rank raised (its traceback is in the message), died, or the run passed ``timeout``.
            All rank processes are killed before it is raised.
    """
    if world_size < 1:
        raise ValueError(f"run_on_ranks: world_size must be at least 1, got {world_size}")
    if namespaces is not None and len(namespaces) != world_size:
        raise ValueError(f"run_on_ranks: {len(namespaces)} namespaces given for {world_size} ranks")
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                fn,
                tuple(args),
                rank,
                world_size,
                port,
                backend,
                collective_timeout,
                results,
                None if namespaces is None else namespaces[rank],
                master_addr,
            ),
            name=f"gradcomm-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    fn_name = getattr(fn, "__qualname__", repr(fn))
    values: dict[int, Any] = {}
    failures: dict[int, tuple[float, str]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(failures) < world_size:
            if failures or time.monotonic() > deadline:
                break
            _collect(results, values, failures, _POLL_SECONDS)
            dead = _dead_unreported(procs, values, failures)
            if dead:
                # A result put just before exit may still be in the pipe.
                _collect(results, values, failures, _POLL_SECONDS)
                if any(rank in _dead_unreported(procs, values, failures) for rank in dead):
                    break
        if len(values) < world_size:
            # One rank's fault makes its peers fail too; wait briefly so the report can name the root cause.
            grace = time.monotonic() + _GRACE_SECONDS
            while len(values) + len(failures) < world_size and time.monotonic() < grace:
                _collect(results, values, failures, _POLL_SECONDS)
                if len(_dead_unreported(procs, values, failures)) + len(values) + len(failures) == world_size:
                    break
            raise _rank_error(fn_name, procs, values, failures, timeout)
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        _kill_all(procs)
        results.close()
    return [values[rank] for rank in range(world_size)]


def _collect(results: mp.Queue, values: dict[int, Any], failures: dict[int, tuple[float, str]], wait: float) -> None:
    """Move one report from the queue, if any arrives within ``wait``; failures are kept in time order."""
    try:
        rank, ok, value, when = results.get(timeout=wait)
    except queue.Empty:
        return
    if ok:
        values[rank] = pickle.loads(value)
    else:
        failures[rank] = (when, value)


def _dead_unreported(procs: list[mp.Process], values: dict[int, Any], failures: dict[int, tuple[float, str]]) -> list[int]:
    return [
        rank
        for rank, proc in enumerate(procs)
        if rank not in values and rank not in failures and not proc.is_alive() and proc.exitcode is not None
    ]


def _rank_error(
    fn_name: str, procs: list[mp.Process], values: dict[int, Any], failures: dict[int, tuple[float, str]], timeout: float
) -> RankError:
    """Build one error naming the root cause first: a dead rank, then a raising rank, then a stuck one."""
    world_size = len(procs)
    dead = _dead_unreported(procs, values, failures)
    if dead:
        rank = dead[0]
        message = (
            f"{fn_name}: rank {rank} of {world_size} exited with code {procs[rank].exitcode} without "
            "reporting a result (a negative code is the signal that killed it)"
        )
        root_traceback = None
    elif failures:
        rank = min(failures, key=lambda r: failures[r][0])  # the first to fail is the cause
        root_traceback = failures[rank][1]
        message = f"{fn_name} failed on rank {rank} of {world_size}:\n{root_traceback}"
    else:
        missing = [r for r in range(world_size) if r not in values]
        return RankError(
            f"{fn_name}: ranks {missing} did not finish within {timeout:g} s; all ranks were killed "
            "(a collective that not every rank entered, or a deadlock?)"
        )
    others = sorted(set(failures) - {rank})
    if others:
        message += "\n\nOther ranks failed as a consequence:\n" + "\n".join(
            f"rank {r}: {failures[r][1].splitlines()[0]}" for r in others
        )
    return RankError(message, rank, root_traceback)


def _kill_all(procs: list[mp.Process]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5.0)
