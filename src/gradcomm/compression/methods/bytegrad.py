"""8-bit min-max quantization exchanged by a scatter-reduce and an all-gather, as Bagua's ByteGrad.

Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022 (ByteGrad and its
``MinMaxUInt8`` compressor). Each tensor is split into one chunk per rank; each chunk is quantized to 8 bits
between its own minimum and maximum. Rank ``j`` receives everyone's chunk ``j``, dequantizes and averages
them in full precision (so no sum is ever held in 8 bits: nothing overflows), quantizes the mean again and
all-gathers it (:class:`~gradcomm.compression.two_stage.TwoStageAllreduce`).

Trade-offs: about 4x less traffic than float32 (plus two scalars per chunk), and, unlike all-gather methods,
traffic per rank that does not grow with the world size. Round-to-nearest is deterministic and biased, with
error at most half a quantization step ``(max - min) / 255`` per stage; one outlier widens the range of its
whole chunk. Bagua uses no error feedback, so it is off by default; switching it on adds a residual for the
first stage (the second stage's error is not fed back).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from gradcomm.compression._numerics import as_uint8, decode_bits, work_dtype
from gradcomm.compression.base import ErrorFeedback, Payload, SegmentedRowwiseCompressor
from gradcomm.compression.segment_bits import decode_segments
from gradcomm.compression.segment_stats import Matrix, constant, holding
from gradcomm.compression.segments import Segments, as_dtype, segment_reduce
from gradcomm.compression.two_stage import TwoStageAllreduce
from gradcomm.compression.wire import payload_slot

__all__ = ["ByteGrad"]

_LEVELS = 255


class ByteGrad(
    SegmentedRowwiseCompressor, name="bytegrad", summary="8-bit min-max quantization, all-to-all then all-gather"
):
    """Round-to-nearest 8-bit quantization between each row's (segment's) minimum and maximum."""

    communicator = TwoStageAllreduce(server_error_feedback=False)
    error_feedback = ErrorFeedback.OPTIONAL

    def payload_layout(self, lengths: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(sum(lengths), torch.uint8), (len(lengths), work_dtype(dtype)), (len(lengths), work_dtype(dtype))]

    @holding
    def compress_segments(self, flat: torch.Tensor, segments: Segments) -> tuple[Payload, None]:
        work = as_dtype(flat, work_dtype(flat.dtype))
        matrix = Matrix.of(segments)
        if matrix is None:
            return self._compress_runs(work, segments)
        rows = matrix.view(work.contiguous())
        # each segment's minimum and maximum as (segments, 1) columns, a column per row of the matrix apiece,
        # computed into the wire's slots where the hook has them (payload_slot)
        column = (len(segments), 1)
        slots = [payload_slot(1, column, work.dtype), payload_slot(2, column, work.dtype)]
        low = matrix.extreme(rows, "min", None if slots[0] is None else slots[0].view)
        high = matrix.extreme(rows, "max", None if slots[1] is None else slots[1].view)
        scale, low_scaled, steps_per_unit = _steps(low, high)
        columns = [matrix.column(low_scaled, "low"), matrix.column(steps_per_unit, "steps")]
        positions = _positions_of(rows, None if scale is None else matrix.column(scale, "scale"), *columns)
        # truncated through int16 (a float-to-uint8 conversion is slower on the CPU)
        truncated = torch.empty(rows.shape, dtype=torch.int16, device=rows.device).copy_(positions)
        code_slot = payload_slot(0, tuple(rows.shape), torch.uint8)
        if code_slot is None:
            codes = torch.empty(rows.numel(), dtype=torch.uint8, device=rows.device).copy_(truncated.view(-1))
        else:
            codes = code_slot.flat
            code_slot.view.copy_(truncated)
        flats = [low.view(-1) if slot is None else slot.flat for low, slot in zip((low, high), slots, strict=True)]
        return [codes, *flats], None

    @staticmethod
    def _compress_runs(work: torch.Tensor, segments: Segments) -> tuple[Payload, None]:
        """:meth:`compress_segments` of segments without a :class:`Matrix`: run by run."""
        low, high = segment_reduce(work, "min", segments), segment_reduce(work, "max", segments)
        scale, low_scaled, steps_per_unit = _steps(low, high)
        per_segment = [low_scaled, steps_per_unit] if scale is None else [scale, low_scaled, steps_per_unit]
        codes = segments.groups.rowwise(
            _codes if scale is not None else lambda rows, low, steps: _codes(rows, None, low, steps),
            [work],
            per_segment,
            torch.empty(work.shape, dtype=torch.uint8, device=work.device),
        )
        return [codes, low, high], None

    @holding
    def decompress_segments(
        self, payload: Payload, ctx: Any, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        codes, low, high = payload
        position, complement = _positions(low.dtype, low.device)
        # a convex combination (it cannot overflow) of each segment's 256 code values, then one lookup per code
        values = torch.mul(low.view(-1, 1), complement).add_(torch.mul(high.view(-1, 1), position))
        values = as_dtype(values, segments.dtype)
        groups = segments.groups
        if Matrix.of(segments) is not None or len(groups.runs) > 16:
            return decode_segments(codes, segments, 8, values, out)
        usable = out is not None and out.is_contiguous() and out.numel() == segments.numel and out.dtype == values.dtype
        out = out.view(-1) if usable else torch.empty(segments.numel, dtype=segments.dtype, device=codes.device)
        tables = groups.per_run(values)
        for rows_out, rows, table in zip(groups.rows(out), groups.rows(codes), tables, strict=True):
            rows_out.copy_(decode_bits(rows, 8, rows.shape[1], table))
        return out


def _steps(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Per segment: the power of two it is scaled by, its minimum scaled, and code steps per unit of the scaled
    segment. Each segment is scaled by a power of two (exactly) where its range would not do: halved where the
    range overflows (max - min beyond the dtype's largest value, or NaN), times 2**64 where it is so small
    (subnormal, zero) that 255 / range would overflow. The codes of the scaled segment are the segment's.
    On the CPU, where every range is fine (checked on the host), no scale at all (``None``): the same codes."""
    dtype, device = low.dtype, low.device
    span = torch.sub(high, low)
    levels = constant(float(_LEVELS), dtype, device)
    small_span, large_span = constant(2.0**-60, dtype, device), constant(torch.finfo(dtype).max, dtype, device)
    if device.type == "cpu" and torch.equal(torch.clamp(span, min=small_span, max=large_span), span):
        return None, low, torch.reciprocal(span).mul_(levels)  # 255 / span, as torch divides a number
    small = torch.where(torch.lt(span, small_span), constant(2.0**64, dtype, device), constant(1.0, dtype, device))
    scale = torch.where(torch.le(span, large_span), small, constant(0.5, dtype, device))
    low_scaled = torch.mul(low, scale)
    span = torch.mul(high, scale).sub_(low_scaled)
    per_unit = torch.reciprocal(span).mul_(levels)  # a constant segment: all code 0
    zero = constant(0.0, dtype, device)
    return scale, low_scaled, torch.where(torch.gt(span, zero), per_unit, zero)


def _codes(
    rows: torch.Tensor, scale: torch.Tensor | None, low_scaled: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """The codes: :func:`_positions_of` truncated by the integer conversion."""
    return as_uint8(_positions_of(rows, scale, low_scaled, steps))


def _positions_of(
    rows: torch.Tensor, scale: torch.Tensor | None, low_scaled: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """The position (x - low) / (high - low) times 255, plus 1/2: the code rounded half up once truncated.
    x - low is in [0, high - low] (rounding is monotonic), so the code is in [0, 255] (the product passes 255
    by an ulp or two at most)."""
    half = constant(0.5, rows.dtype, rows.device)
    shifted = torch.sub(rows, low_scaled) if scale is None else torch.mul(rows, scale).sub_(low_scaled)
    return shifted.mul_(steps).add_(half)


@functools.lru_cache(maxsize=16)
def _positions(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Code ``c``'s place between a row's minimum and maximum, ``c / 255``, and ``1 -`` that. Made once per dtype
    and device and shared: read them, never write them."""
    position = torch.arange(_LEVELS + 1, dtype=dtype, device=device) / _LEVELS
    return position, 1 - position
