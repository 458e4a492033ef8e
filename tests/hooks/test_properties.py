"""Property: every registered communication hook trains random models correctly on 2 and 3 gloo ranks.

For every hook in the registry (``hook_names()``: a new hook is covered without touching this file) and
random models from :mod:`tests.hooks.property_models` (0-dim scalars used multiplicatively, ``[1]``, ``[1, n]``,
``[n, 1]``, empty parameters, 3-D and 4-D convolution kernels, transposed and channels-last layouts, float64
beside float32, frozen and tied
parameters, a matrix larger than the bucket cap, gradients with a zero column, row or everywhere),
gradcomm's DDP or torch's (the hook registered on either: they are interchangeable) or gradcomm's legacy
DDP, 1 to 3 micro-batches per step (gradients accumulated under ``no_sync()``), sometimes a post-accumulate-grad hook of the user's that
scales ``.grad`` in place by a different factor on every rank (it runs before the reduction, as under torch's
DDP), the hook often wrapped in one carrying per-rank data (a closure over the rank, a string and a tensor
of the rank; a bound method of a callable object holding its rank; a hook defined inside such an object's
method, closing over ``self``), which every DDP must accept (the ranks run the same code), random bucket caps
(0.0001 MB to ``None``), ``gradient_as_bucket_view`` on, off or default (``None``), random hook options, sometimes the fp16 or
bf16 wrapper around the hook, and 3 to 5 SGD steps (with or without momentum), after every synchronised step:

(a) the replicas are bit-identical: the exact bytes of every parameter, and of every averaged gradient,
    are the same on all ranks (compared by SHA-256; a mismatch is then described from the values);
(b) nothing is non-finite: loss, averaged gradients, parameters;
(c) hooks that promise the mean return it: ``allreduce`` and ``allgather`` the true mean of the ranks' local
    gradients to float rounding (1e-6 of the mean absolute gradient, element by element: the summation order
    differs), ``fp16_compress`` and ``bf16_compress`` within their precision, PowerSGD and post-local SGD
    exactly that during their warm-up. ``noop`` and post-local SGD's local phase must hand every rank its
    own local gradient, bit for bit (rounded through 16 bits under a wrapper, whose extra rounding the mean
    tolerances also allow for). Frozen parameters must not change.

Lossy hooks (PowerSGD after warm-up, quantization, sparsification, sign and 1-bit methods) are checked for
(a) and (b) only; hooks that diverge replicas on purpose are exempt from (a) where they do, with the reason
in :data:`DIVERGING`. Warm-up options are set so that compression is really exercised
(``start_powerSGD_iter`` 1 or 2, ``min_numel=1`` for the compression methods), and required options are in
:data:`FIXED_OPTIONS`. Every compression method of :mod:`gradcomm.compression.registry` is classified
:data:`LOSSY` (unless placed in another table) with ``min_numel=1`` fixed (plus its
:data:`COMPRESSION_FIXED_OVERRIDES`); :func:`test_every_hook_is_classified` fails
when any other hook is added to the registry without being placed in one of these tables (it is still run
with checks (a) and (b) meanwhile).

Each hook runs three explicit examples per world size (every model feature at once on gradcomm's DDP, with a
0.0001 MB bucket cap, one parameter per bucket, and with 0.01 MB, several per bucket; and a bucket with no
elements; each with the hook wrapped one of the three per-rank ways) and ``EXAMPLES`` generated ones. With ``GRADCOMM_TEST_DEVICE=cuda`` (and ``_BACKEND``,
``_WORLD_SIZES``: :mod:`tests.support.ranks`) the same runs on CUDA tensors; ``benchmarks/gpu_checks.sh`` does that
on a machine with a GPU.

Speed and determinism: one group of ranks is spawned per world size; inside it every rank runs the same
hypothesis search per hook (a fixed seed per hook and world size, no example database), so all ranks draw the
same examples in the same order. Each example trains on a fresh gloo subgroup with a 10 s timeout, so a hook
that hangs fails that example quickly. Every check is decided on data gathered from all ranks (one
``all_gather_object`` per step), so every rank reaches the same verdict and the ranks stay in lockstep; the
examples' descriptions are compared too. Failures come back to the parent as text naming the hook, world
size, bucket cap, options, model and step, and each hook is its own test case.

Set ``GRADCOMM_PROPERTY_EXAMPLES`` for more generated examples per hook and world size, and
``GRADCOMM_PROPERTY_SHRINK=1`` to have hypothesis shrink the first generated failure of each hook to a minimal
example (slow, and without the explicit examples; the ranks shrink in lockstep because every verdict is
shared).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import hashlib
import os
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, Verbosity, example, given, seed, settings
from hypothesis import strategies as st

import gradcomm
from gradcomm.compression.registry import method_options, methods
from gradcomm.hooks.registry import hook_names, make_comm_hook, resolve_hook_name
from gradcomm.testing import RankError, run_on_ranks
from tests.hooks.property_models import (
    ModelSpec,
    ParamSpec,
    PropertyModel,
    batch,
    full_feature_spec,
    model_specs,
)
from tests.support.ranks import DDP_KINDS, TEST_BACKEND, TEST_DEVICE, make_ddp, world_sizes_to_test

# Gloo on CPU tensors unless GRADCOMM_TEST_DEVICE / _BACKEND / _WORLD_SIZES say otherwise (support.ranks).
DEVICE, BACKEND, WORLD_SIZES = TEST_DEVICE, TEST_BACKEND, world_sizes_to_test()
PROPERTY_DDP_KINDS = (*DDP_KINDS, "legacy")  # torch's, gradcomm's, gradcomm's legacy (see _make_ddp)
# gradient_as_bucket_view per DDP: gradcomm's also takes None (its default); torch's a bool; the legacy DDP
# has no such option (it copies gradients into its buffers)
BUCKET_VIEWS: dict[str, list[bool | None]] = {"gradcomm": [None, True, False], "torch": [True, False], "legacy": [None]}
EXAMPLES = int(os.environ.get("GRADCOMM_PROPERTY_EXAMPLES", "3"))  # generated, per hook and world size
SHRINK = os.environ.get("GRADCOMM_PROPERTY_SHRINK", "") not in ("", "0")
EXAMPLE_TIMEOUT = 10.0  # seconds: the timeout of each example's subgroup
WATCHDOG_SECONDS = 45.0  # an example still running after this long prints its description and stacks
EXPLICIT_EXAMPLES = 3  # per hook and world size: check_hook's @example cases
# seconds per spawned group: 150 at the default examples, more in proportion where more are asked for
RUN_TIMEOUT = (150.0 if not SHRINK else 1200.0) * max(1.0, (EXAMPLES + EXPLICIT_EXAMPLES) / (3 + EXPLICIT_EXAMPLES))
LEARNING_RATE = 0.05
BUCKET_CAPS_MB = (0.0001, 0.001, 0.01, 0.1, None)
FLOAT_RTOL = 1e-6  # allreduce and allgather: float rounding, relative to the mean absolute gradient

# -- what each hook promises --------------------------------------------------------------------------------
# Hooks returning the mean of the ranks' gradients: (relative, absolute) tolerance, per rounding for the
# 16-bit hooks, which round world_size + 1 times (the cast, the sums): fp16 up to 2**-11 of the mean absolute
# gradient, and up to 2**-25 near its subnormals, each time; bf16 2**-8.
MEAN_TOLERANCE: dict[str, tuple[float, float]] = {
    "allreduce": (FLOAT_RTOL, 0.0),
    "allgather": (FLOAT_RTOL, 0.0),
    "fp16_compress": (2**-11, 2**-25),
    "bf16_compress": (2**-8, 0.0),
    # with its defaults (inner allreduce, LOCAL_WORLD_SIZE ranks per node: one node here) an exact average
    "hierarchical": (FLOAT_RTOL, 0.0),
}
ROUNDINGS_SCALE_WITH_WORLD = ("fp16_compress", "bf16_compress")
# The registry's wrappers (``wrapper="fp16"``): 16-bit dtype, relative and absolute error per rounding.
WRAPPER_TOLERANCE: dict[str, tuple[torch.dtype, float, float]] = {
    "fp16": (torch.float16, 2**-11, 2**-24),
    "bf16": (torch.bfloat16, 2**-8, 0.0),
}

# Hooks that average exactly (FLOAT_RTOL) while step < the named option, and are lossy afterwards.
WARMUP_OPTION: dict[str, str] = {
    "powersgd": "start_powerSGD_iter",
    "powersgd_rank2": "start_powerSGD_iter",
    "batched_powersgd": "start_powerSGD_iter",
    "batched_powersgd_rank2": "start_powerSGD_iter",
}

# Lossy hooks: the result is not the mean, but it must be the same on every rank. The compression methods
# are added below.
LOSSY: dict[str, str] = {
    "quantize_per_tensor": "8-bit quantization per tensor",
    "quantize_per_channel": "8-bit quantization per row",
    "auto": "one of its candidates per step (default: fp16, allreduce, PowerSGD rank 4), switching between them",
}

# Hooks exempt from (a), identical replicas, where they diverge on purpose; what they must do instead.
DIVERGING: dict[str, str] = {
    "noop": "no communication at all: every rank trains on its own gradient (checked bit for bit), so the "
    "replicas drift apart after the first step",
    "post_localsgd": "global averaging (checked like allreduce) for start_localSGD_iter steps, then local SGD: "
    "with post_local_gradient_allreduce=False each rank keeps its own gradient (checked bit for bit) and the "
    "replicas drift apart until a model averager (not part of the hook) pulls them together; with True the "
    "gradients are averaged over the intra-node subgroup, which is every rank here, so (a) still holds",
}

# The compression methods of gradcomm.compression.registry, each a hook under its name (a new method is
# covered without an edit here): LOSSY, described by its summary, unless placed in another table above; run
# with _COMPRESSION_FIXED plus its COMPRESSION_FIXED_OVERRIDES in every example.
COMPRESSION_METHODS = methods()
COMPRESSION_FIXED_OVERRIDES: dict[str, dict[str, Any]] = {}
LOSSY.update(
    (name, method.summary)
    for name, method in COMPRESSION_METHODS.items()
    if name not in {*MEAN_TOLERANCE, *WARMUP_OPTION, *DIVERGING}
)

# Options every example of a hook gets: required ones and warm-ups shortened so that compression happens.
_COMPRESSION_FIXED = {"min_numel": 1}
FIXED_OPTIONS: dict[str, dict[str, Any]] = {
    **{name: {"start_powerSGD_iter": 2} for name in WARMUP_OPTION},
    "post_localsgd": {"start_localSGD_iter": 2},
    **{
        name: {**_COMPRESSION_FIXED, **COMPRESSION_FIXED_OVERRIDES.get(name, {})}
        for name in COMPRESSION_METHODS
    },
}


@st.composite
def _powersgd_options(draw: st.DrawFn, hook: str) -> dict[str, Any]:
    start = draw(st.sampled_from([1, 2]))
    options: dict[str, Any] = {
        "start_powerSGD_iter": start,
        # torch's rule: error feedback and warm start need start_powerSGD_iter > 1
        "use_error_feedback": start > 1 and draw(st.booleans()),
        "warm_start": start > 1 and draw(st.booleans()),
        "min_compression_rate": draw(st.sampled_from([0.5, 2.0])),  # 0.5: [1, n] and [n, 1] compressed too
        "batch_tensors_with_same_shape": draw(st.booleans()),
    }
    if not hook.endswith("rank2"):
        options["matrix_approximation_rank"] = draw(st.integers(1, 3))
    return options


def _compression_options(hook: str) -> st.SearchStrategy[dict[str, Any]]:
    extra: dict[str, st.SearchStrategy[Any]] = {"min_compression_rate": st.sampled_from([0.0, 2.0])}
    if any(option.name == "ratio" for option in method_options(COMPRESSION_METHODS[hook])):  # sparsifiers
        extra["ratio"] = st.sampled_from([0.05, 0.5, 1.0])
    return st.fixed_dictionaries(extra)


def option_strategy(hook: str) -> st.SearchStrategy[dict[str, Any]]:
    """Options drawn per example, on top of :data:`FIXED_OPTIONS`."""
    if hook in WARMUP_OPTION:
        return _powersgd_options(hook)
    if hook == "post_localsgd":
        return st.fixed_dictionaries({"post_local_gradient_allreduce": st.booleans()})
    if hook in COMPRESSION_METHODS:
        return _compression_options(hook)
    return st.just({})


@dataclass(frozen=True)
class Expect:
    """What must hold after one step: (a) identical replicas, and (c) what the averaged gradient is:
    ``"mean"`` (within ``rtol`` * mean absolute gradient + ``atol``), ``"local"`` (the rank's own gradient,
    bit for bit, after a round trip through ``rounded_to`` if a wrapper compresses) or ``None`` (not
    checked: lossy)."""

    identical: bool
    reduction: str | None
    rtol: float = 0.0
    atol: float = 0.0
    rounded_to: torch.dtype | None = None


def expected(hook: str, options: dict[str, Any], step: int, world_size: int, wrapper: str | None = None) -> Expect:
    """The promise of ``hook`` with ``options`` for ``step`` (counting from 0), run by ``wrapper``."""
    expect = _hook_promise(hook, options, step, world_size)
    if wrapper is None:
        return expect
    # The wrapper casts the bucket to 16 bits before the hook and back after it: one more rounding, and the
    # hook divides by the world size in 16 bits.
    dtype, rtol, atol = WRAPPER_TOLERANCE[wrapper]
    if expect.reduction == "mean":
        rtol = max(expect.rtol, (world_size + 2) * rtol)
        return Expect(expect.identical, "mean", rtol, max(expect.atol, (world_size + 2) * atol))
    if expect.reduction == "local":
        return Expect(expect.identical, "local", rounded_to=dtype)
    return expect


def _hook_promise(hook: str, options: dict[str, Any], step: int, world_size: int) -> Expect:
    if hook in MEAN_TOLERANCE:
        rtol, atol = MEAN_TOLERANCE[hook]
        if hook in ROUNDINGS_SCALE_WITH_WORLD:
            rtol, atol = (world_size + 1) * rtol, (world_size + 1) * atol
        return Expect(True, "mean", rtol, atol)
    if hook in WARMUP_OPTION:
        warm = step < options[WARMUP_OPTION[hook]]
        return Expect(True, "mean", FLOAT_RTOL) if warm else Expect(True, None)
    if hook == "noop":
        return Expect(False, "local")
    if hook == "post_localsgd":
        if step < options["start_localSGD_iter"] or options.get("post_local_gradient_allreduce", True):
            return Expect(True, "mean", FLOAT_RTOL)
        return Expect(False, "local")
    return Expect(True, None)  # lossy, or a hook not classified yet: the replicas must still agree


class SGD:
    """SGD with momentum, as ``torch.optim.SGD`` computes it (``buf = momentum * buf + grad``, the first
    ``buf`` being the gradient; ``p -= lr * buf``). Written out because constructing any ``torch.optim``
    optimizer first imports ``torch._dynamo``, which costs every spawned rank about 4 s on this machine."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float, momentum: float) -> None:
        self.params = params
        self.lr = lr
        self.momentum = momentum
        self.buffers: dict[int, torch.Tensor] = {}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for index, p in enumerate(self.params):
            if p.grad is None:
                continue
            update = p.grad
            if self.momentum:
                buffer = self.buffers.get(index)
                if buffer is None:
                    buffer = self.buffers[index] = update.clone()
                else:
                    buffer.mul_(self.momentum).add_(update)
                update = buffer
            p.add_(update, alpha=-self.lr)


