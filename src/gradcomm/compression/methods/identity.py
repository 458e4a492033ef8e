"""No compression: the dense allreduce, for tensors too small to be worth compressing (biases, norms)."""

from __future__ import annotations

from typing import Any

import torch

from gradcomm.compression.base import Compressor, ErrorFeedback, Payload
from gradcomm.compression.communicators import ALLREDUCE

__all__ = ["NoCompression"]


class NoCompression(Compressor):
    """Sends the tensor itself; summed by allreduce. Lossless, so error feedback would hold nothing."""

    communicator = ALLREDUCE
    error_feedback = ErrorFeedback.OPTIONAL
    elementwise = True

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Any]:
        return [tensor], None

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return payload[0]
