"""The reducer's buckets and their layout: where each parameter is, and the one-time rebuild in ready order.

The buckets start as torch's first-iteration layout (:func:`~gradcomm.ddp.bucketing.initial_buckets`). During
the first synchronised iteration the reducer records the order in which gradients become ready; after it the
buckets are rebuilt once from that order (rank 0's, broadcast, so every rank builds the same buckets) at the
next synchronised forward, as torch's DDP does. With ``find_unused_parameters`` (and no static graph) nothing
is recorded or rebuilt, as in torch: the ready order then varies between iterations. A layout can also be
taken over instead: a checkpoint's (:meth:`BucketLayout.loaded_order`) or the one a resumed hook state was
made in (:meth:`BucketLayout.hook_state_order`); either replaces the rebuild.

:class:`BucketLayout` is all of that in one object: the buckets, what is recorded, when the rebuild is due,
and :meth:`BucketLayout.bucket_layout`, the plain values a checkpoint saves. What happens in the buckets
during a step is the reducer's business.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm.comm.collectives import collective_device
from gradcomm.ddp.bucketing import Bucket, assign_buckets, initial_buckets
from gradcomm.ddp.sparse import SparseBucket

__all__ = ["BucketLayout", "broadcast_order"]

logger = logging.getLogger(__name__)


class BucketLayout:
    """The buckets, where each parameter is in them, the order they were built from, and their rebuild.

    Args:
        params: the reducer's parameters, in its order.
        limits: ``(first bucket limit, limit of the others)`` in bytes.
        bucket_caps: torch's ``bucket_cap_mb_list`` in bytes, or ``None``.
        sparse: per parameter, whether it has a bucket of its own (a sparse gradient), or ``None``.
        as_view: the DDP's ``gradient_as_bucket_view`` (``None``: views where safe, see
            :meth:`grads_as_views`).
        find_unused_parameters, static_graph: the DDP's options, which decide whether a rebuild happens.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        limits: tuple[int, int],
        bucket_caps: list[int] | None,
        sparse: list[bool] | None,
        as_view: bool | None,
        find_unused_parameters: bool,
        static_graph: bool,
    ) -> None:
        self._params = params
        self._first_limit, self._limit = limits
        self._bucket_caps = bucket_caps
        self._sparse = sparse
        self._as_view = as_view
        one_per_kind = static_graph or not find_unused_parameters
        # the ready order of the first synchronised iteration, while it is being recorded; None once the
        # rebuild is decided (or never happens: torch does not rebuild with find_unused_parameters alone)
        self.ready_order: list[int] | None = [] if one_per_kind else None
        self.due: list[int] | None = None  # the order to rebuild from at the next synchronised forward
        self.has_rebuilt = False
        self.buckets: list[Bucket | SparseBucket] = []
        # each parameter's bucket and position in it (not its view: see Bucket.seen_by_user)
        self.location: list[tuple[Any, int]] = []
        self._build(
            initial_buckets(
                params, self._first_limit, self._limit, one_per_kind=one_per_kind, limits=bucket_caps, alone=sparse
            )
        )

    @property
    def recording(self) -> bool:
        return self.ready_order is not None

    @property
    def order(self) -> list[int]:
        """The parameter order the current buckets were built from."""
        return [index for bucket in self.buckets for index in bucket.param_indices]

    def _groups(self, order: list[int]) -> list[list[int]]:
        """The buckets torch's DDP builds from the parameter ``order`` (a ready order)."""
        return assign_buckets(
            self._params, order, self._first_limit, self._limit, limits=self._bucket_caps, alone=self._sparse
        )

    def _build(self, groups: list[list[int]]) -> None:
        """Make the buckets: ``groups`` holds each bucket's parameter indices, in bucket order."""
        params, last = self._params, len(groups) - 1
        self.buckets = [
            SparseBucket(index, indices[0], params, index == last)
            if self._sparse and self._sparse[indices[0]]
            else Bucket(index, indices, params, index == last, self.grads_as_views(indices))
            for index, indices in enumerate(groups)
        ]
        self.location = [None] * len(params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for position, index in enumerate(bucket.param_indices):
                self.location[index] = (bucket, position)

    def grads_as_views(self, indices: list[int]) -> bool:
        """Whether these parameters' ``.grad`` become views of their bucket. By default (``None``) only for
        contiguous parameters, where that changes nothing a user sees; held ``.grad`` are protected by the
        reducer. (A transposed or channels-last parameter's view has its memory format too, see
        :func:`~gradcomm.ddp.bucketing.bucket_view`, but such buckets keep torch's copies.)"""
        if self._as_view is None:
            return all(self._params[i].is_contiguous() for i in indices)
        return self._as_view

    def rebuild(self, order: list[int]) -> None:
        """Rebuild the buckets from the parameter ``order``.

        With ``gradient_as_bucket_view=True`` the ``.grad`` move into the new buckets, as torch's; by default
        they stay where they are until their next gradient (a ``.grad`` held there must keep receiving the
        results).
        """
        old_grads = [p.grad for p in self._params] if self._as_view else []
        self._build(self._groups(order))
        self.has_rebuilt = True
        for index, grad in enumerate(old_grads):
            bucket, position = self.location[index]
            if grad is not None and bucket.grads_are_views:
                view = bucket.views[position]
                view.copy_(grad)
                self._params[index].grad = view
        if old_grads:
            self.handed_out()
        logger.debug("rebuilt %d buckets in gradient-ready order", len(self.buckets))

    def handed_out(self) -> None:
        """The buckets' views are now ``.grad``: each bucket records what refers to its memory (see
        :meth:`Bucket.seen_by_user`)."""
        for bucket in self.buckets:
            if bucket.grads_are_views:
                bucket.handed_out()

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
        broadcast), so its own current order only stands in."""
        if self.ready_order is not None:
            self.due = self.ready_order if ready_order_known else self.order
            self.ready_order = None

    def take_due(self) -> list[int] | None:
        """The order to rebuild from now, if a rebuild is due (it is then no longer due)."""
        due, self.due = self.due, None
        return due

    def adopt(self, order: list[int]) -> None:
        """Take over the buckets the ready order ``order`` gives (a checkpoint's, the hook state's): they
        replace the one-time rebuild."""
        self.rebuild(order)
        self.ready_order = None
        self.due = None

    def expect(self) -> None:
        """The graph was declared static before the first iteration: record the ready order and rebuild."""
        if self.ready_order is None:
            self.ready_order = []

    def hook_state_order(self, layout: Any, names: list[str]) -> list[int] | None:
        """The parameter order from which this DDP's own rebuild would make the buckets a hook state's
        ``bucket_layout`` (each bucket's parameter names) describes, to :meth:`adopt` before the first
        iteration; ``None`` when there is no rebuild to anticipate, or when the layout is of other parameters
        or not what this DDP would build (another ``bucket_cap_mb``).

        A state resumed through ``torch.save`` then reduces in its buckets from the first step, as after
        ``load_bucket_layout``; otherwise the first iteration would run in the initial layout, in which
        per-bucket state (batched PowerSGD's ``Q``) does not fit and sums round differently from three ranks
        on. A layout left alone does no harm: the state is keyed by parameter and resumes in any layout.
        """
        if not layout or not self.recording:  # find_unused_parameters: the initial layout is kept
            return None
        index = {name: i for i, name in enumerate(names)}
        if not all(isinstance(key, str) and key in index for keys in layout for key in keys):
            return None
        groups = [[index[key] for key in keys] for keys in layout]
        order = [i for group in groups for i in group]
        if sorted(order) != list(range(len(self._params))):
            return None
        if self._groups(order) != groups:
            logger.debug("the hook state's bucket layout is not what this DDP would build; keeping its own")
            return None
        return order

    def bucket_layout(self, names: list[str]) -> dict[str, Any]:
        """The bucket layout as plain values, for checkpoints: the parameter order the buckets are (or, after
        a pending rebuild, will be) built from, and whether the one-time rebuild has happened."""
        order = self.due if self.due is not None else self.order
        # with find_unused_parameters nothing is ever rebuilt: the initial layout follows from the model alone
        rebuilt = not self.recording and (self.has_rebuilt or self.due is not None)
        return {"order": list(order), "rebuilt": rebuilt, "names": list(names)}

    @staticmethod
    def loaded_order(layout: dict[str, Any], names: list[str]) -> list[int] | None:
        """The order to rebuild from for a saved :meth:`bucket_layout` (``None``: the initial layout, kept);
        raises ``ValueError`` if it was saved for other parameters."""
        if list(layout["names"]) != names:
            mismatch = next(
                (f"{a!r} here, {b!r} saved" for a, b in zip(names, layout["names"], strict=False) if a != b),
                f"{len(names)} parameters here, {len(layout['names'])} saved",
            )
            raise ValueError(
                "load_bucket_layout: the checkpoint's bucket layout is for other parameters "
                f"({mismatch}); load it into the model it was saved from"
            )
        return list(layout["order"]) if layout["rebuilt"] else None


def broadcast_order(order: list[int], group: ProcessGroup | None, source_rank: int) -> list[int]:
    """Group rank ``source_rank``'s ``order``, on every rank (a collective), so that all build the same buckets."""
    tensor = torch.tensor(order, dtype=torch.int64, device=collective_device(group))
    src = dist.get_global_rank(group or dist.group.WORLD, source_rank)
    dist.broadcast(tensor, src=src, group=group)
    return tensor.tolist()
