"""EF-SignSGD: the sign of each coordinate scaled by the mean magnitude, with error feedback.

Karimireddy, Rebjock, Stich & Jaggi, "Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
ICML 2019. The compressor is ``C(p) = (||p||_1 / d) * sign(p)`` applied to the gradient plus the residual.

Trade-offs: 1 bit per coordinate plus one scale per tensor (about 32x smaller than float32). Plain sign
compression is biased enough to diverge (the paper's counter-examples); the residual makes it converge like
SGD, so error feedback is required (one gradient-sized buffer). Scales differ per rank, so payloads are
all-gathered and traffic grows with the world size. Zeros are sent as ``+scale``.
"""

from __future__ import annotations

from typing import Any

import torch

from gradcomm.compression._numerics import work_dtype
from gradcomm.compression.base import ErrorFeedback, OwnDecoding, Payload, SegmentedCompressor
from gradcomm.compression.communicators import ALLGATHER
from gradcomm.compression.segment_bits import (
    decode_scaled_signs,
    encode_scaled_signs,
    scaled_signs_layout,
    unpack_scaled_signs,
)
from gradcomm.compression.segment_stats import segment_mean_abs
from gradcomm.compression.segments import Segments, as_dtype

__all__ = ["EFSignSGD"]


class EFSignSGD(SegmentedCompressor, name="efsign", summary="scaled sign with error feedback (EF-SignSGD)"):
    """Scaled sign: one bit per coordinate and each tensor's mean magnitude. Payload of a bucket: every
    tensor's signs (packed as for that tensor alone), back to back, then one scale per tensor."""

    communicator = ALLGATHER
    world_decoding = True
    error_feedback = ErrorFeedback.REQUIRED

    def payload_layout(self, lengths: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return scaled_signs_layout(lengths, dtype)

    def compress_segments(self, flat: torch.Tensor, segments: Segments) -> tuple[Payload, OwnDecoding]:
        scales = segment_mean_abs(as_dtype(flat, work_dtype(flat.dtype)), segments)
        payload, signs = encode_scaled_signs(flat, segments, scales)
        return payload, OwnDecoding(signs)

    def decompress_segments(
        self, payload: Payload, ctx: Any, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return unpack_scaled_signs(payload, segments, out)

    def decompress_own(self, payload: Payload, ctx: OwnDecoding, segments: Segments) -> torch.Tensor:
        ctx.decoded = decode_scaled_signs(ctx.state, payload[1], segments)
        return ctx.decoded
