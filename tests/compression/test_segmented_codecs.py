"""Segmented buckets (issue 36): a bucket's torch calls do not grow with its tensors, and payloads are what
encoding every tensor on its own made before.

The per-tensor references below are the methods' encodings before the segmented form, frozen here (built
from the :mod:`gradcomm.compression._numerics` primitives they used); where the segmented form changed the
random draws (QSGD, TernGrad, random-k), the compression error is compared with its exact expectation,
which is what the old draws had too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from gradcomm.compression import DGC, QSGD, ByteGrad, EFSignSGD, OneBit, RandomK, SignSGD, TernGrad, TopK
from gradcomm.compression._numerics import (
    as_uint8,
    nonzero_or_one,
    pack_signs,
    safe_mean_abs,
    safe_rms,
    top_magnitudes,
    work_dtype,
)
from gradcomm.compression.registry import methods
from gradcomm.compression.segment_bits import packed_lengths
from gradcomm.compression.segments import Segments
from gradcomm.testing import run_on_ranks

LENGTHS = (1000, 1024, 3001, 7, 4096, 1024)
"""Runs of equal lengths (no length divides them all): worked run by run."""

CHUNKED = (131072, 1024, 96, 2048, 1024, 65536, 160, 131072, 4096, 96)
"""Multiples of 32 in more runs than one: worked in chunks (:class:`~gradcomm.compression.segments.Chunks`),
the large ones' top-k from their samples."""

LAYOUTS = {"runs": LENGTHS, "chunks": CHUNKED}


def _bucket(seed: int = 0, lengths: tuple[int, ...] = LENGTHS) -> tuple[list[torch.Tensor], Segments, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(n, generator=generator) * 10.0 ** (i % 5 - 2) for i, n in enumerate(lengths)]
    return tensors, Segments.of(tensors, [f"p{i}" for i in range(len(tensors))]), torch.cat(tensors)


def test_layouts_take_their_paths():
    assert Segments.of([torch.empty(n) for n in LENGTHS], list(range(len(LENGTHS)))).chunks is None
    chunked = Segments.of([torch.empty(n) for n in CHUNKED], list(range(len(CHUNKED))))
    assert chunked.chunks is not None and chunked.chunks.length == 32 and len(chunked.groups.runs) > 1
    one_run = Segments.of([torch.empty(1024)] * 5, list(range(5)))
    assert one_run.chunks is None  # one run is a (count, length) view already


