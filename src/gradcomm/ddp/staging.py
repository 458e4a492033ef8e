"""Writing gradients into their bucket a run of neighbours at a time.

Each gradient is copied into its bucket view and, with the default reduction, multiplied by ``1 / world_size``
(torch's pre-division). The fixed cost of a torch call from Python dominates for small tensors, and a model
of 1600 parameter tensors pays it for each of them every step (figures in
``docs/notes/2026-11-27-figures-from-docstrings.md``). So small gradients are *staged*: kept
until a run of neighbouring views (adjacent positions in the bucket, as they arrive once the buckets follow
the gradients' ready order) reaches :data:`RUN_BYTES`, then copied with one ``_foreach_copy_`` and scaled with
one ``mul_`` over the run's stretch of the buffer, while the gradients are still in cache. Every element is
multiplied exactly once by the same factor, so the floats are those of multiplying each gradient into its
view. A gradient of :data:`RUN_BYTES` or more is written at once, in one pass.

Only on the CPU. On an accelerator a gradient is written at once, in its hook, on the stream autograd
produced it on: a run written later, from another gradient's hook, could be on another stream (a model that
runs part of its forward on a side stream) and read a gradient not yet computed.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gradcomm.ddp.bucketing import Bucket

__all__ = ["RUN_BYTES", "StagedWrites"]

RUN_BYTES = 256 * 1024
"""A run is written once it holds this many bytes (about a core's L2 share, so the second pass over the run,
the scaling, finds it in cache); a gradient this large is written on its own."""


class StagedWrites:
    """The run of one bucket's gradients not yet written into its buffer."""

    __slots__ = ("_bucket", "_first", "_immediate", "_last", "_nbytes", "_sources", "_targets")

    def __init__(self, bucket: Bucket) -> None:
        # weak: the bucket holds this object, and a cycle would keep both (and the DDP's process group) alive
        # until the cyclic collector runs
        self._bucket = weakref.ref(bucket)
        self._immediate = bucket.params[0].device.type != "cpu"  # no runs: see the module's docstring
        self.discard()

    def discard(self) -> None:
        """Forget the staged run (a backward that was abandoned)."""
        self._sources: list[torch.Tensor] = []
        self._targets: list[torch.Tensor] = []
        self._first = self._last = -1  # the run's positions in the bucket; -1: no run
        self._nbytes = 0

    def put(self, position: int, grad: torch.Tensor | None, scale: float | None) -> None:
        """Write ``grad`` times ``scale`` (if given) into the view at ``position``, now or with its run;
        ``grad`` ``None``: the view already holds the gradient (accumulated in place, or zeroed)."""
        bucket = self._bucket()
        assert bucket is not None
        nbytes = bucket.nbytes[position]
        if nbytes >= RUN_BYTES or self._immediate:
            self.flush(scale)
            view = bucket.views[position]
            if scale is not None:
                torch.mul(view if grad is None else grad, scale, out=view)
            elif grad is not None:
                view.copy_(grad)
            return
        if self._first < 0:
            self._first = self._last = position
        elif position == self._last + 1:
            self._last = position
        elif position == self._first - 1:
            self._first = position
        else:  # not a neighbour of the run: write the run, start another
            self.flush(scale)
            self._first = self._last = position
        if grad is not None:
            self._sources.append(grad)
            self._targets.append(bucket.views[position])
        self._nbytes += nbytes
        if self._nbytes >= RUN_BYTES:
            self.flush(scale)

    def flush(self, scale: float | None) -> None:
        """Write the staged run: one copy call for its gradients, one multiplication over its stretch."""
        if self._first < 0:
            return
        if self._sources:
            torch._foreach_copy_(self._targets, self._sources)
        if scale is not None:
            bucket = self._bucket()
            assert bucket is not None
            start = bucket.offsets[self._first]
            end = bucket.offsets[self._last] + bucket.lengths[self._last]
            bucket.buffer[start:end].mul_(scale)
        self.discard()
