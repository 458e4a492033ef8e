"""Properties of every compressor on its own (no process group): codec round trips, selection, unbiasedness,
error-feedback bookkeeping, and finiteness at the edges of the floating-point range."""

import io
import math
import pickle
import sys
from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradcomm.compression import (
    QSGD,
    ByteGrad,
    Compressor,
    ErrorFeedback,
    NoCompression,
    RandomizedCompressor,
    RandomK,
    ResidualMemory,
    TernGrad,
    TopK,
    _numerics,
)
from gradcomm.compression._numerics import (
    NOISE_SCALE,
    centred_noise,
    decode_bits,
    gather_rows,
    pack_bits,
    pack_signs,
    top_magnitudes,
    unpack_bits,
    unpack_signs,
)
from gradcomm.compression.communicators import ALLGATHER, ALLREDUCE, compensated_compress
from gradcomm.compression.registry import methods

HUGE = float(np.float32(1e30))
FAST = settings(max_examples=25, deadline=None)
SLOW = settings(max_examples=6, deadline=None)

# Every registered method with its default options (a new method is covered without an edit here), plus
# variants of some methods' options and the unregistered dense NoCompression.
VARIANTS = {
    "randomk_biased": partial(RandomK, unbiased=False),
    "qsgd_8bit": partial(QSGD, levels=127, bucket_size=64),
    "terngrad_unclipped": partial(TernGrad, clip=None),
    "none": NoCompression,
}
COMPRESSORS = {**methods(), **VARIANTS}
NAMES = sorted(COMPRESSORS)
RANDOMIZED = [name for name, cls in methods().items() if issubclass(cls, RandomizedCompressor)]
# Methods whose round trip does not keep an all-zero tensor zero, and why.
ZERO_NOT_KEPT = {"signsgd": "signs of zeros are sent as +1"}

shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=12)


def tensors(dtype=np.float32, low: float = -1e3, high: float = 1e3) -> st.SearchStrategy[torch.Tensor]:
    elements = st.floats(low, high, width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False)
    return hnp.arrays(dtype, shapes, elements=elements).map(torch.from_numpy)


def round_trip(compressor: Compressor, x: torch.Tensor) -> torch.Tensor:
    payload, ctx = compressor.compress(x)
    return compressor.decompress(payload, ctx)


