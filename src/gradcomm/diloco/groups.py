"""DiLoCo over a DDP: which model DiLoCo works on, and the group of the DDPs it works across.

Wrapped in a DDP, the model's gradients are averaged every step within the DDP's group (a node); DiLoCo
then averages pseudo-gradients across the nodes, over the group of the ranks with the same local rank
(torchrun's layout: global rank = node * LOCAL_WORLD_SIZE + local rank).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from gradcomm.comm.agreement import check_same_on_all_ranks
from gradcomm.comm.faults import derived_group_timeout

__all__ = ["across_nodes_group", "replica_group", "unwrap_ddp"]

_ENV = "LOCAL_WORLD_SIZE"


def unwrap_ddp(model: nn.Module) -> tuple[nn.Module, bool]:
    """The module inside ``model`` if it is a DDP (gradcomm's, legacy or torch's), and whether it was one."""
    from gradcomm.ddp.distributed import DistributedDataParallel
    from gradcomm.ddp.legacy import LegacyDistributedDataParallel

    ddp_types = (
        torch.nn.parallel.DistributedDataParallel,
        DistributedDataParallel,
        LegacyDistributedDataParallel,
    )
    if isinstance(model, ddp_types):
        return model.module, True
    return model, False


def replica_group(model: nn.Module) -> ProcessGroup | None:
    """The group of a DDP ``model`` (its ranks train one replica together), or ``None`` when the DDP spans a
    single rank.

    Its ranks hold the same parameters between syncs, but each exchanges its pseudo-gradients with its own
    peers on the other nodes (the ranks of its local rank): a compressor that rounds at random (QSGD) or a
    collective that sums in another order gives each a different average, so the replica's ranks must take
    one of them, its first rank's. A DDP that broadcasts its buffers at every forward (gradcomm's and
    torch's ``forward_sync_buffers``) also makes its first rank's buffers the replica's.
    """
    group = getattr(model, "process_group", None)
    group = group if group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def across_nodes_group() -> ProcessGroup:
    """The group of this rank and the ranks of the same local rank on the other nodes; a collective of the
    default group (every rank creates every such group, in the same order, with the default group's timeout).

    Raises:
        RanksDisagreeError: the ranks read different ``LOCAL_WORLD_SIZE`` values (on every rank).
        ValueError: ``LOCAL_WORLD_SIZE`` unset or not dividing the world size (on every rank).
    """
    text = os.environ.get(_ENV, "<unset>")
    check_same_on_all_ranks({_ENV: text}, None, "gradcomm.DiLoCo")
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = int(text) if text.isdigit() else 0
    if per_node < 1 or world % per_node:
        raise ValueError(
            f"gradcomm.DiLoCo: the model is wrapped in a DDP, so DiLoCo works across nodes, but {_ENV} is {text} "
            f"for a world of {world} ranks; launch with torchrun, or pass process_group= (the group of the DDPs "
            "DiLoCo averages across)"
        )
    timeout = derived_group_timeout()
    mine: ProcessGroup | None = None
    for local_rank in range(per_node):
        members = list(range(local_rank, world, per_node))
        group = dist.new_group(members, timeout=timeout) if timeout is not None else dist.new_group(members)
        if rank in members:
            mine = group
    assert mine is not None
    return mine
