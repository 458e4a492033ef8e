"""Names of the emulated network's namespaces, and entering one (:func:`enter_namespace`).

Namespace names carry the owner's pid and a per-process counter (``gc<pid>-<n>-br`` for the switch,
``gc<pid>-<n>-r<i>`` for rank ``i``, ``gc<pid>-<n>-h<i>`` for emulated host ``i`` of a
:class:`~gradcomm.testing.network.HostNetwork`, ``gc<pid>-<n>-probe`` for :func:`check_network_privileges`' test), so
parallel runs never collide; :func:`_new_prefix` picks a free ``gc<pid>-<n>``. They are files under
:data:`NETNS_DIR`, where ``ip netns add`` puts them.

gloo. gloo binds to the address of the machine's hostname, which does not exist inside a rank namespace, and
falls back to loopback, which the other ranks cannot reach ("Connection refused, remote=[127.0.0.1]").
:func:`enter_namespace` therefore sets ``GLOO_SOCKET_IFNAME=eth0`` when it enters a rank namespace; a launcher
that enters namespaces some other way must set it itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import logging
import os
import re
import threading

from .commands import NetworkSetupError

__all__ = ["NETNS_DIR", "RANK_IFNAME", "enter_namespace"]

log = logging.getLogger(__name__)

RANK_IFNAME = "eth0"
"""Name of the rank's network interface inside every rank namespace (the value for ``GLOO_SOCKET_IFNAME``)."""

NETNS_DIR = "/var/run/netns"
_BRIDGE = "br0"
_CLONE_NEWNET = 0x40000000
_NAME_RE = re.compile(r"^gc(?P<pid>\d+)-(?P<n>\d+)-(?P<role>br|probe|[rh]\d+)$")
_RANK_NAME_RE = re.compile(r"^gc\d+-\d+-r\d+$")

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
