"""Hierarchical averaging: exact inside a node, any hook among the nodes, then a broadcast inside the node.

On a cluster the links inside a machine (shared memory, NVLink) are much faster than those between machines.
:func:`hierarchical_hook` averages each bucket in three stages so that a compressing hook such as PowerSGD
works only where it pays, on the slow inter-node link, and the fast links carry exact averages:

1. **intra-node reduce**: every rank divides its bucket by the number of ranks per node and all-reduces it
   within its node (exact: the node average, in the bucket's own buffer);
2. **inter-node hook**: each node's leader (local rank 0) runs the *inner* hook on that bucket, whose buffer
   now holds the node average, among the node leaders only: the inner state's process group is the
   inter-node group of the leaders, so the inner hook divides by the number of nodes and returns the global
   average (as the inner hook computes it: exact for ``allreduce_hook``, compressed for PowerSGD);
3. **intra-node broadcast**: each leader broadcasts the result to the ranks of its node.

Every rank ends with the leaders' common result, so replicas stay identical whatever the inner hook.

Trade-offs:

* Bytes on the slow link are the inner hook's bytes among ``nodes`` ranks, not among ``world_size``: with
  ``allreduce`` a ring among the leaders carries ``2 (nodes - 1) / nodes`` times the bucket per leader; with
  PowerSGD, only its low-rank factors. The intra-node stages add two exact collectives per bucket (an
  all-reduce and a broadcast) on the fast link.
* The non-leader ranks idle while their leader runs the inner hook (its compression and its inter-node
  collectives): the inner hook's compute is not spread over the node. Buckets still overlap: a bucket's
  intra-node reduce proceeds while earlier buckets are on the inter-node link.
* The intra-node average comes first, so the inner hook compresses one node-averaged gradient per node and
  keeps one error-feedback state per node, on the leader. For a compressor that is not linear (top-k,
  signSGD, quantization) that changes the result: the error is that of compressing node averages. PowerSGD
  is linear in the summed matrix (``P = sum M_i Q``, ``Q = sum M_i^T P``, its error feedback sums alike), so
  hierarchical PowerSGD computes what flat PowerSGD over all ranks computes, to rounding: the gain is its
  bytes and latency on the slow link, which are among ``nodes`` ranks instead of ``world_size``.
* The inner hook's state (PowerSGD's error feedback, its iteration count) advances on the leaders only; the
  other ranks' inner states stay as built. Each rank checkpoints its own (one file per rank, as always).

Topology: the ranks of the state's process group (the default group, or another group of every rank) are
split into nodes of ``ranks_per_node`` consecutive ranks (the way torchrun numbers them: node ``n`` holds
ranks ``n * ranks_per_node`` to ``(n + 1) * ranks_per_node - 1``, the first being its leader). ``ranks_per_node`` defaults to torchrun's ``LOCAL_WORLD_SIZE``; the world size
must be a multiple of it, and every rank must have the same value (checked at the first call).

Groups are created lazily, at the hook's first call (the first bucket of the first backward, the same point
on every rank, so the state can be built before ``init_process_group``), with ``torch.distributed.new_group``
called by every rank for every group in the same order: one *reduce* group per node, one *broadcast* group per
node, then the group of the node leaders, each with the process group's timeout. A node has two groups so that its broadcasts, which wait for the
inter-node stage, never hold up the next buckets' reduces: each group's collectives are launched in bucket
order on every rank, the reduces at once from the hook's call, the inner hook's calls and the broadcasts
through an :class:`~gradcomm.comm.launcher.OrderedLauncher` each, from whichever thread completes the stage
before (nothing blocks the hook's thread). A stage that fails (the inner hook raises, or returns something
other than a future of the bucket's size) stops its launcher: that rank's step fails, and the other ranks,
waiting for a collective that never comes, fail at the process group's timeout, as with any hook.

Degenerate topologies create no group: with one node the result is the exact average (one all-reduce over
the process group; the inner hook is not run, since there is no inter-node link to save), and with one rank
per node the inner hook runs directly on the process group, as if registered alone; so does a process group
of a single rank, whatever ``ranks_per_node`` (``gradcomm bench`` times each hook's local work on one).

Example::

    >>> from gradcomm.hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    >>> inner = PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=10)
    >>> state = HierarchicalState(powerSGD_hook, inner)              # ranks_per_node from LOCAL_WORLD_SIZE
    >>> ddp_model.register_comm_hook(state, hierarchical_hook)
    >>> # or by name: register_comm_hook_by_name(ddp_model, "hierarchical", inner="powersgd",
    >>> #                                        matrix_approximation_rank=4, start_powerSGD_iter=10)

Build the inner state with ``process_group=None``: the hierarchical state attaches it to the inter-node group
at the first call (a stateless inner hook, whose state is its process group, gets the inter-node group).
"""

