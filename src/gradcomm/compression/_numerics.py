"""Overflow- and underflow-safe reductions, bit packing and sparse selection shared by the compressors.

Gradients reach 1e30 and the subnormal range in practice (loss scaling, exploding layers); a plain
``vector_norm`` squares them into ``inf`` or ``0``. Everything here divides by the largest magnitude first and
works on any device (no host synchronisation on accelerators: the selections :func:`top_magnitudes` and
:func:`random_subset` take their faster, data-dependent paths only on the CPU), so compressors built from these
pieces stay finite and NCCL-ready.

The hot paths avoid what is slow on the CPU (``benchmarks/bench_compression.py`` measures them): full-size
``torch.where`` on broadcast boolean masks, ``topk`` and ``randperm`` over a whole tensor for a few
percent of it, float-to-uint8 conversions and reductions along a leading axis. The figures behind each choice
below ("several times faster") are one machine's, recorded with their dates in
``docs/notes/2026-11-27-figures-from-docstrings.md`` and ``docs/notes/2026-11-24-compression-compute.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch

__all__ = [
    "add_rounding_noise_",
    "as_uint8",
    "centred_noise",
    "decode_bits",
    "gather_rows",
    "index_dtype",
    "majority_signs",
    "NOISE_SCALE",
    "nonzero_or_one",
    "ordered_mean",
    "pack_bits",
    "pack_signs",
    "random_subset",
    "sign_values",
    "safe_mean_abs",
    "safe_norm",
    "safe_rms",
    "safe_std",
    "sparse_mean",
    "sparse_nonzero",
    "sparse_to_dense",
    "top_magnitudes",
    "unpack_bits",
    "unpack_signs",
    "work_dtype",
    "zero_at",
    "zeros_in",
]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are computed and sent in: at least float32, so half precision cannot overflow."""
    return torch.promote_types(dtype, torch.float32)


