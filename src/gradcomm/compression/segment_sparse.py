"""Per-tensor budgets in a segmented bucket: ``k[s]`` elements of every segment (top-k, DGC, random-k).

:func:`segment_topk` chooses every tensor's ``k`` largest magnitudes row-wise on strided runs of equal tensors
(:class:`~gradcomm.compression.segments.Groups`) where they are few, else all at once on the bucket's
:class:`~gradcomm.compression.segments.Chunks`: its calls are bounded whatever the tensors and their shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from gradcomm.compression._numerics import sample_stride, sparse_nonzero, top_magnitudes
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

    @functools.cached_property
    def groups(self) -> Groups:
        """The segments by length and budget, in strided runs (:class:`Groups`)."""
        return Groups(self.segments, list(zip(self.segments.lengths, self.ks, strict=True)))

    @functools.cached_property
    def sampling(self) -> _Sampling:
        """Where :func:`_chunks_topk` samples each segment, and at which place of its sample the threshold lies
        (cached)."""
        return _Sampling(self)

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


_FEW_RUNS = 3
"""Up to this many runs of equal segments and budgets, :func:`segment_topk` chooses run by run (fewer calls and
less CPU time than chunks); beyond, in chunks, in calls that do not grow with the runs."""


class _Sampling:
    """Each segment's sample as :func:`~gradcomm.compression._numerics.top_magnitudes` takes it (every
    :func:`~gradcomm.compression._numerics.sample_stride`-th element from its start), laid side by side in one
    ``(segments, widest sample)`` matrix, and the place in its sample of each segment's threshold."""

    def __init__(self, budget: Budget):
        segments = budget.segments
        device = segments.device
        strides = [sample_stride(n) for n in segments.lengths]
        counts = [-(-n // s) for n, s in zip(segments.lengths, strides, strict=True)]
        places = [min(m, -(-2 * k * m // n) + 1) for m, k, n in zip(counts, budget.ks, segments.lengths, strict=True)]
        width = max(counts)
        column = torch.arange(width, device=device)
        start = torch.tensor(segments.starts, dtype=torch.int64, device=device).unsqueeze(1)
        step = torch.tensor(strides, dtype=torch.int64, device=device).unsqueeze(1)
        self.padding = column >= torch.tensor(counts, dtype=torch.int64, device=device).unsqueeze(1)
        self.index = torch.where(self.padding, 0, start + column * step).reshape(-1)
        self.width = width
        self.deepest = max(places)
        self.place = torch.tensor(places, dtype=torch.int64, device=device).sub_(1).unsqueeze(1)
        self.ks = torch.tensor(budget.ks, dtype=torch.int64, device=device)
        self.candidates_few = 64 * budget.total <= segments.numel
        widest = max(budget.ks)
        self.keep: torch.Tensor | None = None  # of each row's sorted top ``widest``, the first ``k[s]``
        self.filler: torch.Tensor | None = None  # of ``widest`` places after a row, those of padding
        if min(budget.ks) != widest:
            kept = torch.arange(widest, device=device) < self.ks.unsqueeze(1)
            self.keep = kept.reshape(-1).nonzero().squeeze(1)
            self.filler = torch.arange(widest, device=device) < (widest - self.ks).unsqueeze(1)


def _chunks_topk(flat: torch.Tensor, budget: Budget, chunks: Chunks) -> torch.Tensor | None:
    """:func:`segment_topk` in a number of calls that does not depend on the segments, for segments that cut
    into :class:`Chunks` (on the CPU): every segment's threshold from its own sample (top_magnitudes' sample
    and place, so the same thresholds), all in one ``(segments, widest sample)`` matrix; the candidates of
    all segments at or above their thresholds (one comparison with a column per chunk), packed one row per
    segment, and every row's top ``k``. ``None`` where some segment has fewer than ``k`` candidates (its
    threshold too high, or a mostly zero segment with fewer than ``k`` nonzero elements): then the caller
    chooses run by run. A zero threshold counts only the nonzero elements, as top_magnitudes does."""
    sampling = budget.sampling
    count = len(budget.segments)
    magnitudes = flat.abs()
    sample = magnitudes.index_select(0, sampling.index).view(count, sampling.width).masked_fill_(sampling.padding, -1)
    thresholds = sample.topk(sampling.deepest, dim=1, sorted=True).values.gather(1, sampling.place)
    # a zero threshold: every nonzero element is a candidate (below the smallest subnormal: zero alone)
    smallest = torch.finfo(flat.dtype).smallest_normal * torch.finfo(flat.dtype).eps
    thresholds = thresholds.clamp_(min=smallest)
    rows = chunks.rows(magnitudes)
    # into int8, then read as bool: a comparison into bool is not vectorised on the CPU
    below = torch.lt(rows, chunks.column(thresholds), out=torch.empty(rows.shape, dtype=torch.int8))
    candidate = below.view(torch.bool).logical_not_().view(-1)  # NaN is never below: a candidate
    found = sparse_nonzero(candidate) if sampling.candidates_few else candidate.nonzero().squeeze(1)
    segment = chunks.ids.index_select(0, found.div(chunks.length, rounding_mode="floor"))
    per_segment = torch.bincount(segment, minlength=count)
    if bool((per_segment < sampling.ks).any()):
        return None
    # each segment's candidates side by side in a (segments, width) matrix padded with -1, by flat indices; a
    # choice there is a place in ``found``, which holds its index
    width = int(per_segment.max())
    first = per_segment.cumsum(0).sub_(per_segment)
    lanes = torch.arange(count, device=found.device)
    slots = torch.arange(found.numel(), device=found.device).add_((lanes * width - first).index_select(0, segment))
    values = magnitudes.index_select(0, found)
    if sampling.keep is None:
        packed = magnitudes.new_full((count * width,), -1.0).index_copy_(0, slots, values).view(count, width)
        chosen = packed.topk(budget.ks[0], dim=1, sorted=False).indices.add_(first.unsqueeze(1)).view(-1)
        return found.index_select(0, chosen)
    # budgets differ: each row padded with ``max(k) - k[s]`` NaNs after its candidates, so that one unsorted top
    # ``max(k)`` of every row (NaN counting as largest) holds them and the row's top ``k[s]``, told apart by
    # column: a sorted top ``max(k)`` cost more than the rest of the selection together. A row of more than
    # ``k[s]`` NaN candidates (whose choice among NaNs could leave some padding out) is chosen sorted.
    deepest = max(budget.ks)
    slots.add_(segment, alpha=deepest)  # rows of ``width + deepest`` places
    packed = magnitudes.new_full((count, width + deepest), -1.0)
    packed[:, width:].masked_fill_(sampling.filler, torch.nan)
    packed.view(-1).index_copy_(0, slots, values)
    chosen = packed.topk(deepest, dim=1, sorted=False).indices
    candidates = chosen < width
    chosen = chosen.add_(first.unsqueeze(1)).masked_select(candidates)
    if chosen.numel() == budget.total:
        return found.index_select(0, chosen)
    packed = packed[:, :width].nan_to_num(nan=torch.inf)  # real NaNs as the largest, the padding left out
    chosen = packed.topk(deepest, dim=1, sorted=True).indices.add_(first.unsqueeze(1))
    return found.index_select(0, chosen.view(-1).index_select(0, sampling.keep))


def segment_topk(flat: torch.Tensor, budget: Budget) -> torch.Tensor:
    """Indices (into ``flat``, int64) of the ``k[s]`` largest magnitudes of every segment ``s``, segment after
    segment, each segment's in no order. Segments of one length and budget at one stride are chosen together
    (row-wise on a strided view, :func:`_rows_topk`), so the calls grow with the number of runs of equal
    shapes (:class:`Groups`), not of tensors; a segment alone goes
    :func:`~gradcomm.compression._numerics.top_magnitudes`' way (the same set as ``torch.topk``'s). Beyond
    :data:`_FEW_RUNS` runs, where the segments cut into :class:`Chunks` (on the CPU), all segments at once
    (:func:`_chunks_topk`)."""
    flat = flat.contiguous()
    chunks = budget.segments.chunks
    if chunks is not None and flat.device.type == "cpu" and len(budget.groups.runs) > _FEW_RUNS:
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


