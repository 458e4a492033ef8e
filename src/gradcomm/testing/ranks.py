"""Run a function on N local ranks, for tests of DDP code and communication hooks.

:func:`run_on_ranks` starts ``world_size`` fresh Python processes (``spawn``; ``GRADCOMM_RANKS_START_METHOD=forkserver``
forks them from a server that imported torch once instead), joins them into one
``torch.distributed`` process group over a free localhost port, runs ``fn(*args)`` on each and returns
the ranks' return values in rank order. It never hangs: the whole run has a hard timeout, every
collective has the process group's timeout, and a rank that raises, dies or stalls makes the call raise
:class:`RankError` carrying that rank's traceback, after every rank process has been killed. The processes
are started, watched and ended by :func:`gradcomm.testing.processes.launch`, which ``gradcomm bench`` uses
too; this module words its outcome for tests.

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

import os
from collections.abc import Callable, Sequence
from typing import Any, cast

from gradcomm.errors import GradcommError
from gradcomm.testing.processes import Cause, Outcome, StartMethod, free_port, launch

__all__ = ["RankError", "free_port", "run_on_ranks"]

START_METHOD_ENV = "GRADCOMM_RANKS_START_METHOD"
"""Environment variable choosing how :func:`run_on_ranks` starts ranks: ``spawn`` (unset: the default) or
``forkserver``, which forks them from one server process that has imported torch and gradcomm, saving each
rank that import (seconds of CPU; gradcomm's own test suite sets it). See
``gradcomm.testing.processes.rank_context`` for what a forked rank shares with the server."""


class RankError(GradcommError, RuntimeError):
    """A rank raised, exited without reporting, or did not finish within the timeout."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


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
        namespaces: one network namespace per rank to run it in (see
            :class:`gradcomm.testing.network.ShapedNetwork`); ``master_addr`` is then rank 0's address there.
        master_addr: address of rank 0's rendezvous store.

    Raises:
        RankError: a rank raised (its traceback is in the message), died, or the run passed ``timeout``.
            All rank processes are killed before it is raised.
    """
    if world_size < 1:
        raise ValueError(f"run_on_ranks: world_size must be at least 1, got {world_size}")
    outcome = launch(
        fn,
        world_size,
        args,
        timeout=timeout,
        collective_timeout=collective_timeout,
        backend=backend,
        namespaces=namespaces,
        master_addr=master_addr,
        name="gradcomm-rank",
        caller="run_on_ranks",
        start_method=cast(StartMethod, os.environ.get(START_METHOD_ENV, "spawn")),
    )
    if outcome.cause is not None:
        raise _rank_error(getattr(fn, "__qualname__", repr(fn)), outcome, outcome.cause, timeout)
    return outcome.results()


def _rank_error(fn_name: str, outcome: Outcome, cause: Cause, timeout: float) -> RankError:
    """Build one error naming the root cause first: a dead rank, then a raising rank, then a stuck one."""
    world_size, rank = outcome.world_size, cause.rank
    root_traceback = None
    if cause.kind == "died":
        message = (
            f"{fn_name}: rank {rank} of {world_size} exited with code {outcome.exitcodes[rank]} without "
            "reporting a result (a negative code is the signal that killed it)"
        )
    elif cause.kind == "raised":
        root_traceback = outcome.failures[rank]
        message = f"{fn_name} failed on rank {rank} of {world_size}:\n{root_traceback}"
    else:
        return RankError(
            f"{fn_name}: ranks {outcome.unfinished} did not finish within {timeout:g} s; all ranks were "
            "killed (a collective that not every rank entered, or a deadlock?)"
        )
    others = sorted(set(outcome.failures) - {rank})
    if others:
        message += "\n\nOther ranks failed as a consequence:\n" + "\n".join(
            f"rank {r}: {outcome.failures[r].splitlines()[0]}" for r in others
        )
    return RankError(message, rank, root_traceback)