# -- one example --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One example: a model, the DDP's bucket cap and gradient_as_bucket_view, hook options and wrapper
    (the registry's ``wrapper="fp16"``/``"bf16"``), a number of steps and SGD's momentum."""

    spec: ModelSpec
    bucket_cap_mb: float | None
    options: tuple[tuple[str, Any], ...]
    steps: int
    momentum: float
    bucket_view: bool | None = None
    wrapper: str | None = None
    ddp_kind: str = "gradcomm"
    micro_batches: int = 1  # backward passes per step, all but the last under no_sync()
    user_hook: bool = False  # a post-accumulate-grad hook of the user's scales .grad by user_hook_factor(rank)
    rank_data: str | None = None  # how the hook is wrapped with per-rank data (RANK_DATA_WRAPPERS)

    def describe(self) -> str:
        user = ", a user hook scaling .grad by 0.5 * (1 + rank)" if self.user_hook else ""
        carried = f", the hook wrapped as a {self.rank_data} carrying per-rank data" if self.rank_data else ""
        return (
            f"{self.ddp_kind}'s DDP{user}{carried}, {self.micro_batches} micro-batch(es), bucket_cap_mb={self.bucket_cap_mb}, gradient_as_bucket_view={self.bucket_view}, "
            f"options={dict(self.options)}, wrapper={self.wrapper}, steps={self.steps}, momentum={self.momentum}, "
            f"{self.spec.numel()} elements, {self.spec.describe()}"
        )


@st.composite
def cases(draw: st.DrawFn, hook: str) -> Case:
    cap = draw(st.sampled_from(BUCKET_CAPS_MB))
    spec = draw(model_specs(cap))
    options = {**FIXED_OPTIONS.get(hook, {}), **draw(option_strategy(hook))}
    steps = draw(st.integers(3, 5))
    momentum = draw(st.sampled_from([0.0, 0.9]))
    wrapper = draw(st.sampled_from([None, None, *WRAPPER_TOLERANCE]))
    ddp_kind = draw(st.sampled_from(PROPERTY_DDP_KINDS))
    bucket_view = draw(st.sampled_from(BUCKET_VIEWS[ddp_kind]))
    micro_batches = draw(st.sampled_from([1, 1, 2, 3]))
    user_hook = draw(st.sampled_from([False, False, True]))
    rank_data = draw(st.sampled_from([None, *RANK_DATA_WRAPPERS]))
    return Case(
        spec,
        cap,
        tuple(sorted(options.items())),
        steps,
        momentum,
        bucket_view,
        wrapper,
        ddp_kind,
        micro_batches,
        user_hook,
        rank_data,
    )


def user_hook_factor(rank: int) -> float:
    """What the user's post-accumulate-grad hook multiplies ``.grad`` by on ``rank``: different on every rank,
    so that a DDP that reduced the gradient before the hook ran (or raced it) is seen."""
    return 0.5 * (1 + rank)


def _scaling_hook(factor: float) -> Callable[[torch.Tensor], None]:
    def scale(param: torch.Tensor) -> None:
        param.grad.mul_(factor)

    return scale


# -- hooks carrying per-rank data ---------------------------------------------------------------------------
# The wrapped hooks carry no annotations: torch's register_comm_hook compares them by value, and this module's
# annotations are strings.
class RankHolder:
    """A callable object holding its rank and per-rank data, as an ``nn.Module`` or a ``TestCase`` does,
    whose methods are hooks or define them."""

    def __init__(self, hook: Callable[..., Any], rank: int) -> None:
        self.hook, self.rank, self.tag, self.logged = hook, rank, f"rank {rank}", torch.full((1,), float(rank))

    def __call__(self, *args: Any) -> None:
        return None

    def bound_hook(self, state, bucket):
        return self.hook(state, bucket)

    def make_hook(self) -> Callable[..., Any]:
        def hook_in_method(state, bucket):
            if self.rank == 0 and bucket.is_last():
                self.logged += 1
            return self.hook(state, bucket)

        return hook_in_method


def _rank_closure(hook: Callable[..., Any], rank: int) -> Callable[..., Any]:
    tag, logged = f"rank {rank}", torch.full((1,), float(rank))

    def rank_closure_hook(state, bucket):
        if rank == 0 and tag and bucket.is_last():
            logged.add_(1)
        return hook(state, bucket)

    return rank_closure_hook


RANK_DATA_WRAPPERS: dict[str, Callable[[Callable[..., Any], int], Callable[..., Any]]] = {
    "closure over the rank": _rank_closure,
    "bound method": lambda hook, rank: RankHolder(hook, rank).bound_hook,
    "closure in a method": lambda hook, rank: RankHolder(hook, rank).make_hook(),
}


def explicit_case(hook: str, bucket_cap_mb: float, rank_data: str | None = None) -> Case:
    """The examples every hook runs first: every model feature at once, 4 steps; with a tiny bucket cap
    (every parameter in a bucket of its own) and with a cap that puts several parameters in a bucket."""
    options = dict(FIXED_OPTIONS.get(hook, {}))
    if hook in WARMUP_OPTION:
        options.update(min_compression_rate=0.5, use_error_feedback=True, warm_start=True)
    if hook in COMPRESSION_METHODS:
        options.update(min_compression_rate=0.0)
    if hook == "post_localsgd":
        options.update(post_local_gradient_allreduce=False)
    spec = full_feature_spec(bucket_cap_mb)
    return Case(spec, bucket_cap_mb, tuple(sorted(options.items())), 4, 0.9, rank_data=rank_data)


def empty_bucket_case(hook: str) -> Case:
    """The third example every hook runs: a bucket with no elements. The only float64 parameter is empty, so
    it has a bucket of its own (one per dtype), beside a float32 matrix; 3 steps, past the warm-ups."""
    spec = ModelSpec(params=(ParamSpec((0,), "float64"), ParamSpec((67, 68), zero="column")), tied=(1,), seed=2)
    return replace(explicit_case(hook, 0.01, "bound method"), spec=spec, steps=3)


def _make_ddp(case: Case, model: PropertyModel, group: dist.ProcessGroup) -> torch.nn.Module:
    """The case's DDP: gradcomm's, torch's (the hook registered on it as on gradcomm's), or gradcomm's legacy
    one (an explicit ``all_reduce()`` after backward, the bucket cap as its buffer of float32 elements)."""
    if case.ddp_kind == "legacy":
        buffer = {} if case.bucket_cap_mb is None else {"buffer_size": max(1, int(case.bucket_cap_mb * 2**20 / 4))}
        return gradcomm.LegacyDistributedDataParallel(model, dist.get_world_size(group), group, **buffer)
    return make_ddp(
        case.ddp_kind,
        model,
        process_group=group,
        bucket_cap_mb=case.bucket_cap_mb,
        gradient_as_bucket_view=case.bucket_view,
    )


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _nonfinite(named: list[tuple[str, torch.Tensor | None]]) -> list[str]:
    return [name for name, t in named if t is not None and not bool(torch.isfinite(t).all())]


def _run_step(
    ddp: torch.nn.Module,
    model: PropertyModel,
    optimizer: SGD,
    case: Case,
    step: int,
    expect: Expect,
) -> dict[str, Any]:
    """One training step on this rank; what the checks need, as plain values."""
    rank = dist.get_rank()
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    batches = [
        tuple(t.to(DEVICE) for t in batch(case.spec.seed, rank, step + 1000 * micro))
        for micro in range(case.micro_batches)
    ]
    # each micro-batch's loss divided by their count, as in gradient accumulation: the accumulated gradient
    # keeps one batch's scale (unscaled, 3 micro-batches can take SGD past its stable step size)
    scale = case.micro_batches
    report: dict[str, Any] = {}
    local: list[torch.Tensor] | None = None
    if expect.reduction is not None:
        # autograd.grad does not accumulate into .grad, so the DDP's hooks do not fire; summed in the order
        # .grad accumulates them
        for x, y in batches:
            grads = torch.autograd.grad(F.mse_loss(model(x), y) / scale, [p for _, p in trainable])
            local = list(grads) if local is None else [a + b for a, b in zip(local, grads, strict=True)]
            if case.user_hook:  # after each accumulation, before the reduction (as under torch's DDP)
                local = [g * user_hook_factor(rank) for g in local]
    optimizer.zero_grad()
    for micro, (x, y) in enumerate(batches):
        with ddp.no_sync() if micro < len(batches) - 1 else contextlib.nullcontext():
            loss = F.mse_loss(ddp(x), y) / scale
            loss.backward()
    if case.ddp_kind == "legacy":
        ddp.all_reduce()
    missing = [name for name, p in trainable if p.grad is None]
    if missing:
        raise AssertionError(f"no gradient after backward for {missing}")
    reduced = [p.grad.detach().clone() for _, p in trainable]
    report["nonfinite"] = _nonfinite(
        [("loss", loss.detach())] + [(f"gradient of {name}", g) for (name, _), g in zip(trainable, reduced, strict=True)]
    )
    report["grads"] = [_digest(g) for g in reduced]
    if expect.reduction == "local":
        assert local is not None
        if expect.rounded_to is not None:
            local = [g.to(expect.rounded_to).to(g.dtype) for g in local]
        report["not_local"] = [
            name for (name, _), g, mine in zip(trainable, reduced, local, strict=True) if not torch.equal(g, mine)
        ]
    elif expect.reduction == "mean":
        assert local is not None
        report["local"] = [g.detach().cpu().numpy() for g in local]
        report["reduced"] = [g.cpu().numpy() for g in reduced]
    optimizer.step()
    report["nonfinite"] += _nonfinite([(name, p) for name, p in model.named_parameters()])
    report["params"] = [_digest(p) for _, p in model.named_parameters()]
    return report


def _first_error(reports: list[dict[str, Any]]) -> str | None:
    errors = [(r["error_time"], rank, r["error"]) for rank, r in enumerate(reports) if r.get("error")]
    if not errors:
        return None
    when, rank, text = min(errors)
    others = [f"rank {r}: {t.splitlines()[0]}" for _, r, t in sorted(errors) if r != rank]
    return f"rank {rank} raised:\n{text}" + (("\nthen " + "; ".join(others)) if others else "")


def _mean_failure(reports: list[dict[str, Any]], names: list[str], expect: Expect) -> str | None:
    for index, name in enumerate(names):
        grads = np.stack([np.asarray(r["local"][index], dtype=np.float64) for r in reports])
        mean = grads.mean(axis=0)
        allowed = expect.rtol * np.abs(grads).mean(axis=0) + expect.atol
        for rank, r in enumerate(reports):
            got = np.asarray(r["reduced"][index], dtype=np.float64)
            off = np.abs(got - mean) > allowed
            if off.any():
                worst = np.unravel_index(int(np.argmax(np.abs(got - mean) - allowed)), got.shape) if got.ndim else ()
                return (
                    f"the averaged gradient of {name} {list(got.shape)} ({r['reduced'][index].dtype}) on rank {rank} "
                    f"is not the mean of the ranks' local gradients: {int(off.sum())} of {got.size} elements off "
                    f"by more than {expect.rtol:g} x mean |gradient| + {expect.atol:g}; worst at {list(worst)}: "
                    f"got {got[worst]!r}, mean {mean[worst]!r}, local gradients {grads[(slice(None), *worst)].tolist()}"
                )
    return None


def _difference(tensor: torch.Tensor, what: str) -> str:
    """Gather ``tensor`` from every rank (a collective) and describe how the ranks' values differ."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tensor.detach().cpu().numpy().copy())
    reference = np.asarray(everyone[0], dtype=np.float64)
    lines = [f"{what} {list(tensor.shape)} ({tensor.dtype}) differs between ranks:"]
    for rank, value in enumerate(everyone[1:], start=1):
        value = np.asarray(value, dtype=np.float64)
        differs = value != reference
        if differs.any():
            diff = np.abs(value - reference)
            lines.append(
                f"  rank {rank} vs rank 0: {int(differs.sum())} of {value.size} elements differ, max |diff| "
                f"{float(np.nanmax(diff)):.3g}; first: rank 0 {reference[differs][0]!r}, rank {rank} {value[differs][0]!r}"
            )
    return "\n".join(lines)


