"""The compression hook on 2 and 3 gloo ranks, under torch's DDP and gradcomm's DDP and legacy DDP.

Every method keeps the ranks' parameters identical while training, sends exactly the bytes its wire format
implies, averages what the ranks sent, and resumes from a ``weights_only`` checkpoint as if never
interrupted. Each world size spawns its ranks once; every DDP kind and method runs inside that one group and
the tests below check the returned results.
"""

import functools
import io
import math
import pickle
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradcomm
from gradcomm import comm
from gradcomm.compression import QSGD, EFSignSGD, RandomizedCompressor, RowwiseCompressor, SignSGD, TopK
from gradcomm.compression.communicators import Allgather, Allreduce, compensated_compress
from gradcomm.compression.registry import methods
from gradcomm.compression.two_stage import TwoStageAllreduce
from gradcomm.hooks import compression_hook
from gradcomm.hooks.compression_hook import CompressionState, compressed_allreduce_hook
from gradcomm.testing import run_on_ranks
from tests.support.models import mlp
from tests.support.ranks import DDP_KINDS, make_ddp
from tests.support.training import linear_target_batch

# Every registered method, with its default options: a new method is covered without an edit here.
METHODS = methods()
ALLGATHERED = tuple(name for name, cls in METHODS.items() if isinstance(cls.communicator, Allgather))
DETERMINISTIC = tuple(name for name, cls in METHODS.items() if not issubclass(cls, RandomizedCompressor))
STEPS = 10  # every method's held-out loss has fallen well below its start by then, on 2 and 3 ranks
WORLD_SIZES = [2, 3]
KINDS = (*DDP_KINDS, "legacy")
BUCKET_CAP_MB = 0.005  # several buckets (and, for torch's DDP, a rebuild after the first step)
LEGACY_BUFFER = 1500  # elements: several buffers

# The model: its weights of 1280 and 3072 elements are compressed (min_numel=1024); the 240-element weight
# and the biases (64 + 48 + 5) are sent dense.
COMPRESSED = (1280, 3072)
DENSE_FLOATS = 240 + 64 + 48 + 5

# Resumed runs compress every tensor (no dense allreduce): a fresh DDP's first bucket layout differs from the
# rebuilt one it was checkpointed with, and on 3 gloo ranks a dense allreduce sums in a layout-dependent order
# (last-bit differences). Everything else, residuals and random streams included, must resume exactly.
# Every method is resumed, with EVERYTHING or its RESUMED_OVERRIDES (QSGD: with error feedback, so that its
# residuals are checkpointed too). A method whose own payloads are summed by an allreduce (random-k) meets the
# same order dependence on 3 ranks: it must resume exactly on 2 ranks, to float rounding
# (SUMMED_RESUME_TOLERANCE) on 3.
EVERYTHING = {"min_numel": 1, "min_compression_rate": 0.0}
RESUMED_OVERRIDES = {"qsgd": dict(EVERYTHING, error_feedback=True)}
RESUMED = {name: RESUMED_OVERRIDES.get(name, EVERYTHING) for name in METHODS}
SUMMED_RESUME_TOLERANCE = 1e-6


def _model() -> torch.nn.Module:
    return mlp(20, 64, 48, 5, activation=torch.nn.ReLU)


def _flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    return [linear_target_batch(generator) for _ in range(steps)]


