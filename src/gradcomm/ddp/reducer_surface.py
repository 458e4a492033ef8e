"""The reducer's surface: what the DDP, checkpoints and frameworks call on it, apart from the mechanism.

:class:`ReducerSurface` is a mixin of :class:`~gradcomm.ddp.reducer.Reducer`: statistics and bucket
introspection, hook registration, the bucket layout for checkpoints, and the methods of torch's C++
``Reducer`` that Lightning and Accelerate call (``_rebuild_buckets``, ``_delay_all_reduce``, ...) or that
torch's DDP methods need (``set_static_graph``, ``check_finalized``, ``can_set_static_graph``). The mechanism
(buckets, readiness, launching hooks, finalising) stays in :mod:`gradcomm.ddp.reducer`; the state used here
is the reducer's.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from gradcomm.comm.faults import reporting_lost_peers
from gradcomm.comm.telemetry import CommStats
from gradcomm.ddp.unused import StaticCounting, UsedParameters
from gradcomm.hooks.contract import CommHook

__all__ = ["ReducerSurface", "graph_changed_error", "marked_twice_error"]


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


class ReducerSurface:
    """Mixin of :class:`~gradcomm.ddp.reducer.Reducer`: its public and torch-facing methods."""

    @property
    def stats(self) -> CommStats:
        """This DDP's communication statistics (see :mod:`gradcomm.ddp.telemetry`)."""
        return self._runner.stats

    @property
    def bucket_count(self) -> int:
        return len(self._buckets)

    @property
    def synchronised_steps(self) -> int:
        """Synchronised steps completed (shadow steps of a joined rank included); the step numbers in errors
        count from 0, so step ``n`` is the one after ``n`` completed steps."""
        return self._synced_backwards

    def bucket_parameter_names(self) -> list[list[str]]:
        """The parameter names in each bucket, in bucket order."""
        return [[self._names[i] for i in bucket.param_indices] for bucket in self._buckets]

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Register ``hook``; a collective: every rank must register, and the same hook with the same options.

        The ranks compare the hook's qualified name, its state's plain options and the bucket layout in one
        ``all_gather_object`` and all raise :class:`~gradcomm.ddp.agreement.RanksDisagreeError` if they differ.
        """
        too_late = None
        if self._synced_backwards or self._armed and self._started or self._runner.setup_checked:
            too_late = (
                "before the first backward, and before the first synchronised forward (where the ranks compare "
                f"their setup); {self._synced_backwards} synchronised backward pass(es) already ran with "
                f"{self._runner.name}"
            )
        self._runner.register(state, hook, too_late, self._setup())

    def _setup(self) -> dict[str, str]:
        """What the ranks must agree on besides the hook: bucket layout and the DDP's settings."""
        sizes = [bucket.buffer.numel() for bucket in self._buckets]
        dtypes = sorted({str(bucket.buffer.dtype) for bucket in self._buckets})
        return {
            "bucket layout": f"{len(sizes)} bucket(s) of {sizes} elements ({', '.join(dtypes)})",
            "bucket_cap_mb": repr(self._bucket_cap_mb),
            "find_unused_parameters": repr(self._find_unused),
            "static_graph": repr(self._static.enabled),
            "bucket_cap_mb_list": repr(self._bucket_caps),
            **self._settings,
        }

    def bucket_layout(self) -> dict[str, Any]:
        """The bucket layout as plain values, for checkpoints: the parameter order the buckets are (or, after
        a pending rebuild, will be) built from, and whether the one-time rebuild has happened."""
        order = self._rebuild_order if self._rebuild_order is not None else self._layout_order
        # with find_unused_parameters nothing is ever rebuilt: the initial layout follows from the model alone
        rebuilt = self._rebuild_done and (self._has_rebuilt or self._rebuild_order is not None)
        return {"order": list(order), "rebuilt": rebuilt, "names": list(self._names)}

    def load_bucket_layout(self, layout: dict[str, Any]) -> None:
        """Adopt a saved :meth:`bucket_layout`, so a resumed run reduces in the same buckets as the original."""
        if self._armed and self._started:
            raise RuntimeError("load_bucket_layout: cannot change buckets during a backward pass")
        if list(layout["names"]) != self._names:
            mismatch = next(
                (f"{a!r} here, {b!r} saved" for a, b in zip(self._names, layout["names"], strict=False) if a != b),
                f"{len(self._names)} parameters here, {len(layout['names'])} saved",
            )
            raise ValueError(
                "load_bucket_layout: the checkpoint's bucket layout is for other parameters "
                f"({mismatch}); load it into the model it was saved from"
            )
        if layout["rebuilt"]:
            self._rebuild_in_order(list(layout["order"]), broadcast=False)
            self._rebuild_done, self._rebuild_order, self._ready_order = True, None, []

    def replicas_may_differ(self) -> bool:
        """Whether the registered hook leaves the replicas different on purpose at this point."""
        return self._runner.replicas_may_differ()

    def check_usable(self) -> None:
        """Raise if an earlier synchronised step failed on this rank: the ranks may be out of step."""
        self._runner.check_usable()

    def set_active_ranks(self, count: int | None) -> None:
        """Average the default reduction over ``count`` ranks (``None``: all), for ``join()`` with
        ``divide_by_initial_world_size=False``. A registered hook divides as it does itself."""
        self._grad_divisor = count or self._world_size  # sparse gradients are divided by it (as torch)
        # dense ones multiplied by its inverse, as a Python number: the kernel reads it as torch's reducer's
        # wrapped scalar, in the gradient's compute type (a 0-dim tensor would promote a 0-dim gradient)
        self._scale = 1.0 / self._grad_divisor

    # -- torch's Reducer methods that frameworks call, and what torch's DDP methods need --------------------
    def _rebuild_buckets(self) -> bool:
        """torch's ``Reducer._rebuild_buckets()``: do the one-time rebuild now if it is due; whether it ran.

        The DDP's forward does it anyway; Lightning calls it again before a manual backward. A collective when
        due (rank 0's ready order is broadcast), so every rank must call it.
        """
        if self._rebuild_order is None:
            return False
        with reporting_lost_peers(self._synced_backwards, "rebuilding buckets", self._group):
            self._rebuild_in_order(self._rebuild_order)
        self._rebuild_order = None
        return True

    def _delay_all_reduce(self) -> None:
        """torch's first-iteration flush of a static graph, which Lightning calls after a manual backward:
        reduce every bucket now if that backward has not done it already."""
        if self._armed and self._started and self._counting is StaticCounting.FIRST:
            self._end_of_backward()

    def set_static_graph(self) -> None:
        """Treat the graph as static from now on; only before the first synchronised iteration, as in torch."""
        if self._synced_backwards or self._armed and self._started:
            raise RuntimeError(
                "set_static_graph() should be called before training loop starts and after "
                "DistributedDataParallel is constructed. "
                "gradcomm.DistributedDataParallel._set_static_graph() must be called before the first "
                f"synchronised iteration ({self._synced_backwards} already ran); pass static_graph=True to the "
                "constructor instead"
            )
        self._static = UsedParameters(len(self._params), True)
        self._rebuild_done = False
        self._runner.setup_checked = False  # the ranks compare the new setting at the next synchronised forward

    @property
    def has_rebuilt_buckets(self) -> bool:
        return self._has_rebuilt

    @property
    def hook_name(self) -> str:
        return self._runner.name

    def bucket_sizes_bytes(self) -> list[int]:
        """Each bucket's size in bytes (a sparse bucket: its parameter's dense size)."""
        return [sum(p.numel() * p.element_size() for p in bucket.params) for bucket in self._buckets]

    def can_set_static_graph(self) -> bool:
        """Whether the iterations so far suggest ``static_graph=True`` would hold (see ``UsedParameters``)."""
        return self._synced_backwards > 0 and self._static.consistent

    def check_finalized(self) -> None:
        """Raise if the last synchronised backward left buckets unreduced (torch's ``_check_reducer_finalized``)."""
        if self._unfinished or (self._armed and self._started):
            unready = [self._names[i] for i in self._unfinished or self._unready()]
            raise RuntimeError(
                "gradcomm.DistributedDataParallel: the last backward did not finish reducing: no gradient "
                f"arrived for {', '.join(unready[:10])}. Pass find_unused_parameters=True if they are unused on "
                "purpose."
            )

    def remove_hooks(self) -> None:
        for handle in self._grad_hook_handles:
            handle.remove()
        self._grad_hook_handles, self._accumulators = [], []

