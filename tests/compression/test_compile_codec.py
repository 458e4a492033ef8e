"""``compile=True`` (:mod:`gradcomm.compression.fusion`): a method's encoding and decoding through
``torch.compile``, per bucket layout, with the same results as the eager hook and the same state.

The registry-wide checks compile with the ``aot_eager`` backend (dynamo's graphs and graph breaks, AOT
autograd's functionalization of the passes' in-place writes, no code generation): the machinery, for every
method, in seconds. Inductor itself, which needs a C++ compiler and tens of seconds per graph on the CPU, runs
on two cheap deterministic methods, in the slow tier.

The slow checks run in one spawned group of 2 ranks (``compiled_on_ranks``, at the end): every method on both,
then inductor's on one of them; each test asserts on its own part's results.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradcomm.compression import SignSGD
from gradcomm.compression.base import Compressor
from gradcomm.compression.fusion import CompiledCodec
from gradcomm.compression.registry import methods
from gradcomm.compression.segments import Segments
from gradcomm.hooks import compression_hook
from gradcomm.hooks.compression_hook import CompressionState
from gradcomm.hooks.registry import check_options, make_comm_hook
from gradcomm.testing import run_on_ranks
from gradcomm.testing.op_count import many_tensor_bucket
from tests.support.ranks import each_part, part_results

STEPS = 4
GROUP_TIMEOUT = 1200  # seconds: the one spawned group of the slow checks, inductor's C++ compilation included


class _PerTensor(Compressor):
    """A method written per tensor (no segmented form)."""

    def compress(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
        return [tensor.clone()], None

    def decompress(self, payload: list[torch.Tensor], ctx: Any) -> torch.Tensor:
        return payload[0]


def test_compile_is_off_by_default_and_checked():
    assert CompressionState(SignSGD())._runtime.codec.__class__ is SignSGD
    with pytest.raises(TypeError, match="compile must be True or False, got 'yes'"):
        CompressionState(SignSGD(), compile="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="_PerTensor is not a SegmentedCompressor"):
        CompressionState(_PerTensor(), compile=True)
    with pytest.raises(ValueError, match="option 'compile' expects bool, got 'maybe'"):
        check_options("qsgd", compile="maybe")


def test_a_state_pickled_before_the_option_unpickles_eager():
    saved = CompressionState(SignSGD()).__getstate__()
    del saved["compile"]
    state = CompressionState.__new__(CompressionState)
    state.__setstate__(saved)
    assert state.compile is False and state._runtime.codec is state.compressor


def test_compile_is_an_option_of_every_compression_hook():
    for name in methods():
        _, state = make_comm_hook(name, compile="true")
        assert state.compile is True and isinstance(state._runtime.codec, CompiledCodec), name
        assert state._runtime.codec.communicator is state.compressor.communicator


def _counting_backend(graphs: list[Any]) -> Any:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    return backend


def test_a_layout_runs_eagerly_once_then_compiled():
    """The first call fills the layout's caches eagerly; the second compiles; each layout on its own."""
    graphs: list[Any] = []
    codec = CompiledCodec(SignSGD(), backend=_counting_backend(graphs))
    tensors = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (1024, 4096, 1000)]
    segments = Segments.of(tensors, ["a", "b", "c"])
    flat = torch.cat(tensors)
    eager = codec.compressor.compress_segments(flat, segments)
    first = codec.compress_segments(flat, segments)
    assert graphs == [] and codec.compiled_layouts() == 0
    second = codec.compress_segments(flat, segments)
    assert graphs and codec.compiled_layouts() == 1
    for payload in (first[0], second[0]):
        assert torch.equal(payload[0], eager[0][0])
    other = Segments.of(tensors[:2], ["a", "b"])
    codec.compress_segments(flat[:5120], other)
    codec.compress_segments(flat[:5120], other)
    assert codec.compiled_layouts() == 2


