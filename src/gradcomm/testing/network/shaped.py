"""Emulated cluster network: each rank a separate host behind its own rate-limited, delayed link.

A :class:`ShapedNetwork` builds, with ``ip netns``, veth pairs, a Linux bridge and ``tc``, a private switched
network whose hosts are Linux network namespaces; one rank process runs in each (:func:`enter_namespace`,
called by :func:`gradcomm.testing.run_on_ranks`). Rank traffic then goes through the kernel's real TCP stack
and a real queue on a link of a chosen rate, instead of over loopback, which moves tens of Gbit/s and would
never show what sending fewer bytes is worth::

     netns gc<pid>-<n>-r0             netns gc<pid>-<n>-br (the switch)             netns gc<pid>-<n>-r1
    +--------------------+      +---------------------------------------+      +--------------------+
    | lo                 |      |              br0 (bridge)             |      | lo                 |
    | eth0 10.213.0.1/24 | veth |      +-------------+-------------+    | veth | eth0 10.213.0.2/24 |
    |   egress: tbf R    |======| p0 --+  (p2 ... : a port a rank) +-- p1 |======|   egress: tbf R    |
    |   (rank 0 upload)  |      | egress: tbf R         egress: tbf R   |      |   (rank 1 upload)  |
    +--------------------+      | (rank 0 download)  (rank 1 download)  |      +--------------------+
                                +---------------------------------------+

Rank ``i`` has namespace ``gc<pid>-<n>-r<i>`` with ``lo`` and ``eth0`` (:data:`RANK_IFNAME`, the same name in
every rank namespace) at ``<subnet>.<i+1>``; the other end of its veth pair, ``p<i>``, is a port of bridge
``br0`` in the switch namespace ``gc<pid>-<n>-br``. Nothing is created in the host's own namespace and nothing
is routed to or from it: the ranks reach each other and nothing else. The /24 therefore cannot clash with
anything, but it is still chosen (among 10.213-10.254.x.0/24) to differ from every address and route of the
host, so that no reader mistakes one for the other; all instances may share it, their namespaces are apart.

gloo. gloo binds to the address of the machine's hostname, which does not exist inside a rank namespace, and
falls back to loopback, which the other ranks cannot reach ("Connection refused, remote=[127.0.0.1]").
:func:`enter_namespace` therefore sets ``GLOO_SOCKET_IFNAME=eth0`` when it enters a rank namespace; a launcher
that enters namespaces some other way must set it itself.

Shaping. Each rank's link is shaped in both directions to the rate ``R``: a ``tbf`` on the egress of ``eth0``
in the rank namespace (what the rank sends) and one on the egress of ``p<i>`` in the switch (what it
receives). Traffic from rank ``a`` to rank ``b`` passes ``a``'s upload and ``b``'s download shaper, as between
two hosts on a switch with ports of rate ``R``: a rank sends and receives at ``R`` at once (full duplex), and
ranks sending to one rank share its download. tbf counts whole Ethernet frames, so TCP payload gets about
95% of ``R`` (1448 of 1514 bytes), as on a real link (measured: 92-94% for a gloo allreduce, 20 Mbit/s to
1 Gbit/s).
The bucket (``burst``) holds 2 ms of traffic at ``R``, at least 16 full-size frames (about 24 KiB): a transfer
is never faster than ``(bytes - burst) / R``, and large GSO segments pass at high rates. The queue (``limit``)
holds 20 ms of traffic at ``R`` (at least 64 KiB) plus one emulated round trip, plus the burst: one TCP flow
fills the link without tail drops, and the queueing delay stays bounded.

Latency. ``latency_s`` is the one-way delay between any two ranks: a packet from rank ``a`` arrives at rank
``b`` ``latency_s`` later than it would on the same network without latency, so a round trip takes
``2 * latency_s`` more. Two ways, see :attr:`ShapedNetwork.delay_method`:

* ``netem`` where the kernel has it (``CONFIG_NET_SCH_NETEM``): the delay is split over the two hops of every
  path, ``latency_s / 2`` on each upload and ``latency_s / 2`` on each download, as a ``netem`` qdisc at the
  root of each shaped interface with the ``tbf`` as its child.
* ``relay`` where it does not (as on the machine this was written on): the switch namespace has no bridge;
  a small user-space process there (this file, run as a script) forwards Ethernet frames between the ports,
  each ``latency_s`` after the kernel received it, through ``AF_PACKET`` sockets with ``PACKET_VNET_HDR`` so
  that GSO segments of up to 64 KiB cross as one frame. The ``tbf`` shapers stay in the kernel. Measured on a
  2-core VM: a 1-float ping-pong at 1 ms one-way latency takes 2.3-2.4 ms (0.15 ms without latency), a
  2-rank allreduce at 100 Mbit/s and 1 Gbit/s with 1 ms keeps 92% and 85% of the rate. It costs one CPU
  core's share for its Python loop and is not meant for 10 Gbit/s.

Clean-up. Namespace names carry the owner's pid and a per-process counter (``gc<pid>-<n>-...``), so parallel
runs never collide. :meth:`ShapedNetwork.close` removes everything; it runs on ``__exit__``, at interpreter
exit and on SIGINT/SIGTERM (then the previous handler runs); :func:`remove_stale_networks`, which
``gradcomm bench`` calls before it builds a network, removes what a killed process left behind (the relay
exits by itself when its owner dies).

Requirements: root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` and ``tc`` from iproute2, and a kernel with
network namespaces, veth, bridge and tbf; :func:`check_network_privileges` says what is missing.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import ipaddress
import itertools
import logging
import math
import os
import re
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any

__all__ = [
    "RANK_IFNAME",
    "NetworkSetupError",
    "ShapedNetwork",
    "check_network_privileges",
    "enter_namespace",
    "parse_duration",
    "parse_rate",
    "remove_stale_networks",
]

log = logging.getLogger(__name__)

RANK_IFNAME = "eth0"
"""Name of the rank's network interface inside every rank namespace (the value for ``GLOO_SOCKET_IFNAME``)."""

