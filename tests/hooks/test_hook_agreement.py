"""The ranks' hooks must agree on their code, not on the data they carry (``describe_hook``).

A hook that closes over per-rank data (its rank, a rank-specific string or tensor, a logger holding its rank),
or is defined inside a method of a callable object holding its rank (an ``nn.Module``, a ``unittest.TestCase``),
runs the same collectives on every rank: torch's DDP accepts it, and so must gradcomm's. Hooks whose reachable
code differs (``Wrapper(allreduce_hook)`` on one rank, ``Wrapper(fp16_compress_hook)`` on another) launch
different collectives and are refused with the same ``RanksDisagreeError`` on every rank.

Hooks are built from a recipe: a leaf hook (per rank: the same one, or a different one on rank 0) wrapped in
layers (closure, ``functools.partial``, callable object, bound method, closure inside a method, a list held by
a callable object), each layer carrying per-rank data of one kind. In one process the descriptions are compared
for ranks 0..2 (many recipes, cheap); on 2 and 3 gloo ranks, a few recipes are registered for real, on torch's
DDP and on gradcomm's, and trained.

No ``from __future__ import annotations``: torch's ``register_comm_hook`` compares a hook's annotations by
value, so the hooks here carry none.
"""

import datetime
import functools
import hashlib
import traceback
import zlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, Verbosity, example, given, seed, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks

import gradcomm
from gradcomm.hooks import default_hooks
from gradcomm.hooks.contract import replicas_may_differ
from gradcomm.hooks.debugging_hooks import noop_hook
from gradcomm.hooks.fingerprint import describe_hook
from gradcomm.hooks.post_localSGD_hook import post_localSGD_hook
from gradcomm.testing import run_on_ranks
from tests.support.ranks import error_text


# -- leaves: hooks whose code decides the collectives -------------------------------------------------------
def mean_hook(state, bucket):
    """A user's allreduce: divide, sum over ``state`` (the process group), take the tensor."""
    tensors = [bucket.buffer() / state.size()]
    return state.allreduce(tensors).get_future().then(lambda fut: fut.value()[0])


LEAVES = {
    "allreduce": torch_hooks.allreduce_hook,
    "fp16_compress": torch_hooks.fp16_compress_hook,
    "mean_hook": mean_hook,
}


# -- per-rank data -----------------------------------------------------------------------------------------
class RankNote:
    """A callable object carrying per-rank data (a logger, a metric): reached from a hook, it is code like any
    callable, but its attributes are data."""

    def __init__(self, rank: int) -> None:
        self.rank, self.prefix, self.count = rank, f"[rank {rank}]", torch.full((2,), float(rank))

    def __call__(self, *args: Any) -> None:
        self.count += 1


def per_rank_data(kind: str, rank: int) -> Any:
    return {
        "int": rank,
        "str": f"rank {rank} of the group",
        "tensor": torch.full((3,), float(rank)),
        "callable": RankNote(rank),
    }[kind]


DATA_KINDS = ("int", "str", "tensor", "callable")


# -- layers: how a hook is wrapped ---------------------------------------------------------------------------
def closure_over(inner, data):
    def closure_hook(state, bucket):
        if data is None or bucket.index() in {-1, "never", "an index", "frozenset constant"}:
            raise AssertionError("unreachable: a branch on the per-rank data, and a frozenset constant")
        return inner(state, bucket)

    return closure_hook


def _hook_with_options(state, bucket, *, inner, data):
    return inner(state, bucket)


class CallableWrapper:
    """A hook as a callable object around another hook, holding per-rank data."""

    def __init__(self, inner: Any, data: Any, rank: int) -> None:
        self.inner, self.data, self.rank = inner, data, rank

    def __call__(self, state, bucket):
        return self.inner(state, bucket)


