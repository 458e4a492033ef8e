"""SparseLoCo (``gradcomm.compression.methods.sparseloco``): its wire format against the layout it states, its
chunked top-k and 2-bit values against a plain dense reference, the error-feedback accounting with decay, its
checkpointed accumulator and its options. The registry's suites (round trips, hooks on every DDP, resume,
the property suite) cover it as every method; DiLoCo with it: ``tests/diloco/test_diloco_sparseloco.py``."""

import io
import math
import pickle

import pytest
import torch

from gradcomm.compression import SparseLoCo
from gradcomm.compression.segments import Segments
from gradcomm.hooks.compression_hook import CompressionState
from gradcomm.hooks.registry import check_options


def _sent(compressor: SparseLoCo, x: torch.Tensor, key=None) -> torch.Tensor:
    with compressor.stream(key):
        payload, ctx = compressor.compress(x)
    return compressor.decompress(payload, ctx)


def _accumulator(compressor: SparseLoCo, key=None) -> torch.Tensor:
    return compressor.state_dict()["accumulation"][key]


def _reference(x: torch.Tensor, ratio: float, chunk: int) -> torch.Tensor:
    """What one exchange sends, written plainly in float64: per chunk the top k magnitudes, split at their
    mean magnitude, each half sent as its sign times the half's mean magnitude."""
    x = x.double().reshape(-1)
    out = torch.zeros_like(x)
    for start in range(0, x.numel(), chunk):
        part = x[start : start + chunk]
        k = min(part.numel(), max(1, math.ceil(ratio * part.numel())))
        chosen = part.abs().topk(k).indices
        values = part[chosen]
        magnitudes = values.abs()
        big = magnitudes > magnitudes.mean()
        high = magnitudes[big].mean() if big.any() else 0.0
        low = magnitudes[~big].mean() if (~big).any() else 0.0
        out[start + chosen] = torch.where(values < 0, -1.0, 1.0) * torch.where(big, high, low)
    return out


# -- the wire format ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lengths", "chunk", "ratio", "expected"),
    [
        # 4096, 4096, 1808 elements: 64 + 64 + 29 values of 12 + 2 bits: one low byte and 6 bits packed
        (
            (10000,),
            4096,
            1 / 64,
            [(157, torch.uint8), (math.ceil(157 * 6 / 8), torch.uint8), (6, torch.float32)],
        ),
        # two tensors of one chunk each: 16 values each, their 6-bit tops packed each alone (12 bytes)
        ((64, 64), 4096, 0.25, [(32, torch.uint8), (24, torch.uint8), (4, torch.float32)]),
        # chunks of 64: 6 + 2 bits, one packed byte per value and no low bytes
        ((64, 64), 64, 0.25, [(32, torch.uint8), (4, torch.float32)]),
        # chunks of 65536 and 4464: 656 + 45 values of 16 + 2 bits, two low bytes and 2 bits packed
        (
            (70000,),
            65536,
            0.01,
            [(701 * 2, torch.uint8), (math.ceil(701 * 2 / 8), torch.uint8), (4, torch.float32)],
        ),
        # chunks of one element: 2 bits, the code alone
        ((5,), 1, 1.0, [(2, torch.uint8), (10, torch.float32)]),
        # 3 + 2 bits per value, each tensor's 1, 4 + 1 and 4 + 4 values packed alone: 1 + 4 + 5 bytes; 5 chunks
        ((1, 9, 16), 8, 0.5, [(10, torch.uint8), (10, torch.float32)]),
    ],
)
def test_payload_layout_is_the_stated_words_and_two_magnitudes_per_chunk(lengths, chunk, ratio, expected):
    compressor = SparseLoCo(ratio=ratio, chunk=chunk)
    assert compressor.payload_layout(lengths, torch.float32) == expected
    tensors = [torch.randn(n) for n in lengths]
    payload, _ = compressor.compress_segments(
        torch.cat(tensors), Segments.of(tensors, list(range(len(lengths))))
    )
    assert [(part.numel(), part.dtype) for part in payload] == expected