@pytest.mark.parametrize("name", NAMES)
@FAST
@given(x=tensors(), dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_round_trip_keeps_shape_and_dtype(name, x, dtype):
    x = x.to(dtype)
    y = round_trip(COMPRESSORS[name](), x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all()


def _special(kind: str, shape: tuple[int, ...], value: float, sign_seed: int) -> torch.Tensor:
    if kind == "constant":
        return torch.full(shape, value)
    signs = torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(sign_seed)) * 2 - 1
    magnitude = {"zero": 0.0, "tiny": 1e-42, "huge": 1e30, "largest": 3.0e38}[kind]  # tiny: float32 subnormal
    return signs * torch.full(shape, magnitude)


@pytest.mark.parametrize("name", NAMES)
@FAST
@given(
    kind=st.sampled_from(["zero", "constant", "tiny", "huge", "largest"]),
    shape=shapes,
    value=st.floats(width=32, allow_nan=False, allow_infinity=False),
    sign_seed=st.integers(0, 2**16),
)
def test_finite_input_never_becomes_nan_or_inf(name, kind, shape, value, sign_seed):
    compressor = COMPRESSORS[name]()
    x = _special(kind, shape, value, sign_seed)
    payload, ctx = compressor.compress(x)
    assert all(torch.isfinite(part).all() for part in payload if part.is_floating_point())
    y = compressor.decompress(payload, ctx)
    assert torch.isfinite(y).all(), f"{name} turned {kind} input into {y}"
    if kind == "zero" and name not in ZERO_NOT_KEPT:
        assert not y.any()


@FAST
@given(x=tensors(), ratio=st.floats(0.001, 1.0))
def test_topk_keeps_exactly_the_k_largest_magnitudes(x, ratio):
    compressor = TopK(ratio)
    (values, indices), ctx = compressor.compress(x)
    flat = x.reshape(-1)
    k = max(1, math.ceil(ratio * flat.numel()))
    assert indices.numel() == k == len(set(indices.tolist()))
    assert torch.equal(values, flat[indices.long()])
    dropped = torch.ones(flat.numel(), dtype=torch.bool)
    dropped[indices.long()] = False
    if dropped.any():
        assert values.abs().min() >= flat[dropped].abs().max()
    y = compressor.decompress([values, indices], ctx).reshape(-1)
    assert torch.equal(y[~dropped], flat[~dropped]) and not y[dropped].any()


def _mean_of_draws(compressor: Compressor, x: torch.Tensor, draws: int) -> torch.Tensor:
    total = torch.zeros(x.shape, dtype=torch.float64)
    for _ in range(draws):
        total += round_trip(compressor, x).double()
    return total / draws


DRAWS = 2000
SIGMAS = 6.0
# Each coordinate of a mean of DRAWS independent draws has standard error sqrt(variance bound / DRAWS). By the
# central limit theorem (DRAWS = 2000 draws of a bounded variable), a deviation beyond 6 standard errors has
# probability ~2e-9 per coordinate: over every coordinate of every example below, a false failure is less
# likely than 1e-4. The bounds are the papers' per-coordinate variances, maximized over the unknown rounding:
#   QSGD:     Var = (norm_b / s)**2 * p (1 - p) <= (norm_b / s)**2 / 4   (norm_b: the bucket's norm)
#   TernGrad: Var = |x| (scale - |x|)        <= scale**2 / 4            (scale = max |x|, no clipping)
#   random-k: Var = x**2 (numel / k - 1)                                  (rescaled by numel / k)
# A float32 rounding allowance (1e-5 relative to the tensor's peak) covers the codecs' arithmetic.


def _assert_unbiased(mean: torch.Tensor, x: torch.Tensor, std_bound: torch.Tensor) -> None:
    exact = x.double()
    allowed = SIGMAS * std_bound / math.sqrt(DRAWS) + 1e-5 * exact.abs().max()
    assert ((mean - exact).abs() <= allowed).all(), (mean - exact).abs().max()


unbiased_inputs = hnp.arrays(
    np.float32, st.integers(1, 48), elements=st.floats(-10, 10, width=32, allow_subnormal=False)
).map(torch.from_numpy)


@pytest.mark.parametrize(
    "make", [partial(QSGD, levels=1), QSGD, partial(QSGD, levels=127, bucket_size=64), TernGrad, partial(TernGrad, clip=None)]
)
@pytest.mark.parametrize("noise", [-(2**15), -1, 0, 2**15 - 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stochastic_rounding_at_the_noise_extremes(make, noise, dtype, monkeypatch):
    """With every draw at one value, u = 1/2 + noise * 2**-16 is the same for every element: each level is its
    exact value rounded down or up (down for all at u = 0), and a level that is already whole (+-levels in a
    bucket of one nonzero; +-scale) comes back exactly. That is where the bound arguments in the methods'
    comments are tight (u = 1 - 2**-16 on a whole level, 127 levels too)."""
    compressor = make()
    qsgd = isinstance(compressor, QSGD)
    def constant_noise(seeds, segments, multiple=1):
        return torch.full((segments.padded(multiple).numel,), noise, dtype=torch.int16)

    monkeypatch.setattr(sys.modules[type(compressor).__module__], "segment_noise", constant_noise)
    generator = torch.Generator().manual_seed(noise)
    one_hot = torch.zeros(4096)
    one_hot[::512] = torch.randn(8, generator=generator)  # one nonzero per bucket of 64 or 512
    for x in (torch.randn(3000, generator=generator), -torch.rand(777, generator=generator), one_hot, torch.zeros(640)):
        one_nonzero_per_bucket = x is one_hot
        x = x.to(dtype)
        y = round_trip(compressor, x).double()
        exact = x.double()
        if qsgd:
            padded = torch.nn.functional.pad(exact, (0, -x.numel() % compressor.bucket_size))
            norms = padded.view(-1, compressor.bucket_size).norm(dim=1, keepdim=True)
            step = (norms / compressor.levels).expand(-1, compressor.bucket_size).reshape(-1)[: x.numel()]
        else:
            step = y.abs().max().expand(x.shape)  # the ternary scale (clipped or not)
            if compressor.clip is None:
                assert torch.allclose(step, exact.abs().max().expand(x.shape), rtol=1e-6)
            exact = torch.minimum(torch.maximum(exact, -step), step)
        tolerance = 1e-5 * step + 1e-300  # the codec's float32 arithmetic
        assert (y >= exact - step - tolerance).all() and (y <= exact + step + tolerance).all()
        levels = y / torch.where(step > 0, step, 1)
        assert (levels - levels.round()).abs().max() < 1e-4  # whole levels only
        if noise == -(2**15):  # u = 0: every level rounds down
            assert (y <= exact + tolerance).all()
        if qsgd:  # +-levels where a bucket has one nonzero, and 0
            whole = (exact != 0) if one_nonzero_per_bucket else (exact == 0)
        else:  # +-scale
            whole = exact.abs() >= step
        assert ((y - exact).abs()[whole] <= tolerance[whole]).all()
        assert not y[x == 0].any()


@pytest.mark.slow
@SLOW
@given(x=unbiased_inputs, seed=st.integers(0, 1000))
def test_qsgd_is_unbiased(x, seed):
    compressor = QSGD(levels=3, bucket_size=16, seed=seed)
    buckets = torch.nn.functional.pad(x.double(), (0, -x.numel() % 16)).view(-1, 16)
    bucket_norms = buckets.norm(dim=1, keepdim=True).expand_as(buckets).reshape(-1)[: x.numel()]
    _assert_unbiased(_mean_of_draws(compressor, x, DRAWS), x, bucket_norms / compressor.levels / 2)


@pytest.mark.slow
@SLOW
@given(x=unbiased_inputs, seed=st.integers(0, 1000))
def test_terngrad_without_clipping_is_unbiased(x, seed):
    scale = x.double().abs().max()
    _assert_unbiased(_mean_of_draws(TernGrad(clip=None, seed=seed), x, DRAWS), x, scale.expand(x.shape) / 2)


@SLOW
@given(x=unbiased_inputs, seed=st.integers(0, 1000))
def test_randomk_is_unbiased(x, seed):
    compressor = RandomK(ratio=0.25, seed=seed)
    k = max(1, math.ceil(0.25 * x.numel()))
    std = x.double().abs() * math.sqrt(x.numel() / k - 1)
    _assert_unbiased(_mean_of_draws(compressor, x, DRAWS), x, std)


@FAST
@given(x=tensors(), seed=st.integers(0, 2**31))
def test_randomk_shares_coordinates_across_ranks_with_one_seed(x, seed):
    rank_a, rank_b = RandomK(seed=seed), RandomK(seed=seed)
    for _ in range(3):
        (_, ctx_a), (_, ctx_b) = rank_a.compress(x), rank_b.compress(-x)
        indices_a, indices_b = ctx_a.ctx[0], ctx_b.ctx[0]
        assert torch.equal(indices_a, indices_b)
        assert indices_a.unique().numel() == indices_a.numel() == rank_a.k(x.numel())  # distinct


@pytest.mark.parametrize(
    "name", [n for n in NAMES if COMPRESSORS[n]().error_feedback != ErrorFeedback.UNSUPPORTED]
)
@FAST
@given(data=st.data())
def test_error_feedback_conserves_mass(name, data):
    """Everything put in is either sent or still held: sum(sent) + residual == sum(inputs)."""
    shape = data.draw(shapes)
    arrays = hnp.arrays(np.float32, shape, elements=st.floats(-100, 100, width=32))
    inputs = [torch.from_numpy(x) for x in data.draw(st.lists(arrays, min_size=1, max_size=4))]
    compressor, memory = COMPRESSORS[name](), ResidualMemory()
    sent = torch.zeros(shape, dtype=torch.float64)
    largest = max(float(x.abs().max()) for x in inputs)
    for x in inputs:
        payload, ctx = compensated_compress(compressor, memory, "w", x)
        decompressed = compressor.decompress(payload, ctx).double()
        sent += decompressed
        largest = max(largest, float(decompressed.abs().max()), float(memory.residuals["w"].abs().max()))
    total = torch.stack([x.double() for x in inputs]).sum(0)
    # float32 arithmetic: a few roundings per step of the largest magnitude involved (rescaled random-k sends
    # values ~numel/k times its inputs).
    atol = 1e-6 * max(1.0, largest) * len(inputs)
    torch.testing.assert_close(sent + memory.residuals["w"].double(), total, rtol=0, atol=atol)


@FAST
@given(
    rows=hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=2, max_dims=2, max_side=40),
        elements=st.floats(-HUGE, HUGE, width=32),
    ).map(torch.from_numpy)
)
@example(rows=torch.tensor([[0.0, 2.4816e-41]]))  # a subnormal range: 255 / range overflows float32
@example(rows=torch.tensor([[-3e38, 3e38, 1.0]]))  # the range overflows
def test_bytegrad_round_trip_within_one_quantization_step(rows):
    compressor = ByteGrad()
    payload, ctx = compressor.compress_rows(rows)
    codes, low, high = payload
    assert codes.dtype == torch.uint8 and codes.shape == rows.shape
    decoded = compressor.decompress_rows(payload, ctx)
    error = (decoded.double() - rows.double()).abs()
    step = (rows.double().amax(dim=1, keepdim=True) - rows.double().amin(dim=1, keepdim=True)) / 255
    # Half a step (round to nearest), plus float32 rounding of the position and of the dequantized value, and
    # the subnormal spacing.
    assert (error <= step * (0.5 + 1e-5) + 1e-6 * rows.double().abs() + 1e-44).all()
    # each code's value is the convex combination of its row's minimum and maximum, bit for bit as computed
    # element by element
    position = codes.float() / 255
    assert torch.equal(decoded, low * (1 - position) + high * position)


@pytest.mark.parametrize("bits", range(1, 9))
@FAST
@given(length=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_bit_packing_round_trip(bits, length, seed):
    codes = torch.randint(
        0, 2**bits, (3, length), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
    )
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, math.ceil(length * bits / 8))
    assert torch.equal(unpack_bits(packed, bits, length), codes)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_bit_packing_wire_format_is_code_i_at_bit_i_times_bits(bits):
    codes = torch.randint(0, 2**bits, (2, 37), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    per_byte = 8 // bits
    padded = torch.nn.functional.pad(codes, (0, -37 % per_byte)).reshape(2, -1, per_byte).long()
    expected = (padded << torch.arange(0, 8, bits)).sum(dim=-1).to(torch.uint8)
    assert torch.equal(pack_bits(codes, bits), expected)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_bit_packing_gives_every_byte_from_its_codes(bits):
    # Every byte value once: its 8 // bits codes, lowest first. Pins the gathering multiplication's claim that
    # no two codes' products overlap or carry, for all code combinations (with offsets and odd row lengths).
    per_byte = 8 // bits
    byte = torch.arange(256)
    codes = ((byte.unsqueeze(1) >> (bits * torch.arange(per_byte))) & (2**bits - 1)).to(torch.uint8)
    assert torch.equal(pack_bits(codes.reshape(1, -1), bits), byte.to(torch.uint8).unsqueeze(0))
    assert torch.equal(pack_bits(codes, bits), byte.to(torch.uint8).unsqueeze(1))
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), codes.reshape(-1)])[3:]  # storage offset 3
    assert torch.equal(pack_bits(shifted, bits), byte.to(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_sign_bits_are_those_of_x_not_below_zero(dtype):
    # 1 for x >= 0 (-0.0 and +inf included), 0 for negatives and NaN: pack_signs compares into int8, not bool
    x = torch.randn(3, 1001, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[0, :6] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), -1e-3])
    for tensor in (x, x[:, 1:], x[:, ::3], x.reshape(-1), x[0, :0]):
        expected = pack_bits(tensor >= 0, 1)
        assert pack_signs(tensor).dtype == torch.uint8 and torch.equal(pack_signs(tensor), expected)
    assert pack_signs(x[0, :6]).tolist() == [0b1011]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@FAST
