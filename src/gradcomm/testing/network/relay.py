"""The user-space delay relay: the switch of a :class:`ShapedNetwork` whose kernel has no netem.

It runs as a separate process in the switch namespace, where there is then no bridge, and forwards Ethernet
frames between the ports, each ``latency_s`` after the kernel received it, through ``AF_PACKET`` sockets with
``PACKET_VNET_HDR`` so that GSO segments of up to 64 KiB cross as one frame. The ``tbf`` shapers stay in the
kernel. It adds a little delay of its own to each frame and keeps most, not all, of the shaped rate up to
1 Gbit/s (figures in ``docs/notes/2026-11-27-figures-from-docstrings.md``). It costs one CPU core's share
for its Python loop and is not meant for 10 Gbit/s.

:class:`~gradcomm.testing.network.ShapedNetwork` starts it by file path, ``python -I .../network/relay.py
relay NAMESPACE DELAY_S OWNER_PID PORT=MAC,...``, and waits for it to print ``ready``; it also runs as
``python -m gradcomm.testing.network.relay relay ...``. Run by file path it imports its sibling modules
without importing :mod:`gradcomm` (and torch with it): see the ``__package__`` set-up below.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import signal
import socket
import struct
import sys
import time
from collections import deque

if __name__ == "__main__" and not __package__:
    # Run by file path: make this folder a package of its own name, so that the relative import below finds
    # namespaces.py and commands.py here, without importing gradcomm's __init__ (PEP 366).
    import types

    _package = types.ModuleType("_gradcomm_network_relay")
    _package.__path__ = [os.path.dirname(os.path.abspath(__file__))]
    sys.modules[_package.__name__] = _package
    __package__ = _package.__name__

from .namespaces import enter_namespace  # noqa: E402

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
