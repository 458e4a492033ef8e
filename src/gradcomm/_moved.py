"""Old import paths of modules that moved: each stays importable, warns once, and is the new module itself.

The engine's folder (:mod:`gradcomm.ddp`) once held checkpoints, averagers, telemetry and the ranks'
agreement checks; they moved to :mod:`gradcomm.checkpoint`, :mod:`gradcomm.hooks.averagers`,
:mod:`gradcomm.comm.telemetry`, :mod:`gradcomm.comm.agreement` and :mod:`gradcomm.hooks.fingerprint`.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping


def warn_moved(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn the code importing ``old`` (not this module, nor the shim calling it) that it should import ``new``.

    The default ``stacklevel`` skips this function and the shim's body; Python skips importlib's frames."""
    warnings.warn(
        f"{old} has moved: import from {new} instead (the old path will be removed)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def alias_moved_module(old: str, new: str, advised: str | None = None) -> None:
    """Make the module named ``old`` the module ``new``: the same objects, private names and monkeypatching
    included, so code written against the old path behaves as before. The warning advises ``advised``
    (a package re-exporting ``new``'s public names), or ``new``."""
    warn_moved(old, advised or new, stacklevel=4)
    sys.modules[old] = importlib.import_module(new)


def moved_names(old: str, new_modules: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for the names that moved out of module ``old`` to ``new_modules[name]``: each is
    read from its new module, with a warning naming it. Lazily, since the new modules import the old one."""

    def __getattr__(name: str) -> object:
        if name not in new_modules:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warn_moved(f"{old}.{name}", new_modules[name])
        return getattr(importlib.import_module(new_modules[name]), name)

    return __getattr__
