"""The communication-hook contract, checked the same way by every gradcomm DDP.

``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``: the hook is called once per bucket and
iteration, and its future must complete with a tensor of the bucket buffer's shape and dtype. These
functions check a hook when it is registered and its future when it completes, and turn every violation
into one error naming the hook, the bucket and what was expected.

A hook that raises, or whose future fails for a reason of its own, gives :class:`CommHookError` with the
original exception chained; a failure caused by a lost peer gives :class:`~gradcomm.comm.faults.PeerLostError`.

What else a hook or its state may declare (replicas that differ on purpose, a fingerprint, a report, a
checkpoint) is described in :mod:`gradcomm.hooks.protocols`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, get_args, get_origin

import torch
import torch.distributed as dist

from gradcomm.comm.faults import is_communication_failure, lost_contact, rank_and_step
from gradcomm.errors import GradcommError
from gradcomm.hooks.grad_bucket import GradBucket

__all__ = [
    "DEFAULT_HOOK_NAME",
    "CommHookError",
    "CommHookResultError",
    "CommHookTypeError",
    "call_hook",
    "check_hook",
    "declares_replicas_may_differ",
    "hook_name",
    "hook_result",
    "replicas_may_differ",
]

DEFAULT_HOOK_NAME = "default allreduce (no hook registered)"

CommHook = Callable[[Any, "GradBucket | dist.GradBucket"], torch.futures.Future[torch.Tensor]]
"""A communication hook: ``hook(state, bucket)`` returning a future of the bucket's reduced tensor."""

_BUCKET_TYPES = (GradBucket, dist.GradBucket)
_BUCKET_TYPE_NAMES = ("GradBucket", "dist.GradBucket", "gradcomm.GradBucket", "torch.distributed.GradBucket")
_FUTURE_TYPE_NAMES = ("Future", "torch.futures.Future", "Future[torch.Tensor]", "torch.futures.Future[torch.Tensor]")
_SPARSE_HINT = (
    "a sparse bucket: torch's DDP hands sparse gradients (nn.Embedding(sparse=True)) to hooks too, so the hook must "
    "handle a sparse buffer, or use no hook"
)
"""What a hook failure on a sparse bucket says: the likely cause and what to do."""


class CommHookError(GradcommError, RuntimeError):
    """A communication hook raised, or its future failed, on a bucket.

    A ``RuntimeError``, as what torch's DDP raises for these, so ``except RuntimeError`` written for torch
    catches it; the subclasses below are also the ``TypeError``/``ValueError`` gradcomm raised before.
    """


class CommHookTypeError(CommHookError, TypeError):
    """A hook returned something other than a future, or its future held something other than a tensor."""


class CommHookResultError(CommHookError, ValueError):
    """A hook's future held a tensor of another shape or dtype than the bucket's buffer."""


