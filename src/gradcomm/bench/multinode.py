"""``gradcomm bench --nodes N --procs-per-node P``: a multi-host run, emulated on this machine, started as a real one.

Each host is a network namespace of a :class:`~gradcomm.testing.network.HostNetwork`, its link to the others
shaped to ``--bandwidth`` (and ``--latency``); its ``P`` ranks share it, so their traffic to each other stays
on the host's loopback, the fast local path of a machine, and only traffic between hosts crosses the link.
In each host :func:`run_hosts` starts, with ``ip netns exec``, what a real N-node job runs on every node::

    python -m torch.distributed.run --nnodes N --nproc-per-node P --node-rank i --rdzv-backend c10d
        --rdzv-endpoint <host 0>:29400 --rdzv-id <id> --local-addr <host i> -m gradcomm bench <the same args>

torchrun's c10d rendezvous on host 0 joins them; the ranks then run the bench under torchrun
(:func:`gradcomm.bench.cli.run`), with these differences, which the variables of :func:`rank_environment`
ask for:

* gloo binds the host's interface (``GLOO_SOCKET_IFNAME``); torchrun's rendezvous and store use the host's
  address (``--local-addr``, and ``is_host`` for host 0, since the machine's hostname resolves to no address
  of the namespace);
* local rank 0 of each host records the byte counters of the host's link during every hook's training
  (:envvar:`GRADCOMM_BENCH_HOST_LINK`), and rank 0 reports the floor from them;
* every rank writes its output to ``<output>/logs/rank<i>.log`` (:envvar:`GRADCOMM_BENCH_LOG_DIR`), each
  torchrun to ``<output>/logs/host<i>.log``, and rank 0 the results to ``--output``;
* every rank writes the runs it finished so far to ``<output>/finished/rank<i>.json`` after each hook
  (:envvar:`GRADCOMM_BENCH_FINISHED_DIR`), as the bench's local ranks do, so that when a later hook fails (or
  the run passes ``--timeout``) the parent still reports the hooks every rank finished.

The parent owns the network and both torchruns: when one torchrun fails, the run passes ``--timeout``, or on
Ctrl-C, it stops them all (SIGTERM, which torchrun passes on to its ranks, then SIGKILL to whatever is left
in the hosts) and removes the namespaces; a torchrun whose parent dies gets SIGTERM from the kernel.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gradcomm.errors import GradcommError
from gradcomm.testing.network import HostNetwork
from gradcomm.testing.processes import log_rank_output, set_parent_death_signal

__all__ = ["FINISHED_DIR_ENV", "HOST_LINK_ENV", "LOG_DIR_ENV", "HostsFailure", "redirect_rank_output", "run_hosts"]

logger = logging.getLogger(__name__)

HOST_LINK_ENV = "GRADCOMM_BENCH_HOST_LINK"
"""Set by :func:`run_hosts` for the ranks: the interface of their host's link (its presence: the link is
emulated and shaped to ``--bandwidth``)."""

LOG_DIR_ENV = "GRADCOMM_BENCH_LOG_DIR"
"""Set by :func:`run_hosts` for the ranks: where each writes ``rank<RANK>.log``."""

FINISHED_DIR_ENV = "GRADCOMM_BENCH_FINISHED_DIR"
"""Set by :func:`run_hosts` for the ranks: where each writes ``rank<RANK>.json``, the runs it finished so far
(:func:`gradcomm.bench.runner.bench_rank`'s ``finished_dir``)."""

RDZV_PORT = 29400  # torchrun's default for c10d; free in a fresh namespace
_POLL_SECONDS = 0.2
_STOP_SECONDS = 10.0  # for torchrun to end its ranks after SIGTERM, before everything left is killed


class HostsFailure(GradcommError, RuntimeError):
    """A host's torchrun failed, or the run passed its timeout; every process and namespace is gone.

    ``str(error)`` is one line naming the failed host, the first failed rank where torchrun says which, and
    their logs.
    """


def rank_environment(net: HostNetwork, log_dir: Path, finished_dir: Path) -> dict[str, str]:
    """The environment of every host's torchrun, and so of its ranks."""
    return {
        **os.environ,
        "GLOO_SOCKET_IFNAME": net.ifname,
        HOST_LINK_ENV: net.ifname,
        LOG_DIR_ENV: str(log_dir),
        FINISHED_DIR_ENV: str(finished_dir),
        "PYTHONUNBUFFERED": "1",
    }


def torchrun_command(
    net: HostNetwork, host: int, procs_per_node: int, rdzv_id: str, bench_args: Sequence[str]
) -> list[str]:
    """Host ``host``'s torchrun of ``gradcomm bench <bench_args>``, in its namespace."""
    torchrun = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(len(net.namespaces)),
        "--nproc-per-node", str(procs_per_node),
        "--node-rank", str(host),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{net.master_addr}:{RDZV_PORT}",
        "--rdzv-id", rdzv_id,
        "--rdzv-conf", f"is_host={int(host == 0)}",
        "--local-addr", net.addresses[host],
        "--max-restarts", "0",
        "-m", "gradcomm", "bench", *bench_args,
    ]  # fmt: skip
    return net.exec_command(host, torchrun)


