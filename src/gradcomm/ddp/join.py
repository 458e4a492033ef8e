"""Uneven inputs through torch's ``Joinable`` protocol: ranks that run out of batches keep matching the others.

``torch.distributed.algorithms.join.Join`` drives it, exactly as for torch's DDP: ``with Join([ddp]):`` or
``with ddp.join():``. Each forward of a rank still training first notifies the context (one allreduce of
"not joined yet", :meth:`Join.notify_join_context`), then exchanges one flag per rank (0 joined, 1 a forward
without synchronisation, 2 a synchronised forward). A rank that has left its loop waits in ``Join``'s exit,
which counts the ranks not yet joined and, while there are some, calls :meth:`DDPJoinHook.main_hook` once per
step they take: it does its part of their collectives (the flag exchange, the buffer broadcast, the one-time
bucket rebuild, and a *shadow backward* running the communication hook on zero buckets, in bucket order, so
any hook's collectives match). When every rank has joined, :meth:`DDPJoinHook.post_hook` broadcasts parameters
and (with ``forward_sync_buffers``, as torch's ``_sync_final_model``) buffers from a rank that trained longest,
so all replicas leave identical; buffers a DDP does not synchronise stay each rank's own.

The flags are what every rank knows alike, so every decision (which rank's buffers and bucket order count,
how many ranks are active, which rank's model is kept) is the same on all ranks without further messages.
With ``stop_on_uneven_inputs`` (``ddp.join(throw_on_early_termination=True)``) the flag exchange raises the
same error on every rank, naming the ranks that ran out, as soon as one has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from gradcomm.comm import collective_device
from gradcomm.comm.agreement import broadcast_coalesced
from gradcomm.comm.faults import reporting_lost_peers

if TYPE_CHECKING:
    from gradcomm.ddp.distributed import DistributedDataParallel

__all__ = ["DDPJoinHook", "JoinState"]

JOINED, FORWARD_ONLY, SYNCHRONISED = 0, 1, 2


@dataclass
class JoinState:
    """One join context's settings and what every rank has learned from the flags (identical on all ranks)."""

    divide_by_initial_world_size: bool
    stop_on_uneven_inputs: bool
    last_active: list[int] = field(default_factory=list)  # group ranks active in the last step anyone was


class DDPJoinHook(JoinHook):
    """The join hook of gradcomm's DDP; built by ``ddp.join_hook(**kwargs)`` when a ``Join`` context starts.

    Args:
        ddp: the DDP.
        divide_by_initial_world_size: joined ranks contribute zeros; ``True`` divides the default reduction's
            sum by the initial world size (a step with ``k`` active ranks takes ``k / world_size`` of a full
            step), ``False`` by the number of active ranks. A registered hook divides as it always does.
        stop_on_uneven_inputs: raise on every rank as soon as any rank runs out of inputs.
    """

    def __init__(
        self,
        ddp: DistributedDataParallel,
        divide_by_initial_world_size: bool = True,
        stop_on_uneven_inputs: bool = False,
    ) -> None:
        self.ddp = ddp
        ddp._join = JoinState(divide_by_initial_world_size, stop_on_uneven_inputs)

    def main_hook(self) -> None:
        """One step the other ranks take while this one has joined: match their collectives."""
        ddp = self.ddp
        values = exchange_flags(ddp, JOINED)
        active = [rank for rank, value in enumerate(values) if value]
        synchronising = SYNCHRONISED in values
        if synchronising:
            ddp._reducer.prepare_for_forward(active[0])
            ddp._maybe_check_parameters(joined=True)
        ddp._broadcast_buffers(active[0])
        if synchronising:
            ddp._reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has joined: make the replicas identical again, then leave the join context."""
        ddp = self.ddp
        state = ddp._join
        try:
            if state is not None and state.last_active:
                buffers = list(ddp.module.buffers()) if ddp.forward_sync_buffers else []
                tensors = [p for p in ddp.module.parameters()] + buffers
                with reporting_lost_peers(ddp.synchronised_steps, "synchronising the model after join()", ddp._group):
                    broadcast_coalesced(tensors, ddp._group, state.last_active[0])
        finally:
            leave(ddp)


def leave(ddp: DistributedDataParallel) -> None:
    """Forget the join context (also after a failure inside it)."""
    ddp._join = None
    ddp._reducer.set_active_ranks(None)


def exchange_flags(ddp: DistributedDataParallel, mode: int) -> list[int]:
    """One allreduce of per-rank flags (:data:`JOINED`, :data:`FORWARD_ONLY`, :data:`SYNCHRONISED`)."""
    state = ddp._join
    assert state is not None
    group = ddp._group
    world = dist.get_world_size(group)
    flags = torch.zeros(world, dtype=torch.int32, device=collective_device(group))
    flags[dist.get_rank(group)] = mode
    with reporting_lost_peers(ddp.synchronised_steps, "exchanging join() flags", group):
        dist.all_reduce(flags, group=group)
    values = flags.tolist()
    active = [rank for rank, value in enumerate(values) if value]
    if active:
        state.last_active = active
        if state.stop_on_uneven_inputs and len(active) < world:
            finished = [dist.get_global_rank(group, r) for r, v in enumerate(values) if not v]
            torch_sentence = (  # torch's Join raises these, on the finished ranks and on the others
                f"Rank {dist.get_rank()} exhausted all inputs."
                if mode == JOINED
                else "Detected at least one rank that exhausted inputs. Throwing across all ranks."
            )
            raise RuntimeError(
                f"{torch_sentence} gradcomm.DistributedDataParallel.join(throw_on_early_termination=True): rank(s) {finished} "
                f"ran out of inputs at step {ddp.synchronised_steps}; raised on every rank"
            )
    return values


def training_step(ddp: DistributedDataParallel, synchronise: bool) -> int:
    """A training rank's part at the start of a forward; returns the group rank whose buffers and bucket
    order are authoritative this step."""
    state = ddp._join
    assert state is not None
    if not ddp._join_config.is_first_joinable:
        raise RuntimeError(
            "gradcomm.DistributedDataParallel must be the first joinable of its Join context (Join([ddp, ...])): "
            "its forward notifies the context before its own collectives, in the order the joined ranks match"
        )
    notified = Join.notify_join_context(ddp)  # matched by the joined ranks' count of those not yet joined
    mode = SYNCHRONISED if synchronise else FORWARD_ONLY
    active = [rank for rank, value in enumerate(exchange_flags(ddp, mode)) if value]
    if notified is not None:
        notified.wait()
    if synchronise and not state.divide_by_initial_world_size:
        ddp._reducer.set_active_ranks(len(active))
    return active[0]
