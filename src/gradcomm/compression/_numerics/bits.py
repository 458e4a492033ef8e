"""Bit packing and sign codes: codes of 1 to 8 bits packed into bytes, decoded by table lookups.

The hot paths avoid what is slow on the CPU (``benchmarks/bench_compression.py`` measures them): float-to-uint8
conversions, a broadcast pass per code, reductions along a leading axis. The figures behind each choice below
("several times faster") are one machine's, recorded with their dates in
``docs/notes/2026-11-27-figures-from-docstrings.md`` and ``docs/notes/2026-11-24-compression-compute.md``.
"""

from __future__ import annotations

import functools

import torch

from gradcomm.compression._numerics.reductions import work_dtype

__all__ = [
    "as_uint8",
    "decode_bits",
    "gather_rows",
    "majority_signs",
    "pack_bits",
    "pack_signs",
    "sign_values",
    "unpack_bits",
    "unpack_signs",
]


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes ``< 2**bits`` (``bits`` in 1..8; uint8, or int8 below 8 bits, are packed as their
    bytes, other dtypes converted) along the last dimension at exactly ``bits`` bits
    each: ``ceil(length * bits / 8)`` bytes, zero padded.

    The bytes are one little-endian bit stream: code ``i`` sits at stream bits ``i * bits`` upwards (for 1, 2
    and 4 bits: code ``i`` of a byte at bits ``i * bits``, the first code in the lowest bits; other widths
    straddle bytes). For 1, 2 and 4 bits, the ``8 // bits`` codes of a byte are gathered by one integer
    multiplication of the lane (int64, int32 or int16) that holds them one per byte (:func:`_gathering_lane`).
    For other widths, eight codes at a time are packed as one int64 word (one code per byte, little-endian),
    whose fields are merged pairwise by shift-and-mask steps (:func:`_merge_steps`) until they fill whole
    bytes: a few vectorised passes over an eighth of the elements, where shifting each code into place took a
    broadcast uint8 pass per code.
    """
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"pack_bits: bits must be an integer in 1..8, got {bits!r}")
    as_bytes = codes.dtype == torch.uint8 or (codes.dtype == torch.bool and bits == 1) or (
        codes.dtype == torch.int8 and bits < 8
    )
    if not as_bytes:  # bool, int8 codes (below 2**bits < 128): packed as their bytes
        codes = as_uint8(codes, bits)
    if bits == 8:
        return codes
    length = codes.shape[-1]
    if length == 0:  # no codes, no bytes (and no lanes to view)
        return codes.view(torch.uint8) if codes.dtype == torch.int8 else codes
    aligned = length % 8 == 0 and codes.is_contiguous() and codes.storage_offset() % 8 == 0
    padded = codes if aligned else torch.nn.functional.pad(codes, (0, -length % 8))  # a fresh, aligned copy
    if 8 % bits == 0:
        lane, _ = _gathering_lane(bits)
        multiplier = _multiplier(bits, codes.device)
        if padded.dim() == 1:  # each lane's top byte, as one strided view: four calls
            lane_bytes = 8 // bits
            product = torch.mul(padded.view(lane), multiplier).view(torch.uint8)
            return product.as_strided((-(-length * bits // 8),), (lane_bytes,), lane_bytes - 1)
        lanes = padded.reshape(*codes.shape[:-1], -1, 8 // bits).view(lane)
        return (lanes * multiplier).view(torch.uint8)[..., -1][..., : -(-length * bits // 8)]
    words = padded.reshape(*codes.shape[:-1], -1, 8).view(torch.int64)
    steps = _merge_steps(bits)
    for width, spacing in steps:
        shifted = words >> (spacing - width)
        if spacing >= 2 * width:  # the lower field shifts out entirely: one mask keeps both fields
            words = shifted.bitwise_or_(words).bitwise_and_(_field_mask(2 * width, 2 * spacing))
        else:
            low = _field_mask(width, 2 * spacing)
            words = shifted.bitwise_and_(low << width).bitwise_or_(words.bitwise_and(low))
    width, spacing = _packed_field(bits)
    packed = words.view(torch.uint8).reshape(*codes.shape[:-1], -1, spacing // 8)[..., : width // 8]
    return packed.reshape(*codes.shape[:-1], -1)[..., : -(-length * bits // 8)]


_LANES = {1: torch.int64, 2: torch.int32, 4: torch.int16}


@functools.lru_cache(maxsize=16)
def _multiplier(bits: int, device: torch.device) -> torch.Tensor:
    """:func:`_gathering_lane`'s multiplier as a 0-d tensor of its lane dtype (a Python number costs four calls
    more per multiplication; the products wrap alike). Shared: read it, never write it."""
    lane, multiplier = _gathering_lane(bits)
    return torch.tensor(multiplier, dtype=lane, device=device)


@functools.lru_cache(maxsize=4)
def _gathering_lane(bits: int) -> tuple[torch.dtype, int]:
    """The integer dtype of ``n = 8 // bits`` bytes, and the multiplier that gathers ``n`` codes ``c_i < 2**bits``,
    one per byte of such a lane (byte ``i`` at bit ``8 i``, little-endian), into its top byte as
    ``sum_i c_i << (bits * i)``.

    The multiplier is ``sum_j 2**(8 (n - 1) - (8 - bits) j)``: it copies code ``i`` to bit
    ``8 (n - 1) + 8 i - (8 - bits) j`` for every ``j``. Those places are ``bits`` or more apart for distinct
    ``(i, j)`` (their differences ``8 (i - i') - (8 - bits) (j - j')`` are nonzero multiples of ``bits``), so
    the products never overlap and nothing carries; only ``j == i`` lands in the top byte (at bit
    ``8 (n - 1) + bits i``), and what passes the lane's top bit wraps away. For one bit it is
    ``0x0102040810204080`` on an int64. One multiplication replaces the three shift-and-mask merges of
    :func:`_merge_steps` (three passes each, over the same eighth of the elements), and is faster (the
    fourth pass in ``docs/notes/2026-11-24-compression-compute.md``).
    """
    lane_bytes = 8 // bits
    return _LANES[bits], sum(1 << (8 * (lane_bytes - 1) - (8 - bits) * j) for j in range(lane_bytes))


@functools.lru_cache(maxsize=8)
def _merge_steps(bits: int) -> tuple[tuple[int, int], ...]:
    """The ``(width, spacing)`` of the fields before each merge of :func:`pack_bits`: fields of ``width``
    bits every ``spacing`` bits become fields of twice both, until a field is whole bytes."""
    steps, width, spacing = [], bits, 8
    while width % 8:
        steps.append((width, spacing))
        width, spacing = 2 * width, 2 * spacing
    return tuple(steps)


def _packed_field(bits: int) -> tuple[int, int]:
    """Width and spacing of :func:`pack_bits`' fields after its last merge."""
    steps = _merge_steps(bits)
    return (2 * steps[-1][0], 2 * steps[-1][1]) if steps else (8, 8)