def _identity_failure(
    reports: list[dict[str, Any]], ddp_params: list[tuple[str, torch.Tensor]], trainable: list[tuple[str, torch.Tensor]]
) -> str | None:
    """The first gradient or parameter whose bytes differ between ranks, described (collectively)."""
    for index, (name, p) in enumerate(trainable):
        if any(r["grads"][index] != reports[0]["grads"][index] for r in reports):
            assert p.grad is not None
            return _difference(p.grad, f"the averaged gradient of {name}")
    for index, (name, p) in enumerate(ddp_params):
        if any(r["params"][index] != reports[0]["params"][index] for r in reports):
            return _difference(p, f"parameter {name}")
    return None


def _gather(report: dict[str, Any]) -> list[dict[str, Any]]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, report)
    return everyone


@contextmanager
def _watchdog(where: str) -> Iterator[None]:
    """Print ``where`` and every thread's stack to stderr if the block runs longer than WATCHDOG_SECONDS
    (a hang that no collective timeout catches then names its example before the run's timeout kills it)."""

    def report() -> None:
        print(f"rank {dist.get_rank()}: example still running after {WATCHDOG_SECONDS:g} s: {where}", file=sys.stderr)
        faulthandler.dump_traceback(all_threads=True)

    timer = threading.Timer(WATCHDOG_SECONDS, report)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()




