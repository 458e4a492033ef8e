"""The end of a synchronised step: the buckets' results, the collectives after the last bucket, ``.grad``.

Shared by a real step (:meth:`~gradcomm.ddp.reducer.Reducer._finalize`) and a joined rank's shadow step
(:meth:`~gradcomm.ddp.reducer.Reducer.shadow_backward`), which must issue the same collectives in the same
order so that the ranks still training are matched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm.comm.collectives import collective_device
from gradcomm.comm.faults import reporting_lost_peers
from gradcomm.ddp.bucketing import Bucket, same_tensor
from gradcomm.ddp.hook_runner import HookRunner
from gradcomm.ddp.sparse import SparseBucket

__all__ = ["after_last_bucket", "bucket_results", "raise_first_failure", "shadow_results", "write_results"]


def bucket_results(
    runner: HookRunner,
    buckets: Sequence[Bucket | SparseBucket],
    futures: Sequence[torch.futures.Future | None],
    step: int,
) -> list[torch.Tensor]:
    """Wait for every bucket's future and check its value (a failure names the step and the bucket)."""
    return [
        runner.result(future, bucket.index, bucket.buffer, step)  # type: ignore[arg-type]
        for bucket, future in zip(buckets, futures, strict=True)
    ]


def raise_first_failure(
    runner: HookRunner,
    buckets: Sequence[Bucket | SparseBucket],
    futures: Sequence[torch.futures.Future | None],
    index: int,
    step: int,
) -> None:
    """Raise if bucket ``index``'s future, complete as soon as it was launched, failed, naming the first
    launched bucket whose future did (so that no later bucket's collectives are launched)."""
    bucket = buckets[index]
    try:
        runner.result(futures[index], index, bucket.buffer, step)  # type: ignore[arg-type]
    except BaseException:
        for earlier in buckets[:index]:
            if futures[earlier.index].done():  # type: ignore[union-attr]
                runner.result(futures[earlier.index], earlier.index, earlier.buffer, step)  # type: ignore[arg-type]
        raise


def shadow_results(runner: HookRunner, buckets: Sequence[Bucket | SparseBucket], step: int) -> list[torch.Tensor]:
    """A joined rank's buckets: the hook on zeros, every bucket launched in order, then every result."""
    launched = []
    for bucket in buckets:
        zeros = torch.zeros_like(bucket.buffer)
        launched.append((bucket, zeros, runner.launch(bucket.grad_bucket(zeros), step)))
    return [runner.result(future, bucket.index, zeros, step) for bucket, zeros, future in launched]


def after_last_bucket(
    runner: HookRunner,
    buckets: Sequence[Bucket | SparseBucket],
    results: list[torch.Tensor],
    locally_used: torch.Tensor | None,
    group: ProcessGroup | None,
    step: int,
) -> list[int] | None:
    """The collectives after the last bucket, the same in real and shadow steps: the used-parameter map
    (with ``find_unused_parameters``), then the telemetry's error pass (with ``measure_error``).

    Only after every bucket's future: a hook may launch collectives from its futures' callbacks, and these
    must not interleave with them differently on different ranks. Returns the globally-used flags.
    """
    with reporting_lost_peers(step, "after the last bucket (used-parameter map, telemetry)", group):
        globally_used = None
        if locally_used is not None:
            # a copy (on the device NCCL needs): the local flags are kept for the static-graph record
            reduced = locally_used.to(collective_device(group), copy=True)
            dist.all_reduce(reduced, group=group)
            globally_used = reduced.tolist()
        for bucket, result in zip(buckets, results, strict=True):
            runner.stats.compare_result(bucket.index, result, group)
    return globally_used


def write_results(
    buckets: Sequence[Bucket | SparseBucket], results: list[torch.Tensor], globally_used: list[int] | None
) -> None:
    """Give the parameters their reduced gradients (a parameter no rank used keeps its ``.grad``)."""
    for bucket, result in zip(buckets, results, strict=True):
        if bucket.sparse:
            if globally_used is None or globally_used[bucket.param_indices[0]]:
                bucket.write(result)
            continue
        if not same_tensor(result, bucket.buffer):
            bucket.buffer.copy_(result)
        bucket.write_gradients(globally_used)
