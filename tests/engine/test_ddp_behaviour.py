"""gradcomm's DDP engine: misuse messages, GradBucket semantics, bucket rebuild, checkpoints, legacy DDP.

The rank function collects messages and observations into a dict; the assertions run in the parent so a
failure names the check. One spawned group per world size serves all checks.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradcomm
from gradcomm.ddp.bucketing import assign_buckets, bucket_size_limits, initial_buckets
from gradcomm.testing import run_on_ranks
from tests.support.models import WithUnused, mlp
from tests.support.ranks import error_text
from tests.support.training import random_batch


def _mlp() -> nn.Module:
    return mlp(8, 32, 16, 4, activation=nn.ReLU)


def _batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(100 * dist.get_rank() + step, 6, 8, 4)


def _backward(ddp: nn.Module, step: int = 0) -> None:
    x, y = _batch(step)
    nn.functional.mse_loss(ddp(x), y).backward()



# -- hooks used by the checks -----------------------------------------------------------------------------
def first_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return _allreduce_average(bucket)


def second_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return _allreduce_average(bucket)


def _allreduce_average(bucket: Any) -> torch.futures.Future[torch.Tensor]:
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def then_chained_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Allreduce, then divide in a ``.then`` callback (the seeds' no_sync NaN regression)."""
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda fut: fut.value()[0] / dist.get_world_size()).then(lambda fut: fut.value() * 1.0)


def future_passing_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sets its own future's value: every gradient becomes 2."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(torch.full_like(bucket.buffer(), 2.0))
    return future


def bad_bucket_annotation(state: Any, bucket: int) -> torch.futures.Future[torch.Tensor]:
    raise AssertionError("never called")


def bad_return_annotation(state: Any, bucket: dist.GradBucket) -> int:
    raise AssertionError("never called")


def one_argument_hook(bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    raise AssertionError("never called")


def returns_tensor_hook(state, bucket):  # hooks may be unannotated
    return bucket.buffer()


def wrong_shape_hook(state, bucket):
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(torch.zeros(3))
    return future


def wrong_dtype_hook(state, bucket):
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer().double())
    return future


def not_a_tensor_hook(state, bucket):
    future: torch.futures.Future = torch.futures.Future()
    future.set_result("gradients")
    return future


def raising_hook(state, bucket):
    raise KeyError("missing compression table")


class Recorder:
    """Hook state that records what each bucket looked like, then averages by allreduce."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []


def recording_hook(state: Recorder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    grads = bucket.gradients()
    params = bucket.parameters()
    state.calls.append(
        {
            "index": bucket.index(),
            "is_last": bucket.is_last(),
            "numel": buffer.numel(),
            "param_shapes": [tuple(p.shape) for p in params],
            "grad_shapes": [tuple(g.shape) for g in grads],
            "grads_are_views": all(g.data_ptr() >= buffer.data_ptr() for g in grads)
            and sum(g.numel() for g in grads) == buffer.numel(),
            "grads_equal_local": all(torch.equal(g, p.grad) for g, p in zip(grads, params, strict=True)),
        }
    )
    replacement = buffer.clone()
    bucket.set_buffer(replacement)
    state.calls[-1]["set_buffer_takes"] = bucket.buffer() is replacement and bucket.gradients()[0].data_ptr() == (
        replacement.data_ptr()
    )
    return _allreduce_average(bucket)


class ReverseUse(nn.Module):
    """Registered first, used last: the observed gradient order differs from the reverse registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(16, 4)
        self.early = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(torch.relu(self.early(x)))


