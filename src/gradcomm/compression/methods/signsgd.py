"""signSGD with majority vote: every rank sends signs, the update is the sign of their sum.

Bernstein, Zhao, Azizzadenesheli & Anandkumar, "signSGD with Majority Vote is Communication Efficient and
Fault Tolerant", ICLR 2019 (and Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems",
ICML 2018).

The averaged gradient the hook returns is the vote, ``sign(sum_r sign(g_r))``: +1, -1, or 0 on a tie (even
world sizes), so the optimizer's learning rate is the step size per coordinate (the paper's lr is of order
1e-4; the magnitude of the gradient is discarded). 1 bit per coordinate, no scale. Momentum, as in Signum,
belongs to the optimizer: apply it to the local gradient before the hook for the paper's variant.
Error feedback is not supported: the vote is not the sum of what ranks sent, so a residual would not measure
what was lost. Bits are all-gathered (the paper's parameter-server vote is done by every rank) and, on the
CPU, counted where they lie, packed (:func:`~gradcomm.compression._numerics.majority_signs`).
"""

from __future__ import annotations

from typing import Any

import torch

from gradcomm.compression._numerics import majority_signs, pack_signs, unpack_signs, work_dtype
from gradcomm.compression.base import ErrorFeedback, Payload, SegmentedCompressor
from gradcomm.compression.communicators import ALLGATHER
from gradcomm.compression.segments import Segments

__all__ = ["SignSGD"]


class SignSGD(SegmentedCompressor, name="signsgd", summary="signSGD with majority vote"):
    """One bit per coordinate; aggregated by majority vote. Elementwise: a bucket's signs are packed as one
    stream, whatever its segments."""

    communicator = ALLGATHER
    error_feedback = ErrorFeedback.UNSUPPORTED
    elementwise = True

    def payload_layout(self, lengths: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(-(-sum(lengths) // 8), torch.uint8)]

    def compress_segments(self, flat: torch.Tensor, segments: Segments) -> tuple[Payload, None]:
        return [pack_signs(flat)], None

    def decompress_segments(
        self, payload: Payload, ctx: Any, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return unpack_signs(payload[0], segments.numel, segments.dtype)

    def aggregate_segments(
        self, gathered: Payload, ctx: Any, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if gathered[0].shape[0] == 1:  # one rank: the vote is its signs
            return self.decompress_segments([gathered[0][0]], ctx, segments)
        if gathered[0].device.type != "cpu":
            return _vote_by_sum(gathered[0], segments.numel, segments.dtype)
        return majority_signs(gathered[0], segments.numel, segments.dtype)


def _vote_by_sum(packed: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`~gradcomm.compression._numerics.majority_signs` off the CPU in calls that do not grow with the
    ranks: every rank's signs decoded at once and summed over ranks (integers, exact in any order up to 2**24
    ranks), then their sign. On the CPU the bit-plane count stays: about ``2 rows log2(rows)`` byte-wise passes
    over packed bytes, several times faster there than the float sum of ``rows`` decoded rows."""
    votes = torch.sum(unpack_signs(packed, length, work_dtype(dtype)), dim=0)
    return votes.sign_().to(dtype)