def nonzero_or_one(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zeros replaced by ones: a divisor for magnitudes whose scale is 0 only where they all are
    (then ``0 / 1 == 0``, without a mask)."""
    return torch.where(x == 0, torch.ones_like(x), x)


_nonzero = nonzero_or_one


def ordered_mean(tensors: Iterable[torch.Tensor], count: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``count`` tensors (or rows of a tensor) summed in the given order, so that every rank computing
    it gets identical bits; each is divided first, so the sum cannot overflow where the mean does not. The mean
    of one tensor is that tensor itself (not a copy); of several, it is summed in ``out`` where given (a tensor
    of their shape and dtype that none of them shares memory with)."""
    iterator = iter(tensors)
    if count == 1:
        return next(iterator)
    first = next(iterator)
    usable = out is not None and out.shape == first.shape and out.dtype == first.dtype
    total = torch.div(first, count, out=out) if usable else first / count
    for tensor in iterator:
        total += tensor / count
    return total


def _amax(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The largest element, of all or along ``dim`` (kept)."""
    return x.amax() if dim is None else x.amax(dim=dim, keepdim=True)


def _mean(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The mean, of all or along ``dim`` (kept)."""
    return x.mean() if dim is None else x.mean(dim=dim, keepdim=True)


def _max_abs(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    return _amax(x.abs(), dim)


def safe_norm(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """L2 norm without underflow (``keepdim`` along ``dim``), saturating at the dtype's largest value."""
    peak = _max_abs(x, dim)
    scaled = x / _nonzero(peak)
    norm = scaled.norm() if dim is None else scaled.norm(dim=dim, keepdim=True)
    return (peak * norm).clamp_(max=torch.finfo(x.dtype).max)


_PLAIN_FLOOR = 2.0**-80
"""The smallest mean (of magnitudes or squares) that :func:`safe_rms` and :func:`safe_mean_abs` take from a plain
sum: below it, terms lost to underflow (each under 2**-126 in float32) could matter beyond 2**-46 of it."""


def _plain_is_exact(mean: torch.Tensor) -> bool:
    """Whether means computed without scaling neither overflowed nor came near the underflow range. Reads the
    values on the host, so callers ask only on the CPU (an accelerator would wait for its stream)."""
    return bool(torch.isfinite(mean).logical_and_(mean >= _PLAIN_FLOOR).all())


def safe_rms(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Root mean square (``||x||_2 / sqrt(n)``) without overflow or underflow (``keepdim`` along ``dim``).

    On the CPU the plain mean of squares is tried first (two passes), and kept unless a square or the sum
    overflowed or the result is close enough to underflow to have lost terms; otherwise, and on other devices,
    the squares are of ``x`` divided by its peak magnitude (four passes). ``x.norm()`` would be faster still,
    but its float32 sum along a dimension is 50x less accurate (4e-6 relative over 500k elements).
    """
    if x.device.type == "cpu":
        mean_square = _mean(torch.mul(x, x), dim)
        if _plain_is_exact(mean_square):
            return mean_square.sqrt_()
    magnitude = x.abs()
    peak = _amax(magnitude, dim)
    scaled = magnitude.div_(_nonzero(peak))  # |x| / peak: the same squares as x / peak
    squares = scaled.mul_(scaled)  # what square() computes, without its slower pow kernel
    return peak * _mean(squares, dim).sqrt()


def safe_mean_abs(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean magnitude (``||x||_1 / n``) without overflow (``keepdim`` along ``dim``); on the CPU the plain mean
    first, as :func:`safe_rms` does."""
    magnitude = x.abs()
    if x.device.type == "cpu":
        mean = _mean(magnitude, dim)
        if _plain_is_exact(mean):
            return mean
    peak = _amax(magnitude, dim)
    return peak * _mean(magnitude.div_(_nonzero(peak)), dim)


def safe_std(x: torch.Tensor, peak: torch.Tensor | None = None) -> torch.Tensor:
    """Population standard deviation of all elements without overflow; ``peak``: ``x.abs().amax()`` where the
    caller has it already.

    Two passes, as ``std`` (the mean, then the mean square of the differences), but of vectorised sums: on the
    CPU ``torch.std``'s Welford loop costs several times a pass over memory; the result differs from it in the
    last bit or two (float32's cascade sums)."""
    peak = _max_abs(x, None) if peak is None else peak
    scaled = x / _nonzero(peak)
    centred = scaled.sub_(scaled.mean())
    return peak * centred.mul_(centred).mean().sqrt()


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes ``< 2**bits`` (``bits`` in 1..8) along the last dimension at exactly ``bits`` bits
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
    codes = as_uint8(codes, bits)
    if bits == 8:
        return codes
    length = codes.shape[-1]
    if length == 0:  # no codes, no bytes (and no lanes to view)
        return codes
    aligned = length % 8 == 0 and codes.is_contiguous() and codes.storage_offset() % 8 == 0
    padded = codes if aligned else torch.nn.functional.pad(codes, (0, -length % 8))  # a fresh, aligned copy
    if 8 % bits == 0:
        lane, multiplier = _gathering_lane(bits)
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
    if codes.is_floating_point():
        if bits < 8:
            return codes.to(torch.int8).view(torch.uint8)
        codes = codes.to(torch.int16)
    return codes.to(torch.uint8)


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
    rows = table.view(torch.uint8).view(row_dtype).reshape(-1)
    return rows.index_select(0, index).view(torch.uint8).view(table.dtype).view(-1, table.shape[1])


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


NOISE_SCALE = 2.0**-16
""":func:`centred_noise` times this is uniform on ``[-1/2, 1/2)`` in steps of ``2**-16``."""


def centred_noise(shape: torch.Size | tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Independent int16, uniform over all 65,536 values: 16 random bits per element, four from each 64-bit draw.

    Times :data:`NOISE_SCALE` (fused into an ``add``/``sub``'s ``alpha``) they are uniform on ``[-1/2, 1/2)``, so
    ``1/2 +`` that is uniform on ``[0, 1)`` in steps of ``2**-16``: stochastic rounding with it rounds up with a
    probability that exceeds the exact fraction by less than ``2**-16`` (of a step). On the CPU a 64-bit draw
    costs two of the generator's (mt19937) 32-bit outputs: half an output per element, where two 24-bit fields
    per draw, or ``torch.rand``, take one. The draws cover the
    full 64 bits (``random_(-2**63, None)``: the default ``random_()`` of int64 leaves the sign bit 0). Every
    element depends only on the generator's seed; only the views are dtype-specific, so any device draws alike.
    """
    numel = math.prod(shape)
    words = torch.empty(-(-numel // 4), dtype=torch.int64, device=device).random_(-(2**63), None, generator=generator)
    return words.view(torch.int16)[:numel].view(shape)


def add_rounding_noise_(x: torch.Tensor, offset: float, generator: torch.Generator | None) -> torch.Tensor:
    """``x + offset + u`` in place, ``u`` uniform on ``[0, 1)`` in steps of ``2**-16`` (:func:`centred_noise`):
    its floor is ``x + offset`` rounded down or up, up with the chance of its fraction (less than ``2**-16``
    more), whatever the sign of ``x``: -1.25 becomes -1 or -2, -2 a quarter of the time, as the sign times the
    rounding of 1.25 would. Where ``x + offset >= 0`` the result is too, so an integer conversion's truncation
    is that floor (stochastic quantizers' codes: QSGD, TernGrad). The result is at most ``max(x) + offset + 1 -
    2**-16``, a float32 exactly where it is below ``2**8`` (24 bits), so where ``max(x) + offset`` is a whole
    number below that, the truncation never passes it."""
    noise = centred_noise(x.shape, generator, x.device)
    return x.add_(noise, alpha=NOISE_SCALE).add_(offset + 0.5)


# -- sparse payloads: values at indices (top-k, DGC) ------------------------------------------------------------
def index_dtype(numel: int) -> torch.dtype:
    """The narrowest index dtype for a tensor of ``numel`` elements: int32, or int64 above 2**31 - 1."""
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


_SAMPLE = 4096
"""Magnitudes sampled by :func:`top_magnitudes` to estimate its threshold."""


def sample_stride(numel: int) -> int:
    """The stride of :func:`top_magnitudes`' sample of a flat tensor of ``numel`` elements: about ``numel /
    4096``, and odd. Weights are row-major matrices whose rows are mostly powers of two long, and an even stride
    visits a few columns of them only: where the gradient's magnitude differs by column (an MLP's output
    projection: each column scaled by one hidden unit's activation), the threshold came out far too low (10x
    the candidates needed, in the transformer workload's training). An odd stride visits every column."""
    return (numel // _SAMPLE) | 1


def top_magnitudes(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest ``|flat|`` (NaN counting as largest, as in ``torch.topk``), in no order.

    The set is ``torch.topk``'s (up to the choice among equal magnitudes at the k-th place). On the CPU a
    large tensor goes a faster way (a full ``topk`` is costly per element there): the magnitude at
    the ``2k``-th place of an evenly strided sample of about 4096 (:func:`sample_stride`) estimates a
    threshold, every element not below it is a candidate, and the top k of the candidates are the top k of all
    when there are at least k of them (otherwise, rarely, the full ``topk`` runs). Where the threshold is 0
    (a mostly zero tensor: an embedding's gradient, say), every element would be a candidate: the candidates
    are the elements above it, and where fewer than k are, the first zeros make up the rest. The sample needs
    no random draws, so ranks compute it alike; only the amount of work depends on the values, never the
    result's size.
    """
    magnitudes = flat.abs()
    stride = sample_stride(magnitudes.numel())
    if flat.device.type != "cpu" or stride < 16 or k > magnitudes.numel() // 4:
        return magnitudes.topk(k, sorted=False).indices
    sample = magnitudes[::stride]
    place = min(sample.numel(), -(-2 * k * sample.numel() // magnitudes.numel()) + 1)
    # a Python number, not a 0-dim tensor: compared with one, into int8, the mask is written faster
    threshold = sample.topk(place, sorted=True).values[-1].item()
    mostly_zero = threshold == 0
    below = (torch.le if mostly_zero else torch.lt)(
        magnitudes, threshold, out=torch.empty(magnitudes.shape, dtype=torch.int8)
    )
    candidate = below.view(torch.bool).logical_not_()  # NaN is never below: a candidate
    candidates = sparse_nonzero(candidate) if 64 * k <= magnitudes.numel() else candidate.nonzero().squeeze(1)
    if candidates.numel() >= k:
        return candidates[magnitudes[candidates].topk(k, sorted=False).indices]
    if mostly_zero:  # every nonzero element, then zeros: the first k elements hold enough of them
        zeros = candidate[:k].logical_not().nonzero().squeeze(1)[: k - candidates.numel()]
        return torch.cat([candidates, zeros])
    return magnitudes.topk(k, sorted=False).indices


def sparse_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """The indices of a flat boolean ``mask``'s true elements in ascending order, as ``mask.nonzero()``, faster
    where they are few: ``nonzero`` first finds the 8-byte words holding any (a scan of an eighth of the
    elements), then searches those words alone: faster at low densities, slower at high ones."""
    length = mask.numel()
    head = length - length % 8
    if mask.storage_offset() % 8 or not mask.is_contiguous():
        mask = mask.clone()
    all_words = mask[:head].view(torch.int64)
    words = all_words.nonzero().squeeze(1)
    found = all_words[words].view(torch.uint8).view(-1, 8).nonzero()  # whole words: faster than rows of 8
    indices = words[found[:, 0]].mul_(8).add_(found[:, 1])
    if head == length:
        return indices
    return torch.cat([indices, mask[head:].nonzero().squeeze(1).add_(head)])


def random_subset(numel: int, k: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``k`` distinct indices of ``range(numel)``, a uniformly random subset in random order (as
    ``randperm(numel)[:k]``, whose cost grows with ``numel`` however small ``k`` is).

    On the CPU, for ``k`` up to a quarter of ``numel``: draws with replacement, and the first ``k`` distinct
    draws in drawing order (sequential rejection sampling: each new index is uniform over those not drawn yet),
    at a cost that grows with ``k``. The draws depend only on the generator, so ranks sharing a seed agree.
    """
    if device.type != "cpu" or 4 * k > numel:
        return torch.randperm(numel, generator=generator, device=device)[:k]
    draws = torch.empty(0, dtype=torch.int64, device=device)
    while True:  # one round but for about one time in a million
        more = torch.randint(numel, (k + k // 8 + 16,), generator=generator, device=device)
        draws = torch.cat([draws, more])
        distinct, which = torch.unique(draws, return_inverse=True)
        if distinct.numel() >= k:
            break
    positions = torch.arange(draws.numel(), device=device)
    first = torch.full_like(distinct, draws.numel()).scatter_reduce_(0, which, positions, "amin")
    return distinct[first.argsort()[:k]]


def zero_at(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``tensor`` with the elements at flat ``indices`` set to 0: in place (and returned) where it is
    contiguous, else in a contiguous copy."""
    tensor = tensor.contiguous()
    return tensor.view(-1).index_fill_(0, indices.long(), 0).view(tensor.shape)


def zeros_in(out: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``numel`` zeros of ``dtype``, flat: ``out`` zeroed where it is contiguous with that size and dtype (a
    decoder's ``out``, the gradient's place in its bucket), else a new tensor."""
    if out is not None and out.is_contiguous() and out.numel() == numel and out.dtype == dtype:
        return out.view(-1).zero_()
    return torch.zeros(numel, dtype=dtype, device=device)


def sparse_to_dense(values: torch.Tensor, indices: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor of ``numel`` zeros holding ``values`` at ``indices``."""
    dense = torch.zeros(numel, dtype=dtype, device=values.device)
    return dense.scatter_(0, indices.long(), values)


def sparse_mean(
    values: torch.Tensor, indices: torch.Tensor, numel: int, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The mean over ranks of sparse payloads gathered with a leading rank axis, summed in rank order; flat,
    in ``out`` where given and contiguous (``numel`` elements of ``dtype``), else in a new tensor."""
    world_size = values.shape[0]
    total = zeros_in(out, numel, dtype, values.device)
    for rank in range(world_size):  # indices are distinct within a rank: deterministic even with atomics
        total.index_add_(0, indices[rank].long(), values[rank] / world_size)
    return total
