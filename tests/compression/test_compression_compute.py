"""The compression hooks' cheaper encode and decode paths give the values of the plain formulas they replace.

Each shortcut (a residual zeroed in place instead of ``corrected - decompress(payload)``, decoding a two-stage
exchange once, ...) is checked bit for bit against the formula it stands for, on several dtypes and shapes,
with zeros and negative zeros in the input.
"""

from functools import partial

import pytest
import torch

from gradcomm.compression import DGC, QSGD, Memory, NoMemory, RandomK, ResidualMemory, TernGrad, TopK
from gradcomm.compression._numerics import ordered_mean, sparse_nonzero
from gradcomm.compression.base import RowwiseCompressor
from gradcomm.compression.communicators import compensated_compress
from gradcomm.compression.registry import methods
from gradcomm.compression.two_stage import TwoStageAllreduce, _join_rows

COMPRESSORS = {
    **methods(),
    "randomk_biased": partial(RandomK, unbiased=False),
    "randomk_all": partial(RandomK, ratio=1.0, unbiased=False),
    "topk_half": partial(TopK, ratio=0.5),
    "qsgd_3bit": partial(QSGD, levels=3, bucket_size=64),
    "terngrad_unclipped": partial(TernGrad, clip=None),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(1000,), (33, 65), (5, 7, 11)]


def bits(x: torch.Tensor) -> torch.Tensor:
    """The bytes of ``x``: equal only where every element has the same bits (-0.0 is not 0.0)."""
    return x.contiguous().view(-1).view(torch.uint8)


