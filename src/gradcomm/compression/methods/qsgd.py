"""QSGD: stochastic quantization of each coordinate to one of ``s`` levels of its bucket's norm.

Alistarh, Grubic, Li, Tomioka & Vojnovic, "QSGD: Communication-Efficient SGD via Gradient Quantization and
Encoding", NeurIPS 2017. Each bucket of ``bucket_size`` coordinates is sent as its L2 norm and, per
coordinate, a sign and a level ``l`` in ``0..s`` drawn so that ``E[norm * l / s] = |x_i|`` (unbiased).
Defaults ``levels=7``, ``bucket_size=512``: the paper's 4-bit QSGD (sign and level in 4 bits) with its bucket
size of 512; ``levels=127`` gives 8-bit QSGD.

Trade-offs: unbiased, with variance at most ``min(d / s**2, sqrt(d) / s) * ||bucket||**2`` (Lemma 3.1,
``d = bucket_size``); error feedback is off by default (not needed for convergence) but may be switched on.
Per-rank norms and randomness make payloads non-summable: they are all-gathered. Elias coding of the levels
(the paper's further lossless compression) is replaced by fixed-width codes: simpler and GPU-friendly, with
a payload size independent of the values. Random draws come from generators seeded by ``(seed, rank, parameter, draw count)``
(:class:`~gradcomm.compression.base.RandomizedCompressor`): independent across ranks and parameters, and
the same whatever order the tensors are compressed in.
"""

from __future__ import annotations

import torch

from gradcomm.compression._numerics import pack_bits, safe_divide, safe_norm, unpack_bits, work_dtype
from gradcomm.compression.base import ErrorFeedback, Payload, RandomizedCompressor, TensorSpec
from gradcomm.compression.communicators import ALLGATHER

__all__ = ["QSGD"]


class QSGD(RandomizedCompressor, name="qsgd", summary="QSGD stochastic quantization (unbiased)"):
    """Unbiased stochastic quantization to ``levels`` levels per sign, with one norm per bucket."""

    communicator = ALLGATHER
    error_feedback = ErrorFeedback.OPTIONAL

    def __init__(self, levels: int = 7, bucket_size: int = 512, seed: int = 0):
        for name, value in (("levels", levels), ("bucket_size", bucket_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"QSGD: {name} must be an integer, got {value!r}")
        if not 1 <= levels <= 127:
            raise ValueError(f"QSGD: levels must be in 1..127 (codes of at most 8 bits), got {levels}")
        if bucket_size < 1:
            raise ValueError(f"QSGD: bucket_size must be at least 1, got {bucket_size}")
        super().__init__(seed)
        self.levels = levels
        self.bucket_size = bucket_size
        self._bits = next(bits for bits in (1, 2, 4, 8) if 2**bits >= 2 * levels + 1)

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, TensorSpec]:
        flat = tensor.reshape(-1).to(work_dtype(tensor.dtype))
        buckets = torch.nn.functional.pad(flat, (0, -flat.numel() % self.bucket_size)).view(
            -1, self.bucket_size
        )
        norms = safe_norm(buckets, dim=1)
        scaled = safe_divide(buckets.abs(), norms).clamp_(max=1) * self.levels
        noise = torch.rand(
            scaled.shape, generator=self.generator(flat.device), dtype=scaled.dtype, device=flat.device
        )
        levels = (scaled + noise).floor_().clamp_(max=self.levels)
        codes = buckets.sign().mul_(levels).add_(self.levels)
        return [pack_bits(codes.reshape(-1), self._bits), norms.reshape(-1)], TensorSpec.of(tensor)

    def decompress(self, payload: Payload, ctx: TensorSpec) -> torch.Tensor:
        packed, norms = payload
        codes = unpack_bits(packed, self._bits, norms.numel() * self.bucket_size).view(-1, self.bucket_size)
        # the fraction (at most 1 in magnitude) first: norm / levels * levels can round past the dtype's maximum
        values = ((codes.to(norms.dtype) - self.levels) / self.levels) * norms.unsqueeze(1)
        return values.reshape(-1)[: ctx.numel].to(ctx.dtype).view(ctx.shape)
