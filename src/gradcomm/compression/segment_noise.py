"""Random bits keyed by segment: counter-based, so what a tensor draws depends on its key and draw count alone.

SplitMix64's finalizer of a per-segment seed plus the element's (or word's) index: a few integer passes over
the bucket, whatever its number of tensors, on any device, where a torch generator per tensor cost a
generator, a seed and a draw per tensor.
"""

from __future__ import annotations

import functools
import math

import torch

from gradcomm.compression._numerics import NOISE_SCALE
from gradcomm.compression.segment_stats import constant
from gradcomm.compression.segments import Padded, Segments, _ids, _placement, _starts

__all__ = ["add_noise_", "seed_of", "segment_noise", "segment_words"]


_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _shifted_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 (torch's ``>>`` is arithmetic); its operands as 0-d tensors made once (a
    Python number costs calls of its own)."""
    shift, mask = _shift_operands(bits, x.device)
    return torch.bitwise_right_shift(x, shift).bitwise_and_(mask)


@functools.lru_cache(maxsize=16)
def _shift_operands(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(bits, dtype=torch.int64, device=device),
        torch.tensor((1 << (64 - bits)) - 1, dtype=torch.int64, device=device),
    )


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer, in place: every output bit depends on every input bit."""
    x = x.bitwise_xor_(_shifted_right(x, 30)).mul_(_MIX1)
    x = x.bitwise_xor_(_shifted_right(x, 27)).mul_(_MIX2)
    return x.bitwise_xor_(_shifted_right(x, 31))


def segment_noise(seeds: torch.Tensor, segments: Segments, multiple: int = 1) -> torch.Tensor:
    """Independent int16, uniform over all 65,536 values, one per element of ``segments`` padded to
    ``multiple`` (1: not padded): element ``i`` of segment ``s`` is 16 bits of SplitMix64's output for
    ``seeds[s] + (i // 4) * golden``, four elements per 64-bit word. Counter-based: what a segment gets depends
    on its seed alone, not on the bucket around it; times ``2**-16`` (``NOISE_SCALE``), uniform on
    ``[-1/2, 1/2)`` as ``centred_noise``."""
    wanted = segments.padded(multiple) if multiple > 1 else None
    words_layout = segments.padded(math.lcm(multiple, 4))
    ids, places = _word_layout(words_layout)
    noise = _mix(seeds.index_select(0, ids).add_(places, alpha=_GOLDEN)).view(torch.int16)
    target = wanted.lengths if wanted is not None else segments.lengths
    if tuple(target) == words_layout.lengths:
        return noise
    return noise.index_select(0, _placement_cached(segments, tuple(target), words_layout.lengths))


def add_noise_(x: torch.Tensor, noise: torch.Tensor, offset: float) -> torch.Tensor:
    """``x + noise * NOISE_SCALE + offset`` in place (stochastic rounding, ``x`` flat, ``noise`` from
    :func:`segment_noise`): the noise converted once (an addition of int16 converts it anyway, in four calls),
    the offset a 0-d constant."""
    converted = torch.empty(noise.shape, dtype=x.dtype, device=x.device).copy_(noise)
    return x.add_(converted, alpha=NOISE_SCALE).add_(constant(offset, x.dtype, x.device))


def segment_words(seeds: torch.Tensor, segments: Segments) -> torch.Tensor:
    """One random 64-bit word (int64) per element of ``segments``: SplitMix64's output for ``seeds[s] + i *
    golden`` at element ``i`` of segment ``s``."""
    return _mix(seeds.index_select(0, segments.ids).add_(segments.positions, alpha=_GOLDEN))


def _placement_cached(segments: Segments, lengths: tuple[int, ...], wider: tuple[int, ...]) -> torch.Tensor:
    cache = segments.__dict__.setdefault("_placements", {})
    if (lengths, wider) not in cache:
        cache[lengths, wider] = _placement(lengths, wider, segments.device)
    return cache[lengths, wider]


def _word_layout(padded: Padded) -> tuple[torch.Tensor, torch.Tensor]:
    """For each 64-bit word of noise (4 padded elements): its segment and its place in the segment (cached)."""
    if not hasattr(padded, "_words"):
        word_lengths = [n // 4 for n in padded.lengths]
        ids = _ids(word_lengths, padded.segments.device)
        starts = torch.tensor(_starts(word_lengths), dtype=torch.int64, device=padded.segments.device)
        places = torch.arange(len(ids), device=ids.device).sub_(starts.index_select(0, ids))
        padded._words = (ids, places)
    return padded._words


def seed_of(digest: bytes) -> int:
    """A 64-bit seed (as int64) from a digest's first 8 bytes."""
    value = int.from_bytes(digest[:8], "little")
    return value - (1 << 64) if value >= 1 << 63 else value