# -- the rank function -----------------------------------------------------------------------------------
def engine_checks() -> dict[str, Any]:
    out: dict[str, Any] = {}
    world = dist.get_world_size()

    # registration-time misuse
    ddp = gradcomm.DistributedDataParallel(_mlp())
    out["not_callable"] = error_text(lambda: ddp.register_comm_hook(None, "allreduce"))
    out["bad_bucket_annotation"] = error_text(lambda: ddp.register_comm_hook(None, bad_bucket_annotation))
    out["bad_return_annotation"] = error_text(lambda: ddp.register_comm_hook(None, bad_return_annotation))
    out["one_argument"] = error_text(lambda: ddp.register_comm_hook(None, one_argument_hook))
    ddp.register_comm_hook(None, first_hook)
    out["twice"] = error_text(lambda: ddp.register_comm_hook(None, second_hook))
    late = gradcomm.DistributedDataParallel(_mlp())
    _backward(late)
    out["after_backward"] = error_text(lambda: late.register_comm_hook(None, first_hook))

    # run-time misuse: each on a fresh DDP, every rank fails the same way, nothing hangs
    for name, hook in [
        ("returns_tensor", returns_tensor_hook),
        ("wrong_shape", wrong_shape_hook),
        ("wrong_dtype", wrong_dtype_hook),
        ("not_a_tensor", not_a_tensor_hook),
        ("raises", raising_hook),
    ]:
        bad = gradcomm.DistributedDataParallel(_mlp())
        bad.register_comm_hook(None, hook)
        out[name] = error_text(lambda bad=bad: _backward(bad))

    # an unused parameter without find_unused_parameters: an error at the next forward, not a hang
    unused = gradcomm.DistributedDataParallel(WithUnused())
    _backward_unused = lambda: nn.functional.mse_loss(unused(_batch()[0]), _batch()[1]).backward()  # noqa: E731
    _backward_unused()
    out["unused_next_forward"] = error_text(_backward_unused)

    # ranks that disagree on the model
    other = nn.Linear(8, 4 if dist.get_rank() == 0 else 5)
    out["shape_mismatch"] = error_text(lambda: gradcomm.DistributedDataParallel(other))

    # future passing: the hook's own future value becomes the gradient
    passing = gradcomm.DistributedDataParallel(_mlp())
    passing.register_comm_hook(None, future_passing_hook)
    _backward(passing)
    out["future_passing"] = all(torch.all(p.grad == 2.0).item() for p in passing.parameters())

    # GradBucket methods and is_last order, across several buckets
    recorder = Recorder()
    recorded = gradcomm.DistributedDataParallel(_mlp(), bucket_cap_mb=0.0001)
    recorded.register_comm_hook(recorder, recording_hook)
    _backward(recorded)  # the first iteration: one bucket (torch's layout), rebuilt at the next forward
    recorder.calls.clear()
    _backward(recorded, 1)
    out["bucket_calls"] = recorder.calls
    out["bucket_count"] = recorded.reducer.bucket_count

    # buckets are rebuilt once, in the order gradients became ready
    rebuilt = gradcomm.DistributedDataParallel(ReverseUse(), bucket_cap_mb=0.0001)
    out["layout_before"] = rebuilt.reducer.bucket_parameter_names()
    for step in range(2):
        _backward(rebuilt, step)
    out["layout_after"] = rebuilt.reducer.bucket_parameter_names()
    # find_unused_parameters: never rebuilt, and a saved layout loads as the same (torch's initial) buckets
    unused = gradcomm.DistributedDataParallel(_mlp(), bucket_cap_mb=0.0001, find_unused_parameters=True)
    for step in range(2):
        _backward(unused, step)
    loaded = gradcomm.DistributedDataParallel(_mlp(), bucket_cap_mb=0.0001, find_unused_parameters=True)
    loaded.reducer.load_bucket_layout(unused.reducer.bucket_layout())
    out["unused_layouts"] = [ddp.reducer.bucket_parameter_names() for ddp in (unused, loaded)]

    # no_sync with a .then-chained hook over many iterations: finite and equal to plain averaging
    out["no_sync_then"] = _no_sync_then_vs_default(world)

    # gradient_as_bucket_view: .grad lives in the bucket, and survives the rebuild
    view = gradcomm.DistributedDataParallel(_mlp(), gradient_as_bucket_view=True)
    for step in range(3):
        view.zero_grad(set_to_none=False)
        _backward(view, step)
    storages = {b.buffer.untyped_storage().data_ptr() for b in view._reducer.layout.buckets}
    out["grad_is_bucket_view"] = all(p.grad.untyped_storage().data_ptr() in storages for p in view.parameters())

    # checkpoints interchange with torch's DDP
    torch_ddp = nn.parallel.DistributedDataParallel(_mlp())
    ours = gradcomm.DistributedDataParallel(_mlp())
    out["same_state_keys"] = list(torch_ddp.state_dict()) == list(ours.state_dict())
    with torch.no_grad():
        for p in torch_ddp.parameters():
            p.add_(1.0)
    ours.load_state_dict(torch_ddp.state_dict())
    out["loads_torch_checkpoint"] = all(
        torch.equal(a, b) for a, b in zip(torch_ddp.parameters(), ours.parameters(), strict=True)
    )

    out.update(_legacy_checks(world))
    return out