def _held_out_loss(model: torch.nn.Module) -> float:
    x, y = linear_target_batch(torch.Generator().manual_seed(7))
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def _setup(
    kind: str, model: torch.nn.Module, state: CompressionState
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    if kind == "legacy":
        ddp = gradcomm.LegacyDistributedDataParallel(model, dist.get_world_size(), buffer_size=LEGACY_BUFFER)
    else:
        ddp = make_ddp(kind, model, bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(state, compressed_allreduce_hook)
    return ddp, torch.optim.SGD(model.parameters(), lr=0.05)


def _step(
    ddp: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    optimizer.zero_grad()
    F.mse_loss(ddp(batch[0]), batch[1]).backward()
    if hasattr(ddp, "all_reduce"):  # the legacy DDP reduces explicitly
        ddp.all_reduce()
    optimizer.step()


def _gathered_gradients(
    model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> list[list[torch.Tensor]]:
    """Every rank's raw gradient of every parameter (gathered by torch.distributed, not comm: uncounted)."""
    model.zero_grad()
    F.mse_loss(model(batch[0]), batch[1]).backward()
    gathered = []
    for p in model.parameters():
        gathered.append([torch.empty_like(p.grad) for _ in range(dist.get_world_size())])
        dist.all_gather(gathered[-1], p.grad)
    model.zero_grad()
    return gathered


# Methods whose first averaged gradient is checked against the ranks' mean within a method-specific
# allowance (a function of the ranks' raw gradients) instead of the generic rule of _first_step_error.
FIRST_STEP_ALLOWANCE = {
    "bytegrad": lambda grads: 2 * max(float(g.max() - g.min()) for g in grads) / 255,  # one step per stage
}


def _reproducible(name: str) -> bool:
    """Deterministic and single-stage: the average is the method's aggregate of the ranks' payloads."""
    cls = METHODS[name]
    return not issubclass(cls, RandomizedCompressor) and not isinstance(cls.communicator, TwoStageAllreduce)


def _first_step_error(name: str, model: torch.nn.Module, gathered: list[list[torch.Tensor]]) -> float:
    """Largest deviation of the first averaged gradient from what the ranks' raw gradients imply, in units
    of the deviation allowed: float rounding for dense tensors and reproducible methods (deterministic and
    single-stage), a method's FIRST_STEP_ALLOWANCE (ByteGrad: two quantization steps, one per stage).
    Stochastic and other two-stage methods (1-bit) are checked on dense tensors only."""
    worst = 0.0
    for p, grads in zip(model.parameters(), gathered, strict=True):
        mean = sum(g / len(grads) for g in grads)
        if p.numel() < 1024:
            want, allowed = mean, 1e-6 * float(mean.abs().max()) + 1e-12
        elif name in FIRST_STEP_ALLOWANCE:
            want, allowed = mean, FIRST_STEP_ALLOWANCE[name](grads)
        elif _reproducible(name):
            # a fresh compressor per rank: a stateful method's first step starts from its initial state
            payloads = [METHODS[name]().compress(g) for g in grads]
            stacked = [
                torch.stack(parts) for parts in zip(*(payload for payload, _ in payloads), strict=True)
            ]
            want = METHODS[name]().aggregate(stacked, payloads[0][1])
            allowed = 1e-6 * float(want.abs().max()) + 1e-12
        else:
            continue
        worst = max(worst, float((p.grad - want).abs().max()) / allowed)
    return worst


def _train(kind: str, name: str) -> dict:
    model = _model()
    batches = _batches(STEPS)
    gathered = _gathered_gradients(model, batches[0])
    ddp, optimizer = _setup(kind, model, CompressionState(METHODS[name]()))
    comm.traffic.reset()
    loss_before = _held_out_loss(model)
    _step(ddp, optimizer, batches[0])
    first_step_error = _first_step_error(name, model, gathered)
    for batch in batches[1:]:
        _step(ddp, optimizer, batch)
    return {
        "params": _flat(model),
        "bytes": dict(comm.traffic.bytes_sent),
        "calls": dict(comm.traffic.calls),
        "losses": (loss_before, _held_out_loss(model)),
        "first_step_error": first_step_error,
    }


def _dense_apart(kind: str, name: str) -> np.ndarray:
    """:func:`_train`'s parameters with the dense tensors in an allreduce of their own, never in the
    method's all-gather (what every world size did before all-gathers carried them on two ranks)."""
    carries_dense = Allgather.carries_dense
    Allgather.carries_dense = lambda self, world_size: False
    try:
        return _train(kind, name)["params"]
    finally:
        Allgather.carries_dense = carries_dense


def _resume_gap(kind: str, name: str, kwargs: dict) -> float:
    """Max parameter difference between 6 uninterrupted steps and 3 + (checkpoint, fresh DDP, state) + 3."""
    batches = _batches(6)
    model = _model()
    state = CompressionState(METHODS[name](), **kwargs)
    ddp, optimizer = _setup(kind, model, state)
    for batch in batches[:3]:
        _step(ddp, optimizer, batch)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "hook": state.state_dict()}, saved)
    for batch in batches[3:]:
        _step(ddp, optimizer, batch)

    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    resumed_model = _model()
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_state = CompressionState(METHODS[name](), **kwargs)
    resumed_state.load_state_dict(checkpoint["hook"])
    resumed_ddp, resumed_optimizer = _setup(kind, resumed_model, resumed_state)
    for batch in batches[3:]:
        _step(resumed_ddp, resumed_optimizer, batch)
    return float(np.abs(_flat(model) - _flat(resumed_model)).max())


def _run_everything(kinds: tuple[str, ...]) -> dict:
    return {
        kind: {
            "methods": {name: _train(kind, name) for name in METHODS},
            "resume_gaps": {name: _resume_gap(kind, name, kwargs) for name, kwargs in RESUMED.items()},
            "dense_apart": {name: _dense_apart(kind, name) for name in ALLGATHERED},
        }
        for kind in kinds
    }


@functools.cache
def _results(world_size: int) -> list[dict]:
    return run_on_ranks(_run_everything, world_size, args=(KINDS,), timeout=270)


def _wire_format_bytes_per_step(name: str, world_size: int) -> dict[str, int]:
    """Payload bytes per step by collective, from the wire formats the methods document (float32
    gradients); a method not listed here is checked against _payload_bytes_per_step alone."""
    dense = 4 * DENSE_FLOATS
    if name == "randomk":  # k float32 values at shared coordinates, summed with the dense tensors
        return {"all_reduce": dense + sum(4 * math.ceil(0.01 * d) for d in COMPRESSED)}
    chunks = [math.ceil(d / world_size) for d in COMPRESSED]  # two-stage methods: one padded chunk per rank
    gathered = {
        "topk": sum(math.ceil(0.01 * d) * (4 + 4) for d in COMPRESSED),  # float32 values + int32 indices
        "efsign": sum(math.ceil(d / 8) + 4 for d in COMPRESSED),  # sign bits + a float32 scale
        "signsgd": sum(math.ceil(d / 8) for d in COMPRESSED),  # sign bits
        "qsgd": sum(
            math.ceil(d / 512) * (512 // 2 + 4) for d in COMPRESSED
        ),  # 4-bit codes + a norm per bucket
        "terngrad": sum(math.ceil(d / 4) + 4 for d in COMPRESSED),  # 2-bit codes + a float32 scale
        "bytegrad": sum(c + 8 for c in chunks),  # a chunk: 8-bit codes + float32 min and max ...
        "onebit": sum(math.ceil(c / 8) + 4 for c in chunks),  # ... or sign bits + a float32 scale
    }[name]
    if name in ("bytegrad", "onebit"):
        # stage 1 sends one chunk to every rank (all-to-all), stage 2 all-gathers this rank's reduced chunk
        return {"all_reduce": dense, "all_to_all": world_size * gathered, "all_gather": gathered}
    if world_size == 2:  # the all-gather carries the dense tensors too: the same bytes on each link
        return {"all_gather": dense + gathered}
    return {"all_reduce": dense, "all_gather": gathered}


WIRE_FORMATS = ("topk", "randomk", "efsign", "signsgd", "qsgd", "terngrad", "bytegrad", "onebit")


def _nbytes(payload: list[torch.Tensor]) -> int:
    return sum(part.numel() * part.element_size() for part in payload)


def _stated_bytes(compressor, lengths: tuple[int, ...], dtype: torch.dtype) -> int:
    return sum(numel * torch.empty((), dtype=part_dtype).element_size() for numel, part_dtype in compressor.payload_layout(lengths, dtype))


def _payload_bytes_per_step(name: str, world_size: int) -> dict[str, int]:
    """Payload bytes per step by collective, from the sizes of the method's payloads (as its payload_layout
    states them) and its communicator: the generic expectation, for any method."""
    compressor = METHODS[name]()
    state = CompressionState(compressor)
    communicator = compressor.communicator
    traffic: Counter[str] = Counter()
    for p in _model().parameters():
        meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
        if not state.compresses(meta):  # sent dense: in the all-gather on two ranks
            dense_in = "all_gather" if isinstance(communicator, Allgather) and world_size == 2 else "all_reduce"
            traffic[dense_in] += _nbytes([meta])
        elif isinstance(communicator, Allreduce):
            traffic["all_reduce"] += _stated_bytes(compressor, (p.numel(),), p.dtype)
        elif isinstance(communicator, Allgather):
            traffic["all_gather"] += _stated_bytes(compressor, (p.numel(),), p.dtype)
        elif isinstance(communicator, TwoStageAllreduce):
            assert isinstance(compressor, RowwiseCompressor)
            chunk = math.ceil(p.numel() / world_size)  # one padded chunk per rank, each sent to its rank ...
            traffic["all_to_all"] += _stated_bytes(compressor, (chunk,) * world_size, p.dtype)
            # ... then this rank's reduced chunk, recompressed, is all-gathered
            traffic["all_gather"] += _stated_bytes(compressor, (chunk,), p.dtype)
        else:
            raise AssertionError(
                f"{name}: no generic traffic expectation for communicator {communicator!r}; "
                "give its wire format in _wire_format_bytes_per_step"
            )
    return dict(traffic)


def _expected_bytes_per_step(name: str, world_size: int) -> dict[str, int]:
    if name in WIRE_FORMATS:
        return _wire_format_bytes_per_step(name, world_size)
    return _payload_bytes_per_step(name, world_size)


runs = pytest.mark.parametrize("kind", KINDS)
world_sizes = pytest.mark.parametrize("world_size", WORLD_SIZES)


@pytest.mark.slow
@pytest.mark.timeout(300)
@runs
@world_sizes
def test_every_method_keeps_ranks_identical_and_trains(kind, world_size):
    initial = _flat(_model())
    ranks = [rank[kind]["methods"] for rank in _results(world_size)]
    for name in METHODS:
        params = [rank[name]["params"] for rank in ranks]
        assert all(np.array_equal(params[0], other) for other in params[1:]), f"{name}: ranks diverged"
        assert np.isfinite(params[0]).all() and not np.array_equal(params[0], initial), name
        before, after = ranks[0][name]["losses"]
        assert after < before, f"{name}: held-out loss went from {before} to {after}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@runs
@world_sizes
def test_traffic_equals_payload_sizes(kind, world_size):
    for rank in _results(world_size):
        for name in METHODS:
            expected = {
                collective: STEPS * n for collective, n in _expected_bytes_per_step(name, world_size).items()
            }
            assert rank[kind]["methods"][name]["bytes"] == expected, name


@pytest.mark.slow
@pytest.mark.timeout(300)
@runs
@world_sizes
def test_allgathered_methods_carry_dense_tensors_on_two_ranks(kind, world_size):
    """On two ranks the all-gather carries the dense tensors: one collective per bucket instead of two, and
    the parameters bit for bit those of the dense allreduce; from three ranks on the dense allreduce stays."""
    for rank in _results(world_size):
        for name in ALLGATHERED:
            calls = rank[kind]["methods"][name]["calls"]
            assert ("all_reduce" in calls) == (world_size > 2), f"{name}: {calls}"
            params, apart = rank[kind]["methods"][name]["params"], rank[kind]["dense_apart"][name]
            assert np.array_equal(params, apart), f"{name}: the dense tensors' mean changed with their collective"


@pytest.mark.slow
@pytest.mark.timeout(300)
@runs
@world_sizes
def test_first_step_averages_what_ranks_sent(kind, world_size):
    for rank in _results(world_size):
        for name in METHODS:
            assert rank[kind]["methods"][name]["first_step_error"] <= 1.0, name


@pytest.mark.slow
@pytest.mark.timeout(300)
@runs
@world_sizes
def test_resume_from_weights_only_checkpoint(kind, world_size):
    for rank in _results(world_size):
        gaps = rank[kind]["resume_gaps"]
        assert set(gaps) == set(RESUMED)
        for name, gap in gaps.items():
            summed = isinstance(METHODS[name].communicator, Allreduce)
            allowed = SUMMED_RESUME_TOLERANCE if summed and world_size > 2 else 0.0
            assert gap <= allowed, f"{name}: the resumed run's parameters differ by up to {gap}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deterministic_methods_agree_across_ddp_kinds():
    """On 2 ranks (where a dense sum cannot depend on order) bucket layouts must not change the result."""
    results = _results(2)[0]
    for name in DETERMINISTIC:
        params = [results[kind]["methods"][name]["params"] for kind in results]
        assert all(np.array_equal(params[0], other) for other in params[1:]), name


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", WIRE_FORMATS)
def test_payload_sizes_are_the_documented_wire_formats(name, world_size):
    """The generic expectation (what a method without a documented wire format is checked against) agrees
    with every documented one."""
    assert _payload_bytes_per_step(name, world_size) == _wire_format_bytes_per_step(name, world_size)


def test_error_feedback_choice_is_checked_against_the_method():
    with pytest.raises(ValueError, match="requires error feedback"):
        CompressionState(EFSignSGD(), error_feedback=False)
    with pytest.raises(ValueError, match="does not support error feedback"):
        CompressionState(SignSGD(), error_feedback=True)
    assert CompressionState(TopK()).error_feedback and not CompressionState(QSGD()).error_feedback


def test_state_pickles_without_process_group_or_caches():
    state = CompressionState(QSGD(), error_feedback=True)
    x = torch.randn(2048)
    assert state.compresses(x)
    compensated_compress(state.compressor, state.memory, 0, x)
    restored = pickle.loads(pickle.dumps(state))
    assert torch.equal(restored.memory.residuals[0], state.memory.residuals[0])
    assert restored.compressor.state_dict() == state.compressor.state_dict() == {"draws": {0: 1}}
    assert restored.process_group is None and not restored._runtime.compressible


def test_small_and_poorly_compressed_tensors_are_sent_dense():
    state = CompressionState(TopK(0.5), min_numel=100)
    assert not state.compresses(torch.zeros(99))
    assert not state.compresses(torch.zeros(1000))  # values + indices of half the tensor: no saving
    state = CompressionState(TopK(0.01), min_numel=100)
    assert state.compresses(torch.zeros(1000))


def test_empty_tensors_are_sent_dense_whatever_min_numel():
    for name, cls in METHODS.items():
        state = CompressionState(cls(), min_numel=0, min_compression_rate=0.0)
        for shape in [(0,), (0, 5), (3, 0)]:
            assert not state.compresses(torch.empty(shape)), (name, shape)
        assert state.compresses(torch.ones(())), name  # one element is compressed at min_numel=0


def test_results_go_into_the_buffer_unless_a_piece_shares_it_or_has_another_dtype():
    buffer = torch.zeros(5)
    pieces = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])]
    result = compression_hook._written_into(buffer, pieces)
    assert result.data_ptr() == buffer.data_ptr() and torch.equal(buffer, torch.arange(1.0, 6.0))
    aliasing = [buffer[3:], buffer[:3]]  # a decoding that returned views of what it was given
    result = compression_hook._written_into(buffer, aliasing)
    assert result.data_ptr() != buffer.data_ptr() and torch.equal(result, torch.tensor([4.0, 5.0, 1.0, 2.0, 3.0]))
    result = compression_hook._written_into(buffer, [p.double() for p in pieces])
    assert result.data_ptr() != buffer.data_ptr() and result.dtype == buffer.dtype
    decoded_in_place = buffer[2:].copy_(torch.tensor([8.0, 9.0, 10.0]))  # in its own place: left there
    result = compression_hook._written_into(buffer, [torch.tensor([6.0, 7.0]), decoded_in_place])
    assert result.data_ptr() == buffer.data_ptr() and torch.equal(buffer, torch.arange(6.0, 11.0))


