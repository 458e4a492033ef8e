"""Whether this process and kernel can build an emulated network, and what is missing if not.

Requirements: root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` and ``tc`` from iproute2, and a kernel with
network namespaces, veth, bridge and tbf; :func:`check_network_privileges` says what is missing.
:func:`_netem_available` tells whether the kernel also has netem (``CONFIG_NET_SCH_NETEM``), which decides how
:class:`~gradcomm.testing.network.ShapedNetwork` adds latency.
"""

from __future__ import annotations

import logging
import os

from .commands import NetworkSetupError, _run, _tool
from .namespaces import _BRIDGE, NETNS_DIR, _new_prefix

__all__ = ["check_network_privileges"]

log = logging.getLogger(__name__)

_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21


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
