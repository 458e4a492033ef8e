"""Making and dropping DDPs and process groups in one process: no rank aborts, no group outlives its DDP.

A hyper-parameter sweep, a test suite or an elastic restart builds a process group, a DDP and a hook on it,
trains a little, destroys the group and drops everything, many times in one process. Two things went wrong:

* a hook's future callbacks run on the group's gloo worker thread; where one of them held the last reference
  to the hook state (and through it to the group), the group was destroyed on its own worker thread, whose
  destructor joins that thread: ``terminate called after throwing an instance of 'std::system_error' what():
  Resource deadlock avoided``, SIGABRT (torch's DDP with gradcomm's ``powerSGD_hook``, in every run of 30
  rounds). The launcher now releases what it is given before the collective it leads to can complete (see
  :mod:`gradcomm.comm.launcher`);
* gradcomm's DDP held itself in reference cycles (its reducer's bound methods, each bucket's staging), as did
  ``AutoHookState``: a dropped DDP kept its buckets and its group's gloo threads until the cyclic collector
  ran (3 threads a round with the collector off).

Both DDP kinds run, one after the other, in one pair of rank processes: every hook of the registry (a
two-layer MLP, ``bucket_cap_mb=0.001``, 3 backward passes, warm-ups shortened so that compression runs) for one
round, then :data:`ROUNDS` more, and ``powersgd`` for :data:`POWERSGD_ROUNDS` more (the case that aborted;
20 rounds aborted every run before the fix). A rank that aborts fails the test with its exit code. The process's
threads (``threading`` and ``/proc/self/task``, gradcomm's waiter threads left out: a pool that grows to the
number of waits at once and is reused) must be no more after a hook's later rounds than after its first:
on gradcomm's DDP with the cyclic collector off, on torch's DDP after a collection (torch's DDP holds itself
in cycles; torch's DDP with no hook at all hangs in its destructor when its group was destroyed first, so
torch's own ``allreduce_hook`` is the reference run there). ``benchmarks/soak_groups.py`` runs 100 rounds per
hook, and torch's own ``powerSGD_hook``, which aborts as gradcomm's did (its callbacks hold its state).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from gradcomm.hooks.registry import hook_names, register_comm_hook_by_name
from gradcomm.testing import run_on_ranks
from tests.support.ranks import DDP_KINDS, make_ddp

ROUNDS = 1
POWERSGD_ROUNDS = 20
OPTIONS: dict[str, dict[str, Any]] = {
    "powersgd": {"start_powerSGD_iter": 2},
    "powersgd_rank2": {"start_powerSGD_iter": 2},
    "batched_powersgd": {"start_powerSGD_iter": 2},
    "batched_powersgd_rank2": {"start_powerSGD_iter": 2},
    # without the intra-node allreduce: with it the state makes subgroups of the default group, which torch
    # keeps (as its own PostLocalSGDState's) until the default group is destroyed
    "post_localsgd": {"start_localSGD_iter": 2, "post_local_gradient_allreduce": False},
    "hierarchical": {"inner": "powersgd", "ranks_per_node": 1, "start_powerSGD_iter": 2},
    "auto": {"candidates": "allreduce+powersgd:start_powerSGD_iter=2", "trial_steps": 1},
}
TORCH_ALLREDUCE = "torch's allreduce_hook"
"""The reference: torch's own hook on torch's DDP. (torch's DDP with no hook at all hangs in its destructor
when its group was destroyed first, in the first round.)"""
TORCH_POWERSGD = "torch's powerSGD_hook"
"""torch's own PowerSGD on torch's DDP: aborts, its callbacks hold its state (``benchmarks/soak_groups.py``)."""
TORCH_HOOKS: dict[str, Callable[[dist.ProcessGroup], tuple[Any, Callable[..., Any]]]] = {
    TORCH_ALLREDUCE: lambda group: (group, default_hooks.allreduce_hook),
    TORCH_POWERSGD: lambda group: (
        powerSGD_hook.PowerSGDState(group, matrix_approximation_rank=1, start_powerSGD_iter=2),
        powerSGD_hook.powerSGD_hook,
    ),
}
"""torch's own hooks, by name: ``(state, hook)`` on a group."""


def _options(name: str) -> dict[str, Any]:
    from gradcomm.compression.registry import methods

    return OPTIONS.get(name, {"min_numel": 1} if name in methods() else {})


def thread_counts() -> tuple[int, int]:
    """(Python threads, OS threads of the process), gradcomm's waiter threads left out of both."""
    waiters = sum(1 for thread in threading.enumerate() if thread.name == "gradcomm-waiter")
    return threading.active_count() - waiters, len(os.listdir("/proc/self/task")) - waiters