# No ``from __future__ import annotations``: torch's DDP compares the hook's annotations with real types.

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm import comm
from gradcomm.comm.faults import derived_group_timeout
from gradcomm.comm.launcher import OrderedLauncher
from gradcomm.hooks.contract import check_hook, declares_replicas_may_differ, hook_name
from gradcomm.hooks.default_hooks import mean_allreduce
from gradcomm.hooks.fingerprint import describe_hook
from gradcomm.hooks.hook_state import _GROUP_RANKS_KEY, HookState, options_text
from gradcomm.hooks.options import HierarchicalOptions

logger = logging.getLogger(__name__)

__all__ = ["HierarchicalState", "hierarchical_hook"]

_ENV = "LOCAL_WORLD_SIZE"


@dataclass(frozen=True)
class _Topology:
    """This rank's place among the nodes, and the groups it communicates over (``None``: not needed)."""

    ranks_per_node: int
    nodes: int
    leader: int  # global rank of this rank's node leader
    is_leader: bool
    reduce_group: ProcessGroup | None
    broadcast_group: ProcessGroup | None

    @property
    def solo(self) -> bool:
        """A process group of one rank: no node topology at all."""
        return self.nodes * self.ranks_per_node == 1


@dataclass
class _Runtime:
    """What a hierarchical state holds for this process only, rebuilt by :meth:`HierarchicalState.reset_runtime`."""

    topology: _Topology | None = None  # created at the first call
    inner_bound: Any = None  # what the inner hook gets as its state on a leader
    inner_launcher: OrderedLauncher = field(default_factory=OrderedLauncher)
    broadcast_launcher: OrderedLauncher = field(default_factory=OrderedLauncher)


def _unwrapped(hook: Any) -> Any:
    while isinstance(hook, functools.partial):
        hook = hook.func
    return hook


def _is_stateless(inner_state: Any) -> bool:
    """Whether ``inner_state`` is a stateless hook's state: its process group (``None`` for the default)."""
    return inner_state is None or isinstance(inner_state, ProcessGroup)


