"""Emulated machines: a :class:`HostNetwork` of hosts, each a namespace shared by several ranks, and their links.

A :class:`HostNetwork` is a :class:`~gradcomm.testing.network.ShapedNetwork` whose namespaces are hosts
(``gc<pid>-<n>-h<i>``) rather than ranks: the same switch, veth pairs and ``tbf`` shapers, one link of the
chosen rate per host. The ranks of a host all run in its namespace; traffic between two of them goes to an
address of their own namespace and so through its loopback, never through the shaped link, as between the
processes of one machine; traffic between hosts crosses both hosts' shaped links.

Processes are started in a host with ``ip netns exec`` (:meth:`HostNetwork.exec_command`), which also mounts
a sysfs of the namespace over ``/sys`` for the process and its children, so that ``/sys/class/net`` shows
the host's own interfaces: :func:`link_byte_counters` reads the host link's byte counters there, and checks
that they are the namespace's. :meth:`HostNetwork.close` ends every process still in a host before removing
the namespaces (a namespace lives on, with its links, while a process is in it).
"""

from __future__ import annotations

import logging
import os
import socket

from .cleanup import kill_processes_in
from .commands import NetworkSetupError, _tool
from .namespaces import NETNS_DIR
from .shaped import ShapedNetwork

__all__ = ["HostNetwork", "link_byte_counters"]

log = logging.getLogger(__name__)

_SYS_NET = "/sys/class/net"


class HostNetwork(ShapedNetwork):
    """``nodes`` emulated hosts on a switch, each behind a link of ``rate_bps`` both ways.

    Arguments and attributes as :class:`ShapedNetwork`'s (``world_size`` is the number of hosts), with
    ``namespaces[i]`` and ``addresses[i]`` host ``i``'s, on its interface :attr:`ifname`::

        with HostNetwork(2, parse_rate("100mbit")) as net:
            subprocess.run(net.exec_command(0, ["python", "-c", "..."]), env={"GLOO_SOCKET_IFNAME": net.ifname})

    gloo must be told the interface (``GLOO_SOCKET_IFNAME``): it otherwise binds the address of the machine's
    hostname, which does not exist in the namespace.
    """

    _role = "h"

    def exec_command(self, host: int, argv: list[str]) -> list[str]:
        """The command line running ``argv`` in host ``host``'s namespace (``ip netns exec``)."""
        if not 0 <= host < len(self.namespaces):
            hosts = f"{len(self.namespaces)} hosts" if self.namespaces else "no hosts until it is opened"
            raise ValueError(f"HostNetwork.exec_command: no host {host}; the network has {hosts}")
        return [_tool("ip"), "netns", "exec", self.namespaces[host], *argv]

    def kill_processes(self) -> list[int]:
        """SIGKILL every process still in a host namespace; return their pids."""
        killed = []
        for name in self.namespaces:
            try:
                killed += kill_processes_in(name)
            except NetworkSetupError as exc:
                if os.path.exists(os.path.join(NETNS_DIR, name)):
                    log.warning("network %s: %s", self.prefix, exc)
        return killed

    def close(self) -> None:
        """End every process left in a host, then remove the network (see :meth:`ShapedNetwork.close`)."""
        if os.getpid() == self._owner_pid and self._state == "open":
            for pid in self.kill_processes():
                log.info("network %s: killed process %d left in a host namespace", self.prefix, pid)
        super().close()


def link_byte_counters(ifname: str) -> tuple[int, int]:
    """``(tx_bytes, rx_bytes)`` of this process's interface ``ifname``: every Ethernet frame it sent, received.

    Read from ``/sys/class/net/<ifname>/statistics``, which shows this process's network namespace only where
    a sysfs was mounted for it (``ip netns exec`` does; ``setns`` alone does not).

    Raises:
        NetworkSetupError: the interface is missing, or ``/sys`` shows another namespace's interfaces.
    """
    try:
        in_sysfs = set(os.listdir(_SYS_NET))
    except OSError as exc:
        raise NetworkSetupError(f"link_byte_counters: cannot list {_SYS_NET}: {exc}") from exc
    own = {name for _, name in socket.if_nameindex()}
    if in_sysfs != own:
        raise NetworkSetupError(
            f"link_byte_counters: {_SYS_NET} shows {sorted(in_sysfs)}, not this network namespace's interfaces "
            f"{sorted(own)}: start the process with `ip netns exec` (HostNetwork.exec_command), which mounts "
            "the namespace's sysfs"
        )
    if ifname not in own:
        raise NetworkSetupError(f"link_byte_counters: no interface {ifname!r} here; there are {sorted(own)}")
    counters = []
    for name in ("tx_bytes", "rx_bytes"):
        with open(os.path.join(_SYS_NET, ifname, "statistics", name)) as stream:
            counters.append(int(stream.read()))
    return counters[0], counters[1]
