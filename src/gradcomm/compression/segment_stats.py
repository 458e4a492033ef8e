"""Per-segment statistics of a segmented bucket built on :func:`~gradcomm.compression.segments.segment_reduce`:
mean magnitudes without overflow, root mean squares and standard deviations, one per tensor, in a number of
calls that does not grow with the tensors (the scales of the sign and ternary methods).

Where the bucket is one ``(rows, length)`` matrix whose rows never cross a tensor (:class:`Matrix`: one tensor,
one run of equal tensors, or :class:`~gradcomm.compression.segments.Chunks`), the statistics are row-wise
operations on it with ``out=`` buffers and 0-d constants (:func:`constant`): a Python number in a torch call
is wrapped into a tensor first, four calls more each time. The results are the same bits as the general
:func:`~gradcomm.compression.segments.segment_reduce` path, which other layouts keep.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from gradcomm.compression._numerics import nonzero_or_one
from gradcomm.compression._numerics.reductions import _PLAIN_FLOOR, _plain_is_exact
from gradcomm.compression.segments import _BLOCK, Segments, segment_reduce

__all__ = [
    "Matrix",
    "constant",
    "segment_absmax",
    "segment_mean_abs",
    "segment_rms",
    "segment_std",
    "held",
    "holding",
    "scratch",
    "scratch_view",
    "smallest_positive",
]


_T = TypeVar("_T")
_KEPT_PER = 32
"""A :func:`scratch` buffer is kept on its layout only where it has at most one element per this many of the
layout's."""


class _Scratch:
    """A layout's :func:`scratch` buffers and the thread that holds them (:func:`held`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holder: int | None = None
        self.buffers: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}


@contextlib.contextmanager
def held(layout: Segments) -> Iterator[None]:
    """Within it, this thread's :func:`scratch` calls on ``layout`` return the layout's kept buffers (made
    once); where another thread holds them (the same bucket exchanged again before the last exchange was
    done), new tensors. A method's encoding or decoding of a bucket holds its layout throughout."""
    state = layout.__dict__.get("_scratch")
    if state is None:
        state = layout.__dict__.setdefault("_scratch", _Scratch())
    if not state.lock.acquire(blocking=False):  # held: by this thread (nested), or by another
        yield
        return
    state.holder = threading.get_ident()
    try:
        yield
    finally:
        state.holder = None
        state.lock.release()


def holding(method: Callable[..., _T]) -> Callable[..., _T]:
    """A method whose call holds (:func:`held`) the layout it is given (its first :class:`Segments` argument);
    compiled (``torch.compile``), it holds nothing: a graph makes its own temporaries."""

    @functools.wraps(method)
    def holder(*args: Any, **kwargs: Any) -> _T:
        if torch.compiler.is_compiling():
            return method(*args, **kwargs)
        layout = next(a for a in (*args, *kwargs.values()) if isinstance(a, Segments))
        with held(layout):
            return method(*args, **kwargs)

    return holder