def run_case(hook: str, case: Case) -> str | None:
    """Train ``case`` with ``hook`` on a fresh subgroup; the first failed check, the same on every rank."""
    where = f"hook {hook!r}, world size {dist.get_world_size()}, {case.describe()}"
    with _watchdog(where):
        return _run_case(hook, case, where)


def _run_case(hook: str, case: Case, where: str) -> str | None:
    world_size = dist.get_world_size()
    dist.barrier()  # the previous example has ended on every rank
    group = dist.new_group(backend=BACKEND, timeout=datetime.timedelta(seconds=EXAMPLE_TIMEOUT))
    report: dict[str, Any] = {"where": where}
    try:
        model = PropertyModel(case.spec).to(DEVICE)
        ddp = _make_ddp(case, model, group)
        if case.user_hook:
            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(_scaling_hook(user_hook_factor(dist.get_rank())))
        hook_fn, state = make_comm_hook(hook, process_group=group, wrapper=case.wrapper, **dict(case.options))
        if case.rank_data is not None:
            hook_fn = RANK_DATA_WRAPPERS[case.rank_data](hook_fn, dist.get_rank())
        ddp.register_comm_hook(state, hook_fn)
        optimizer = SGD(list(model.parameters()), LEARNING_RATE, case.momentum)
        frozen = {name: _digest(p) for name, p in model.named_parameters() if not p.requires_grad}
    except Exception:
        report.update(error=traceback.format_exc(), error_time=time.time())
    reports = _gather(report)
    if any(r["where"] != where for r in reports):
        return f"{where}: the ranks ran different examples ({[r['where'] for r in reports]}): lockstep lost"
    error = _first_error(reports)
    if error is not None:
        return f"{where}\nsetting up the DDP and the hook failed: {error}"
    named = list(model.named_parameters())
    trainable = [(name, p) for name, p in named if p.requires_grad]
    for step in range(case.steps):
        expect = expected(hook, dict(case.options), step, world_size, case.wrapper)
        try:
            report = _run_step(ddp, model, optimizer, case, step, expect)
        except Exception:
            report = {"error": traceback.format_exc(), "error_time": time.time()}
        reports = _gather(report)
        failure = _first_error(reports)
        if failure is None:
            bad = [(rank, r["nonfinite"]) for rank, r in enumerate(reports) if r["nonfinite"]]
            if bad:
                failure = "non-finite values: " + "; ".join(f"rank {rank}: {names}" for rank, names in bad)
        if failure is None and expect.reduction == "local":
            bad = [(rank, r["not_local"]) for rank, r in enumerate(reports) if r["not_local"]]
            if bad:
                failure = "the gradient is not the rank's own local gradient: " + "; ".join(
                    f"rank {rank}: {names}" for rank, names in bad
                )
        if failure is None and expect.reduction == "mean":
            failure = _mean_failure(reports, [name for name, _ in trainable], expect)
        if failure is None and expect.identical:
            failure = _identity_failure(reports, named, trainable)
        if failure is None:
            changed = [name for name, p in named if name in frozen and _digest(p) != frozen[name]]
            if changed:
                failure = f"frozen parameters changed: {changed}"
        if failure is not None:
            return f"{where}\nafter step {step} (counting from 0): {failure}"
    dist.destroy_process_group(group)
    return None


