"""Behaviour checks mirroring torch's CPU/gloo DDP tests in ``test_c10d_gloo.py`` and ``test_c10d_common.py``.

Those two files are not installed with torch, so this module restates, in its own code, what their DDP and
communication-hook cases check (``tests/torch_suite/test_c10d_behaviours.py`` maps each check to the torch
cases it mirrors), with two hook cases of ``test_c10d_nccl.py`` and one case of ``distributed_test.py`` whose
behaviour does not depend on CUDA. A check is a scenario ``run(ddp_class, process_group) -> observation`` run twice in the
same rank: once with torch's ``DistributedDataParallel`` (the reference) and once with gradcomm's, each time
on a fresh process group with the same seeds and data. A check passes on a rank when

* torch's DDP shows the behaviour torch's test asserts (otherwise the check itself is wrong: ``reference``),
* gradcomm's DDP shows it too: the same exception type with torch's message fragment where torch's test
  asserts an error, and otherwise no error and the same observation (gradients, parameters, buffers:
  torch's tolerance ``rtol=1.3e-6, atol=5e-5``; sparse gradients compared coalesced).

:func:`run_checks` is the rank function: it runs the named checks one after the other and returns one
outcome line per check, so one spawned group serves them all. Every check has its own process group with a
short timeout, so a check that leaves collectives unmatched fails alone instead of blocking the rest.

No ``from __future__ import annotations`` here: torch's ``register_comm_hook`` compares a hook's annotations
with ``dist.GradBucket`` and ``Future[Tensor]`` by value, and string annotations would fail that check.
"""

import copy
import datetime
import os
import random
import tempfile
import traceback
import unittest
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import gradcomm

RTOL, ATOL = 1.3e-6, 5e-5
CHECK_GROUP_TIMEOUT = datetime.timedelta(seconds=15)
"""Timeout of each check's own process group: a check that leaves a collective unmatched fails after this."""

PASS = "pass"
REFERENCE = "reference"
"""Prefix of an outcome in which torch's own DDP did not behave as torch's test asserts (a bug in the check)."""

Observation = dict[str, Any]
Scenario = Callable[[type, dist.ProcessGroup], Observation]


@dataclass(frozen=True)
class Check:
    """One behaviour: the scenario, and the error torch's test expects from it (type, message fragment)."""

    run: Scenario
    raises: tuple[type[BaseException], str] | None = None


def _rank() -> int:
    return dist.get_rank()


def _world() -> int:
    return dist.get_world_size()