def _unpack_words(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits` for any width: its merges undone in reverse order, as uint8 codes."""
    width, spacing = _packed_field(bits)
    field_bytes, word_bytes = width // 8, spacing // 8
    lead = packed.shape[:-1]
    groups = -(-packed.shape[-1] // field_bytes)
    fields = torch.nn.functional.pad(packed, (0, groups * field_bytes - packed.shape[-1]))
    fields = fields.reshape(*lead, groups, field_bytes)
    bytes_ = torch.nn.functional.pad(fields, (0, word_bytes - field_bytes)).reshape(*lead, -1)
    words = torch.nn.functional.pad(bytes_, (0, -bytes_.shape[-1] % 8)).reshape(*lead, -1, 8).view(torch.int64)
    for width, spacing in reversed(_merge_steps(bits)):
        low = _field_mask(width, 2 * spacing)
        words = words.bitwise_and(low << width).bitwise_left_shift_(spacing - width).bitwise_or_(
            words.bitwise_and_(low)
        )
    return words.view(torch.uint8).reshape(*lead, -1)[..., :length]


def as_uint8(codes: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """``codes`` (below ``2**bits``) as uint8; booleans are reinterpreted in place, floats are truncated towards
    zero. Floats go through int8 where the codes fit it (``bits < 8``), else through int16: on the CPU a direct
    float-to-uint8 conversion is several times slower than either, and all give the same bytes for codes in
    range."""
    if codes.dtype == torch.bool:
        return codes.view(torch.uint8)
    if codes.is_floating_point():  # conversions into new tensors: two calls each, where .to is four
        if bits < 8:
            return _converted(codes, torch.int8).view(torch.uint8)
        codes = _converted(codes, torch.int16)
    return codes if codes.dtype == torch.uint8 else _converted(codes, torch.uint8)


def _converted(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` (the same conversion) into a new contiguous tensor."""
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def _field_mask(width: int, spacing: int) -> int:
    """An int64 mask of the low ``width`` bits of every ``spacing``-bit field."""
    return sum(((1 << width) - 1) << offset for offset in range(0, 64, spacing))


@functools.lru_cache(maxsize=64)
def _byte_codes(bits: int, device: torch.device) -> torch.Tensor:
    """Row ``b``: the ``8 // bits`` codes packed in byte ``b`` (int64, to index a table of code values)."""
    byte = torch.arange(256, device=device).unsqueeze(1)
    return (byte >> torch.arange(0, 8, bits, device=device)) & ((1 << bits) - 1)


def decode_bits(packed: torch.Tensor, bits: int, length: int, values: torch.Tensor) -> torch.Tensor:
    """The first ``length`` codes of :func:`pack_bits` (1, 2, 4 or 8 bits wide) along the last dimension, each
    replaced by its value:
    ``values[code]``, with ``values`` of shape ``(2**bits,)``, or ``values[row, code]`` with one row of values
    per row of ``packed`` (shape ``(*packed.shape[:-1], 2**bits)``: per-row scales).

    Decoding is one lookup per byte in a table of the 256 byte patterns' values, so the values (signs times a
    scale, say) cost no pass of their own over the result; the result has ``values``' dtype.
    """
    patterns = _byte_codes(bits, packed.device)
    leading, width = packed.shape[:-1], packed.shape[-1]  # sizes, not -1: an empty packing is decoded too
    rows = packed.reshape(leading.numel(), width).to(torch.int32)
    tables = values.reshape(-1, 2**bits)  # one row of values per table
    if bits < 8:  # at 8 bits a byte is one code: its table row is the code's value
        tables = tables[:, patterns]
    table = tables.reshape(-1, patterns.shape[1])
    if tables.shape[0] > 1:  # one table per row, side by side: row r's bytes index rows 256 * r onwards
        rows += 256 * torch.arange(rows.shape[0], dtype=torch.int32, device=packed.device).unsqueeze(1)
    decoded = gather_rows(table, rows.reshape(-1))
    return decoded.reshape(*leading, width * patterns.shape[1])[..., :length]


_ROW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}
"""A dtype of each row size that :func:`gather_rows` copies as one element."""


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table.index_select(0, index)`` for a contiguous 2-D ``table``, its bits copied unchanged.

    ``index_select`` copies a 2-D table row by row on the CPU, at a cost per row whatever the row's width;
    a row of 1, 2, 4, 8 or 16 bytes is gathered as one element of a dtype of that size instead, several times
    faster for the 2- and 4-bit codes' tables of float32 (2 and 4 values per byte). Wider rows (one
    bit per code: 8 values, 32 bytes) are written at memory speed either way and go as they are.
    """
    row_dtype = _ROW_DTYPES.get(table.shape[1] * table.element_size())
    if row_dtype is None or not table.is_contiguous():
        return table.index_select(0, index)
    rows = table.view(row_dtype).view(-1)  # a row is one element of row_dtype
    return rows.index_select(0, index).view(table.dtype).view(-1, table.shape[1])


def unpack_bits(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``length`` codes along the last dimension, as uint8."""
    if bits == 8:
        return packed[..., :length]
    if 8 % bits:
        return _unpack_words(packed, bits, length)
    return decode_bits(packed, bits, length, torch.arange(2**bits, dtype=torch.uint8, device=packed.device))


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per element along the last dimension: 1 for ``x >= 0``, 0 for negatives (and NaN).

    The comparison writes int8 rather than bool: the same 0 and 1 bytes, but on the CPU a comparison into
    bool is not vectorised."""
    not_negative = torch.ge(x, 0, out=torch.empty(x.shape, dtype=torch.int8, device=x.device))
    return pack_bits(not_negative.view(torch.uint8), 1)


def unpack_signs(packed: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`pack_signs` as ``+1``/``-1`` of ``dtype``."""
    return decode_bits(packed, 1, length, sign_values(dtype, packed.device))


