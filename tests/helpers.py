"""Small helpers shared by the test modules (importable by spawned ranks as ``tests.helpers``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def flat_parameters(module: torch.nn.Module) -> np.ndarray:
    """The parameters as one numpy array, a copy that survives the trip back from a rank process."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy().copy()


def error_text(fn: Callable[[], Any]) -> str:
    """``"Type: message"`` of what ``fn()`` raises, or ``"no error"``; messages are asserted in the parent."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