def _grads(module: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _assert_close(expected: Any, actual: Any, what: str) -> None:
    """Equal structure; tensors close at torch's test tolerance (sparse ones coalesced); other values equal."""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            raise AssertionError(f"{what}: expected {_describe(expected)}, got {_describe(actual)}")
        if expected.is_sparse != actual.is_sparse:
            raise AssertionError(f"{what}: expected {_describe(expected)}, got {_describe(actual)}")
        if expected.is_sparse:
            expected, actual = expected.coalesce().to_dense(), actual.coalesce().to_dense()
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    elif isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        if len(expected) != len(actual):
            raise AssertionError(f"{what}: expected {len(expected)} entries, got {len(actual)}")
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _assert_close(e, a, f"{what}[{i}]")
    elif isinstance(expected, dict) and isinstance(actual, dict):
        if expected.keys() != actual.keys():
            raise AssertionError(f"{what}: expected keys {sorted(expected)}, got {sorted(actual)}")
        for key in expected:
            _assert_close(expected[key], actual[key], f"{what}.{key}")
    elif expected != actual:
        raise AssertionError(f"{what}: expected {expected!r}, got {actual!r}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        layout = "sparse" if value.is_sparse else "dense"
        return f"a {layout} {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value)


# -- models (own definitions, shaped like the ones torch's tests use) -------------------------------------


class ThreeLayer(nn.Module):
    """Three bias-free linear layers, softmax output: 2 -> 10 -> 50 -> 4."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 10, bias=False)
        self.b = nn.Linear(10, 50, bias=False)
        self.c = nn.Linear(50, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.c(torch.relu(self.b(torch.relu(self.a(x))))), dim=1)


class TwoLayerSpare(nn.Module):
    """Two used linear layers and, with ``spare=True``, a third one that never takes part."""

    def __init__(self, spare: bool) -> None:
        super().__init__()
        self.a = nn.Linear(2, 10, bias=False)
        self.b = nn.Linear(10, 4, bias=False)
        if spare:
            self.unused = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(torch.relu(self.b(torch.relu(self.a(x)))), dim=1)


class Offset(nn.Module):
    """``x + p`` with ``p`` a 2x2 parameter of ones."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(2, 2))

    def forward(self, x: Any) -> torch.Tensor:
        return x + self.p


class RankShifted(nn.Module):
    """``Offset`` applied to ``x + rank``: each rank's gradient of the mean is 0.25 everywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Offset()

    def forward(self, x: Any, rank: int) -> torch.Tensor:
        return self.inner(x + rank)


class PerRankTask(nn.Module):
    """Rank 0 uses ``first``, the other ranks ``second``; ``never`` is used by no rank."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.never = Offset(), Offset(), Offset()

    def forward(self, x: Any, rank: int) -> torch.Tensor:
        return self.first(x) if rank == 0 else self.second(x)


class ChainOnRankZero(nn.Module):
    """Rank 0 uses both offsets in a chain, the other ranks only ``second``."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Offset(), Offset()

    def forward(self, x: Any, rank: int) -> torch.Tensor:
        return self.second(self.first(x)) if rank == 0 else self.second(x)


class SparseBag(nn.Module):
    """An ``EmbeddingBag`` with sparse gradients (10 entries of width 10), softmax output."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 10, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.bag(x), dim=1)


class Checkpointed(nn.Module):
    """Two 20x20 linear layers; ``second`` runs under ``torch.utils.checkpoint`` ``times`` times.

    ``tie=True`` shares ``first.weight`` with ``second.weight``; ``alternate=True`` checkpoints ``first`` on odd
    calls and ``second`` on even ones, each on the input (a module whose used parameters change per call).
    """

    def __init__(self, reentrant: bool, times: int = 1, tie: bool = False, alternate: bool = False) -> None:
        super().__init__()
        self.first = nn.Linear(20, 20)
        self.second = nn.Linear(20, 20)
        if tie:
            self.first.weight = self.second.weight
        self.reentrant, self.times, self.alternate = reentrant, times, alternate
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.alternate:
            layer = self.first if self.calls % 2 else self.second
            self.calls += 1
            return checkpoint(layer, x, use_reentrant=self.reentrant)
        x = self.first(x)
        for _ in range(self.times):
            x = checkpoint(self.second, x, use_reentrant=self.reentrant)
        return x


@dataclass
class PairOutput:
    """A dataclass output: an optional tensor and a dict of tensors."""

    single: torch.Tensor | None
    named: dict[str, torch.Tensor]


class DataclassOut(nn.Module):
    """Returns :class:`PairOutput`; with ``skip_single=True`` the ``left`` stack takes no part."""

    def __init__(self, skip_single: bool) -> None:
        super().__init__()
        self.left = nn.Sequential(*[nn.Linear(10, 10) for _ in range(3)])
        self.right = nn.Sequential(*[nn.Linear(10, 10) for _ in range(3)])
        self.skip_single = skip_single

    def forward(self, x: torch.Tensor) -> PairOutput:
        single = None if self.skip_single else torch.relu(self.left(x))
        return PairOutput(single=single, named={"plain": self.right(x), "relu": torch.relu(self.right(x))})


class MixedState(nn.Module):
    """Parameters and buffers of several dtypes, for the construction broadcast."""

    def __init__(self) -> None:
        super().__init__()
        self.single = nn.Linear(6, 5)
        self.double = nn.Linear(5, 3).double()
        self.register_buffer("counts", torch.zeros(4, dtype=torch.int64))
        self.register_buffer("scale", torch.zeros(7, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.double(self.single(x).double())


# -- scenarios ---------------------------------------------------------------------------------------------


def _matches_local_training(gradient_as_bucket_view: bool) -> Scenario:
    """A DDP of 1-sample shards with tiny buckets tracks one process training on the whole batch."""

    def run(ddp_class: type, group: dist.ProcessGroup) -> Observation:
        torch.manual_seed(2024)
        local = ThreeLayer()
        ddp = ddp_class(
            copy.deepcopy(local),
            process_group=group,
            bucket_cap_mb=0.001,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
        batch, target = torch.randn(_world(), 2), torch.randn(_world(), 4)
        seen = []
        for step in range(2):
            for model, x, y in ((local, batch, target), (ddp, batch[_rank()], target[_rank()])):
                F.mse_loss(model(x.reshape(-1, 2)), y.reshape(-1, 4)).backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= p.grad
                        p.grad = None
            _assert_close(_params(local), _params(ddp.module), f"parameters after step {step}")
            seen.append(_params(ddp.module))
            torch.manual_seed(77 + step)
            order = torch.randperm(_world())
            batch, target = batch[order], target[order]
        return {"parameters": seen}

    return run


def _ignored_output(spare: bool) -> Scenario:
    """Forwards whose outputs are dropped without backward, then ordinary training steps."""

    def run(ddp_class: type, group: dist.ProcessGroup) -> Observation:
        torch.manual_seed(5)
        ddp = ddp_class(TwoLayerSpare(spare), process_group=group, find_unused_parameters=spare)
        generator = torch.Generator().manual_seed(100 + _rank())
        x = torch.rand(4, 2, generator=generator)
        target = torch.randint(0, 4, (4,), generator=generator)
        for _ in range(4):
            out = ddp(x)
            del out
        grads = []
        for _ in range(4):
            F.cross_entropy(ddp(x), target).backward()
            grads.append(_grads(ddp.module))
        return {"grads": grads}

    return run


class HookTestCase(unittest.TestCase):
    """Shaped, as far as its hooks see it, like the ``MultiProcessTestCase`` of torch's hook tests: a callable
    object holding this rank's ``rank``, its ``world_size`` and the process group. torch's tests define their
    hooks inside its methods (capturing ``self``, which differs on every rank) or register its bound methods;
    both DDPs must accept those hooks, as they carry the same code on every rank."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()  # "runTest": a TestCase built outside a test runner
        self.rank, self.world_size, self.process_group = _rank(), _world(), group

    def _get_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def _simple_hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """torch's ``_simple_hook``: a completed future of ones, then ``+ 1``."""
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(torch.ones_like(bucket.buffer()))

        def fut_then(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            t = fut.value()
            return t + torch.ones_like(t)

        return fut.then(fut_then)

    def allreduce_hook_gloo(self) -> Callable[..., torch.futures.Future[torch.Tensor]]:
        """test_ddp_comm_hook_sparse_gradients's hook: allreduce, then divide by ``self.world_size``."""
        process_group = self._get_process_group()

        def allreduce_hook_gloo(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            def div_by_world_size(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
                return fut.wait()[0] / self.world_size

            fut = process_group.allreduce([bucket.buffer()]).get_future()
            return fut.then(div_by_world_size)

        return allreduce_hook_gloo

    def allreduce_hook(self) -> Callable[..., torch.futures.Future[torch.Tensor]]:
        """test_ddp_comm_hook_allreduce_hook_nccl's hook: divide by ``self.world_size``, allreduce, take the
        future's tensor."""
        process_group = self._get_process_group()

        def allreduce_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            tensors = [bucket.buffer() / self.world_size]
            return process_group.allreduce(tensors).get_future().then(lambda fut: fut.value()[0])

        return allreduce_hook

    def allreduce_with_then_hook(self) -> Callable[..., torch.futures.Future[torch.Tensor]]:
        """test_ddp_comm_hook_allreduce_with_then_hook_nccl's hook: as :meth:`allreduce_hook`, then two
        ``then`` callbacks multiplying by 10 and by 0.5."""
        process_group = self._get_process_group()

        def allreduce_with_then_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            tensors = [bucket.buffer() / self.world_size]
            fut = process_group.allreduce(tensors).get_future()

            def mult(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
                return 10 * fut.value()[0]

            def div(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                return 0.5 * fut.value()

            return fut.then(mult).then(div)

        return allreduce_with_then_hook


def _sparse(gradient_as_bucket_view: bool = False, with_hook: bool = False) -> Scenario:
    """Sparse ``EmbeddingBag`` gradients of half batches, averaged, equal the full batch's on one process;
    ``with_hook``: through :meth:`HookTestCase.allreduce_hook_gloo`."""

    def run(ddp_class: type, group: dist.ProcessGroup) -> Observation:
        torch.manual_seed(1337)
        local = SparseBag()
        ddp = ddp_class(copy.deepcopy(local), process_group=group, gradient_as_bucket_view=gradient_as_bucket_view)
        if with_hook:
            ddp.register_comm_hook(None, HookTestCase(group).allreduce_hook_gloo())
        half = 2
        x = torch.randint(0, 10, (half * _world(), 2))
        target = torch.randint(0, 10, (half * _world(),))
        F.cross_entropy(local(x), target).backward()
        part = slice(_rank() * half, (_rank() + 1) * half)
        F.cross_entropy(ddp(x[part]), target[part]).backward()
        grad = ddp.module.bag.weight.grad
        if grad is None or not grad.is_sparse:
            raise AssertionError(f"the DDP's EmbeddingBag gradient should be sparse, got {_describe(grad)}")
        _assert_close(local.bag.weight.grad, grad, "sparse gradient against one process on the full batch")
        return {"grad": grad.coalesce()}

    return run


def _test_case_hook(make: Callable[[HookTestCase], Any], expected: float) -> Scenario:
    """torch's ``_run_and_verify_hook``: a hook of a :class:`HookTestCase` on ``RankShifted``; one backward
    of the output's mean (each rank's gradient is 0.25 everywhere) must leave ``expected`` everywhere."""

    def run(ddp_class: type, group: dist.ProcessGroup) -> Observation:
        case = HookTestCase(group)
        ddp = ddp_class(RankShifted(), process_group=case._get_process_group())
        ddp.register_comm_hook(None, make(case))
        ddp(8, case.rank).mean().backward()
        grads = _grads(ddp.module)
        _assert_close([expected * torch.ones(2, 2)] * len(grads), grads, "gradients after the hook")
        return {"grads": grads}

    return run


# torch's expected fragments of the unused-parameter error, as torch/testing/_internal/distributed/
# distributed_test.py names them (that module needs torch's own launcher's environment to import).
DDP_PREV_REDUCTION_UNFINISHED = "Expected to have finished reduction in the prior iteration"
DDP_RECOMMEND_FIND_UNUSED_PARAMS = "passing the keyword argument `find_unused_parameters=True`"
DDP_FIND_UNUSED_PARAMS_ENABLED = "Since `find_unused_parameters=True` is enabled"
DDP_OUTPUTS_NOT_USED_IN_LOSS = "`forward` function outputs participate in calculating loss"
DDP_SUGGEST_DEBUG_MODE = "set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL"


class UnusedSecond(nn.Module):
    """torch's ToyModel of that test: ``net2`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10, bias=False)
        self.net2 = nn.Linear(10, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net1(x)


def _unused_parameter_error(ddp_class: type, group: dist.ProcessGroup) -> Observation:
    """A model with an unused parameter and no ``find_unused_parameters``: the second iteration's forward
    raises a RuntimeError carrying every fragment torch's test_ddp_unused_params_rebuild_buckets_exception
    expects, with torch's debug level OFF (a hint at TORCH_DISTRIBUTED_DEBUG) and INFO (the parameter's
    name); every rank raises, then meets the others at a barrier."""
    observed = {}
    before = dist.get_debug_level()
    try:
        for level in (dist.DebugLevel.OFF, dist.DebugLevel.INFO):
            dist.set_debug_level(level)
            ddp = ddp_class(UnusedSecond(), process_group=group)
            ddp(torch.rand(1, 10)).sum().backward()
            try:
                ddp(torch.rand(1, 10)).sum().backward()
            except RuntimeError as exc:
                message, kind = str(exc), type(exc).__name__
            else:
                raise AssertionError(f"debug level {level}: no error at the second iteration")
            expected = [
                DDP_PREV_REDUCTION_UNFINISHED,
                DDP_RECOMMEND_FIND_UNUSED_PARAMS,
                DDP_OUTPUTS_NOT_USED_IN_LOSS,
                f"Parameter indices which did not receive grad for rank {_rank()}: 1",
                DDP_SUGGEST_DEBUG_MODE
                if level == dist.DebugLevel.OFF
                else f"did not receive grad for rank {_rank()}: net2.weight",
            ]
            missing = [fragment for fragment in expected if fragment not in message]
            if missing or DDP_FIND_UNUSED_PARAMS_ENABLED in message:
                raise AssertionError(f"debug level {level}: the message lacks {missing}: {message!r}")
            observed[str(level)] = kind
    finally:
        dist.set_debug_level(before)
    dist.barrier(group=group)
    return observed


def _register(hook: Any) -> Scenario:
    def run(ddp_class: type, group: dist.ProcessGroup) -> Observation:
        ddp_class(RankShifted(), process_group=group).register_comm_hook(state=None, hook=hook)
        return {}

    return run


def _bucket_annotated_int(state: object, bucket: int) -> torch.futures.Future[torch.Tensor]:
    return torch.futures.Future()


def _returns_annotated_int(state: object, bucket: dist.GradBucket) -> int:
    return 0


def _returns_one(state: object, bucket: dist.GradBucket):  # no return annotation: the check is at backward
    return 1


def _hook_returning_non_future(ddp_class: type, group: dist.ProcessGroup) -> Observation:
    ddp = ddp_class(RankShifted(), process_group=group)
    ddp.register_comm_hook(None, _returns_one)
    ddp(8, _rank()).mean().backward()
    return {}


def _completed_buffer(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _register_twice(ddp_class: type, group: dist.ProcessGroup) -> Observation:
    ddp = ddp_class(RankShifted(), process_group=group)
    ddp.register_comm_hook(None, _completed_buffer)
    ddp.register_comm_hook(None, _completed_buffer)
    return {}


def _global_local_unused(**options: Any) -> Scenario:
    """A parameter no rank uses keeps ``grad=None``; ones some ranks use get gradients on every rank."""

    def run(ddp_class: type, group: dist.ProcessGroup) -> Observation:
        ddp = ddp_class(PerRankTask(), process_group=group, find_unused_parameters=True, **options)
        out = ddp(8, _rank())
        if any(g is not None for g in _grads(ddp.module)):
            raise AssertionError("gradients should all be None before the first backward")
        out.mean().backward()
        inner = ddp.module
        if inner.first.p.grad is None or inner.second.p.grad is None:
            raise AssertionError("a parameter used on some rank has no gradient after backward")
        if inner.never.p.grad is not None:
            raise AssertionError("the parameter no rank uses got a gradient; it should stay None")
        return {"grads": _grads(inner)}

    return run


def _unused_on_some_ranks(ddp_class: type, group: dist.ProcessGroup) -> Observation:
    """Rank 0 uses every parameter, the others do not: with find_unused_parameters all get gradients."""
    ddp = ddp_class(ChainOnRankZero(), process_group=group, find_unused_parameters=True)
    out = ddp(8, _rank())
    out.mean().backward()
    grads = _grads(ddp.module)
    if any(g is None for g in grads):
        raise AssertionError("every parameter is used on rank 0, so every rank should have every gradient")
    return {"grads": grads}


def _state_dict_resume(ddp_class: type, group: dist.ProcessGroup) -> Observation:
    """Save the DDP's state_dict on rank 0, reload it on every rank (DDP and plain module): training resumes
    exactly where an uninterrupted run would be."""
    torch.manual_seed(11)
    resumed, reference = TwoLayerSpare(spare=False), TwoLayerSpare(spare=False)
    for model in (resumed, reference):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    ddp_resumed = ddp_class(resumed, process_group=group)
    ddp_reference = ddp_class(reference, process_group=group)
    generator = torch.Generator().manual_seed(300 + _rank())
    x, target = torch.rand(4, 2, generator=generator), torch.randint(0, 4, (4,), generator=generator)

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            F.cross_entropy(model(x), target).backward()
            optimizer.step()

    opt_resumed = torch.optim.SGD(ddp_resumed.parameters(), lr=0.1)
    opt_reference = torch.optim.SGD(ddp_reference.parameters(), lr=0.1)
    train(ddp_resumed, opt_resumed, 3)
    with tempfile.TemporaryDirectory() as folder:
        shared = [os.path.join(folder, "ddp.pt")]
        dist.broadcast_object_list(shared, src=0, group=group)
        if _rank() == 0:
            torch.save(ddp_resumed.state_dict(), shared[0])
        dist.barrier(group=group)
        saved = torch.load(shared[0], weights_only=True)
        dist.barrier(group=group)  # rank 0 removes the folder only when every rank has read the file
    plain = TwoLayerSpare(spare=False)
    with torch.no_grad():
        for p in list(ddp_resumed.parameters()) + list(plain.parameters()):
            p.zero_()
    ddp_resumed.load_state_dict(saved)
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(saved, "module.")
    plain.load_state_dict(saved)
    train(ddp_resumed, opt_resumed, 3)
    train(ddp_reference, opt_reference, 6)
    _assert_close(_params(reference), _params(resumed), "resumed DDP against 6 uninterrupted steps")
    return {"parameters": _params(resumed), "loaded_plain": _params(plain)}


def _activation_checkpointing(
    build: Callable[[], nn.Module],
    *,
    static_graph: bool = False,
    find_unused_parameters: bool = False,
    whole_model: bool = False,
    whole_reentrant: bool = True,
    allow_none_grads: bool = False,
) -> Scenario:
    """Five steps with ``torch.utils.checkpoint`` inside (or around) the model, with and without
    gradient_as_bucket_view: the DDP's gradients on its half batch equal one process's on the full batch."""

    def run(ddp_class: type, group: dist.ProcessGroup) -> Observation:
        torch.manual_seed(31415)
        template = build()
        grads = []
        for bucket_view in (False, True):
            local = copy.deepcopy(template)
            options = {"static_graph": True} if static_graph else {}
            ddp = ddp_class(
                copy.deepcopy(template),
                process_group=group,
                bucket_cap_mb=1,
                gradient_as_bucket_view=bucket_view,
                find_unused_parameters=find_unused_parameters,
                **options,
            )
            generator = torch.Generator().manual_seed(9)
            x = torch.rand(16 * _world(), 20, generator=generator, requires_grad=True)
            target = torch.randn(16 * _world(), 20, generator=generator)
            part = slice(16 * _rank(), 16 * (_rank() + 1))
            for step in range(5):
                for model, xs, ys in ((local, x, target), (ddp, x[part], target[part])):
                    model.zero_grad(set_to_none=False)
                    out = checkpoint(model, xs, use_reentrant=whole_reentrant) if whole_model else model(xs)
                    F.mse_loss(out, ys).backward()
                for a, b in zip(local.parameters(), ddp.module.parameters(), strict=True):
                    if not allow_none_grads and (a.grad is None or b.grad is None):
                        raise AssertionError(f"step {step}: a parameter has no gradient")
                _assert_close(_grads(local), _grads(ddp.module), f"bucket view {bucket_view}, step {step}")
            grads.append(_grads(ddp.module))
        return {"grads": grads}

    return run


def _two_forwards_one_backward(ddp_class: type, group: dist.ProcessGroup) -> Observation:
    """Two forwards (buffers broadcast before each) then one backward through both outputs, with BatchNorm."""
    torch.manual_seed(21)
    ddp = ddp_class(nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10)), process_group=group)
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(40 + _rank()))
    ddp.zero_grad()
    first, second = ddp(x), ddp(x)
    (first.mean() + second.mean()).backward()
    return {"grads": _grads(ddp.module), "buffers": [b.clone() for b in ddp.module.buffers()]}


def _dataclass_output(skip_single: bool) -> Scenario:
    """A module returning a dataclass holding a tensor (or None) and a dict of tensors, under
    find_unused_parameters: gradients equal one process's on the full batch."""

    def run(ddp_class: type, group: dist.ProcessGroup) -> Observation:
        torch.manual_seed(0)
        local = DataclassOut(skip_single)
        ddp = ddp_class(copy.deepcopy(local), process_group=group, find_unused_parameters=True)
        full = torch.cat([torch.ones(4, 10) * r for r in range(_world())])
        mine = torch.ones(4, 10) * _rank()

        def loss(out: PairOutput) -> torch.Tensor:
            total = out.named["plain"] + out.named["relu"]
            if out.single is not None:
                total = total + out.single
            return F.mse_loss(total, torch.ones_like(total))

        loss(local(full)).backward()
        loss(ddp(mine)).backward()
        _assert_close(_grads(local), _grads(ddp.module), "gradients against one process on the full batch")
        return {"grads": _grads(ddp.module)}

    return run


def _invalid_powersgd_state(ddp_class: type, group: dist.ProcessGroup) -> Observation:
    """PowerSGD state with error feedback or warm start and ``start_powerSGD_iter <= 1`` is refused."""
    if ddp_class is TorchDDP:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
    else:
        from gradcomm.hooks.powerSGD_hook import PowerSGDState
    refused = []
    for start in (0, 1):
        for error_feedback, warm_start in ((True, True), (True, False), (False, True)):
            try:
                PowerSGDState(
                    process_group=None,
                    matrix_approximation_rank=1,
                    start_powerSGD_iter=start,
                    use_error_feedback=error_feedback,
                    warm_start=warm_start,
                )
            except ValueError as exc:
                refused.append(str(exc))
            else:
                refused.append("accepted")
    fragment = "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled"
    wrong = [m for m in refused if fragment not in m]
    if wrong:
        raise AssertionError(f"expected ValueError containing {fragment!r}; got {wrong[0]!r}")
    return {}


def _bucket_layout(params: list[tuple[int, torch.dtype]], bucket_cap_mb: float | None) -> Scenario:
    """Which parameters share a bucket, by size limit and dtype, as a hook sees them once the buckets were
    rebuilt in gradient-ready order (second step). The first step is not compared: torch 2.13 reduces it in
    one bucket per dtype, in registration order, gradcomm already in size-limited buckets."""

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.ParameterList([nn.Parameter(torch.ones(n, dtype=dtype)) for n, dtype in params])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return sum((w.sum() * x).sum().float() for w in self.weights)

    def run(ddp_class: type, group: dist.ProcessGroup) -> Observation:
        module = Flat()
        names = {id(p): i for i, p in enumerate(module.parameters())}
        seen: list[dict[int, list[int]]] = [{}, {}]
        step = [0]

        def record(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            seen[step[0]][bucket.index()] = [names[id(p)] for p in bucket.parameters()]
            work = group.allreduce([bucket.buffer()])
            return work.get_future().then(lambda fut: fut.value()[0] / _world())

        options = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        ddp = ddp_class(module, process_group=group, **options)
        ddp.register_comm_hook(None, record)
        for iteration in range(2):
            step[0] = iteration
            ddp(torch.ones(1)).backward()
        return {"buckets_after_rebuild": [bucket for _, bucket in sorted(seen[1].items())]}

    return run


def _construction_broadcast(ddp_class: type, group: dist.ProcessGroup) -> Observation:
    """Construction copies rank 0's parameters and buffers (float32, float64, int64) to every rank."""
    torch.manual_seed(500 + _rank())
    module = MixedState()
    with torch.no_grad():
        module.counts.copy_(torch.arange(4) + 10 * _rank())
        module.scale.uniform_()
    ddp_class(module, process_group=group)
    state = [t.detach().clone() for t in list(module.parameters()) + list(module.buffers())]
    everyone: list[Any] = [None] * _world()
    dist.all_gather_object(everyone, state, group=group)
    for rank, theirs in enumerate(everyone):
        _assert_close(everyone[0], theirs, f"rank {rank}'s parameters and buffers against rank 0's")
    return {"state": state}


def _checkpointed(reentrant: bool, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: Checkpointed(reentrant, **kwargs)


def _tied_pair() -> nn.Module:
    first, second = nn.Linear(20, 20), nn.Linear(20, 20)
    first.weight = second.weight
    return nn.Sequential(first, second)


_MARK_TWICE = (RuntimeError, "Expected to mark a variable ready only once.")

CHECKS: dict[str, Check] = {
    "cpu_module_matches_local_training": Check(_matches_local_training(False)),
    "cpu_module_matches_local_training_grad_is_view": Check(_matches_local_training(True)),
    "ignored_output": Check(_ignored_output(spare=False)),
    "ignored_output_with_unused_parameters": Check(_ignored_output(spare=True)),
    "sparse_gradients": Check(_sparse()),
    "sparse_gradients_grad_is_view": Check(_sparse(gradient_as_bucket_view=True)),
    "sparse_gradients_with_allreduce_hook": Check(_sparse(with_hook=True)),
    "hook_future_then_value_becomes_gradient": Check(_test_case_hook(lambda case: case._simple_hook, 2.0)),
    "hook_in_test_case_allreduce_future": Check(_test_case_hook(HookTestCase.allreduce_hook, 0.25)),
    "hook_in_test_case_allreduce_with_then": Check(_test_case_hook(HookTestCase.allreduce_with_then_hook, 1.25)),
    "hook_not_callable_type_error": Check(_register(1), (TypeError, "Communication hook must be callable.")),
    "hook_bucket_annotation_value_error": Check(
        _register(_bucket_annotated_int), (ValueError, "bucket annotation should be dist.GradBucket.")
    ),
    "hook_return_annotation_value_error": Check(
        _register(_returns_annotated_int),
        (ValueError, "Communication hook: return annotation should be torch.futures.Future"),
    ),
    "hook_returning_non_future_runtime_error": Check(
        _hook_returning_non_future, (RuntimeError, "callback must return a torch.futures.Future object, but got")
    ),
    "hook_registered_twice_runtime_error": Check(
        _register_twice,
        (RuntimeError, "register_comm_hook or register_builtin_comm_hook can only be called once."),
    ),
    "globally_unused_grad_none_locally_unused_reduced": Check(_global_local_unused()),
    "globally_unused_grad_none_locally_unused_reduced_grad_is_view": Check(
        _global_local_unused(gradient_as_bucket_view=True)
    ),
    "globally_unused_grad_none_locally_unused_reduced_static_graph": Check(_global_local_unused(static_graph=True)),
    "unused_on_some_ranks_used_on_others_all_reduced": Check(_unused_on_some_ranks),
    "state_dict_save_load_resumes_exactly": Check(_state_dict_resume),
    "checkpointing_once": Check(_activation_checkpointing(_checkpointed(True))),
    "checkpointing_once_non_reentrant": Check(_activation_checkpointing(_checkpointed(False))),
    "checkpointing_once_static_graph": Check(_activation_checkpointing(_checkpointed(True), static_graph=True)),
    "checkpointing_once_static_graph_find_unused": Check(
        _activation_checkpointing(_checkpointed(True), static_graph=True, find_unused_parameters=True)
    ),
    "checkpointing_unused_params_reentrant_runtime_error": Check(
        _activation_checkpointing(_checkpointed(True), find_unused_parameters=True), _MARK_TWICE
    ),
    "checkpointing_unused_params_non_reentrant": Check(
        _activation_checkpointing(_checkpointed(False), find_unused_parameters=True)
    ),
    "checkpointing_unused_params_static_graph": Check(
        _activation_checkpointing(_checkpointed(True), find_unused_parameters=True, static_graph=True)
    ),
    "checkpointing_twice_reentrant_runtime_error": Check(
        _activation_checkpointing(_checkpointed(True, times=2)), _MARK_TWICE
    ),
    "checkpointing_twice_reentrant_find_unused_runtime_error": Check(
        _activation_checkpointing(_checkpointed(True, times=2), find_unused_parameters=True), _MARK_TWICE
    ),
    "checkpointing_twice_non_reentrant": Check(
        _activation_checkpointing(_checkpointed(False, times=2), find_unused_parameters=True)
    ),
    "checkpointing_twice_static_graph": Check(
        _activation_checkpointing(_checkpointed(True, times=2), static_graph=True)
    ),
    "checkpointing_dynamic_module": Check(
        _activation_checkpointing(
            _checkpointed(False, alternate=True), find_unused_parameters=True, allow_none_grads=True
        )
    ),
    "checkpointing_dynamic_weight_sharing": Check(
        _activation_checkpointing(
            _checkpointed(False, alternate=True, tie=True), find_unused_parameters=True, allow_none_grads=True
        )
    ),
    "checkpointing_whole_model_weight_sharing": Check(
        _activation_checkpointing(_tied_pair, whole_model=True, whole_reentrant=True)
    ),
    "checkpointing_whole_model_weight_sharing_non_reentrant": Check(
        _activation_checkpointing(_tied_pair, whole_model=True, whole_reentrant=False)
    ),
    "checkpointing_whole_model_weight_sharing_static_graph": Check(
        _activation_checkpointing(_tied_pair, whole_model=True, static_graph=True)
    ),
    "checkpointing_twice_weight_sharing_static_graph": Check(
        _activation_checkpointing(_checkpointed(True, times=2, tie=True), static_graph=True)
    ),
    "two_forwards_one_backward_batchnorm_buffers": Check(_two_forwards_one_backward),
    "dataclass_output": Check(_dataclass_output(skip_single=False)),
    "dataclass_output_unused_param": Check(_dataclass_output(skip_single=True)),
    "invalid_powersgd_state_value_error": Check(_invalid_powersgd_state),
    "bucket_assignment_single_limit_single_dtype": Check(
        _bucket_layout([(100, torch.float32), (200, torch.float32), (100, torch.float32), (50, torch.float32)], 400e-6)
    ),
    "bucket_assignment_single_limit_multi_dtype": Check(
        _bucket_layout([(50, torch.float32), (25, torch.float64)] * 3, 400e-6)
    ),
    "bucket_assignment_default_limits_first_bucket_smaller": Check(
        _bucket_layout([(150_000, torch.float32)] * 4 + [(60_000, torch.float64)] * 3, None)
    ),
    "construction_broadcasts_rank0_state_mixed_dtypes": Check(_construction_broadcast),
    "unused_parameter_second_iteration_runtime_error": Check(_unused_parameter_error),
}


# -- running -----------------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _attempt(check: Check, ddp_class: type) -> tuple[Observation | None, BaseException | None]:
    group = dist.new_group(backend="gloo", timeout=CHECK_GROUP_TIMEOUT)
    random.seed(1000 + _rank())
    torch.manual_seed(1000)
    try:
        return check.run(ddp_class, group), None
    except Exception as exc:  # the outcome under test
        exc.__traceback__ = None
        return None, exc


def _judge(check: Check) -> str:
    reference, reference_error = _attempt(check, TorchDDP)
    observed, error = _attempt(check, gradcomm.DistributedDataParallel)
    if check.raises is not None:
        kind, fragment = check.raises
        if not (isinstance(reference_error, kind) and fragment in str(reference_error)):
            got = "no error" if reference_error is None else _first_line(reference_error)
            return f"{REFERENCE}: torch's DDP should raise {kind.__name__}({fragment!r}), got {got}"
        if error is None:
            return f"no error; torch's DDP raises {kind.__name__}: {fragment}"
        if not isinstance(error, kind):
            return f"raises {_first_line(error)}; torch's DDP raises {kind.__name__}: {fragment}"
        if fragment not in str(error):
            return f"{kind.__name__} lacks torch's message {fragment!r}: {_first_line(error)}"
        return PASS
    if reference_error is not None:
        return f"{REFERENCE}: torch's DDP failed: {_first_line(reference_error)}"
    if error is not None:
        return _first_line(error)
    try:
        _assert_close(reference, observed, "observation against torch's DDP")
    except AssertionError as exc:
        return _first_line(exc)
    return PASS


def run_checks(names: list[str]) -> dict[str, str]:
    """Rank function: run the named checks in order; one outcome line per check (``pass`` or what failed)."""
    torch.set_num_threads(1)
    outcomes = {}
    for name in names:
        try:
            outcomes[name] = _judge(CHECKS[name])
        except Exception:  # a failure outside the scenarios (group creation): report, go on
            outcomes[name] = "harness: " + traceback.format_exc().strip().splitlines()[-1]
    return outcomes


__all__ = ["CHECKS", "PASS", "REFERENCE", "Check", "run_checks"]
