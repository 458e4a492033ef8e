"""The extension points of a communication hook and its state, in one place.

gradcomm's DDP, checkpoints and integrations look for these by duck typing: a hook or state need not inherit
anything, only have the attribute. Each is a :class:`typing.Protocol` (checkable with ``isinstance``) so that
a type checker can check a hook written against it, and so that the contract is written down once:

* :class:`DeclaresReplicasMayDiffer`: a *hook* whose replicas differ on purpose (no communication, local SGD
  between model averagings); read by :func:`gradcomm.hooks.contract.replicas_may_differ`.
* :class:`Fingerprinted`: a *state* saying itself what the ranks must agree on; read by the DDP's check at
  registration (``gradcomm.hooks.fingerprint.describe_state``). Without it, the state's public plain attributes
  are compared. :class:`~gradcomm.hooks.hook_state.HookState` subclasses derive it from their options.
* :class:`ReportsCommStats`: a *state* adding its own report to ``comm_stats().hook_details``
  (``gradcomm.comm.telemetry``); the ``auto`` hook reports its phase, choice and link.
* :class:`Checkpointable`: a *state* saved and restored by ``state_dict()``/``load_state_dict()``
  (``gradcomm.checkpoint``, ``HierarchicalState``'s inner state, ``auto``'s chosen candidate).

The lifecycle of gradcomm's own states (options dataclass, runtime, checkpoints) is described in
:mod:`gradcomm.hooks.hook_state`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Checkpointable", "DeclaresReplicasMayDiffer", "Fingerprinted", "ReportsCommStats"]


@runtime_checkable
class DeclaresReplicasMayDiffer(Protocol):
    """A hook with ``hook.replicas_may_differ = predicate``: ``predicate(state)`` is true while the hook may
    leave the ranks' replicas different on purpose (post-local SGD after its warm-up; ``noop`` always).

    The DDP then skips its periodic check that the replicas are identical, and the model averager checks
    right after it averages instead; ``HierarchicalState`` refuses such a hook as its inner hook. A wrapper
    (``fp16_compress_wrapper(hook)``) inherits the declaration of the hook it wraps.
    """

    replicas_may_differ: Any  # Callable[[state], bool]: an attribute of the hook function, not a method

    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]: ...


@runtime_checkable
class Fingerprinted(Protocol):
    """A state that says itself what must agree across ranks, as text compared at registration: its options,
    not what legitimately differs by rank (measurements not yet agreed, counters that advance on some ranks
    only). Leave out tensors and anything naming the rank."""

    def comm_hook_fingerprint(self) -> str: ...


@runtime_checkable
class ReportsCommStats(Protocol):
    """A state whose ``comm_stats_details()`` (plain values) is shown as ``comm_stats().hook_details``, as of
    the last step."""

    def comm_stats_details(self) -> dict[str, Any]: ...


@runtime_checkable
class Checkpointable(Protocol):
    """A state saved as a dict of tensors and plain values (loadable with ``torch.load(weights_only=True)``) and
    restored into a state built with the same options and the resumed run's groups."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
