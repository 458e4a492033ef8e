"""Start, watch and end local rank processes: the one mechanism under ``run_on_ranks`` and ``gradcomm bench``.

:func:`launch` starts ``world_size`` fresh Python processes (``spawn``), joins them into one
``torch.distributed`` process group over a free port (each rank optionally in its own network namespace),
runs ``fn(*args)`` on each and returns an :class:`Outcome`: every rank's value or failure, its exit code,
which ranks had to be killed, and the root :class:`Cause` of a failed run. It raises nothing for a rank's
fault, leaving the wording of the error to its callers, :func:`gradcomm.testing.run_on_ranks` (tests) and
:func:`gradcomm.bench.launch.run_ranks` (``gradcomm bench``); and it never returns or raises, Ctrl-C
included, while one of its rank processes lives.

Each rank:

* dies with its parent (``PR_SET_PDEATHSIG`` on Linux): a parent killed with SIGKILL cleans nothing up, and a
  rank blocked in a collective would otherwise live on until the collective timeout;
* with ``ignore_sigint``, is started with SIGINT blocked and then ignores it: Ctrl-C signals the terminal's
  whole foreground process group, and the parent alone handles it, by killing the ranks;
* with ``log_dir``, writes its stdout and stderr (file descriptors 1 and 2, where gloo and c10d write) to
  ``<log_dir>/rank<i>.log`` from its first instruction on, with Python's logging at INFO level, and prints
  the traceback of its failure there;
* reports ``(rank, ok, payload, time)`` on a queue, its result pickled with plain pickle (the queue's own
  pickler would send tensors as shared-memory handles that die with the rank);
* rank 0, which hosts the rendezvous store, stays after ``fn`` returned until every rank has finished ``fn``
  (a few seconds at most), so that a peer still using the store does not lose it;
* leaves with :func:`os._exit` once the report is flushed, running no C++ destructor: those of a gloo process
  group whose peer is gone can throw (``gloo::IoException``, then ``std::terminate`` and SIGABRT) and turn a
  clean report into an abort.

The parent collects reports until every rank has reported a result, one has reported a failure, one has
exited without a report, or ``timeout`` has passed. One rank's fault makes its peers fail too, so after a
failure it gives them a grace period to report why before killing every rank left; the cause it names is the
root one: a rank that died, else the first to raise, else a stall.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["Cause", "Outcome", "free_port", "launch", "log_rank_output", "set_parent_death_signal"]

_POLL_SECONDS = 0.05
_GRACE_SECONDS = 3.0  # for the peers of a failed rank to fail in turn and report why
_EXIT_SECONDS = 5.0  # for a rank that reported to exit by itself; for a killed one to be reaped
_PR_SET_PDEATHSIG = 1
_FINISHED_KEY = "gradcomm/testing/finished"


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Cause:
    """The root cause of a failed run, the first of these that applies.

    * ``"died"``: rank ``rank`` (the lowest such) exited without reporting and was not killed by the launcher;
    * ``"raised"``: rank ``rank`` reported a failure before any other rank did;
    * ``"stalled"``: no rank died or raised; ``rank`` is None and :attr:`Outcome.unfinished` were killed.
    """

    kind: Literal["died", "raised", "stalled"]
    rank: int | None


@dataclass(frozen=True)
class Outcome:
    """What became of the ranks of one :func:`launch`, once no rank process is left."""

    world_size: int
    values: dict[int, Any]  # rank -> the value its ``fn`` returned
    failures: dict[int, str]  # rank -> "Type: message\n\ntraceback" of what it raised
    exitcodes: list[int | None]  # per rank; negative: the signal that ended it; None: never started
    killed: frozenset[int]  # ranks the launcher killed (alive when the run ended)
    logs: list[Path]  # per rank, its log with ``log_dir``; empty without
    cause: Cause | None  # None: every rank returned a value

    @property
    def unfinished(self) -> list[int]:
        """Ranks that did not report a value."""
        return [rank for rank in range(self.world_size) if rank not in self.values]

    def results(self) -> list[Any]:
        """The ranks' values in rank order; only for a run without a :attr:`cause`."""
        return [self.values[rank] for rank in range(self.world_size)]