@pytest.mark.parametrize(
    ("numel", "chunk"),
    [
        *(
            (numel, chunk)
            for numel in (1, 3, 256, 257, 5000)
            for chunk in (1, 2, 3, 255, 256, 257, 4096, 2**20)
        ),
        (70000, 65536),  # two low bytes
        (2**22 + 5, 2**23),  # three
    ],
)
def test_payload_bytes_match_the_layout_and_decode_to_the_kept_indices(numel, chunk):
    """Every word split (no low byte, one, two, three) decodes to the indices the selection kept."""
    compressor = SparseLoCo(ratio=0.3, chunk=chunk, ef_decay=0)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel + chunk))
    payload, ctx = compressor.compress(x)
    assert [(part.numel(), part.dtype) for part in payload] == compressor.payload_layout((numel,), x.dtype)
    sent = compressor.decompress(payload, ctx)
    torch.testing.assert_close(sent.double(), _reference(x, 0.3, chunk), rtol=1e-6, atol=0)


def test_a_bucket_of_several_tensors_is_each_tensor_alone_back_to_back():
    """Chunks never straddle tensors: the bucket's payload is each tensor's payload back to back, part by part
    (the words' bytes of compressing each alone), and decodes to each tensor's own exchange."""
    compressor = SparseLoCo(chunk=1000, ratio=0.05, ef_decay=0)
    tensors = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (2500, 1000, 7, 3000)]
    segments = Segments.of(tensors, ["a", "b", "c", "d"])
    payload, ctx = compressor.compress_segments(torch.cat(tensors), segments)
    expected = compressor.payload_layout(segments.lengths, torch.float32)
    assert [(part.numel(), part.dtype) for part in payload] == expected
    alone = [torch.cat(parts) for parts in zip(*(compressor.compress(t)[0] for t in tensors), strict=True)]
    for part, part_alone in zip(payload[:-1], alone[:-1], strict=True):  # the words: the same bytes
        assert torch.equal(part, part_alone)
    assert torch.equal(payload[-1], alone[-1])  # the magnitudes: the same means, row by row
    sent = compressor.decompress_segments(payload, ctx, segments)
    alone = torch.cat([_reference(t, 0.05, 1000) for t in tensors])
    torch.testing.assert_close(sent.double(), alone, rtol=1e-6, atol=0)


@pytest.mark.parametrize("other", [torch.zeros(4096), torch.full((4096,), 1e-30)], ids=["zeros", "tiny"])
def test_a_chunks_magnitudes_do_not_depend_on_the_other_chunks_of_its_bucket(other):
    """Each chunk's means are plain or peak-scaled on their own: a tensor's are the same bits alone and beside
    a tensor of zeros (whose means, 0, are below the plain range) or of tiny values (peak-scaled). Before, one
    such chunk made every chunk of its bucket take peak-scaled means, a few ulps off the plain ones."""
    compressor = SparseLoCo(ef_decay=0)
    for seed in range(8):
        x = torch.randn(8 * 4096, generator=torch.Generator().manual_seed(seed)) * 10.0 ** (seed - 4)
        alone = compressor.compress(x)[0]
        segments = Segments.of([x, other], ["x", "other"])
        payload, _ = compressor.compress_segments(torch.cat([x, other]), segments)
        assert torch.equal(payload[-1][: alone[-1].numel()], alone[-1]), seed


