"""Bit packing by segment: the codes of a whole bucket packed in one pass, with the bytes of packing every tensor
on its own, back to back (each segment padded to whole bytes), and decoded with a table per segment.

Used by the quantizers and sign methods (:mod:`gradcomm.compression.methods`); the layouts and index tensors
come from :class:`~gradcomm.compression.segments.Segments`, cached on it per layout.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from gradcomm.compression._numerics import (
    pack_bits,
    sign_values,
    unpack_bits,
    work_dtype,
)
from gradcomm.compression._numerics.bits import _ROW_DTYPES
from gradcomm.compression._numerics.sparse import rank_offsets
from gradcomm.compression.segment_stats import Matrix, constant
from gradcomm.compression.segments import Padded, Segments, _ids, _placement, as_dtype

__all__ = [
    "byte_codes",
    "byte_table",
    "decode_scaled_signs",
    "decode_segments",
    "encode_scaled_signs",
    "lookup_bytes",
    "not_negative",
    "pack_scaled_signs",
    "pack_segments",
    "packed_lengths",
    "scaled_signs_layout",
    "unpack_scaled_signs",
    "unpad_rows",
]


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


def scaled_signs_layout(lengths: Sequence[int], dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
    """The payload of :func:`pack_scaled_signs`: every segment's sign bits, then one scale per segment."""
    return [(sum(packed_lengths(lengths, 1)), torch.uint8), (len(lengths), work_dtype(dtype))]


def pack_scaled_signs(flat: torch.Tensor, segments: Segments, scales: torch.Tensor) -> list[torch.Tensor]:
    """Each segment's signs (zeros as ``+``) packed one bit each, and its scale: ``sign(x) * scale``."""
    return encode_scaled_signs(flat, segments, scales)[0]


def encode_scaled_signs(
    flat: torch.Tensor, segments: Segments, scales: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`pack_scaled_signs`, and what :func:`decode_scaled_signs` decodes it from: ``flat`` itself (read
    there, so it must not change in between)."""
    return [pack_segments(not_negative(flat), segments, 1), scales], flat


def decode_scaled_signs(flat: torch.Tensor, scales: torch.Tensor, segments: Segments) -> torch.Tensor:
    """:func:`unpack_scaled_signs` of the payload :func:`encode_scaled_signs` made of ``flat``, the same values:
    ``+scale`` where ``flat >= 0``, ``-scale`` elsewhere, on the segments'
    :class:`~gradcomm.compression.segment_stats.Matrix` (a decoding where they have none). The scale's
    magnitude with the sign of ``flat + 0`` (-0 made +0; its NaN made -1, as :func:`not_negative` counts it):
    three passes in as many calls, where the signs' +-1 times the scale took eight (a selection by a bool
    mask is not vectorised on the CPU: ten times slower)."""
    matrix = Matrix.of(segments)
    if matrix is None:
        return unpack_scaled_signs([pack_segments(not_negative(flat), segments, 1), scales], segments)
    signed = torch.add(matrix.view(flat), constant(0.0, flat.dtype, flat.device))
    torch.nan_to_num(signed, nan=-1.0, out=signed)  # as nan_to_num_, in one call where that is two
    return torch.copysign(matrix.column(as_dtype(scales, segments.dtype)), signed, out=signed).view(-1)


def not_negative(flat: torch.Tensor) -> torch.Tensor:
    """Where ``flat >= 0`` (its sign bits: zeros count as ``+``, NaN as ``-``), as bool: one call (a Python 0,
    or an ``out=`` of int8, costs several); :func:`pack_segments` packs it as it is."""
    return torch.ge(flat, constant(0, flat.dtype, flat.device))


def unpack_scaled_signs(
    payload: Sequence[torch.Tensor], segments: Segments, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`pack_scaled_signs`: ``±scale`` of its segment for every coordinate."""
    bits, scales = payload
    tables = as_dtype(torch.mul(sign_values(scales.dtype, scales.device), scales.view(-1, 1)), segments.dtype)
    return decode_segments(bits, segments, 1, tables, out)


