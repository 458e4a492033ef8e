"""Error-compensated 1-bit compressed allreduce, as in DeepSpeed's 1-bit Adam.

Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed", ICML
2021 (Algorithm 1's compressed allreduce; Seide et al. 2014 for 1-bit SGD with error feedback). Each rank
adds its worker residual, splits the tensor into one chunk per rank and sends each chunk as signs with one
scale ``||chunk||_2 / sqrt(len(chunk))``. Rank ``j`` averages everyone's chunk ``j``, adds its server
residual, compresses the mean to signs and a scale again, keeps the new server residual and all-gathers the
result
(:class:`~gradcomm.compression.communicators.TwoStageAllreduce` with ``server_error_feedback``).

Trade-offs: about 32x less traffic than float32 and traffic per rank that does not grow with the world size;
costs one gradient-sized worker residual plus a chunk-sized (``1/world_size``) server residual. Both error
feedbacks are required: without them signs alone do not converge. DeepSpeed scales the worker stage by one
norm per tensor; here each chunk has its own scale (``world_size`` scalars instead of one, a closer fit).
The paper applies this to Adam's momentum after a warm-up with uncompressed Adam; as a gradient hook it
compresses gradients, so any warm-up is the caller's (register the hook after it).
"""

from __future__ import annotations

import torch

from gradcomm.compression._numerics import decode_bits, pack_signs, safe_rms, sign_values, work_dtype
from gradcomm.compression.base import ErrorFeedback, Payload, RowwiseCompressor
from gradcomm.compression.communicators import TwoStageAllreduce

__all__ = ["OneBit"]


class OneBit(RowwiseCompressor, name="onebit", summary="two-stage error-compensated 1-bit allreduce"):
    """Signs with one RMS scale per row."""

    communicator = TwoStageAllreduce(server_error_feedback=True)
    error_feedback = ErrorFeedback.REQUIRED

    def compress_rows(self, rows: torch.Tensor) -> tuple[Payload, tuple[int, torch.dtype]]:
        scale = safe_rms(rows.to(work_dtype(rows.dtype)), dim=1)
        return [pack_signs(rows), scale], (rows.shape[1], rows.dtype)

    def decompress_rows(self, payload: Payload, ctx: tuple[int, torch.dtype]) -> torch.Tensor:
        bits, scale = payload
        length, dtype = ctx
        return decode_bits(bits, 1, length, (sign_values(scale.dtype, scale.device) * scale).to(dtype))