# -- the math ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_round_trip_keeps_k_per_chunk_with_at_most_four_values_each(dtype):
    ratio, chunk = 0.02, 4096
    x = torch.randn(3 * chunk + 100, generator=torch.Generator().manual_seed(3)).to(dtype)
    sent = _sent(SparseLoCo(ratio=ratio, chunk=chunk), x)
    assert sent.dtype == dtype and sent.shape == x.shape
    for start in range(0, x.numel(), chunk):
        part, original = sent[start : start + chunk], x[start : start + chunk]
        kept = part != 0
        assert int(kept.sum()) == math.ceil(ratio * part.numel())
        # the kept coordinates are the chunk's largest magnitudes, with their signs
        assert float(original[kept].abs().min()) >= float(original[~kept].abs().max())
        assert torch.equal(part[kept].sign(), original[kept].sign())
        levels = part[kept].abs().unique()
        assert len(levels) <= 2, levels  # sign and one of two magnitudes: 2 bits
    torch.testing.assert_close(
        sent.double(), _reference(x, ratio, chunk).to(dtype).double(), rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("ef_decay", [0.95, 0.5, 1.0])
def test_sent_plus_accumulator_is_the_input_plus_the_decayed_accumulator(ef_decay):
    """Error feedback's accounting, exact to float rounding: ``sent + e_new == x + beta * e_old``, the
    quantization error included in what is kept."""
    compressor = SparseLoCo(ratio=0.05, chunk=256, ef_decay=ef_decay)
    generator = torch.Generator().manual_seed(5)
    old = torch.zeros(1000, dtype=torch.float64)
    total_in, total_sent = torch.zeros_like(old), torch.zeros_like(old)
    for _ in range(6):
        x = torch.randn(1000, generator=generator, dtype=torch.float64)
        sent = _sent(compressor, x, key="w")
        new = _accumulator(compressor, "w")
        torch.testing.assert_close(sent + new, x + ef_decay * old, rtol=0, atol=1e-12)
        assert (sent != 0).sum() == 3 * math.ceil(0.05 * 256) + math.ceil(0.05 * 232)  # chunks 3 x 256, 232
        total_in += x
        total_sent += sent
        old = new.clone()
    if ef_decay == 1.0:  # nothing lost: everything put in is sent or still held
        torch.testing.assert_close(total_sent + old, total_in, rtol=0, atol=1e-11)


def test_the_accumulator_is_what_error_feedback_sends_next():
    """The second exchange chooses among ``x2 + beta * e1``: a coordinate left out of the first with a large
    value is sent by the second even where ``x2`` is zero."""
    compressor = SparseLoCo(ratio=0.25, chunk=4, ef_decay=0.95)
    _sent(compressor, torch.tensor([8.0, 4.0, 2.0, 1.0]), key="w")
    accumulated = _accumulator(compressor, "w")
    assert torch.equal(accumulated, torch.tensor([0.0, 4.0, 2.0, 1.0]))
    second = _sent(compressor, torch.zeros(4), key="w")
    assert torch.equal(second, torch.tensor([0.0, 0.95 * 4.0, 0.0, 0.0]))


def test_without_decay_nothing_is_kept_and_each_tensor_goes_alone():
    compressor = SparseLoCo(ratio=0.1, chunk=64, ef_decay=0)
    x = torch.randn(500, generator=torch.Generator().manual_seed(9))
    first, second = _sent(compressor, x, key="w"), _sent(compressor, x, key="w")
    assert torch.equal(first, second)
    assert compressor.state_dict() == {"accumulation": {}}


def test_zeros_stay_zero_and_extremes_stay_finite():
    compressor = SparseLoCo(ratio=0.5, chunk=8, ef_decay=0)
    assert not _sent(compressor, torch.zeros(20)).any()
    huge = torch.tensor([3.0e38, -3.0e38, 2.9e38, -1.0, 1e-42, 0.0, 3.0e38, -3.0e38])
    sent = _sent(compressor, huge)
    assert torch.isfinite(sent).all()
    assert torch.equal(sent.sign(), torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0]))


# -- state ---------------------------------------------------------------------------------------------------------


