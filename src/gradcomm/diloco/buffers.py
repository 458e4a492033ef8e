"""The model's buffers at an outer sync: floating ones averaged over the ranks, the others taken from the first.

Between syncs every replica updates its own buffers (batch norm's running statistics) from its own batches, as
it updates its parameters. DiLoCo averages the floating-point buffers at every sync of fragment 0 (every outer
sync of plain DiLoCo; once per ``sync_every`` steps with fragments), and copies the others (counters such as
``num_batches_tracked``) from the group's first rank, so that right after the sync the buffers are the same on
every rank to the bit, like the parameters. The exchange is launched before the fragment's pseudo-gradients
(a hook's later stages must come last on the group) and its result applied with them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm import comm
from gradcomm.comm.faults import reporting_lost_peers

__all__ = ["average_buffers"]


def average_buffers(
    named_buffers: Sequence[tuple[str, torch.Tensor]], group: ProcessGroup | None, step: int
) -> dict[str, torch.Tensor]:
    """The buffers' synced values by name (new tensors; the module's are left as they are): the mean over
    ``group`` of each floating buffer, every other buffer as on the group's first rank. A collective (one per
    dtype and device), counted in the current :func:`gradcomm.comm.counting_into` account.

    Raises:
        PeerLostError: a peer was lost during the exchange.
    """
    by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[str, torch.Tensor]]] = {}
    for name, buffer in named_buffers:
        by_kind.setdefault((buffer.dtype, buffer.device), []).append((name, buffer))
    world = dist.get_world_size(group)
    first = dist.get_global_rank(group, 0) if group is not None else 0
    synced: dict[str, torch.Tensor] = {}
    with reporting_lost_peers(step, "averaging the buffers at an outer sync", group):
        for (dtype, _), same_kind in by_kind.items():
            flat = torch.cat([buffer.detach().reshape(-1) for _, buffer in same_kind])
            if dtype.is_floating_point or dtype.is_complex:
                comm.all_reduce(flat, group).wait()
                flat.div_(world)
            else:
                comm.broadcast(flat, first, group).wait()
            offset = 0
            for name, buffer in same_kind:
                synced[name] = flat[offset : offset + buffer.numel()].view_as(buffer).clone()
                offset += buffer.numel()
    return synced
