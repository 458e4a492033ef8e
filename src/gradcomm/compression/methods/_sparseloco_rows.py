"""SparseLoCo's encoding of a bucket (:mod:`gradcomm.compression.methods.sparseloco`): its chunks as the rows
of one matrix, in a fixed number of torch calls whatever its tensors, their shapes or their values.

:class:`Rows` is what a layout needs, made once: where each chunk's elements are gathered into its row, which
of each row's sorted top ``max(k)`` it keeps, its constants as tensors (a Python number costs four more calls
in every operation it is in), and the buffers of a call (:class:`_Scratch`, written by ``out=`` calls and
viewed by views made once). An encoding then returns only tensors of its own (its payload, the indices it
chose and the values it sent there); the buffers serve the next call.

The two magnitudes of a chunk are the means of its halves, taken as :meth:`Rows.encode` describes: every mean
is float32 sums of blocks of 32 added in float64 and divided there, the same bits in any bucket. The halves
and the counts in them come from one reduction: a ``(chunks, 2, 2, width)`` tensor holds, per half, the
magnitudes and an indicator of the chunk's first ``k`` places, each kept where it falls in that half.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from gradcomm.compression._numerics import index_dtype, work_dtype
from gradcomm.compression._numerics.reductions import _PLAIN_FLOOR
from gradcomm.compression.fusion import eager_under_compile
from gradcomm.compression.segment_bits import pack_segments
from gradcomm.compression.segment_sparse import Budget
from gradcomm.compression.segments import _BLOCK, Segments

__all__ = ["Encoded", "Rows"]

_EXACT_IN_FLOAT32 = 2**24
"""Budgets up to this many values divide a single block's float32 sum in float32 with the bits of float64's
division rounded to float32 (a quotient of two floats rounded twice, to 53 and then 24 bits, is rounded once)."""


@dataclass(frozen=True, eq=False)
class Encoded:
    """One encoding: the payload (low bytes of the words where there are any, their packed top bits, two
    magnitudes per chunk), each kept value's index in the flat tensor and the value sent there (the flat
    tensor's dtype), which is this rank's own decoding of its payload."""

    payload: list[torch.Tensor]
    indices: torch.Tensor
    sent: torch.Tensor


class Rows:
    """A bucket's chunks (:meth:`Segments.chunked`) as the rows of one ``(chunks, width)`` matrix, ``width``
    the longest chunk's length: the bucket itself where every chunk is that long, else each chunk gathered
    into its row by one index and padded with -1 (a magnitude below any). One sorted ``topk`` of ``max(k)``
    per row chooses every chunk's values, each row keeping its first ``k``. ``low_bytes`` and ``top_bits``:
    the words' split (:func:`~gradcomm.compression.methods.sparseloco._word_split`); ``kept``: the values each
    tensor sends, whose top bits are packed tensor by tensor."""

    def __init__(
        self, segments: Segments, budget: Budget, low_bytes: int, top_bits: int, kept: Sequence[int]
    ):
        chunked = budget.segments
        device = segments.device
        lengths = chunked.lengths
        self.segments = segments
        self.count = len(lengths)
        self.width = max(lengths)
        self.numel = segments.numel
        self.total = budget.total
        self.ks = budget.ks
        self.widest = max(self.ks)
        self.blocked = -(-self.widest // _BLOCK) * _BLOCK
        self.blocks = self.blocked // _BLOCK
        self.low_bytes = low_bytes
        self.top_bits = top_bits
        self.kept_segments = segments.relaid(kept)
        ks = torch.tensor(self.ks, dtype=torch.int64, device=device).unsqueeze(1)
        self.k = ks
        self.gather: torch.Tensor | None = None
        """Where each place of the rows reads the magnitudes (where chunks differ; past a chunk's end: 0)."""
        self.past_end: torch.Tensor | None = None
        """The places past a chunk's end, ``(rows, width)``: set to -1, below every magnitude."""
        if any(n != self.width for n in lengths):
            column = torch.arange(self.width, device=device)
            starts = torch.tensor(chunked.starts, dtype=torch.int64, device=device).unsqueeze(1)
            inside = column < torch.tensor(lengths, dtype=torch.int64, device=device).unsqueeze(1)
            self.gather = torch.where(inside, starts + column, 0).view(-1).to(index_dtype(self.numel))
            self.past_end = inside.logical_not()
        places = torch.arange(self.blocked, device=device)
        self.indicator = places < ks
        """Each row's first ``k`` places of ``blocked``."""
        uniform = min(self.ks) == self.widest
        self.unkept = None if uniform else self.indicator[:, : self.widest].logical_not()
        self.keep = None if uniform else self.unkept.logical_not().view(-1).nonzero().squeeze(1)
        """Of the ``(rows, max(k))`` choices, the kept ones (where budgets differ)."""
        self.keep_blocked: torch.Tensor | None = None
        """The same places in rows ``blocked`` wide (where that is not the choices' own layout)."""
        if not uniform or self.blocked != self.widest:
            self.keep_blocked = self.indicator.logical_and(places < self.widest).view(-1).nonzero().squeeze(1)
        self.starts = budget.starts
        self.ids4 = budget.chosen.ids.mul(4)
        """4 times each kept value's chunk: its row of the values' table (``+low, +high, -low, -high``)."""
        self.groups = _packing_group(top_bits)
        self.grouped = all(n % self.groups == 0 for n in kept)
        """Every tensor's top codes fill whole groups (bytes): packed at once, without padding."""
        self._scratch: _Scratch | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, object]:
        """Pickled (with a compressor whose accumulator's layout caches it) without its buffers and lock."""
        return {**self.__dict__, "_scratch": None, "_lock": None}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @contextlib.contextmanager
    def scratch(self, dtype: torch.dtype) -> Iterator[_Scratch]:
        """The layout's buffers for a flat tensor of ``dtype`` (kept), or new ones where another thread holds
        them."""
        if not self._lock.acquire(blocking=False):
            yield _Scratch(self, dtype)
            return
        try:
            if self._scratch is None or self._scratch.dtype != dtype:
                self._scratch = _Scratch(self, dtype)
            yield self._scratch
        finally:
            self._lock.release()

    @eager_under_compile  # it writes into buffers through views of other dtypes, which aot_autograd refuses
    def encode(self, flat: torch.Tensor) -> Encoded:
        """Encode ``flat`` (not modified): per row its top ``k`` magnitudes, sorted; the mean of each row's
        ``k`` (``split``); the halves above it and not, and each half's mean magnitude (``low``, ``high``),
        sent as ``mean over the chunk * k / count in the half``. Means are float32 sums of blocks of 32 added
        in float64 (in float32 where a row is one block: the same bits). On the CPU each is the plain mean
        where that is exact (all of a call's checked at once), else the mean of the magnitudes divided by
        their peak, times the peak; on accelerators always the latter. Row by row: a chunk's scales depend
        on its values alone, never on the other chunks of its bucket.
        """
        with self.scratch(flat.dtype) as scratch:
            return scratch.encode(flat)


