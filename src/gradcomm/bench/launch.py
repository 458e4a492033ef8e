"""Start, watch and end the local rank processes of ``gradcomm bench`` so that nothing is lost or left behind.

:func:`gradcomm.testing.run_on_ranks` does the same job for tests. A bench is run by a person at a terminal,
which asks for four things more:

* Each rank's stdout and stderr go to ``<log_dir>/rank<i>.log`` from the rank's first instruction on, with
  Python's logging at INFO level (what the rank is doing). gloo and c10d write warnings, and C++ stack traces
  when a peer dies, straight to file descriptor 2; the user sees one line naming the failing rank and its
  log instead.
* Ranks die with their parent (``PR_SET_PDEATHSIG`` on Linux): a parent killed with SIGKILL cleans nothing
  up, and a rank blocked in a collective would otherwise live on until the collective timeout.
* Ranks ignore SIGINT. Ctrl-C signals the terminal's whole foreground process group; the parent alone
  handles it, by killing the ranks at once.
* After reporting its result or failure a rank leaves with :func:`os._exit`, running no C++ destructor:
  those of a gloo process group whose peer is gone can throw (``gloo::IoException``, then
  ``std::terminate`` and SIGABRT) and turn a clean report into an abort.
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
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradcomm.testing import free_port

__all__ = ["RankFailure", "run_ranks"]

_POLL_SECONDS = 0.05
_GRACE_SECONDS = 3.0  # for the peers of a failed rank to fail in turn and report why
_EXIT_SECONDS = 5.0  # for a rank that reported to exit by itself
_LOG_TAIL_LINES = 40
_PR_SET_PDEATHSIG = 1


class RankFailure(RuntimeError):
    """A rank raised, died, or the run passed its timeout; every rank process has been killed.

    ``str(error)`` is one line naming the rank that failed first and its log; ``report`` is the whole story
    for a file: that rank's traceback, what every rank did, and the end of the failing rank's log.
    """

    def __init__(self, summary: str, report: str, rank: int | None = None, log: Path | None = None) -> None:
        super().__init__(summary)
        self.report = report
        self.rank = rank
        self.log = log


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
    log: Path
    parent_pid: int


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies, and exit now if that already happened.

    The signal follows the death of the parent *thread* that started the process; :func:`run_ranks` waits
    in that thread until the ranks are gone. Where prctl is missing (not Linux) the parent's clean-up is
    all there is.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def _redirect_output(log: Path) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _leave(results: mp.Queue, status: int) -> None:
    """Exit once the report has left through the pipe, without destructors (see the module docstring)."""
    sys.stdout.flush()
    sys.stderr.flush()
    results.close()
    results.join_thread()
    os._exit(status)


def _rank_main(fn: Callable[..., Any], args: Sequence[Any], spec: _Rank, results: mp.Queue) -> None:
    _die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _redirect_output(spec.log)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank {spec.rank} (pid %(process)d) %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    status = 1
    try:
        if spec.namespace is not None:
            from gradcomm.testing.network import enter_namespace

            enter_namespace(spec.namespace)
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
        # Plain pickle: the queue's own pickler would send tensors as shared-memory handles that die with the rank.
        value = pickle.dumps(fn(*args))
        results.put((spec.rank, True, value, time.time()))
        status = 0
    except BaseException as exc:  # everything, SystemExit included, ends in a report
        traceback.print_exc()
        results.put((spec.rank, False, f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}", time.time()))
    finally:
        _leave(results, status)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    log_dir: Path,
    timeout: float,
    collective_timeout: float,
    namespaces: Sequence[str] | None = None,
    master_addr: str = "127.0.0.1",
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks joined in one process group; return their results.

    ``fn`` must be a module-level function; its arguments and results picklable. ``log_dir`` (created if
    missing) receives ``rank<i>.log``, each rank's stdout and stderr. ``namespaces`` places rank ``i`` in
    network namespace ``namespaces[i]`` (see :class:`gradcomm.testing.network.ShapedNetwork`), ``master_addr`` is
    then rank 0's address there. Call it from the thread that is to outlive the ranks (see
    :func:`_die_with_parent`). On return, raise or KeyboardInterrupt, no rank process is left.

    Raises:
        RankFailure: a rank raised, exited without a result, or the run passed ``timeout`` seconds.
    """
    if namespaces is not None and len(namespaces) != world_size:
        raise ValueError(f"run_ranks: {len(namespaces)} namespaces given for {world_size} ranks")
    log_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
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
            log=log_dir / f"rank{rank}.log",
            parent_pid=os.getpid(),
        )
        for rank in range(world_size)
    ]
    procs = [
        ctx.Process(
            target=_rank_main, args=(fn, tuple(args), spec, results), name=f"gradcomm-bench-rank{spec.rank}", daemon=True
        )
        for spec in specs
    ]
    watch = _Watch(procs, results)
    try:
        _start(procs)
        deadline = time.monotonic() + timeout
        while len(watch.values) < world_size and not watch.failures and time.monotonic() < deadline:
            watch.collect(_POLL_SECONDS)
            if watch.dead_unreported():
                watch.collect(_POLL_SECONDS)  # a report put just before exit may still be in the pipe
                if watch.dead_unreported():
                    break
        if len(watch.values) < world_size:
            watch.wait_for_exits(_GRACE_SECONDS)
            raise watch.failure(specs, timeout)
        watch.wait_for_exits(_EXIT_SECONDS)
    finally:
        watch.kill_all()
        results.close()
    return [watch.values[rank] for rank in range(world_size)]


