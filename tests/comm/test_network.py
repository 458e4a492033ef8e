"""gradcomm.testing.network: rate/duration parsing, and real namespaced ranks on shaped links.

The parsing tests need nothing. The others build :class:`ShapedNetwork` s (network namespaces, veth, a
bridge, tbf; see the module docstring of :mod:`gradcomm.testing.network` for the topology) and skip, with the
reason :func:`check_network_privileges` gives, where the machine does not allow that. Two spawned 2-rank
runs measure:

* at 20 Mbit/s with 5 ms one-way latency, an allreduce of 2 MB takes at least the time its bytes need on the
  link, and a ping-pong at least one round trip of the latency;
* at 1 Gbit/s without latency the same allreduce is many times faster (the slowness above comes from the
  shaping), yet still no faster than 1 Gbit/s allows, and a ping-pong has no added delay.

Why the floor holds: in an allreduce of ``N`` bytes on 2 ranks each rank ends with the sum, from which it
can recover the other rank's whole tensor, so at least ``N`` bytes must cross its download link (gloo's ring
moves exactly ``2 * N * (world - 1) / world`` = ``N`` per rank and direction). We time the slowest rank, the
one that entered the allreduce first, so every byte it needs was sent after its clock started; the token
bucket may let one ``burst`` through at once, so the floor is ``(N - burst) / rate``.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradcomm.testing import run_on_ranks
from gradcomm.testing.network import (
    RANK_IFNAME,
    NetworkSetupError,
    ShapedNetwork,
    check_network_privileges,
    commands,
    enter_namespace,
    parse_duration,
    parse_rate,
    privileges,
    remove_stale_networks,
)

NETWORK_INIT_PY = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "src",
    "gradcomm",
    "testing",
    "network",
    "__init__.py",
)
ALLREDUCE_BYTES = 2_000_000


# ---------------------------------------------------------------------------------------------------------
# Parsing (no privileges needed)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("100mbit", 100_000_000),
        ("1gbit", 1_000_000_000),
        ("10Gbit", 10_000_000_000),
        ("500kbit", 500_000),
        ("2.5gbit", 2_500_000_000),
        (" 20 Mbit ", 20_000_000),
        ("1kibit", 1024),
        ("64000", 64_000),  # a bare number is bit/s, as in tc
        ("100bit", 100),
        ("100mbps", 800_000_000),  # tc: bps units are BYTES per second
        ("1MBps", 8_000_000),
        ("1mibps", 8 * 1024 * 1024),
        ("1e3kbit", 1_000_000),
    ],
)
def test_parse_rate(text: str, bits: int) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize(
    "text", ["", "fast", "100 mbits", "100mb", "-1mbit", "0mbit", "0", "mbit", "1e400gbit", "1,5gbit"]
)
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(
        ValueError, match=r"invalid rate .*expected .*mbit.*BYTES/s as in tc: 100mbps = 800mbit"
    ) as info:
        parse_rate(text)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"rate must be a string such as '100mbit', got 100"):
        parse_rate(100)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1ms", 1e-3),
        ("250us", 250e-6),
        ("0", 0.0),
        ("0.5s", 0.5),
        ("2msec", 2e-3),
        ("10 ms", 10e-3),
        ("0ms", 0.0),
        ("3usecs", 3e-6),
        ("1500ns", 1.5e-6),
        ("1S", 1.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds, rel=1e-12, abs=0)


@pytest.mark.parametrize("text", ["", "ms", "1 hour", "-1ms", "1e999s", "fast", "1m"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(
        ValueError, match=r"invalid duration .*expected .*s, ms, us or ns.* e\.g\. 1ms, 250us, 0\.5s"
    ):
        parse_duration(text)


def test_parse_duration_needs_a_unit_except_for_zero() -> None:
    with pytest.raises(ValueError, match=r"invalid duration '5': a unit is required \(is it 5ms or 5s\?\)"):
        parse_duration("5")


def test_shaped_network_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="world_size must be an int from 1 to 250"):
        ShapedNetwork(0, 10**6)
    with pytest.raises(ValueError, match="rate_bps must be an int of at least 8 bit/s"):
        ShapedNetwork(2, 0)
    with pytest.raises(ValueError, match="latency_s must be finite and >= 0"):
        ShapedNetwork(2, 10**6, -1e-3)
    with pytest.raises(ValueError, match="delay_method must be 'auto', 'netem' or 'relay'"):
        ShapedNetwork(2, 10**6, 1e-3, delay_method="sleep")


def test_enter_missing_namespace_is_a_clear_error() -> None:
    with pytest.raises(
        NetworkSetupError, match=r"network namespace 'gc0-0-nothing' does not exist .*ip netns list"
    ):
        enter_namespace("gc0-0-nothing")


def test_missing_privileges_and_tools_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(privileges, "_privileges_ok", False)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(privileges, "_effective_capabilities", lambda: 1 << 12)  # CAP_NET_ADMIN only
    with pytest.raises(
        NetworkSetupError, match=r"^not root and missing CAP_NET_ADMIN/CAP_SYS_ADMIN: .*run as root"
    ):
        check_network_privileges()
    monkeypatch.setattr(privileges, "_effective_capabilities", lambda: (1 << 12) | (1 << 21))
    monkeypatch.setattr(commands, "_tools", {})
    monkeypatch.setattr(commands, "_SBIN_PATH", "/nonexistent")
    with pytest.raises(
        NetworkSetupError, match=r"^'ip' not found on PATH or in /usr/sbin, /sbin: install iproute2"
    ):
        check_network_privileges()


# ---------------------------------------------------------------------------------------------------------
# Real networks (root, namespaces, veth, bridge, tbf)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def privileged() -> None:
    try:
        check_network_privileges()
    except NetworkSetupError as exc:
        pytest.skip(f"emulated networks unavailable: {exc}")


def _netns_names() -> list[str]:
    """Names listed by ``ip netns list`` (lines such as ``gc12-0-r1 (id: 3)``)."""
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _ours(prefix: str) -> list[str]:
    return sorted(name for name in _netns_names() if name.startswith(prefix + "-"))


def _allreduce_and_ping(nbytes: int, reps: int, pings: int) -> dict[str, Any]:
    """On each rank: time ``reps`` allreduces of ``nbytes`` and ``pings`` 1-float ping-pongs with the peer."""
    tensor = torch.rand(nbytes // 4)
    dist.all_reduce(torch.ones(1))  # connections established, ARP resolved
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    rank, peer, ball = dist.get_rank(), 1 - dist.get_rank(), torch.zeros(1)
    rtts = []
    for _ in range(pings + 1):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(ball, peer)
            dist.recv(ball, peer)
        else:
            dist.recv(ball, peer)
            dist.send(ball, peer)
        rtts.append(time.perf_counter() - start)
    return {"allreduce_s": times, "rtt_s": rtts[1:], "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}


def _measure(net: ShapedNetwork, reps: int = 2, pings: int = 10) -> tuple[float, list[float]]:
    """(fastest of ``reps`` allreduce times of the slowest rank, rank 0's ping-pong round trips)."""
    results = run_on_ranks(
        _allreduce_and_ping,
        2,
        args=(ALLREDUCE_BYTES, reps, pings),
        namespaces=net.namespaces,
        master_addr=net.master_addr,
        timeout=120,
        collective_timeout=60,
    )
    assert [r["gloo_ifname"] for r in results] == [RANK_IFNAME, RANK_IFNAME]
    allreduce = min(max(per_rank) for per_rank in zip(*(r["allreduce_s"] for r in results), strict=True))
    return allreduce, results[0]["rtt_s"]


def _floor_s(net: ShapedNetwork) -> float:
    """Least time for a 2-rank allreduce of ALLREDUCE_BYTES on ``net`` (see the module docstring)."""
    return (ALLREDUCE_BYTES - net.burst_bytes) * 8 / net.rate_bps


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_allreduce_is_limited_by_link_rate_and_latency(privileged: None) -> None:
    rate, latency = parse_rate("20mbit"), parse_duration("5ms")
    with ShapedNetwork(2, rate, latency) as net:
        assert net.master_addr == net.addresses[0] and len(set(net.addresses)) == 2
        assert _ours(net.prefix) == sorted([net.bridge_namespace, *net.namespaces])
        seconds, rtts = _measure(net)
    ideal = ALLREDUCE_BYTES * 8 / rate
    figures = (
        f"2 ranks, {ALLREDUCE_BYTES} B allreduce at 20 Mbit/s: took {seconds:.3f} s; "
        f"floor {_floor_s(net):.3f} s "
        f"(burst {net.burst_bytes} B), payload at line rate {ideal:.3f} s; delay by {net.delay_method}"
    )
    assert seconds >= _floor_s(net), "faster than the link allows, so it is not shaped: " + figures
    assert seconds <= 3 * ideal, "far slower than the link rate (drops? a stalled relay?): " + figures
    round_trip = 2 * latency
    assert min(rtts) >= round_trip, (
        f"ping-pong {min(rtts) * 1e3:.2f} ms < 2 x 5 ms one-way latency; all: {rtts}"
    )
    assert statistics.median(rtts) <= round_trip + 0.025, f"ping-pong far above 10 ms: {rtts}"
    assert _ours(net.prefix) == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_high_rate_is_much_faster_but_still_shaped(privileged: None) -> None:
    slow_floor = (ALLREDUCE_BYTES * 8) / parse_rate("20mbit")
    with ShapedNetwork(2, parse_rate("1gbit")) as net:
        seconds, rtts = _measure(net, reps=3)
    figures = (
        f"{ALLREDUCE_BYTES} B allreduce at 1 Gbit/s took {seconds * 1e3:.1f} ms; "
        f"its floor {_floor_s(net) * 1e3:.1f} ms "
        f"(burst {net.burst_bytes} B); at 20 Mbit/s at least {slow_floor * 1e3:.0f} ms"
    )
    assert seconds < slow_floor / 4, "not much faster at 50x the rate: " + figures
    assert seconds >= _floor_s(net), "faster than 1 Gbit/s allows, so it is not shaped: " + figures
    assert net.delay_method == "none"
    assert statistics.median(rtts) < 0.005, f"ping-pong without added latency took {rtts}"
    assert _ours(net.prefix) == []


def test_namespaces_are_removed_on_exit_and_on_error(privileged: None) -> None:
    with ShapedNetwork(3, parse_rate("100mbit")) as net:
        assert len(_ours(net.prefix)) == 4
    assert _ours(net.prefix) == []
    net.close()  # idempotent

    with (
        pytest.raises(RuntimeError, match="body failed"),
        ShapedNetwork(2, parse_rate("100mbit"), 1e-3) as net,
    ):
        assert len(_ours(net.prefix)) == 3
        raise RuntimeError("body failed")
    assert _ours(net.prefix) == []


# A child process that builds a network without importing torch (gradcomm/__init__ does; 3 s a process).
_CHILD = textwrap.dedent(
    """
    import importlib.util, os, sys, time
    spec = importlib.util.spec_from_file_location(
        "gradcomm_network", sys.argv[1], submodule_search_locations=[os.path.dirname(sys.argv[1])]
    )
    network = importlib.util.module_from_spec(spec)
    sys.modules["gradcomm_network"] = network
    spec.loader.exec_module(network)
    net = network.ShapedNetwork(2, network.parse_rate("10mbit"), 0.002, delay_method="relay").__enter__()
    print(net.prefix, net._relay.pid, flush=True)
    time.sleep(60)
    """
)


def _start_child() -> tuple[subprocess.Popen[str], str, int]:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, NETWORK_INIT_PY],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline().split()
    if len(line) != 2:
        child.kill()
        pytest.fail(f"child did not build its network: {child.communicate(timeout=10)[1]}")
    return child, line[0], int(line[1])


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_removes_the_network_and_chains(privileged: None, signum: int) -> None:
    child, prefix, relay_pid = _start_child()
    assert len(_ours(prefix)) == 3
    child.send_signal(signum)
    _, stderr = child.communicate(timeout=30)
    if signum == signal.SIGTERM:  # the default action ran after the clean-up
        assert child.returncode == -signal.SIGTERM, stderr
    else:  # Python's own SIGINT handler ran after the clean-up: KeyboardInterrupt
        assert "KeyboardInterrupt" in stderr and child.returncode != 0, stderr
    assert _ours(prefix) == [], stderr
    assert _wait_gone(relay_pid, 10), "the relay survived its network"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_remove_stale_networks_after_a_killed_owner(privileged: None) -> None:
    child, prefix, relay_pid = _start_child()
    child.kill()
    child.communicate(timeout=30)
    assert len(_ours(prefix)) == 3  # SIGKILL: no clean-up ran
    assert _wait_gone(relay_pid, 10), "the relay outlived its owner"
    removed = remove_stale_networks()
    assert sorted(name for name in removed if name.startswith(prefix + "-")) == sorted(
        [f"{prefix}-br", f"{prefix}-r0", f"{prefix}-r1"]
    )
    assert _ours(prefix) == []