# -- the search on every rank ---------------------------------------------------------------------------------
def check_hook(hook: str, examples: int, shrink: bool) -> dict[str, Any]:
    """Run the explicit examples and ``examples`` generated ones for ``hook``; the failures, as text."""
    failures: list[str] = []
    ran = 0
    start = time.monotonic()
    # Shrinking starts from a generated failure (hypothesis does not shrink explicit examples).
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.explicit, Phase.generate]

    @seed(zlib.crc32(f"{hook}/{dist.get_world_size()}".encode()))
    @settings(
        database=None,
        deadline=None,
        max_examples=examples,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
        print_blob=False,
    )
    @example(case=explicit_case(hook, 0.0001, "closure over the rank"))
    @example(case=explicit_case(hook, 0.01, "closure in a method"))
    @example(case=empty_bucket_case(hook))
    @given(case=cases(hook))
    def property_holds(case: Case) -> None:
        nonlocal ran
        ran += 1
        failure = run_case(hook, case)
        if failure is not None:
            failures.append(failure)
            if shrink:  # every rank fails alike, so hypothesis shrinks in lockstep; the last failure is minimal
                raise AssertionError(failure)

    try:
        property_holds()
    except AssertionError:
        if not shrink:
            raise
    return {"examples": ran, "failures": failures, "seconds": round(time.monotonic() - start, 1)}