_BUCKET_SHAPES = [(), (0,), (1, 2000), (3000,), (40, 50), (7,)]


def _every_hook_call(write_into_buffer: bool) -> dict[str, list[tuple[bool, bytes]]]:
    """Three calls of every method's hook on one bucket of odd shapes (a 0-dim and an empty gradient among
    them), everything compressed but the empty one, new gradients in the buffer before each call: per
    method and call, whether the result is the buffer, and its bytes."""
    if not write_into_buffer:
        compression_hook._written_into = lambda buffer, pieces: torch.cat(pieces).to(buffer.dtype).view(buffer.shape)
    from gradcomm.hooks.grad_bucket import GradBucket

    lengths = [math.prod(shape) for shape in _BUCKET_SHAPES]
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    parameters = [torch.nn.Parameter(torch.zeros(shape)) for shape in _BUCKET_SHAPES]
    results: dict[str, list[tuple[bool, bytes]]] = {}
    for name, cls in METHODS.items():
        state = CompressionState(cls(), min_numel=0, min_compression_rate=0.0)
        buffer = torch.empty(sum(lengths))
        bucket = GradBucket(0, buffer, offsets, lengths, _BUCKET_SHAPES, parameters, is_last=True)
        for call in range(3):
            buffer.copy_(torch.randn(buffer.numel(), generator=torch.Generator().manual_seed(call)))
            result = compressed_allreduce_hook(state, bucket).wait()
            assert result.shape == buffer.shape and result.dtype == buffer.dtype, name
            results.setdefault(name, []).append(
                (result.data_ptr() == buffer.data_ptr(), result.contiguous().view(torch.uint8).numpy().tobytes())
            )
    return results


