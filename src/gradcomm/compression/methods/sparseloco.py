"""SparseLoCo: chunked top-k of an error-feedback accumulator, its values quantized to 2 bits.

Sarfi, Thérien, Lidin & Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo", 2025,
https://arxiv.org/abs/2508.15706. Meant for DiLoCo's pseudo-gradients (``gradcomm.DiLoCo(...,
compressor="sparseloco")``, outer step plain averaging: the accumulator stands in for outer momentum), and a
per-step hook like any method. Per compressed tensor, each rank keeps an accumulator ``e`` (zero at first);
with ``x`` this exchange's tensor and ``beta`` the decay::

    e = beta * e + x                 error feedback with decay (beta = 1: classic error feedback)
    each chunk of `chunk` elements of e: its k = ceil(ratio * len) largest magnitudes, quantized to 2 bits
    e = e - sent                     what was not sent: the rest of e, and the quantization error

**Chunks.** Top-k is taken per chunk of ``chunk`` consecutive elements of a tensor (its last chunk shorter),
as the paper does (after DeMo's blocks): the budget is spread over the whole tensor (a tensor-wide top-k lets
one region with large values take it all, and others wait many exchanges), each chunk has its own 2-bit
scales, and an index within a chunk needs ``log2(chunk)`` bits. Default 4096 elements with ``ratio=1/64``: 64
values per chunk, the paper's setting (1.56% density, inside its 1-3%).

**2 bits per value.** A kept value is its sign and one of two magnitudes of its chunk: the chunk's kept
values are split at their mean magnitude, and each half is sent as its own mean magnitude (float32): the
least-squares reconstruction for that split, as the paper's quantizer sends the mean of each bin.

**Wire format** (:meth:`SparseLoCo.payload_layout`), all-gathered (coordinates differ between ranks): per
kept value one word of ``b + 2`` bits, its index within its chunk (``b = ceil(log2(chunk))``: 12 bits at the
default chunk) and its 2-bit code, sent as the word's ``(b + 1) // 8`` low bytes (uint8; none for chunks of
up to 64) and its remaining top bits, bit-packed tensor by tensor; then two float32 magnitudes per chunk. A
bucket's payload is its tensors' payloads back to back, part by part. At the defaults a chunk of 4096
float32 values (16384 bytes) is 64 * 14 bits + 8 bytes = 120 bytes, 136.5x smaller.

**Error feedback** lives here (``ef_decay``, the paper's decay ``beta`` of 0.95; 0 switches it off; 1 is
plain error feedback), like DGC's buffers: the hook's own is refused (:attr:`ErrorFeedback.UNSUPPORTED`: a
second residual would count every unsent value twice). Tensors the hook sends dense bypass it. The
accumulator is keyed by the hook's tensor keys and checkpointed by :meth:`SparseLoCo.state_dict`
(``weights_only``-safe); a compression that fails midway drops it rather than keep half an update.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from gradcomm.compression._numerics import work_dtype, zeros_in
from gradcomm.compression._numerics.reductions import _PLAIN_FLOOR
from gradcomm.compression.base import ErrorFeedback, Payload, SegmentedCompressor, tensor_stream
from gradcomm.compression.communicators import ALLGATHER
from gradcomm.compression.memory import ResidualMemory
from gradcomm.compression.segment_bits import decode_segments, pack_segments, packed_lengths
from gradcomm.compression.segment_sparse import Budget
from gradcomm.compression.segment_stats import constant
from gradcomm.compression.segments import _BLOCK, Segments, _block_sums, as_dtype

__all__ = ["SparseLoCo"]

_CODE_BITS = 2
_DESCRIBE = "SparseLoCo: the accumulator kept for {key} has shape"


def _word_split(chunk: int) -> tuple[int, int]:
    """For chunks of ``chunk`` elements: the whole low bytes of a value's word (index and code) and the bits
    of its top part, packed."""
    bits = (chunk - 1).bit_length() + _CODE_BITS
    low_bytes = (bits - 1) // 8
    return low_bytes, bits - 8 * low_bytes


@functools.lru_cache(maxsize=8)
def _top_values(bits: int, device: torch.device) -> torch.Tensor:
    """Each top code as itself (int64), the table :func:`decode_segments` looks codes up in. Shared: read it."""
    return torch.arange(2**bits, dtype=torch.int64, device=device)


class SparseLoCo(
    SegmentedCompressor, name="sparseloco", summary="SparseLoCo: chunked top-k, 2-bit values, decayed EF"
):
    """Per chunk of ``chunk`` elements of each tensor's accumulator, the ``ceil(ratio * len)`` (at least one)
    largest magnitudes, each sent as a 2-bit code and its index within the chunk; see the module docstring.

    Args:
        ratio: fraction of each chunk sent, in (0, 1] (the density; named as top-k's).
        chunk: elements per chunk, at least 1.
        ef_decay: the accumulator's decay ``beta`` in [0, 1]; 0 sends each tensor alone (no error feedback).
    """

    communicator = ALLGATHER
    error_feedback = ErrorFeedback.UNSUPPORTED

    def __init__(self, ratio: float = 1 / 64, chunk: int = 4096, ef_decay: float = 0.95):
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
            raise ValueError(f"SparseLoCo: ratio must be a number in (0, 1], got {ratio!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= 2**30:
            raise ValueError(f"SparseLoCo: chunk must be an integer in 1..2**30, got {chunk!r}")
        if isinstance(ef_decay, bool) or not isinstance(ef_decay, int | float) or not 0 <= ef_decay <= 1:
            raise ValueError(f"SparseLoCo: ef_decay must be a number in [0, 1], got {ef_decay!r}")
        self.ratio = ratio
        self.chunk = chunk
        self.ef_decay = ef_decay
        self._accumulation = ResidualMemory(_DESCRIBE)

    def k(self, numel: int) -> int:
        """Values sent of a chunk of ``numel`` elements."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def _chunk_lengths(self, lengths: Sequence[int]) -> list[int]:
        return [min(self.chunk, n - start) for n in lengths for start in range(0, n, self.chunk)]

    def _kept(self, length: int) -> int:
        """Values sent of a tensor of ``length`` elements."""
        return sum(self.k(n) for n in self._chunk_lengths([length]))

    def payload_layout(self, lengths: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        kept = [self._kept(n) for n in lengths]
        low_bytes, top_bits = _word_split(self.chunk)
        low = [(sum(kept) * low_bytes, torch.uint8)] if low_bytes else []
        chunks = len(self._chunk_lengths(lengths))
        return [*low, (sum(packed_lengths(kept, top_bits)), torch.uint8), (2 * chunks, work_dtype(dtype))]

    def _budget(self, segments: Segments) -> Budget:
        chunks = segments.chunked(self.chunk)
        return chunks.budget([self.k(n) for n in chunks.lengths])

    def _kept_segments(self, segments: Segments) -> Segments:
        """The values each tensor sends, as segments: its words' top bits are packed as for it alone."""
        return segments.relaid([self._kept(n) for n in segments.lengths])

    def stream(self, key: Hashable) -> contextlib.AbstractContextManager[None]:
        """Scope in which :meth:`compress` reads and updates the accumulator of the tensor ``key`` (as DGC's)."""
        return tensor_stream(key)

    # -- the math ------------------------------------------------------------------------------------------
    def compress_segments(self, flat: torch.Tensor, segments: Segments) -> tuple[Payload, None]:
        if not self.ef_decay:
            return self._encode(flat, segments)[0], None
        held = self._accumulation.held_segments(segments, flat)
        try:  # e = beta e + x, in place; a failure midway drops the accumulator (as error feedback does)
            accumulated = flat.clone() if held is None else held.mul_(constant(self.ef_decay, held.dtype, held.device)).add_(flat)
            payload, indices, sent = self._encode(accumulated, segments)
            self._accumulation.store_segments(segments, accumulated.index_add_(0, indices, sent, alpha=-1))
        except BaseException:
            self._accumulation.discard_segments(segments)
            raise
        return payload, None

    def _rows(self, segments: Segments) -> _Rows:
        """The chunks of ``segments`` as rows (cached per layout, chunk and ratio)."""
        cache = segments.__dict__.setdefault("_sparseloco_rows", {})
        key = (self.chunk, self.ratio)
        if key not in cache:
            cache[key] = _Rows(segments, self._budget(segments), self.k)
        return cache[key]

    def _encode(self, flat: torch.Tensor, segments: Segments) -> tuple[Payload, torch.Tensor, torch.Tensor]:
        """The payload of ``flat``'s chunks, the indices it keeps and the values it sends there (in
        ``flat``'s dtype). Every chunk is a row of one ``(chunks, width)`` matrix of magnitudes (a chunk
        shorter than the widest padded with -1), so that one ``topk`` chooses every chunk's values and its
        two magnitudes are row-wise statistics: calls that do not grow with the chunks or their shapes."""
        budget = self._budget(segments)
        if budget.total == 0:  # only empty tensors: nothing to choose
            empty = flat.new_empty(0)
            layout = self.payload_layout(segments.lengths, flat.dtype)
            return [flat.new_empty(0, dtype=dtype) for _, dtype in layout], empty.long(), empty
        rows = self._rows(segments)
        tops, columns = rows.magnitudes(flat).topk(rows.widest, dim=1)  # sorted: the same order in any layout
        indices = rows.kept(columns.add(rows.starts))
        local = rows.kept(columns)
        work = work_dtype(flat.dtype)
        kept = as_dtype(flat.index_select(0, indices), work)
        constants = rows.constants(work)
        magnitudes = as_dtype(tops, work)  # |kept| in rows, zeros after each row's k
        if rows.unkept is not None:
            magnitudes.masked_fill_(rows.unkept, constants.zero)
        if rows.blocked != rows.widest:  # zeros up to a multiple of 32: each row summed by blocks of 32
            padded = magnitudes.new_zeros(magnitudes.shape[0], rows.blocked)
            padded[:, : rows.widest] = magnitudes
            magnitudes = padded
        split = rows.mean_abs(magnitudes, constants)
        big = torch.gt(magnitudes, split.view(-1, 1))  # never in the zeros after a row's k: split >= 0
        # each half's mean magnitude: overflow-safe means over the chunk, rescaled to the half's count; the
        # halves side by side, (low, high) per row
        halves = magnitudes.new_empty(magnitudes.shape[0], 2, magnitudes.shape[1])
        torch.where(big, constants.zero, magnitudes, out=halves[:, 0])
        torch.where(big, magnitudes, constants.zero, out=halves[:, 1])
        in_half = magnitudes.new_empty(magnitudes.shape[0], 2)
        big_count = torch.sum(big, dim=1, dtype=work, out=in_half[:, 1])
        torch.sub(constants.counts, big_count, out=in_half[:, 0])
        means = rows.mean_abs(halves.view(-1, magnitudes.shape[1]), constants, halves=2).view(-1, 2)
        scales = means.mul_(torch.div(constants.counts.view(-1, 1), constants.nonzero_or_one(in_half)))
        scales.clamp_(max=constants.largest)
        codes = torch.empty(kept.shape, dtype=torch.int64, device=kept.device).copy_(torch.lt(kept, constants.zero))
        chosen_big = rows.kept(big if rows.blocked == rows.widest else big[:, : rows.widest].contiguous())
        codes.bitwise_left_shift_(1).bitwise_or_(torch.empty_like(codes).copy_(chosen_big))
        payload = [*self._pack(local, codes, segments), scales.view(-1)]
        return payload, indices, as_dtype(self._values(codes, scales, rows.ids4), flat.dtype)

    @staticmethod
    def _values(codes: torch.Tensor, scales: torch.Tensor, ids4: torch.Tensor) -> torch.Tensor:
        """Code ``2 * negative + big`` of each kept value as ``+-`` its chunk's low or high magnitude
        (``ids4``: 4 times each kept value's chunk)."""
        table = torch.cat([scales, scales.neg()], dim=1).view(-1)
        return table.index_select(0, torch.add(ids4, codes))

    # -- the wire format -----------------------------------------------------------------------------------
    def _pack(self, local: torch.Tensor, codes: torch.Tensor, segments: Segments) -> list[torch.Tensor]:
        """The words' low bytes (where there are any), then their top bits packed tensor by tensor."""
        low_bytes, top_bits = _word_split(self.chunk)
        words = local.bitwise_left_shift(_CODE_BITS).bitwise_or_(codes)  # int64, little-endian bytes
        top = words.bitwise_right_shift(8 * low_bytes)
        top = torch.empty(top.shape, dtype=torch.uint8, device=top.device).copy_(top)  # two calls, where to is four
        packed = pack_segments(top, self._kept_segments(segments), top_bits)
        if not low_bytes:
            return [packed]
        return [words.view(torch.uint8).view(-1, 8)[:, :low_bytes].reshape(-1), packed]

    def _decode(self, payload: Payload, segments: Segments) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices into the flat tensor and values (work dtype) of one rank's payload."""
        budget = self._budget(segments)
        low_bytes, top_bits = _word_split(self.chunk)
        *low, packed, scales = payload
        total = budget.total
        words = torch.zeros(total, 8, dtype=torch.uint8, device=packed.device)
        if low_bytes:
            words[:, :low_bytes] = low[0].view(total, low_bytes)
        words = words.view(torch.int64).view(-1)
        tops = _top_values(top_bits, packed.device)
        top = decode_segments(packed, self._kept_segments(segments), top_bits, tops)
        words.bitwise_or_(top.bitwise_left_shift(8 * low_bytes))
        codes = words.bitwise_and(2**_CODE_BITS - 1)
        indices = words.bitwise_right_shift_(_CODE_BITS).add_(budget.starts)
        return indices, self._values(codes, scales.view(-1, 2), self._rows(segments).ids4)

    def decompress_segments(
        self, payload: Payload, ctx: Any, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        indices, values = self._decode(payload, segments)
        dense = zeros_in(out, segments.numel, segments.dtype, values.device)
        return dense.index_put_((indices,), as_dtype(values, segments.dtype))

    def aggregate_segments(
        self, gathered: Payload, ctx: Any, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The mean over ranks, summed in rank order (indices are distinct within a rank: deterministic)."""
        world_size = gathered[0].shape[0]
        total = zeros_in(out, segments.numel, segments.dtype, gathered[0].device)
        for rank in range(world_size):
            indices, values = self._decode([part[rank] for part in gathered], segments)
            values = as_dtype(values, segments.dtype)
            total.index_add_(0, indices, values if world_size == 1 else values / world_size)
        return total

    # -- checkpointing -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"accumulation": {key: e}}``: the accumulators keyed by the hook's tensor keys."""
        return {"accumulation": {key: e.clone() for key, e in self._accumulation.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"accumulation"}:
            raise ValueError(f"SparseLoCo: state must have the one entry 'accumulation', got {sorted(state)}")
        accumulation = dict(state["accumulation"])
        for key, e in accumulation.items():
            if not isinstance(e, torch.Tensor):
                raise ValueError(
                    f"SparseLoCo: the accumulator of {key!r} must be a tensor, got {type(e).__name__}"
                )
        self._accumulation.load_state_dict(accumulation)


class _Rows:
    """A bucket's chunks (:meth:`Segments.chunked`) as the rows of one ``(chunks, width)`` matrix, ``width``
    the longest chunk's length: the bucket itself where every chunk is that long (they lie back to back),
    else each chunk gathered into its row and padded with -1 (a magnitude below any). One ``topk`` of
    ``max(k)`` per row then chooses every chunk's values, sorted where budgets differ (a tensor's last, shorter
    chunk), each row keeping its first ``k``; the two magnitudes are row-wise means of the chosen magnitudes
    (zeros after a row's ``k``). Made once per layout."""

    def __init__(self, segments: Segments, budget: Budget, k: Callable[[int], int]):
        chunked = budget.segments
        device = segments.device
        lengths = chunked.lengths
        self.width = max(lengths)
        self.numel = segments.numel
        self.aligned = all(n == self.width for n in lengths)
        self.starts = torch.tensor(chunked.starts, dtype=torch.int64, device=device).unsqueeze(1)
        self.column = torch.arange(self.width, device=device)
        self.lengths = torch.tensor(lengths, dtype=torch.int64, device=device).unsqueeze(1)
        ks = budget.ks
        self.widest = max(ks)
        self.ks = torch.tensor(ks, dtype=torch.int64, device=device)
        self.blocked = -(-self.widest // _BLOCK) * _BLOCK
        """The rows' width for their means: ``max(k)`` and zeros up to a multiple of 32."""
        uniform = min(ks) == self.widest
        self.keep: torch.Tensor | None = None
        """Of each row's sorted top ``max(k)``, its first ``k`` (where budgets differ)."""
        self.unkept: torch.Tensor | None = None
        if not uniform:
            self.unkept = torch.arange(self.widest, device=device) >= self.ks.unsqueeze(1)
            self.keep = self.unkept.logical_not().reshape(-1).nonzero().squeeze(1)
        self.ids4 = budget.chosen.ids.mul(4)
        """4 times each kept value's chunk: its row of :meth:`SparseLoCo._values`' table."""
        self._constants: dict[torch.dtype, _Constants] = {}

    def magnitudes(self, flat: torch.Tensor) -> torch.Tensor:
        """``|flat|`` as the rows (a new tensor)."""
        if self.aligned:
            return flat.view(-1, self.width).abs()
        padded = flat.new_empty(self.numel + self.width)  # room for the last row's padding
        torch.abs(flat, out=padded[: self.numel])
        rows = padded.unfold(0, self.width, 1).index_select(0, self.starts.view(-1))
        return rows.masked_fill_(self.column >= self.lengths, -1)  # made per call: a mask kept is a byte per element

    def kept(self, per_place: torch.Tensor) -> torch.Tensor:
        """Of a ``(rows, max(k))`` tensor, each row's first ``k``, flat."""
        flat = per_place.view(-1)
        return flat if self.keep is None else flat.index_select(0, self.keep)

    def constants(self, dtype: torch.dtype) -> _Constants:
        """The layout's constants in ``dtype`` (cached)."""
        if dtype not in self._constants:
            self._constants[dtype] = _Constants(self.ks, dtype)
        return self._constants[dtype]

    def mean_abs(self, magnitudes: torch.Tensor, constants: _Constants, halves: int = 1) -> torch.Tensor:
        """Each row's mean of its first ``k`` ``magnitudes`` (zeros after them) without overflow, as
        :func:`~gradcomm.compression.segment_stats.segment_mean_abs` of the chunks' chosen values: on the CPU
        the plain means first, kept unless one overflowed or came near underflow, else means of magnitudes
        divided by their row's peak. ``halves``: rows ``halves * r + h`` are half ``h`` of chunk ``r``, each
        half's means taken plainly or scaled for all its rows, as if it were alone."""
        means = self._means(magnitudes, halves)
        plain = [False] * halves
        if magnitudes.device.type == "cpu":
            plain = constants.plain(means.view(-1, halves))
            if all(plain):
                return means
        peak = magnitudes.amax(dim=1)
        scaled = peak.mul_(self._means(magnitudes.div(constants.nonzero_or_one(peak).view(-1, 1)), halves))
        if not any(plain):
            return scaled
        chosen = torch.tensor(plain, device=means.device)
        return torch.where(chosen, means.view(-1, halves), scaled.view(-1, halves)).view(-1)

    def _means(self, values: torch.Tensor, halves: int) -> torch.Tensor:
        """Each row's mean over its ``k`` (``values`` zero after them, rows a multiple of 32 wide): float32 sums of
        blocks of 32 added in float64 (:func:`~gradcomm.compression.segments._block_sums`, the reduction of a
        run of equal segments where ``k`` is a multiple of 32), the same bits whatever the rows' width: a
        chunk's scales do not depend on the bucket it is in."""
        means = _block_sums(values).view(-1, halves).div_(self.counts64.view(-1, 1)).view(-1)
        return torch.empty(means.shape, dtype=values.dtype, device=values.device).copy_(means)

    @functools.cached_property
    def counts64(self) -> torch.Tensor:
        return self.ks.to(torch.float64)


class _Constants:
    """A layout's constants in one dtype, as tensors (a Python number costs four more torch calls, its
    conversion, in every operation it is used in)."""

    def __init__(self, ks: torch.Tensor, dtype: torch.dtype):
        device = ks.device
        self.counts = ks.to(dtype)
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.one = torch.ones((), dtype=dtype, device=device)
        self.largest = torch.tensor(torch.finfo(dtype).max, dtype=dtype, device=device)
        self.floor = torch.tensor(_PLAIN_FLOOR, dtype=dtype, device=device)

    def nonzero_or_one(self, x: torch.Tensor) -> torch.Tensor:
        """:func:`~gradcomm.compression._numerics.nonzero_or_one`."""
        return torch.where(x == self.zero, self.one, x)

    def plain(self, means: torch.Tensor) -> list[bool]:
        """Per column of ``means``, whether none overflowed or came near underflow (``_plain_is_exact``): every
        mean within ``[floor, largest]``, which no NaN is."""
        within = torch.eq(means, torch.clamp(means, self.floor, self.largest))
        return within.all(dim=0).tolist()
