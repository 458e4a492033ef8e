"""Per-segment statistics of a segmented bucket built on :func:`~gradcomm.compression.segments.segment_reduce`:
mean magnitudes without overflow, root mean squares and standard deviations, one per tensor, in a number of
calls that does not grow with the tensors (the scales of the sign and ternary methods).
"""

from __future__ import annotations

import torch

from gradcomm.compression._numerics import nonzero_or_one
from gradcomm.compression._numerics.reductions import _plain_is_exact
from gradcomm.compression.segments import Segments, segment_reduce

__all__ = ["segment_mean_abs", "segment_rms", "segment_std"]


def _expanded(per_segment: torch.Tensor, segments: Segments) -> torch.Tensor:
    return segments.expand(per_segment.reshape(-1))


def segment_mean_abs(x: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Each segment's mean magnitude without overflow, as ``safe_mean_abs`` for one tensor: on the CPU the
    plain means first (kept unless one overflowed or came near underflow), else means of magnitudes divided
    by their segment's peak."""
    magnitude = x.abs()
    if x.device.type == "cpu":
        mean = segment_reduce(magnitude, "mean", segments)
        if _plain_is_exact(mean):
            return mean
    peak = segment_reduce(magnitude, "max", segments)
    return peak * segment_reduce(magnitude.div_(_expanded(nonzero_or_one(peak), segments)), "mean", segments)


def segment_rms(x: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Each segment's root mean square without overflow or underflow, as ``safe_rms`` for one tensor."""
    if x.device.type == "cpu":
        mean_square = segment_reduce(torch.mul(x, x), "mean", segments)
        if _plain_is_exact(mean_square):
            return mean_square.sqrt_()
    magnitude = x.abs()
    peak = segment_reduce(magnitude, "max", segments)
    scaled = magnitude.div_(_expanded(nonzero_or_one(peak), segments))
    return peak * segment_reduce(scaled.mul_(scaled), "mean", segments).sqrt()


def segment_std(x: torch.Tensor, segments: Segments, peak: torch.Tensor) -> torch.Tensor:
    """Each segment's population standard deviation without overflow, as ``safe_std`` (``peak``: each
    segment's largest magnitude)."""
    groups = segments.groups
    scaled = groups.rowwise_into(
        lambda target, rows, p: torch.div(rows, p, out=target), [x], [nonzero_or_one(peak)], torch.empty_like(x)
    )
    mean = segment_reduce(scaled, "mean", segments)
    centred = groups.rowwise_into(
        lambda target, rows, m: torch.sub(rows, m, out=target).square_(), [scaled], [mean], scaled
    )
    return peak * segment_reduce(centred, "mean", segments).sqrt()