def _compile_with(backend: str) -> None:
    """Build the hook's compiled codecs with ``backend`` (this rank process only)."""
    compression_hook.fused_codec = lambda compressor, on: CompiledCodec(compressor, backend=backend) if on else compressor


def _values(step: int) -> torch.Tensor:
    bucket = many_tensor_bucket(12, seed=step)
    return bucket.buffer().mul_(1 + dist.get_rank())


def _lockstep(names: list[str], backend: str, group: Any = None) -> dict[str, Any]:
    """Per method, whether the eager and the compiled hook gave the same bits at every step (the same
    values in, called in turn), and how many layouts were compiled; the hooks on ``group`` (default: all ranks)."""
    _compile_with(backend)
    group = group or dist.group.WORLD
    bucket = many_tensor_bucket(12)
    found = {}
    for name in names:
        eager, compiled = make_comm_hook(name, process_group=group), make_comm_hook(
            name, process_group=group, compile=True
        )
        mismatches = []
        for step in range(STEPS):
            outputs = []
            for hook, state in (eager, compiled):
                bucket.buffer().copy_(_values(step))
                outputs.append(hook(state, bucket).wait().clone())
            if not torch.equal(*outputs):
                mismatches.append(step)
        found[name] = (mismatches, compiled[1]._runtime.codec.compiled_layouts())
    return found


@pytest.mark.slow
@pytest.mark.timeout(GROUP_TIMEOUT + 60)
def test_every_method_compiled_gives_the_eager_hooks_bits(compiled_on_ranks: list[dict[str, Any]]):
    """Two ranks, every registered method: the compiled passes (aot_eager) give the eager hook's bits at
    every step, error feedback and random streams included; a layout is compiled (two for the two-stage
    methods: the bucket's rows, and the row each rank recompresses)."""
    two_stage = {"bytegrad", "onebit"}
    for found in part_results(compiled_on_ranks, "every method"):
        assert found == {name: ([], 2 if name in two_stage else 1) for name in methods()}


def _resumed(backend: str) -> dict[str, bool]:
    """A compiled hook's state_dict loads into an eager one and back (and pickles): the runs continue as
    an uninterrupted compiled run does."""
    _compile_with(backend)
    bucket = many_tensor_bucket(12)
    outcome = {}
    for name in ("topk", "qsgd", "onebit"):
        options = {"error_feedback": True}
        _, straight = make_comm_hook(name, process_group=dist.group.WORLD, compile=True, **options)
        hook, first = make_comm_hook(name, process_group=dist.group.WORLD, compile=True, **options)

        def run(state: CompressionState, steps: range, hook: Any = hook) -> list[torch.Tensor]:
            outputs = []
            for step in steps:
                bucket.buffer().copy_(_values(step))
                outputs.append(hook(state, bucket).wait().clone())
            return outputs

        expected = run(straight, range(2 * STEPS))
        run(first, range(STEPS))
        saved = io.BytesIO()
        torch.save(first.state_dict(), saved)
        _, eager = make_comm_hook(name, process_group=dist.group.WORLD, **options)
        eager.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
        middle = run(eager, range(STEPS, STEPS + 2))
        _, back = make_comm_hook(name, process_group=dist.group.WORLD, compile=True, **options)
        back.load_state_dict(eager.state_dict())
        unpickled = pickle.loads(pickle.dumps(back))
        rest = run(unpickled, range(STEPS + 2, 2 * STEPS))
        outcome[name] = (
            isinstance(unpickled._runtime.codec, CompiledCodec)
            and all(torch.equal(a, b) for a, b in zip(expected[STEPS:], middle + rest, strict=True))
        )
    return outcome


@pytest.mark.slow
@pytest.mark.timeout(GROUP_TIMEOUT + 60)
def test_a_compiled_hooks_state_loads_into_an_eager_one_and_back(compiled_on_ranks: list[dict[str, Any]]):
    for outcome in part_results(compiled_on_ranks, "resumed"):
        assert outcome == {"topk": True, "qsgd": True, "onebit": True}