NETNS_DIR = "/var/run/netns"
_BRIDGE = "br0"
_CLONE_NEWNET = 0x40000000
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21
_COMMAND_TIMEOUT_S = 30.0
_MTU_FRAME = 1514  # bytes of a full-size Ethernet frame at MTU 1500 (without FCS)
_NAME_RE = re.compile(r"^gc(?P<pid>\d+)-(?P<n>\d+)-(?P<role>br|probe|r\d+)$")
_RANK_NAME_RE = re.compile(r"^gc\d+-\d+-r\d+$")
_MAX_WORLD_SIZE = 250

# ----------------------------------------------------------------------------------------------------------
# Parsing of tc-style rates and durations
# ----------------------------------------------------------------------------------------------------------

_NUMBER = r"(?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
_RATE_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>[a-zA-Z]*)\s*$")
# tc(8), "RATES": bit and byte units, SI (powers of 1000) and IEC (powers of 1024), case-insensitive.
_RATE_UNITS: dict[str, float] = {
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "kibit": 1024.0,
    "mibit": 1024.0**2,
    "gibit": 1024.0**3,
    "tibit": 1024.0**4,
    "bps": 8.0,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
    "tbps": 8e12,
    "kibps": 8 * 1024.0,
    "mibps": 8 * 1024.0**2,
    "gibps": 8 * 1024.0**3,
    "tibps": 8 * 1024.0**4,
}
_RATE_FORMS = (
    "a positive number with a tc unit: bit, kbit, mbit, gbit, tbit (bits/s, powers of 1000), kibit..tibit "
    "(powers of 1024), or bps, kbps, mbps, gbps, tbps, kibps..tibps (BYTES/s as in tc: 100mbps = 800mbit); "
    "e.g. 100mbit, 1gbit, 2.5gbit, 500kbit"
)

_DURATION_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>[a-zA-Zµ]*)\s*$")
_DURATION_UNITS: dict[str, float] = {
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "ms": 1e-3,
    "msec": 1e-3,
    "msecs": 1e-3,
    "us": 1e-6,
    "usec": 1e-6,
    "usecs": 1e-6,
    "µs": 1e-6,
    "ns": 1e-9,
    "nsec": 1e-9,
    "nsecs": 1e-9,
}
_DURATION_FORMS = (
    "a non-negative number with a unit s, ms, us or ns (also sec, msec, usec, nsec), or 0; "
    "e.g. 1ms, 250us, 0.5s"
)


def parse_rate(text: str) -> int:
    """Bits per second from a tc-style rate such as ``"100mbit"``, ``"1gbit"``, ``"10Gbit"`` or ``"2.5gbit"``.

    Units follow tc(8) and are case-insensitive: ``bit`` (or a bare number), ``kbit``, ``mbit``, ``gbit``,
    ``tbit`` are bits per second in powers of 1000, ``kibit`` .. ``tibit`` in powers of 1024; ``bps``,
    ``kbps``, ``mbps``, ``gbps``, ``tbps`` (and ``kibps`` .. ``tibps``) are **bytes** per second, exactly as
    tc reads them: ``"100mbps"`` is 800,000,000 bit/s, not 100 Mbit/s. The result is rounded to whole bits.

    Raises:
        ValueError: not a positive number with one of these units.
    """
    if not isinstance(text, str):
        raise ValueError(f"rate must be a string such as '100mbit', got {text!r}")
    match = _RATE_RE.match(text)
    unit = match.group("unit").lower() if match else ""
    if match is None or (unit and unit not in _RATE_UNITS):
        raise ValueError(f"invalid rate {text!r}: expected {_RATE_FORMS}")
    bits = float(match.group("num")) * _RATE_UNITS.get(unit, 1.0)
    if not math.isfinite(bits) or round(bits) < 1:
        raise ValueError(f"invalid rate {text!r}: must be at least 1 bit/s; expected {_RATE_FORMS}")
    return int(round(bits))