@dataclass(frozen=True)
class _Rank:
    """What a rank process needs to know, pickled to it by ``spawn``."""

    rank: int
    world_size: int
    port: int
    backend: str
    collective_timeout: float
    namespace: str | None
    master_addr: str
    log: Path | None
    ignore_sigint: bool
    parent_pid: int  # the process that starts it: the caller, or the fork server


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float,
    collective_timeout: float,
    backend: str = "gloo",
    namespaces: Sequence[str] | None = None,
    master_addr: str = "127.0.0.1",
    log_dir: Path | None = None,
    ignore_sigint: bool = False,
    name: str = "gradcomm-rank",
    caller: str = "launch",
    start_method: StartMethod = "spawn",
) -> Outcome:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks joined in one process group; say how each ended.

    ``fn`` must be a module-level function, its arguments and result picklable. ``timeout`` bounds the whole
    run, start-up included; ``collective_timeout`` is the process group's. ``namespaces`` places rank ``i``
    in network namespace ``namespaces[i]``, ``master_addr`` then being rank 0's address there. ``log_dir``
    (created if missing) and ``ignore_sigint`` are described in the module docstring; ``name`` prefixes the
    processes' names and ``caller`` the messages of ValueError. Call it from the thread that is to outlive
    the ranks: their PR_SET_PDEATHSIG follows the parent *thread* that started them. ``start_method``
    ``"forkserver"`` forks the ranks from a server process that has imported torch once (see
    :func:`rank_context`), where the environment allows it.

    Raises:
        ValueError: ``namespaces`` does not hold one namespace per rank.
    """
    if namespaces is not None and len(namespaces) != world_size:
        raise ValueError(f"{caller}: {len(namespaces)} namespaces given for {world_size} ranks")
    logs: list[Path] = []
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        logs = [log_dir / f"rank{rank}.log" for rank in range(world_size)]
    if start_method == "forkserver" and (namespaces is not None or ignore_sigint):
        start_method = "spawn"  # a namespace is entered, and SIGINT blocked, before Python starts: spawn's
    ctx, parent_pid = rank_context(start_method)
    results: mp.Queue = ctx.Queue()
    port = free_port()
    specs = [
        _Rank(
            rank=rank,
            world_size=world_size,
            port=port,
            backend=backend,
            collective_timeout=collective_timeout,
            namespace=None if namespaces is None else namespaces[rank],
            master_addr=master_addr,
            log=logs[rank] if logs else None,
            ignore_sigint=ignore_sigint,
            parent_pid=parent_pid,
        )
        for rank in range(world_size)
    ]
    procs = [
        ctx.Process(
            target=_rank_main, args=(fn, tuple(args), spec, results), name=f"{name}{spec.rank}", daemon=True
        )
        for spec in specs
    ]
    watch = _Watch(procs, results)
    try:
        _start(procs, block_sigint=ignore_sigint)
        deadline = time.monotonic() + timeout
        while len(watch.values) < world_size and not watch.failures and time.monotonic() < deadline:
            watch.collect(_POLL_SECONDS)
            if watch.dead_unreported():
                watch.collect(_POLL_SECONDS)  # a report put just before exit may still be in the pipe
                if watch.dead_unreported():
                    break
        watch.wait_for_exits(_EXIT_SECONDS if len(watch.values) == world_size else _GRACE_SECONDS)
    finally:
        watch.kill_all()
        results.close()
    return watch.outcome(logs)


StartMethod = Literal["spawn", "forkserver"]
_PRELOADED = ["torch", "torch.distributed", "gradcomm.testing.processes"]
_forkserver_environ: dict[str, str] | None = None
_PER_TEST_VARIABLES = {"PYTEST_CURRENT_TEST"}  # pytest's name of the running test, which no rank reads


def rank_context(start_method: StartMethod) -> tuple[Any, int]:
    """The multiprocessing context that starts rank processes, and the pid of their parent.

    ``"spawn"``: a fresh interpreter per rank, which imports torch itself (seconds of CPU each). ``"forkserver"``:
    ranks forked from one server process per caller, started at the first such call with torch,
    ``torch.distributed`` and gradcomm imported (not ``torch._dynamo``, which stays as lazy as under spawn); each
    rank still gets the caller's current ``sys.path`` and working directory (multiprocessing sends them per
    process), and dies with the server, which exits when the caller does. The server keeps the environment
    it started with, which modules read at import: while the caller's environment differs from it (pytest's
    ``PYTEST_CURRENT_TEST`` aside), ranks are spawned; so are they where CPython's private attributes of the
    fork server (its pid, its "alive" pipe) are missing.
    """
    global _forkserver_environ
    if start_method == "forkserver":
        from multiprocessing import forkserver

        environ = {key: value for key, value in os.environ.items() if key not in _PER_TEST_VARIABLES}
        if _forkserver_environ is None:
            _forkserver_environ = environ
        server = getattr(forkserver, "_forkserver", None)  # CPython's internals: spawn where they differ
        if _forkserver_environ == environ and hasattr(server, "_forkserver_alive_fd"):
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOADED)
            forkserver.ensure_running()
            pid = getattr(server, "_forkserver_pid", None)
            if isinstance(pid, int):
                return ctx, pid
    elif start_method != "spawn":
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    return mp.get_context("spawn"), os.getpid()


def _start(procs: list[Any], block_sigint: bool) -> None:
    """Start the rank processes, with SIGINT blocked if asked, which they keep across exec.

    Ctrl-C signals the terminal's whole foreground process group: a rank still starting Python, before
    :func:`_rank_main` ignores SIGINT, would print a KeyboardInterrupt traceback of its own. The parent
    handles the Ctrl-C as at any other time.
    """
    if not block_sigint:
        for proc in procs:
            proc.start()
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for proc in procs:
            proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _Watch:
    """The parent's view of the ranks: their reports, and which processes it had to kill."""

    def __init__(self, procs: list[Any], results: mp.Queue) -> None:
        self.procs = procs
        self.results = results
        self.values: dict[int, Any] = {}
        self.failures: dict[int, tuple[float, str]] = {}  # rank -> (when it failed, what it raised)
        self.killed: set[int] = set()

    def collect(self, wait: float) -> None:
        """Move one report from the queue, if one arrives within ``wait`` seconds."""
        try:
            rank, ok, value, when = self.results.get(timeout=wait)
        except queue.Empty:
            return
        if ok:
            self.values[rank] = pickle.loads(value)
        else:
            self.failures[rank] = (when, value)

    def reported(self, rank: int) -> bool:
        return rank in self.values or rank in self.failures

    def dead_unreported(self) -> list[int]:
        procs = enumerate(self.procs)
        return [rank for rank, proc in procs if not self.reported(rank) and proc.exitcode is not None]

    def wait_for_exits(self, seconds: float) -> None:
        """Collect reports until every started rank has exited, for at most ``seconds``."""
        until = time.monotonic() + seconds
        while any(proc.is_alive() for proc in self.procs) and time.monotonic() < until:
            self.collect(_POLL_SECONDS)
        while True:  # reports of ranks that exited meanwhile
            before = len(self.values) + len(self.failures)
            self.collect(0)
            if len(self.values) + len(self.failures) == before:
                break

    def kill_all(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.pid is not None and proc.is_alive():
                proc.kill()
                self.killed.add(rank)
        until = time.monotonic() + _EXIT_SECONDS
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(timeout=max(0.0, until - time.monotonic()))

    def outcome(self, logs: list[Path]) -> Outcome:
        world_size = len(self.procs)
        died = [rank for rank in self.dead_unreported() if rank not in self.killed]
        if died:
            cause: Cause | None = Cause("died", died[0])
        elif self.failures:
            cause = Cause("raised", min(self.failures, key=lambda r: self.failures[r][0]))
        elif len(self.values) < world_size:
            cause = Cause("stalled", None)
        else:
            cause = None
        return Outcome(
            world_size=world_size,
            values=dict(self.values),
            failures={rank: text for rank, (_, text) in self.failures.items()},
            exitcodes=[proc.exitcode for proc in self.procs],
            killed=frozenset(self.killed),
            logs=logs,
            cause=cause,
        )


def _rank_main(fn: Callable[..., Any], args: Sequence[Any], spec: _Rank, results: mp.Queue) -> None:
    _die_with_parent(spec.parent_pid)
    _as_if_spawned()
    if spec.ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.log is not None:
        log_rank_output(spec.log, spec.rank)
    status = 1
    try:
        if spec.namespace is not None:
            from gradcomm.testing.network import enter_namespace

            enter_namespace(spec.namespace)  # before torch starts any thread: threads inherit the namespace
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.update(
            MASTER_ADDR=spec.master_addr,
            MASTER_PORT=str(spec.port),
            RANK=str(spec.rank),
            WORLD_SIZE=str(spec.world_size),
            LOCAL_RANK=str(spec.rank),
            LOCAL_WORLD_SIZE=str(spec.world_size),
        )
        dist.init_process_group(
            spec.backend,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.collective_timeout),
        )
        value = pickle.dumps(fn(*args))
        results.put((spec.rank, True, value, time.time()))
        status = 0
    except BaseException as exc:  # everything, KeyboardInterrupt and SystemExit included, ends in a report
        if spec.log is not None:
            traceback.print_exc()
        failure = f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}"
        results.put((spec.rank, False, failure, time.time()))
    finally:
        _finish_together(spec, wait=status == 0)
        _leave(results, status)