@given(ranks=st.integers(1, 9), length=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_majority_signs_is_the_sign_of_the_summed_signs(dtype, ranks, length, seed):
    x = torch.randn(ranks, length, generator=torch.Generator().manual_seed(seed))
    x[:, : length // 4] = torch.tensor([0.0, -0.0, float("nan")]).repeat(length)[: length // 4]  # their codes
    packed = torch.stack([pack_signs(row) for row in x])
    summed = unpack_signs(packed, length, torch.float64).sum(dim=0)
    votes = _numerics.majority_signs(packed, length, dtype)
    assert votes.dtype == dtype and votes.shape == (length,)
    assert torch.equal(votes, summed.sign().to(dtype))


GATHERED = [name for name in NAMES if COMPRESSORS[name]().communicator is ALLGATHER]
# where the mean is written into ``out`` (any number of ranks; the others from two ranks on)
DECODED_IN_PLACE = {"topk", "dgc"}
NOT_IN_PLACE = {"signsgd": "the vote is decoded from packed counts into a new tensor"}


@pytest.mark.parametrize("name", GATHERED)
@FAST
@given(x=tensors(), ranks=st.integers(1, 3))
def test_aggregate_writes_into_the_tensor_given(name, x, ranks):
    """The hook passes each gradient's place in the bucket as ``out``: where a method writes the mean there
    (no gradient-sized tensor to allocate and copy afterwards), the bits are those of a new tensor."""
    compressors = [COMPRESSORS[name]() for _ in range(ranks)]
    payloads = [compressor.compress(x * (rank + 1)) for rank, compressor in enumerate(compressors)]
    gathered = [torch.stack(parts) for parts in zip(*(payload for payload, _ in payloads), strict=True)]
    out = torch.full_like(x, float("nan"))
    result = compressors[0].aggregate(gathered, payloads[0][1], out)
    assert result.shape == x.shape and torch.equal(result, compressors[0].aggregate(gathered, payloads[0][1]))
    if name in DECODED_IN_PLACE or (ranks > 1 and name not in NOT_IN_PLACE):
        assert result.data_ptr() == out.data_ptr()


def test_decoders_written_without_out_are_called_without_it():
    """A method written without ``out`` (``decompress(self, payload, ctx)``, ``aggregate(self, gathered,
    ctx)``) keeps working: the communicators pass ``out``, which it ignores, and its result is a new tensor."""

    class WithoutOut(RandomK):
        def decompress(self, payload, ctx):
            return super().decompress(payload, ctx)

        def aggregate(self, gathered, ctx):
            return super().aggregate(gathered, ctx)

    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    payload, ctx = WithoutOut(0.1).compress(x)
    gathered = [part.unsqueeze(0) for part in payload]
    for decoder, received in (("decompress", payload), ("aggregate", gathered)):
        out = torch.full_like(x, float("nan"))
        result = getattr(WithoutOut(0.1), decoder)(received, ctx, out)
        assert result.data_ptr() != out.data_ptr(), decoder
        assert torch.equal(result, getattr(RandomK(0.1), decoder)(received, ctx)), decoder


SUMMED = [name for name in NAMES if COMPRESSORS[name]().communicator is ALLREDUCE]


@pytest.mark.parametrize("name", SUMMED)
@FAST
@given(x=tensors())
def test_decompress_writes_into_the_tensor_given(name, x):
    """For the summed methods the hook's ``out`` reaches ``decompress``: random-k writes its values into it
    (no gradient-sized zeros to allocate and copy), the same bits as a new tensor."""
    compressor = COMPRESSORS[name]()
    with compressor.stream("x"):
        payload, ctx = compressor.compress(x)
    out = torch.full_like(x, float("nan"))
    result = compressor.decompress(payload, ctx, out)
    assert result.shape == x.shape and torch.equal(result, compressor.decompress(payload, ctx))
    if name.startswith("randomk"):
        assert result.data_ptr() == out.data_ptr()


ELEMENTWISE = sorted(name for name, make in COMPRESSORS.items() if make().elementwise)


def test_the_elementwise_methods_are_flagged():
    assert {"none", "signsgd"} <= set(ELEMENTWISE)  # else the test below checks nothing the hook relies on


@pytest.mark.parametrize("name", ELEMENTWISE)
@FAST
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    ranks=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_an_elementwise_method_decodes_a_concatenation_as_its_parts(name, lengths, ranks, dtype, seed):
    """What lets the hook send a bucket's tensors as one (``Compressor.elementwise``): decoding, and the
    aggregation of every rank's payloads, give for a concatenation of tensors the concatenation of their
    results, bit for bit, whatever the tensors' lengths (bit packing's byte boundaries fall elsewhere)."""
    compressor = COMPRESSORS[name]()
    x = torch.randn(ranks, sum(lengths), generator=torch.Generator().manual_seed(seed)).to(dtype)
    x[:, ::7] = 0.0

    def aggregated(rows: torch.Tensor) -> torch.Tensor:
        payloads = [compressor.compress(row) for row in rows]
        gathered = [torch.stack(parts) for parts in zip(*(payload for payload, _ in payloads), strict=True)]
        return compressor.aggregate(gathered, payloads[0][1])

    parts = x.split(lengths, dim=1)
    assert torch.equal(round_trip(compressor, x[0]), torch.cat([round_trip(compressor, part[0]) for part in parts]))
    assert torch.equal(aggregated(x), torch.cat([aggregated(part) for part in parts]))


@pytest.mark.parametrize("scale", [1.0, 1e-12, 1e-25, 1e-40, 1e19, 1e30, 3e37])
@FAST
@given(rows=st.integers(1, 3), numel=st.integers(1, 5000), seed=st.integers(0, 2**16), by_row=st.booleans())
def test_safe_rms_and_mean_abs_are_exact_to_float32_at_every_magnitude(scale, rows, numel, seed, by_row):
    """The plain means (the CPU's first try) where they are exact, and the peak-scaled ones where squares or sums
    overflow (1e19 and up) or squares underflow (1e-25 and below): within float32's rounding of the float64 values."""
    x = torch.randn(rows, numel, generator=torch.Generator().manual_seed(seed)) * scale
    dim = 1 if by_row else None
    exact = x.double().square().mean(dim=dim, keepdim=by_row).sqrt(), x.double().abs().mean(dim=dim, keepdim=by_row)
    for computed, expected in zip((_numerics.safe_rms(x, dim), _numerics.safe_mean_abs(x, dim)), exact, strict=True):
        assert computed.dtype == torch.float32 and computed.shape == expected.shape
        assert ((computed.double() - expected).abs() <= 1e-6 * expected + 2e-45).all(), (computed, expected)
    assert not _numerics.safe_rms(x * 0, dim).any() and not _numerics.safe_mean_abs(x * 0, dim).any()


@pytest.mark.parametrize("scale", [1.0, 3e37, 1e-40])
@FAST
@given(numel=st.integers(1, 5000), shift=st.floats(-3, 3), seed=st.integers(0, 2**16))
def test_safe_std_is_the_population_std_without_overflow(scale, numel, shift, seed):
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(seed)) + shift) * scale
    exact = x.double().std(correction=0)
    std = _numerics.safe_std(x)
    assert std.dtype == torch.float32 and torch.isfinite(std)
    assert abs(float(std) - float(exact)) <= 1e-5 * float(exact) + 2e-45  # float32 sums; subnormal spacing
    assert float(_numerics.safe_std(torch.full((numel,), scale))) == 0.0