def _start(procs: list[Any]) -> None:
    """Start the rank processes with SIGINT blocked, which they keep across exec.

    Ctrl-C signals the terminal's whole foreground process group: a rank still starting Python, before
    :func:`_rank_main` ignores SIGINT, would print a KeyboardInterrupt traceback of its own to the terminal.
    The parent handles the Ctrl-C as at any other time.
    """
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
        self.failures: dict[int, tuple[float, str]] = {}
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
        return [
            rank
            for rank, proc in enumerate(self.procs)
            if not self.reported(rank) and proc.exitcode is not None
        ]

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

    def failure(self, specs: list[_Rank], timeout: float) -> RankFailure:
        """One error naming the root cause first: a rank that died, then the first to raise, then a stall."""
        world_size = len(self.procs)
        self.kill_all()
        dead = self.dead_unreported()
        dead = [rank for rank in dead if rank not in self.killed]
        root_traceback = ""
        if dead:
            rank = dead[0]
            summary = (
                f"rank {rank} of {world_size} exited with code {_exit_text(self.procs[rank].exitcode)} "
                f"without reporting a result; its output: {specs[rank].log}"
            )
        elif self.failures:
            rank = min(self.failures, key=lambda r: self.failures[r][0])
            root_traceback = self.failures[rank][1]
            summary = f"rank {rank} of {world_size} failed: {_first_line(root_traceback)}; its output: {specs[rank].log}"
        else:
            missing = [r for r in range(world_size) if r not in self.values]
            summary = (
                f"ranks {missing} did not finish within {timeout:g} s and were killed (raise --timeout, or see "
                f"their output in {specs[0].log.parent})"
            )
            return RankFailure(summary, summary + "\n\n" + self._statuses(specs) + "\n")
        sections = [summary]
        if root_traceback:
            sections.append(f"rank {rank}'s error:\n{root_traceback.rstrip()}")
        sections.append(self._statuses(specs))
        sections.append(f"end of rank {rank}'s output ({specs[rank].log}):\n{_tail(specs[rank].log)}")
        return RankFailure(summary, "\n\n".join(sections) + "\n", rank, specs[rank].log)

    def _statuses(self, specs: list[_Rank]) -> str:
        lines = ["every rank:"]
        for rank, proc in enumerate(self.procs):
            if rank in self.values:
                what = "reported its result"
            elif rank in self.failures:
                what = f"reported {_first_line(self.failures[rank][1])}"
            else:
                what = "reported nothing"
            ending = "killed by the launcher" if rank in self.killed else f"exit code {_exit_text(proc.exitcode)}"
            lines.append(f"  rank {rank}: {what}; {ending}; output in {specs[rank].log}")
        return "\n".join(lines)


def _exit_text(code: int | None) -> str:
    if code is None or code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)


def _first_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.strip()), text).strip()


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(none: the rank ended before it opened its log)"
    except OSError as exc:
        return f"(unreadable: {exc})"
    return "\n".join(lines[-_LOG_TAIL_LINES:]) if lines else "(empty)"
