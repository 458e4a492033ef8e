"""Overflow- and underflow-safe reductions: norms, means and scales of gradients of any magnitude.

Gradients reach 1e30 and the subnormal range in practice (loss scaling, exploding layers); a plain
``vector_norm`` squares them into ``inf`` or ``0``. Everything here divides by the largest magnitude first where
a plain sum could fail, and works on any device, so compressors built from these pieces stay finite.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

__all__ = [
    "add_rows_in_order",
    "nonzero_or_one",
    "ordered_mean",
    "rank_order_mean",
    "safe_mean_abs",
    "safe_norm",
    "safe_rms",
    "safe_std",
    "work_dtype",
]


@functools.lru_cache(maxsize=32)
def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are computed and sent in: at least float32, so half precision cannot overflow.
    Cached: ``promote_types`` is a torch call of its own every time."""
    return torch.promote_types(dtype, torch.float32)


def nonzero_or_one(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zeros replaced by ones: a divisor for magnitudes whose scale is 0 only where they all are
    (then ``0 / 1 == 0``, without a mask)."""
    return torch.where(x == 0, torch.ones_like(x), x)


_nonzero = nonzero_or_one


def ordered_mean(tensors: Iterable[torch.Tensor], count: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``count`` tensors (or rows of a tensor) summed in the given order, so that every rank computing
    it gets identical bits; each is divided first, so the sum cannot overflow where the mean does not. The mean
    of one tensor is that tensor itself (not a copy); of several, it is summed in ``out`` where given (a tensor
    of their shape and dtype that none of them shares memory with)."""
    iterator = iter(tensors)
    if count == 1:
        return next(iterator)
    first = next(iterator)
    usable = out is not None and out.shape == first.shape and out.dtype == first.dtype
    total = torch.div(first, count, out=out) if usable else first / count
    for tensor in iterator:
        total += tensor / count
    return total


def rank_order_mean(rows: torch.Tensor, out: torch.Tensor | None = None, overwrite: bool = False) -> torch.Tensor:
    """The mean of the rows of ``rows`` (``(world, ...)``, ``world >= 2``), the bits of :func:`ordered_mean`:
    rows divided by ``world``, added in rank order (``torch.sum`` over ranks promises no order). ``out``: where
    it may be written (a row's shape and dtype, not ``rows``' memory); ``overwrite``: ``rows`` is divided in
    place."""
    return add_rows_in_order(None, rows, rows.shape[0], out, overwrite)


def add_rows_in_order(
    total: torch.Tensor | None, rows: torch.Tensor, count: int, out: torch.Tensor | None, overwrite: bool
) -> torch.Tensor:
    """``total`` (``None``: nothing yet, then ``rows`` has two rows or more) plus every row of ``rows`` divided
    by ``count``, in order: :func:`rank_order_mean` of a world's rows given a batch of ranks at a time."""
    divided = rows.div_(count) if overwrite else torch.div(rows, count)
    first = 0
    if total is None:
        usable = out is not None and out.shape == divided.shape[1:] and out.dtype == divided.dtype
        total, first = torch.add(divided[0], divided[1], out=out if usable else None), 2
    for rank in range(first, rows.shape[0]):
        total.add_(divided[rank])
    return total


def _amax(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The largest element, of all or along ``dim`` (kept)."""
    return x.amax() if dim is None else x.amax(dim=dim, keepdim=True)


def _mean(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The mean, of all or along ``dim`` (kept)."""
    return x.mean() if dim is None else x.mean(dim=dim, keepdim=True)


def _max_abs(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    return _amax(x.abs(), dim)


def safe_norm(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """L2 norm without underflow (``keepdim`` along ``dim``), saturating at the dtype's largest value."""
    peak = _max_abs(x, dim)
    scaled = x / _nonzero(peak)
    norm = scaled.norm() if dim is None else scaled.norm(dim=dim, keepdim=True)
    return (peak * norm).clamp_(max=torch.finfo(x.dtype).max)


_PLAIN_FLOOR = 2.0**-80
"""The smallest mean (of magnitudes or squares) that :func:`safe_rms` and :func:`safe_mean_abs` take from a plain
sum: below it, terms lost to underflow (each under 2**-126 in float32) could matter beyond 2**-46 of it."""


def _plain_is_exact(mean: torch.Tensor) -> bool:
    """Whether means computed without scaling neither overflowed nor came near the underflow range. Reads the
    values on the host, so callers ask only on the CPU (an accelerator would wait for its stream)."""
    return bool(torch.isfinite(mean).logical_and_(mean >= _PLAIN_FLOOR).all())


def safe_rms(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Root mean square (``||x||_2 / sqrt(n)``) without overflow or underflow (``keepdim`` along ``dim``).

    On the CPU the plain mean of squares is tried first (two passes), and kept unless a square or the sum
    overflowed or the result is close enough to underflow to have lost terms; otherwise, and on other devices,
    the squares are of ``x`` divided by its peak magnitude (four passes). ``x.norm()`` would be faster still,
    but its float32 sum along a dimension is 50x less accurate (4e-6 relative over 500k elements).
    """
    if x.device.type == "cpu":
        mean_square = _mean(torch.mul(x, x), dim)
        if _plain_is_exact(mean_square):
            return mean_square.sqrt_()
    magnitude = x.abs()
    peak = _amax(magnitude, dim)
    scaled = magnitude.div_(_nonzero(peak))  # |x| / peak: the same squares as x / peak
    squares = scaled.mul_(scaled)  # what square() computes, without its slower pow kernel
    return peak * _mean(squares, dim).sqrt()


def safe_mean_abs(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean magnitude (``||x||_1 / n``) without overflow (``keepdim`` along ``dim``); on the CPU the plain mean
    first, as :func:`safe_rms` does."""
    magnitude = x.abs()
    if x.device.type == "cpu":
        mean = _mean(magnitude, dim)
        if _plain_is_exact(mean):
            return mean
    peak = _amax(magnitude, dim)
    return peak * _mean(magnitude.div_(_nonzero(peak)), dim)


def safe_std(x: torch.Tensor, peak: torch.Tensor | None = None) -> torch.Tensor:
    """Population standard deviation of all elements without overflow; ``peak``: ``x.abs().amax()`` where the
    caller has it already.

    Two passes, as ``std`` (the mean, then the mean square of the differences), but of vectorised sums: on the
    CPU ``torch.std``'s Welford loop costs several times a pass over memory; the result differs from it in the
    last bit or two (float32's cascade sums)."""
    peak = _max_abs(x, None) if peak is None else peak
    scaled = x / _nonzero(peak)
    centred = scaled.sub_(scaled.mean())
    return peak * centred.mul_(centred).mean().sqrt()
