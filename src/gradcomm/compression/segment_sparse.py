"""Per-tensor budgets in a segmented bucket: ``k[s]`` elements of every segment (top-k, DGC, random-k).

:func:`segment_topk` chooses every tensor's ``k`` largest magnitudes row-wise on a strided run of equal tensors
(:class:`~gradcomm.compression.segments.Groups`) where they are one run, else all at once on the bucket's
:class:`~gradcomm.compression.segments.Chunks` (in buffers kept per layout): its calls are bounded whatever the
tensors and their shapes. Layouts that cut into no chunks (a tensor of odd length) go run by run.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence

import torch

from gradcomm.compression._numerics import sample_stride, sparse_nonzero, top_magnitudes
from gradcomm.compression._numerics.sparse import _counting
from gradcomm.compression.segments import Chunks, Groups, Segments, _starts

__all__ = ["Budget", "segment_topk"]


class Budget:
    """``k[s]`` elements chosen of each segment ``s``: their layout as segments of their own, and each
    choice's segment start (to turn indices within a segment into indices of the flat tensor)."""

    def __init__(self, segments: Segments, ks: Sequence[int]):
        self.segments = segments
        self.ks = tuple(ks)
        self.chosen = segments.relaid(self.ks)
        self.total = sum(self.ks)

    @functools.cached_property
    def starts(self) -> torch.Tensor:
        """Each chosen element's segment start in the flat tensor (int64)."""
        starts = torch.tensor(self.segments.starts, dtype=torch.int64, device=self.segments.device)
        return self.chosen.expand(starts)

    def starts_as(self, dtype: torch.dtype) -> torch.Tensor:
        """:attr:`starts` in ``dtype`` (an index dtype; cached): added to a payload's indices within their
        segments, in that dtype, with no conversion of them."""
        cache = self.__dict__.setdefault("_starts_as", {})
        if dtype not in cache:
            cache[dtype] = self.starts.to(dtype)
        return cache[dtype]

    @functools.cached_property
    def groups(self) -> Groups:
        """The segments by length and budget, in strided runs (:class:`Groups`)."""
        return Groups(self.segments, list(zip(self.segments.lengths, self.ks, strict=True)))

    def sampling(self, chunks: Chunks) -> _Sampling:
        """What :func:`_chunks_topk` needs of the layout cut into ``chunks``, made once (cached)."""
        cached = self.__dict__.get("_sampling")
        if cached is None:
            cached = self.__dict__["_sampling"] = _Sampling(self, chunks)
        return cached

    @functools.cached_property
    def order(self) -> torch.Tensor | None:
        """The order that puts the runs' choices back in segment order (``None``: they already are)."""
        grouped = [position for _, positions, _ in self.groups.runs for position in positions]
        if grouped == list(range(len(self.ks))):
            return None
        chosen_starts = _starts(self.ks)
        order = [chosen_starts[position] + j for position in grouped for j in range(self.ks[position])]
        inverse = [0] * len(order)
        for place, element in enumerate(order):
            inverse[element] = place
        return torch.tensor(inverse, dtype=torch.int64, device=self.segments.device)


