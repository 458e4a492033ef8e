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

The modules, each with the details of its part:

* :mod:`~gradcomm.testing.network.parsing`: :func:`parse_rate` and :func:`parse_duration` (tc spellings).
* :mod:`~gradcomm.testing.network.commands`: running ``ip`` and ``tc``; :class:`NetworkSetupError`.
* :mod:`~gradcomm.testing.network.privileges`: :func:`check_network_privileges`, and the requirements: root
  (or CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` and ``tc`` from iproute2, and a kernel with network
  namespaces, veth, bridge and tbf.
* :mod:`~gradcomm.testing.network.namespaces`: namespace names, :func:`enter_namespace` (and why it sets
  ``GLOO_SOCKET_IFNAME``).
* :mod:`~gradcomm.testing.network.shaped`: :class:`ShapedNetwork`: building the network, shaping (tbf) and
  latency (netem, or the relay).
* :mod:`~gradcomm.testing.network.hosts`: :class:`HostNetwork`, the same network with one namespace per
  emulated host shared by its ranks, and :func:`link_byte_counters`, what crossed a host's link.
* :mod:`~gradcomm.testing.network.cleanup`: removal at exit, on SIGINT/SIGTERM, and
  :func:`remove_stale_networks` for what a killed process left behind.
* :mod:`~gradcomm.testing.network.relay`: the user-space delay relay, a separate process in the switch
  namespace where the kernel has no netem.
"""

from .cleanup import remove_stale_networks
from .commands import NetworkSetupError
from .hosts import HostNetwork, link_byte_counters
from .namespaces import RANK_IFNAME, enter_namespace
from .parsing import parse_duration, parse_rate
from .privileges import check_network_privileges
from .shaped import ShapedNetwork

__all__ = [
    "RANK_IFNAME",
    "HostNetwork",
    "NetworkSetupError",
    "ShapedNetwork",
    "check_network_privileges",
    "enter_namespace",
    "link_byte_counters",
    "parse_duration",
    "parse_rate",
    "remove_stale_networks",
]