def _no_sync_then_vs_default(world: int) -> float:
    chained = gradcomm.DistributedDataParallel(_mlp())
    chained.register_comm_hook(None, then_chained_hook)
    plain = gradcomm.DistributedDataParallel(_mlp())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (chained, plain)]
    worst = 0.0
    for step in range(6):
        for model, opt in zip((chained, plain), opts, strict=True):
            opt.zero_grad()
            for micro in range(3):
                if micro < 2:
                    with model.no_sync():
                        _backward(model, 10 * step + micro)
                else:
                    _backward(model, 10 * step + micro)
        for a, b in zip(chained.parameters(), plain.parameters(), strict=True):
            if not torch.isfinite(a.grad).all():
                return float("nan")
            worst = max(worst, (a.grad - b.grad).abs().max().item())
        for opt in opts:
            opt.step()
    return worst


def _legacy_checks(world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    reference = nn.parallel.DistributedDataParallel(_mlp())
    _backward(reference)
    for use_hook in (False, True):
        legacy = gradcomm.LegacyDistributedDataParallel(_mlp(), world_size=world, buffer_size=300)
        recorder = Recorder()
        if use_hook:
            legacy.register_comm_hook(recorder, recording_hook)
        # accumulate two micro-batches under no_sync, then the explicit reduction
        with legacy.no_sync():
            x, y = _batch()
            nn.functional.mse_loss(legacy(x[:3]), y[:3]).mul(0.5).backward()
            legacy.all_reduce()  # a no-op inside no_sync
        nn.functional.mse_loss(legacy(x[3:]), y[3:]).mul(0.5).backward()
        legacy.all_reduce()
        # mse over 6 rows = average of the two halves' mse; the halves' sum of gradients matches
        out[f"legacy_hook={use_hook}"] = max(
            (a.grad - b.grad).abs().max().item()
            for a, b in zip(legacy.parameters(), reference.parameters(), strict=True)
        )
        if use_hook:
            out["legacy_is_last"] = [call["is_last"] for call in recorder.calls]
            out["legacy_twice"] = error_text(lambda legacy=legacy: legacy.register_comm_hook(None, second_hook))
    return out


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=lambda n: f"world{n}")
def observed(request: pytest.FixtureRequest) -> dict[str, Any]:
    return run_on_ranks(engine_checks, request.param, timeout=180)[0]