def scratch(layout: Segments, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` for what one call computes and reads before it returns (never returned, nor kept
    past the call): kept on ``layout`` where this thread holds it (:func:`held`), where a new tensor costs a
    call (``empty``) every step; else a new one."""
    return scratch_view(layout, name, shape, dtype, device, None)[0]


def scratch_view(
    layout: Segments,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    view: tuple[int, ...] | torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`scratch`, and its view of shape (or dtype) ``view``, made once with it (a view costs a call).
    Only small buffers are kept (:data:`_KEPT_PER`: per-tensor,
    per-chunk and per-block temporaries); one the size of the bucket is made in each call, as memory that
    the allocator can reuse between steps instead of memory held for the layout's life."""
    state = None if torch.compiler.is_compiling() else layout.__dict__.get("_scratch")
    if state is None or state.holder != threading.get_ident() or math.prod(shape) * _KEPT_PER > max(layout.numel, _KEPT_PER):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        return tensor, tensor if view is None else tensor.view(view)
    key = (name, shape, dtype, device, view)
    if key not in state.buffers:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        state.buffers[key] = (tensor, tensor if view is None else tensor.view(view))
    return state.buffers[key]


@functools.lru_cache(maxsize=256)
def constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``value`` as a 0-d tensor of ``dtype`` on ``device``, made once: an operand that costs no wrapping call
    (the same bits as the Python number, which torch converts to the operation's dtype). Shared: read it,
    never write it."""
    return torch.tensor(value, dtype=dtype, device=device)


class Matrix:
    """A bucket's flat tensor as one ``(rows, length)`` matrix whose rows never cross a segment: one segment
    (one row), one run of equal segments back to back (a row each), or its chunks
    (:class:`~gradcomm.compression.segments.Chunks`: ``ids``, each row's segment). Per-segment statistics
    are then row-wise reductions (and, for chunks, one reduction of the rows' results by segment), and
    per-segment values broadcast as one ``(rows, 1)`` column."""

    def __init__(self, segments: Segments, rows: int, length: int, ids: torch.Tensor | None) -> None:
        self.segments = segments
        self.rows = rows
        self.length = length
        self.ids = ids

    @staticmethod
    def of(segments: Segments) -> Matrix | None:
        """The matrix of ``segments`` (cached), or ``None`` where their layout has none (runs of several
        lengths whose lengths share no power-of-two chunk of 32 or more)."""
        cache = segments.__dict__
        if "_matrix" not in cache:
            cache["_matrix"] = Matrix._made(segments)
        return cache["_matrix"]

    @staticmethod
    def _made(segments: Segments) -> Matrix | None:
        if len(segments) == 1:
            return Matrix(segments, 1, segments.numel, None)
        chunks = segments.chunks
        if chunks is not None:
            return Matrix(segments, chunks.count, chunks.length, chunks.ids)
        runs = segments.groups.runs
        if len(runs) == 1 and segments.groups.order is None and runs[0][2] == runs[0][0]:
            return Matrix(segments, len(segments), runs[0][0], None)
        return None

    @functools.cached_property
    def _counts(self) -> torch.Tensor:
        """Each segment's number of rows (chunks), the lengths of :func:`torch.segment_reduce` over rows."""
        return torch.tensor([n // self.length for n in self.segments.lengths], device=self.segments.device)

    @functools.cached_property
    def _id_column(self) -> torch.Tensor:
        """Each row's segment as a ``(rows, 1)`` column: a :func:`torch.take` by it is a column already."""
        assert self.ids is not None
        return self.ids.view(-1, 1)

    @functools.cached_property
    def _lengths(self) -> torch.Tensor:
        """Each segment's length (float64) as a ``(segments, 1)`` column, that its sum is divided by."""
        return _lengths(self.segments).view(-1, 1)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """Contiguous flat ``flat`` as the ``(rows, length)`` matrix (the matrix itself where it is one)."""
        return flat if flat.dim() == 2 else flat.view(self.rows, self.length)

    def column(self, per_segment: torch.Tensor, name: str = "column") -> torch.Tensor:
        """Each row's segment's value of ``per_segment`` (flat, or a ``(segments, 1)`` column, as the
        statistics here return them), as a ``(rows, 1)`` column: itself where a row is a segment, else in the
        :func:`scratch` buffer ``name`` (an operand read before the caller returns: columns read together
        need names of their own)."""
        if self.ids is None:
            return per_segment if per_segment.dim() == 2 else per_segment.view(self.rows, 1)
        out = scratch(self.segments, name, (self.rows, 1), per_segment.dtype, per_segment.device)
        return torch.take(per_segment, self._id_column, out=out)

    def _by_segment(self, partial: torch.Tensor, reduce: str) -> torch.Tensor:
        """Row results ``partial`` (a ``(rows, 1)`` column) reduced by segment (``"max"``, ``"min"``, ``"sum"``),
        in order, as a ``(segments, 1)`` column: themselves where a row is a segment."""
        if self.ids is None:
            return partial
        return torch.segment_reduce(partial, reduce, lengths=self._counts, axis=0, unsafe=True)

    def absmax(self, flat: torch.Tensor) -> torch.Tensor:
        """Each segment's largest magnitude (NaN where it has one; +0 where all are zeros), as a ``(segments,
        1)`` column; ``flat`` may be its :meth:`view` already, as for the other statistics. The larger of the
        row's maximum and its minimum negated (two reading passes, where ``abs`` writes a bucket-sized tensor
        and an inf-norm, or ``aminmax`` by row, is several times slower on the CPU), plus +0 (a -0 of zeros
        made +0)."""
        rows = self.view(flat)
        peak = torch.maximum(torch.amax(rows, dim=1, keepdim=True), torch.amin(rows, dim=1, keepdim=True).neg_())
        return self._by_segment(peak, "max").add_(constant(0.0, peak.dtype, peak.device))

    def extreme(self, flat: torch.Tensor, reduce: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Each segment's ``"max"`` or ``"min"``, as a ``(segments, 1)`` column: in ``out`` where given (such a
        column; where a row is a segment, written there by the reduction itself)."""
        rows = self.view(flat)
        direct = out if self.ids is None else None
        reduction = torch.amax if reduce == "max" else torch.amin
        partial = reduction(rows, dim=1, keepdim=True) if direct is None else reduction(rows, dim=1, keepdim=True, out=direct)
        result = self._by_segment(partial, reduce)
        return result if out is None or result is out else out.copy_(result)

    def mean(self, flat: torch.Tensor, into: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Each segment's mean as a ``(segments, 1)`` column, the bits of ``segment_reduce(flat, "mean",
        segments)``: float32 sums of blocks of 32 elements added in float64 (a plain row mean where a row is no
        multiple of 32 long). ``into``: the name of a :func:`scratch` buffer for the result, where the caller
        reads it before it returns; ``out``: a ``(segments, 1)`` column to write it into (else a new tensor)."""
        length = self.length
        if length % _BLOCK:
            mean = torch.mean(self.view(flat), dim=1, keepdim=True)
            return mean if out is None else out.copy_(mean)
        accumulation = torch.float32 if flat.dtype.itemsize < 4 else None
        blocks = torch.sum(flat.view(self.rows, length // _BLOCK, _BLOCK), dim=2, keepdim=True, dtype=accumulation)
        if blocks.dtype != torch.float64:  # into float64 rows of the blocks' sums, kept with their 2-d view
            shape = tuple(blocks.shape)
            wide, rows = scratch_view(self.segments, "wide", shape, torch.float64, blocks.device, shape[:2])
            wide.copy_(blocks)
            blocks = rows
        else:
            blocks = blocks.view(self.rows, -1)
        sums = self._by_segment(torch.sum(blocks, dim=1, keepdim=True), "sum")
        if self.ids is None:
            sums.div_(constant(float(length), torch.float64, flat.device))
        else:
            sums.div_(self._lengths)
        if flat.dtype == torch.float64 and out is None:
            return sums
        if out is None:
            out = (
                torch.empty(sums.shape, dtype=flat.dtype, device=flat.device)
                if into is None
                else scratch(self.segments, into, tuple(sums.shape), flat.dtype, flat.device)
            )
        return out.copy_(sums)

@functools.lru_cache(maxsize=8)
def smallest_positive(dtype: torch.dtype) -> float:
    """The smallest positive number of a floating ``dtype`` (a subnormal one)."""
    zero = torch.zeros((), dtype=dtype)
    return float(torch.nextafter(zero, torch.ones((), dtype=dtype)))


def _lengths(segments: Segments) -> torch.Tensor:
    cache = segments.__dict__
    if "_lengths64" not in cache:
        cache["_lengths64"] = torch.tensor(segments.lengths, dtype=torch.float64, device=segments.device)
    return cache["_lengths64"]


def _plain_ok(mean: torch.Tensor) -> bool:
    """:func:`_plain_is_exact` in three calls: every mean finite and at least the floor (a NaN fails the
    comparison as it fails ``isfinite``). Reads the values on the host."""
    low = constant(_PLAIN_FLOOR, mean.dtype, mean.device)
    high = constant(torch.finfo(mean.dtype).max, mean.dtype, mean.device)
    return torch.equal(torch.clamp(mean, min=low, max=high), mean)


def _expanded(per_segment: torch.Tensor, segments: Segments) -> torch.Tensor:
    return segments.expand(per_segment.reshape(-1))


def segment_absmax(x: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Each segment's largest magnitude (``segment_reduce(x.abs(), "max", segments)``)."""
    matrix = Matrix.of(segments)
    if matrix is not None:
        return matrix.absmax(x.contiguous()).view(-1)
    return segment_reduce(x.abs(), "max", segments)


def segment_mean_abs(x: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Each segment's mean magnitude without overflow, as ``safe_mean_abs`` for one tensor: on the CPU the
    plain means first (kept unless one overflowed or came near underflow), else means of magnitudes divided
    by their segment's peak."""
    magnitude = x.abs()
    if x.device.type == "cpu":
        matrix = Matrix.of(segments)
        if matrix is not None:
            mean = matrix.mean(magnitude)
            if _plain_ok(mean):
                return mean.view(-1)
        else:
            mean = segment_reduce(magnitude, "mean", segments)
            if _plain_is_exact(mean):
                return mean
    peak = segment_reduce(magnitude, "max", segments)
    return peak * segment_reduce(magnitude.div_(_expanded(nonzero_or_one(peak), segments)), "mean", segments)


def segment_rms(x: torch.Tensor, segments: Segments, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each segment's root mean square without overflow or underflow, as ``safe_rms`` for one tensor; ``out``:
    a ``(segments, 1)`` column the result may be written into (and is then returned as it is), else flat."""
    if x.device.type == "cpu":
        matrix = Matrix.of(segments)
        if matrix is not None:
            mean_square = matrix.mean(torch.mul(x, x), out=out)
            if _plain_ok(mean_square):
                return mean_square.sqrt_() if out is not None else mean_square.sqrt_().view(-1)
        else:
            mean_square = segment_reduce(torch.mul(x, x), "mean", segments)
            if _plain_is_exact(mean_square):
                return mean_square.sqrt_()
    magnitude = x.abs()
    peak = segment_reduce(magnitude, "max", segments)
    scaled = magnitude.div_(_expanded(nonzero_or_one(peak), segments))
    return peak * segment_reduce(scaled.mul_(scaled), "mean", segments).sqrt()


def segment_std(x: torch.Tensor, segments: Segments, peak: torch.Tensor) -> torch.Tensor:
    """Each segment's population standard deviation without overflow, as ``safe_std`` (``peak``: each
    segment's largest magnitude); ``x`` flat, or the :class:`Matrix` view of it where the segments have one."""
    matrix = Matrix.of(segments)
    if matrix is not None:
        return _matrix_std(matrix, x if x.dim() == 2 else x.contiguous(), peak)
    groups = segments.groups
    scaled = groups.rowwise_into(
        lambda target, rows, p: torch.div(rows, p, out=target), [x], [nonzero_or_one(peak)], torch.empty_like(x)
    )
    mean = segment_reduce(scaled, "mean", segments)
    centred = groups.rowwise_into(
        lambda target, rows, m: torch.sub(rows, m, out=target).square_(), [scaled], [mean], scaled
    )
    return peak * segment_reduce(centred, "mean", segments).sqrt()


def _matrix_std(matrix: Matrix, x: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """:func:`segment_std` on a :class:`Matrix` (``x`` flat or its view), the same bits, shaped as ``peak`` (flat
    or a column). A zero peak is a segment of zeros: any nonzero divisor gives its zeros (``nonzero_or_one``'s
    1 or the smallest positive number alike)."""
    tiny = constant(smallest_positive(peak.dtype), peak.dtype, peak.device)
    scaled = torch.div(matrix.view(x), matrix.column(torch.clamp_min(peak, tiny)))
    centred = scaled.sub_(matrix.column(matrix.mean(scaled, into="mean")))
    root = matrix.mean(centred.mul_(centred), into="variance").sqrt_()
    return peak * (root if peak.dim() == 2 else root.view(-1))