def parse_duration(text: str) -> float:
    """Seconds from a duration such as ``"1ms"``, ``"250us"``, ``"0.5s"`` or ``"0"``.

    Units: ``s``, ``ms``, ``us`` (or ``µs``), ``ns``, and tc's spellings ``sec``, ``msec``, ``usec``,
    ``nsec`` (with an optional plural ``s``), case-insensitive. A bare number is accepted only for ``0``: tc
    would read a bare ``5`` as microseconds, a reader as seconds, so a unit is required.

    Raises:
        ValueError: not a non-negative number with one of these units.
    """
    if not isinstance(text, str):
        raise ValueError(f"duration must be a string such as '1ms', got {text!r}")
    match = _DURATION_RE.match(text)
    unit = match.group("unit").lower() if match else ""
    if match is None or (unit and unit not in _DURATION_UNITS):
        raise ValueError(f"invalid duration {text!r}: expected {_DURATION_FORMS}")
    value = float(match.group("num"))
    if not unit and value != 0:
        raise ValueError(
            f"invalid duration {text!r}: a unit is required (is it {text}ms or {text}s?); "
            f"expected {_DURATION_FORMS}"
        )
    seconds = value * _DURATION_UNITS.get(unit, 1.0)
    if not math.isfinite(seconds):
        raise ValueError(f"invalid duration {text!r}: expected {_DURATION_FORMS}")
    return seconds


# ----------------------------------------------------------------------------------------------------------
# Commands, privileges
# ----------------------------------------------------------------------------------------------------------


class NetworkSetupError(RuntimeError):
    """The emulated network could not be built, entered or removed; the message says what and why."""


_SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])
_tools: dict[str, str] = {}


def _tool(name: str) -> str:
    """Absolute path of ``ip`` or ``tc`` (also looked up in the sbin directories, absent from many PATHs)."""
    path = _tools.get(name)
    if path is None:
        path = shutil.which(name, path=_SBIN_PATH)
        if path is None:
            raise NetworkSetupError(
                f"'{name}' not found on PATH or in /usr/sbin, /sbin: install iproute2 "
                "(e.g. apt-get install iproute2)"
            )
        _tools[name] = path
    return path


def _run(command: str | Sequence[str], *, what: str = "") -> str:
    """Run ``ip ...`` or ``tc ...`` (a string is split on whitespace); return stdout.

    A failure becomes a NetworkSetupError naming the command, what it was for, and its stderr.
    """
    args = command.split() if isinstance(command, str) else list(command)
    cmd = [_tool(args[0]), *args[1:]]
    shown = shlex.join([args[0], *args[1:]])
    log.debug("network: %s", shown)
    try:
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        stderr = (exc.stderr or "").strip() or "(no message)"
        purpose = f" ({what})" if what else ""
        raise NetworkSetupError(f"command failed{purpose}, exit {exc.returncode}: {shown}: {stderr}") from exc
    except subprocess.TimeoutExpired as exc:
        raise NetworkSetupError(f"command did not finish within {_COMMAND_TIMEOUT_S:g} s: {shown}") from exc
    except OSError as exc:
        raise NetworkSetupError(f"could not run {shown}: {exc}") from exc
    return proc.stdout


def _effective_capabilities() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


_privileges_ok = False
_counter = itertools.count()
_counter_lock = threading.Lock()