def decode_segments(
    packed: torch.Tensor,
    segments: Segments,
    bits: int,
    tables: torch.Tensor,
    out: torch.Tensor | None = None,
    by_byte: bool = False,
) -> torch.Tensor:
    """Inverse of :func:`pack_segments`, each code replaced by its value: ``tables[segment, code]`` with one
    row of ``2**bits`` values per segment (or one row for all). A lookup per byte, as ``decode_bits``.
    ``out``: a flat tensor of the segments' elements and the tables' dtype it may be written into (where the
    decoding needs no padding removed). ``by_byte`` (``bits`` 1, 2 or 4): each row of ``tables`` holds the
    values of every byte's codes already (``(segments, 256 * 8 // bits)``: a scale times
    :func:`byte_codes`' values, one multiplication where the values of the codes and their expansion to
    bytes were two calls more).

    Every rank's packing at once: ``packed`` of shape ``(world, bytes)`` (an all-gather's rows), with one
    table for all or ``world * len(segments)`` rows of them, rank by rank (each rank's scales): the result is
    ``(world, numel)``, row ``r`` the decoding of rank ``r``'s bytes alone, bit for bit, in as many calls as
    one rank's (``out`` is not used)."""
    if by_byte and (8 % bits or bits == 8):
        raise ValueError(f"decode_segments: by_byte tables need 1, 2 or 4 bits, got {bits}")
    world = packed.shape[0] if packed.dim() == 2 else None
    if world is not None:
        out = None
    per_segment = tables.dim() == 2 and tables.shape[0] > 1
    if bits == 8:  # a byte is a code, and segments are not padded
        if per_segment:
            return _decode_by_segment(packed, 8, tables, segments, out)
        return lookup_bytes(packed, byte_table(tables, 8), segments.numel, out)
    padded = segments.padded(8)
    if not padded.aligned:  # each segment's bytes at a multiple of 8 codes
        shape = (padded.numel * bits // 8,) if world is None else (world, padded.numel * bits // 8)
        bytes_ = packed.new_zeros(shape).index_copy_(packed.dim() - 1, _kept_bytes(segments, bits), packed)
    else:
        bytes_ = packed
    if 8 % bits:  # codes straddling bytes: unpacked, then looked up (one table)
        codes = unpack_bits(bytes_, bits, padded.numel).to(torch.int64)
        decoded = tables.reshape(-1).index_select(0, codes.view(-1)).view(codes.shape)
    elif not per_segment:
        table = tables.view(-1, 8 // bits) if by_byte else byte_table(tables, bits)
        decoded = lookup_bytes(bytes_, table, padded.numel, out if padded.aligned else None)
    else:
        decoded = _decode_by_segment(bytes_, bits, tables, segments, out if padded.aligned else None, by_byte)
    if world is not None:
        return unpad_rows(padded, decoded)
    return decoded if padded.aligned and decoded.numel() == segments.numel else padded.unpad(decoded)


def unpad_rows(padded: Padded, rows: torch.Tensor) -> torch.Tensor:
    """Of ``(world, padded numel)`` decodings of ``padded``'s layout, each row's elements without the padding:
    ``(world, numel)``, contiguous."""
    numel = padded.segments.numel
    if not padded.aligned:
        return rows.index_select(1, padded.index)
    return rows if rows.shape[1] == numel else rows[:, :numel].contiguous()


def lookup_bytes(
    packed: torch.Tensor, table: torch.Tensor, length: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The first ``length`` values of the codes in 1-D ``packed`` bytes, looked up in one :func:`byte_table`;
    of every row of ``(world, bytes)`` ``packed``: ``(world, length)`` (``out`` not used)."""
    rows = torch.empty(packed.shape, dtype=torch.int32, device=packed.device).copy_(packed)
    if packed.dim() == 2:
        world = packed.shape[0]
        decoded = _looked_up(table, rows.view(-1)).view(world, -1)
        return decoded if decoded.shape[1] == length else decoded[:, :length].contiguous()
    decoded = _looked_up(table, rows, out if packed.numel() * table.shape[1] == length else None)
    return decoded if decoded.numel() == length else decoded[:length]


def _decode_by_segment(
    packed: torch.Tensor,
    bits: int,
    tables: torch.Tensor,
    segments: Segments,
    out: torch.Tensor | None = None,
    by_byte: bool = False,
) -> torch.Tensor:
    """``decode_bits`` with one table per segment: a byte ``b`` of segment ``s`` reads row ``256 s + b``
    (:func:`_byte_offsets`: ``256 s`` in int32, one per byte, or a column of one per chunk of bytes); at 8
    bits a row is one value, looked up in the flat tables. ``(world, bytes)`` ``packed``: rank ``r``'s
    bytes read the tables of segment ``s`` of rank ``r``, row ``256 (r len(segments) + s) + b``."""
    rows = torch.empty(packed.shape, dtype=torch.int32, device=packed.device).copy_(packed)
    world = packed.shape[0] if packed.dim() == 2 else None
    if world is None or len(segments) > 1:  # (one segment of every rank: no offset within a rank)
        offsets = _byte_offsets(segments, bits)
        if offsets.dim() == 2:
            rows.view(*packed.shape[:-1], offsets.shape[0], -1).add_(offsets)
        else:
            rows.add_(offsets)
    if world is not None:
        if world > 1:
            rows.add_(rank_offsets(world, 256 * len(segments), rows.device))
        rows = rows.view(-1)
    if bits == 8:
        flat = tables.view(-1) if tables.is_contiguous() else tables.reshape(-1)
        usable = out is not None and out.is_contiguous() and out.dtype == flat.dtype and out.numel() == rows.numel()
        decoded = torch.index_select(flat, 0, rows, out=_flat(out)) if usable else flat.index_select(0, rows)
    else:
        decoded = _looked_up(tables if by_byte else _byte_rows(tables, bits), rows, out, 8 // bits)
    return decoded if world is None else decoded.view(world, -1)


def _looked_up(
    table: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None, per_byte: int | None = None
) -> torch.Tensor:
    """Rows ``rows`` of a :func:`byte_table`, flat: a table of one value per byte is a flat lookup. ``out``:
    where it may be written (flat, of the result's size and the table's dtype, contiguous), else ``None``.
    ``per_byte``: the values of a byte, where ``table`` is not viewed as one row of them per byte (a
    :func:`_byte_rows` table: ``(segments, 256 * per_byte)``)."""
    if per_byte is None:
        per_byte = table.shape[1]
    elif table.is_contiguous() and _ROW_DTYPES.get(per_byte * table.element_size()) is None:
        table = table.view(-1, per_byte)
    usable = (
        out is not None and out.is_contiguous() and out.dtype == table.dtype
        and out.numel() == rows.numel() * per_byte
    )
    if per_byte == 1:
        flat = table.view(-1)
        return torch.index_select(flat, 0, rows, out=_flat(out)) if usable else flat.index_select(0, rows)
    row_dtype = _ROW_DTYPES.get(per_byte * table.element_size())
    if row_dtype is None or not table.is_contiguous():  # rows copied as rows (one bit per code: 8 values)
        table = table if table.shape[-1] == per_byte else table.reshape(-1, per_byte)
        if usable:
            torch.index_select(table, 0, rows, out=out.view(-1, per_byte))
            return _flat(out)
        return table.index_select(0, rows).view(-1)
    elements = table.view(row_dtype).view(-1)  # a row as one element
    if usable and out.storage_offset() * out.element_size() % row_dtype.itemsize == 0:
        torch.index_select(elements, 0, rows, out=out.view(row_dtype))
        return _flat(out)
    return elements.index_select(0, rows).view(table.dtype)


def _flat(out: torch.Tensor) -> torch.Tensor:
    """Contiguous ``out``, flat: itself where it is (a view costs a call)."""
    return out if out.dim() == 1 else out.view(-1)


def byte_table(tables: torch.Tensor, bits: int) -> torch.Tensor:
    """Of ``tables`` (one row of ``2**bits`` code values per segment, or one row), the values of every byte's
    ``8 // bits`` codes: row ``256 s + b`` for byte ``b`` of segment ``s`` (:func:`_decode_by_segment`)."""
    if bits == 8:
        return tables.view(-1, 1) if tables.is_contiguous() else tables.reshape(-1, 1)
    return _byte_rows(tables, bits).view(-1, 8 // bits)


def _byte_rows(tables: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`byte_table` as ``(segments, 256 * codes per byte)``: the values of byte 0's codes, then of byte
    1's, ... of each segment (``bits < 8``)."""
    rows = tables if tables.dim() == 2 else tables.view(1, -1)
    return rows.index_select(1, _flat_patterns(bits, tables.device))


@functools.lru_cache(maxsize=16)
def byte_codes(values: tuple[float, ...], bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The values (``values[code]``) of the codes of byte 0, then of byte 1, ... (``256 * 8 // bits`` of
    them, flat; ``bits`` 1, 2 or 4): a scale column times it is a ``by_byte`` table of
    :func:`decode_segments`, the same products as the scale times each code's value. Made once per dtype
    and device and shared: read it, never write it."""
    return torch.tensor(values, dtype=dtype, device=device).index_select(0, _flat_patterns(bits, device))


@functools.lru_cache(maxsize=16)
def _flat_patterns(bits: int, device: torch.device) -> torch.Tensor:
    """:func:`_byte_patterns`, flat: the codes of byte 0, then of byte 1, ..."""
    return _byte_patterns(bits, device).reshape(-1)


@functools.lru_cache(maxsize=16)
def _byte_patterns(bits: int, device: torch.device) -> torch.Tensor:
    byte = torch.arange(256, device=device).unsqueeze(1)
    return (byte >> torch.arange(0, 8, bits, device=device)) & ((1 << bits) - 1)


def _byte_offsets(segments: Segments, bits: int) -> torch.Tensor:
    """``256 *`` each packed byte's segment (in the layout padded to 8 codes), in int32: a column of one per
    chunk where the segments cut into :class:`Chunks` (their bytes, too, are chunks of one length), else one
    per byte (cached)."""
    if segments.chunks is not None:
        return segments.chunks.byte_offsets
    cache = segments.__dict__.setdefault("_byte_offsets", {})
    if bits not in cache:
        lengths = segments.lengths if bits == 8 else [n * bits // 8 for n in segments.padded(8).lengths]
        cache[bits] = _ids(lengths, segments.device).to(torch.int32).mul_(256)
    return cache[bits]


def _kept_bytes(segments: Segments, bits: int) -> torch.Tensor:
    """Of the bytes of the layout padded to 8 codes, those :func:`pack_segments` keeps (cached)."""
    cache = segments.__dict__.setdefault("_kept_bytes", {})
    if bits not in cache:
        kept = packed_lengths(segments.lengths, bits)
        cache[bits] = _placement(kept, [n * bits // 8 for n in segments.padded(8).lengths], segments.device)
    return cache[bits]
