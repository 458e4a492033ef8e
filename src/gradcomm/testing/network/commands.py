"""Running ``ip`` and ``tc`` (iproute2), and :class:`NetworkSetupError`, the error of this package.

:func:`_run` runs one command and turns any failure into a :class:`NetworkSetupError` that names the command,
what it was for and its stderr; :func:`_tool` finds ``ip`` and ``tc`` also in the sbin directories, which are
missing from many ``PATH`` s.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence

from gradcomm.errors import GradcommError

__all__ = ["NetworkSetupError"]

log = logging.getLogger(__name__)

_COMMAND_TIMEOUT_S = 30.0


class NetworkSetupError(GradcommError, RuntimeError):
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
