"""A segmented bucket: the tensors a hook compresses, back to back in one flat tensor, with their lengths and keys.

A compressor that works on a :class:`Segments` layout encodes a whole bucket at once while keeping each
tensor's own statistics (scales, norms, maxima, budgets, random draws): per-tensor values come from
row-wise operations on the bucket cut into chunks that never cross a tensor (:class:`Chunks`), or on runs of
equal tensors (:class:`Groups`), so the number of torch calls per bucket does not grow with its number of
tensors (budgets and top-k: :mod:`~gradcomm.compression.segment_sparse`;
random bits: :mod:`~gradcomm.compression.segment_noise`). The index tensors these need (each element's segment, its
place in a layout where every segment is padded to a multiple, each packed byte's segment) are computed
once per layout and kept on the :class:`Segments` object, which the hook keeps per bucket layout.

Helpers here are what several methods share: per-segment reductions and their broadcast back to elements
(:func:`segment_reduce`, :meth:`Segments.expand`); bit packing whose bytes are those of packing every tensor
on its own is in :mod:`~gradcomm.compression.segment_bits` (its names still resolve here, with a warning), random bits keyed
by segment in :mod:`~gradcomm.compression.segment_noise`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gradcomm._moved import moved_names

__all__ = [
    "Chunks",
    "Groups",
    "Segments",
    "as_dtype",
    "segment_reduce",
]

if TYPE_CHECKING:
    from gradcomm.compression.segment_sparse import Budget


@dataclass(frozen=True, eq=False)
class Segments:
    """The layout of a flat tensor holding several tensors back to back: their lengths, keys and shapes.

    Equal layouts compare by identity (the hook keeps one object per bucket layout, with its index tensors)."""

    lengths: tuple[int, ...]
    keys: tuple[Hashable, ...]
    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], keys: Sequence[Hashable]) -> Segments:
        """The layout of ``tensors`` concatenated (all of one dtype and device)."""
        return cls(
            tuple(t.numel() for t in tensors),
            tuple(keys),
            tuple(t.shape for t in tensors),
            tensors[0].dtype,
            tensors[0].device,
        )

    def __len__(self) -> int:
        return len(self.lengths)

    @functools.cached_property
    def numel(self) -> int:
        return sum(self.lengths)

    @functools.cached_property
    def starts(self) -> tuple[int, ...]:
        """Where each segment begins in the flat tensor."""
        return tuple(_starts(self.lengths))

    @functools.cached_property
    def lengths_tensor(self) -> torch.Tensor:
        return torch.tensor(self.lengths, dtype=torch.int64, device=self.device)

    @functools.cached_property
    def ids(self) -> torch.Tensor:
        """Each element's segment (int64)."""
        return _ids(self.lengths, self.device)

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """Each element's place within its segment (int64)."""
        starts = torch.tensor(self.starts, dtype=torch.int64, device=self.device)
        return torch.arange(self.numel, device=self.device).sub_(starts.index_select(0, self.ids))

    def expand(self, per_segment: torch.Tensor) -> torch.Tensor:
        """One value per segment broadcast to its elements (``per_segment`` flat, of ``len(self)`` values)."""
        if len(self) == 1:
            return per_segment.reshape(1).expand(self.numel)
        chunks = self.chunks
        if chunks is not None:
            return chunks.column(per_segment).expand(chunks.count, chunks.length).reshape(-1)
        groups = self.groups
        if len(groups.runs) > _MAX_RUNS or self.numel <= _SMALL:
            return per_segment.index_select(0, self.ids)
        out = per_segment.new_empty(self.numel)
        for rows, values in zip(groups.rows(out), groups.per_run(per_segment), strict=True):
            rows.copy_(values.unsqueeze(1).expand(rows.shape))
        return out

    def relaid(self, lengths: Sequence[int]) -> Segments:
        """The same segments with other lengths (a padded layout's), cached per lengths."""
        cache = self.__dict__.setdefault("_relaid", {})
        key = tuple(lengths)
        if key not in cache:
            cache[key] = Segments(key, self.keys, self.shapes, self.dtype, self.device)
        return cache[key]

    def chunked(self, size: int) -> Segments:
        """Every segment cut into chunks of ``size`` elements (its last one shorter), each chunk a segment
        keyed ``(key, j)``: the same flat tensor, laid out for per-chunk statistics and budgets (cached per
        size). Chunks of one length lie at one stride, so per-chunk work goes by :class:`Groups` runs."""
        cache = self.__dict__.setdefault("_chunked", {})
        if size not in cache:
            lengths, keys = [], []
            for key, length in zip(self.keys, self.lengths, strict=True):
                for j, start in enumerate(range(0, length, size)):
                    lengths.append(min(size, length - start))
                    keys.append((key, j))
            shapes = tuple(torch.Size([n]) for n in lengths)
            cache[size] = Segments(tuple(lengths), tuple(keys), shapes, self.dtype, self.device)
        return cache[size]

    @functools.cached_property
    def chunks(self) -> Chunks | None:
        """The segments cut into chunks of one length, where one divides them all and they are more than one
        run (cached; :meth:`Chunks.of`)."""
        return Chunks.of(self)

    @functools.cached_property
    def groups(self) -> Groups:
        """The segments by length, as strided views of the flat tensor where they can be (cached)."""
        return Groups(self, self.lengths)

    def budget(self, ks: Sequence[int]) -> Budget:
        """``ks[s]`` elements chosen of each segment (cached per budget)."""
        from gradcomm.compression.segment_sparse import Budget

        cache = self.__dict__.setdefault("_budgets", {})
        key = tuple(ks)
        if key not in cache:
            cache[key] = Budget(self, key)
        return cache[key]

    def padded(self, multiple: int) -> Padded:
        """This layout with every segment padded to a multiple of ``multiple`` elements (cached)."""
        cache = self.__dict__.setdefault("_padded", {})
        if multiple not in cache:
            cache[multiple] = Padded(self, multiple)
        return cache[multiple]


