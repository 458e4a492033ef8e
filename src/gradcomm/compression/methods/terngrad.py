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
the same whatever order the tensors are compressed in; the noise has ``torch.rand``'s float32 resolution
(:func:`~gradcomm.compression._numerics.uniform_bits`), so ``b_i`` is unbiased up to ``2**-24``.
"""

from __future__ import annotations

import torch

from gradcomm.compression._numerics import (
    UNIFORM_SCALE,
    decode_bits,
    nonzero_or_one,
    pack_bits,
    safe_std,
    uniform_bits,
    work_dtype,
)
from gradcomm.compression.base import ErrorFeedback, Payload, RandomizedCompressor, TensorSpec
from gradcomm.compression.communicators import ALLGATHER

__all__ = ["TernGrad"]


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
        magnitude = flat.abs()
        scale = magnitude.amax()
        if self.clip is not None:
            std = safe_std(flat, scale)
            # Clipping x to +-bound is clipping |x| to bound (signs are x's); a constant tensor is not clipped.
            scale = torch.where(std > 0, torch.minimum(self.clip * std, scale), scale)
            magnitude = magnitude.clamp_(max=scale)
        noise = uniform_bits(flat.shape, self.generator(flat.device), flat.device)
        # keep (as 1, else 0) where noise < |x| / scale: the difference is in (-1, 1], so its ceiling is 0 or 1
        # (a zero scale: all zeros, 0 / 1)
        keep = magnitude.div_(nonzero_or_one(scale)).sub_(noise, alpha=UNIFORM_SCALE).ceil_()
        codes = keep.copysign_(flat).add_(1)  # 0, 1, 2 for -scale, 0, +scale (x = -0 or keep -0: 1)
        return [pack_bits(codes, 2), scale.reshape(1)], TensorSpec.of(tensor)

    def decompress(self, payload: Payload, ctx: TensorSpec) -> torch.Tensor:
        packed, scale = payload
        ternary = torch.arange(4, dtype=scale.dtype, device=scale.device) - 1  # code 3 is never sent
        return decode_bits(packed, 2, ctx.numel, (ternary * scale).to(ctx.dtype)).view(ctx.shape)