MESSAGES = {
    # Each starts with, or contains, the sentence torch's DDP raises, then names the hook and what to do.
    "not_callable": r"TypeError: Communication hook must be callable\. Got str 'allreduce': pass a function "
    r"hook\(state, bucket\)",
    "bad_bucket_annotation": r"ValueError: Communication hook: bucket annotation should be dist\.GradBucket\. Hook "
    r"bad_bucket_annotation's bucket parameter 'bucket' is annotated int: annotate it dist\.GradBucket",
    "bad_return_annotation": r"ValueError: Communication hook: return annotation should be "
    r"torch\.futures\.Future\[torch\.Tensor\]\. Hook bad_return_annotation's return annotation is int: annotate it",
    "one_argument": r"TypeError: Communication hook one_argument_hook: it must accept two positional arguments",
    "twice": r"RuntimeError: register_comm_hook or register_builtin_comm_hook can only be called once\. Hook "
    r"first_hook is already registered on this gradcomm\.DistributedDataParallel, so second_hook cannot be: "
    r"combine them",
    "after_backward": r"RuntimeError: register_comm_hook\(first_hook\) must be called before the first backward",
    "returns_tensor": r"CommHookTypeError: Communication hook returns_tensor_hook returned Tensor on bucket 0; it must "
    r"return a torch\.futures\.Future whose value is the bucket's tensor\. DDP communication hook's callback must "
    r"return a torch\.futures\.Future object, but got torch\.Tensor \(rank \d, step 0\)\. For a tensor computed",
    "wrong_shape": r"CommHookResultError: Communication hook wrong_shape_hook: the future for bucket 0 holds a tensor of "
    r"shape \(3,\) and dtype torch.float32; expected shape \(\d+,\) and dtype torch.float32",
    "wrong_dtype": r"CommHookResultError: Communication hook wrong_dtype_hook: .* dtype torch.float64; expected .* dtype "
    r"torch.float32",
    "not_a_tensor": r"CommHookTypeError: Communication hook not_a_tensor_hook: the future for bucket 0 holds str; "
    r"expected a tensor",
    "raises": r"CommHookError: Communication hook raising_hook raised on bucket 0 \(\d+ elements\): KeyError: "
    r"'missing compression table'",
    "unused_next_forward": r"(?s)RuntimeError: Expected to have finished reduction in the prior iteration before "
    r"starting a new one\. This error indicates that your module has parameters that were not used in producing "
    r"loss\. You can enable unused parameter detection by passing the keyword argument "
    r"`find_unused_parameters=True` .*\nParameters which did not receive grad for rank \d: unused.weight, "
    r"unused.bias\nParameter indices which did not receive grad for rank \d: \d+, \d+\n.*"
    r"the previous backward produced no gradient for 2 parameter\(s\) .*find_unused_parameters=True",
    "shape_mismatch": r"ParameterMismatchError: .*ranks disagree .* Parameter #0 is weight \(4, 8\) torch.float32 on rank 0 but "
    r"weight \(5, 8\) torch.float32 on rank 1",
    "legacy_twice": r"RuntimeError: register_comm_hook or register_builtin_comm_hook can only be called once\. Hook "
    r"recording_hook is already registered on this gradcomm\.LegacyDistributedDataParallel",
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("check", list(MESSAGES))
def test_misuse_message(observed: dict[str, Any], check: str) -> None:
    assert re.search(MESSAGES[check], observed[check]), observed[check]


@pytest.mark.timeout(240)
def test_grad_bucket_methods_and_is_last(observed: dict[str, Any]) -> None:
    calls = observed["bucket_calls"]
    assert observed["bucket_count"] >= 3, "the tiny cap should give several buckets"
    assert [c["index"] for c in calls] == list(range(observed["bucket_count"])), "hooks called in bucket order"
    assert [c["is_last"] for c in calls] == [False] * (len(calls) - 1) + [True]
    for call in calls:
        assert call["param_shapes"] == call["grad_shapes"]
        assert call["numel"] == sum(torch.Size(s).numel() for s in call["param_shapes"])
        assert call["grads_are_views"] and call["grads_equal_local"] and call["set_buffer_takes"]
    # rebuilt in ready order: the last layer's parameters are in bucket 0
    assert calls[0]["param_shapes"][0] in [(4,), (4, 16)]


@pytest.mark.timeout(240)
def test_buckets_rebuilt_in_ready_order(observed: dict[str, Any]) -> None:
    before, after = observed["layout_before"], observed["layout_after"]
    assert len(before) == 1, before  # torch's first iteration: one bucket (test_bucket_layouts_are_torchs)
    assert after[0][0].startswith("late"), after  # `late` is used last in forward: its gradients come first
    assert sorted(sum(before, [])) == sorted(sum(after, []))
    kept, loaded = observed["unused_layouts"]
    assert len(kept) > 1 and loaded == kept, (kept, loaded)


@pytest.mark.timeout(240)
def test_future_passing_and_no_sync_then_hook(observed: dict[str, Any]) -> None:
    assert observed["future_passing"]
    assert observed["no_sync_then"] <= 1e-6, observed["no_sync_then"]


@pytest.mark.timeout(240)
def test_gradient_as_bucket_view_and_checkpoints(observed: dict[str, Any]) -> None:
    assert observed["grad_is_bucket_view"]
    assert observed["same_state_keys"] and observed["loads_torch_checkpoint"]


@pytest.mark.timeout(240)
def test_legacy_ddp(observed: dict[str, Any]) -> None:
    assert observed["legacy_hook=False"] <= 1e-6
    assert observed["legacy_hook=True"] <= 1e-6
    calls = observed["legacy_is_last"]
    assert len(calls) >= 2 and calls == [False] * (len(calls) - 1) + [True]


def test_without_process_group_the_message_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match=r"needs an initialized default process group: call "):
        gradcomm.DistributedDataParallel(nn.Linear(2, 2))


