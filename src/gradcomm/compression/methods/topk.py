"""Top-k sparsification: send the k largest-magnitude coordinates as values and indices.

Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017; Lin et al., "Deep
Gradient Compression", ICLR 2018 (DGC). Default ``ratio=0.01`` (1% of each tensor), the density of Aji &
Heafield's experiments and of DGC's final warm-up stage.

Trade-offs: biased, so error feedback is on by default (DGC's local gradient accumulation; without it the
dropped 99% is lost). Coordinates differ between ranks, so payloads cannot be summed: they are all-gathered,
``world_size * k`` values and indices received per tensor, and the aggregate densifies as ranks disagree.
Payload: k values in the gradient's dtype plus k int32 indices (int64 beyond 2**31 elements). The selection
is exact (:func:`~gradcomm.compression._numerics.top_magnitudes`): on the CPU, DGC's sampled threshold only
narrows the candidates for a ``topk`` of a few times k elements, so k never varies with the values. DGC's momentum correction, clipping and warm-up belong to the optimizer and are left out.
"""

from __future__ import annotations

import math

import torch

from gradcomm.compression._numerics import add_in_rank_order, dense_rows, index_dtype, zeros_in
from gradcomm.compression.base import ErrorFeedback, Payload, SegmentedCompressor
from gradcomm.compression.communicators import ALLGATHER
from gradcomm.compression.segment_sparse import Budget, segment_topk
from gradcomm.compression.segments import Segments, as_dtype

__all__ = ["TopK"]


class SparseSegments(SegmentedCompressor):
    """A method sending ``k(numel)`` values of each tensor with their indices within it (top-k, DGC): the
    payload of a bucket is every tensor's values, back to back, then every tensor's indices."""

    world_decoding = True

    def k(self, numel: int) -> int:
        raise NotImplementedError

    def budget(self, segments: Segments) -> Budget:
        return segments.budget([self.k(n) for n in segments.lengths])

    def payload_layout(self, lengths: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        total = sum(self.k(n) for n in lengths)
        return [(total, dtype), (total, index_dtype(max(lengths)))]

    def payload(self, flat: torch.Tensor, indices: torch.Tensor, segments: Segments) -> Payload:
        """The values of ``flat`` at ``indices`` (into ``flat``), and the indices within their tensors."""
        budget = self.budget(segments)
        local = torch.sub(indices, budget.starts)
        dtype = index_dtype(max(segments.lengths))
        if dtype != local.dtype:  # an empty tensor and copy_: two calls, where ``to`` is four
            local = torch.empty(local.shape, dtype=dtype, device=local.device).copy_(local)
        return [flat.index_select(0, indices), local]

    def _indices(self, local: torch.Tensor, segments: Segments) -> torch.Tensor:
        """Indices into the flat tensor of a payload's ``local`` ones, in their dtype (int32 or int64:
        ``index_put_`` and ``index_add_`` take either)."""
        return torch.add(local, self.budget(segments).starts_as(local.dtype))

    def decompress_segments(
        self, payload: Payload, ctx: torch.Tensor, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        values, local = payload
        if values.dim() == 2:  # every rank's payload: (world, numel)
            return dense_rows(self._indices(local, segments), as_dtype(values, segments.dtype), segments.numel)
        dense = zeros_in(out, segments.numel, segments.dtype, values.device)
        return dense.index_put_((self._indices(local, segments),), as_dtype(values, segments.dtype))

    def aggregate_segments(
        self, gathered: Payload, ctx: torch.Tensor, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The mean over ranks, summed in rank order (indices are distinct within a rank: deterministic), by
        :func:`add_in_rank_order`."""
        values, local = gathered
        world_size = values.shape[0]
        total = zeros_in(out, segments.numel, segments.dtype, values.device)
        indices = self._indices(local, segments)
        values = as_dtype(values, segments.dtype)
        if world_size > 1:
            values = values.div(world_size)
        return add_in_rank_order(total, indices, values)

    def residual_segments(
        self, corrected: torch.Tensor, payload: Payload, ctx: torch.Tensor, segments: Segments
    ) -> torch.Tensor:
        """``corrected`` with its sent coordinates zeroed in place: ``corrected - decompress(payload)`` for
        finite values (a sent infinity or NaN leaves 0, where the subtraction leaves NaN)."""
        return corrected.index_fill_(0, ctx, 0)


class TopK(SparseSegments, name="topk", summary="top-k sparsification, error feedback"):
    """Keep the ``ceil(ratio * numel)`` (at least one) largest-magnitude coordinates of each tensor."""

    communicator = ALLGATHER
    error_feedback = ErrorFeedback.RECOMMENDED

    def __init__(self, ratio: float = 0.01):
        if not 0 < ratio <= 1:
            raise ValueError(f"TopK: ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio

    def k(self, numel: int) -> int:
        """Number of coordinates kept of a tensor of ``numel`` elements."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def compress_segments(self, flat: torch.Tensor, segments: Segments) -> tuple[Payload, torch.Tensor]:
        indices = segment_topk(flat, self.budget(segments))
        return self.payload(flat, indices, segments), indices
