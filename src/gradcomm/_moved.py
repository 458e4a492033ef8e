"""Old import paths of modules that moved: each stays importable, warns once, and is the new module itself.

The engine's folder (:mod:`gradcomm.ddp`) once held checkpoints, averagers, telemetry and the ranks'
agreement checks; they moved to :mod:`gradcomm.checkpoint`, :mod:`gradcomm.hooks.averagers`,
:mod:`gradcomm.comm.telemetry`, :mod:`gradcomm.comm.agreement` and :mod:`gradcomm.hooks.fingerprint`.
"""

from __future__ import annotations

import importlib
import sys
import warnings


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
