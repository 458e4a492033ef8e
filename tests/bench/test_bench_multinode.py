"""``gradcomm bench --nodes N --procs-per-node P``: emulated hosts started by one torchrun each.

Bad options are refused in one line before anything starts. A real 2-host x 2-rank run (root, network
namespaces) writes the results of 4 ranks with the bytes measured on the host links, which match what the
ranks handed to ring collectives, and leaves no namespace or process; a rank killed mid-run ends both
torchruns, every rank and the namespaces, in one line, keeping the rows of the methods every rank finished.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gradcomm.__main__ import main
from gradcomm.bench import multinode
from gradcomm.bench.multinode import HOST_LINK_ENV
from gradcomm.testing.network import (
    HostNetwork,
    NetworkSetupError,
    check_network_privileges,
    hosts,
    link_byte_counters,
    parse_rate,
    privileges,
    remove_stale_networks,
)

GRADCOMM = [sys.executable, "-m", "gradcomm"]


@pytest.fixture
def privileged() -> None:
    try:
        check_network_privileges()
    except NetworkSetupError as exc:
        pytest.skip(f"--nodes needs root and network namespaces: {exc}")


@pytest.fixture
def no_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the bench gets as far as starting hosts."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("hosts were started before the input was refused")

    monkeypatch.setattr(multinode, "run_hosts", refuse)
    monkeypatch.delenv(HOST_LINK_ENV, raising=False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nodes", "0", "--bandwidth", "1gbit"], r"--nodes must be at least 1, got 0$"),
        (["--nodes", "2", "--procs-per-node", "0", "--bandwidth", "1gbit"],
         r"--procs-per-node must be at least 1, got 0$"),
        (["--procs-per-node", "2"], r"--procs-per-node is the number of ranks on each of --nodes hosts: give --nodes"),
        (["--nodes", "2", "--procs-per-node", "2", "--world-size", "3", "--bandwidth", "1gbit"],
         r"--world-size 3 differs from --nodes 2 x --procs-per-node 2 = 4 ranks; leave --world-size out"),
        (["--nodes", "2"], r"--nodes emulates hosts joined by a shaped link: give its rate, e\.g\. --bandwidth 1gbit$"),
        (["--nodes", "2", "--bandwidth", "fast"], r"invalid rate 'fast': expected a positive number"),
        (["--nodes", "2", "--bandwidth", "1gbit", "--steps", "0"], r"--steps must be at least 1, got 0$"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture, no_hosts: None
) -> None:
    assert main(["bench", "--workload", "cnn", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gradcomm bench: error: "), err
    assert re.search(message, err), err


def test_nodes_without_root_is_refused_with_the_privilege_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, no_hosts: None, tmp_path: Path
) -> None:
    monkeypatch.setattr(privileges, "_privileges_ok", False)
    monkeypatch.setattr(privileges.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(privileges, "_effective_capabilities", lambda: 0)
    output = tmp_path / "run"
    assert main(["bench", "--nodes", "2", "--bandwidth", "1gbit", "--output", str(output)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "gradcomm bench: error: --nodes needs network namespaces: not root and missing CAP_NET_ADMIN/CAP_SYS_ADMIN"
    ), err
    assert len(err.splitlines()) == 1
    assert not output.exists()


def test_nodes_under_a_users_torchrun_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, no_hosts: None
) -> None:
    """Only the --nodes parent may pass --nodes on to torchrun's ranks (it sets GRADCOMM_BENCH_HOST_LINK)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["bench", "--nodes", "2", "--procs-per-node", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "gradcomm bench: error: --nodes and --procs-per-node start torchrun on emulated hosts; under torchrun "
        "leave them out (torchrun's --nnodes and --nproc-per-node place the ranks)"
    )