def gradient(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    flat = x.view(-1)
    flat[::9] = 0
    flat[1::13] = -0.0
    return x


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_residual_is_corrected_minus_the_decompressed_payload(name, dtype):
    compressor = COMPRESSORS[name]()
    for seed, shape in enumerate(SHAPES):
        corrected = gradient(shape, dtype, seed)
        with compressor.stream(shape):
            payload, ctx = compressor.compress(corrected)
        expected = corrected - compressor.decompress(payload, ctx)
        residual = compressor.residual(corrected.clone(), payload, ctx)
        assert residual.shape == corrected.shape and residual.dtype == dtype
        assert torch.equal(bits(residual), bits(expected)), (name, dtype, shape)


@pytest.mark.parametrize("name", ["topk", "randomk_biased"])
def test_sparse_residual_zeroes_sent_coordinates_in_place(name):
    """The sparsifiers' residual is ``corrected`` itself with what was sent set to 0 (no dense pass); a sent
    infinity leaves 0 (the subtraction would leave NaN)."""
    compressor = COMPRESSORS[name]()
    corrected = gradient((4096,), torch.float32, 0)
    corrected[5] = float("inf")
    with compressor.stream("w"):
        payload, ctx = compressor.compress(corrected)
    residual = compressor.residual(corrected, payload, ctx)
    assert residual.data_ptr() == corrected.data_ptr()
    sent = compressor.decompress(payload, ctx) != 0
    assert sent.sum() > 0 and (residual[sent] == 0).all()
    assert torch.isfinite(residual).all() or name == "randomk_biased"


def test_sparse_residual_of_a_non_contiguous_tensor():
    compressor = TopK(0.25)
    corrected = gradient((64, 48), torch.float32, 3).t()
    payload, ctx = compressor.compress(corrected)
    expected = corrected - compressor.decompress(payload, ctx)
    assert torch.equal(compressor.residual(corrected.clone(), payload, ctx), expected)


@pytest.mark.parametrize("name", sorted(n for n in COMPRESSORS if not isinstance(COMPRESSORS[n](), DGC)))
def test_compensated_compress_leaves_the_gradient_alone(name):
    """The first step (no residual yet) compresses the gradient itself: the in-place residual must work on a
    copy. Two steps of error feedback give the dense formula's residuals. (Not DGC, which keeps its own
    buffers instead of error feedback.)"""
    compressor, memory = COMPRESSORS[name](), ResidualMemory()
    expected = None
    for step in range(3):
        x = gradient((2048,), torch.float32, step)
        original = x.clone()
        corrected = x if expected is None else x + expected
        with compressor.stream("w"):
            payload, ctx = compensated_compress(compressor, memory, "w", x)
        assert torch.equal(bits(x), bits(original))
        expected = corrected - compressor.decompress(payload, ctx)
        assert torch.equal(bits(memory.residuals["w"]), bits(expected)), step


@pytest.mark.parametrize("name", ["onebit", "bytegrad"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_two_stage_worker_residual(name, world_size):
    compressor: RowwiseCompressor = COMPRESSORS[name]()
    communicator = TwoStageAllreduce(server_error_feedback=True)
    memory = ResidualMemory()
    held = torch.zeros(1001)
    for step in range(3):
        x = gradient((1001,), torch.float32, step)
        message = communicator.encode(compressor, "w", x, memory, world_size)
        sent = _join_rows(compressor.decompress_rows(message.payload, message.ctx.rows), message.ctx.spec)
        held = x + held - sent
        assert torch.equal(bits(memory.residuals["w"]), bits(held)), step


class _UpdateOnly(Memory):
    """A memory written before :meth:`Memory.store` existed: only ``update``."""

    enabled = True

    def __init__(self) -> None:
        self.kept: dict[str, torch.Tensor] = {}

    def compensate(self, key, tensor):
        return tensor + self.kept[key] if key in self.kept else tensor

    def update(self, key, corrected, sent):
        self.kept[key] = corrected - sent


def test_memory_store_defaults_to_update():
    memory, x = _UpdateOnly(), torch.randn(2048)
    compressor = TopK(0.01)
    payload, ctx = compensated_compress(compressor, memory, "w", x)
    assert torch.equal(memory.kept["w"], x - compressor.decompress(payload, ctx))
    NoMemory().store("w", x)  # keeps nothing


@pytest.mark.parametrize("name", ["onebit", "bytegrad"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_stage_one_reuses_this_ranks_own_decoding(name, world_size):
    """Stage 1 takes this rank's own row from the worker residual's decompression instead of decoding it
    again: the rows, and their ordered mean, are those of decoding every received row."""
    compressor: RowwiseCompressor = COMPRESSORS[name]()
    memory = ResidualMemory()
    x = gradient((1001,), torch.float32, 5)
    message = TwoStageAllreduce().encode(compressor, "w", x, memory, world_size)
    assert message.ctx.decoded is not None
    for rank in range(world_size):
        # what rank `rank` receives: row `rank` of every source; here every source sent this payload
        received = [part[rank : rank + 1].expand(world_size, *part.shape[1:]).contiguous() for part in message.payload]
        expected = compressor.decompress_rows(received, message.ctx.rows)
        rows = TwoStageAllreduce._received(compressor, received, message.ctx, rank)
        assert torch.equal(torch.stack(list(rows)), expected)
        assert torch.equal(ordered_mean(rows, world_size), ordered_mean(expected, world_size))


def test_ordered_mean_of_one_tensor_is_the_tensor():
    x = gradient((100,), torch.float32, 1)
    assert ordered_mean([x], 1) is x
    assert torch.equal(ordered_mean(torch.stack([x, 2 * x]), 2), x / 2 + 2 * x / 2)


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 64, 1000, 4099])
@pytest.mark.parametrize("density", [0.0, 0.002, 0.05, 0.5, 1.0])
def test_sparse_nonzero_is_nonzero(length, density):
    generator = torch.Generator().manual_seed(length)
    mask = torch.rand(length + 3, generator=generator) < density
    for view in (mask[:length], mask[3:], mask[::2]):  # aligned, unaligned, strided
        assert torch.equal(sparse_nonzero(view), view.nonzero().squeeze(1))


class _Failing(TopK):
    def compress(self, tensor):
        raise RuntimeError("compression failed")


def test_compensation_adds_into_the_residual_and_a_failed_compression_drops_it():
    memory, compressor = ResidualMemory(), TopK(0.01)
    x = gradient((2048,), torch.float32, 0)
    compensated_compress(compressor, memory, "w", x)
    residual = memory.residuals["w"]
    expected = x + residual
    corrected = memory.compensate("w", x)
    assert corrected is residual and torch.equal(bits(corrected), bits(expected))
    with pytest.raises(RuntimeError, match="compression failed"):
        compensated_compress(_Failing(0.01), memory, "w", x)
    assert "w" not in memory.residuals  # it held this step's tensor: not counted twice
    _UpdateOnly().discard("w")  # the default keeps what it holds


def test_loaded_residuals_are_copies():
    """compensate adds into the residual in place: a loaded checkpoint's tensors must not change with it."""
    saved = {"w": torch.ones(4)}
    memory = ResidualMemory()
    memory.load_state_dict(saved)
    assert torch.equal(memory.compensate("w", torch.full((4,), 2.0)), torch.full((4,), 3.0))
    assert torch.equal(saved["w"], torch.ones(4))
