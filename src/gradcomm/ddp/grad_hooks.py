"""The autograd hooks through which backward reaches the reducer; each holds it weakly, so a DDP can be
collected while autograd graphs that saw it are still alive."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gradcomm.ddp.reducer import Reducer

__all__ = ["EndOfBackwardHook", "GradReadyHook"]

class GradReadyHook:
    """Post-accumulate-grad hook on one parameter; holds the reducer weakly so the DDP can be collected."""

    __slots__ = ("index", "reducer")

    def __init__(self, reducer: weakref.ref[Reducer], index: int) -> None:
        self.reducer = reducer
        self.index = index

    def __call__(self, _param: torch.Tensor) -> None:
        reducer = self.reducer()
        if reducer is not None:
            reducer._on_grad_ready(self.index)


class EndOfBackwardHook:
    """Pre-hook on an output's autograd node: queues the reducer's end-of-backward callback (held weakly)."""

    __slots__ = ("reducer",)

    def __init__(self, reducer: weakref.ref[Reducer]) -> None:
        self.reducer = reducer

    def __call__(self, _grad_outputs: Any) -> None:
        reducer = self.reducer()
        if reducer is not None:
            reducer._queue_end_of_backward()