def _inductor_payloads(names: list[str], group: Any) -> dict[str, Any]:
    """Inductor (C++ on the CPU): the payload bits of a bucket's encoding, and the hook's results (on
    ``group``), against the eager method's."""
    torch.set_num_threads(1)
    found = {}
    bucket = many_tensor_bucket(12)
    state = CompressionState(SignSGD(), min_numel=1024)
    plan = state.plan(bucket, state.keys(bucket))
    assert plan.compressed is not None
    segments, flat = plan.compressed.segments, plan.compressed.take(bucket.buffer())[0].clone()
    for name in names:
        compressor = methods()[name]()
        codec = CompiledCodec(compressor)
        eager_payload, _ = compressor.compress_segments(flat.clone(), segments)
        payloads = [codec.compress_segments(flat.clone(), segments)[0] for _ in range(3)]
        same_payloads = all(
            all(torch.equal(a, b) for a, b in zip(eager_payload, payload, strict=True)) for payload in payloads
        )
        found[name] = (same_payloads, codec.compiled_layouts())
    found["hooks"] = _lockstep(names, "inductor", group)
    return found


@pytest.mark.slow
@pytest.mark.timeout(GROUP_TIMEOUT + 60)
def test_inductor_on_the_cpu_gives_the_eager_payload_bits(compiled_on_ranks: list[dict[str, Any]]):
    found = part_results(compiled_on_ranks, "inductor")[1]
    assert found == {
        "signsgd": (True, 1),
        "bytegrad": (True, 1),
        "hooks": {"signsgd": ([], 1), "bytegrad": ([], 2)},
    }


def test_a_failed_compilation_names_the_method_and_the_way_out():
    def failing(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        raise RuntimeError("no compiler here")

    codec = CompiledCodec(SignSGD(), backend=failing)
    tensors = [torch.randn(2048)]
    segments = Segments.of(tensors, ["w"])
    codec.compress_segments(tensors[0], segments)  # eager: the layout's first call
    with pytest.raises(RuntimeError, match=r"'signsgd' with compile=True: torch.compile failed on its "
                       r"compress_segments of a bucket of 1 compressed tensors .*no compiler here.*compile=False"):
        codec.compress_segments(tensors[0], segments)


# -- the slow checks above, in one spawned group of 2 -------------------------------------------------------------
# Every method and the resumed runs on both ranks, then inductor on rank 1 alone (on a group of that rank, as the
# 1-rank group it had), rank 0 finishing meanwhile. Each part compiles after torch._dynamo.reset(), as in a
# fresh process.
def _solo_group() -> Any:
    """This rank alone, as a process group (every rank creates every rank's, in the same order)."""
    return [dist.new_group([rank]) for rank in range(dist.get_world_size())][dist.get_rank()]


def _on_rank(rank: int, fn: Any, *args: Any) -> Any:
    """``fn(*args, group)`` on rank ``rank`` alone, ``group`` that rank alone, with dynamo's caches emptied
    first; None on the others, which go on to their next part at once."""
    group = _solo_group()
    if dist.get_rank() != rank:
        return None
    torch._dynamo.reset()
    return fn(*args, group)


def _every_rank(fn: Any, *args: Any) -> Any:
    torch._dynamo.reset()
    return fn(*args)


@pytest.fixture(scope="module")
def compiled_on_ranks() -> list[dict[str, Any]]:
    parts = [
        ("every method", _every_rank, (_lockstep, sorted(methods()), "aot_eager")),
        ("resumed", _every_rank, (_resumed, "aot_eager")),
        ("inductor", _on_rank, (1, _inductor_payloads, ["signsgd", "bytegrad"])),
    ]
    return run_on_ranks(each_part, 2, args=(parts,), timeout=GROUP_TIMEOUT, collective_timeout=300)
