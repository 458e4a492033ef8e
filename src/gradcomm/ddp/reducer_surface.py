"""What ``ddp.reducer`` is: torch's C++ ``Reducer`` surface, a thin facade over gradcomm's reducer.

torch's DDP keeps its C++ reducer in ``ddp.reducer``, and Lightning, Accelerate and torch's DDP methods call
it there (``prepare_for_backward``, ``_rebuild_buckets``, ``_delay_all_reduce``, ...). gradcomm's DDP puts a
:class:`ReducerSurface` there, which holds the :class:`~gradcomm.ddp.reducer.Reducer` and answers those calls,
and gradcomm's own introspection (bucket names and sizes, statistics, the bucket layout for checkpoints),
through the reducer's public methods and the parts it exposes (see :class:`~gradcomm.ddp.reducer.Reducer`). The DDP itself drives the reducer directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradcomm.comm.telemetry import CommStats
from gradcomm.hooks.contract import CommHook

if TYPE_CHECKING:
    from gradcomm.ddp.reducer import Reducer

__all__ = ["ReducerSurface"]


class ReducerSurface:
    """torch's C++ reducer's methods, and gradcomm's introspection, answered by ``reducer``."""

    def __init__(self, reducer: Reducer) -> None:
        self._reducer = reducer

    # -- torch's Reducer methods that frameworks call, and what torch's DDP methods need --------------------
    def prepare_for_backward(self, outputs: Any) -> None:
        """Arm the reducer for the backward of ``outputs`` (any nesting of tensors), as torch's: Lightning's
        manual optimization and Accelerate's ``trigger_sync_in_backward`` call it."""
        self._reducer.prepare_for_backward(outputs)

    def _rebuild_buckets(self) -> bool:
        """torch's ``Reducer._rebuild_buckets()``: do the one-time rebuild now if it is due; whether it ran.

        The DDP's forward does it anyway; Lightning calls it again before a manual backward. A collective when
        due (rank 0's ready order is broadcast), so every rank must call it.
        """
        return self._reducer.rebuild_if_due()

    def _delay_all_reduce(self) -> None:
        """torch's first-iteration flush of a static graph, which Lightning calls after a manual backward:
        reduce every bucket now if that backward has not done it already."""
        self._reducer.delay_all_reduce()

    def set_static_graph(self) -> None:
        """Treat the graph as static from now on; only before the first synchronised iteration, as in torch."""
        self._reducer.set_static_graph()

    def check_finalized(self) -> None:
        """Raise if the last synchronised backward left buckets unreduced (torch's ``_check_reducer_finalized``)."""
        self._reducer.check_finalized()

    def remove_hooks(self) -> None:
        """Remove the per-parameter gradient hooks (torch's ``_remove_autograd_hooks``)."""
        self._reducer.remove_hooks()

    def can_set_static_graph(self) -> bool:
        """Whether the iterations so far suggest ``static_graph=True`` would hold (see ``UsedParameters``)."""
        return self._reducer.synchronised_steps > 0 and self._reducer.static.consistent

    @property
    def has_rebuilt_buckets(self) -> bool:
        return self._reducer.layout.has_rebuilt

    # -- gradcomm's introspection ---------------------------------------------------------------------------
    @property
    def stats(self) -> CommStats:
        """This DDP's communication statistics (see :mod:`gradcomm.comm.telemetry`)."""
        return self._reducer.runner.stats

    @property
    def hook_name(self) -> str:
        return self._reducer.runner.name

    @property
    def synchronised_steps(self) -> int:
        """Synchronised steps completed (shadow steps of a joined rank included); the step numbers in errors
        count from 0, so step ``n`` is the one after ``n`` completed steps."""
        return self._reducer.synchronised_steps

    @property
    def bucket_count(self) -> int:
        return len(self._reducer.layout.buckets)

    def bucket_parameter_names(self) -> list[list[str]]:
        """The parameter names in each bucket, in bucket order."""
        names = self._reducer.names
        return [[names[i] for i in bucket.param_indices] for bucket in self._reducer.layout.buckets]

    def bucket_sizes_bytes(self) -> list[int]:
        """Each bucket's size in bytes (a sparse bucket: its parameter's dense size)."""
        return [sum(p.numel() * p.element_size() for p in bucket.params) for bucket in self._reducer.layout.buckets]

    def bucket_layout(self) -> dict[str, Any]:
        """The bucket layout as plain values, for checkpoints: the parameter order the buckets are (or, after
        a pending rebuild, will be) built from, and whether the one-time rebuild has happened."""
        return self._reducer.layout.bucket_layout(self._reducer.names)

    def load_bucket_layout(self, layout: dict[str, Any]) -> None:
        """Adopt a saved :meth:`bucket_layout`, so a resumed run reduces in the same buckets as the original."""
        self._reducer.load_bucket_layout(layout)

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Register ``hook`` (a collective; see ``DistributedDataParallel.register_comm_hook``)."""
        self._reducer.register_comm_hook(state, hook)

    def replicas_may_differ(self) -> bool:
        """Whether the registered hook leaves the replicas different on purpose at this point."""
        return self._reducer.runner.replicas_may_differ()

    def check_usable(self) -> None:
        """Raise if an earlier synchronised step failed on this rank: the ranks may be out of step."""
        self._reducer.check_usable()
