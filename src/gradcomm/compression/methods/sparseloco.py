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
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from gradcomm.compression._numerics import add_in_rank_order, dense_rows, rank_offsets, work_dtype, zeros_in
from gradcomm.compression.base import ErrorFeedback, Payload, SegmentedCompressor, tensor_stream
from gradcomm.compression.communicators import ALLGATHER
from gradcomm.compression.memory import ResidualMemory
from gradcomm.compression.methods._sparseloco_rows import Encoded, Rows
from gradcomm.compression.segment_bits import decode_segments, packed_lengths
from gradcomm.compression.segment_sparse import Budget
from gradcomm.compression.segment_stats import constant
from gradcomm.compression.segments import Segments, as_dtype

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


def _grouped_tops(packed: torch.Tensor, bits: int, groups: int) -> torch.Tensor:
    """The ``bits``-bit codes (int64) of packed bytes (1-D, or ``(world, bytes)``: then ``(world, codes)``)
    where every tensor's codes fill whole groups of ``groups`` codes (``pack_bits``' little-endian stream, a
    group's bytes one integer): each group's bytes as one int64, its codes shifted out of it. A few calls,
    where unpacking the stream by its merge steps took some forty."""
    width = bits * groups // 8
    as_words = torch.empty(packed.shape, dtype=torch.int64, device=packed.device).copy_(packed)
    weights, shifts, mask = _group_constants(bits, groups, packed.device)
    words = torch.mul(as_words.view(-1, width), weights).sum(dim=1, keepdim=True)
    codes = words.bitwise_right_shift_(shifts) if groups == 1 else words.bitwise_right_shift(shifts)
    return codes.bitwise_and_(mask).view(*packed.shape[:-1], -1)


@functools.lru_cache(maxsize=16)
def _group_constants(bits: int, groups: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A group's byte weights (``256 ** i``), its codes' shifts (``bits * j``) and the codes' mask. Shared:
    read them."""
    width = bits * groups // 8
    weights = torch.tensor([1 << (8 * i) for i in range(width)], dtype=torch.int64, device=device)
    shifts = torch.tensor([bits * j for j in range(groups)], dtype=torch.int64, device=device)
    return weights, shifts, torch.tensor((1 << bits) - 1, dtype=torch.int64, device=device)


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
    world_decoding = True
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
    def compress_segments(self, flat: torch.Tensor, segments: Segments) -> tuple[Payload, Encoded | None]:
        if not self.ef_decay:
            return self._encode(flat, segments)
        held = self._accumulation.held_segments(segments, flat)
        try:  # e = beta e + x, in place; a failure midway drops the accumulator (as error feedback does)
            decay = constant(self.ef_decay, flat.dtype, flat.device)
            accumulated = flat.clone() if held is None else held.mul_(decay).add_(flat)
            payload, encoded = self._encode(accumulated, segments)
            if encoded is not None:
                accumulated.index_add_(0, encoded.indices, encoded.sent, alpha=-1)
            self._accumulation.store_segments(segments, accumulated)
        except BaseException:
            self._accumulation.discard_segments(segments)
            raise
        return payload, encoded

    def _rows(self, segments: Segments) -> Rows:
        """The chunks of ``segments`` as rows (cached per layout, chunk and ratio)."""
        cache = segments.__dict__.setdefault("_sparseloco_rows", {})
        key = (self.chunk, self.ratio)
        if key not in cache:
            low_bytes, top_bits = _word_split(self.chunk)
            kept = [self._kept(n) for n in segments.lengths]
            cache[key] = Rows(segments, self._budget(segments), low_bytes, top_bits, kept)
        return cache[key]

    def _encode(self, flat: torch.Tensor, segments: Segments) -> tuple[Payload, Encoded | None]:
        """The payload of ``flat``'s chunks and what it sends (:class:`Encoded`; ``None`` where the segments
        are all empty: nothing to choose). Every chunk is a row of one ``(chunks, width)`` matrix, so that
        one ``topk`` chooses every chunk's values and its two magnitudes are row-wise statistics
        (:meth:`Rows.encode`): calls that do not grow with the chunks or their shapes."""
        if self._budget(segments).total == 0:
            layout = self.payload_layout(segments.lengths, flat.dtype)
            return [flat.new_empty(0, dtype=dtype) for _, dtype in layout], None
        encoded = self._rows(segments).encode(flat)
        return encoded.payload, encoded

    def _decode(self, payload: Payload, segments: Segments) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices into the flat tensor and values (work dtype) of one rank's payload; of every rank's at once
        (parts ``(world, ...)``, contiguous): ``(world, kept)`` each, row ``r`` rank ``r``'s, in as many calls."""
        budget = self._budget(segments)
        low_bytes, top_bits = _word_split(self.chunk)
        *low, packed, scales = payload
        world = packed.shape[0] if packed.dim() == 2 else None
        total = budget.total * (world or 1)
        words = torch.zeros(total, 8, dtype=torch.uint8, device=packed.device)
        if low_bytes:
            words[:, :low_bytes] = low[0].view(total, low_bytes)
        words = words.view(torch.int64).view(-1)
        rows = self._rows(segments)
        if rows.grouped:
            top = _grouped_tops(packed, top_bits, rows.groups)
        else:
            top = decode_segments(packed, rows.kept_segments, top_bits, _top_values(top_bits, packed.device))
        words.bitwise_or_((top if world is None else top.view(-1)).bitwise_left_shift(8 * low_bytes))
        codes = words.bitwise_and(2**_CODE_BITS - 1)
        indices = words.bitwise_right_shift_(_CODE_BITS)
        table = torch.cat([scales.view(-1, 2), scales.view(-1, 2).neg()], dim=1)
        ids4 = rows.ids4
        if world is None:
            return indices.add_(budget.starts), table.take(codes.add_(ids4))
        indices = indices.view(world, -1).add_(budget.starts)
        ranks = rank_offsets(world, table.shape[0] // world * 4, codes.device, torch.int64)  # a rank's 4 per chunk
        return indices, table.take(codes.view(world, -1).add_(ids4).add_(ranks))

    def decompress_segments(
        self, payload: Payload, ctx: Any, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        indices, values = self._decode(payload, segments)
        if values.dim() == 2:  # every rank's payload: (world, numel)
            return dense_rows(indices, as_dtype(values, segments.dtype), segments.numel)
        dense = zeros_in(out, segments.numel, segments.dtype, values.device)
        return dense.index_put_((indices,), as_dtype(values, segments.dtype))

    def aggregate_segments(
        self, gathered: Payload, ctx: Any, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The mean over ranks, summed in rank order (indices are distinct within a rank: deterministic): every
        rank's payload decoded at once, its values added rank after rank (:func:`add_in_rank_order`)."""
        world_size = gathered[0].shape[0]
        total = zeros_in(out, segments.numel, segments.dtype, gathered[0].device)
        if world_size == 1 and isinstance(ctx, Encoded):  # this rank's own payload: what its encoding sent
            return total.index_add_(0, ctx.indices, as_dtype(ctx.sent, segments.dtype))
        if world_size == 1:
            indices, values = self._decode([part[0] for part in gathered], segments)
            return total.index_add_(0, indices, as_dtype(values, segments.dtype))
        parts = [part if part.is_contiguous() else part.contiguous() for part in gathered]
        indices, values = self._decode(parts, segments)
        return add_in_rank_order(total, indices, as_dtype(values, segments.dtype).div(world_size))

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