def _existing_namespaces() -> list[str]:
    """Names of the namespaces ``ip netns`` knows (the files under /var/run/netns)."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise NetworkSetupError(f"cannot list {NETNS_DIR}: {exc}") from exc


def _new_prefix() -> str:
    """``gc<pid>-<n>`` not used by any existing namespace (one may be left by a dead process with our pid)."""
    existing = _existing_namespaces()
    pid = os.getpid()
    with _counter_lock:
        while True:
            prefix = f"gc{pid}-{next(_counter)}"
            if not any(name.startswith(prefix + "-") for name in existing):
                return prefix


def check_network_privileges() -> None:
    """Check that this process can build a :class:`ShapedNetwork`; else raise NetworkSetupError saying what is
    missing and what to do.

    Checks, in order: root or CAP_NET_ADMIN and CAP_SYS_ADMIN; ``ip`` and ``tc`` present; then, in a
    throw-away namespace, that namespaces can be created and that veth pairs, bridges and the tbf qdisc are
    available. Success is remembered for the process.
    """
    global _privileges_ok
    if _privileges_ok:
        return
    caps = _effective_capabilities()
    if os.geteuid() != 0 and not (caps >> _CAP_NET_ADMIN & 1 and caps >> _CAP_SYS_ADMIN & 1):
        raise NetworkSetupError(
            "not root and missing CAP_NET_ADMIN/CAP_SYS_ADMIN: emulated networks need both (network "
            "namespaces, veth, tc); run as root, e.g. with sudo, or in a container started with "
            "--cap-add NET_ADMIN --cap-add SYS_ADMIN"
        )
    _tool("ip")
    _tool("tc")
    probe = f"{_new_prefix()}-probe"
    try:
        _run(f"ip netns add {probe}")
    except NetworkSetupError as exc:
        raise NetworkSetupError(
            f"network namespaces not permitted here: {exc}. Run as root on a host (or a privileged "
            f"container) whose kernel has CONFIG_NET_NS and where {NETNS_DIR} is writable"
        ) from exc
    try:
        steps = [
            (f"ip -n {probe} link set lo up", "loopback cannot be brought up in a namespace"),
            (
                f"ip -n {probe} link add va type veth peer name vb",
                "veth pairs unavailable (kernel without CONFIG_VETH)",
            ),
            (
                f"ip -n {probe} link add {_BRIDGE} type bridge",
                "bridges unavailable (kernel without CONFIG_BRIDGE)",
            ),
            (
                f"tc -n {probe} qdisc add dev va root tbf rate 1mbit burst 32kb limit 64kb",
                "tbf qdisc unavailable (kernel without CONFIG_NET_SCH_TBF; try modprobe sch_tbf)",
            ),
        ]
        for command, meaning in steps:
            try:
                _run(command)
            except NetworkSetupError as exc:
                raise NetworkSetupError(f"{meaning}: {exc}") from exc
    finally:
        try:
            _run(f"ip netns delete {probe}")
        except NetworkSetupError as exc:
            log.warning("network: could not remove probe namespace %s: %s", probe, exc)
    _privileges_ok = True


def _netem_available(namespace: str) -> bool:
    """Whether the kernel has the netem qdisc, tried on ``lo`` of a namespace of ours."""
    try:
        _run(f"tc -n {namespace} qdisc add dev lo root netem delay 1ms")
    except NetworkSetupError as exc:
        log.debug("network: netem unavailable: %s", exc)
        return False
    _run(f"tc -n {namespace} qdisc del dev lo root")
    return True


# ----------------------------------------------------------------------------------------------------------
# Entering a namespace
# ----------------------------------------------------------------------------------------------------------


def _setns(fd: int) -> None:
    setns = getattr(os, "setns", None)  # Python >= 3.12
    if setns is not None:
        setns(fd, _CLONE_NEWNET)
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    if libc.setns(ctypes.c_int(fd), ctypes.c_int(_CLONE_NEWNET)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def enter_namespace(name: str) -> None:
    """Move the calling thread, and every thread it starts afterwards, into network namespace ``name``.

    Uses ``setns(2)`` (through ctypes before Python 3.12) on ``/var/run/netns/<name>``, the file
    ``ip netns add`` creates. Only the calling thread moves: call it first thing in a fresh process, before
    gloo or anything else that opens sockets starts its threads, which would otherwise stay in the old
    namespace. For a rank namespace of a :class:`ShapedNetwork` it also sets ``GLOO_SOCKET_IFNAME`` to
    :data:`RANK_IFNAME` (``eth0``): gloo otherwise binds to the address of the machine's hostname, which does
    not exist inside the namespace, and falls back to loopback, which the other ranks cannot reach.

    Raises:
        NetworkSetupError: the namespace does not exist, or setns failed (it needs CAP_SYS_ADMIN).
    """
    path = os.path.join(NETNS_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NetworkSetupError(
            f"enter_namespace: network namespace {name!r} does not exist ({path} is missing; see "
            "`ip netns list`; was its ShapedNetwork closed already?)"
        ) from None
    except OSError as exc:
        raise NetworkSetupError(f"enter_namespace: cannot open {path}: {exc.strerror} (run as root)") from exc
    try:
        _setns(fd)
    except OSError as exc:
        raise NetworkSetupError(
            f"enter_namespace: setns({path}, CLONE_NEWNET) failed: {exc.strerror} "
            "(it needs CAP_SYS_ADMIN: run as root)"
        ) from exc
    finally:
        os.close(fd)
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = 1
    if threads > 1:  # importing torch alone starts one (idle) thread
        log.debug(
            "enter_namespace(%s): the process has %d threads; only the calling one moved into the namespace",
            name,
            threads,
        )
    if _RANK_NAME_RE.match(name):
        previous = os.environ.get("GLOO_SOCKET_IFNAME")
        if previous not in (None, RANK_IFNAME):
            log.info("enter_namespace(%s): GLOO_SOCKET_IFNAME %s -> %s", name, previous, RANK_IFNAME)
        os.environ["GLOO_SOCKET_IFNAME"] = RANK_IFNAME
    log.debug("enter_namespace: pid %d now in network namespace %s", os.getpid(), name)


# ----------------------------------------------------------------------------------------------------------
# The network
# ----------------------------------------------------------------------------------------------------------

_ROUTE_TYPES = frozenset(
    "unicast local broadcast multicast throw unreachable prohibit blackhole nat anycast".split()
)


def _host_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of the host's addresses and routes (only read), to keep our subnet clear of them."""
    networks: list[ipaddress.IPv4Network] = []
    lines = _run("ip -o -4 addr show").splitlines() + _run("ip -4 route show table all").splitlines()
    for line in lines:
        tokens = line.split()
        if "inet" in tokens:  # ip -o addr: "2: eth0    inet 192.0.2.2/24 brd ..."
            candidate = tokens[tokens.index("inet") + 1]
        elif tokens:
            candidate = tokens[1] if tokens[0] in _ROUTE_TYPES and len(tokens) > 1 else tokens[0]
        else:
            continue
        if candidate == "default":
            continue
        try:
            networks.append(ipaddress.IPv4Network(candidate, strict=False))
        except ValueError:
            continue
    return networks