def _packing_group(bits: int) -> int:
    """Codes of ``bits`` bits that fill whole bytes together."""
    return 8 // math.gcd(bits, 8)


class _Scratch:
    """A layout's buffers for one flat dtype, with their views (made once)."""

    def __init__(self, rows: Rows, dtype: torch.dtype):
        device = rows.segments.device
        count, blocked, blocks, total = rows.count, rows.blocked, rows.blocks, rows.total
        work = work_dtype(dtype)
        self.rows = rows
        self.dtype = dtype
        self.work = work
        # the magnitudes (bucket-sized) are made in each call, memory the allocator reuses between steps; what
        # is kept here is per row or per kept value
        self.columns = torch.empty(count, rows.widest, dtype=torch.int64, device=device)
        self.columns_flat = self.columns.view(-1)
        # channel 0: each row's top magnitudes (zeros after its k); channel 1: 1 at its first k places
        self.values = torch.zeros(count, 2, blocked, dtype=work, device=device)
        self.values[:, 1] = rows.indicator
        self.tops = self.values[:, 0, : rows.widest]
        self.first = self.values[:, 0]
        self.first_blocks = self.first.unflatten(1, (blocks, _BLOCK))
        self.pairs = self.values.view(count, 1, 2, blocked)
        self.split_sums = torch.empty(count, blocks, dtype=work, device=device)
        # means (rows, 2), split (rows, 1), counts (rows, 2): one buffer, the first two checked at once
        self.means_flat = torch.empty(5 * count, dtype=work, device=device)
        self.checked = self.means_flat[: 3 * count]
        self.means = self.means_flat[: 2 * count].view(count, 2)
        self.split_flat = self.means_flat[2 * count : 3 * count]
        self.split = self.split_flat.view(count, 1)
        self.counts = self.means_flat[3 * count :].view(count, 2)
        self.means_and_counts = self.means_flat.as_strided((count, 2, 2), (2, 1, 3 * count))
        self.big = torch.empty(count, blocked, dtype=torch.bool, device=device)
        self.big_bytes = self.big.view(torch.uint8).view(-1)
        self.big_column = self.big.view(count, 1, blocked)
        self.halves_mask = torch.empty(count, 2, blocked, dtype=torch.bool, device=device)
        self.halves_mask4 = self.halves_mask.view(count, 2, 1, blocked)
        self.halves = torch.empty(count, 2, 2, blocked, dtype=work, device=device)
        self.halves_blocks = self.halves.unflatten(3, (blocks, _BLOCK))
        self.halves_sums = torch.empty(count, 2, 2, blocks, dtype=work, device=device)
        self.halves_values = self.halves[:, :, 0]
        self.ratio = torch.empty(count, 2, dtype=work, device=device)
        self.kept_columns = torch.empty(total, dtype=torch.int64, device=device)
        self.kept_values = torch.empty(total, dtype=dtype, device=device)
        self.kept_big = torch.empty(total, dtype=torch.uint8, device=device)
        self.negative = torch.empty(total, dtype=torch.bool, device=device)
        self.negative_bytes = self.negative.view(torch.uint8)
        self.codes = torch.empty(total, dtype=torch.int64, device=device)
        self.table_index = torch.empty(total, dtype=torch.int64, device=device)
        self.constants = _Constants(rows, work, device)
        self.single = blocks == 1 and rows.widest <= _EXACT_IN_FLOAT32
        if self.single:
            self.halves_sums3 = self.halves_sums.view(count, 2, 2)
        else:
            self.split64 = _Float64Sums(self.split_sums)
            self.halves64 = _Float64Sums(self.halves_sums)
        self._packing(rows, device)

    def _packing(self, rows: Rows, device: torch.device) -> None:
        """Buffers of the words' top codes, packed ``groups`` to a little-endian int64 whose low bytes are
        theirs (``pack_bits``' stream), and which bytes those are."""
        total, groups = rows.total, rows.groups
        self.low = torch.empty(total, dtype=torch.uint8, device=device) if rows.low_bytes == 1 else None
        self.top = torch.empty(total, dtype=torch.int64, device=device)
        self.shift = torch.tensor(max(0, 8 * rows.low_bytes - 2), dtype=torch.int64, device=device)
        if not rows.grouped:
            return
        self.top_groups = self.top.view(-1, groups)
        self.weights = torch.tensor(
            [1 << (rows.top_bits * i) for i in range(groups)], dtype=torch.int64, device=device
        )
        self.weighted = torch.empty(total // groups, groups, dtype=torch.int64, device=device)
        self.packed = torch.empty(total // groups, dtype=torch.int64, device=device)
        self.packed_bytes = (self.top if groups == 1 else self.packed).view(torch.uint8)
        width = rows.top_bits * groups // 8
        self.byte_index = (
            torch.arange(width, device=device)
            .add(8 * torch.arange(total // groups, device=device).unsqueeze(1))
            .view(-1)
        )

    def encode(self, flat: torch.Tensor) -> Encoded:
        rows, c = self.rows, self.constants
        self._choose(flat)
        self._split()
        self._halves()
        if flat.device.type != "cpu":
            self._scaled()
        elif not torch.equal(self.checked, torch.clamp(self.checked, c.floor, c.largest)):
            self._per_row()
        torch.clamp_min(self.counts, c.one, out=self.ratio)
        torch.div(c.k, self.ratio, out=self.ratio)
        scales = torch.mul(self.means, self.ratio).clamp_(max=c.largest)
        columns = self.columns_flat
        if rows.keep is not None:
            columns = torch.index_select(self.columns_flat, 0, rows.keep, out=self.kept_columns)
        indices = torch.add(columns, rows.starts)
        torch.index_select(flat, 0, indices, out=self.kept_values)
        torch.lt(
            self.kept_values, c.zero if flat.dtype == self.work else c.zero.to(flat.dtype), out=self.negative
        )
        big = self.big_bytes
        if rows.keep_blocked is not None:
            big = torch.index_select(self.big_bytes, 0, rows.keep_blocked, out=self.kept_big)
        codes = torch.add(big, self.negative_bytes, alpha=2)  # 2 * negative + big
        self.codes.copy_(codes)
        payload = [*self._words(columns, codes), scales.view(-1)]
        table = torch.cat([scales, scales.neg()], dim=1)
        sent = table.take(torch.add(self.codes, rows.ids4, out=self.table_index))
        return Encoded(payload, indices, sent if sent.dtype == flat.dtype else sent.to(flat.dtype))

    # -- the choice and its magnitudes ----------------------------------------------------------------------
    def _choose(self, flat: torch.Tensor) -> None:
        """Each row's sorted top ``max(k)`` magnitudes (``tops``, zeros after its ``k``) and their columns."""
        rows = self.rows
        if rows.gather is None:
            matrix = torch.abs(flat).view(rows.count, rows.width)
        else:
            matrix = flat.index_select(0, rows.gather).abs_().view(rows.count, rows.width)
            matrix.masked_fill_(rows.past_end, -1.0)
        if self.dtype == self.work:
            torch.topk(matrix, rows.widest, dim=1, out=(self.tops, self.columns))
        else:
            tops, _ = torch.topk(
                matrix,
                rows.widest,
                dim=1,
                out=(torch.empty(0, dtype=self.dtype, device=flat.device), self.columns),
            )
            self.tops.copy_(tops)
        if rows.unkept is not None:
            self.tops.masked_fill_(rows.unkept, 0.0)

    def _split(self) -> None:
        """Each row's plain mean of its ``k`` magnitudes."""
        torch.sum(self.first_blocks, dim=2, out=self.split_sums)
        c = self.constants
        if self.single:
            torch.div(self.split_sums, c.k, out=self.split)
            return
        self.split_flat.copy_(self.split64().div_(c.k64_flat))

    def _halves(self) -> None:
        """Each half's plain mean over the chunk's ``k`` (``means``) and the count in it (``counts``)."""
        c = self.constants
        torch.gt(self.first, self.split, out=self.big)  # never in the zeros after a row's k: split >= 0
        torch.eq(self.big_column, c.halves, out=self.halves_mask)  # (not big, big)
        torch.where(self.halves_mask4, self.pairs, c.zero, out=self.halves)
        torch.sum(self.halves_blocks, dim=4, out=self.halves_sums)
        if self.single:
            torch.div(self.halves_sums3, c.divisor, out=self.means_and_counts)
            return
        self.means_and_counts.copy_(self.halves64().div_(c.divisor64))

    def _per_row(self) -> None:
        """Where a row's plain mean (``split``, ``low`` or ``high``) is out of range, its peak-scaled mean; the
        halves again where a split changed. A mean of 0 (a row or half of zeros) is both, and stays."""
        c = self.constants
        if bool(_within(self.checked, c).all()):
            return
        within = _within(self.split, c)
        if not bool(within.all()):
            self.split.copy_(
                torch.where(within, self.split, self._peak_scaled(self.first, c.k64).unsqueeze(1))
            )
            self._halves()
        within = _within(self.means, c)
        if not bool(within.all()):
            self.means.copy_(
                torch.where(within, self.means, self._peak_scaled(self.halves_values, c.k64.unsqueeze(1)))
            )

    def _scaled(self) -> None:
        """Every mean peak-scaled (off the CPU, where checking the plain ones would wait for the device)."""
        c = self.constants
        self.split_flat.copy_(self._peak_scaled(self.first, c.k64))
        self._halves()
        self.means.copy_(self._peak_scaled(self.halves_values, c.k64.unsqueeze(1)))

    def _peak_scaled(self, values: torch.Tensor, k64: torch.Tensor) -> torch.Tensor:
        """Means over ``k`` of ``values`` (the last dimension, ``blocked`` wide) without overflow or underflow:
        each divided by its peak (or 1 where that is 0), means of those, times the peak."""
        c = self.constants
        peak = values.amax(dim=-1)
        normal = values.div(torch.where(peak == c.zero, c.one, peak).unsqueeze(-1))
        sums = normal.unflatten(-1, (self.rows.blocks, _BLOCK)).sum(dim=-1).to(torch.float64).sum(dim=-1)
        return peak.mul_(sums.div_(k64.squeeze(-1)).to(self.work))

    # -- the wire format ------------------------------------------------------------------------------------
    def _words(self, columns: torch.Tensor, codes: torch.Tensor) -> list[torch.Tensor]:
        """Each kept value's word ``column << 2 | code``: its low bytes (where there are any), then its top
        bits packed tensor by tensor."""
        rows = self.rows
        if rows.low_bytes == 0:
            torch.add(self.codes, columns, alpha=4, out=self.top)
            low = []
        elif self.low is not None:  # one low byte: the word's, in uint8 arithmetic (mod 256)
            self.low.copy_(columns)
            low = [torch.add(codes, self.low, alpha=4)]
            torch.bitwise_right_shift(columns, self.shift, out=self.top)
        else:
            words = torch.add(self.codes, columns, alpha=4)
            low = [words.view(torch.uint8).view(-1, 8)[:, : rows.low_bytes].reshape(-1)]
            torch.bitwise_right_shift(columns, self.shift, out=self.top)
        if not rows.grouped:
            top = torch.empty(self.top.shape, dtype=torch.uint8, device=self.top.device).copy_(self.top)
            return [*low, pack_segments(top, rows.kept_segments, rows.top_bits)]
        if rows.groups > 1:
            torch.mul(self.top_groups, self.weights, out=self.weighted)
            torch.sum(self.weighted, dim=1, out=self.packed)
        return [*low, self.packed_bytes.index_select(0, self.byte_index)]


class _Float64Sums:
    """Float32 block sums (the last dimension) added in float64, in buffers and views made once: two blocks
    by one addition (the sum's ``a + b``)."""

    def __init__(self, sums: torch.Tensor):
        self.sums = sums
        self.wide = torch.empty(sums.shape, dtype=torch.float64, device=sums.device)
        self.out = torch.empty(sums.shape[:-1], dtype=torch.float64, device=sums.device)
        self.pair = (self.wide[..., 0], self.wide[..., 1]) if sums.shape[-1] == 2 else None

    def __call__(self) -> torch.Tensor:
        """The sums of the rows of ``sums`` as they are now (float64, a buffer: read it before the next call)."""
        self.wide.copy_(self.sums)
        if self.pair is None:
            return torch.sum(self.wide, dim=-1, out=self.out)
        return torch.add(*self.pair, out=self.out)


def _within(means: torch.Tensor, c: _Constants) -> torch.Tensor:
    """Where a plain mean is exact: it neither overflowed nor came near underflow (within ``[floor,
    largest]``, which no NaN is), or it is 0 (its magnitudes all are, and so is their peak-scaled mean)."""
    return torch.eq(means, torch.clamp(means, c.floor, c.largest)).logical_or_(means == c.zero)


class _Constants:
    """A layout's constants in its work dtype, as tensors."""

    def __init__(self, rows: Rows, work: torch.dtype, device: torch.device):
        self.zero = torch.zeros((), dtype=work, device=device)
        self.one = torch.ones((), dtype=work, device=device)
        self.largest = torch.tensor(torch.finfo(work).max, dtype=work, device=device)
        self.floor = torch.tensor(_PLAIN_FLOOR, dtype=work, device=device)
        self.k = rows.k.to(work)
        self.k64 = rows.k.to(torch.float64)
        self.k64_flat = self.k64.view(-1)
        divisor = torch.stack(
            [self.k64, torch.ones_like(self.k64)], dim=2
        )  # (rows, 1, 2): values by k, counts by 1
        self.divisor64 = divisor
        self.divisor = divisor.to(work)
        self.halves = torch.tensor([[False], [True]], device=device)