def _split(part: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(part.reshape(-1).split(sizes))


# -- frozen per-tensor encodings (before segments) --------------------------------------------------------------
def _old_efsign(t: torch.Tensor) -> list[torch.Tensor]:
    return [pack_signs(t), safe_mean_abs(t.to(work_dtype(t.dtype))).reshape(1)]


def _old_onebit_rows(rows: torch.Tensor) -> list[torch.Tensor]:
    return [pack_signs(rows), safe_rms(rows.to(work_dtype(rows.dtype)), dim=1)]


def _old_bytegrad_rows(rows: torch.Tensor) -> list[torch.Tensor]:
    work = rows.to(work_dtype(rows.dtype))
    low, high = work.amin(dim=1, keepdim=True), work.amax(dim=1, keepdim=True)
    span = high - low
    scale = torch.where(torch.isfinite(span), torch.where(span < 2.0**-60, 2.0**64, 1.0), 0.5).to(work.dtype)
    span = high * scale - low * scale
    steps = torch.where(span > 0, 255 / nonzero_or_one(span), 0.0)
    return [as_uint8(((work * scale).sub_(low * scale)).mul_(steps).add_(0.5)), low, high]


def _no_less_accurate(ours: torch.Tensor, old: torch.Tensor, exact: torch.Tensor, halves: float = 1) -> None:
    """Scales as close to their exact values as before, or within ``halves`` half ulps (float32 of the exact
    value)."""
    ulp = exact.float().double().abs() * 2.0**-24 * halves
    assert ((ours.double() - exact).abs() <= torch.maximum((old.double() - exact).abs(), ulp)).all()


_HALVES = {"runs": 1, "chunks": 2}
"""Chunks' means add float32 sums of chunks in float64: within an ulp of the exact mean (more accurate than one
float32 sum on average, measured in docs/notes/2026-11-28-segmented-codecs.md), not always closer than it."""


def test_signsgd_payload_is_the_concatenations_signs():
    tensors, segments, flat = _bucket()
    payload, _ = SignSGD().compress_segments(flat, segments)
    assert torch.equal(payload[0], pack_signs(flat))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_efsign_payload_is_every_tensors_own(layout):
    lengths = LAYOUTS[layout]
    tensors, segments, flat = _bucket(0, lengths)
    compressor = EFSignSGD()
    bits, scales = compressor.compress_segments(flat, segments)[0]
    old = [_old_efsign(t) for t in tensors]
    assert torch.equal(bits, torch.cat([o[0] for o in old]))
    exact = torch.stack([t.double().abs().mean() for t in tensors])
    _no_less_accurate(scales, torch.cat([o[1] for o in old]), exact, _HALVES[layout])
    assert compressor.payload_layout(segments.lengths, torch.float32) == [
        (bits.numel(), bits.dtype), (len(lengths), scales.dtype)
    ]
    decoded = compressor.decompress_segments([bits, scales], None, segments)
    for t, d, s in zip(tensors, decoded.split(lengths), scales, strict=True):
        assert torch.equal(d, torch.where(t >= 0, s, -s))


def _mostly_zero(lengths: tuple[int, ...], nonzero: float) -> tuple[list[torch.Tensor], Segments, torch.Tensor]:
    """The chunked bucket with its first tensor mostly zero (an embedding's gradient): ``nonzero`` of it not."""
    tensors, _, _ = _bucket(6, lengths)
    tensors[0] = tensors[0] * (torch.rand(tensors[0].shape, generator=torch.Generator().manual_seed(7)) < nonzero)
    return tensors, Segments.of(tensors, [f"p{i}" for i in range(len(tensors))]), torch.cat(tensors)


_SPARSE_BUCKETS = {
    **{layout: lambda lengths=lengths: _bucket(0, lengths) for layout, lengths in LAYOUTS.items()},
    "mostly-zero": lambda: _mostly_zero(CHUNKED, 0.03),  # a zero threshold, enough nonzero elements
    "too-few-nonzero": lambda: _mostly_zero(CHUNKED, 0.002),  # fewer than k: chosen run by run
    "infinite": lambda: _with(CHUNKED, torch.inf, 1),
    "nan": lambda: _with(CHUNKED, torch.nan, 1),  # a NaN among the padding of the rows of smaller budgets
    "nans": lambda: _with(CHUNKED, torch.nan, 20),  # more NaNs than k: some padding would be left out
}


def _with(lengths: tuple[int, ...], value: float, count: int) -> tuple[list[torch.Tensor], Segments, torch.Tensor]:
    """The bucket with ``count`` elements of its second tensor (k = 11) set to ``value``."""
    tensors, segments, flat = _bucket(8, lengths)
    tensors[1][5 : 5 + count] = -value
    return tensors, segments, torch.cat(tensors)


@pytest.mark.parametrize("bucket", _SPARSE_BUCKETS)
@pytest.mark.parametrize("make", [TopK, lambda: DGC(ratio=0.01, momentum=0.9)])
def test_sparse_payload_is_every_tensors_top_k(make, bucket):
    tensors, segments, flat = _SPARSE_BUCKETS[bucket]()
    compressor = make()
    (values, local), indices = compressor.compress_segments(flat, segments)
    ks = [compressor.k(n) for n in segments.lengths]
    for t, v, i, k in zip(tensors, _split(values, ks), _split(local, ks), ks, strict=True):
        expected = top_magnitudes(t, k).sort().values
        order = i.long().sort()
        if bucket == "too-few-nonzero" and t.count_nonzero() < k:  # its zeros are ties: any will do
            assert torch.equal(t[order.values].abs().sort().values, t[expected].abs().sort().values)
            continue
        if bucket == "nans" and t.isnan().sum() > k:  # NaNs are ties too
            assert order.values.numel() == k and t[order.values].isnan().all()
            continue
        assert torch.equal(order.values, expected)
        torch.testing.assert_close(v[order.indices], t[expected], rtol=0, atol=0, equal_nan=True)
    assert local.dtype == torch.int32


@pytest.mark.parametrize(("world_size", "lengths"), [(1, "runs"), (2, "runs"), (3, "runs"), (1, "chunks"), (2, "chunks")])
@pytest.mark.parametrize("name", ["onebit", "bytegrad"])
def test_two_stage_chunks_are_every_tensors_rows(name, world_size, lengths):
    """The whole bucket's rows: chunk j of every tensor, encoded as that tensor's row j was."""
    from gradcomm.compression.row_layout import RowLayout as _RowLayout

    tensors, segments, flat = _bucket(1, LAYOUTS[lengths])
    compressor = {"onebit": OneBit, "bytegrad": ByteGrad}[name]()
    old_rows = {"onebit": _old_onebit_rows, "bytegrad": _old_bytegrad_rows}[name]
    layout = _RowLayout.of(segments, world_size)
    payload, _ = compressor.compress_segments(layout.cut(flat), layout.rows)
    rows = [part.reshape(world_size, -1) for part in payload]
    sizes = [layout.chunks, packed_lengths(layout.chunks, 1)][name == "onebit"]
    for index, t in enumerate(tensors):
        padded = torch.nn.functional.pad(t, (0, -t.numel() % world_size)).view(world_size, -1)
        old = old_rows(padded)
        ours = [r.reshape(world_size, -1) for r in rows]
        codes = torch.stack([ours[0][j].split(list(sizes))[index] for j in range(world_size)])
        assert torch.equal(codes, old[0])
        for ours_part, old_part in zip(ours[1:], old[1:], strict=True):
            if name == "onebit":  # the scale, summed in float64 now
                exact = padded.double().square().mean(dim=1).sqrt()
                _no_less_accurate(ours_part[:, index], old_part.reshape(-1), exact, _HALVES[lengths])
            else:  # minima and maxima: exact either way
                assert torch.equal(ours_part[:, index], old_part.reshape(-1))
    assert torch.equal(layout.join(layout.cut(flat)), flat)
    decoded = compressor.decompress_segments(payload, None, layout.rows)
    alone = [Segments((n,), ("s",), (torch.Size([n]),), torch.float32, flat.device) for n in layout.rows.lengths]
    pieces = zip(payload[0].split(list(sizes) * world_size), *(part.split(1) for part in payload[1:]), strict=True)
    assert torch.equal(decoded, torch.cat([
        compressor.decompress_segments(list(piece), None, one) for piece, one in zip(pieces, alone, strict=True)
    ]))


def _error(compressor, flat: torch.Tensor, segments: Segments, draws: int) -> float:
    total = 0.0
    for _ in range(draws):
        payload, ctx = compressor.compress_segments(flat, segments)
        total += float((compressor.decompress_segments(payload, ctx, segments).double() - flat.double()).square().sum())
    return total / draws


def test_qsgd_error_is_stochastic_roundings():
    tensors, segments, flat = _bucket(2)
    compressor = QSGD(levels=7, bucket_size=512)
    expected = 0.0
    for t in tensors:
        rows = torch.nn.functional.pad(t.double(), (0, -t.numel() % 512)).view(-1, 512)
        step = rows.norm(dim=1, keepdim=True) / 7
        fraction = (rows.abs() / torch.where(step > 0, step, 1)).frac()
        expected += float((fraction * (1 - fraction) * step.square()).sum())
    assert _error(compressor, flat, segments, 30) == pytest.approx(expected, rel=0.1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_terngrad_error_is_stochastic_roundings(layout):
    tensors, segments, flat = _bucket(3, LAYOUTS[layout])
    compressor = TernGrad(clip=None)
    expected = sum(float((t.double().abs() * (t.double().abs().max() - t.double().abs())).sum()) for t in tensors)
    assert _error(compressor, flat, segments, 30) == pytest.approx(expected, rel=0.1)


def test_randomk_error_is_a_uniform_subsets():
    """Stratified: one coordinate per stratum; where k divides n, the error of a uniform k-subset,
    sum x_i**2 (n / k - 1)."""
    generator = torch.Generator().manual_seed(4)
    tensors = [torch.randn(n, generator=generator) for n in (1000, 2000, 500)]
    segments, flat = Segments.of(tensors, ["a", "b", "c"]), torch.cat(tensors)
    compressor = RandomK(ratio=0.1)
    expected = sum(float(t.double().square().sum()) * (10 - 1) for t in tensors)
    assert _error(compressor, flat, segments, 40) == pytest.approx(expected, rel=0.1)
    payload, (indices, _) = compressor.compress_segments(flat, segments)
    for start, n in zip(segments.starts, segments.lengths, strict=True):
        mine = indices[(indices >= start) & (indices < start + n)] - start
        assert mine.numel() == math.ceil(0.1 * n) and mine.unique().numel() == mine.numel()


def test_a_tensor_draws_alike_in_any_bucket():
    """Random draws are keyed by tensor: compressing it alone or in a bucket gives the same codes."""
    tensors, segments, flat = _bucket(5)
    together = QSGD(seed=3).compress_segments(flat, segments)[0]
    alone = QSGD(seed=3)
    pieces = []
    for key, t in reversed(list(zip(segments.keys, tensors, strict=True))):  # any order
        with alone.stream(key):
            pieces.insert(0, alone.compress(t)[0])
    for part, together_part in zip(zip(*pieces, strict=True), together, strict=True):
        assert torch.equal(torch.cat([p.reshape(-1) for p in part]), together_part)


def test_a_tensors_scales_are_alike_in_any_layout():
    """Per-tensor means (EF-sign's, OneBit's, TernGrad's clipping) are the same bits whether the tensor is
    alone, in runs or in chunks of any length: a resumed run, whose buckets are laid out anew, stays exact."""
    from gradcomm.compression.segment_stats import segment_std
    from gradcomm.compression.segments import segment_reduce

    tensors, _, _ = _bucket(9, CHUNKED)
    t = tensors[3]  # 2048 elements
    layouts = {
        "alone": [t],
        "runs": [torch.randn(1000), t, torch.randn(3001)],
        "chunks of 32": [torch.randn(96), t, torch.randn(160)],
        "chunks of 1024": [torch.randn(4096), t, torch.randn(1024), torch.randn(1024)],
    }
    scales = {}
    for name, members in layouts.items():
        segments, flat = Segments.of(members, list(range(len(members)))), torch.cat(members)
        place = 0 if name == "alone" else 1
        peak = segment_reduce(flat.abs(), "max", segments)
        scales[name] = torch.stack([
            EFSignSGD().compress_segments(flat, segments)[0][1][place],
            OneBit().compress_segments(flat, segments)[0][1][place],
            segment_std(flat, segments, peak)[place],
        ])
    assert Segments.of(layouts["chunks of 32"], [0, 1, 2]).chunks.length == 32
    for name, values in scales.items():
        assert torch.equal(values, scales["alone"]), name


_DECODE_LAYOUTS = {**LAYOUTS, "aligned": (1024, 2048, 1024, 4096)}
"""``aligned``: whole QSGD buckets and bytes of codes in every tensor, so every quantizer can decode in place."""


@pytest.mark.parametrize("layout", _DECODE_LAYOUTS)
@pytest.mark.parametrize("make", [QSGD, EFSignSGD, TernGrad, OneBit, ByteGrad])
def test_quantizers_decode_into_out(make, layout):
    """The hook hands its workspace (or the bucket's place) as ``out``: a decoding written there is the same,
    and needs no new bucket-sized tensor."""
    _, segments, flat = _bucket(10, _DECODE_LAYOUTS[layout])
    compressor = make()
    payload, ctx = compressor.compress_segments(flat, segments)
    expected = compressor.decompress_segments(payload, ctx, segments)
    out = torch.full_like(flat, 7.0)
    decoded = compressor.decompress_segments(payload, ctx, segments, out)
    assert torch.equal(decoded, expected)
    if layout == "aligned":
        assert decoded.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("lengths", [(301,), (64, 37, 128, 8, 200), (256,) * 4])
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_tables_by_byte_decode_as_the_code_tables_they_expand(bits, lengths):
    """A scale column times :func:`byte_codes` (every byte's code values) decodes as the code table times the
    scale does, for one segment or several, aligned or not; int8 codes pack as their uint8 bytes."""
    from gradcomm.compression._numerics import pack_bits
    from gradcomm.compression.segment_bits import byte_codes, decode_segments, pack_segments

    generator = torch.Generator().manual_seed(bits)
    segments = Segments(lengths, tuple(range(len(lengths))), tuple(torch.Size([n]) for n in lengths), torch.float32, torch.device("cpu"))
    codes = torch.randint(0, 2**bits, (segments.numel,), generator=generator, dtype=torch.uint8)
    assert torch.equal(pack_bits(codes.view(torch.int8), bits), pack_bits(codes, bits))
    packed = pack_segments(codes, segments, bits)
    values = tuple(float(v) for v in torch.randn(2**bits, generator=generator))
    scales = torch.rand(len(lengths), 1, generator=generator) + 0.5
    expected = decode_segments(packed, segments, bits, torch.tensor(values) * scales)
    by_byte = decode_segments(packed, segments, bits, byte_codes(values, bits, torch.float32, torch.device("cpu")) * scales, by_byte=True)
    assert torch.equal(by_byte, expected)
    assert torch.equal(expected, (torch.tensor(values) * scales).repeat_interleave(torch.tensor(lengths), dim=0).gather(1, codes.long().view(-1, 1)).view(-1))


@pytest.mark.parametrize("layout", _DECODE_LAYOUTS)
@pytest.mark.parametrize("make", [EFSignSGD, OneBit])
def test_own_decoding_is_the_payloads(make, layout):
    """A rank's decoding of its own payload from what its encoding kept is the payload's decoding, and the mean
    over one rank is it."""
    _, segments, flat = _bucket(11, _DECODE_LAYOUTS[layout])
    compressor = make()
    payload, ctx = compressor.compress_segments(flat, segments)
    own = compressor.decompress_own(payload, ctx, segments)
    assert torch.equal(own, compressor.decompress_segments(payload, ctx, segments))
    assert compressor.aggregate_segments([part.unsqueeze(0) for part in payload], ctx, segments) is own


@pytest.mark.parametrize("layout", _DECODE_LAYOUTS)
def test_own_sign_decoding_is_the_payloads_at_signed_zeros_nan_and_infinities(layout):
    """The own decoding copies the sign of the values (-0 counted +, NaN -) onto the scale: at -0, +0, NaN of
    either sign and infinities it is the payload's decoding, sign bit for sign bit, whatever the scales."""
    from gradcomm.compression.segment_bits import (
        decode_scaled_signs,
        encode_scaled_signs,
        unpack_scaled_signs,
    )

    _, segments, flat = _bucket(12, _DECODE_LAYOUTS[layout])
    edges = torch.tensor([-0.0, 0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45])
    flat[: edges.numel()] = edges
    flat[segments.starts[-1] : segments.starts[-1] + edges.numel()] = edges
    scales = torch.rand(len(segments)) * 10.0 ** torch.arange(len(segments), dtype=torch.float32)
    scales[0] = float("inf")
    payload, state = encode_scaled_signs(flat, segments, scales)
    own, decoded = decode_scaled_signs(state, scales, segments), unpack_scaled_signs(payload, segments)
    assert torch.equal(torch.signbit(own), torch.signbit(decoded))
    torch.testing.assert_close(own, decoded, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", ["bytegrad", "terngrad", "onebit", "efsign", "qsgd"])
def test_a_layout_keeps_only_small_scratch_buffers(name: str) -> None:
    """What a layout keeps between calls is per tensor, chunk or block of 32 (at most one element per 32 of the
    bucket's, each): a bucket-sized temporary is made in each call, memory the allocator reuses between steps,
    not memory held for the layout's life beside the gradients."""
    _, segments, flat = _bucket(13, CHUNKED)
    compressor = methods()[name]()
    payload, ctx = compressor.compress_segments(flat, segments)
    compressor.decompress_segments(payload, ctx, segments)
    state = segments.__dict__.get("_scratch")
    kept = [tensor for tensor, _ in state.buffers.values()] if state is not None else []
    assert all(32 * tensor.numel() <= segments.numel for tensor in kept), [t.shape for t in kept]


def test_a_layout_held_by_another_thread_encodes_in_tensors_of_its_own():
    """A layout's scratch buffers serve the thread that holds it; another thread (the same bucket exchanged again
    before the last exchange was done) encodes and decodes in new tensors, to the same payload, and leaves the
    held buffers as they were."""
    import threading

    from gradcomm.compression.segment_stats import held

    _, segments, flat = _bucket(13, CHUNKED)
    expected = [part.clone() for part in ByteGrad().compress_segments(flat, segments)[0]]
    state = segments.__dict__["_scratch"]
    kept = {key: tensor.clone() for key, (tensor, _) in state.buffers.items()}
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with held(segments):
            entered.set()
            release.wait(timeout=60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert entered.wait(timeout=60)
        payload = ByteGrad().compress_segments(flat * 2, segments)[0]
        ByteGrad().decompress_segments(payload, None, segments)
    finally:
        release.set()
        holder.join(timeout=60)
    assert all(torch.equal(state.buffers[key][0], tensor) for key, tensor in kept.items())
    assert torch.equal(payload[0], expected[0]) and torch.equal(payload[1], 2 * expected[1])


# -- torch calls per bucket -------------------------------------------------------------------------------------
CEILINGS = {
    "allreduce": 5,
    "bytegrad": 68,
    "dgc": 41,
    "efsign": 46,
    "onebit": 67,
    "qsgd": 71,
    "randomk": 35,
    "signsgd": 58,
    "sparseloco": 66,
    "terngrad": 88,
    "topk": 36,
}
"""aten calls of one hook call beyond a plain allreduce's (allreduce: its own), at most, at 28 and at 800
tensors (``python benchmarks/bench_codecs.py --count`` prints them): what they are now, with a few calls to
spare. Before segmented buckets they grew with the tensors: 1,254 / 34,836 for top-k at 28 / 800. The issue's
target is 80 for every method: met by signSGD, random-k, top-k, DGC (on real models too,
:data:`MODEL_CEILINGS`), QSGD, EF-sign, OneBit (80 -> 72 with chunks reduced by one ``segment_reduce``,
statistics kept as columns and small scratch buffers per layout; 72 -> 64 with its scales computed into the
wire's slots) and SparseLoCo (295 / 297 before its buffers and one check of its means, 2026-11-28); ByteGrad
(89 -> 83: two stages of encoding; 81 -> 65 with its minima, maxima and codes computed into the wire's slots
and stage 2 decoded into the hook's workspace). TernGrad is above it (two means of blocks for its clipping's
standard deviation, 108 -> 97; 96 -> 85 with its seeds without torch calls, its scales computed into the
wire's slot and its decoding table of every byte in one multiplication; see
docs/notes/2026-11-28-segmented-codecs.md)."""


def _many_shapes_bucket(count: int):
    """``count`` weights (compressed) of 1,024 to 8,192 elements in shapes drawn at random: more runs of equal
    shapes the more tensors, as a real model's layers of several widths. No dense tensors between them: the
    hook's copy of a compressed part in pieces is not what this counts."""
    from gradcomm.hooks.grad_bucket import GradBucket

    generator = torch.Generator().manual_seed(count)
    heights = torch.randint(1, 9, (count,), generator=generator).tolist()
    shapes = [torch.Size([32 * h, 32]) for h in heights]
    gradients = [torch.randn(shape, generator=generator) * 10.0 ** (i % 7 - 3) for i, shape in enumerate(shapes)]
    lengths = [shape.numel() for shape in shapes]
    return GradBucket(
        0, torch.cat([g.reshape(-1) for g in gradients]), [sum(lengths[:i]) for i in range(len(lengths))],
        lengths, shapes, [torch.nn.Parameter(torch.empty(shape)) for shape in shapes], is_last=True,
    )


def _counts(sizes: list[int], names: list[str], shapes: bool = False) -> dict[int, dict[str, int]]:
    from gradcomm.hooks.registry import make_comm_hook
    from gradcomm.testing.op_count import hook_calls, many_tensor_bucket

    torch.set_num_threads(1)
    counts: dict[int, dict[str, int]] = {}
    for size in sizes:
        bucket = _many_shapes_bucket(size) if shapes else many_tensor_bucket(size)
        counts[size] = {}
        for name in names:
            hook, state = make_comm_hook(name, process_group=dist.group.WORLD)
            counts[size][name] = hook_calls(hook, state, bucket)
    return counts


def test_torch_calls_per_bucket_do_not_grow_with_its_tensors():
    names = ["allreduce", *methods()]
    assert set(CEILINGS) == set(names), "a new method needs its ceiling here"
    [counts] = run_on_ranks(_counts, world_size=1, args=([28, 800], names), timeout=600)
    _assert_flat_and_under(counts, names, CEILINGS)


def _assert_flat_and_under(counts: dict[int, dict[str, int]], names: list[str], ceilings: dict[str, int]) -> None:
    """Each method's calls beyond allreduce's at 28 and 800 tensors are at most its ceiling and within 10."""
    for name in names:
        beyond = [counts[size][name] - (0 if name == "allreduce" else counts[size]["allreduce"]) for size in (28, 800)]
        assert max(beyond) <= ceilings[name], (name, beyond)
        assert abs(beyond[0] - beyond[1]) <= 10, (name, beyond)


SHAPES_CEILINGS = {
    "allreduce": 5,
    "bytegrad": 84,
    "dgc": 72,
    "efsign": 51,
    "onebit": 72,
    "qsgd": 69,
    "randomk": 33,
    "signsgd": 90,
    "terngrad": 96,
    "sparseloco": 84,
    "topk": 68,
}
"""As :data:`CEILINGS`, for weights of random shapes (:func:`_many_shapes_bucket`): before chunks (59f8b5a) the
calls grew with the runs of equal shapes, 203 / 2,846 for top-k and 624 / 9,696 for TernGrad at 28 / 800; top-k
and DGC went on paying per run of the chunked top-k's setup, 204 / 213, before its buffers and one plain
``nonzero`` (63 / 67); SparseLoCo's, 2,221 / 48,768 while its chunks went run by run, before they became rows
of one matrix (301 / 302), and 82 / 82 since its buffers and one check of its means; ByteGrad, OneBit and
TernGrad went from 119 / 91 / 124 to 95 / 77 / 104 when chunks' statistics went to their tensors by one
``segment_reduce`` and their small temporaries into buffers of the layout, and to 81 / 69 / 93 with payload
parts computed into the wire's slots and fewer calls of decoding (QSGD 70 -> 66, random-k 33 -> 30)."""


def test_torch_calls_per_bucket_do_not_grow_with_its_shapes():
    names = ["allreduce", *methods()]
    assert set(SHAPES_CEILINGS) == set(names), "a new method needs its ceiling here"
    [counts] = run_on_ranks(_counts, world_size=1, args=([28, 800], names, True), timeout=600)
    _assert_flat_and_under(counts, names, SHAPES_CEILINGS)


MODEL_CEILINGS = {
    "bytegrad": 91,
    "dgc": 76,
    "efsign": 59,
    "onebit": 82,
    "qsgd": 75,
    "randomk": 40,
    "signsgd": 63,
    "sparseloco": 80,
    "terngrad": 102,
    "topk": 74,
}
"""aten calls of one hook call beyond a plain allreduce's on a real model's gradients of one batch as one bucket
(the bench's transformer: 12 compressed tensors in 8 shapes between dense biases and norms, and its CNN: 3
compressed tensors), at most: calls that did not grow with the runs of equal shapes but with the runs of
weights and biases the hook copies. Before (d8bf709): top-k 186 / 132, DGC 196 / 142, SparseLoCo 1,082 /
1,085 (transformer / CNN); the issue's target is 80. The compressed part copied out in one call rather than
one per group (2026-11-28; a call per group remains to write it back): ByteGrad 132 / 129 -> 127 / 125, DGC
77 / 75 -> 73 / 72, EF-sign 62 / 59 -> 61 / 58, OneBit 103 / 100 -> 101 / 98, QSGD 85 / 82 -> 77 / 76,
random-k 46 / 44 -> 41 / 40, signSGD 64 / 61 -> 60 / 58, SparseLoCo 273 / 275 -> 269 / 272, TernGrad 138 /
135 -> 130 / 129, top-k 72 / 70 -> 71 / 69. Chunks' statistics to their tensors by one ``segment_reduce``,
kept as columns, small temporaries in buffers of the layout (2026-11-28): ByteGrad 127 / 125 -> 103 / 101,
OneBit 101 / 98 -> 87 / 84, TernGrad 130 / 129 -> 110 / 109, EF-sign 61 / 58 -> 57 / 54, QSGD 77 / 76 -> 76 /
75; SparseLoCo's buffers and one check of its means: 269 / 272 -> 77 / 80. Payload parts computed into the
wire's slots, seeds without torch calls, fewer calls of decoding (2026-11-28): ByteGrad 103 / 101 -> 88 / 87,
OneBit 87 / 84 -> 79 / 76, TernGrad 110 / 109 -> 99 / 98, QSGD 76 / 75 -> 72 / 71, random-k
40 / 39 -> 37 / 36, EF-sign 57 / 54 -> 56 / 53 (the pins: these, with a few to spare)."""


def _model_bucket(name: str):
    """All the workload's gradients of one batch as one bucket (as ``benchmarks/bench_compression.py``)."""
    from gradcomm.testing.op_count import workload_bucket

    return workload_bucket(name)


def _model_counts(workloads: list[str], names: list[str]) -> dict[str, dict[str, int]]:
    from gradcomm.hooks.registry import make_comm_hook
    from gradcomm.testing.op_count import hook_calls

    torch.set_num_threads(1)
    counts: dict[str, dict[str, int]] = {}
    for workload in workloads:
        bucket = _model_bucket(workload)
        values = bucket.buffer().clone()
        counts[workload] = {}
        for name in names:
            bucket.buffer().copy_(values)  # the gradients, not the last hook's mean
            counts[workload][name] = hook_calls(*make_comm_hook(name, process_group=dist.group.WORLD), bucket)
    return counts


def test_torch_calls_per_bucket_on_real_models():
    names = ["allreduce", *MODEL_CEILINGS]
    [counts] = run_on_ranks(_model_counts, world_size=1, args=(["transformer", "cnn"], names), timeout=600)
    for workload, by_name in counts.items():
        for name, ceiling in MODEL_CEILINGS.items():
            assert by_name[name] - by_name["allreduce"] <= ceiling, (workload, name, by_name)


# -- a bucket's strided gradients: compensated in place of their copy ------------------------------------------
def _mixed_bucket(distinct: bool):
    """Weights (compressed) between biases (dense): a strided compressed part, in one group of runs, or
    (``distinct``: every weight of its own size) in more groups than the hook copies one by one."""
    from gradcomm.hooks.grad_bucket import GradBucket
    from gradcomm.testing.op_count import many_tensor_bucket

    if not distinct:
        return many_tensor_bucket(9)
    generator = torch.Generator().manual_seed(1)
    shapes = [torch.Size([32 + i, 32]) if j == 0 else torch.Size([32]) for i in range(10) for j in range(2)]
    gradients = [torch.randn(shape, generator=generator) * 10.0 ** (i % 5 - 2) for i, shape in enumerate(shapes)]
    lengths = [shape.numel() for shape in shapes]
    return GradBucket(
        0, torch.cat([g.reshape(-1) for g in gradients]), [sum(lengths[:i]) for i in range(len(lengths))],
        lengths, shapes, [torch.nn.Parameter(torch.empty(shape)) for shape in shapes], is_last=True,
    )


def _strided_against_contiguous(
    names: list[str], distinct: bool
) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    from gradcomm.hooks.grad_bucket import GradBucket
    from gradcomm.hooks.registry import make_comm_hook

    mixed = _mixed_bucket(distinct)
    weights = mixed.gradients()[::2]
    lengths = [w.numel() for w in weights]
    alone_values = torch.cat([w.reshape(-1) for w in weights])
    alone = GradBucket(
        0, alone_values.clone(), [sum(lengths[:i]) for i in range(len(lengths))], lengths,
        [w.shape for w in weights], mixed.parameters()[::2], is_last=True,
    )
    mixed_values = mixed.buffer().clone()
    out: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name in names:
        (mixed_hook, mixed_state), (alone_hook, alone_state) = (
            make_comm_hook(name, process_group=dist.group.WORLD) for _ in range(2)
        )
        out[name] = []
        for step in range(3):
            scale = 1.0 + step
            mixed.buffer().copy_(mixed_values * scale)
            alone.buffer().copy_(alone_values * scale)
            got = mixed_hook(mixed_state, mixed).wait()
            want = alone_hook(alone_state, alone).wait()
            got_weights = torch.cat([g.reshape(-1) for g in got.split([m.numel() for m in mixed.gradients()])[::2]])
            out[name].append((got_weights, want.clone()))
    return out


@pytest.mark.parametrize("distinct", [False, True], ids=["one-group", "gathered-by-index"])
def test_strided_gradients_compensate_as_contiguous_ones(distinct):
    """Error feedback on a bucket's strided gradients (added into the held residual straight from the bucket)
    gives, step after step, what it gives on the same gradients lying contiguous."""
    names = ["topk", "efsign", "onebit", "bytegrad"]
    [results] = run_on_ranks(_strided_against_contiguous, world_size=1, args=(names, distinct), timeout=120)
    for name in names:
        for step, (got, want) in enumerate(results[name]):
            assert torch.equal(got, want), (name, step)


def _layered_part(groups: int, layers: int = 3):
    """The compressed part of ``layers`` blocks of ``groups`` weights of distinct sizes, each followed by a
    bias: a part in ``groups`` strided groups of runs (weights of 16,384 elements or more: compressed, and
    more than the parts gathered by index), the bucket's
    buffer, and each of the part's elements' place in it."""
    from gradcomm.compression.methods.signsgd import SignSGD
    from gradcomm.hooks.compression_hook import CompressionState
    from gradcomm.hooks.compression_plan import _Plan

    shapes = tuple(
        torch.Size([512 + 32 * g, 32]) if j == 0 else torch.Size([16]) for _ in range(layers) for g in range(groups)
        for j in range(2)
    )
    buffer = torch.randn(sum(shape.numel() for shape in shapes))
    plan = _Plan.of(CompressionState(SignSGD()), list(range(len(shapes))), shapes, buffer)
    assert plan.compressed is not None and len(plan.compressed.groups) == groups
    starts = [sum(shape.numel() for shape in shapes[:i]) for i in range(len(shapes))]
    place = torch.cat([torch.arange(starts[i], starts[i] + shapes[i].numel()) for i in plan.compressed.segments.keys])
    return plan.compressed, buffer, place


@pytest.mark.parametrize("groups", [2, 4, 8])
def test_a_strided_part_is_copied_out_in_one_call_whatever_its_groups(groups):
    """Copying a compressed part out of the bucket is one concatenation of its runs, whatever the number of
    groups (a call per group before), where torch concatenates in one call (one CPU thread: the counts'
    setting); a copy per group on several threads. Writing it back from a workspace handed over in a new tensor object
    every step (a view of it) costs a call per group, its views made once; the values are the bucket's."""
    from gradcomm.testing.op_count import count_aten_calls

    part, buffer, place = _layered_part(groups)
    into = torch.empty(part.segments.numel)
    threads = torch.get_num_threads()
    try:
        for count, expected in ((1, 1), (2, groups)):  # on several threads, torch's cat costs calls per run
            torch.set_num_threads(count)
            into.zero_()
            part.take(buffer, into)
            assert count_aten_calls(lambda: part.take(buffer, into)) == expected
            assert torch.equal(into, buffer[place])
    finally:
        torch.set_num_threads(threads)
    workspace = torch.randn(part.segments.numel)
    for _ in range(2):
        part.put(buffer, workspace.view(-1))
    again = workspace.view(-1)
    assert count_aten_calls(lambda: part.put(buffer, again)) == groups
    assert torch.equal(buffer[place], workspace)


def test_a_part_keeps_no_values_written_back_from_a_new_tensor_every_step():
    """Values written back from new memory every step (a decoder's new tensor) are not held by the part once
    written: only a place written back from twice (a workspace) has its views kept."""
    import gc
    import weakref

    part, buffer, _ = _layered_part(4)
    for _ in range(3):
        values = torch.randn(part.segments.numel)
        held = weakref.ref(values)
        part.put(buffer, values)
        del values
        gc.collect()
        assert held() is None


# -- a bucket layout's workspace: reused every step, never by two calls at once ---------------------------------
def _overlapping_calls(names: list[str], reuse_busy: bool) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Two calls of one bucket layout before either is waited for, against the same two calls one after the
    other; ``reuse_busy``: the busy workspace is reused anyway (what the guard prevents)."""
    from gradcomm.hooks import compression_hook
    from gradcomm.hooks.grad_bucket import GradBucket
    from gradcomm.hooks.registry import make_comm_hook
    from gradcomm.testing.op_count import many_tensor_bucket

    if reuse_busy:
        def workspace(plan, state, world_size):
            work = plan.workspaces.get(world_size) or compression_hook._Workspace(plan, state, world_size)
            plan.workspaces[world_size] = work
            work.busy = True
            return work

        compression_hook._Plan.workspace = workspace
    rank = dist.get_rank()
    first = many_tensor_bucket(9, seed=rank)
    lengths = [gradient.numel() for gradient in first.gradients()]
    shapes = [gradient.shape for gradient in first.gradients()]

    def bucket(seed: int) -> GradBucket:
        values = many_tensor_bucket(9, seed=seed).buffer() * (seed + 1)
        offsets = [sum(lengths[:i]) for i in range(9)]
        return GradBucket(0, values, offsets, lengths, shapes, first.parameters(), is_last=True)

    out: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name in names:
        (hook, state), (reference, reference_state) = (
            make_comm_hook(name, process_group=dist.group.WORLD) for _ in range(2)
        )
        seeds = (10 + rank, 20 + rank)
        wanted = [reference(reference_state, bucket(seed)).wait().clone() for seed in seeds]
        futures = [hook(state, bucket(seed)) for seed in seeds]
        out[name] = [(future.wait().clone(), want) for future, want in zip(futures, wanted, strict=True)]
    return out


@pytest.mark.parametrize("name", ["signsgd", "randomk", "topk", "bytegrad"])
def test_a_call_before_the_last_one_is_assembled_gets_its_own_workspace(name):
    """A caller may call the hook for a bucket layout again before waiting for the last call's future; the
    second call then must not write into the buffers the first one is still exchanging through."""
    for got, want in (pair for rank in run_on_ranks(_overlapping_calls, 2, args=([name], False), timeout=120) for pair in rank[name]):
        assert torch.equal(got, want), name


def _old_layout_after_a_new_one() -> list[int]:
    from gradcomm.hooks.registry import make_comm_hook
    from gradcomm.testing.op_count import many_tensor_bucket

    hook, state = make_comm_hook("topk", process_group=dist.group.WORLD)
    old, new = many_tensor_bucket(9), many_tensor_bucket(7)
    hook(state, old).wait()
    [old_plan] = state._runtime.plans.values()
    held = [len(old_plan.workspaces), len(old_plan.compressed._buffer_views)]
    hook(state, new).wait()  # the last bucket of an iteration that did not use the old layout
    return [*held, len(old_plan.workspaces), len(old_plan.compressed._buffer_views)]


def test_a_layout_not_used_in_the_last_iteration_releases_its_workspace():
    """DDP rebuilds its buckets after the first iteration: the old layouts' buffers (and the views the hook
    kept of them) are dropped at the end of the next iteration, not kept for good."""
    [counts] = run_on_ranks(_old_layout_after_a_new_one, 1, timeout=120)
    assert counts[:2] == [1, 1] and counts[2:] == [0, 0], counts