def _pick_subnet() -> ipaddress.IPv4Network:
    used = _host_networks()
    for second in range(213, 255):
        for third in range(256):
            candidate = ipaddress.IPv4Network(f"10.{second}.{third}.0/24")
            if not any(candidate.overlaps(net) for net in used):
                return candidate
    raise NetworkSetupError("no free 10.213-10.254.x.0/24 subnet: the host uses all of them")


def _tbf_sizes(rate_bps: int, latency_s: float) -> tuple[int, int]:
    """``(burst, limit)`` in bytes for a tbf of ``rate_bps``; see the module docstring."""
    rate_bytes = rate_bps / 8.0
    burst = max(math.ceil(rate_bytes * 0.002), 16 * _MTU_FRAME)
    limit = max(math.ceil(rate_bytes * (0.020 + 2 * latency_s)), 64 * 1024) + burst
    return burst, limit


_live: dict[int, ShapedNetwork] = {}
_live_lock = threading.RLock()
_previous_handlers: dict[int, Any] = {}
_atexit_registered = False


def _close_all() -> None:
    with _live_lock:
        networks = list(_live.values())
    for net in networks:
        try:
            net.close()
        except Exception as exc:  # at exit or in a signal handler: report, remove the rest
            log.error("network: clean-up of %s failed: %s", net.prefix, exc)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    previous = _previous_handlers.get(signum, signal.SIG_DFL)  # before the clean-up restores the handlers
    log.info("network: signal %d: removing emulated networks", signum)
    _close_all()
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # SIG_DFL, or a handler not installed from Python: let the default action happen
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _register(net: ShapedNetwork) -> None:
    global _atexit_registered
    with _live_lock:
        _live[id(net)] = net
        if not _atexit_registered:
            atexit.register(_close_all)
            _atexit_registered = True
        if threading.current_thread() is not threading.main_thread():
            log.debug("network: not in the main thread; no SIGINT/SIGTERM clean-up handlers installed")
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            current = signal.getsignal(signum)
            if current is not _on_signal:
                _previous_handlers[signum] = current
                signal.signal(signum, _on_signal)


def _unregister(net: ShapedNetwork) -> None:
    with _live_lock:
        _live.pop(id(net), None)
        if _live or threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in list(_previous_handlers.items()):
            if signal.getsignal(signum) is _on_signal:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            del _previous_handlers[signum]