def settled_counts(most: tuple[int, int] | None = None, seconds: float = 3.0) -> tuple[int, int]:
    """:func:`thread_counts` once at or below ``most``, else as they are after ``seconds``; with no ``most``,
    the lowest seen in ``seconds``. A thread that is just starting or ending (a waiter, a peer's connection)
    is not a leak (gloo's TCP loop thread is replaced when a group goes, and for a moment there are two);
    a group's threads that stay are."""
    deadline = time.monotonic() + seconds
    lowest = thread_counts()
    while time.monotonic() < deadline and (most is None or not _at_most(lowest, most)):
        time.sleep(0.01)
        lowest = min(lowest, thread_counts())
    return lowest


def thread_names() -> dict[str, int]:
    """The process's OS threads by name (gloo's workers are ``pt_gloo_runloop``), for a failure's message."""
    names: Counter[str] = Counter()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as file:
                names[file.read().strip()] += 1
        except OSError:  # ended meanwhile
            pass
    return dict(names)


def _at_most(counts: tuple[int, int], most: tuple[int, int]) -> bool:
    return counts[0] <= most[0] and counts[1] <= most[1]


def one_round(kind: str, hook: str) -> None:
    """A group, a DDP and its hook, three backward passes, the group destroyed, everything dropped."""
    group = dist.new_group(list(range(dist.get_world_size())))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ddp = make_ddp(kind, model, bucket_cap_mb=0.001, process_group=group)
    if hook in TORCH_HOOKS:
        ddp.register_comm_hook(*TORCH_HOOKS[hook](group))
    else:
        register_comm_hook_by_name(ddp, hook, process_group=group, **_options(hook))
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        ddp(torch.randn(8, 16, generator=generator)).sum().backward()
    dist.destroy_process_group(group)


def soak(kind: str, hooks: list[tuple[str, int]], collector: bool) -> dict[str, tuple[Any, ...]]:
    """Each ``(hook, rounds)`` in turn: one round, the thread counts, ``rounds`` more rounds, the counts again
    (and the threads by name).

    The first round makes the threads a process makes once (torch's and gloo's, gradcomm's waiters), so the
    rounds after it must not add any. ``collector``: the cyclic collector stays on, and runs before each
    count (torch's DDP frees its groups only through it); off, a group must go as soon as its DDP is dropped.
    """
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # a state's notes per round
    counts = {}
    if not collector:
        gc.disable()
    try:
        for hook, rounds in hooks:
            one_round(kind, hook)
            if collector:
                gc.collect()
            before = settled_counts(seconds=0.1)
            for _ in range(rounds):
                one_round(kind, hook)
            if collector:
                gc.collect()
            counts[hook] = (before, settled_counts(before), thread_names())
    finally:
        gc.enable()
    return counts


def _plan(kind: str) -> list[tuple[str, int]]:
    reference = [(TORCH_ALLREDUCE, ROUNDS)] if kind == "torch" else []
    return [*reference, *((name, ROUNDS) for name in hook_names()), ("powersgd", POWERSGD_ROUNDS)]


def soak_each_kind(plans: dict[str, list[tuple[str, int]]]) -> dict[str, dict[str, tuple[Any, ...]]]:
    """:func:`soak` for each DDP kind in turn, in one pair of ranks (one start of the ranks for both); the counts
    are compared per hook, so threads an earlier kind left behind are in both counts of a later one."""
    return {kind: soak(kind, plan, kind == "torch") for kind, plan in plans.items()}


@pytest.fixture(scope="module")
def soaked() -> list[dict[str, dict[str, tuple[Any, ...]]]]:
    # a rank that aborts makes run_on_ranks raise, naming its exit code
    return run_on_ranks(soak_each_kind, 2, args=({kind: _plan(kind) for kind in DDP_KINDS},), timeout=300)


@pytest.mark.slow
@pytest.mark.timeout(330)
@pytest.mark.parametrize("kind", DDP_KINDS)
def test_dropped_ddps_free_their_groups_at_once_and_no_rank_aborts(
    soaked: list[dict[str, dict[str, tuple[Any, ...]]]], kind: str
) -> None:
    for rank, counts in enumerate(by_kind[kind] for by_kind in soaked):
        grown = {hook: result for hook, result in counts.items() if not _at_most(result[1], result[0])}
        assert not grown, (
            f"rank {rank} on {kind}'s DDP: threads (Python, OS) before and after the rounds of these hooks, and "
            f"the OS threads by name after: {grown}"
        )