def _netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (the run's unique output path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def _bench(output: Path, *extra: str) -> list[str]:
    return [
        *GRADCOMM, "bench", "--nodes", "2", "--procs-per-node", "2", "--workload", "cnn", "--hooks", "allreduce",
        "--bandwidth", "1gbit", "--output", str(output), "--timeout", "400", "--collective-timeout", "60", *extra,
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_hosts_of_two_ranks_measure_the_host_links(tmp_path: Path, privileged: None) -> None:
    output = tmp_path / "run"
    bench = subprocess.Popen(
        _bench(output, "--steps", "4", "--warmup", "1", "--hooks", "allreduce", "diloco:sync_every=2"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = bench.communicate(timeout=450)
        assert bench.returncode == 0, err + out
        assert err == "", err
        assert "host-link MB/step" in out and "measured/floor" in out, out
        document = json.loads((output / "results.json").read_text())
        assert document["config"]["world_size"] == 4
        assert (document["config"]["nodes"], document["config"]["procs_per_node"]) == (2, 2)
        assert document["config"]["command"].split().count("--output") == 1, document["config"]["command"]
        runs = [ranks[0] for ranks in document["runs_by_rank"]]
        assert sorted(run["rank"] for run in runs) == [0, 1, 2, 3]
        readers = [run for run in runs if run["host_link_bytes"] is not None]
        assert len(readers) == 2, "one rank per host reads its link"
        wire = runs[0]["wire_bytes_per_step"][-1]  # what ring collectives put on each rank's link
        for run in readers:
            sent, received = run["host_link_bytes"][-1]
            assert len(run["host_link_bytes"]) == 4
            # The ring of 4 ranks crosses between the hosts once each way: each host link carries one rank's
            # ring traffic each way, plus Ethernet, IP and TCP headers.
            for way in (sent, received):
                assert 0.9 < way / 4 / wire < 1.3, (sent, received, wire)
        summary = document["summaries"][0]
        assert 0.9 < summary["host_link_mb_per_step"] * 1e6 / wire < 1.3, summary
        assert summary["floor_ms"] > summary["compute_ms"]
        # DiLoCo: a DDP in each host, DiLoCo across them; the DDP's allreduce stays inside the host, and the
        # hosts' first ranks (0 and 2) alone exchange across them, once each way per sync
        diloco = [ranks[1] for ranks in document["runs_by_rank"]]
        dense = diloco[0]["dense_bytes_per_step"]
        assert diloco[0]["bytes_per_step"][0::2] == [dense] * 2  # the DDP's, inside the host
        exchange = diloco[0]["wire_bytes_per_step"][1] - diloco[0]["wire_bytes_per_step"][0]  # 2 ranks: 1x
        for run in diloco:
            if run["host_link_bytes"] is not None:
                # nothing crosses before the first sync: not even the tail of the constructor's broadcast
                assert max(run["host_link_bytes"][0]) < 0.02 * exchange, (run["host_link_bytes"], exchange)
                for way in run["host_link_bytes"][-1]:
                    assert 0.9 < way / (2 * exchange) < 1.3, (run["host_link_bytes"], exchange)
        assert "one replica per host (2 hosts of 2 ranks" in (output / "logs" / "rank0.log").read_text()
        assert len({run["final_loss"] for run in diloco}) == 1
        for name in ("host0.log", "host1.log", "rank0.log", "rank1.log", "rank2.log", "rank3.log"):
            assert (output / "logs" / name).stat().st_size > 0, name
        assert "training 4 steps on 4 ranks" in (output / "logs" / "rank3.log").read_text()
    finally:
        left = _end(bench, output, group=False)
    assert left == [], "torchrun or rank processes outlived the run"
    assert [name for name in _netns_names() if name.startswith(f"gc{bench.pid}-")] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_rank_ends_both_torchruns_and_the_namespaces(tmp_path: Path, privileged: None) -> None:
    output = tmp_path / "run"
    bench = _endless_bench(output)
    try:
        victim = _wait_until_training(bench, output / "logs" / "rank3.log", rank=3)
        ours = [name for name in _netns_names() if name.startswith(f"gc{bench.pid}-")]
        assert len(ours) == 3, f"expected a switch and two host namespaces, got {ours}"
        os.kill(victim, signal.SIGKILL)
        _, err = bench.communicate(timeout=120)
    finally:
        left = _end(bench, output, group=True)
    assert bench.returncode == 1, err
    assert len(err.strip().splitlines()) == 1, err
    # The victim's host or its peer's, whichever torchrun notices first, naming the rank at the root
    assert re.fullmatch(
        r"gradcomm bench: error: host [01]'s torchrun exited with code \d+: rank \d (failed: .+|exited with code "
        rf"-?\d+.*); its output: {re.escape(str(output / 'logs'))}/rank\d\.log\n",
        err,
    ), err
    assert left == [], "torchrun or rank processes outlived the failed run"
    assert [name for name in _netns_names() if name.startswith(f"gc{bench.pid}-")] == []


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_failing_during_its_second_method_keeps_the_first_ones_row(tmp_path: Path, privileged: None) -> None:
    """A rank lost during the second method: as on one host, the rows every rank finished are printed and
    written, and the run still fails with its one-line error."""
    output = tmp_path / "run"
    bench = subprocess.Popen(
        _bench(output, "--steps", "60", "--warmup", "1", "--hooks", "allreduce", "diloco:sync_every=5"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        victim = _wait_until_training(bench, output / "logs" / "rank3.log", rank=3)
        finished = [output / "finished" / f"rank{rank}.json" for rank in range(4)]
        deadline = time.monotonic() + 300
        while not all(path.exists() for path in finished) and bench.poll() is None:
            assert time.monotonic() < deadline, "the first method never finished"
            time.sleep(0.02)
        assert all(path.exists() for path in finished), "the ranks wrote no finished runs"
        os.kill(victim, signal.SIGKILL)
        out, err = bench.communicate(timeout=120)
    finally:
        left = _end(bench, output, group=True)
    assert bench.returncode == 1, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("gradcomm bench: error: host "), err
    assert "the run stopped during hook 2 of 2; the 1 finished:" in out, out
    document = json.loads((output / "results.json").read_text())
    assert [summary["label"] for summary in document["summaries"]] == ["allreduce"], document["summaries"]
    assert document["config"]["world_size"] == 4 and document["config"]["nodes"] == 2
    assert left == [], "torchrun or rank processes outlived the failed run"
    assert [name for name in _netns_names() if name.startswith(f"gc{bench.pid}-")] == []


def _endless_bench(output: Path) -> subprocess.Popen:
    """A 2x2 bench that trains until stopped, in its own session (Ctrl-C to it reaches it alone); stderr piped."""
    return subprocess.Popen(
        _bench(output, "--steps", "100000"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )


def _end(bench: subprocess.Popen | None, output: Path, group: bool = False) -> list[int]:
    """Kill the bench if it still runs (its whole process group with ``group``), then every process still
    mentioning ``output``; return those, which a clean run leaves none of."""
    if bench is not None and bench.poll() is None:
        if group:
            os.killpg(bench.pid, signal.SIGKILL)
        else:
            bench.kill()
    left = _processes_mentioning(str(output))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _wait_until_training(bench: subprocess.Popen, log: Path, rank: int, within: float = 200) -> int:
    """The pid of rank ``rank`` once its log says it is training."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and bench.poll() is None:
        text = log.read_text(errors="replace") if log.exists() else ""
        match = re.search(rf"rank {rank} \(pid (\d+)\) gradcomm\.bench\.runner: .*: training ", text)
        if match:
            return int(match.group(1))
        time.sleep(0.2)
    bench.kill()
    _, err = bench.communicate(timeout=30)
    pytest.fail(f"rank {rank} never started training (exit {bench.returncode}): {err}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_ends_both_torchruns_and_the_namespaces(tmp_path: Path, privileged: None) -> None:
    """SIGINT reaches the parent alone (each torchrun has its own session); it stops them and their ranks."""
    output = tmp_path / "run"
    bench = _endless_bench(output)
    try:
        _wait_until_training(bench, output / "logs" / "rank0.log", rank=0)
        os.killpg(bench.pid, signal.SIGINT)
        _, err = bench.communicate(timeout=120)
    finally:
        left = _end(bench, output, group=True)
    assert bench.returncode == 130, err
    assert err.strip() == "gradcomm bench: interrupted; all ranks and network namespaces were removed", err
    assert left == [], "torchrun or rank processes outlived the interrupted run"
    assert [name for name in _netns_names() if name.startswith(f"gc{bench.pid}-")] == []


def test_link_counters_refuse_another_namespaces_sysfs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process entered with setns alone sees the sysfs of the namespace it came from: its counters are refused."""
    with pytest.raises(NetworkSetupError, match=r"no interface 'nosuch0' here; there are \["):
        link_byte_counters("nosuch0")
    monkeypatch.setattr(hosts.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0"), (9, "only-here")])
    with pytest.raises(NetworkSetupError, match=r"/sys/class/net shows .*, not this network namespace's interfaces "
                       r"\['eth0', 'lo', 'only-here'\]: start the process with `ip netns exec`"):
        link_byte_counters("eth0")
    with pytest.raises(ValueError, match=r"HostNetwork.exec_command: no host 0; the network has no hosts until it is "
                       r"opened$"):
        HostNetwork(2, parse_rate("1gbit")).exec_command(0, ["true"])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_run_past_its_timeout_ends_in_one_line(tmp_path: Path, privileged: None) -> None:
    output = tmp_path / "run"
    bench = subprocess.Popen(_bench(output, "--steps", "100000", "--timeout", "8"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = bench.communicate(timeout=150)
    finally:
        left = _end(bench, output, group=False)
    assert bench.returncode == 1, err
    assert err == (
        f"gradcomm bench: error: the hosts' ranks did not finish within 8 s and were killed (raise --timeout, or see "
        f"their output in {output / 'logs'})\n"
    )
    assert left == []
    assert [name for name in _netns_names() if name.startswith(f"gc{bench.pid}-")] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_parent_s_torchruns_end_their_ranks_and_the_next_run_removes_its_hosts(
    tmp_path: Path, privileged: None
) -> None:
    """SIGKILL cleans nothing up: the kernel sends each torchrun SIGTERM, which ends its ranks; the namespaces
    stay until :func:`remove_stale_networks`, which every run calls first, removes them."""
    output = tmp_path / "run"
    bench = subprocess.Popen(
        _bench(output, "--steps", "100000"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_until_training(bench, output / "logs" / "rank0.log", rank=0)
        bench.kill()
        bench.wait(timeout=30)
        deadline = time.monotonic() + 60
        while _processes_mentioning(str(output)) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        left = _end(None, output)
    assert left == [], "torchrun or rank processes outlived their killed parent"
    hosts_left = [name for name in _netns_names() if re.fullmatch(rf"gc{bench.pid}-\d+-h\d", name)]
    assert len(hosts_left) == 2, _netns_names()
    removed = remove_stale_networks()
    assert set(hosts_left) <= set(removed)
    assert [name for name in _netns_names() if name.startswith(f"gc{bench.pid}-")] == []


def test_without_option_drops_the_option_and_its_value() -> None:
    args = ["--nodes", "2", "--output", "a", "--steps", "3", "--output=b", "--outputs", "c"]
    assert multinode.without_option(args, "--output") == ["--nodes", "2", "--steps", "3", "--outputs", "c"]

