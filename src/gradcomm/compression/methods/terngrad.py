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

import functools

import torch

from gradcomm.compression._numerics import (
    add_rounding_noise_,
    decode_bits,
    nonzero_or_one,
    pack_bits,
    safe_std,
    work_dtype,
)
from gradcomm.compression.base import ErrorFeedback, Payload, RandomizedCompressor, TensorSpec
from gradcomm.compression.communicators import ALLGATHER

__all__ = ["TernGrad"]


@functools.lru_cache(maxsize=16)
def _ternary(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What codes 0, 1, 2 mean: -1, 0, +1 times the scale (code 3 is never sent). Made once per dtype and device
    and shared: read it, never write it."""
    return torch.arange(4, dtype=dtype, device=device) - 1


class TernGrad(RandomizedCompressor, name="terngrad", summary="TernGrad ternary quantization"):
    """Unbiased ternary gradients with one scale per tensor (optionally clipped first)."""

    communicator = ALLGATHER
    error_feedback = ErrorFeedback.OPTIONAL

    def __init__(self, clip: float | None = 2.5, seed: int = 0):
        if clip is not None and not clip > 0:
            raise ValueError(f"TernGrad: clip must be a number > 0 (standard deviations) or None, got {clip!r}")
        super().__init__(seed)
        self.clip = clip

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, TensorSpec]:
        flat = tensor.reshape(-1).to(work_dtype(tensor.dtype))
        scale = torch.maximum(flat.amax(), flat.amin().neg_())
        if self.clip is not None:
            std = safe_std(flat, scale)
            # a constant tensor is not clipped
            scale = torch.where(std > 0, torch.minimum(self.clip * std, scale), scale)
        fraction = flat / nonzero_or_one(scale)  # p = x / scale (a zero scale: all zeros, 0 / 1)
        if self.clip is not None:
            fraction.clamp_(-1, 1)  # clipping x to +-scale
        # codes 0, 1, 2 for -scale, 0, +scale: 1 + p rounded stochastically (for p >= 0, 1 with chance p, else
        # 0; for p < 0, -1 with chance |p|, else 0)
        codes = add_rounding_noise_(fraction, 1, self.generator(flat.device))
        return [pack_bits(codes, 2), scale.reshape(1)], TensorSpec.of(tensor)

    def decompress(self, payload: Payload, ctx: TensorSpec) -> torch.Tensor:
        packed, scale = payload
        values = (_ternary(scale.dtype, scale.device) * scale).to(ctx.dtype)
        return decode_bits(packed, 2, ctx.numel, values).view(ctx.shape)