class ShapedNetwork:
    """A switched network of ``world_size`` namespaced hosts, each on a link of ``rate_bps`` both ways.

    Use as a context manager; see the module docstring for the topology, shaping and latency::

        with ShapedNetwork(2, parse_rate("100mbit"), parse_duration("1ms")) as net:
            run_on_ranks(fn, 2, namespaces=net.namespaces, master_addr=net.master_addr)

    Args:
        world_size: number of rank hosts (1 to 250).
        rate_bps: rate of every rank's link, in bits per second, in each direction.
        latency_s: one-way delay between any two ranks, in seconds (round trip ``2 * latency_s``).
        delay_method: how latency is added: ``"auto"`` (netem where the kernel has it, else the user-space
            relay), ``"netem"`` or ``"relay"``. Ignored when ``latency_s`` is 0.

    Attributes (set on enter):
        namespaces: rank ``i``'s network namespace name.
        addresses: rank ``i``'s IPv4 address (on its interface :data:`RANK_IFNAME`).
        master_addr: rank 0's address.
        bridge_namespace: the switch's namespace.
        prefix: the instance's unique name prefix ``gc<pid>-<n>``.
        subnet: the private /24 the addresses are in.
        burst_bytes, limit_bytes: the tbf bucket and queue sizes.
        delay_method: ``"none"``, ``"netem"`` or ``"relay"``: what actually adds the latency.
    """

    ifname = RANK_IFNAME

    def __init__(self, world_size: int, rate_bps: int, latency_s: float = 0.0, *, delay_method: str = "auto"):
        if not isinstance(world_size, int) or not 1 <= world_size <= _MAX_WORLD_SIZE:
            raise ValueError(
                f"ShapedNetwork: world_size must be an int from 1 to {_MAX_WORLD_SIZE}, got {world_size!r}"
            )
        if not isinstance(rate_bps, int) or rate_bps < 8:
            raise ValueError(
                f"ShapedNetwork: rate_bps must be an int of at least 8 bit/s, got {rate_bps!r} "
                "(see parse_rate)"
            )
        if not math.isfinite(latency_s) or latency_s < 0:
            raise ValueError(
                f"ShapedNetwork: latency_s must be finite and >= 0, got {latency_s!r} (see parse_duration)"
            )
        if delay_method not in ("auto", "netem", "relay"):
            raise ValueError(
                f"ShapedNetwork: delay_method must be 'auto', 'netem' or 'relay', got {delay_method!r}"
            )
        self.world_size = world_size
        self.rate_bps = rate_bps
        self.latency_s = float(latency_s)
        self._requested_delay = delay_method
        self.delay_method = "none"
        self.burst_bytes, self.limit_bytes = _tbf_sizes(rate_bps, self.latency_s)
        self.prefix = ""
        self.bridge_namespace = ""
        self.namespaces: list[str] = []
        self.addresses: list[str] = []
        self.master_addr = ""
        self.subnet: ipaddress.IPv4Network | None = None
        self._created: list[str] = []
        self._relay: subprocess.Popen[bytes] | None = None
        self._owner_pid = os.getpid()
        self._lock = threading.RLock()
        self._state = "new"  # new -> open -> closed

    def __repr__(self) -> str:
        return (
            f"ShapedNetwork(world_size={self.world_size}, rate_bps={self.rate_bps}, "
            f"latency_s={self.latency_s}, prefix={self.prefix!r}, state={self._state!r})"
        )

    def __enter__(self) -> ShapedNetwork:
        self.open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_exc:  # keep the body's exception; report ours
            log.error("network: clean-up after %s failed: %s", exc_type.__name__, close_exc)

    # -- building ---------------------------------------------------------------------------------------

    def open(self) -> None:
        """Build the network (done by ``__enter__``). On failure everything built so far is removed."""
        with self._lock:
            if self._state != "new":
                raise NetworkSetupError(
                    f"ShapedNetwork.open: already {self._state}; a ShapedNetwork is used once"
                )
            check_network_privileges()
            self._state = "open"
        self._owner_pid = os.getpid()
        self.subnet = _pick_subnet()
        self.prefix = _new_prefix()
        self.bridge_namespace = f"{self.prefix}-br"
        self.namespaces = [f"{self.prefix}-r{i}" for i in range(self.world_size)]
        hosts = list(self.subnet.hosts())
        self.addresses = [str(hosts[i]) for i in range(self.world_size)]
        self.master_addr = self.addresses[0]
        _register(self)
        started = time.monotonic()
        try:
            self._build()
        except BaseException:
            try:
                self.close()
            except Exception as exc:
                log.error("network: clean-up after a failed set-up failed: %s", exc)
            raise
        log.info(
            "network %s: %d ranks on %s, %s bit/s per link each way (burst %d B, queue %d B), "
            "one-way latency %g s (%s), built in %.2f s",
            self.prefix,
            self.world_size,
            self.subnet,
            self.rate_bps,
            self.burst_bytes,
            self.limit_bytes,
            self.latency_s,
            self.delay_method,
            time.monotonic() - started,
        )

    def _add_namespace(self, name: str) -> None:
        _run(f"ip netns add {name}", what="create a network namespace")
        self._created.append(name)
        _run(f"ip -n {name} link set lo up")

    def _build(self) -> None:
        br = self.bridge_namespace
        self._add_namespace(br)
        if self.latency_s > 0:
            if self._requested_delay == "auto":
                self.delay_method = "netem" if _netem_available(br) else "relay"
            else:
                self.delay_method = self._requested_delay
        use_bridge = self.delay_method != "relay"
        if use_bridge:
            _run(f"ip -n {br} link add {_BRIDGE} type bridge", what="create the bridge")
            _run(f"ip -n {br} link set {_BRIDGE} addrgenmode none up")
        prefixlen = self.subnet.prefixlen if self.subnet is not None else 24
        for i, (ns, addr) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
            port, mac = f"p{i}", _rank_mac(i)
            self._add_namespace(ns)
            _run(
                f"ip -n {br} link add {port} type veth peer name {RANK_IFNAME} address {mac} netns {ns}",
                what=f"create rank {i}'s veth pair",
            )
            master = f"master {_BRIDGE}" if use_bridge else ""
            _run(f"ip -n {br} link set {port} {master} addrgenmode none up")
            _run(f"ip -n {ns} addr add {addr}/{prefixlen} dev {RANK_IFNAME}")
            _run(f"ip -n {ns} link set {RANK_IFNAME} addrgenmode none up")
            self._shape(ns, RANK_IFNAME, f"rank {i}'s upload")
            self._shape(br, port, f"rank {i}'s download")
        if self.delay_method == "relay":
            self._start_relay()

    def _shape(self, ns: str, dev: str, what: str) -> None:
        tbf = f"tbf rate {self.rate_bps}bit burst {self.burst_bytes} limit {self.limit_bytes}"
        if self.delay_method != "netem":
            _run(f"tc -n {ns} qdisc add dev {dev} root {tbf}", what=f"shape {what}")
            return
        # netem (half the one-way latency) at the root, tbf as its child, the layout of the netem
        # documentation ("rate control"): a packet is delayed, then shaped. netem's limit, in packets, covers
        # what is in flight.
        half_us = max(1, round(self.latency_s / 2 * 1e6))
        packets = math.ceil((self.limit_bytes + self.rate_bps / 8 * self.latency_s) / _MTU_FRAME) + 1000
        _run(
            f"tc -n {ns} qdisc add dev {dev} root handle 1: netem delay {half_us}us limit {packets}",
            what=f"delay {what} (netem; the kernel needs CONFIG_NET_SCH_NETEM)",
        )
        _run(f"tc -n {ns} qdisc add dev {dev} parent 1:1 handle 10: {tbf}", what=f"shape {what}")

    def _start_relay(self) -> None:
        args = [
            sys.executable,
            "-I",
            os.path.abspath(__file__),
            "relay",
            self.bridge_namespace,
            repr(self.latency_s),
            str(os.getpid()),
            ",".join(f"p{i}={_rank_mac(i)}" for i in range(self.world_size)),
        ]
        log.debug("network: starting relay: %s", shlex.join(args))
        relay = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert relay.stdout is not None and relay.stderr is not None
        ready, _, _ = select.select([relay.stdout], [], [], _COMMAND_TIMEOUT_S)
        if ready and relay.stdout.readline().strip() == b"ready":
            self._relay = relay
            return
        relay.kill()
        relay.wait(timeout=5)
        stderr = relay.stderr.read().decode(errors="replace").strip()
        relay.stdout.close()
        relay.stderr.close()
        raise NetworkSetupError(
            f"the user-space delay relay in {self.bridge_namespace} did not start (exit {relay.returncode}): "
            f"{stderr or 'no message'}; command: {shlex.join(args)}"
        )

    def _stop_relay(self) -> None:
        relay, self._relay = self._relay, None
        if relay is None:
            return
        if relay.poll() is None:
            relay.terminate()
            try:
                relay.wait(timeout=5)
            except subprocess.TimeoutExpired:
                relay.kill()
                relay.wait(timeout=5)
        message = relay.stderr.read().decode(errors="replace").strip() if relay.stderr is not None else ""
        for stream in (relay.stdout, relay.stderr):
            if stream is not None:
                stream.close()
        if relay.returncode not in (0, -signal.SIGTERM):
            log.warning(
                "network %s: the relay had exited with code %s: %s", self.prefix, relay.returncode, message
            )
        else:
            log.debug("network %s: %s", self.prefix, message)

    # -- removal ----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove every namespace of this network (and its relay). Idempotent; a no-op in a forked child.

        Raises:
            NetworkSetupError: a namespace could not be removed (the rest are still removed).
        """
        with self._lock:
            if self._state == "closed" or os.getpid() != self._owner_pid:
                return
            self._state = "closed"
        try:
            self._stop_relay()
        except Exception as exc:
            log.warning("network %s: stopping the relay failed: %s", self.prefix, exc)
        failures = []
        for name in reversed(self._created):
            try:
                _run(f"ip netns delete {name}", what="remove a network namespace")
            except NetworkSetupError as exc:
                if os.path.exists(os.path.join(NETNS_DIR, name)):
                    failures.append(str(exc))
        self._created.clear()
        _unregister(self)
        if failures:
            raise NetworkSetupError(f"network {self.prefix}: clean-up incomplete: " + "; ".join(failures))
        log.debug("network %s: removed", self.prefix)


def _rank_mac(rank: int) -> str:
    """A locally administered unicast MAC for rank ``rank``'s interface (stable, so the relay can route)."""
    return f"02:67:63:00:{rank >> 8 & 0xFF:02x}:{rank & 0xFF:02x}"


