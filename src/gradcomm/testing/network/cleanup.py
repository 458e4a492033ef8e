"""Removal of emulated networks when their owner ends: at exit, on SIGINT/SIGTERM, or after it was killed.

Clean-up. Namespace names carry the owner's pid and a per-process counter (``gc<pid>-<n>-...``), so parallel
runs never collide. :meth:`ShapedNetwork.close` removes everything; it runs on ``__exit__``, at interpreter
exit and on SIGINT/SIGTERM (then the previous handler runs): every open network is registered here
(:func:`_register`) and the handlers are installed while one is. :func:`remove_stale_networks`, which
``gradcomm bench`` calls before it builds a network, removes what a killed process left behind (the relay
exits by itself when its owner dies).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

from .commands import NetworkSetupError, _run
from .namespaces import _NAME_RE, _existing_namespaces

if TYPE_CHECKING:
    from .shaped import ShapedNetwork

__all__ = ["kill_processes_in", "remove_stale_networks"]

log = logging.getLogger(__name__)

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


def remove_stale_networks() -> list[str]:
    """Remove namespaces left by dead processes (owner pid, encoded in the name, no longer running).

    Only names of the form ``gc<pid>-<n>-{br,probe,r<i>,h<i>}`` are considered. Processes still inside one
    (ranks of a launcher killed before it could end them) are killed first: a namespace, with its veth pairs and
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
            for inside in kill_processes_in(name):
                log.info("network: killed process %d left in stale namespace %s", inside, name)
            _run(f"ip netns delete {name}", what="remove a stale network namespace")
        except NetworkSetupError as exc:
            log.warning("network: %s", exc)
            continue
        removed.append(name)
    if removed:
        log.info("network: removed stale namespaces %s", ", ".join(removed))
    return removed


def kill_processes_in(namespace: str) -> list[int]:
    """SIGKILL every process in network namespace ``namespace`` (``ip netns pids``); return their pids.

    Raises:
        NetworkSetupError: the processes could not be listed (the namespace is gone, or not root).
    """
    killed = []
    for inside in _run(f"ip netns pids {namespace}", what="list the processes in a network namespace").split():
        try:
            os.kill(int(inside), signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed.append(int(inside))
    return killed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
