"""Start, watch and end the local rank processes of ``gradcomm bench`` so that nothing is lost or left behind.

The processes are run by :func:`gradcomm.testing.processes.launch`, as for
:func:`gradcomm.testing.run_on_ranks` in tests; this module asks it for what a bench run by a person at a
terminal needs more, and words its outcome for that person:

* Each rank's stdout and stderr go to ``<log_dir>/rank<i>.log`` from the rank's first instruction on, with
  Python's logging at INFO level (what the rank is doing). gloo and c10d write warnings, and C++ stack traces
  when a peer dies, straight to file descriptor 2; the user sees one line naming the failing rank and its
  log instead, and :attr:`RankFailure.report` has the whole story for a file.
* Ranks ignore SIGINT. Ctrl-C signals the terminal's whole foreground process group; the parent alone
  handles it, by killing the ranks at once.
* Ranks die with their parent (``PR_SET_PDEATHSIG`` on Linux), and after reporting their result or failure
  leave with :func:`os._exit`, running no C++ destructor (a gloo process group whose peer is gone can throw
  from one and abort): :func:`~gradcomm.testing.processes.launch` does both for every caller.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gradcomm.errors import GradcommError
from gradcomm.testing.processes import Cause, Outcome, launch

__all__ = ["RankFailure", "run_ranks"]

_LOG_TAIL_LINES = 40


class RankFailure(GradcommError, RuntimeError):
    """A rank raised, died, or the run passed its timeout; every rank process has been killed.

    ``str(error)`` is one line naming the rank that failed first and its log; ``report`` is the whole story
    for a file: that rank's traceback, what every rank did, and the end of the failing rank's log.
    """

    def __init__(self, summary: str, report: str, rank: int | None = None, log: Path | None = None) -> None:
        super().__init__(summary)
        self.report = report
        self.rank = rank
        self.log = log


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
    network namespace ``namespaces[i]`` (see :class:`gradcomm.testing.network.ShapedNetwork`),
    ``master_addr`` is then rank 0's address there. Call it from the thread that is to outlive the ranks
    (their PR_SET_PDEATHSIG follows the thread that started them). On return, raise or KeyboardInterrupt,
    no rank process is left.

    Raises:
        RankFailure: a rank raised, exited without a result, or the run passed ``timeout`` seconds.
    """
    outcome = launch(
        fn,
        world_size,
        args,
        timeout=timeout,
        collective_timeout=collective_timeout,
        backend=backend,
        namespaces=namespaces,
        master_addr=master_addr,
        log_dir=log_dir,
        ignore_sigint=True,
        name="gradcomm-bench-rank",
        caller="run_ranks",
    )
    if outcome.cause is not None:
        raise _failure(outcome, outcome.cause, log_dir, timeout)
    return outcome.results()


def _failure(outcome: Outcome, cause: Cause, log_dir: Path, timeout: float) -> RankFailure:
    """One error naming the root cause first: a rank that died, then the first to raise, then a stall."""
    logs, world_size, rank = outcome.logs, outcome.world_size, cause.rank
    if cause.kind == "stalled":
        summary = (
            f"ranks {outcome.unfinished} did not finish within {timeout:g} s and were killed (raise "
            f"--timeout, or see their output in {log_dir})"
        )
        return RankFailure(summary, summary + "\n\n" + _statuses(outcome) + "\n")
    root_traceback = ""
    if cause.kind == "died":
        summary = (
            f"rank {rank} of {world_size} exited with code {_exit_text(outcome.exitcodes[rank])} "
            f"without reporting a result; its output: {logs[rank]}"
        )
    else:
        root_traceback = outcome.failures[rank]
        first_line = _first_line(root_traceback)
        summary = f"rank {rank} of {world_size} failed: {first_line}; its output: {logs[rank]}"
    sections = [summary]
    if root_traceback:
        sections.append(f"rank {rank}'s error:\n{root_traceback.rstrip()}")
    sections.append(_statuses(outcome))
    sections.append(f"end of rank {rank}'s output ({logs[rank]}):\n{_tail(logs[rank])}")
    return RankFailure(summary, "\n\n".join(sections) + "\n", rank, logs[rank])


def _statuses(outcome: Outcome) -> str:
    lines = ["every rank:"]
    for rank, code in enumerate(outcome.exitcodes):
        if rank in outcome.values:
            what = "reported its result"
        elif rank in outcome.failures:
            what = f"reported {_first_line(outcome.failures[rank])}"
        else:
            what = "reported nothing"
        ending = "killed by the launcher" if rank in outcome.killed else f"exit code {_exit_text(code)}"
        lines.append(f"  rank {rank}: {what}; {ending}; output in {outcome.logs[rank]}")
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