def test_state_dict_round_trip_resumes_bit_for_bit():
    gradients = [torch.randn(3000, generator=torch.Generator().manual_seed(s)) for s in range(6)]
    original = SparseLoCo(ratio=0.02, chunk=512)
    for step in range(3):
        for key in ("a", "b"):
            _sent(original, gradients[step] * (2 if key == "b" else 1), key)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    snapshot = {key: t.clone() for key, t in original.state_dict()["accumulation"].items()}
    buffer.seek(0)
    restored = SparseLoCo(ratio=0.02, chunk=512)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    unpickled = pickle.loads(pickle.dumps(original))
    saved = original.state_dict()
    for step in range(3, 6):
        for key in ("a", "b"):
            x = gradients[step] * (2 if key == "b" else 1)
            expected = _sent(original, x, key)
            assert torch.equal(_sent(restored, x, key), expected)
            assert torch.equal(_sent(unpickled, x, key), expected)
    for key, tensor in saved["accumulation"].items():  # an earlier state_dict is not changed by later steps
        assert torch.equal(tensor, snapshot[key])


def test_a_failed_step_drops_the_accumulator_rather_than_half_update_it(monkeypatch):
    from gradcomm.compression.methods import _sparseloco_rows as module

    compressor = SparseLoCo(ratio=0.1, chunk=64)
    x = torch.randn(200, generator=torch.Generator().manual_seed(4))
    _sent(compressor, x, key="w")

    def failing(*args, **kwargs):
        raise RuntimeError("selection failed")

    monkeypatch.setattr(module._Scratch, "_choose", failing)  # the selection's first step
    with pytest.raises(RuntimeError, match="selection failed"):
        _sent(compressor, x, key="w")
    assert compressor.state_dict() == {"accumulation": {}}
    monkeypatch.undo()
    assert torch.equal(_sent(compressor, x, key="w"), _sent(SparseLoCo(ratio=0.1, chunk=64), x, key="w"))


def test_loading_a_bad_state_is_refused():
    compressor = SparseLoCo()
    with pytest.raises(ValueError, match="SparseLoCo: state must have the one entry 'accumulation', got"):
        compressor.load_state_dict({"residuals": {}})
    with pytest.raises(ValueError, match="SparseLoCo: the accumulator of 'w' must be a tensor, got list"):
        compressor.load_state_dict({"accumulation": {"w": [1.0]}})
    compressor.load_state_dict({"accumulation": {"w": torch.zeros(3)}})
    with pytest.raises(
        ValueError, match=r"SparseLoCo: the accumulator kept for 'w' has shape \(3,\), but the"
    ):
        _sent(compressor, torch.ones(4), key="w")


# -- options -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ratio": 0}, r"SparseLoCo: ratio must be a number in \(0, 1\], got 0"),
        ({"ratio": 1.5}, r"SparseLoCo: ratio must be a number in \(0, 1\], got 1.5"),
        ({"ratio": float("nan")}, r"SparseLoCo: ratio must be a number in \(0, 1\], got nan"),
        ({"chunk": 0}, r"SparseLoCo: chunk must be an integer in 1..2\*\*30, got 0"),
        ({"chunk": 64.0}, r"SparseLoCo: chunk must be an integer in 1..2\*\*30, got 64.0"),
        ({"ef_decay": -0.1}, r"SparseLoCo: ef_decay must be a number in \[0, 1\], got -0.1"),
        ({"ef_decay": 1.01}, r"SparseLoCo: ef_decay must be a number in \[0, 1\], got 1.01"),
        ({"ef_decay": True}, r"SparseLoCo: ef_decay must be a number in \[0, 1\], got True"),
    ],
)
def test_invalid_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SparseLoCo(**options)


def test_registry_options_and_the_hooks_error_feedback():
    check_options("sparseloco", ratio="0.02", chunk="1024", ef_decay="0.9", min_numel="16")
    with pytest.raises(
        ValueError, match=r"sparseloco.*SparseLoCo: ef_decay must be a number in \[0, 1\], got 2.0"
    ):
        check_options("sparseloco", ef_decay="2")
    assert CompressionState(SparseLoCo()).error_feedback is False  # its own accumulator is the error feedback
    with pytest.raises(ValueError, match="SparseLoCo does not support error feedback"):
        CompressionState(SparseLoCo(), error_feedback=True)
