"""One synchronised backward's progress in the reducer, as one object replaced at each arming.

Everything here describes the backward being reduced now: which parameters are ready, how many gradients
each bucket still waits for, the launched futures, which end-of-backward callbacks are queued, how a static
graph counts gradients. The reducer makes a new :class:`Iteration` when it arms for a backward (and after the
buckets change), so nothing of an earlier backward carries over by mistake. What outlives a backward (the
buckets, the rebuild, the static graph's record, the step count) stays on the reducer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradcomm.ddp.unused import StaticCounting

__all__ = ["Iteration"]


@dataclass(slots=True, eq=False)
class Iteration:
    """The state of the synchronised backward the reducer is armed for (or the last one)."""

    ready: bytearray
    """Per parameter: 1 once its gradient is in its bucket."""
    pending: list[int]
    """Per bucket: the gradients it still waits for (0: ready to launch)."""
    futures: list[torch.futures.Future | None]
    """Per bucket: its hook's future once launched."""
    locally_used: torch.Tensor | None
    """Flags of the parameters used on this rank, when this iteration allreduces the used-parameter map."""
    next_bucket: int = 0
    """The next bucket to launch (buckets launch strictly in order, so the ranks' collectives match)."""
    started: bool = False
    """A gradient of the armed backward has arrived."""
    finalize_queued: bool = False
    end_queued: bool = False
    end_at_first_grad: bool = False
    """Queue the end-of-backward callback at the first gradient (no output to hook: a backward in the forward)."""
    counting: StaticCounting | None = None
    """Static graph: how a gradient is counted before its parameter is ready (``None``: ready at once)."""
    unused: list[int] = field(default_factory=list)
    """Parameters known unused before backward: marked ready at its first gradient."""
    unused_at_end: bool = False
    """Parameters without a gradient are known only at the end of backward (``find_unused`` without output)."""
    first_counts: list[int] = field(default_factory=list)
    """Static graph's first iteration: the gradients each parameter received."""
    countdown: list[int] = field(default_factory=list)
    """Static graph's later iterations: the gradients each parameter still awaits before it is ready."""

    @classmethod
    def start(cls, count: int, buckets: Sequence[Any], locally_used: torch.Tensor | None) -> Iteration:
        """A backward over ``count`` parameters in ``buckets``, none ready yet."""
        return cls(
            bytearray(count),
            [len(bucket.param_indices) for bucket in buckets],
            [None] * len(buckets),
            locally_used,
        )
