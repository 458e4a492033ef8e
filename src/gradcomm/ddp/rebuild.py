"""The buckets' one-time rebuild in gradient-ready order, as torch's DDP does it, and the layout it saves.

The buckets start as torch's first-iteration layout (:func:`~gradcomm.ddp.bucketing.initial_buckets`). During
the first synchronised iteration the reducer records the order in which gradients become ready; after it the
buckets are rebuilt once from that order (rank 0's, broadcast, so every rank builds the same buckets) at the
next synchronised forward. With ``find_unused_parameters`` (and no static graph) nothing is recorded or
rebuilt, as in torch: the ready order then varies between iterations. A layout can also be taken over
instead: a checkpoint's (:meth:`~gradcomm.ddp.reducer.Reducer.load_bucket_layout`) or the one a resumed hook
state was made in (:meth:`BucketRebuild.hook_state_order`); either settles the rebuild.

:class:`BucketRebuild` is that state machine in one object: what is recorded, when the rebuild is due, which
parameter groups an order makes, and :meth:`BucketRebuild.bucket_layout`, the plain values a checkpoint
saves. Building the buckets themselves stays with the reducer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm.comm.collectives import collective_device
from gradcomm.ddp.bucketing import assign_buckets, initial_buckets

__all__ = ["BucketRebuild", "broadcast_order"]

logger = logging.getLogger(__name__)


class BucketRebuild:
    """The bucket layout's history: built from which order, recording the ready order, a rebuild due.

    Args:
        params: the reducer's parameters, in its order.
        limits: ``(first bucket limit, limit of the others)`` in bytes.
        bucket_caps: torch's ``bucket_cap_mb_list`` in bytes, or ``None``.
        sparse: per parameter, whether it has a bucket of its own (a sparse gradient), or ``None``.
        find_unused_parameters, static_graph: the DDP's options, which decide whether a rebuild happens.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        limits: tuple[int, int],
        bucket_caps: list[int] | None,
        sparse: list[bool] | None,
        find_unused_parameters: bool,
        static_graph: bool,
    ) -> None:
        self._params = params
        self._first_limit, self._limit = limits
        self._bucket_caps = bucket_caps
        self._sparse = sparse
        self._one_per_kind = static_graph or not find_unused_parameters
        # the ready order of the first synchronised iteration, while it is being recorded; None once the
        # rebuild is decided (or never happens: torch does not rebuild with find_unused_parameters alone)
        self.ready_order: list[int] | None = [] if self._one_per_kind else None
        self.due: list[int] | None = None  # the order to rebuild from at the next synchronised forward
        self.has_rebuilt = False
        self.layout_order: list[int] = []  # the parameter order the current buckets were built from

    @property
    def recording(self) -> bool:
        return self.ready_order is not None

    def initial_groups(self) -> list[list[int]]:
        """The first iteration's buckets (each bucket's parameter indices, in bucket order)."""
        return initial_buckets(
            self._params,
            self._first_limit,
            self._limit,
            one_per_kind=self._one_per_kind,
            limits=self._bucket_caps,
            alone=self._sparse,
        )

    def groups(self, order: list[int]) -> list[list[int]]:
        """The buckets torch's DDP builds from the parameter ``order`` (a ready order)."""
        return assign_buckets(
            self._params, order, self._first_limit, self._limit, limits=self._bucket_caps, alone=self._sparse
        )

    def built(self, groups: list[list[int]], rebuilt: bool) -> None:
        """The buckets were (re)built as ``groups``."""
        self.layout_order = [index for group in groups for index in group]
        self.has_rebuilt = self.has_rebuilt or rebuilt

    def restart_recording(self) -> list[int]:
        """The order recorded so far, recording anew (a static graph's first iteration marks its parameters
        at the end of backward, in that order, which records them again)."""
        order = self.ready_order
        if order is None:
            return []
        self.ready_order = []
        return order

    def step_done(self, ready_order_known: bool) -> None:
        """A synchronised step completed: the first one decides the rebuild. ``ready_order_known`` is false
        on a joined rank, which has no ready order: it rebuilds with the others from theirs (the order is
        broadcast), so its own current layout order only stands in."""
        if self.ready_order is not None:
            self.due = self.ready_order if ready_order_known else list(self.layout_order)
            self.ready_order = None

    def take_due(self) -> list[int] | None:
        """The order to rebuild from now, if a rebuild is due (it is then no longer due)."""
        due, self.due = self.due, None
        return due

    def settle(self) -> None:
        """The buckets were taken over from elsewhere (a checkpoint, the hook state): no rebuild any more."""
        self.ready_order = None
        self.due = None

    def expect(self) -> None:
        """The graph was declared static before the first iteration: record the ready order and rebuild."""
        if self.ready_order is None:
            self.ready_order = []

    def hook_state_order(self, layout: Any, names: list[str]) -> list[int] | None:
        """The parameter order from which this DDP's own rebuild would make the buckets a hook state's
        ``bucket_layout`` (each bucket's parameter names) describes; ``None`` when there is no rebuild to
        anticipate, or when the layout is of other parameters or not what this DDP would build (another
        ``bucket_cap_mb``): the state is keyed by parameter and resumes in any layout."""
        if not layout or not self.recording:  # find_unused_parameters: the initial layout is kept
            return None
        index = {name: i for i, name in enumerate(names)}
        if not all(isinstance(key, str) and key in index for keys in layout for key in keys):
            return None
        groups = [[index[key] for key in keys] for keys in layout]
        order = [i for group in groups for i in group]
        if sorted(order) != list(range(len(self._params))):
            return None
        if self.groups(order) != groups:
            logger.debug("the hook state's bucket layout is not what this DDP would build; keeping its own")
            return None
        return order

    def bucket_layout(self, names: list[str]) -> dict[str, Any]:
        """The bucket layout as plain values, for checkpoints: the parameter order the buckets are (or, after
        a pending rebuild, will be) built from, and whether the one-time rebuild has happened."""
        order = self.due if self.due is not None else self.layout_order
        # with find_unused_parameters nothing is ever rebuilt: the initial layout follows from the model alone
        rebuilt = not self.recording and (self.has_rebuilt or self.due is not None)
        return {"order": list(order), "rebuilt": rebuilt, "names": list(names)}


def broadcast_order(order: list[int], group: ProcessGroup | None, source_rank: int) -> list[int]:
    """Group rank ``source_rank``'s ``order``, on every rank (a collective), so that all build the same buckets."""
    tensor = torch.tensor(order, dtype=torch.int64, device=collective_device(group))
    src = dist.get_global_rank(group or dist.group.WORLD, source_rank)
    dist.broadcast(tensor, src=src, group=group)
    return tensor.tolist()