def check_every_hook(hooks: list[str], examples: int, shrink: bool) -> dict[str, dict[str, Any]]:
    """Runs on every rank of the spawned group."""
    torch.manual_seed(0)
    results = {}
    for hook in hooks:
        try:
            results[hook] = check_hook(hook, examples, shrink)
        except Exception:  # a bug of this module (not of a hook): reported per hook, the others still run
            results[hook] = {"examples": 0, "failures": [f"hook {hook!r}: the search raised:\n{traceback.format_exc()}"]}
        dist.barrier()
    return results


# -- the tests --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def property_results() -> dict[int, list[dict[str, dict[str, Any]]] | RankError]:
    """Each world size's group, spawned once for all hooks; a failed run is reported by every hook's test."""
    results: dict[int, list[dict[str, dict[str, Any]]] | RankError] = {}
    for world_size in WORLD_SIZES:
        try:
            results[world_size] = run_on_ranks(
                check_every_hook,
                world_size,
                args=(hook_names(), EXAMPLES, SHRINK),
                backend=BACKEND,
                timeout=RUN_TIMEOUT,
                collective_timeout=60.0,
            )
        except RankError as exc:
            results[world_size] = exc
    return results


def test_every_hook_is_classified() -> None:
    """A hook added to the registry must be placed in a table here, saying what it promises."""
    tables = {
        "MEAN_TOLERANCE": MEAN_TOLERANCE,
        "WARMUP_OPTION": WARMUP_OPTION,
        "LOSSY": LOSSY,
        "DIVERGING": DIVERGING,
    }
    for hook in hook_names():
        homes = [table for table, entries in tables.items() if hook in entries]
        assert homes, (
            f"hook {hook!r} is in the registry but not classified in tests/hooks/test_properties.py: add it to "
            "MEAN_TOLERANCE (returns the mean), WARMUP_OPTION (exact, then lossy), LOSSY (identical replicas "
            "only) or DIVERGING (replicas drift on purpose, with the reason); until then it is checked for "
            "identical replicas and finite values only"
        )
        assert len(homes) == 1, f"hook {hook!r} is classified twice: {homes}"
    stale = {hook for table in (*tables.values(), FIXED_OPTIONS) for hook in table} - set(hook_names())
    assert not stale, f"tests/hooks/test_properties.py classifies hooks the registry no longer has: {sorted(stale)}"


