"""Error-compensated 1-bit compressed allreduce, as in DeepSpeed's 1-bit Adam.

Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed", ICML
2021 (Algorithm 1's compressed allreduce; Seide et al. 2014 for 1-bit SGD with error feedback). Each rank
adds its worker residual, splits the tensor into one chunk per rank and sends each chunk as signs with one
scale ``||chunk||_2 / sqrt(len(chunk))``. Rank ``j`` averages everyone's chunk ``j``, adds its server
residual, compresses the mean to signs and a scale again, keeps the new server residual and all-gathers the
result
(:class:`~gradcomm.compression.two_stage.TwoStageAllreduce` with ``server_error_feedback``).

Trade-offs: about 32x less traffic than float32 and traffic per rank that does not grow with the world size;
costs one gradient-sized worker residual plus a chunk-sized (``1/world_size``) server residual. Both error
feedbacks are required: without them signs alone do not converge. DeepSpeed scales the worker stage by one
norm per tensor; here each chunk has its own scale (``world_size`` scalars instead of one, a closer fit).
The paper applies this to Adam's momentum after a warm-up with uncompressed Adam; as a gradient hook it
compresses gradients, so any warm-up is the caller's (register the hook after it).
"""

from __future__ import annotations

from typing import Any

import torch

from gradcomm.compression._numerics import work_dtype
from gradcomm.compression.base import ErrorFeedback, OwnDecoding, Payload, SegmentedRowwiseCompressor
from gradcomm.compression.segment_bits import (
    decode_scaled_signs,
    encode_scaled_signs,
    scaled_signs_layout,
    unpack_scaled_signs,
)
from gradcomm.compression.segment_stats import holding, segment_rms
from gradcomm.compression.segments import Segments, as_dtype
from gradcomm.compression.two_stage import TwoStageAllreduce
from gradcomm.compression.wire import payload_slot

__all__ = ["OneBit"]


class OneBit(SegmentedRowwiseCompressor, name="onebit", summary="two-stage error-compensated 1-bit allreduce"):
    """Signs with one RMS scale per row (per chunk of a tensor: a segment)."""

    communicator = TwoStageAllreduce(server_error_feedback=True)
    error_feedback = ErrorFeedback.REQUIRED

    def payload_layout(self, lengths: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return scaled_signs_layout(lengths, dtype)

    @holding
    def compress_segments(self, flat: torch.Tensor, segments: Segments) -> tuple[Payload, OwnDecoding]:
        work = as_dtype(flat, work_dtype(flat.dtype))
        slot = payload_slot(1, (len(segments), 1), work.dtype)  # the scales computed into the wire's slot
        scales = segment_rms(work, segments, None if slot is None else slot.view)
        payload, state = encode_scaled_signs(flat, segments, slot.flat if slot is not None and scales is slot.view else scales)
        return payload, OwnDecoding(state)

    @holding
    def decompress_segments(
        self, payload: Payload, ctx: Any, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return unpack_scaled_signs(payload, segments, out)

    @holding
    def decompress_own(self, payload: Payload, ctx: OwnDecoding, segments: Segments) -> torch.Tensor:
        ctx.decoded = decode_scaled_signs(ctx.state, payload[1], segments)
        return ctx.decoded