class HookHolder:
    """A callable object holding its rank (as an ``nn.Module`` or a ``TestCase`` does) whose methods are hooks
    or define them."""

    def __init__(self, inner: Any, data: Any, rank: int) -> None:
        self.inner, self.data, self.rank, self.note = inner, data, rank, RankNote(rank)

    def __call__(self, *args: Any) -> None:
        return None

    def hook(self, state, bucket):
        return self.inner(state, bucket)

    def make_hook(self):
        def hook_in_method(state, bucket):
            if self.rank == 0 and bucket.is_last():
                self.note(bucket.index())
            return self.inner(state, bucket)

        return hook_in_method


class HookList:
    """A callable object keeping its hooks in a list."""

    def __init__(self, inner: Any, data: Any, rank: int) -> None:
        self.hooks, self.data, self.rank = [inner], data, rank

    def __call__(self, state, bucket):
        return self.hooks[0](state, bucket)


LAYERS = {
    "closure": lambda inner, data, rank: closure_over(inner, data),
    "partial": lambda inner, data, rank: functools.partial(_hook_with_options, inner=inner, data=data),
    "object": CallableWrapper,
    "method": lambda inner, data, rank: HookHolder(inner, data, rank).hook,
    "closure_in_method": lambda inner, data, rank: HookHolder(inner, data, rank).make_hook(),
    "list": HookList,
}
# torch's DDP reads hook.__name__: the outermost layer must be a function or a bound method
REGISTRABLE = ("closure", "method", "closure_in_method")


@dataclass(frozen=True)
class Recipe:
    """A leaf hook wrapped in ``layers`` (innermost first: layer kind, kind of per-rank data). With
    ``other_leaf``, rank 0 uses ``leaf`` and every other rank ``other_leaf``: their code differs."""

    leaf: str
    layers: tuple[tuple[str, str], ...]
    other_leaf: str | None = None

    def build(self, rank: int) -> Any:
        hook = LEAVES[self.other_leaf if self.other_leaf and rank > 0 else self.leaf]
        for layer, data_kind in self.layers:
            hook = LAYERS[layer](hook, per_rank_data(data_kind, rank), rank)
        return hook

    def leaves(self) -> set[str]:
        return {self.leaf, self.other_leaf or self.leaf}


@st.composite
def recipes(draw: st.DrawFn, differing: bool | None = None) -> Recipe:
    leaf = draw(st.sampled_from(sorted(LEAVES)))
    inner = draw(st.lists(st.tuples(st.sampled_from(sorted(LAYERS)), st.sampled_from(DATA_KINDS)), max_size=3))
    outer = (draw(st.sampled_from(REGISTRABLE)), draw(st.sampled_from(DATA_KINDS)))
    differ = draw(st.booleans()) if differing is None else differing
    other = draw(st.sampled_from(sorted(set(LEAVES) - {leaf}))) if differ else None
    return Recipe(leaf, (*inner, outer), other)


# The issue's examples: a closure over the rank, a hook defined in a method of a callable object holding its
# rank, Wrapper(allreduce) against Wrapper(fp16), a closure holding allreduce on one rank and fp16 on another.
RANK_CLOSURE = Recipe("allreduce", (("closure_in_method", "int"),))
TEST_CASE_LIKE = Recipe("mean_hook", (("object", "tensor"), ("closure_in_method", "callable")))
WRAPPERS_DIFFER = Recipe("allreduce", (("object", "int"), ("closure", "str")), other_leaf="fp16_compress")
CLOSURES_DIFFER = Recipe("allreduce", (("closure", "int"),), other_leaf="fp16_compress")


def _leaf_name(leaf: str) -> str:
    return LEAVES[leaf].__qualname__


# -- in one process: the descriptions ------------------------------------------------------------------------
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(recipe=recipes(), world_size=st.sampled_from([2, 3]))
def test_descriptions_agree_exactly_when_the_code_does(recipe: Recipe, world_size: int) -> None:
    described = [describe_hook(recipe.build(rank)) for rank in range(world_size)]
    assert all(text == described[1] for text in described[1:]), described  # ranks > 0 build the same code
    if recipe.other_leaf is None:
        assert described[0] == described[1], described
    else:
        assert described[0] != described[1], described
    for rank, text in enumerate(described):
        assert _leaf_name(recipe.other_leaf if recipe.other_leaf and rank else recipe.leaf) in text, text
        assert f"rank {rank}" not in text and "tensor(" not in text, text  # no data in the fingerprint


