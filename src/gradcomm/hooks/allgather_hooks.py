"""Averaging by all-gather: every rank receives every other rank's bucket and averages locally.

:func:`allgather_then_aggregate_hook` computes the same mean as
:func:`~gradcomm.hooks.default_hooks.allreduce_hook` (to float rounding: the sum is taken in rank order on
every rank rather than in the allreduce's order) but moves far more data. With ``W`` ranks and a bucket of
``B`` bytes, each rank receives ``(W - 1) * B`` bytes and holds a ``W * B`` gather buffer, where a ring
allreduce receives about ``2 * B`` whatever ``W``; the local sum also costs ``O(W)``. It is a reference
implementation and the template for hooks whose per-rank payloads cannot be summed on the wire, such as
:mod:`gradcomm.hooks.quantization_hooks`.
"""

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm import comm

__all__ = ["allgather_then_aggregate_hook"]


def allgather_then_aggregate_hook(
    process_group: ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """All-gather every rank's bucket, then average them locally into the bucket's buffer.

    Example::

        >>> ddp_model.register_comm_hook(process_group, allgather_then_aggregate_hook)
    """
    buffer = bucket.buffer()
    world_size = comm.group_size(process_group)

    def aggregate(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        return torch.mean(fut.value().view(world_size, -1), dim=0, out=buffer)

    return comm.all_gather_into_tensor(buffer, process_group).then(aggregate)
