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

from gradcomm.compression._numerics import index_dtype, sparse_mean, sparse_to_dense, top_magnitudes, zero_at
from gradcomm.compression.base import Compressor, ErrorFeedback, Payload, TensorSpec
from gradcomm.compression.communicators import ALLGATHER

__all__ = ["TopK"]


class TopK(Compressor, name="topk", summary="top-k sparsification, error feedback"):
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

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, TensorSpec]:
        flat = tensor.reshape(-1)
        indices = top_magnitudes(flat, self.k(flat.numel()))
        indices_dtype = index_dtype(flat.numel())
        return [flat[indices], indices.to(indices_dtype)], TensorSpec.of(tensor)

    def decompress(self, payload: Payload, ctx: TensorSpec) -> torch.Tensor:
        values, indices = payload
        return sparse_to_dense(values, indices, ctx.numel, ctx.dtype).view(ctx.shape)

    def residual(self, corrected: torch.Tensor, payload: Payload, ctx: TensorSpec) -> torch.Tensor:
        """``corrected`` with its sent coordinates zeroed in place: ``corrected - decompress(payload)`` for
        finite values (a sent infinity or NaN leaves 0, where the subtraction leaves NaN)."""
        return zero_at(corrected, payload[1])

    def aggregate(self, gathered: Payload, ctx: TensorSpec, out: torch.Tensor | None = None) -> torch.Tensor:
        values, indices = gathered
        return sparse_mean(values, indices, ctx.numel, ctx.dtype, out).view(ctx.shape)