def _issue_hook(rank: int, logged: list[int]):
    """The issue's example: a closure over the rank, logging on rank 0 only."""

    def hook(state, bucket):
        if rank == 0 and bucket.is_last():
            logged.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    return hook


def test_the_issues_rank_closure_is_described_without_the_rank() -> None:
    described = [describe_hook(_issue_hook(rank, [])) for rank in (0, 1)]
    assert described[0] == described[1], described
    assert described[0].startswith("tests.hooks.test_hook_agreement._issue_hook.<locals>.hook@"), described


def test_code_that_differs_under_one_name_is_told_apart() -> None:
    """Two lambdas of one function share their qualified name; the hash of their code tells them apart."""
    first, second = (
        lambda state, bucket: torch_hooks.allreduce_hook(state, bucket),
        lambda state, bucket: torch_hooks.fp16_compress_hook(state, bucket),
    )
    assert first.__qualname__ == second.__qualname__
    assert describe_hook(first) != describe_hook(second)
    assert describe_hook(first) == describe_hook(lambda state, bucket: torch_hooks.allreduce_hook(state, bucket))


def test_dtypes_decide_what_is_sent() -> None:
    fp16 = describe_hook(default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook))
    bf16 = describe_hook(default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook))
    assert "dtype=torch.float16" in fp16 and "dtype=torch.bfloat16" in bf16


def test_cycles_depth_and_builtins() -> None:
    looped = CallableWrapper(None, 0, 0)
    looped.inner = looped
    text = describe_hook(looped)
    module = "tests.hooks.test_hook_agreement"
    assert text.startswith(f"{module}.CallableWrapper(inner={module}.CallableWrapper@")
    deep = mean_hook
    for _ in range(50):
        deep = closure_over(deep, 1)
    assert describe_hook(deep).count("closure_hook") <= 17  # depth 16, then names only
    assert describe_hook(print) == "builtins.print"
    assert describe_hook(torch_hooks.allreduce_hook) == (
        "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook"
    )
    assert describe_hook(None) == "default allreduce (no hook registered)"


# -- on 2 and 3 ranks: registration and training, on torch's DDP and gradcomm's --------------------------------
EXAMPLES = 4  # generated per world size, beside the 4 explicit ones
EXAMPLE_TIMEOUT = datetime.timedelta(seconds=10)
STEPS = 2


def _train(ddp_class: type, hook: Any, group: dist.ProcessGroup) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    ddp = ddp_class(model, process_group=group, bucket_cap_mb=0.0001)  # several buckets: is_last() varies
    ddp.register_comm_hook(group, hook)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(STEPS):
        ddp(torch.randn(4, 6, generator=generator)).square().mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    return [p.detach().clone() for p in model.parameters()]


