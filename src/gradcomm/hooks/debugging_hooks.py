"""A hook that does not communicate, for measuring how much of a step's time communication takes.

:func:`noop_hook` returns every rank's own bucket unchanged: ranks train on their local gradients only and
their replicas drift apart, so it is useful for headroom analysis, never for training. If registering it
speeds up training by only a few percent, gradient communication is not the bottleneck and compressing it
will not help much.
"""

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["noop_hook"]


def noop_hook(_: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Return a completed future holding the local bucket, unchanged: no communication at all.

    Example::

        >>> ddp_model.register_comm_hook(None, noop_hook)
    """
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


noop_hook.replicas_may_differ = lambda state: True  # type: ignore[attr-defined]  # never averaged: hooks.protocols
