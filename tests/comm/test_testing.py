"""gradcomm.testing: results in rank order, failures carry the rank's traceback, nothing hangs.

The last tests look at the outcome of :func:`gradcomm.testing.processes.launch`, the core that both
``run_on_ranks`` and ``gradcomm bench`` use, and at the options only the bench asks for.
"""

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradcomm.testing import RankError, run_on_ranks
from gradcomm.testing.processes import Cause, launch, rank_context
from gradcomm.testing.ranks import START_METHOD_ENV


def _sum_of_ranks(offset: float) -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item() + offset


def _tensor_result() -> torch.Tensor:
    return torch.full((3,), float(dist.get_rank()))


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def _exit_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _stall() -> None:
    import time

    time.sleep(60)


@pytest.mark.timeout(60)
def test_results_in_rank_order():
    assert run_on_ranks(_sum_of_ranks, 3, args=(0.5,)) == [3.5, 3.5, 3.5]


@pytest.mark.timeout(60)
def test_tensors_can_be_returned():
    first, second = run_on_ranks(_tensor_result, 2)
    assert torch.equal(first, torch.zeros(3)) and torch.equal(second, torch.ones(3))


@pytest.mark.timeout(60)
def test_failing_rank_traceback_is_reported():
    expected = r"(?s)failed on rank 1 of 2.*ValueError: boom on purpose.*_raise_on_rank_one"
    with pytest.raises(RankError, match=expected):
        run_on_ranks(_raise_on_rank_one, 2, collective_timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_dead_rank_and_stuck_rank_fail_within_timeout():
    with pytest.raises(RankError, match=r"rank 1 of 2 exited with code 3"):
        run_on_ranks(_exit_on_rank_one, 2, collective_timeout=10)
    # the whole wait is the timeout; the stall is reported the same wherever the ranks are when it ends
    with pytest.raises(RankError, match=r"did not finish within 5 s"):
        run_on_ranks(_stall, 2, timeout=5)


def _signals_seen() -> tuple[bool, int]:
    """Whether this rank ignores SIGINT, and the signal it gets when its parent dies."""
    death_signal = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(death_signal))  # PR_GET_PDEATHSIG
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN, death_signal.value


def _log_then_fail_on_rank_one() -> tuple[bool, int]:
    print(f"stdout of rank {dist.get_rank()}", flush=True)
    os.write(2, b"straight to fd 2\n")
    logging.getLogger("gradcomm.check").info("rank is working")
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    return _signals_seen()


def _rank_zero_dies_rank_one_sleeps() -> None:
    if dist.get_rank() == 0:
        os._exit(3)
    time.sleep(60)


@pytest.mark.timeout(60)
def test_launch_defaults_die_with_parent_and_keep_sigint():
    outcome = launch(_signals_seen, 1, timeout=50, collective_timeout=30)
    assert outcome.cause is None and outcome.results() == [(False, signal.SIGKILL)]
    assert (outcome.exitcodes, outcome.killed, outcome.logs, outcome.failures) == ([0], frozenset(), [], {})


@pytest.mark.timeout(60)
def test_launch_logs_ignores_sigint_and_names_the_raising_rank(tmp_path):
    logs = tmp_path / "logs"
    outcome = launch(
        _log_then_fail_on_rank_one, 2, timeout=50, collective_timeout=30, log_dir=logs, ignore_sigint=True
    )
    assert outcome.cause == Cause("raised", 1) and outcome.unfinished == [1]
    assert outcome.values == {0: (True, signal.SIGKILL)}
    assert outcome.failures[1].startswith("ValueError: rank 1 fails on purpose\n\nTraceback")
    assert (outcome.exitcodes, outcome.killed) == ([0, 1], frozenset())
    assert outcome.logs == [logs / "rank0.log", logs / "rank1.log"]
    for rank, log in enumerate(outcome.logs):
        text = log.read_text()
        assert f"stdout of rank {rank}" in text and "straight to fd 2" in text, text
        assert f"rank {rank} (pid " in text and "gradcomm.check: rank is working" in text, text
    assert "ValueError: rank 1 fails on purpose" in outcome.logs[1].read_text()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_launch_dead_rank_is_the_cause_and_its_stuck_peer_is_killed():
    outcome = launch(_rank_zero_dies_rank_one_sleeps, 2, timeout=50, collective_timeout=30)
    assert outcome.cause == Cause("died", 0) and outcome.unfinished == [0, 1]
    assert (outcome.exitcodes, outcome.killed) == ([3, -signal.SIGKILL], frozenset({1}))
    # killed after the grace period that follows a death (a stall at the 50 s timeout would be "stalled")