@pytest.mark.parametrize("bits", range(1, 9))
def test_bit_packing_is_one_little_endian_stream_of_exact_width_codes(bits):
    codes = torch.randint(0, 2**bits, (2, 29), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    for row in range(2):
        stream = sum(int(code) << (bits * i) for i, code in enumerate(codes[row].tolist()))
        assert packed[row].tolist() == list(stream.to_bytes(math.ceil(29 * bits / 8), "little"))


def test_centred_noise_is_16_uniform_bits_per_element_repeatable_from_the_seed():
    draws = [centred_noise((3, 100_001), torch.Generator().manual_seed(5), torch.device("cpu")) for _ in range(2)]
    assert torch.equal(draws[0], draws[1]) and draws[0].shape == (3, 100_001) and draws[0].dtype == torch.int16
    other = centred_noise((3, 100_001), torch.Generator().manual_seed(6), torch.device("cpu"))
    assert not torch.equal(draws[0], other)
    flat = draws[0].reshape(-1).to(torch.int32)
    # every bit is a fair coin, the sign bit of all four int16 of a 64-bit draw included: 6 standard errors
    for lane in range(4):
        of_lane = flat[lane::4]
        for bit in range(16):
            frequency = float(((of_lane >> bit) & 1).double().mean())
            assert abs(frequency - 0.5) < 6 * 0.5 / math.sqrt(of_lane.numel()), (lane, bit)
    u = flat.double() * NOISE_SCALE
    assert float(u.min()) >= -0.5 and float(u.max()) < 0.5 and abs(float(u.mean())) < 0.003
    # neighbours (parts of one 64-bit draw) are uncorrelated
    assert abs(float(torch.corrcoef(torch.stack([u[0::4][:75_000], u[1::4][:75_000]]))[0, 1])) < 0.03
    assert abs(float(torch.corrcoef(torch.stack([u[0::4][:75_000], u[3::4][:75_000]]))[0, 1])) < 0.03


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float_codes_become_their_truncated_bytes_at_every_width(bits, dtype):
    whole = torch.arange(2**bits, dtype=dtype).repeat(3)
    fractions = torch.tensor([0.0, 0.5, 1 - 2**-12], dtype=dtype).repeat_interleave(2**bits)
    codes = torch.cat([whole + fractions, -torch.zeros(5, dtype=dtype)])
    expected = list(range(2**bits)) * 3 + [0] * 5
    assert _numerics.as_uint8(codes, bits).tolist() == expected
    assert _numerics.as_uint8(codes).tolist() == expected  # bits=8: the int16 route
    assert _numerics.as_uint8(codes > 0).dtype == torch.uint8


@pytest.mark.parametrize("bits", [0, 9, 2.0, True])
def test_bit_packing_refuses_widths_outside_1_to_8(bits):
    with pytest.raises(ValueError, match=rf"pack_bits: bits must be an integer in 1..8, got {bits!r}"):
        pack_bits(torch.zeros(8, dtype=torch.uint8), bits)


@pytest.mark.parametrize(("levels", "bits"), [(1, 2), (3, 3), (4, 4), (7, 4), (8, 5), (15, 5), (16, 6), (63, 7), (127, 8)])
@pytest.mark.parametrize("numel", [1, 511, 512, 1000])
def test_qsgd_payload_is_codes_at_exact_width_plus_one_norm_per_bucket(levels, bits, numel):
    bucket_size = 512
    compressor = QSGD(levels=levels, bucket_size=bucket_size)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(levels))
    payload, ctx = compressor.compress(x)
    buckets = math.ceil(numel / bucket_size)
    assert sum(part.numel() * part.element_size() for part in payload) == math.ceil(
        bits * buckets * bucket_size / 8
    ) + 4 * buckets
    assert (2 * levels + 1) <= 2**bits and 2 * levels + 1 > 2 ** (bits - 1)
    codes = unpack_bits(payload[0], bits, numel)
    assert int(codes.max()) <= 2 * levels
    y = compressor.decompress(payload, ctx)
    assert torch.allclose(y.abs() * levels / payload[1].repeat_interleave(bucket_size)[:numel], codes.float().sub(levels).abs(), atol=1e-4)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_decode_bits_looks_up_each_code_in_its_rows_values(bits):
    codes = torch.randint(0, 2**bits, (3, 21), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    values = torch.randn(3, 2**bits, generator=torch.Generator().manual_seed(7))
    packed = pack_bits(codes, bits)
    assert torch.equal(decode_bits(packed, bits, 21, values), values.gather(1, codes.long()))
    assert torch.equal(decode_bits(packed, bits, 21, values[1]), values[1][codes.long()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.uint8, torch.int32, torch.bool])
@FAST
@given(seed=st.integers(0, 2**16))
def test_gather_rows_copies_the_rows_bits_as_index_select_does(dtype, seed):
    """Rows of 1-16 bytes go as one element of another dtype (int64, complex128, ...): every bit pattern,
    NaN payloads and signalling NaNs included, must come out as ``index_select`` copies it, at every width."""
    generator = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    for width in range(1, 18):
        raw = torch.randint(0, 256, (50, width * size), dtype=torch.uint8, generator=generator)
        table = (raw & 1).view(torch.bool) if dtype == torch.bool else raw.view(dtype)
        index = torch.randint(0, 50, (300,), dtype=torch.int32, generator=generator)
        expected = table.index_select(0, index)
        gathered = gather_rows(table, index)
        assert gathered.shape == expected.shape and gathered.dtype == expected.dtype, width
        assert torch.equal(gathered.view(torch.uint8), expected.view(torch.uint8)), width


def test_bit_packing_of_views_at_any_offset():
    codes = torch.randint(0, 2, (40,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    for view in (codes[1:33], codes[8:24], codes.view(4, 10)[:, 1:9], codes.view(5, 8).t()):
        assert torch.equal(unpack_bits(pack_bits(view, 1), 1, view.shape[-1]), view)


def _spiky(numel: int, seed: int) -> torch.Tensor:
    """Gaussian values, large exactly where :func:`top_magnitudes` samples: its threshold is then too high."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    x[:: _numerics.sample_stride(numel)] *= 100
    return x


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(300_000, generator=torch.Generator().manual_seed(0)),  # the sampled-threshold path
        _spiky(300_000, 1),  # the sample underestimates the top: its threshold finds fewer than k candidates
        torch.randn(300_000, generator=torch.Generator().manual_seed(2)).index_fill_(0, torch.tensor([5, 9]), math.nan),
        torch.randn(1000, generator=torch.Generator().manual_seed(3)),  # small: torch.topk itself
    ],
    ids=["sampled", "fallback", "nan", "small"],
)
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.2])
def test_top_magnitudes_selects_the_set_torch_topk_selects(x, ratio):
    k = math.ceil(ratio * x.numel())
    ours = top_magnitudes(x, k)
    assert ours.numel() == k
    assert set(ours.tolist()) == set(x.abs().topk(k).indices.tolist())


@pytest.mark.parametrize("nonzero", [0, 1, 299, 300, 301, 3000])
def test_top_magnitudes_of_a_mostly_zero_tensor_are_its_largest_nonzeros_then_zeros(nonzero):
    # k = 300 of 300,000: the sample's threshold is 0 and the nonzero elements alone are searched
    x = torch.zeros(300_000)
    where = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(nonzero))[:nonzero]
    x[where] = torch.randn(nonzero, generator=torch.Generator().manual_seed(1))
    if nonzero:
        x[where[0]] = math.nan  # counts as the largest
    ours = top_magnitudes(x, 300)
    assert ours.numel() == 300 and ours.unique().numel() == 300
    expected = x.abs().topk(300).values
    assert torch.equal(x.abs()[ours].sort(descending=True).values.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("name", RANDOMIZED)
def test_randomized_compressor_state_survives_checkpoint_and_pickle(name):
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    original = COMPRESSORS[name]()
    original.compress(x)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored = COMPRESSORS[name]()
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    unpickled = pickle.loads(pickle.dumps(original))
    expected = round_trip(original, x)
    assert torch.equal(round_trip(restored, x), expected)
    assert torch.equal(round_trip(unpickled, x), expected)


@pytest.mark.parametrize("name", RANDOMIZED)
def test_random_draws_depend_on_the_key_not_on_call_order(name):
    """DDP reorders buckets after its first step: a tensor's randomness must not depend on that order."""
    tensors = {key: torch.randn(200, generator=torch.Generator().manual_seed(key)) for key in range(3)}
    forward, backward = COMPRESSORS[name](), COMPRESSORS[name]()
    results = {}
    for key in (0, 1, 2):
        with forward.stream(key):
            results[key] = round_trip(forward, tensors[key])
    for key in (2, 1, 0):
        with backward.stream(key):
            assert torch.equal(round_trip(backward, tensors[key]), results[key])


def test_error_feedback_policies():
    assert ErrorFeedback.RECOMMENDED.resolve(None, "m") and not ErrorFeedback.RECOMMENDED.resolve(False, "m")
    assert not ErrorFeedback.OPTIONAL.resolve(None, "m") and ErrorFeedback.OPTIONAL.resolve(True, "m")
    assert ErrorFeedback.REQUIRED.resolve(None, "m") and not ErrorFeedback.UNSUPPORTED.resolve(None, "m")
    with pytest.raises(ValueError, match="requires error feedback"):
        ErrorFeedback.REQUIRED.resolve(False, "EFSignSGD")
    with pytest.raises(ValueError, match="does not support error feedback"):
        ErrorFeedback.UNSUPPORTED.resolve(True, "SignSGD")


def test_invalid_arguments_are_refused():
    for make in (lambda: TopK(0), lambda: RandomK(1.5), lambda: QSGD(levels=128), lambda: TernGrad(clip=0)):
        with pytest.raises(ValueError):
            make()


def test_a_one_row_wire_views_a_part_its_row_length_does_not_divide():
    """21 bytes a row (a float32 part, then a uint8 one): the float32 part is a view of the send and receive
    buffers, each row of it 16 bytes apart from its start, which any torch release can view as float32 (the
    lent GPU's torch 2.11 refused a view whose row stride was the row's 21 bytes)."""
    from gradcomm.compression.wire import GatherWire

    wire = GatherWire([(4, torch.float32), (5, torch.uint8)], world_size=1, device=torch.device("cpu"), name="t")
    assert wire.slots[0].data_ptr() == wire.send.data_ptr()
    assert wire.received[0].data_ptr() == wire.receive.data_ptr()
    assert wire.slots[0].view(1, -1).view(torch.uint8).stride(0) == 16