def test_bucket_assignment() -> None:
    params = [torch.empty(n) for n in (10, 10, 10, 100, 10, 10)] + [torch.empty(10, dtype=torch.float64)]
    order = list(reversed(range(len(params))))
    # 40-byte first bucket, then 120-byte buckets; the 400-byte tensor closes the bucket it joins; fp64 apart
    assert assign_buckets(params, order, 40, 120) == [[6], [5], [4, 3], [2, 1, 0]]
    assert assign_buckets(params, order, 200, 200) == [[6], [5, 4, 3], [2, 1, 0]]
    # fairseq's legacy buffers (strict): closed before a tensor that does not fit, a larger one alone
    assert assign_buckets(params, order, 200, 200, strict=True) == [[6], [5, 4], [3], [2, 1, 0]]
    assert bucket_size_limits(None) == (1024 * 1024, 25 * 1024 * 1024)
    assert bucket_size_limits(4) == (4 * 1024 * 1024, 4 * 1024 * 1024)
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive, got 0"):
        bucket_size_limits(0)


_SIZES = st.lists(st.tuples(st.sampled_from([1, 3, 10, 50, 200, 1000]), st.booleans()), min_size=1, max_size=14)
_LIMITS = st.sampled_from([(8, 8), (40, 400), (400, 400), (100, 2000), (4000, 4000)])


@settings(max_examples=300, deadline=None)
@given(sizes=_SIZES, limits=_LIMITS, data=st.data())
def test_bucket_layouts_are_torchs(sizes: list[tuple[int, bool]], limits: tuple[int, int], data: st.DataObject) -> None:
    """Both layouts against torch's own assignment (``dist._compute_bucket_assignment_by_size``): the first
    iteration's, and the rebuild's in a ready order. One dtype: the same buckets in the same order; two: the
    same buckets (torch orders the leftover buckets of several kinds by a hash map)."""
    tensors = [torch.empty(n, dtype=torch.float64 if wide else torch.float32) for n, wide in sizes]
    first, cap = limits
    one_kind = len({t.dtype for t in tensors}) == 1

    def same(theirs: list[list[int]], ours: list[list[int]]) -> bool:
        theirs = [list(bucket) for bucket in theirs]
        return theirs == ours if one_kind else sorted(theirs) == sorted(ours)

    sparse = [False] * len(tensors)
    for one_per_kind in (False, True):
        torch_limits = [sys.maxsize] if one_per_kind else [first, cap]
        theirs, _ = dist._compute_bucket_assignment_by_size(tensors, torch_limits, sparse)
        assert same(theirs[::-1], initial_buckets(tensors, first, cap, one_per_kind=one_per_kind))
    order = data.draw(st.permutations(range(len(tensors))))
    theirs, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], [first, cap], sparse, order)
    assert same(theirs, assign_buckets(tensors, order, first, cap))


class _RecordsMarker(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.marked = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
        return super().forward(x)


def _forward_marker() -> dict[str, Any]:
    loaded_before = "torch._dynamo" in sys.modules
    ddp = gradcomm.DistributedDataParallel(_RecordsMarker(4, 2))
    ddp(torch.ones(3, 4)).sum().backward()
    return {
        "dynamo_loaded": (loaded_before, "torch._dynamo" in sys.modules),
        "marked_during_forward": ddp.module.marked is ddp,
        "cleared_after": torch.nn.parallel.DistributedDataParallel._get_active_ddp_module() is None,
    }


@pytest.mark.timeout(120)
def test_forward_marks_the_ddp_without_loading_dynamo() -> None:
    """torch's marker of an active DDP forward is set for dynamo's DDPOptimizer, but a process that never
    compiles does not pay for importing torch._dynamo (about 1.5 CPU-s) at its first forward."""
    [out] = run_on_ranks(_forward_marker, world_size=1, timeout=100)
    assert out == {"dynamo_loaded": (False, False), "marked_during_forward": True, "cleared_after": True}
