"""The base of every exception class gradcomm defines.

``except gradcomm.GradcommError`` catches whatever gradcomm raises of its own (a hook breaking its contract,
ranks that disagree, a lost peer, a checkpoint that cannot be loaded, ...). Each class also keeps the builtin
or torch type that torch raises in its place (``RuntimeError`` for most, ``torch.distributed.DistBackendError``
for a lost peer), so ``except RuntimeError`` written for torch's DDP catches it too. Plain argument checks
raise the builtin type torch raises for the same mistake (``ValueError``, ``TypeError``), as torch does.

This module imports nothing, so every layer of the package can use it.
"""

from __future__ import annotations

__all__ = ["GradcommError"]


class GradcommError(Exception):
    """Base class of gradcomm's own exceptions; each also derives from the type torch raises in its place."""
