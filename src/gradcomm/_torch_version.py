"""The torch releases gradcomm supports, checked once when :mod:`gradcomm` is imported.

gradcomm reproduces the behaviour and messages of one torch release's DDP and relies on torch internals that
change between releases without notice (``Variable._execution_engine.queue_callback``,
``torch._C._storage_Use_Count``, a process group's ``_get_backend(device).options._timeout``,
``torch._utils._flatten_dense_tensors``, ``torch._foreach_copy_``). Under another release it would fail
deep inside a backward pass or differ from torch silently, so the import refuses it with the fix instead.
``pyproject.toml`` declares the same range (``tests/test_packaging.py`` keeps the two equal).
"""

from __future__ import annotations

import os
import re

import torch

__all__ = ["SKIP_ENV", "SUPPORTED_TORCH", "check_torch_version"]

_LOWEST = (2, 13)
_BELOW = (2, 14)
SUPPORTED_TORCH = f">={_LOWEST[0]}.{_LOWEST[1]},<{_BELOW[0]}.{_BELOW[1]}"
"""The pip specifier of the supported releases: every 2.13.x."""

SKIP_ENV = "GRADCOMM_SKIP_TORCH_VERSION_CHECK"
"""Set to 1 to import gradcomm under any torch, unsupported (to try a new release, or bisect one)."""


def _release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version such as ``2.13.0+cpu`` or ``2.14.0.dev20260101``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def check_torch_version(version: str | None = None) -> None:
    """Raise ImportError unless ``version`` (default: the installed torch's) is a supported release."""
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return
    version = str(torch.__version__ if version is None else version)
    release = _release(version)
    if release is not None and _LOWEST <= release < _BELOW:
        return
    raise ImportError(
        f"gradcomm supports torch{SUPPORTED_TORCH}, but torch {version} is installed "
        f"({os.path.dirname(torch.__file__)}): gradcomm relies on torch internals that change between "
        f"releases. Install a supported torch with: pip install 'torch{SUPPORTED_TORCH}' "
        f"(or set {SKIP_ENV}=1 to import gradcomm anyway, unsupported)"
    )


check_torch_version()
