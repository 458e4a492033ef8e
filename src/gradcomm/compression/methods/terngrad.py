"""TernGrad: stochastic ternarization to ``{-s, 0, +s}`` with ``s`` the tensor's largest magnitude.

Wen, Xu, Yan, Wu, Wang, Chen & Li, "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
Learning", NeurIPS 2017. Per layer, ``s = max|g|`` and coordinate ``i`` becomes ``s * sign(g_i) * b_i`` with
``b_i ~ Bernoulli(|g_i| / s)``: unbiased. Default ``clip=2.5``: the paper's gradient clipping to
``2.5 * std(g)`` before ternarizing, which shrinks ``s`` and the variance at the price of a (small) bias;
``clip=None`` keeps the estimator exactly unbiased.

Trade-offs: 2 bits per coordinate plus one scale per tensor (16x smaller than float32). Variance per
coordinate is ``|g_i| * (s - |g_i|) <= s**2 / 4``: large when one outlier sets ``s``, which clipping
mitigates. The paper's scalar sharing (one ``s`` for all ranks, making ternaries summable) would cost an
extra collective; here each rank keeps its scale and payloads are all-gathered. Error feedback is off by
default. Random draws come from generators seeded by ``(seed, rank, parameter, draw count)``
(:class:`~gradcomm.compression.base.RandomizedCompressor`): independent across ranks and parameters, and
the same whatever order the tensors are compressed in. The noise has 16 bits
(:func:`~gradcomm.compression._numerics.add_rounding_noise_`), so ``b_i`` is unbiased up to ``2**-16``.
"""

from __future__ import annotations

from typing import Any

import torch

from gradcomm.compression._numerics import work_dtype
from gradcomm.compression.base import ErrorFeedback, Payload, RandomizedCompressor, SegmentedCompressor
from gradcomm.compression.communicators import ALLGATHER
from gradcomm.compression.segment_bits import byte_codes, decode_segments, pack_segments, packed_lengths
from gradcomm.compression.segment_noise import add_noise_, segment_noise
from gradcomm.compression.segment_stats import (
    Matrix,
    constant,
    holding,
    segment_absmax,
    segment_std,
    smallest_positive,
)
from gradcomm.compression.segments import Segments, as_dtype
from gradcomm.compression.wire import payload_slot

__all__ = ["TernGrad"]


class TernGrad(
    RandomizedCompressor, SegmentedCompressor, name="terngrad", summary="TernGrad ternary quantization"
):
    """Unbiased ternary gradients with one scale per tensor (optionally clipped first). Payload of a bucket:
    every tensor's 2-bit codes (packed as for that tensor alone), back to back, then one scale per tensor."""

    communicator = ALLGATHER
    world_decoding = True
    error_feedback = ErrorFeedback.OPTIONAL

    def __init__(self, clip: float | None = 2.5, seed: int = 0):
        if clip is not None and not clip > 0:
            raise ValueError(f"TernGrad: clip must be a number > 0 (standard deviations) or None, got {clip!r}")
        super().__init__(seed)
        self.clip = clip

    def payload_layout(self, lengths: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(sum(packed_lengths(lengths, 2)), torch.uint8), (len(lengths), work_dtype(dtype))]

    @holding
    def compress_segments(self, flat: torch.Tensor, segments: Segments) -> tuple[Payload, None]:
        work = as_dtype(flat, work_dtype(flat.dtype))
        dtype, device = work.dtype, work.device
        matrix = Matrix.of(segments)
        if matrix is not None:  # one view for the statistics and the fractions; (segments, 1) columns of them
            work = matrix.view(work.contiguous())
            scales = matrix.absmax(work)
        else:
            scales = segment_absmax(work, segments)
        slot = None
        if self.clip is not None:
            std = segment_std(work, segments, scales)
            # a constant tensor is not clipped; the scales computed into the wire's slot where there is one
            clipped = torch.minimum(torch.mul(std, constant(self.clip, dtype, device)), scales)
            slot = payload_slot(1, tuple(clipped.shape), dtype)
            chosen = clipped if slot is None else slot.view
            scales = torch.where(torch.gt(std, constant(0.0, dtype, device)), clipped, scales, out=chosen)
        # p = x / scale (a zero scale: all zeros, which any nonzero divisor keeps), clipped to +-1 (x to +-scale)
        divisors = torch.clamp_min(scales, constant(smallest_positive(dtype), dtype, device))
        fraction = _divided(work, divisors, segments, self.clip is not None)
        # codes 0, 1, 2 for -scale, 0, +scale: 1 + p rounded stochastically (for p >= 0, 1 with chance p, else
        # 0; for p < 0, -1 with chance |p|, else 0); noise uniform on [-1/2, 1/2), plus 1/2, then truncated
        noise = segment_noise(self.segment_seeds(segments), segments)
        positions = add_noise_(fraction, noise, 1.5)
        # truncated into int8 (a float-to-uint8 conversion is slower), packed as their bytes
        codes = torch.empty(positions.shape, dtype=torch.int8, device=work.device).copy_(positions)
        flat_scales = slot.flat if slot is not None else scales if scales.dim() == 1 else scales.view(-1)
        return [pack_segments(codes, segments, 2), flat_scales], None

    @holding
    def decompress_segments(
        self, payload: Payload, ctx: Any, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        packed, scales = payload
        # each byte's four codes' values times the scale: one multiplication for the table of every byte
        values = byte_codes((-1.0, 0.0, 1.0, 2.0), 2, scales.dtype, scales.device)
        tables = as_dtype(torch.mul(values, scales.view(-1, 1)), segments.dtype)
        return decode_segments(packed, segments, 2, tables, out, by_byte=True)


def _divided(work: torch.Tensor, divisors: torch.Tensor, segments: Segments, clip: bool) -> torch.Tensor:
    """``work / divisor`` of its segment (clipped to ``[-1, 1]``), flat, in a new tensor; ``work``: flat, or the
    segments' :class:`~gradcomm.compression.segment_stats.Matrix` view of it where they have one."""
    matrix = Matrix.of(segments)
    if matrix is not None:  # work is its view
        fraction = torch.div(work, matrix.column(divisors))
        if clip:  # a NaN kept as it is
            fraction.clamp_(constant(-1.0, fraction.dtype, fraction.device), constant(1.0, fraction.dtype, fraction.device))
        return fraction.view(-1)
    return segments.groups.rowwise_into(
        lambda target, rows, scale: torch.div(rows, scale, out=target).clamp_(-1, 1) if clip
        else torch.div(rows, scale, out=target),
        [work],
        [divisors],
        torch.empty_like(work),
    )
