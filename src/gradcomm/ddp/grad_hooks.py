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

from gradcomm.ddp.unused import tensors_in

if TYPE_CHECKING:
    from gradcomm.ddp.reducer import Reducer

__all__ = ["EndOfBackwardHook", "GradReadyHook", "after_accumulation", "hook_end_of_backward", "hook_parameters"]


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


def hook_parameters(
    params: list[torch.nn.Parameter], reducer: weakref.ref[Reducer]
) -> tuple[list[RemovableHandle], list[torch.autograd.graph.Node]]:
    """A :class:`GradReadyHook` after each parameter's accumulation; the handles, and the nodes to keep (see
    :func:`after_accumulation`)."""
    hooked = [after_accumulation(param, GradReadyHook(reducer, index)) for index, param in enumerate(params)]
    return [handle for handle, _ in hooked], [node for _, node in hooked]


def hook_end_of_backward(outputs: Any, reducer: weakref.ref[Reducer]) -> bool:
    """Queue the reducer's end-of-backward callback when the backward through ``outputs`` ends; whether any
    output is part of a graph (otherwise the reducer queues it at the first gradient).

    As torch's ``_DDPSink``: a pre-hook on the outputs' autograd nodes queues it in the backward that
    reaches them, the outermost one even under reentrant checkpointing.
    """
    hooked = False
    for tensor in tensors_in(outputs):
        if tensor.grad_fn is not None:
            tensor.grad_fn.register_prehook(EndOfBackwardHook(reducer))
            hooked = True
    return hooked
