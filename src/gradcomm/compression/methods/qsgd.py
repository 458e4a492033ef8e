"""QSGD: stochastic quantization of each coordinate to one of ``s`` levels of its bucket's norm.

Alistarh, Grubic, Li, Tomioka & Vojnovic, "QSGD: Communication-Efficient SGD via Gradient Quantization and
Encoding", NeurIPS 2017. Each bucket of ``bucket_size`` coordinates is sent as its L2 norm and, per
coordinate, a sign and a level ``l`` in ``0..s`` drawn so that ``E[norm * l / s] = |x_i|`` (unbiased).
Defaults ``levels=7``, ``bucket_size=512``: the paper's 4-bit QSGD (sign and level in 4 bits) with its bucket
size of 512; ``levels=127`` gives 8-bit QSGD.

Wire format: per coordinate the code ``sign * level + levels`` (``0..2 * levels``) at exactly
``bits = ceil(log2(2 * levels + 1))`` bits, bit-packed across byte boundaries
(:func:`~gradcomm.compression._numerics.pack_bits`: ``ceil(bits * padded numel / 8)`` bytes), then one norm
per bucket in the work dtype (float32 or wider); ``levels=3`` costs 3 bits, ``levels=15`` 5.

Trade-offs: unbiased, with variance at most ``min(d / s**2, sqrt(d) / s) * ||bucket||**2`` (Lemma 3.1,
``d = bucket_size``); error feedback is off by default (not needed for convergence) but may be switched on.
Per-rank norms and randomness make payloads non-summable: they are all-gathered. Elias coding of the levels
(the paper's further lossless compression) is replaced by fixed-width codes: simpler and GPU-friendly, with
a payload size independent of the values. Random draws come from generators seeded by ``(seed, rank,
parameter, draw count)`` (:class:`~gradcomm.compression.base.RandomizedCompressor`): independent across ranks
and parameters, and the same whatever order the tensors are compressed in. The noise has 16 bits
(:func:`~gradcomm.compression._numerics.add_rounding_noise_`), so a level is unbiased up to ``2**-16`` of a
step.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from gradcomm.compression._numerics import as_uint8, work_dtype
from gradcomm.compression.base import ErrorFeedback, Payload, RandomizedCompressor, SegmentedCompressor
from gradcomm.compression.communicators import ALLGATHER
from gradcomm.compression.segment_bits import (
    byte_table,
    decode_segments,
    lookup_bytes,
    pack_segments,
    packed_lengths,
    unpad_rows,
)
from gradcomm.compression.segment_noise import add_noise_, segment_noise
from gradcomm.compression.segment_stats import constant, smallest_positive
from gradcomm.compression.segments import Segments, as_dtype

__all__ = ["QSGD"]


@functools.lru_cache(maxsize=64)
def _fractions(levels: int, bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What each code means, ``(c - levels) / levels`` of the bucket's norm: the fraction (at most 1 in magnitude)
    is applied first, as ``norm / levels * levels`` can round past the dtype's maximum. Made once per setting
    and shared: read it, never write it."""
    return (torch.arange(2**bits, dtype=dtype, device=device) - levels) / levels


class QSGD(RandomizedCompressor, SegmentedCompressor, name="qsgd", summary="QSGD stochastic quantization (unbiased)"):
    """Unbiased stochastic quantization to ``levels`` levels per sign, with one norm per bucket of
    ``bucket_size`` coordinates (each tensor zero padded to whole buckets). Payload of a segmented bucket: every
    tensor's codes (packed as for that tensor alone), back to back, then every tensor's norms."""

    communicator = ALLGATHER
    world_decoding = True
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
        self._bits = (2 * levels).bit_length()  # codes 0..2 * levels: ceil(log2(2 * levels + 1)) bits

    def payload_layout(self, lengths: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        padded = [-(-n // self.bucket_size) * self.bucket_size for n in lengths]
        return [
            (sum(packed_lengths(padded, self._bits)), torch.uint8),
            (sum(padded) // self.bucket_size, work_dtype(dtype)),
        ]

    def compress_segments(self, flat: torch.Tensor, segments: Segments) -> tuple[Payload, None]:
        padded = segments.padded(self.bucket_size)
        buckets = padded.pad(as_dtype(flat, work_dtype(flat.dtype))).view(-1, self.bucket_size)
        dtype, device = buckets.dtype, buckets.device
        # The norm as safe_norm computes it (peak * ||x / peak||), its parts reused: x / norm is
        # (x / peak) / ||x / peak||, and ||x / peak|| >= 1 (its peak element is +-1) or 0 (a bucket of zeros).
        # A bucket of zeros may be divided by anything nonzero: the smallest number, or 1 for its norm.
        peak = torch.maximum(torch.amax(buckets, dim=1, keepdim=True), torch.amin(buckets, dim=1, keepdim=True).neg_())
        relative = torch.div(buckets, torch.clamp_min(peak, constant(smallest_positive(dtype), dtype, device)))
        relative_norm = torch.linalg.vector_norm(relative, dim=1, keepdim=True)
        norms = torch.mul(peak, relative_norm).clamp_(max=torch.finfo(dtype).max)  # a number: a NaN kept as it is
        # x / norm * levels, in [-levels, levels]; levels / n is 1 / n times levels, as torch divides a number
        per_level = torch.clamp_min(relative_norm, constant(1.0, dtype, device)).reciprocal_()
        scaled = relative.mul_(per_level.mul_(constant(float(self.levels), dtype, device)))
        # codes: levels + the level y rounded stochastically, in [0, 2 levels] (levels <= 127)
        noise = segment_noise(self.segment_seeds(segments), segments, self.bucket_size)
        codes = add_noise_(scaled.view(-1), noise, self.levels + 0.5)
        packed = pack_segments(as_uint8(codes, self._bits), padded.as_segments, self._bits)
        return [packed, norms.view(-1)], None

    def decompress_segments(
        self, payload: Payload, ctx: Any, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        packed, norms = payload
        padded = segments.padded(self.bucket_size)
        bits = self._bits
        world = packed.dim() == 2  # every rank's payload: (world, ...) parts, decoded to (world, numel)
        if 8 % bits == 0 and padded.as_segments.padded(8).aligned:  # one lookup per byte in a table made once
            table = _byte_fractions(self.levels, bits, norms.dtype, norms.device)
            usable = padded.aligned and segments.dtype == norms.dtype and not world
            values = lookup_bytes(packed, table, padded.numel, out if usable else None)
        else:
            fractions = _fractions(self.levels, bits, norms.dtype, norms.device)
            values = decode_segments(packed, padded.as_segments, bits, fractions)
        values.view(-1, self.bucket_size).mul_(norms.view(-1, 1))
        if not padded.aligned:
            values = unpad_rows(padded, values) if world else padded.unpad(values)
        return as_dtype(values, segments.dtype)


@functools.lru_cache(maxsize=64)
def _byte_fractions(levels: int, bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:func:`_fractions` of every byte's codes (:func:`~gradcomm.compression.segment_bits.byte_table`), made
    once per setting; read it, never write it."""
    return byte_table(_fractions(levels, bits, dtype, device), bits)
