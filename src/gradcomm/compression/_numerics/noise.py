"""Stochastic rounding noise drawn from a compressor's own generators (QSGD, TernGrad)."""

from __future__ import annotations

import math

import torch

__all__ = ["NOISE_SCALE", "add_rounding_noise_", "centred_noise"]


NOISE_SCALE = 2.0**-16
""":func:`centred_noise` times this is uniform on ``[-1/2, 1/2)`` in steps of ``2**-16``."""


def centred_noise(shape: torch.Size | tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Independent int16, uniform over all 65,536 values: 16 random bits per element, four from each 64-bit draw.

    Times :data:`NOISE_SCALE` (fused into an ``add``/``sub``'s ``alpha``) they are uniform on ``[-1/2, 1/2)``, so
    ``1/2 +`` that is uniform on ``[0, 1)`` in steps of ``2**-16``: stochastic rounding with it rounds up with a
    probability that exceeds the exact fraction by less than ``2**-16`` (of a step). On the CPU a 64-bit draw
    costs two of the generator's (mt19937) 32-bit outputs: half an output per element, where two 24-bit fields
    per draw, or ``torch.rand``, take one. The draws cover the
    full 64 bits (``random_(-2**63, None)``: the default ``random_()`` of int64 leaves the sign bit 0). Every
    element depends only on the generator's seed; only the views are dtype-specific, so any device draws alike.
    """
    numel = math.prod(shape)
    words = torch.empty(-(-numel // 4), dtype=torch.int64, device=device).random_(-(2**63), None, generator=generator)
    return words.view(torch.int16)[:numel].view(shape)


def add_rounding_noise_(x: torch.Tensor, offset: float, generator: torch.Generator | None) -> torch.Tensor:
    """``x + offset + u`` in place, ``u`` uniform on ``[0, 1)`` in steps of ``2**-16`` (:func:`centred_noise`):
    its floor is ``x + offset`` rounded down or up, up with the chance of its fraction (less than ``2**-16``
    more), whatever the sign of ``x``: -1.25 becomes -1 or -2, -2 a quarter of the time, as the sign times the
    rounding of 1.25 would. Where ``x + offset >= 0`` the result is too, so an integer conversion's truncation
    is that floor (stochastic quantizers' codes: QSGD, TernGrad). The result is at most ``max(x) + offset + 1 -
    2**-16``, a float32 exactly where it is below ``2**8`` (24 bits), so where ``max(x) + offset`` is a whole
    number below that, the truncation never passes it."""
    noise = centred_noise(x.shape, generator, x.device)
    return x.add_(noise, alpha=NOISE_SCALE).add_(offset + 0.5)