def remove_stale_networks() -> list[str]:
    """Remove namespaces left by dead processes (owner pid, encoded in the name, no longer running).

    Only names of the form ``gc<pid>-<n>-{br,probe,r<i>}`` are considered. Processes still inside one (ranks
    of a launcher killed before it could end them) are killed first: a namespace, with its veth pairs and
    bridge, lives on while a process is in it, even once its name is removed. ``gradcomm bench`` calls this
    before it builds a network. Returns the names removed.
    """
    removed = []
    for name in _existing_namespaces():
        match = _NAME_RE.match(name)
        if match is None:
            continue
        pid = int(match.group("pid"))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        try:
            for inside in _run(f"ip netns pids {name}", what="list processes in a stale namespace").split():
                try:
                    os.kill(int(inside), signal.SIGKILL)
                except ProcessLookupError:
                    pass
                log.info("network: killed process %s left in stale namespace %s", inside, name)
            _run(f"ip netns delete {name}", what="remove a stale network namespace")
        except NetworkSetupError as exc:
            log.warning("network: %s", exc)
            continue
        removed.append(name)
    if removed:
        log.info("network: removed stale namespaces %s", ", ".join(removed))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ----------------------------------------------------------------------------------------------------------
# The user-space delay relay (the switch, where the kernel has no netem)
# ----------------------------------------------------------------------------------------------------------

_ETH_P_ALL = 0x0003
_SOL_PACKET = 263
_PACKET_VNET_HDR = 15
_PACKET_IGNORE_OUTGOING = 23
_PACKET_OUTGOING = 4
_VNET_HDR_LEN = 10  # struct virtio_net_hdr: GSO and checksum-offload metadata in front of every frame
_RELAY_BUFFER = 256 * 1024  # larger than any GSO frame (64 KiB by default)
_RELAY_SOCKET_BUFFER = 16 * 1024 * 1024
_SO_TIMESTAMPNS = 35
_PR_SET_TIMERSLACK = 29


