"""Random-k sparsification with coordinates drawn from a seed shared by all ranks.

Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (random-k with error feedback);
Wangni et al., "Gradient Sparsification for Communication-Efficient Distributed Optimization", NeurIPS 2018
(unbiased rescaled sparsification). Default ``ratio=0.01``.

Every rank draws the same k coordinates (same seed and parameter key, see
:class:`~gradcomm.compression.base.RandomizedCompressor`), so the payload is just k values and is summed by
allreduce: traffic does not grow with the world size and no indices are sent, unlike top-k. The price is
quality: random coordinates carry far less of the gradient's energy than the largest ones.

``unbiased=True`` (default) rescales by ``numel / k`` so that the decompressed tensor's expectation is the
input; its variance is ``(numel / k - 1) * x_i**2`` per coordinate, large at 1%, so use it where an
unbiased estimator matters. Where a rescaled value exceeds the dtype's range (half precision, or values near
the float32 maximum) it saturates at the largest finite value. ``unbiased=False`` sends the values unscaled
and is meant for error feedback (Stich et al.), on by default then: the residual keeps everything not sent.
"""

from __future__ import annotations

import math

import torch

from gradcomm.compression._numerics import random_subset, work_dtype, zero_at, zeros_in
from gradcomm.compression.base import ErrorFeedback, Payload, RandomizedCompressor, TensorSpec
from gradcomm.compression.communicators import ALLREDUCE

__all__ = ["RandomK"]


class RandomK(
    RandomizedCompressor, name="randomk", summary="random-k sparsification, shared coordinates (summable)"
):
    """Keep ``ceil(ratio * numel)`` coordinates chosen uniformly at random, the same on every rank."""

    communicator = ALLREDUCE
    shared_randomness = True

    def __init__(self, ratio: float = 0.01, unbiased: bool = True, seed: int = 0):
        if not 0 < ratio <= 1:
            raise ValueError(f"RandomK: ratio must be in (0, 1], got {ratio}")
        super().__init__(seed)
        self.ratio = ratio
        self.unbiased = unbiased

    @property
    def error_feedback(self) -> ErrorFeedback:  # type: ignore[override]
        return ErrorFeedback.OPTIONAL if self.unbiased else ErrorFeedback.RECOMMENDED

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, tuple[torch.Tensor, TensorSpec, float]]:
        flat = tensor.reshape(-1)
        numel = flat.numel()
        k = min(numel, max(1, math.ceil(self.ratio * numel)))
        indices = random_subset(numel, k, self.generator(flat.device), flat.device)
        scale = numel / k if self.unbiased else 1.0
        return [flat[indices]], (indices, TensorSpec.of(tensor), scale)

    def decompress(
        self, payload: Payload, ctx: tuple[torch.Tensor, TensorSpec, float], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        indices, spec, scale = ctx
        largest = torch.finfo(spec.dtype).max
        values = (payload[0].to(work_dtype(spec.dtype)) * scale).clamp_(-largest, largest).to(spec.dtype)
        dense = zeros_in(out, spec.numel, spec.dtype, values.device)
        return dense.index_copy_(0, indices, values).view(spec.shape)

    def residual(
        self, corrected: torch.Tensor, payload: Payload, ctx: tuple[torch.Tensor, TensorSpec, float]
    ) -> torch.Tensor:
        """Unscaled (``unbiased=False``): ``corrected`` with the sent coordinates zeroed in place, which is
        ``corrected - decompress(payload)`` for finite values; rescaled values take the dense formula."""
        indices, spec, scale = ctx
        if scale != 1.0:
            return super().residual(corrected, payload, ctx)
        return zero_at(corrected, indices)