def _rank_one_uses_the_store_late() -> int:
    """Rank 0 returns at once; rank 1 talks to the rendezvous store (which rank 0 hosts) a second later."""
    if dist.get_rank() == 1:
        time.sleep(1.0)
        store = dist.distributed_c10d._get_default_store()
        store.set("late", "1")
        return int(store.get("late"))
    return 0


@pytest.mark.timeout(60)
def test_rank_zero_stays_until_every_rank_has_finished():
    """Rank 0 hosts the store: had it exited on returning, rank 1's later use of the store would fail."""
    assert run_on_ranks(_rank_one_uses_the_store_late, world_size=2, timeout=30) == [0, 1]


def _surroundings() -> tuple[str, str | None, bool, int]:
    """This rank's working directory, ``GRADCOMM_CHECK_VARIABLE``, whether dynamo is loaded, its parent."""
    return os.getcwd(), os.environ.get("GRADCOMM_CHECK_VARIABLE"), "torch._dynamo" in sys.modules, os.getppid()


def _unseeded_draws() -> tuple[int, float, float, float]:
    """This rank's torch seed and a draw from each unseeded generator: torch, numpy, Python's random."""
    import random

    import numpy as np

    return torch.initial_seed(), torch.rand(()).item(), float(np.random.rand()), random.random()


@pytest.mark.timeout(120)
def test_forked_ranks_get_the_callers_directory_and_environment(tmp_path, monkeypatch):
    """Ranks forked from the server (what this suite uses) start where the caller is, without dynamo loaded
    (it stays as lazy as in a spawned rank); once the caller's environment differs from the server's, they are
    spawned and see it."""
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    monkeypatch.chdir(tmp_path)
    server = rank_context("forkserver")[1]  # the server, or this process where the environment changed
    assert run_on_ranks(_surroundings, 2) == [(str(tmp_path), None, False, server)] * 2
    monkeypatch.setenv("GRADCOMM_CHECK_VARIABLE", "seen")
    assert run_on_ranks(_surroundings, 2) == [(str(tmp_path), "seen", False, os.getpid())] * 2


@pytest.mark.timeout(30)
def test_start_methods_other_than_spawn_and_forkserver_are_refused_by_name():
    with pytest.raises(ValueError, match=r"start_method must be 'spawn' or 'forkserver', got 'fork'"):
        rank_context("fork")  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_python_without_the_fork_servers_internals_spawns(monkeypatch):
    """The fork server's pid and "alive" pipe are CPython's private attributes: where they are missing,
    ranks are spawned by this process rather than failing."""
    from multiprocessing import forkserver

    monkeypatch.setattr(forkserver, "_forkserver", object())
    context, parent = rank_context("forkserver")
    assert (context.get_start_method(), parent) == ("spawn", os.getpid())


@pytest.mark.timeout(120)
def test_forked_ranks_draw_their_own_random_streams(monkeypatch):
    """As spawned ranks do: a test relying on unseeded ranks differing (replicas to be synchronised, drift to
    be found) must not pass because every forked rank inherited the server's generators."""
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    draws = run_on_ranks(_unseeded_draws, 2) + run_on_ranks(_unseeded_draws, 2)
    for stream in zip(*draws, strict=True):
        assert len(set(stream)) == len(draws), draws


def _note_pid_then_sleep(folder: str) -> None:
    (Path(folder) / f"rank{dist.get_rank()}").write_text(str(os.getpid()))
    time.sleep(60)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.timeout(120)
def test_forked_ranks_die_with_a_killed_caller(tmp_path):
    """A caller killed with SIGKILL cleans nothing up: the fork server must exit and take the ranks with it (it
    stays while any process holds the caller's "alive" pipe, which multiprocessing hands every rank it forks)."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from gradcomm.testing import run_on_ranks; "
        "from tests.comm.test_testing import _note_pid_then_sleep; "
        "run_on_ranks(_note_pid_then_sleep, 2, args=(sys.argv[2],), timeout=100)"
    )
    root = str(Path(__file__).resolve().parents[2])
    caller = subprocess.Popen(
        [sys.executable, "-c", script, root, str(tmp_path)], env={**os.environ, START_METHOD_ENV: "forkserver"}
    )
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("rank*"))) < 2:
            assert caller.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
        ranks = [int(path.read_text()) for path in sorted(tmp_path.glob("rank*"))]
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in ranks if _running(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert left == [], "ranks outlived their killed caller"
    finally:
        if caller.poll() is None:
            caller.kill()
