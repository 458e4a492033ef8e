"""Random-k sparsification with coordinates drawn from a seed shared by all ranks.

Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (random-k with error feedback);
Wangni et al., "Gradient Sparsification for Communication-Efficient Distributed Optimization", NeurIPS 2018
(unbiased rescaled sparsification). Default ``ratio=0.01``.

Every rank draws the same k coordinates (same seed and parameter key, see
:class:`~gradcomm.compression.base.RandomizedCompressor`), so the payload is just k values and is summed by
allreduce. The draw is stratified: a tensor of ``n`` elements is cut into ``k`` consecutive strata
(``[j n // k, (j + 1) n // k)``) and one coordinate is drawn uniformly in each, so the k coordinates are
distinct without sorting or rejection, and a whole bucket draws at once (counter-based random words keyed by
tensor, :func:`~gradcomm.compression.segments.segment_words`). Each coordinate is sent with probability
``1 / size of its stratum`` (``k / n`` where ``k`` divides ``n``), and the mean square error of the unbiased
estimate is that of a uniform subset where it does: traffic does not grow with the world size and no indices are sent, unlike top-k. The price is
quality: random coordinates carry far less of the gradient's energy than the largest ones.

``unbiased=True`` (default) rescales by the stratum's size (``numel / k``) so that the decompressed tensor's expectation is the
input; its variance is ``(numel / k - 1) * x_i**2`` per coordinate, large at 1%, so use it where an
unbiased estimator matters. Where a rescaled value exceeds the dtype's range (half precision, or values near
the float32 maximum) it saturates at the largest finite value. ``unbiased=False`` sends the values unscaled
and is meant for error feedback (Stich et al.), on by default then: the residual keeps everything not sent.
"""

from __future__ import annotations

import math

import torch

from gradcomm.compression._numerics import work_dtype, zeros_in
from gradcomm.compression.base import ErrorFeedback, Payload, RandomizedCompressor, SegmentedCompressor
from gradcomm.compression.communicators import ALLREDUCE
from gradcomm.compression.segment_noise import segment_words
from gradcomm.compression.segment_sparse import Budget
from gradcomm.compression.segments import Segments, as_dtype

__all__ = ["RandomK"]


class RandomK(
    RandomizedCompressor,
    SegmentedCompressor,
    name="randomk",
    summary="random-k sparsification, shared coordinates (summable)",
):
    """Keep ``ceil(ratio * numel)`` coordinates chosen at random (one per stratum), the same on every rank."""

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

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def payload_layout(self, lengths: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(sum(self.k(n) for n in lengths), dtype)]

    def compress_segments(
        self, flat: torch.Tensor, segments: Segments
    ) -> tuple[Payload, tuple[torch.Tensor, torch.Tensor | None]]:
        budget = segments.budget([self.k(n) for n in segments.lengths])
        starts, sizes = _strata(budget)
        words = segment_words(self.segment_seeds(segments), budget.chosen)
        indices = (words >> 1).remainder_(sizes).add_(starts)  # uniform in each stratum (up to 2**-32)
        return [flat.index_select(0, indices)], (indices, sizes if self.unbiased else None)

    def decompress_segments(
        self,
        payload: Payload,
        ctx: tuple[torch.Tensor, torch.Tensor | None],
        segments: Segments,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        indices, sizes = ctx
        values = payload[0]
        if sizes is not None:
            largest = torch.finfo(segments.dtype).max
            scaled = (as_dtype(values, work_dtype(segments.dtype)) * sizes).clamp_(-largest, largest)
            values = as_dtype(scaled, segments.dtype)
        dense = zeros_in(out, segments.numel, segments.dtype, values.device)
        return dense.index_copy_(0, indices, as_dtype(values, segments.dtype))

    def residual_segments(
        self,
        corrected: torch.Tensor,
        payload: Payload,
        ctx: tuple[torch.Tensor, torch.Tensor | None],
        segments: Segments,
    ) -> torch.Tensor:
        """Unscaled (``unbiased=False``): ``corrected`` with the sent coordinates zeroed in place, which is
        ``corrected - decompress(payload)`` for finite values; rescaled values take the dense formula."""
        indices, sizes = ctx
        if sizes is not None:
            return super().residual_segments(corrected, payload, ctx, segments)
        return corrected.index_fill_(0, indices, 0)


def _strata(budget: Budget) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chosen coordinate's stratum: its start in the flat tensor and its size (cached per layout)."""
    cached = budget.__dict__.get("_strata")
    if cached is None:
        chosen = budget.chosen
        j = chosen.positions
        n = chosen.expand(torch.tensor(budget.segments.lengths, dtype=torch.int64, device=j.device))
        k = chosen.expand(torch.tensor(budget.ks, dtype=torch.int64, device=j.device))
        low = (j * n).div_(k, rounding_mode="floor")
        high = ((j + 1) * n).div_(k, rounding_mode="floor")
        cached = budget.__dict__["_strata"] = (low + budget.starts, high - low)
    return cached