class Padded:
    """A :class:`Segments` layout with each segment padded (at its end) to a multiple of ``multiple``."""

    def __init__(self, segments: Segments, multiple: int):
        self.segments = segments
        self.multiple = multiple
        self.lengths = tuple(-(-n // multiple) * multiple for n in segments.lengths)
        self.numel = sum(self.lengths)
        self.aligned = self.lengths == segments.lengths
        self._index: torch.Tensor | None = None

    @property
    def index(self) -> torch.Tensor:
        """Each element's place in the padded layout (only where it is not aligned)."""
        if self._index is None:
            self._index = _placement(self.segments.lengths, self.lengths, self.segments.device)
        return self._index

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` in the padded layout, zeros in the padding (``flat`` itself where aligned)."""
        if self.aligned:
            return flat
        return flat.new_zeros(self.numel).index_copy_(0, self.index, flat)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """The elements of a padded layout, without the padding."""
        if self.aligned:
            return padded[: self.segments.numel]
        return padded.index_select(0, self.index)

    @functools.cached_property
    def ids(self) -> torch.Tensor:
        """Each padded element's segment."""
        return _ids(self.lengths, self.segments.device)

    @functools.cached_property
    def as_segments(self) -> Segments:
        """The padded layout as segments of its own."""
        return self.segments.relaid(self.lengths)


def _starts(lengths: Sequence[int]) -> list[int]:
    starts, total = [], 0
    for length in lengths:
        starts.append(total)
        total += length
    return starts


def _placement(lengths: Sequence[int], wider: Sequence[int], device: torch.device) -> torch.Tensor:
    """Where each element of segments of ``lengths`` lies when segment ``s`` starts a segment of ``wider[s]``
    elements."""
    shifts = [w - n for w, n in zip(_starts(wider), _starts(lengths), strict=True)]
    ids = _ids(lengths, device)
    return torch.arange(len(ids), device=device).add_(
        torch.tensor(shifts, dtype=torch.int64, device=device).index_select(0, ids)
    )


def _ids(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    counts = torch.tensor(lengths, dtype=torch.int64, device=device)
    return torch.arange(len(lengths), device=device).repeat_interleave(counts, output_size=sum(lengths))


_MAX_RUNS = 16
"""Up to this many runs, a per-segment value is broadcast run by run; beyond, by one gather by segment."""

_SMALL = 1 << 16
"""Layouts of at most this many elements (top-k's chosen values, say) are broadcast by one gather by segment:
its index costs less than a call per run."""

_CHUNK_MAX = 1024
_CHUNK_MIN = 32


class Chunks:
    """Segments whose lengths are all multiples of one power of two, ``length`` (at most
    :data:`_CHUNK_MAX`): the flat tensor is one ``(count, length)`` matrix whose rows (chunks) never cross a
    segment boundary, each segment a block of consecutive rows. A per-segment reduction is a row-wise one
    then a reduction of the few row results by segment, a per-segment value broadcasts as one column
    (``(count, 1)``), so the calls are the same whatever the number of segments, their shapes and their
    arrangement, and every pass is one vectorised call over the whole bucket (real models' weights are
    multiples of 512 or 1024 elements; runs of equal shapes, :class:`Groups`, serve the other layouts)."""

    def __init__(self, segments: Segments, length: int):
        self.segments = segments
        self.length = length
        self.count = segments.numel // length
        self.ids = _ids([n // length for n in segments.lengths], segments.device)

    @staticmethod
    def of(segments: Segments) -> Chunks | None:
        """The chunks of ``segments``, or ``None`` where they are one run of equal segments at one stride
        (whose ``(count, length)`` view costs fewer calls than chunks) or no length fits."""
        if len(segments) < 2 or (len(segments.groups.runs) == 1 and segments.groups.order is None):
            return None
        divisor = math.gcd(*segments.lengths)
        length = min(divisor & -divisor, _CHUNK_MAX)
        return Chunks(segments, length) if length >= _CHUNK_MIN else None

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (laid out as the segments, contiguous) as a ``(count, length)`` view."""
        return flat.view(self.count, self.length)

    def column(self, per_segment: torch.Tensor) -> torch.Tensor:
        """Each chunk's segment's value, as a ``(count, 1)`` column."""
        return per_segment.index_select(0, self.ids).view(-1, 1)

    @functools.cached_property
    def byte_offsets(self) -> torch.Tensor:
        """``256 *`` each chunk's segment, an int32 column: the first row of a segment's table of byte
        patterns in :func:`_decode_by_segment`."""
        return self.ids.to(torch.int32).mul_(256).unsqueeze(1)

    @functools.cached_property
    def _lengths(self) -> torch.Tensor:
        return torch.tensor(self.segments.lengths, dtype=torch.float64, device=self.segments.device)

    def reduce(self, values: torch.Tensor, reduce: str) -> torch.Tensor:
        """One ``reduce`` per segment of contiguous flat ``values``: row-wise, then the rows' results by
        segment. Sums and means add float32 sums of blocks of 32 elements in float64 (no less accurate than one float32
        sum of each segment: measured in docs/notes/2026-11-28-segmented-codecs.md), and the same in any
        layout (:func:`_block_sums`)."""
        rows = self.rows(values)
        segments = len(self.segments)
        if reduce in ("max", "min"):
            partial = _REDUCTIONS[reduce](rows, dim=1)
            return partial.new_empty(segments).scatter_reduce_(0, self.ids, partial, "a" + reduce, include_self=False)
        sums = _block_sums(rows)
        total = torch.zeros(segments, dtype=torch.float64, device=values.device).index_add_(0, self.ids, sums)
        if reduce == "mean":
            total.div_(self._lengths)
        return total.to(values.dtype)


class Groups:
    """Segments of one length (and budget, for :class:`Budget`), in runs at one stride in the flat tensor: a
    run is a ``(count, length)`` strided view (a layer repeated in every block of a model lies at one stride),
    so per-segment reductions and selections are row-wise ones on views, a few calls per run, and the runs
    grow with the number of distinct shapes (and their arrangement), not of tensors."""

    def __init__(self, segments: Segments, classes: Sequence[Hashable]):
        self.segments = segments
        members: dict[Hashable, list[int]] = {}
        for position, cls in enumerate(classes):
            members.setdefault(cls, []).append(position)
        self.runs: list[tuple[int, list[int], int]] = []  # (length, positions, stride)
        for positions in members.values():
            length = segments.lengths[positions[0]]
            self.runs.extend((length, run, stride) for run, stride in _arithmetic_runs(positions, segments.starts, length))
        grouped = [position for _, positions, _ in self.runs for position in positions]
        self.order: torch.Tensor | None = None
        if grouped != list(range(len(segments))):
            inverse = [0] * len(grouped)
            for place, position in enumerate(grouped):
                inverse[position] = place
            self.order = torch.tensor(inverse, dtype=torch.int64, device=segments.device)

    def rows(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each run of ``flat`` (laid out as the segments) as a ``(count, length)`` view."""
        offset = flat.storage_offset()
        return [
            flat.as_strided((len(positions), length), (stride, 1), offset + self.segments.starts[positions[0]])
            for length, positions, stride in self.runs
        ]

    @functools.cached_property
    def _run_positions(self) -> list[torch.Tensor]:
        device = self.segments.device
        return [torch.tensor(positions, dtype=torch.int64, device=device) for _, positions, _ in self.runs]

    def run_starts(self, positions: list[int]) -> torch.Tensor:
        """The starts of a run's segments, as a column (cached)."""
        cache = self.__dict__.setdefault("_run_starts", {})
        key = tuple(positions)
        if key not in cache:
            starts = [self.segments.starts[p] for p in positions]
            cache[key] = torch.tensor(starts, dtype=torch.int64, device=self.segments.device).unsqueeze(1)
        return cache[key]

    def per_run(self, per_segment: torch.Tensor) -> list[torch.Tensor]:
        """One value per segment, split by run."""
        if len(self.runs) == 1 and self.order is None:
            return [per_segment]
        return [per_segment.index_select(0, positions) for positions in self._run_positions]

    def rowwise(
        self,
        fn: Callable[..., torch.Tensor],
        inputs: Sequence[torch.Tensor],
        per_segment: Sequence[torch.Tensor],
        out: torch.Tensor,
    ) -> torch.Tensor:
        """``out`` (flat, laid out as the segments) holding ``fn(*rows, *columns)`` run by run: ``rows``, each
        flat input's ``(count, length)`` view of the run, ``columns``, each per-segment value of the run's
        segments as a ``(count, 1)`` column, so that ``fn`` broadcasts as row-wise code does (no per-element
        copy of a per-segment value). Where the segments cut into :class:`Chunks`, one call on the chunks with
        the values as columns; beyond :data:`_MAX_RUNS` runs, one call on the whole tensor as one row with the
        values expanded to it."""
        chunks = self.segments.chunks
        if chunks is not None:
            columns = [chunks.column(v) for v in per_segment]
            chunks.rows(out).copy_(fn(*(chunks.rows(x.contiguous()) for x in inputs), *columns))
            return out
        if len(self.runs) > _MAX_RUNS:
            columns = [self.segments.expand(v).unsqueeze(0) for v in per_segment]
            out.view(1, -1).copy_(fn(*(x.view(1, -1) for x in inputs), *columns))
            return out
        columns = [self.per_run(v) for v in per_segment]
        views = [self.rows(x.contiguous()) for x in inputs]
        for index, rows_out in enumerate(self.rows(out)):
            rows_out.copy_(fn(*(v[index] for v in views), *(c[index].unsqueeze(1) for c in columns)))
        return out

    def rowwise_into(
        self,
        fn: Callable[..., object],
        inputs: Sequence[torch.Tensor],
        per_segment: Sequence[torch.Tensor],
        out: torch.Tensor,
    ) -> torch.Tensor:
        """As :meth:`rowwise`, for an ``fn(target, *rows, *columns)`` that writes its result into ``target``
        (``out``'s view of the run: an ``out=`` argument, or in place), with no result to copy there. ``out``
        may be one of ``inputs`` (elementwise operations, in place)."""
        chunks = self.segments.chunks
        if chunks is not None:
            columns = [chunks.column(v) for v in per_segment]
            fn(chunks.rows(out), *(chunks.rows(x.contiguous()) for x in inputs), *columns)
            return out
        if len(self.runs) > _MAX_RUNS:
            columns = [self.segments.expand(v).unsqueeze(0) for v in per_segment]
            fn(out.view(1, -1), *(x.view(1, -1) for x in inputs), *columns)
            return out
        columns = [self.per_run(v) for v in per_segment]
        views = [self.rows(x.contiguous()) for x in inputs]
        for index, rows_out in enumerate(self.rows(out)):
            fn(rows_out, *(v[index] for v in views), *(c[index].unsqueeze(1) for c in columns))
        return out

    def in_order(self, per_run: list[torch.Tensor]) -> torch.Tensor:
        """Per-segment results of the runs (one flat tensor per run), in segment order."""
        joined = per_run[0] if len(per_run) == 1 else torch.cat(per_run)
        return joined if self.order is None else joined.index_select(0, self.order)


def _arithmetic_runs(positions: list[int], starts: Sequence[int], length: int) -> list[tuple[list[int], int]]:
    """``positions`` split into runs whose starts are evenly spaced, at least ``length`` apart (greedily)."""
    left = list(positions)
    runs = []
    while left:
        first = left.pop(0)
        run, stride = [first], length
        if left:
            stride = starts[left[0]] - starts[first]
            by_start = {starts[p]: p for p in left}
            nxt = starts[first] + stride
            while stride >= length and nxt in by_start:
                run.append(by_start.pop(nxt))
                nxt += stride
            taken = set(run)  # a list's membership test made this quadratic in the segments
            left = [p for p in left if p not in taken]
            if len(run) == 1:
                stride = length
        runs.append((run, stride))
    return runs


_REDUCTIONS = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}

_BLOCK = 32
"""A segment whose length is a multiple of this many elements is summed as float32 sums of its blocks of
this many, added in float64 (:func:`_block_sums`), whatever its layout."""


def _block_sums(rows: torch.Tensor) -> torch.Tensor:
    """Sums of the rows of a 2-D ``rows`` (each a multiple of :data:`_BLOCK` long, inner dimension
    contiguous), in float64: float32 sums of blocks of :data:`_BLOCK` (vectorised, as fast as one float32
    sum), added in float64. A segment's sum depends on its elements alone, not on how a layout cuts it
    (chunks, rows of a run, a single tensor), but for a tie in the last float64 bit."""
    count, length = rows.shape
    blocks = rows.unflatten(1, (length // _BLOCK, _BLOCK)).sum(dim=2, dtype=_accumulation(rows.dtype))
    return blocks.sum(dim=1, dtype=torch.float64)


def _accumulation(dtype: torch.dtype) -> torch.dtype | None:
    return torch.float32 if dtype.itemsize < 4 else None


def _sums(rows: torch.Tensor, reduce: str) -> torch.Tensor:
    """Row sums or means of a 2-D ``rows``, in its dtype: by blocks (:func:`_block_sums`) where the rows are a
    multiple of :data:`_BLOCK` long, else float32 row sums (or means)."""
    length = rows.shape[1]
    if length % _BLOCK or not rows.dtype.is_floating_point:
        return _REDUCTIONS[reduce](rows, dim=1)
    sums = _block_sums(rows)
    return (sums.div_(length) if reduce == "mean" else sums).to(rows.dtype)


def segment_reduce(values: torch.Tensor, reduce: str, segments: Segments) -> torch.Tensor:
    """One ``reduce`` (``"sum"``, ``"mean"``, ``"max"``, ``"min"``) per segment of flat ``values``: row-wise
    reductions of chunks (:class:`Chunks`) where the segments cut into them, else of strided views, one per
    run of equal segments (:class:`Groups`), else (a single segment) of the whole. Sums and means of segments
    a multiple of :data:`_BLOCK` long are the same in every layout (:func:`_block_sums`)."""
    function = _REDUCTIONS[reduce]
    summed = reduce in ("sum", "mean")
    if len(segments) == 1:
        return _sums(values.view(1, -1), reduce) if summed else function(values).reshape(1)
    if segments.chunks is not None:
        return segments.chunks.reduce(values.contiguous(), reduce)
    groups = segments.groups
    rows = groups.rows(values.contiguous())
    return groups.in_order([_sums(r, reduce) if summed else function(r, dim=1) for r in rows])


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``: itself where it is already (no operator at all, where ``.to`` is one)."""
    return x if x.dtype == dtype else x.to(dtype)


__getattr__ = moved_names(
    __name__,
    {
        **dict.fromkeys(
            ("packed_lengths", "pack_segments", "scaled_signs_layout", "pack_scaled_signs", "unpack_scaled_signs",
             "decode_segments"),
            "gradcomm.compression.segment_bits",
        ),
        **dict.fromkeys(("segment_mean_abs", "segment_rms", "segment_std"), "gradcomm.compression.segment_stats"),
    },
)
