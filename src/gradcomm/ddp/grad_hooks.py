"""The autograd hooks through which backward reaches the reducer; each holds it weakly, so a DDP can be
collected while autograd graphs that saw it are still alive.

A gradient reaches the reducer as it reaches torch's: through a post hook on the parameter's
``AccumulateGrad`` node, which runs after the parameter's own post-accumulate-grad hooks. So a user's
``register_post_accumulate_grad_hook`` sees the local gradient in ``.grad`` and may change it in place before
it is reduced, whenever it was registered, as with torch's DDP.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from gradcomm.ddp.reducer import Reducer

__all__ = ["EndOfBackwardHook", "GradReadyHook", "after_accumulation"]


def after_accumulation(
    param: torch.Tensor, hook: Callable[[Any, Any], None]
) -> tuple[RemovableHandle, torch.autograd.graph.Node]:
    """Run ``hook(grad_inputs, grad_outputs)`` each time backward has accumulated a gradient into
    ``param.grad``, after ``param``'s post-accumulate-grad hooks: a post hook on its ``AccumulateGrad`` node,
    where torch's reducer hooks in. Returns the handle and the node; keep the node, which the parameter
    holds only weakly (a new one, without the hook, would replace it once no graph refers to it)."""
    with torch.enable_grad():
        node = param.view_as(param).grad_fn.next_functions[0][0]
    return node.register_hook(hook), node

class GradReadyHook:
    """The reducer's hook on one parameter (see :func:`after_accumulation`); holds the reducer weakly so the
    DDP can be collected."""

    __slots__ = ("index", "reducer")

    def __init__(self, reducer: weakref.ref[Reducer], index: int) -> None:
        self.reducer = reducer
        self.index = index

    def __call__(self, _grad_inputs: Any, _grad_outputs: Any) -> None:
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