def _gather(value: Any, group: dist.ProcessGroup) -> list[Any]:
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def _digest(params: list[torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()


def _agreeing(recipe: Recipe, group: dist.ProcessGroup) -> str | None:
    """Same code, per-rank data: both DDPs register and train it alike; the replicas stay identical."""
    ours = _train(gradcomm.DistributedDataParallel, recipe.build(dist.get_rank()), group)
    theirs = _train(nn.parallel.DistributedDataParallel, recipe.build(dist.get_rank()), group)
    # fp16 sums round in an order that follows the bucket sizes
    rtol, atol = (2e-3, 1e-4) if recipe.leaf == "fp16_compress" else (1e-6, 1e-7)
    torch.testing.assert_close(ours, theirs, rtol=rtol, atol=atol, msg=lambda m: f"against torch's DDP: {m}")
    digests = _gather(_digest(ours), group)
    return None if len(set(digests)) == 1 else f"the replicas differ after {STEPS} steps: {digests}"


def _differing(recipe: Recipe, group: dist.ProcessGroup) -> str | None:
    """Code that differs: every rank raises the same RanksDisagreeError naming both hooks, and the DDP then
    trains on every rank with the default allreduce."""
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    ddp = gradcomm.DistributedDataParallel(model, process_group=group)
    text = error_text(lambda: ddp.register_comm_hook(group, recipe.build(dist.get_rank())))
    texts = _gather(text, group)
    if len(set(texts)) != 1 or not text.startswith("RanksDisagreeError: ") or "hook differs" not in text:
        return f"expected the same RanksDisagreeError on every rank, got {texts}"
    missing = [leaf for leaf in recipe.leaves() if _leaf_name(leaf) not in text]
    if missing:
        return f"the error does not name {missing}: {text}"
    ddp(torch.randn(3, 6) + dist.get_rank()).sum().backward()
    digests = _gather(_digest([p.grad for p in model.parameters()]), group)
    return None if len(set(digests)) == 1 else f"after the refusal, the default allreduce left {digests}"


def _run_example(recipe: Recipe) -> str | None:
    dist.barrier()
    group = dist.new_group(backend="gloo", timeout=EXAMPLE_TIMEOUT)
    try:
        return (_differing if recipe.other_leaf else _agreeing)(recipe, group)
    except Exception:
        return traceback.format_exc()


def check_on_ranks(examples: int) -> dict[str, Any]:
    """Runs on every rank: the same recipes in the same order (a fixed seed), failures as text."""
    failures: list[str] = []
    ran: list[Recipe] = []

    @seed(zlib.crc32(f"hook agreement/{dist.get_world_size()}".encode()))
    @settings(
        database=None,
        deadline=None,
        max_examples=examples,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
    )
    @example(recipe=RANK_CLOSURE)
    @example(recipe=TEST_CASE_LIKE)
    @example(recipe=WRAPPERS_DIFFER)
    @example(recipe=CLOSURES_DIFFER)
    @given(recipe=recipes())
    def holds(recipe: Recipe) -> None:
        ran.append(recipe)
        failure = _run_example(recipe)
        if failure is not None:
            failures.append(f"{recipe}, rank {dist.get_rank()}: {failure}")

    holds()
    return {"ran": [str(r) for r in ran], "failures": failures}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_hooks_agree_on_code_on_ranks(world_size: int) -> None:
    results = run_on_ranks(check_on_ranks, world_size, args=(EXAMPLES,), timeout=170)
    assert all(r["ran"] == results[0]["ran"] for r in results), "the ranks ran different recipes"
    assert len(results[0]["ran"]) >= 4 + EXAMPLES // 2, results[0]["ran"]
    assert any("other_leaf=None" in r for r in results[0]["ran"]) and any("other_leaf='" in r for r in results[0]["ran"])
    failures = [failure for r in results for failure in r["failures"]]
    assert not failures, "\n\n".join(failures)


class _HookOwner:
    """A ``unittest.TestCase``- or ``LightningModule``-like owner whose methods wrap a hook."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def wrapped_noop(self, state: Any, bucket: Any) -> Any:
        return noop_hook(state, bucket)

    def closure_over_post_local(self) -> Any:
        def hook(state: Any, bucket: Any) -> Any:
            return post_localSGD_hook(state, bucket)

        return hook


def test_wrapped_hooks_keep_their_replicas_may_differ_declaration() -> None:
    """A hook that leaves replicas different keeps saying so when a method wraps it by calling it (the DDP's
    replica check would otherwise raise ParameterDriftError on local SGD); allreduce wrapped alike does not."""
    owner = _HookOwner(rank=1)

    class Started:
        iter, start_localSGD_iter = 5, 2

    assert replicas_may_differ(owner.wrapped_noop, None)
    assert replicas_may_differ(owner.closure_over_post_local(), Started())
    assert not replicas_may_differ(lambda state, bucket: default_hooks.allreduce_hook(state, bucket), None)