def test_required_and_warmup_options_are_set() -> None:
    """Required options, and warm-ups that would leave compression unexercised, are set explicitly."""
    for hook in hook_names():
        spec = resolve_hook_name(hook).value
        needed = [o.name for o in spec.options if o.required or o.name.startswith("start_")]
        unset = [name for name in needed if name not in FIXED_OPTIONS.get(hook, {})]
        assert not unset, f"hook {hook!r}: set {unset} in FIXED_OPTIONS of tests/hooks/test_properties.py"
        if "min_numel" in spec.option_names:
            assert FIXED_OPTIONS[hook]["min_numel"] == 1, f"hook {hook!r}: compress every tensor (min_numel=1)"


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)  # the first test runs both spawned groups
@pytest.mark.parametrize("hook", hook_names())
def test_hook_keeps_replicas_identical_finite_and_averaged(
    hook: str, property_results: dict[int, list[dict[str, dict[str, Any]]] | RankError]
) -> None:
    failures: list[str] = []
    for world_size, outcome in property_results.items():
        if isinstance(outcome, RankError):
            raise outcome
        by_rank = [{key: ranks[hook][key] for key in ("examples", "failures")} for ranks in outcome]
        assert all(r == by_rank[0] for r in by_rank[1:]), (
            f"{hook!r}, world size {world_size}: the ranks reached different verdicts (lockstep lost): {by_rank}"
        )
        result = by_rank[0]
        if not result["failures"]:
            assert result["examples"] >= EXAMPLES + (0 if SHRINK else 2), f"{hook!r}: only {result['examples']} examples ran"
        if SHRINK and len(result["failures"]) > 1:
            result["failures"] = [result["failures"][0], "minimal example:\n" + result["failures"][-1]]
        failures += result["failures"]
    assert not failures, f"{len(failures)} failed example(s) for hook {hook!r}:\n\n" + "\n\n".join(failures)
