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
the same whatever order the tensors are compressed in.
"""

from __future__ import annotations

import torch

from gradcomm.compression._numerics import decode_bits, pack_bits, safe_divide, safe_std, work_dtype
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
        if self.clip is not None:
            std = safe_std(flat)
            bound = torch.where(
                std > 0, self.clip * std, flat.abs().amax()
            )  # a constant tensor is not clipped
            flat = flat.clamp(-bound, bound)
        magnitude = flat.abs()
        scale = magnitude.amax()
        noise = torch.rand(
            flat.shape, generator=self.generator(flat.device), dtype=flat.dtype, device=flat.device
        )
        # keep (as 1, else 0) where noise < |x| / scale: the difference is in (-1, 1], so its ceiling is 0 or 1
        keep = safe_divide(magnitude, scale).sub_(noise).ceil_()
        codes = flat.sign().mul_(keep).add_(1)  # 0, 1, 2 for -scale, 0, +scale
        return [pack_bits(codes, 2), scale.reshape(1)], TensorSpec.of(tensor)

    def decompress(self, payload: Payload, ctx: TensorSpec) -> torch.Tensor:
        packed, scale = payload
        ternary = torch.arange(4, dtype=scale.dtype, device=scale.device) - 1  # code 3 is never sent
        return decode_bits(packed, 2, ctx.numel, (ternary * scale).to(ctx.dtype)).view(ctx.shape)