def majority_signs(packed: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The vote ``sign(sum_r (2 b_r - 1))`` of the first ``length`` sign bits of every row of ``packed`` (rows:
    ranks, bits as :func:`pack_signs` makes them), as ``+1``, ``-1`` or ``0`` (a tie) of ``dtype``.

    Counted on the packed bytes themselves: the bits' sum at each position is kept in bit planes (plane
    ``j`` holds bit ``j`` of every position's count), each row added by a ripple of xor and and; two planes
    then say where the count is above half the rows and where below, and one lookup per byte pair decodes
    both into values. About ``2 rows log2(rows)`` byte-wise passes over an eighth of the elements, where
    decoding every row into floats and summing them made ``rows`` full float passes and as many additions.

    Only on the CPU: elsewhere the float sum, a few kernels whatever the number of rows, where the count
    launches about ``2 rows log2(rows)`` small ones (not measured on a GPU). Row by row: a reduction over the
    leading axis is several times slower; exact up to 2**24 rows.
    """
    if packed.device.type != "cpu":
        votes = functools.reduce(torch.add, unpack_signs(packed, length, work_dtype(dtype)).unbind(0))
        return votes.sign().to(dtype)
    rows = packed.shape[0]
    planes: list[torch.Tensor] = []
    for row in packed.unbind(0):
        carry = row
        for j, plane in enumerate(planes):
            planes[j], carry = plane ^ carry, plane & carry
        if len(planes) < rows.bit_length():
            planes.append(carry)
    above = _count_above(planes, rows // 2)  # count > rows / 2
    below = _count_above(planes, (rows + 1) // 2 - 1).bitwise_not_()  # count < rows / 2
    pairs = torch.stack([above, below], dim=-1).view(torch.int16).reshape(-1).to(torch.int32).bitwise_and_(0xFFFF)
    return gather_rows(_vote_table(dtype, packed.device), pairs).reshape(-1)[:length]


def _count_above(planes: list[torch.Tensor], bound: int) -> torch.Tensor:
    """Bits set where the count held in ``planes`` (least significant first) exceeds ``bound``: compared from
    the most significant plane down, as long as the higher bits are equal."""
    above = torch.zeros_like(planes[0])
    equal = torch.full_like(planes[0], 0xFF)
    for j in reversed(range(len(planes))):
        if (bound >> j) & 1:
            equal &= planes[j]
        else:
            above |= equal & planes[j]
            equal &= ~planes[j]
    return above


@functools.lru_cache(maxsize=8)
def _vote_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Row ``a + 256 b``: the 8 votes of a byte ``a`` of "above" bits and ``b`` of "below" bits (``+1``, ``-1``,
    else ``0``). 65,536 rows: 2 MB in float32, made once per dtype and device; read it, never write it."""
    bits = (torch.arange(65536, device=device).unsqueeze(1) >> torch.arange(16, device=device)) & 1
    return (bits[:, :8] - bits[:, 8:]).to(dtype)


@functools.lru_cache(maxsize=64)
def sign_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The values of sign codes 0 and 1 (:func:`pack_signs`): ``[-1, +1]``; times a scale, for :func:`decode_bits`.

    Made once per dtype and device and shared: read it, never write it. (Made afresh, it cost a copy from
    host memory per decoded tensor, which on CUDA also waits for the stream.)"""
    return torch.tensor([-1, 1], dtype=dtype, device=device)
