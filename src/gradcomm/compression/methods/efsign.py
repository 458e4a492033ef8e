"""EF-SignSGD: the sign of each coordinate scaled by the mean magnitude, with error feedback.

Karimireddy, Rebjock, Stich & Jaggi, "Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
ICML 2019. The compressor is ``C(p) = (||p||_1 / d) * sign(p)`` applied to the gradient plus the residual.

Trade-offs: 1 bit per coordinate plus one scale per tensor (about 32x smaller than float32). Plain sign
compression is biased enough to diverge (the paper's counter-examples); the residual makes it converge like
SGD, so error feedback is required (one gradient-sized buffer). Scales differ per rank, so payloads are
all-gathered and traffic grows with the world size. Zeros are sent as ``+scale``.
"""

from __future__ import annotations

import torch

from gradcomm.compression._numerics import decode_bits, pack_signs, safe_mean_abs, sign_values, work_dtype
from gradcomm.compression.base import Compressor, ErrorFeedback, Payload, TensorSpec
from gradcomm.compression.communicators import ALLGATHER

__all__ = ["EFSignSGD"]


class EFSignSGD(Compressor, name="efsign", summary="scaled sign with error feedback (EF-SignSGD)"):
    """Scaled sign: one bit per coordinate and the tensor's mean magnitude."""

    communicator = ALLGATHER
    error_feedback = ErrorFeedback.REQUIRED

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, TensorSpec]:
        flat = tensor.reshape(-1)
        scale = safe_mean_abs(flat.to(work_dtype(flat.dtype))).reshape(1)
        return [pack_signs(flat), scale], TensorSpec.of(tensor)

    def decompress(self, payload: Payload, ctx: TensorSpec) -> torch.Tensor:
        bits, scale = payload
        values = (sign_values(scale.dtype, scale.device) * scale).to(ctx.dtype)
        return decode_bits(bits, 1, ctx.numel, values).view(ctx.shape)
