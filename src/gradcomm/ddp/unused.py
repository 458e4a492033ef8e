"""Parameters that get no gradient: finding them from the forward's output, and remembering them for a static graph.

With ``find_unused_parameters=True`` the reducer searches the autograd graph from the forward's output each
iteration (:func:`parameters_reached`) and marks the parameters it does not reach as ready at once. With
``static_graph=True`` (torch's promise that the same parameters are used every iteration) it instead finds them
once, at the end of the first iteration's backward, and :class:`UsedParameters` remembers them: later
iterations mark them ready at once, without searching the graph and without the allreduce of the
used-parameter map, and leave the ``.grad`` of parameters no rank used untouched, as torch does.
"""

from __future__ import annotations

import enum
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING, Any

import torch

from gradcomm.ddp.reducer_errors import graph_changed_error

if TYPE_CHECKING:
    from gradcomm.ddp.iteration import Iteration

__all__ = ["StaticCounting", "UsedParameters", "parameters_reached", "tensors_in"]


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``: torch's ``_find_tensors`` (lists, tuples, dicts and dataclasses, nested)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    if is_dataclass(value) and not isinstance(value, type):
        return [t for field in fields(value) for t in tensors_in(getattr(value, field.name))]
    return []


def parameters_reached(outputs: Any) -> set[int]:
    """ids of the leaf tensors that ``outputs`` depend on through the autograd graph."""
    reached: set[int] = set()
    stack = []
    for tensor in tensors_in(outputs):
        if tensor.grad_fn is not None:
            stack.append(tensor.grad_fn)
        elif tensor.requires_grad:
            reached.add(id(tensor))
    seen = set(stack)
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                seen.add(next_node)
                stack.append(next_node)
    return reached


class StaticCounting(enum.Enum):
    """How a static graph's gradients are counted before a parameter is ready (a value, not a bound method, so
    that the reducer holds no reference to itself)."""

    FIRST = "first"
    """The first iteration: count each parameter's gradients and mark everything at the end of backward."""
    DOWN = "down"
    """Later iterations: a parameter is ready at its last gradient of the first iteration's count."""

class UsedParameters:
    """A static graph's record of unused parameters, and the evidence for torch's ``can_set_static_graph``.

    Args:
        count: number of parameters the reducer handles.
        static: whether the graph is declared static.
    """

    def __init__(self, count: int, static: bool) -> None:
        self.enabled = static
        self.count = count
        self.locally_unused: list[int] = []  # static: this rank's parameters without a gradient
        self.globally_used: list[int] | None = None  # static: which parameters some rank used
        self.recorded = False  # static: the first iteration has been recorded
        self.consistent = True  # every iteration so far left the same parameters without a gradient
        # static: how many gradients each parameter received in the first iteration (reentrant checkpointing
        # can give one several); later iterations mark it ready at the last of them, as torch does
        self.hook_counts: list[int] = []
        self._last_unused: tuple[int, ...] | None = None

    def arm(self, it: Iteration) -> bool:
        """Set up how the static graph's backward ``it`` counts gradients; whether its end must be hooked: in
        the first iteration, which counts each parameter's gradients and reduces every bucket at the end of
        backward (torch's ``_delay_all_reduce``)."""
        if not self.recorded:
            it.first_counts = [0] * self.count
            it.counting = StaticCounting.FIRST
            return True
        it.unused = self.locally_unused
        it.countdown = list(self.hook_counts)
        it.counting = StaticCounting.DOWN
        return False

    def count_first(self, it: Iteration, index: int, ready_order: list[int] | None) -> bool:
        """First iteration: count the gradient, recording the ready order, and defer marking to the end of
        backward (as torch); whether the parameter waits (always)."""
        it.first_counts[index] += 1
        if it.first_counts[index] == 1 and ready_order is not None:
            ready_order.append(index)
        return True

    def count_down(self, it: Iteration, index: int, name: str) -> bool:
        """Later iterations: a parameter is ready at its last gradient of the first iteration's count; whether
        it still waits."""
        left = it.countdown[index] - 1
        if left < 0:
            raise graph_changed_error(name, self.hook_counts[index])
        it.countdown[index] = left
        return left > 0

    def end_first_iteration(self, it: Iteration, recorded: list[int]) -> list[int]:
        """The end of the first iteration's backward: keep the gradient counts; returns the order in which
        every parameter is marked ready now: the ``recorded`` ready order, then the parameters without one."""
        it.counting = None
        self.hook_counts = list(it.first_counts)
        seen = set(recorded)
        return [*recorded, *(i for i in range(self.count) if i not in seen)]

    def reduces_used_map(self, find_unused: bool) -> bool:
        """Whether this iteration allreduces the used-parameter map: every iteration when searching for unused
        parameters, only the first one of a static graph."""
        return not self.recorded if self.enabled else find_unused

    def after_step(self, locally_used: torch.Tensor | None, globally_used: list[int] | None) -> list[int] | None:
        """Record a finished step (``locally_used``: this rank's flags, ``None`` when not tracked or on a joined
        rank); returns the globally-used flags that decide which ``.grad`` are written."""
        if locally_used is not None:
            unused = tuple((locally_used == 0).nonzero().flatten().tolist())
            if self._last_unused is not None and unused != self._last_unused:
                self.consistent = False
            self._last_unused = unused
        if not self.enabled:
            return globally_used
        if not self.recorded:
            self.recorded = True
            self.globally_used = globally_used
            if locally_used is not None:
                self.locally_unused = list(self._last_unused or ())
            elif globally_used is not None:  # a joined rank knows only what no rank used
                self.locally_unused = [index for index, used in enumerate(globally_used) if not used]
            if not self.hook_counts:
                unused = set(self.locally_unused)
                self.hook_counts = [0 if index in unused else 1 for index in range(self.count)]
        return self.globally_used