def _relay_main(argv: list[str]) -> int:
    """Forward Ethernet frames between the switch's ports, each ``delay`` seconds after it arrived.

    ``argv``: ``namespace delay_s owner_pid port=mac,port=mac,...``. Frames to a rank's MAC go to its port;
    broadcast and multicast frames (ARP) go to every other port; others are dropped. Packets keep their GSO
    and checksum-offload state (``PACKET_VNET_HDR``), so a 64 KiB TCP segment is forwarded as one frame and
    the port's tbf cuts it up. Frames are sent in arrival order, so the delay is the same for all. The relay
    exits when its owner dies or on SIGTERM.
    """
    namespace, delay_text, owner_text, ports_text = argv
    delay = float(delay_text)
    owner = int(owner_text)
    enter_namespace(namespace)
    try:  # wake up on time: timer slack 1 ns instead of the default 50 us
        ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl(
            _PR_SET_TIMERSLACK, 1, 0, 0, 0
        )
    except (OSError, AttributeError):
        pass
    ports = [item.split("=", 1) for item in ports_text.split(",")]
    socks: list[socket.socket] = []
    mac_to_port: dict[bytes, int] = {}
    for index, (name, mac) in enumerate(ports):
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # protocol 0: nothing received before bind
        sock.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)
        try:
            sock.setsockopt(_SOL_PACKET, _PACKET_IGNORE_OUTGOING, 1)
        except OSError:  # kernel < 4.20: outgoing frames are filtered by packet type below
            pass
        sock.setsockopt(socket.SOL_SOCKET, 33, _RELAY_SOCKET_BUFFER)  # SO_RCVBUFFORCE
        sock.setsockopt(socket.SOL_SOCKET, 32, _RELAY_SOCKET_BUFFER)  # SO_SNDBUFFORCE
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)  # kernel arrival time of each frame
        sock.bind((name, _ETH_P_ALL))
        sock.setblocking(False)
        socks.append(sock)
        mac_to_port[bytes.fromhex(mac.replace(":", ""))] = index
    everyone = list(range(len(socks)))
    port_of_fd = {sock.fileno(): index for index, sock in enumerate(socks)}
    # (due on the monotonic clock, in port, out port or None to flood, frame); constant delay: FIFO order
    pending: deque[tuple[float, int, int | None, bytes]] = deque()
    stats = _RelayStats()
    signal.signal(signal.SIGTERM, lambda signum, frame: stats.exit())
    print("ready", flush=True)
    next_owner_check = 0.0
    while True:
        target = pending[0][0] if pending else None
        timeout = 0.2 if target is None else max(0.0, target - time.monotonic())
        readable, _, _ = select.select(socks, [], [], timeout)
        now = time.monotonic()
        if target is not None and timeout > 0 and not readable and now >= target:  # slept until the target
            stats.wakes += 1
            stats.lateness += now - target
        for sock in readable:
            index = port_of_fd[sock.fileno()]
            for _ in range(256):
                try:
                    frame, ancillary, flags, address = sock.recvmsg(_RELAY_BUFFER, 64)
                except BlockingIOError:
                    break
                if (
                    address[2] == _PACKET_OUTGOING
                    or len(frame) < _VNET_HDR_LEN + 14
                    or flags & socket.MSG_TRUNC
                ):
                    continue
                # The kernel's receive timestamp (wall clock) says how long the frame waited for us.
                lag = 0.0
                for level, kind, data in ancillary:
                    if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(data) >= 16:
                        seconds, nanoseconds = struct.unpack("qq", data[:16])
                        lag = min(delay, max(0.0, time.time() - (seconds + nanoseconds * 1e-9)))
                stats.received += 1
                stats.arrival_lag += lag
                destination = frame[_VNET_HDR_LEN : _VNET_HDR_LEN + 6]
                if destination[0] & 1:
                    pending.append((now - lag + delay, index, None, frame))
                elif destination in mac_to_port:
                    pending.append((now - lag + delay, index, mac_to_port[destination], frame))
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, source, out_port, frame = pending.popleft()
            for out in everyone if out_port is None else (out_port,):
                if out == source:
                    continue
                try:
                    socks[out].send(frame)
                    stats.sent += 1
                except OSError:  # ENOBUFS: the port's tbf queue is full (a tail drop, as in a switch)
                    stats.dropped += 1
        if now >= next_owner_check:
            if os.getppid() != owner:
                stats.exit()
            next_owner_check = now + 0.5


class _RelayStats:
    """Counters of the relay, written to stderr when it exits (logged by ShapedNetwork at debug level)."""

    def __init__(self) -> None:
        self.received = self.sent = self.dropped = self.wakes = 0
        self.arrival_lag = self.lateness = 0.0

    def exit(self) -> None:
        sys.stderr.write(
            f"relay: {self.received} frames received, {self.sent} sent, "
            f"{self.dropped} dropped (port queue full); "
            f"mean {self.arrival_lag / max(1, self.received) * 1e6:.0f} us from arrival to read, "
            f"{self.lateness / max(1, self.wakes) * 1e6:.0f} us wake-up lateness\n"
        )
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "relay":
        sys.exit(_relay_main(sys.argv[2:]))
    sys.exit(
        f"usage: {sys.argv[0]} relay NAMESPACE DELAY_S OWNER_PID PORT=MAC,...  (started by ShapedNetwork)"
    )