def _every_hook_call_both_ways() -> tuple[dict[str, list[tuple[bool, bytes]]], ...]:
    """:func:`_every_hook_call` writing into the buffer, then with a new tensor (``_written_into`` replaced, and
    put back after), each from the same seed of the global generator, in one process."""
    original = compression_hook._written_into
    results = []
    try:
        for write_into_buffer in (True, False):
            torch.manual_seed(0)
            results.append(_every_hook_call(write_into_buffer))
    finally:
        compression_hook._written_into = original
    return tuple(results)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hook_writes_the_average_into_the_bucket_with_a_new_tensors_values():
    into_buffer, new_tensor = run_on_ranks(_every_hook_call_both_ways, 1)[0]
    for name in METHODS:
        assert [is_buffer for is_buffer, _ in into_buffer[name]] == [True] * 3, name
        # a segmented method's hook writes every bucket into its buffer (it does not go through _written_into)
        expected = [METHODS[name].segmented] * 3
        assert [is_buffer for is_buffer, _ in new_tensor[name]] == expected, name
        assert [values for _, values in into_buffer[name]] == [values for _, values in new_tensor[name]], name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_sparse_bucket_is_refused_naming_the_method(name: str) -> None:
    """nn.Embedding(sparse=True) hands the hook a sparse bucket; the method says so in one line, before any
    collective, so every rank raises the same error at the same bucket."""
    from gradcomm.hooks.grad_bucket import GradBucket

    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (4,), check_invariants=True)
    bucket = GradBucket(0, sparse, [0], [4], [torch.Size([4])], [torch.nn.Parameter(torch.zeros(4))], True)
    state = CompressionState(METHODS[name](), min_numel=0, min_compression_rate=0.0)
    with pytest.raises(NotImplementedError, match=rf"^compression method '{name}' encodes dense gradients only, and "
                       r"this bucket holds a sparse one \(nn.Embedding\(sparse=True\)\); make the embedding dense, "
                       r"or train with no hook$"):
        compressed_allreduce_hook(state, bucket)
