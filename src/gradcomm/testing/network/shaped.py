"""The emulated network itself: :class:`ShapedNetwork`, built, shaped and removed.

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
  a small user-space process there (:mod:`gradcomm.testing.network.relay`, run as a script) forwards
  Ethernet frames between the ports, each ``latency_s`` after the kernel received it. The ``tbf`` shapers stay
  in the kernel. See that module for how, and what it costs.

The subnet of the ranks is chosen (among 10.213-10.254.x.0/24) to differ from every address and route of the
host (:func:`_pick_subnet`). Removal at exit and on signals is in :mod:`gradcomm.testing.network.cleanup`.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from types import TracebackType

from .cleanup import _register, _unregister
from .commands import _COMMAND_TIMEOUT_S, NetworkSetupError, _run
from .namespaces import _BRIDGE, NETNS_DIR, RANK_IFNAME, _new_prefix
from .privileges import _netem_available, check_network_privileges

__all__ = ["ShapedNetwork"]

log = logging.getLogger(__name__)

_MTU_FRAME = 1514  # bytes of a full-size Ethernet frame at MTU 1500 (without FCS)
_MAX_WORLD_SIZE = 250

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


class ShapedNetwork:
    """A switched network of ``world_size`` namespaced hosts, each on a link of ``rate_bps`` both ways.

    Use as a context manager; see the package and module docstrings for the topology, shaping and latency::

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
    _role = "r"  # namespace i is ``<prefix>-<role><i>``; a HostNetwork's are hosts, ``h``

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
        self.namespaces = [f"{self.prefix}-{self._role}{i}" for i in range(self.world_size)]
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
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "relay.py"),
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
