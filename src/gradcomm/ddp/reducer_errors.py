"""The reducer's errors, each with torch's sentence first (so code and tests matching torch's messages match
gradcomm's), then what went wrong in gradcomm's terms, naming the parameters, and what to do."""

from __future__ import annotations

import torch.distributed as dist

__all__ = [
    "graph_changed_error",
    "marked_twice_error",
    "not_finalized_error",
    "registering_too_late",
    "static_graph_too_late_error",
    "unfinished_reduction_error",
]


def marked_twice_error(name: str) -> RuntimeError:
    """A parameter's gradient arrived twice in one synchronised backward; the message contains torch's
    sentence, so torch's tests' patterns match it."""
    return RuntimeError(
        "Expected to mark a variable ready only once. gradcomm.DistributedDataParallel: parameter "
        f"{name} received its gradient twice in one backward. This happens when it is used in "
        "several reentrant backward passes (torch.utils.checkpoint(..., use_reentrant=True) run more than "
        "once over it, or with find_unused_parameters=True, which cannot see inside a reentrant "
        "checkpoint), or when it is shared between parts of the model checkpointed separately. Use "
        "use_reentrant=False, or static_graph=True if the same parameters are used every iteration."
    )


# torch's C++ reducer's message (Reducer::ensure_prior_reduction_finished), part by part, so code and tests
# matching any of its sentences match gradcomm's.
_UNFINISHED = (
    "Expected to have finished reduction in the prior iteration before starting a new one. This error "
    "indicates that your module has parameters that were not used in producing loss. "
)
_UNFINISHED_STATIC = (
    "Expected to have finished reduction in the prior iteration before starting a new one. This error "
    "indicates that your training graph has changed in this iteration, e.g., one parameter is used in first "
    "iteration, but then got unused in the second iteration. this is not compatible with static_graph set to "
    "True."
)
_ENABLE_FIND_UNUSED = (
    "You can enable unused parameter detection by passing the keyword argument `find_unused_parameters=True` "
    "to `torch.nn.parallel.DistributedDataParallel`, and by \n"
)
_FIND_UNUSED_ENABLED = (
    "Since `find_unused_parameters=True` is enabled, this likely  means that not all `forward` outputs "
    "participate in computing loss. You can fix this by "
)
_OUTPUTS_IN_LOSS = "making sure all `forward` function outputs participate in calculating loss. "
_OUTPUTS_NOT_FOUND = (
    "\nIf you already have done the above, then the distributed data parallel module wasn't able to locate the "
    "output tensors in the return value of your module's `forward` function. Please include the loss function "
    "and the structure of the return value of `forward` of your module when reporting this issue (e.g. list, "
    "dict, iterable)."
)
_DEBUG_HINT = (
    "\n In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL to "
    "print out information about which particular parameters did not receive gradient on this rank as part of "
    "this error"
)


def unfinished_reduction_error(
    names: list[str], indices: list[int], rank: int, static_graph: bool, find_unused: bool
) -> RuntimeError:
    """The previous synchronised backward left parameters ``names`` (``indices`` among the DDP's parameters)
    without a gradient on group rank ``rank``, so their buckets were never reduced; raised at the next forward,
    as torch does, with torch's whole message first (its debug-level hint where torch gives it), then
    gradcomm's: the parameters are always named."""
    if static_graph:
        torch_text = _UNFINISHED_STATIC
    elif find_unused:
        torch_text = _UNFINISHED + _FIND_UNUSED_ENABLED + _OUTPUTS_IN_LOSS + _OUTPUTS_NOT_FOUND
    else:
        torch_text = _UNFINISHED + _ENABLE_FIND_UNUSED + _OUTPUTS_IN_LOSS + _OUTPUTS_NOT_FOUND
    torch_text += (
        f"\nParameters which did not receive grad for rank {rank}: {', '.join(names)}"
        f"\nParameter indices which did not receive grad for rank {rank}: {', '.join(map(str, indices))}"
    )
    if dist.get_debug_level() == dist.DebugLevel.OFF:
        torch_text += _DEBUG_HINT
    advice = (
        "construct the DDP without static_graph if the set of used parameters changes between iterations"
        if static_graph
        else "if these parameters are unused in forward on purpose, pass find_unused_parameters=True and make "
        "every output take part in the loss; if they are not trained, set requires_grad=False on them before "
        "wrapping the model"
    )
    return RuntimeError(
        f"{torch_text}\ngradcomm.DistributedDataParallel: the previous backward produced no gradient for "
        f"{len(names)} parameter(s) that take part in reduction, so their buckets could not be reduced and "
        f"that iteration's gradients were not synchronised: {advice}."
    )


def graph_changed_error(name: str, first_count: int) -> RuntimeError:
    """Under ``static_graph``, parameter ``name`` received more gradients than in the first iteration
    (``first_count``); torch's sentence first, so torch's tests' patterns match."""
    return RuntimeError(
        "Your training graph has changed in this iteration, e.g., one parameter is unused in first iteration, "
        "but then got used in the second iteration. this is not compatible with static_graph set to True. "
        f"gradcomm.DistributedDataParallel(static_graph=True): parameter {name} received more gradients in this "
        f"backward than in the first iteration ({first_count}); construct the DDP without static_graph if the "
        "set of used parameters changes between iterations."
    )


def not_finalized_error(unready: list[str]) -> RuntimeError:
    """torch's ``_check_reducer_finalized`` found the last synchronised backward unfinished: no gradient
    arrived for the parameters ``unready``, so their buckets were never reduced."""
    return RuntimeError(
        "gradcomm.DistributedDataParallel: the last backward did not finish reducing: no gradient "
        f"arrived for {', '.join(unready[:10])}. Pass find_unused_parameters=True if they are unused on "
        "purpose."
    )


def static_graph_too_late_error(steps: int) -> RuntimeError:
    """``_set_static_graph()`` after ``steps`` synchronised iterations (or during the first); torch's
    sentence first."""
    return RuntimeError(
        "set_static_graph() should be called before training loop starts and after "
        "DistributedDataParallel is constructed. "
        "gradcomm.DistributedDataParallel._set_static_graph() must be called before the first "
        f"synchronised iteration ({steps} already ran); pass static_graph=True to the "
        "constructor instead"
    )


def registering_too_late(steps: int, hook_name: str) -> str:
    """When ``register_comm_hook`` must be called, since ``steps`` steps already ran with ``hook_name``."""
    return (
        "before the first backward, and before the first synchronised forward (where the ranks compare "
        f"their setup); {steps} synchronised backward pass(es) already ran with {hook_name}"
    )