def without_option(args: Sequence[str], option: str) -> list[str]:
    """``args`` without ``option`` and its value (``--opt value`` or ``--opt=value``), wherever it occurs."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(f"{option}="):
            kept.append(arg)
    return kept


def run_hosts(
    bench_args: Sequence[str],
    *,
    nodes: int,
    procs_per_node: int,
    rate_bps: int,
    latency_s: float,
    output: Path,
    timeout: float,
) -> None:
    """Run ``gradcomm bench <bench_args> --output <output>`` on ``nodes`` emulated hosts; see the module.

    Returns once every torchrun has exited successfully (rank 0 has then written the results to ``output``).

    Raises:
        HostsFailure: a torchrun exited with an error, or the run passed ``timeout`` seconds; the runs each
            rank finished before are in ``output / "finished"`` (:func:`gradcomm.bench.runner.finished_runs`).
        NetworkSetupError: the hosts' network could not be built or removed.
    """
    output = output.resolve()
    log_dir, finished_dir = output / "logs", output / "finished"
    log_dir.mkdir(parents=True, exist_ok=True)
    finished_dir.mkdir(exist_ok=True)
    args = [*without_option(bench_args, "--output"), "--output", str(output)]
    with HostNetwork(nodes, rate_bps, latency_s) as net:
        env = rank_environment(net, log_dir, finished_dir)
        rdzv_id = f"gradcomm-bench-{net.prefix}"
        procs: list[subprocess.Popen[bytes]] = []
        logs = [log_dir / f"host{host}.log" for host in range(nodes)]
        try:
            for host in range(nodes):
                command = torchrun_command(net, host, procs_per_node, rdzv_id, args)
                logger.info("host %d: %s", host, " ".join(command))
                with open(logs[host], "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            command,
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            env=env,
                            start_new_session=True,  # Ctrl-C reaches the parent alone, which stops them
                            preexec_fn=_terminate_with_parent,
                        )
                    )
            failure = _wait(procs, timeout, _Progress(log_dir / "rank0.log"))
        finally:
            _stop(procs, net)
        if failure is not None:
            raise HostsFailure(_describe(failure, procs, logs, log_dir, timeout))


class _Progress:
    """Echoes on stdout what rank 0 logs of its progress (``gradcomm.bench.runner``: which hook, which phase)."""

    _LINE = re.compile(r"^.* gradcomm\.bench\.runner: (.*)$", re.MULTILINE)

    def __init__(self, log: Path) -> None:
        self.log = log
        self.offset = 0

    def show(self) -> None:
        try:
            with open(self.log, "rb") as stream:
                stream.seek(self.offset)
                text = stream.read()
        except OSError:
            return
        complete = text[: text.rfind(b"\n") + 1]  # whole lines only; the rest is read next time
        self.offset += len(complete)
        for line in self._LINE.finditer(complete.decode(errors="replace")):
            print(f"rank 0: {line.group(1)}", flush=True)


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float, progress: _Progress) -> int | None:
    """Wait until every torchrun succeeded (None), one failed (its host), or ``timeout`` passed (-1)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        progress.show()
        codes = [proc.poll() for proc in procs]
        failed = [host for host, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            return failed[0]
        if all(code == 0 for code in codes):
            progress.show()
            return None
        time.sleep(_POLL_SECONDS)
    return -1


def _stop(procs: list[subprocess.Popen[bytes]], net: HostNetwork) -> None:
    """End every torchrun still running, and every process left in the hosts."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    until = time.monotonic() + _STOP_SECONDS
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for pid in net.kill_processes():
        logger.info("killed process %d left in a host namespace", pid)
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.warning("torchrun %d did not exit after SIGKILL", proc.pid)


def _terminate_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (torchrun then ends its ranks)."""
    set_parent_death_signal(signal.SIGTERM)


_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.MULTILINE)
_ROOT_CAUSE_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)[^\n]*?(?:\((SIG\w+)\))?\s*$", re.MULTILINE)
_EXCEPTION_LINE = re.compile(
    r"^(gradcomm bench: error: .*|[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*)$", re.MULTILINE
)


def _describe(
    failure: int, procs: list[subprocess.Popen[bytes]], logs: list[Path], log_dir: Path, timeout: float
) -> str:
    """One line: the failed host, and the rank torchrun names as the root cause, with what it raised."""
    if failure < 0:
        return (
            f"the hosts' ranks did not finish within {timeout:g} s and were killed (raise --timeout, or see "
            f"their output in {log_dir})"
        )
    summary = f"host {failure}'s torchrun exited with code {procs[failure].returncode}"
    root_cause = _read(logs[failure]).partition("Root Cause")[2]
    rank = _ROOT_CAUSE_RANK.search(root_cause)
    if rank is None:
        return f"{summary}; its output: {logs[failure]}"
    rank_log = log_dir / f"rank{rank.group(1)}.log"
    raised = list(_EXCEPTION_LINE.finditer(_read(rank_log)))
    exit_code = _ROOT_CAUSE_EXIT.search(root_cause)
    if raised:
        what = f"failed: {raised[-1].group(0).strip()}"
    elif exit_code is not None:
        what = f"exited with code {exit_code.group(1)}" + (f" ({exit_code.group(2)})" if exit_code.group(2) else "")
    else:
        what = "failed"
    return f"{summary}: rank {rank.group(1)} {what}; its output: {rank_log}"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def redirect_rank_output(rank: int) -> None:
    """On a rank started by :func:`run_hosts`: send stdout, stderr and INFO logging to its log file."""
    log_rank_output(Path(os.environ[LOG_DIR_ENV]) / f"rank{rank}.log", rank)
