"""The communication layer: counted collectives, ordered launching, futures, and what failures mean.

Everything above it (hooks, compression, the DDPs) communicates through this package, never through a
transport of its own: collectives are ``torch.distributed``'s, launched asynchronously.

* :mod:`~gradcomm.comm.collectives`: asynchronous collectives returning ``torch.futures.Future`` and
  counting the bytes handed to them (:data:`traffic`, :func:`wire_bytes`, per group size
  :func:`group_wire_bytes`);
* :mod:`~gradcomm.comm.faults`: the errors a lost peer or a diverged replica raises, and how to recognise them;
* :mod:`~gradcomm.comm.agreement`: the ranks compare a fingerprint of their setup and their parameters' bits;
* :mod:`~gradcomm.comm.telemetry`: what each synchronised step cost (a DDP's ``comm_stats()``).
"""

from gradcomm.comm.collectives import (
    Traffic,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    broadcast,
    bytes_by_kind,
    collective_device,
    counting_into,
    group_rank,
    group_size,
    group_wire_bytes,
    reduce_scatter_tensor,
    traffic,
    wire_bytes,
)

__all__ = [
    "Traffic",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "bytes_by_kind",
    "collective_device",
    "counting_into",
    "group_rank",
    "group_size",
    "group_wire_bytes",
    "reduce_scatter_tensor",
    "traffic",
    "wire_bytes",
]
