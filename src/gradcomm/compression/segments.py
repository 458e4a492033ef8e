"""A segmented bucket: the tensors a hook compresses, back to back in one flat tensor, with their lengths and keys.

A compressor that works on a :class:`Segments` layout encodes a whole bucket at once while keeping each
tensor's own statistics (scales, norms, maxima, budgets, random draws): per-tensor values come from
segmented operations (``torch.segment_reduce``, a gather by segment index), so the number of torch calls per
bucket does not grow with its number of tensors. The index tensors these need (each element's segment, its
place in a layout where every segment is padded to a multiple, each packed byte's segment) are computed
once per layout and kept on the :class:`Segments` object, which the hook keeps per bucket layout.

Helpers here are what several methods share: per-segment reductions and their broadcast back to elements
(:func:`segment_reduce`, :meth:`Segments.expand`), bit packing whose bytes are those of packing every tensor
on its own (:func:`pack_segments`, :func:`decode_segments`), and random bits keyed by segment
(:func:`segment_noise`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from gradcomm.compression._numerics import (
    decode_bits,
    gather_rows,
    nonzero_or_one,
    pack_bits,
    sample_stride,
    sparse_nonzero,
    top_magnitudes,
    unpack_bits,
)
from gradcomm.compression._numerics.reductions import _plain_is_exact

__all__ = [
    "Segments",
    "as_dtype",
    "decode_segments",
    "pack_segments",
    "segment_mean_abs",
    "segment_noise",
    "segment_reduce",
    "segment_rms",
]


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
        groups = self.groups
        if len(groups.runs) > _MAX_RUNS:
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

    @functools.cached_property
    def groups(self) -> Groups:
        """The segments by length, as strided views of the flat tensor where they can be (cached)."""
        return Groups(self, self.lengths)

    def budget(self, ks: Sequence[int]) -> Budget:
        """``ks[s]`` elements chosen of each segment (cached per budget)."""
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
        copy of a per-segment value). Beyond :data:`_MAX_RUNS` runs, one call on the whole tensor as one row
        with the values expanded to it."""
        if len(self.runs) > _MAX_RUNS:
            columns = [self.segments.expand(v).unsqueeze(0) for v in per_segment]
            out.view(1, -1).copy_(fn(*(x.view(1, -1) for x in inputs), *columns))
            return out
        columns = [self.per_run(v) for v in per_segment]
        views = [self.rows(x.contiguous()) for x in inputs]
        for index, rows_out in enumerate(self.rows(out)):
            rows_out.copy_(fn(*(v[index] for v in views), *(c[index].unsqueeze(1) for c in columns)))
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
            left = [p for p in left if p not in run]
            if len(run) == 1:
                stride = length
        runs.append((run, stride))
    return runs


_REDUCTIONS = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}


def segment_reduce(values: torch.Tensor, reduce: str, segments: Segments) -> torch.Tensor:
    """One ``reduce`` (``"sum"``, ``"mean"``, ``"max"``, ``"min"``) per segment of flat ``values``: row-wise
    reductions of strided views, one per run of equal segments (:class:`Groups`); a single segment is
    reduced by the plain reduction (the same bits as before segments)."""
    function = _REDUCTIONS[reduce]
    if len(segments) == 1:
        return function(values).reshape(1)
    groups = segments.groups
    return groups.in_order([function(rows, dim=1) for rows in groups.rows(values.contiguous())])


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``: itself where it is already (no operator at all, where ``.to`` is one)."""
    return x if x.dtype == dtype else x.to(dtype)


def _expanded(per_segment: torch.Tensor, segments: Segments) -> torch.Tensor:
    return segments.expand(per_segment.reshape(-1))


def segment_mean_abs(x: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Each segment's mean magnitude without overflow, as ``safe_mean_abs`` for one tensor: on the CPU the
    plain means first (kept unless one overflowed or came near underflow), else means of magnitudes divided
    by their segment's peak."""
    magnitude = x.abs()
    if x.device.type == "cpu":
        mean = segment_reduce(magnitude, "mean", segments)
        if _plain_is_exact(mean):
            return mean
    peak = segment_reduce(magnitude, "max", segments)
    return peak * segment_reduce(magnitude.div_(_expanded(nonzero_or_one(peak), segments)), "mean", segments)


