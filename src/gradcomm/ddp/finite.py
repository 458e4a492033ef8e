"""``check_finite``: refuse to send a gradient bucket that holds NaN or infinity, naming the parameter."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gradcomm.comm.faults import NonFiniteGradientError
from gradcomm.ddp.bucketing import Bucket
from gradcomm.ddp.sparse import SparseBucket

__all__ = ["check_bucket_finite"]


def check_bucket_finite(bucket: Bucket | SparseBucket, names: Sequence[str], step: int) -> None:
    """Raise :class:`~gradcomm.comm.faults.NonFiniteGradientError` before ``bucket`` is sent if it holds NaN
    or infinity, naming the first such parameter (``names``: every parameter's name, by index) and the rank."""
    if bool(torch.isfinite(bucket.finite_values() if bucket.sparse else bucket.buffer).all()):
        return
    offending = []
    views = [bucket.finite_values()] if bucket.sparse else bucket.views
    for index, view in sorted(zip(bucket.param_indices, views, strict=True), key=lambda item: item[0]):
        finite = torch.isfinite(view)
        if not bool(finite.all()):
            nans = int(torch.isnan(view).sum())
            offending.append((names[index], nans, int((~finite).sum()) - nans, view.numel()))
    name, nans, infs, numel = offending[0]
    others = [item[0] for item in offending[1:]]
    also = f" (also non-finite in this bucket: {', '.join(others[:5])}{' ...' if len(others) > 5 else ''})"
    rank = dist.get_rank()
    raise NonFiniteGradientError(
        f"gradcomm.DistributedDataParallel(check_finite=True): rank {rank} has a non-finite gradient for "
        f"parameter {name!r} ({nans} NaN and {infs} infinite of {numel} values) in step "
        f"{step}{also if others else ''}. Its bucket {bucket.index} was not sent; the "
        "other ranks fail with a lost-contact error when the process group's timeout passes. Find the "
        f"cause on rank {rank} (learning rate, loss scale, an input holding NaN) and resume from the last "
        "checkpoint."
    )