class HierarchicalState(HookState):
    """State of :func:`hierarchical_hook`: the inner hook and its state, and the node topology.

    Args:
        inner_hook: the hook run among the node leaders, e.g. ``powerSGD_hook`` or ``allreduce_hook``. Hooks
            that leave replicas different on purpose (``noop_hook``, ``post_localSGD_hook``) are refused.
        inner_state: its state, built with ``process_group=None`` (for a stateless hook: ``None``); it is
            attached to the inter-node group of the leaders at the first call.
        ranks_per_node: ranks on each node; ``None`` for torchrun's ``LOCAL_WORLD_SIZE``, read at the first
            call. The world size must be a multiple of it.
        process_group: the group to average over (``None``: the default group). It must hold every rank
            of the default group, since every rank creates the node groups; they get its timeout.

    ``state_dict()`` holds ``ranks_per_node`` and the inner state's ``state_dict()`` (the inner state must
    have one, or be stateless); a checkpoint is refused at another world size or ``ranks_per_node``.
    """

    options_class = HierarchicalOptions

    def __init__(
        self,
        inner_hook: Any,
        inner_state: Any = None,
        ranks_per_node: int | None = None,
        process_group: ProcessGroup | None = None,
    ) -> None:
        check_hook(inner_hook)
        unwrapped = _unwrapped(inner_hook)
        name = hook_name(inner_hook)
        if unwrapped is hierarchical_hook:
            raise ValueError(
                "HierarchicalState: the inner hook cannot be hierarchical_hook itself; nodes within nodes are "
                "not supported: pass the hook to run among the node leaders (e.g. powerSGD_hook)"
            )
        if declares_replicas_may_differ(inner_hook):
            raise ValueError(
                f"HierarchicalState: inner hook {name} leaves replicas different on purpose "
                "(replicas_may_differ), but hierarchical averaging broadcasts the leaders' result as the "
                "average of every rank: choose an averaging inner hook (allreduce_hook, powerSGD_hook, ...)"
            )
        if not _is_stateless(inner_state) and not hasattr(inner_state, "process_group"):
            raise TypeError(
                f"HierarchicalState: inner_state of inner hook {name} must be None or a ProcessGroup (a "
                f"stateless hook's state) or a state with a process_group attribute, got "
                f"{type(inner_state).__name__}: the state is attached to the inter-node group through it"
            )
        bound = inner_state if _is_stateless(inner_state) else inner_state.process_group
        if bound is not None and bound is not dist.group.WORLD:
            raise ValueError(
                f"HierarchicalState: the state of inner hook {name} is bound to a process group of "
                f"{comm.group_size(bound)} ranks, but it runs on the group of the node leaders, which is created "
                "at the first call: build the inner state with process_group=None"
            )
        self._set_options((), {"ranks_per_node": ranks_per_node})
        self.process_group = process_group
        self.inner_hook = inner_hook
        self.inner = f"{getattr(unwrapped, '__module__', '?')}.{name}"  # a plain value: ranks must agree on it
        self.inner_state = None if isinstance(inner_state, ProcessGroup) else inner_state
        self._inner_options = _options_of(self.inner_state)
        self._loaded_ranks_per_node: int | None = None
        self.reset_runtime()

    def comm_hook_fingerprint(self) -> str:
        """What the ranks must agree on (gradcomm's DDP compares it at registration): the inner hook, the
        topology and the inner state's options as built. Not the inner state's counters, which advance on the
        leaders only (a state loaded from a checkpoint differs between leaders and the other ranks). The inner
        hook is described through its wrappers (``fp16_compress_wrapper(powerSGD_hook)`` names both). See
        :class:`gradcomm.hooks.protocols.Fingerprinted`."""
        inner = describe_hook(self.inner_hook)
        return f"HierarchicalState(inner={inner}, {options_text(self.options())}, inner state {self._inner_options})"

    def reset_runtime(self, loaded: bool = False) -> None:
        """Start without topology, groups (created at the next call) or launchers; a state loaded in place keeps
        its own, created by every rank together and still valid (the checkpoint's topology is checked against
        them)."""
        if not (loaded and "_runtime" in self.__dict__):
            self._runtime = _Runtime()

    # -- topology and groups, on first use --------------------------------------------------------------
    def topology(self) -> _Topology:
        """This rank's node, leader and groups; the first call checks the topology and creates the groups
        (a collective of every rank of the default group)."""
        runtime = self._runtime
        if runtime.topology is None:
            runtime.topology = self._make_topology()
        return runtime.topology

    def _make_topology(self) -> _Topology:
        if not dist.is_initialized():
            raise RuntimeError(
                "HierarchicalState: the node groups are created at the hook's first call, which needs the "
                "default process group: call torch.distributed.init_process_group(...) before training"
            )
        group = self.process_group
        group_size, world_size = comm.group_size(group), dist.get_world_size()
        if group_size == 1:  # no link to save and no node to average: whatever ranks_per_node says
            self._bind_inner(group)
            return _Topology(1, 1, dist.get_rank(), True, None, None)
        if group_size != world_size:
            raise ValueError(
                f"HierarchicalState: process_group has {group_size} of the {world_size} ranks, but the node "
                "groups are created by every rank of the default group (torch.distributed.new_group), so it "
                "must hold every rank: pass process_group=None, or a group of all ranks"
            )
        rank, ranks = dist.get_rank(group), dist.get_process_group_ranks(group or dist.group.WORLD)
        ranks_per_node = _agreed_ranks_per_node(self.ranks_per_node, rank, group_size, group)
        if self._loaded_ranks_per_node is not None and self._loaded_ranks_per_node != ranks_per_node:
            raise ValueError(_moved_message(self._loaded_ranks_per_node, ranks_per_node))
        nodes = group_size // ranks_per_node
        node = rank // ranks_per_node
        leader = ranks[node * ranks_per_node]
        reduce_group = broadcast_group = None
        if nodes == 1:
            logger.info("hierarchical_hook: one node of %s ranks: exact averaging, the inner hook is not run", group_size)
        elif ranks_per_node == 1:
            self._bind_inner(group)
        else:
            timeout = derived_group_timeout(group)
            node_ranks = [ranks[n * ranks_per_node : (n + 1) * ranks_per_node] for n in range(nodes)]
            reduce_groups = [dist.new_group(members, timeout=timeout) for members in node_ranks]
            broadcast_groups = [dist.new_group(members, timeout=timeout) for members in node_ranks]
            inter_group = dist.new_group([members[0] for members in node_ranks], timeout=timeout)
            reduce_group, broadcast_group = reduce_groups[node], broadcast_groups[node]
            if ranks[rank] == leader:
                self._bind_inner(inter_group)
            logger.info(
                "hierarchical_hook: %s nodes of %s ranks; created %s node groups and the group of the leaders",
                nodes,
                ranks_per_node,
                2 * nodes,
            )
        return _Topology(ranks_per_node, nodes, leader, ranks[rank] == leader, reduce_group, broadcast_group)

    def _bind_inner(self, group: ProcessGroup | None) -> None:
        """Attach the inner state to ``group``, the inter-node group (``None``: the default group)."""
        if self.inner_state is None:
            self._runtime.inner_bound = group
        else:
            self.inner_state.process_group = group
            self._runtime.inner_bound = self.inner_state

    def run_inner(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """Run the inner hook on ``bucket`` (a leader's, holding the node average) among the leaders."""
        name = hook_name(self.inner_hook)
        try:
            future = self.inner_hook(self._runtime.inner_bound, bucket)
        except Exception as exc:
            raise RuntimeError(
                f"hierarchical_hook: inner hook {name} raised on bucket {bucket.index()} on node leader rank "
                f"{dist.get_rank()}: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(future, torch._C.Future):
            raise TypeError(
                f"hierarchical_hook: inner hook {name} returned {type(future).__name__} on bucket "
                f"{bucket.index()} on node leader rank {dist.get_rank()}; it must return a torch.futures.Future"
            )
        return future

    # -- checkpointing: the inner state's own dict; groups and launchers are rebuilt ----------------------
    def _plain_state(self) -> dict[str, Any]:
        topology = self._runtime.topology
        resolved = self.ranks_per_node if topology is None or topology.solo else topology.ranks_per_node
        return {"ranks_per_node": resolved, "inner": self._inner_state_dict()}

    def _inner_state_dict(self) -> dict[str, Any] | None:
        if self.inner_state is None:
            return None
        saver = getattr(self.inner_state, "state_dict", None)
        if not callable(saver):
            raise TypeError(
                f"HierarchicalState: the state of inner hook {hook_name(self.inner_hook)} "
                f"({type(self.inner_state).__name__}) has no state_dict(), so it cannot be checkpointed: use "
                "gradcomm's state class (gradcomm.hooks.powerSGD_hook.PowerSGDState, ...) or torch.save(state)"
            )
        inner = dict(saver())
        inner.pop(_GROUP_RANKS_KEY, None)  # the inter-node group follows from ranks_per_node, checked instead
        return inner

    def _restore_plain_state(self, state: dict[str, Any]) -> None:
        saved = state.get("ranks_per_node")
        topology = self._runtime.topology
        if saved is not None and topology is not None and not topology.solo and saved != topology.ranks_per_node:
            raise ValueError(_moved_message(saved, topology.ranks_per_node))
        inner = state.get("inner")
        if (inner is None) != (self.inner_state is None):
            saved_kind = "no inner state (a stateless inner hook)" if inner is None else "an inner state"
            raise ValueError(
                f"HierarchicalState: this checkpoint holds {saved_kind}, but inner hook "
                f"{hook_name(self.inner_hook)} has {'a state' if self.inner_state is not None else 'none'}: "
                "load it into a state with the same inner hook"
            )
        if inner is not None:
            loader = getattr(self.inner_state, "load_state_dict", None)
            if not callable(loader):
                raise TypeError(
                    f"HierarchicalState: the state of inner hook {hook_name(self.inner_hook)} "
                    f"({type(self.inner_state).__name__}) has no load_state_dict()"
                )
            loader(inner)
        self._loaded_ranks_per_node = saved

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        topology = self._runtime.topology
        if topology is not None and not topology.solo:
            state["_loaded_ranks_per_node"] = topology.ranks_per_node
        return state


_PLAIN = (bool, int, float, str, type(None))


def _options_of(inner_state: Any) -> str:
    """The inner state's options: its options dataclass where it declares one, else its public plain attributes
    as built (its options, and its counters, still at zero)."""
    if inner_state is None:
        return "None (a stateless hook)"
    if isinstance(inner_state, HookState) and inner_state.options_class is not None:
        return f"{type(inner_state).__qualname__}({options_text(inner_state.options())})"
    attributes = getattr(inner_state, "__dict__", {})
    plain = [f"{k}={v!r}" for k, v in sorted(attributes.items()) if not k.startswith("_") and isinstance(v, _PLAIN)]
    return f"{type(inner_state).__qualname__}({', '.join(plain)})"


def _moved_message(saved: int, current: int) -> str:
    return (
        f"HierarchicalState: this checkpoint was written with {saved} ranks per node, but this run has "
        f"{current}: the inner hook's state belongs to the node leaders of that topology. Resume with "
        f"ranks_per_node={saved}, or start the hook state afresh"
    )


def _local_ranks_per_node(explicit: int | None, rank: int, world_size: int) -> int:
    """This rank's view of the ranks per node, checked against the world size; raises what is wrong."""
    if explicit is not None:
        ranks_per_node, source = explicit, f"ranks_per_node={explicit}"
    else:
        text = os.environ.get(_ENV)
        if not text:
            raise ValueError(
                f"HierarchicalState: the number of ranks per node is unknown on rank {rank}: ranks_per_node "
                f"was not given and {_ENV} is not set. Pass ranks_per_node=..., or launch with torchrun, "
                f"which sets {_ENV}"
            )
        try:
            ranks_per_node = int(text)
            HierarchicalOptions(ranks_per_node)  # at least 1
        except ValueError:
            raise ValueError(
                f"HierarchicalState: {_ENV}={text!r} on rank {rank} is not a positive integer; pass "
                "ranks_per_node=... instead"
            ) from None
        source = f"{_ENV}={ranks_per_node}"
        local_rank = os.environ.get("LOCAL_RANK")
        if local_rank is not None and local_rank.strip().isdigit() and int(local_rank) != rank % ranks_per_node:
            raise ValueError(
                f"HierarchicalState: rank {rank} has LOCAL_RANK={local_rank}, but with {source} it would be "
                f"local rank {rank % ranks_per_node}: the ranks are not numbered node by node, which "
                "hierarchical averaging assumes (node n holds ranks n*ranks_per_node, ...). Pass "
                "ranks_per_node=... to choose the nodes explicitly"
            )
    if world_size % ranks_per_node:
        raise ValueError(
            f"HierarchicalState: world size {world_size} is not a multiple of {source}: the nodes must all "
            "have the same number of ranks. Pass the number of ranks on each node as ranks_per_node"
        )
    return ranks_per_node


def _agreed_ranks_per_node(explicit: int | None, rank: int, world_size: int, group: ProcessGroup | None) -> int:
    """The ranks per node, the same on every rank; a collective of ``group`` (``rank`` is this rank's there).

    Every rank exchanges its value (0 when it could not find a valid one) before raising, so that all ranks
    fail together instead of leaving some waiting in the groups' creation.
    """
    error: ValueError | None = None
    try:
        mine = _local_ranks_per_node(explicit, rank, world_size)
    except ValueError as exc:
        error, mine = exc, 0
    if world_size > 1:
        device = comm.collective_device(group)
        everyone = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
        dist.all_gather(everyone, torch.tensor([mine], dtype=torch.int64, device=device), group=group)
        values = [int(value.item()) for value in everyone]
    else:
        values = [mine]
    if error is not None:
        raise error
    failed = [r for r, value in enumerate(values) if value == 0]
    if failed:
        raise ValueError(
            f"HierarchicalState: rank(s) {', '.join(map(str, failed))} could not determine the number of ranks "
            "per node (their own errors say why); every rank needs the same ranks_per_node"
        )
    if len(set(values)) > 1:
        by_value: dict[int, list[int]] = {}
        for r, value in enumerate(values):
            by_value.setdefault(value, []).append(r)
        listed = "; ".join(f"ranks {', '.join(map(str, ranks))}: {value}" for value, ranks in by_value.items())
        raise ValueError(
            f"HierarchicalState: the ranks disagree on the number of ranks per node ({listed}); pass the same "
            "ranks_per_node on every rank"
        )
    return mine


def _result_tensor(value: Any, buffer: torch.Tensor, name: str, index: int) -> torch.Tensor:
    """The inner hook's result as a tensor like ``buffer``, to broadcast; refuses one of another size."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor) or value.numel() != buffer.numel():
        got = f"a tensor of {value.numel()} elements" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"hierarchical_hook: inner hook {name}'s future for bucket {index} holds {got}; expected a tensor "
            f"of the bucket's {buffer.numel()} elements"
        )
    return value.to(buffer.dtype).reshape(buffer.shape).contiguous()


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` exactly within each node, with ``state.inner_hook`` among the node leaders, then
    broadcast within each node (see the module's description for the algorithm and its trade-offs).

    Returns:
        A future completing with the averaged bucket, identical on every rank.
    """
    topology = state.topology()
    buffer = bucket.buffer()
    if topology.ranks_per_node == 1:
        return state.run_inner(bucket)
    if topology.nodes == 1:
        return mean_allreduce(buffer, state.process_group)
    if buffer.is_sparse:
        raise ValueError(
            f"hierarchical_hook: bucket {bucket.index()} is sparse (nn.Embedding(sparse=True)); a sparse gradient "
            "cannot be broadcast within a node. Use dense gradients, or register no hook"
        )
    node_mean = mean_allreduce(buffer, topology.reduce_group)
    leader, group, device = topology.leader, topology.broadcast_group, buffer.device
    if not topology.is_leader:

        def receive(done: torch.futures.Future[torch.Tensor]) -> Any:
            done.value()  # the reduce writes into the buffer the broadcast receives into
            return lambda: comm.broadcast(buffer, leader, group)

        return state._runtime.broadcast_launcher.launch_after(node_mean, receive, device)

    def run_inner(done: torch.futures.Future[torch.Tensor]) -> Any:
        done.value()
        return lambda: state.run_inner(bucket)

    inner = state._runtime.inner_launcher.launch_after(node_mean, run_inner, device)
    name, index = hook_name(state.inner_hook), bucket.index()

    def send(done: torch.futures.Future[Any]) -> Any:
        result = _result_tensor(done.value(), buffer, name, index)
        return lambda: comm.broadcast(result, leader, group)

    return state._runtime.broadcast_launcher.launch_after(inner, send, device)
