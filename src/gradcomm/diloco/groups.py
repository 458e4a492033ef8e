"""DiLoCo over a DDP: which model DiLoCo works on, and the group of the DDPs it works across.

Wrapped in a DDP, the model's gradients are averaged every step within the DDP's group (a host); the
host's ranks hold one replica. DiLoCo then averages pseudo-gradients across the replicas over the group of
their first ranks (:func:`replica_leaders_group`), so the link between hosts carries one copy of each
host's pseudo-gradients, and each first rank broadcasts the result inside its replica: the layout of the
hierarchical hook (:mod:`gradcomm.hooks.hierarchical_hook`), with its node leaders.
:func:`across_nodes_group` is the other layout, every local rank exchanging with its peers of the same
local rank (each host then sends its pseudo-gradients once per rank): pass it as ``process_group=``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from gradcomm.comm.agreement import check_same_on_all_ranks
from gradcomm.comm.faults import derived_group_timeout

__all__ = ["across_nodes_group", "replica_group", "replica_leaders_group", "unwrap_ddp"]

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


def _ddp_group(model: nn.Module) -> ProcessGroup:
    """The process group a DDP ``model`` averages over (the default group where it names none)."""
    group = getattr(model, "process_group", None)
    return group if group is not None else dist.group.WORLD


def replica_group(model: nn.Module) -> ProcessGroup | None:
    """The group of a DDP ``model`` (its ranks train one replica together), or ``None`` when the DDP spans a
    single rank.

    Its ranks hold the same parameters between syncs; its first rank exchanges the pseudo-gradients (and
    buffers) with the other replicas' and broadcasts the result inside this group. Where every rank
    exchanges (a ``process_group`` given), a compressor that rounds at random (QSGD) or a collective that
    sums in another order would give each a different average, so there too the replica's ranks take its
    first rank's.
    """
    group = _ddp_group(model)
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


def replica_leaders_group(model: nn.Module) -> ProcessGroup | None:
    """The group of the first ranks of the DDPs (each DDP's group one replica, e.g. a host) on such a first
    rank, ``None`` on every other rank; a collective of the default group (one ``all_gather_object`` of each
    rank's DDP group, then ``new_group`` of the first ranks on every rank, with the default group's timeout).

    Raises:
        ValueError: the DDPs' groups do not split the ranks into disjoint replicas (on every rank).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = dist.get_process_group_ranks(_ddp_group(model))
    everyone: list[list[int]] = [[] for _ in range(world)]
    dist.all_gather_object(everyone, mine)
    for r, ranks in enumerate(everyone):
        if r not in ranks or any(everyone[m] != ranks for m in ranks):
            raise ValueError(
                f"gradcomm.DiLoCo: the model is wrapped in a DDP, so DiLoCo works across the DDPs' groups (one "
                f"replica each), but rank {r}'s DDP group is {ranks} and its members' are "
                f"{[everyone[m] for m in ranks if 0 <= m < world]}; wrap every rank's model in a DDP over the "
                "ranks of its host (the same group on each of them), or pass process_group="
            )
    leaders = sorted({ranks[0] for ranks in everyone})
    timeout = derived_group_timeout()
    group = dist.new_group(leaders, timeout=timeout) if timeout is not None else dist.new_group(leaders)
    return group if rank == mine[0] else None