class _Sampling:
    """What :func:`_chunks_topk` needs of a layout, made once: each segment's sample as
    :func:`~gradcomm.compression._numerics.top_magnitudes` takes it (every
    :func:`~gradcomm.compression._numerics.sample_stride`-th element from its start), laid side by side in one
    ``(segments, widest sample)`` matrix (padded with the -1 after the magnitudes); where each chunk's
    threshold lies among the sorted tops of the samples (its segment's place in its sample); where the
    segments begin; which of each row's sorted top ``max(k)`` are its own top ``k``; and the buffers of a
    call (:class:`_Scratch`)."""

    def __init__(self, budget: Budget, chunks: Chunks):
        segments = budget.segments
        device = segments.device
        strides = [sample_stride(n) for n in segments.lengths]
        counts = [-(-n // s) for n, s in zip(segments.lengths, strides, strict=True)]
        places = [min(m, -(-2 * k * m // n) + 1) for m, k, n in zip(counts, budget.ks, segments.lengths, strict=True)]
        self.chunks = chunks
        self.numel = segments.numel
        self.width = max(counts)
        self.deepest = max(places)
        column = torch.arange(self.width, device=device)
        start = torch.tensor(segments.starts, dtype=torch.int64, device=device).unsqueeze(1)
        step = torch.tensor(strides, dtype=torch.int64, device=device).unsqueeze(1)
        padding = column >= torch.tensor(counts, dtype=torch.int64, device=device).unsqueeze(1)
        self.index = torch.where(padding, segments.numel, start + column * step).reshape(-1)
        # each chunk's threshold: its segment's place in the flat (segments, deepest) sorted tops
        places_flat = torch.tensor(places, dtype=torch.int64, device=device).sub_(1)
        places_flat.add_(torch.arange(len(segments), device=device), alpha=self.deepest)
        self.chunk_places = places_flat.index_select(0, chunks.ids)
        self.starts = start.squeeze(1)
        self.ks = budget.ks
        self.widest = max(budget.ks)
        self.lanes = torch.arange(len(segments), device=device)
        dtype = segments.dtype
        floor = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps if dtype.is_floating_point else 1
        self.floor = torch.tensor(floor, dtype=dtype, device=device)
        """Below the smallest subnormal: a threshold of 0 made this, so that only nonzero elements are
        candidates (as top_magnitudes' threshold of 0)."""
        self.keep: torch.Tensor | None = None
        """Of each row's sorted top ``max(k)``, its first ``k[s]``, where budgets differ."""
        if min(budget.ks) != self.widest:
            ks = torch.tensor(budget.ks, dtype=torch.int64, device=device).unsqueeze(1)
            self.keep = (torch.arange(self.widest, device=device) < ks).reshape(-1).nonzero().squeeze(1)
        self._scratch: _Scratch | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def scratch(self, dtype: torch.dtype, device: torch.device) -> Iterator[_Scratch]:
        """The layout's buffers for one call (kept: no bucket-sized allocation per step), or new ones where
        another thread holds them."""
        if not self._lock.acquire(blocking=False):
            yield _Scratch(self, dtype, device)
            return
        try:
            if self._scratch is None or self._scratch.magnitudes.dtype != dtype:
                self._scratch = _Scratch(self, dtype, device)
            yield self._scratch
        finally:
            self._lock.release()


class _Scratch:
    """:func:`_chunks_topk`'s buffers for one layout: the magnitudes (and a -1 after them, which the samples'
    padding reads), the samples and their sorted tops, each chunk's threshold, the candidate mask, each
    segment's first candidate; views of them made once."""

    def __init__(self, sampling: _Sampling, dtype: torch.dtype, device: torch.device):
        chunks = sampling.chunks
        count = sampling.lanes.numel()
        self.magnitudes = torch.empty(sampling.numel + 1, dtype=dtype, device=device)
        self.magnitudes[-1] = -1
        self.flat = self.magnitudes[: sampling.numel]
        self.rows = self.flat.view(chunks.count, chunks.length)
        self.sample = torch.empty(count, sampling.width, dtype=dtype, device=device)
        self.sample_flat = self.sample.view(-1)
        self.tops = torch.empty(count, sampling.deepest, dtype=dtype, device=device)
        self.tops_flat = self.tops.view(-1)
        self.tops_index = torch.empty(count, sampling.deepest, dtype=torch.int64, device=device)
        self.thresholds = torch.empty(chunks.count, dtype=dtype, device=device)
        self.column = self.thresholds.view(-1, 1)
        self.mask = torch.empty(chunks.count, chunks.length, dtype=torch.bool, device=device)
        self.candidate = self.mask.view(-1)
        self.first = torch.empty(count, dtype=torch.int64, device=device)
        self.first_column = self.first.view(-1, 1)


def _chunks_topk(flat: torch.Tensor, budget: Budget, chunks: Chunks) -> torch.Tensor | None:
    """:func:`segment_topk` in a number of calls that depends neither on the segments nor on their shapes, for
    segments that cut into :class:`Chunks` (on the CPU): every segment's threshold from its own sample
    (top_magnitudes' sample and place, so the same thresholds), all in one ``(segments, widest sample)``
    matrix; the candidates of all segments at or above their thresholds (one comparison with a column per
    chunk); each segment's candidates packed into one row of a matrix, and every row's top ``k`` by one
    ``topk`` (sorted where budgets differ: each row's first ``k[s]``). ``None`` where some segment has fewer
    than ``k`` candidates (its threshold too high, or a mostly zero segment with fewer than ``k`` nonzero
    elements): then the caller chooses run by run."""
    sampling = budget.sampling(chunks)
    with sampling.scratch(flat.dtype, flat.device) as scratch:
        return _chosen(flat, budget, sampling, scratch)


def _chosen(flat: torch.Tensor, budget: Budget, sampling: _Sampling, scratch: _Scratch) -> torch.Tensor | None:
    """:func:`_chunks_topk` in ``scratch``'s buffers."""
    chunks = sampling.chunks
    count = len(budget.segments)
    magnitudes = torch.abs(flat, out=scratch.flat)
    torch.index_select(scratch.magnitudes, 0, sampling.index, out=scratch.sample_flat)
    torch.topk(scratch.sample, sampling.deepest, dim=1, out=(scratch.tops, scratch.tops_index))
    torch.index_select(scratch.tops_flat, 0, sampling.chunk_places, out=scratch.thresholds)
    torch.clamp_min_(scratch.thresholds, sampling.floor)
    torch.lt(scratch.rows, scratch.column, out=scratch.mask)
    candidate = scratch.candidate.bitwise_not_()  # NaN is never below its threshold: a candidate
    found = candidate.nonzero().view(-1)
    first = torch.searchsorted(found, sampling.starts, out=scratch.first)  # each segment's first candidate
    begins = first.tolist()  # the one host read
    per_segment = [end - begin for begin, end in zip(begins, [*begins[1:], found.numel()], strict=True)]
    if any(n < k for n, k in zip(per_segment, sampling.ks, strict=True)):
        return None
    # each segment's candidates side by side in a (segments, width) matrix padded with -1, by flat indices; a
    # choice there is a place in ``found``, which holds its index
    width = max(per_segment)
    segment = chunks.ids.index_select(0, found.div(chunks.length, rounding_mode="floor"))
    slots = torch.mul(sampling.lanes, width).sub_(first).index_select(0, segment)
    packed = torch.empty(count * width, dtype=magnitudes.dtype, device=magnitudes.device).fill_(-1)
    packed.scatter_(0, slots.add_(_counting(found.numel(), found.device)), magnitudes.index_select(0, found))
    # where budgets differ, a sorted top ``max(k)`` of every row, of which each row keeps its first ``k[s]``
    chosen = packed.view(count, width).topk(sampling.widest, dim=1, sorted=sampling.keep is not None).indices
    chosen = chosen.add_(scratch.first_column).view(-1)
    return found.index_select(0, chosen if sampling.keep is None else chosen.index_select(0, sampling.keep))


def segment_topk(flat: torch.Tensor, budget: Budget) -> torch.Tensor:
    """Indices (into ``flat``, int64) of the ``k[s]`` largest magnitudes of every segment ``s``, segment after
    segment, each segment's in no order. Segments of one length and budget at one stride are chosen together
    (row-wise on a strided view, :func:`_rows_topk`), so the calls grow with the number of runs of equal
    shapes (:class:`Groups`), not of tensors; a segment alone goes
    :func:`~gradcomm.compression._numerics.top_magnitudes`' way (the same set as ``torch.topk``'s). In more
    runs than one, where the segments cut into :class:`Chunks` (on the CPU), all segments at once
    (:func:`_chunks_topk`)."""
    flat = flat.contiguous()
    chunks = budget.segments.chunks
    if chunks is not None and flat.device.type == "cpu" and len(budget.groups.runs) > 1:
        indices = _chunks_topk(flat, budget, chunks)
        if indices is not None:
            return indices
    groups = budget.groups
    found = []
    for (length, positions, _), rows in zip(groups.runs, groups.rows(flat), strict=True):
        k = budget.ks[positions[0]]
        start = budget.segments.starts[positions[0]]
        if len(positions) == 1:
            found.append(top_magnitudes(flat[start : start + length], k).add_(start))
            continue
        columns = _rows_topk(rows.abs(), k)
        found.append(columns.add_(groups.run_starts(positions)).view(-1))
    indices = found[0] if len(found) == 1 else torch.cat(found)
    return indices if budget.order is None else indices.index_select(0, budget.order)


def _rows_topk(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the ``k`` largest of every row of a 2-D tensor of magnitudes (as ``topk(k, dim=1)``'s, up to
    ties). On the CPU, for long rows and small ``k``, top_magnitudes' way for all rows at once: a threshold per
    row from a strided sample, the candidates at or above it (few) packed into a small matrix, and the top
    ``k`` of that; where a row has fewer than ``k`` candidates, or thresholds are 0, the plain ``topk``."""
    count, length = magnitudes.shape
    stride = sample_stride(length)
    if magnitudes.device.type != "cpu" or stride < 16 or k > length // 4:
        return magnitudes.topk(k, dim=1, sorted=False).indices
    sample = magnitudes[:, ::stride]
    place = min(sample.shape[1], -(-2 * k * sample.shape[1] // length) + 1)
    thresholds = sample.topk(place, dim=1, sorted=True).values[:, -1:]
    if bool((thresholds == 0).any()):
        return magnitudes.topk(k, dim=1, sorted=False).indices
    # into int8, then read as bool: a comparison into bool is not vectorised on the CPU
    below = torch.lt(magnitudes, thresholds, out=torch.empty(magnitudes.shape, dtype=torch.int8))
    candidate = below.view(torch.bool).logical_not_()  # NaN is never below: a candidate
    found = sparse_nonzero(candidate.view(-1)) if 64 * k <= length else candidate.view(-1).nonzero().squeeze(1)
    row = found.div(length, rounding_mode="floor")
    per_row = torch.bincount(row, minlength=count)  # of the few found: a sum along rows reads every element
    if bool((per_row < k).any()):
        return magnitudes.topk(k, dim=1, sorted=False).indices
    # each row's candidates side by side in a (count, width) matrix padded with -1, by flat indices (a 2-D
    # index_put_ is several times slower); a choice there is a place in ``found``, which holds its column
    width = int(per_row.max())
    first = per_row.cumsum(0).sub_(per_row)
    lanes = torch.arange(count, device=found.device)
    slots = torch.arange(found.numel(), device=found.device).add_((lanes * width - first).index_select(0, row))
    values = magnitudes.reshape(-1).index_select(0, found)
    packed = magnitudes.new_full((count * width,), -1.0).index_copy_(0, slots, values).view(count, width)
    chosen = packed.topk(k, dim=1, sorted=False).indices.add_(first.unsqueeze(1))
    return found.index_select(0, chosen.view(-1)).view(count, k).sub_((lanes * length).unsqueeze(1))