def _finish_together(spec: _Rank, wait: bool) -> None:
    """Count this rank as finished in the store; with ``wait`` (``fn`` returned), keep the rank that hosts the
    rendezvous store (rank 0) until every rank has finished ``fn``, for at most ``_EXIT_SECONDS``: a peer still
    using the store (joining the group, creating a subgroup, in a store barrier) would otherwise lose it when
    rank 0 returns first. A rank whose ``fn`` raised leaves at once (its failure is what the run reports)."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        store = dist.distributed_c10d._get_default_store()
        store.add(_FINISHED_KEY, 1)
        if spec.rank != 0 or not wait:
            return
        deadline = time.monotonic() + _EXIT_SECONDS
        while store.add(_FINISHED_KEY, 0) < spec.world_size and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
    except Exception:  # a store whose peers are gone: leaving is all that is left
        return


def _as_if_spawned() -> None:
    """In a rank forked from the fork server (nothing to do in a spawned one): what a spawned rank has.

    * Its own random streams: every forked rank starts from the server's torch and numpy generator states,
      identical on every rank and in every group, where spawned ranks draw fresh seeds (Python's ``random``
      is reseeded at fork by Python itself).
    * No copy of the caller's "alive" pipe, which multiprocessing hands every process it forks (for processes
      of their own): the server exits once every copy is closed, so with one held here the server, and with
      it this rank (its parent-death signal), would outlive a killed caller.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_alive_fd", None) is None:
        return
    os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = None
    import numpy as np
    import torch

    torch.seed()
    np.random.seed()


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies, and exit now if that already happened.

    Where prctl is missing (not Linux) the parent's clean-up is all there is.
    """
    if set_parent_death_signal(signal.SIGKILL) and os.getppid() != parent_pid:
        os._exit(1)


def set_parent_death_signal(signum: int) -> bool:
    """Have the kernel send ``signum`` to this process when the thread that started it ends (``prctl``'s
    ``PR_SET_PDEATHSIG``); ``False`` where there is no prctl (not Linux).

    libc is loaded when this module is imported, so that this is safe between fork and exec (a
    ``preexec_fn``): it calls nothing that could wait for a lock another thread of the parent held.
    """
    if _LIBC is None:
        return False
    try:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except AttributeError:
        return False
    return True


try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
except OSError:
    _LIBC = None


def log_rank_output(log: Path, rank: int) -> None:
    """Send this rank process's stdout, stderr (file descriptors 1 and 2, so C++ output too) and INFO logging,
    each line naming the rank and pid, to ``log`` (truncated)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank {rank} (pid %(process)d) %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def _leave(results: mp.Queue, status: int) -> None:
    """Exit once the report has left through the pipe, without destructors (see the module docstring)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # none, closed, or its reader gone
            pass
    results.close()
    results.join_thread()
    os._exit(status)