def segment_rms(x: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Each segment's root mean square without overflow or underflow, as ``safe_rms`` for one tensor."""
    if x.device.type == "cpu":
        mean_square = segment_reduce(torch.mul(x, x), "mean", segments)
        if _plain_is_exact(mean_square):
            return mean_square.sqrt_()
    magnitude = x.abs()
    peak = segment_reduce(magnitude, "max", segments)
    scaled = magnitude.div_(_expanded(nonzero_or_one(peak), segments))
    return peak * segment_reduce(scaled.mul_(scaled), "mean", segments).sqrt()


def segment_std(x: torch.Tensor, segments: Segments, peak: torch.Tensor) -> torch.Tensor:
    """Each segment's population standard deviation without overflow, as ``safe_std`` (``peak``: each
    segment's largest magnitude)."""
    groups = segments.groups
    scaled = groups.rowwise(torch.div, [x], [nonzero_or_one(peak)], torch.empty_like(x))
    mean = segment_reduce(scaled, "mean", segments)
    centred = groups.rowwise(lambda rows, m: (rows - m).square_(), [scaled], [mean], scaled)
    return peak * segment_reduce(centred, "mean", segments).sqrt()


# -- per-segment budgets: top-k, sparse payloads ---------------------------------------------------------------
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


def segment_topk(flat: torch.Tensor, budget: Budget) -> torch.Tensor:
    """Indices (into ``flat``, int64) of the ``k[s]`` largest magnitudes of every segment ``s``, segment after
    segment, each segment's in no order. Segments of one length and budget at one stride are chosen together
    (row-wise on a strided view, :func:`_rows_topk`), so the calls grow with the number of runs of equal
    shapes (:class:`Groups`), not of tensors; a segment alone goes
    :func:`~gradcomm.compression._numerics.top_magnitudes`' way (the same set as ``torch.topk``'s)."""
    groups = budget.groups
    found = []
    flat = flat.contiguous()
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
    candidate = (magnitudes < thresholds).logical_not_()  # NaN is never below: a candidate
    per_row = candidate.sum(dim=1)
    if bool(((per_row < k) | (thresholds.squeeze(1) == 0)).any()):
        return magnitudes.topk(k, dim=1, sorted=False).indices
    found = sparse_nonzero(candidate.view(-1)) if 64 * k <= length else candidate.view(-1).nonzero().squeeze(1)
    row, column = found.div(length, rounding_mode="floor"), found.remainder(length)
    width = int(per_row.max())
    within = torch.arange(row.numel(), device=row.device) - (per_row.cumsum(0) - per_row).repeat_interleave(per_row)
    packed = magnitudes.new_full((count, width), -1.0).index_put_((row, within), magnitudes[row, column])
    columns = column.new_zeros((count, width)).index_put_((row, within), column)
    return columns.gather(1, packed.topk(k, dim=1, sorted=False).indices)


# -- bit packing by segment: the bytes of packing every tensor on its own, back to back -----------------------
def packed_lengths(lengths: Sequence[int], bits: int) -> tuple[int, ...]:
    """Bytes of each segment's codes packed at ``bits`` bits (:func:`~gradcomm.compression._numerics.pack_bits`)."""
    return tuple(-(-n * bits // 8) for n in lengths)


def pack_segments(codes: torch.Tensor, segments: Segments, bits: int) -> torch.Tensor:
    """Codes (``< 2**bits``, ``bits`` dividing 8) of every segment packed as ``pack_bits`` packs one tensor,
    the segments' bytes back to back: one packing of the whole bucket, each segment padded to whole bytes."""
    if bits == 8:
        return codes
    padded = segments.padded(8)
    packed = pack_bits(padded.pad(codes), bits)
    if padded.aligned:
        return packed
    return packed.index_select(0, _kept_bytes(segments, bits))


def decode_segments(packed: torch.Tensor, segments: Segments, bits: int, tables: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_segments`, each code replaced by its value: ``tables[segment, code]`` with one
    row of ``2**bits`` values per segment (or one row for all). A lookup per byte, as ``decode_bits``."""
    if bits == 8:  # a byte is a code, and segments are not padded
        if tables.dim() == 2 and tables.shape[0] > 1:
            return _decode_by_segment(packed, 8, tables, segments.ids)
        return decode_bits(packed, 8, segments.numel, tables.reshape(-1))
    padded = segments.padded(8)
    if not padded.aligned:  # each segment's bytes at a multiple of 8 codes
        bytes_ = packed.new_zeros(padded.numel * bits // 8).index_copy_(0, _kept_bytes(segments, bits), packed)
    else:
        bytes_ = packed
    if 8 % bits:  # codes straddling bytes: unpacked, then looked up (one table)
        codes = unpack_bits(bytes_, bits, padded.numel).to(torch.int64)
        decoded = tables.reshape(-1).index_select(0, codes)
    elif tables.dim() == 1 or tables.shape[0] == 1:
        decoded = decode_bits(bytes_, bits, padded.numel, tables.reshape(-1))
    else:
        decoded = _decode_by_segment(bytes_, bits, tables, _byte_ids(segments, bits))
    return padded.unpad(decoded)


def _decode_by_segment(packed: torch.Tensor, bits: int, tables: torch.Tensor, byte_ids: torch.Tensor) -> torch.Tensor:
    """``decode_bits`` with one table per segment: byte ``b`` of segment ``s`` reads row ``256 s + b``."""
    codes_per_byte = 8 // bits
    patterns = _byte_patterns(bits, packed.device)
    table = tables[:, patterns].reshape(-1, codes_per_byte) if bits < 8 else tables.reshape(-1, 1)
    rows = packed.to(torch.int64).add_(byte_ids, alpha=256)
    return gather_rows(table, rows).reshape(-1)


@functools.lru_cache(maxsize=16)
def _byte_patterns(bits: int, device: torch.device) -> torch.Tensor:
    byte = torch.arange(256, device=device).unsqueeze(1)
    return (byte >> torch.arange(0, 8, bits, device=device)) & ((1 << bits) - 1)


def _kept_bytes(segments: Segments, bits: int) -> torch.Tensor:
    """Of the bytes of the layout padded to 8 codes, those :func:`pack_segments` keeps (cached)."""
    cache = segments.__dict__.setdefault("_kept_bytes", {})
    if bits not in cache:
        kept = packed_lengths(segments.lengths, bits)
        cache[bits] = _placement(kept, [n * bits // 8 for n in segments.padded(8).lengths], segments.device)
    return cache[bits]


def _byte_ids(segments: Segments, bits: int) -> torch.Tensor:
    """Each byte's segment, in the layout padded to 8 codes (cached)."""
    cache = segments.__dict__.setdefault("_byte_ids", {})
    if bits not in cache:
        cache[bits] = _ids([n * bits // 8 for n in segments.padded(8).lengths], segments.device)
    return cache[bits]


# -- random bits keyed by segment ----------------------------------------------------------------------------
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _shifted_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits).bitwise_and_((1 << (64 - bits)) - 1)


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