def hook_name(hook: Callable[..., Any]) -> str:
    """A readable name for ``hook``: its qualified name, seeing through ``functools.partial``."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    return getattr(hook, "__qualname__", None) or type(hook).__qualname__


def check_hook(hook: Any) -> None:
    """Check at registration that ``hook`` can be called as ``hook(state, bucket)`` and is annotated right.

    Each message starts with the sentence torch's ``DistributedDataParallel._check_comm_hook`` raises (same
    exception type), so code matching torch's wording matches gradcomm's, and goes on to name the hook.
    """
    if not callable(hook):
        raise TypeError(
            f"Communication hook must be callable. Got {type(hook).__name__} {hook!r}: pass a function "
            "hook(state, bucket) -> torch.futures.Future[torch.Tensor], such as "
            "gradcomm.hooks.default_hooks.allreduce_hook"
        )
    name = hook_name(hook)
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to inspect
    try:
        bound = signature.bind(None, None)
    except TypeError as exc:
        raise TypeError(
            f"Communication hook {name}: it must accept two positional arguments (state, bucket), but its "
            f"signature is {signature} ({exc})"
        ) from None
    bucket_parameter = signature.parameters[list(bound.arguments)[-1]]
    annotation = bucket_parameter.annotation
    if annotation is not inspect.Parameter.empty and not _is_bucket_type(annotation):
        raise ValueError(
            f"Communication hook: bucket annotation should be dist.GradBucket. Hook {name}'s bucket parameter "
            f"{bucket_parameter.name!r} is annotated {_describe(annotation)}: annotate it dist.GradBucket (or "
            "gradcomm.GradBucket), or leave it unannotated"
        )
    returned = signature.return_annotation
    if returned is not inspect.Signature.empty and not _is_future_type(returned):
        raise ValueError(
            "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]. Hook "
            f"{name}'s return annotation is {_describe(returned)}: annotate it torch.futures.Future[torch.Tensor], "
            "or leave it unannotated"
        )


def call_hook(
    hook: CommHook, state: Any, bucket: GradBucket, step: int | None = None, group: Any = None
) -> torch.futures.Future:
    """Run ``hook`` on ``bucket``; its exception or a non-future result becomes a clear error.

    An exception that is a communication failure (a collective the hook launched found its peer gone)
    becomes :class:`PeerLostError`; any other becomes :class:`CommHookError`, chained to the original.
    """
    try:
        future = hook(state, bucket)
    except Exception as exc:
        if is_communication_failure(exc):
            raise lost_contact(exc, step, f"bucket {bucket.index()} (hook: {hook_name(hook)})", group) from exc
        buffer = bucket.buffer()
        details = f"{buffer.numel()} elements" + (f", {_SPARSE_HINT}" if buffer.is_sparse else "")
        raise CommHookError(
            f"Communication hook {hook_name(hook)} raised on bucket {bucket.index()} ({details}): "
            f"{type(exc).__name__}: {exc}{rank_and_step(step)}; the hook's traceback is chained below"
        ) from exc
    if not isinstance(future, torch._C.Future):
        returned = type(future)
        raise CommHookTypeError(
            f"Communication hook {hook_name(hook)} returned {returned.__name__} on bucket {bucket.index()}; it must "
            "return a torch.futures.Future whose value is the bucket's tensor. DDP communication hook's callback "
            f"must return a torch.futures.Future object, but got {returned.__module__}.{returned.__qualname__}"
            f"{rank_and_step(step)}. For a tensor computed at once: future = torch.futures.Future(); "
            "future.set_result(tensor); return future"
        )
    return future


def hook_result(
    name: str,
    future: torch.futures.Future,
    index: int,
    expected: torch.Tensor,
    step: int | None = None,
    group: Any = None,
) -> torch.Tensor:
    """Wait for the future of hook ``name`` and check that its value can replace the bucket ``expected``.

    The wait ends at the latest when the process group's timeout passes: every collective behind the
    future then fails, and so does the future. A communication failure becomes :class:`PeerLostError`,
    naming ``step`` and the bucket; any other failure :class:`CommHookError`.
    """
    try:
        value = future.wait()
    except Exception as exc:
        if is_communication_failure(exc):
            raise lost_contact(exc, step, f"bucket {index} (hook: {name})", group) from exc
        sparse = f" ({_SPARSE_HINT})" if expected.is_sparse else ""
        raise CommHookError(
            f"Communication hook {name}: the future it returned for bucket {index}{sparse} failed: "
            f"{type(exc).__name__}: {exc}{rank_and_step(step)}"
        ) from exc
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], torch.Tensor):
        value = value[0]  # torch's collectives' futures hold a one-element list
    if not isinstance(value, torch.Tensor):
        raise CommHookTypeError(
            f"Communication hook {name}: the future for bucket {index} holds {type(value).__name__}; "
            f"expected a tensor of shape {tuple(expected.shape)} and dtype {expected.dtype}"
        )
    if value.shape != expected.shape or value.dtype != expected.dtype:
        raise CommHookResultError(
            f"Communication hook {name}: the future for bucket {index} holds a tensor of shape "
            f"{tuple(value.shape)} and dtype {value.dtype}; expected shape {tuple(expected.shape)} and dtype "
            f"{expected.dtype} (the bucket's buffer)"
        )
    return value


def _is_bucket_type(annotation: Any) -> bool:
    if isinstance(annotation, str):
        return annotation in _BUCKET_TYPE_NAMES
    return annotation in _BUCKET_TYPES


def _is_future_type(annotation: Any) -> bool:
    if isinstance(annotation, str):
        return annotation in _FUTURE_TYPE_NAMES
    origin = get_origin(annotation) or annotation
    if not (isinstance(origin, type) and issubclass(origin, torch._C.Future)):
        return False
    args = get_args(annotation)
    return not args or args == (torch.Tensor,)


def _describe(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__qualname__", repr(annotation))


# -- hooks that leave replicas different on purpose ----------------------------------------------------------
def _torch_declarations() -> dict[Callable[..., Any], Callable[[Any], bool]]:
    """torch's own hooks that leave replicas different, with the same predicates as gradcomm's."""
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, post_localSGD_hook
    except ImportError:
        return {}
    return {
        debugging_hooks.noop_hook: lambda state: True,
        post_localSGD_hook.post_localSGD_hook: lambda state: state.iter >= state.start_localSGD_iter,
    }


def replicas_may_differ(hook: CommHook | None, state: Any) -> bool:
    """Whether ``hook`` may leave the ranks' replicas different on purpose at its state's current iteration.

    Most hooks average, so replicas stay identical and the DDP's periodic parameter check applies. A hook
    that does not declares it with an attribute ``replicas_may_differ(state) -> bool``
    (:class:`gradcomm.hooks.protocols.DeclaresReplicasMayDiffer`, where the contract is described); a wrapper
    inherits the declaration of the hook it wraps. torch's ``noop_hook`` and ``post_localSGD_hook`` are known.
    """
    declared = None if hook is None else _declaration(hook)
    return declared is not None and bool(declared(state))


def declares_replicas_may_differ(hook: CommHook) -> bool:
    """Whether ``hook`` (or the hook it wraps) declares that it may leave replicas different, at any iteration
    (see :func:`replicas_may_differ`)."""
    return _declaration(hook) is not None


def _declaration(hook: Any, seen: set[int] | None = None) -> Callable[[Any], bool] | None:
    """The ``replicas_may_differ`` predicate of ``hook``, of torch's hook it is, or of a hook it wraps: one it
    holds (a partial's function, a closure cell) or calls by a global name (a method or function whose body
    calls ``post_localSGD_hook(state, bucket)``)."""
    seen = set() if seen is None else seen
    while isinstance(hook, functools.partial):
        hook = hook.func
    if id(hook) in seen:
        return None
    seen.add(id(hook))
    declared = getattr(hook, "replicas_may_differ", None)
    if declared is None:
        declared = _torch_declarations().get(hook)
    if declared is None:
        function = getattr(hook, "__func__", hook)  # a bound method: the function it runs
        wrapped = (value for value in _wrapped_callables(function) if value is not hook)
        declared = next((d for d in (_declaration(value, seen) for value in wrapped) if d is not None), None)
    return declared


def _wrapped_callables(function: Any) -> list[Any]:
    """The callables ``function`` holds in its closure or names as globals in its code."""
    values = [value for value in _closure_values(function) if callable(value)]
    code, names = getattr(function, "__code__", None), getattr(function, "__globals__", None)
    if code is not None and isinstance(names, dict):
        values += [names[name] for name in code.co_names if callable(names.get(name))]
    return values


def _closure_values(function: Any) -> list[Any]:
    values = []
    for cell in getattr(function, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return values
