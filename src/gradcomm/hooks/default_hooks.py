"""Averaging by allreduce, in full precision or compressed to 16-bit floats.

All hooks here take a process group (``None`` for the default group) as their state and return the mean of
the bucket over the group's ranks, written into the bucket's own buffer.

* :func:`allreduce_hook` is what DDP does without a hook: it scales the bucket by ``1 / world_size`` and
  allreduces it. Registering it changes nothing (the result is bitwise identical to hook-less DDP), so it is a
  reference point and a starting place for hooks that log or inspect buckets.
* :func:`fp16_compress_hook` and :func:`bf16_compress_hook` allreduce a 16-bit copy of the bucket, halving
  the traffic of a float32 bucket. The price is precision: every rank's contribution is rounded to 11
  significant bits (fp16, unit roundoff 2**-11) or 8 (bf16, 2**-8), and so is every partial sum inside the
  allreduce. fp16 keeps more digits but only covers magnitudes from about 6e-8 (smaller values flush to
  zero) to 65504 (larger ones become ``inf``); bf16 has float32's range, so it cannot overflow or underflow
  where float32 would not, but is eight times coarser.
* :func:`fp16_compress_wrapper` and :func:`bf16_compress_wrapper` apply the same compression around any
  other hook: the wrapped hook sees a 16-bit bucket, and its result is copied back into the bucket's
  original buffer and dtype.

Differences from ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``, all deliberate:

* Averaging multiplies by ``1 / world_size`` (as DDP's built-in reduction does) rather than dividing, so
  that :func:`allreduce_hook` reproduces hook-less DDP bit for bit at every world size; torch's divides and
  differs in the last bit at world sizes that are not powers of two.
* The compress hooks divide in the bucket's own precision *before* casting to 16 bits, where torch casts
  first. That is one rounding instead of two, and in fp16 it avoids overflowing on gradients between 65504
  and ``65504 * world_size`` and losing bits of values near fp16's underflow threshold.
* The bf16 hook and wrapper run on every backend. torch's DDP refuses hooks *named* ``bf16_compress_hook``
  or ``bf16_compress_wrapper_hook`` unless CUDA and NCCL 2.10+ are present, although gloo allreduces
  bfloat16 tensors (checked with torch 2.13); so these go by other ``__name__``s.
* The wrappers' futures hold a tensor of the bucket's original dtype, as the hook contract requires; torch's
  hold the 16-bit tensor.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm import comm
from gradcomm.hooks.contract import CommHook

__all__ = [
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "mean_allreduce",
]

def _scale_to_mean(tensor: torch.Tensor, process_group: ProcessGroup | None) -> torch.Tensor:
    """Multiply ``tensor`` in place by ``1 / world_size``, the factor DDP's own reduction uses."""
    return tensor.mul_(1.0 / comm.group_size(process_group))


def _copy_into(buffer: torch.Tensor, fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    """Decompress in place: copy the future's (16-bit) result into ``buffer`` and return ``buffer``."""
    return buffer.copy_(fut.value())


def allreduce_hook(
    process_group: ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ``process_group`` with one allreduce, exactly as DDP does without a hook.

    Traffic: one allreduce of the bucket in its own dtype. Precision: that of the bucket dtype; the result is
    bitwise identical to DDP without a communication hook.

    Example::

        >>> ddp_model.register_comm_hook(process_group, allreduce_hook)
    """
    return mean_allreduce(bucket.buffer(), process_group)


def mean_allreduce(tensor: torch.Tensor, process_group: ProcessGroup | None) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` in place over ``process_group`` with one allreduce, scaled first as DDP does (what
    :func:`allreduce_hook` does to a bucket; other hooks use it on a part of theirs)."""
    return comm.all_reduce(_scale_to_mean(tensor, process_group), process_group)


def _compress_hook(
    dtype: torch.dtype, process_group: ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    compressed = _scale_to_mean(buffer, process_group).to(dtype)
    return comm.all_reduce(compressed, process_group).then(lambda fut: _copy_into(buffer, fut))


def fp16_compress_hook(
    process_group: ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket by allreducing it in ``torch.float16``, then cast back to the bucket's dtype.

    The bucket is divided by the world size, cast to float16 and allreduced; the sum is copied back into the
    bucket's buffer. Traffic: half of :func:`allreduce_hook`'s for a float32 bucket. Precision: about three
    decimal digits, relative error up to roughly ``world_size * 2**-11`` of the mean absolute gradient;
    values below ~6e-8 are lost and averaged magnitudes above 65504 overflow.

    Example::

        >>> ddp_model.register_comm_hook(process_group, fp16_compress_hook)
    """
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(
    process_group: ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket by allreducing it in ``torch.bfloat16``, then cast back to the bucket's dtype.

    As :func:`fp16_compress_hook`, with bfloat16: the same traffic, float32's range (no overflow or
    underflow), but a relative error up to roughly ``world_size * 2**-8``. Works on every backend,
    gloo included.

    Example::

        >>> ddp_model.register_comm_hook(process_group, bf16_compress_hook)
    """
    return _compress_hook(torch.bfloat16, process_group, bucket)


# torch's DDP rejects a hook named "bf16_compress_hook" unless CUDA and NCCL are present; this one runs anywhere.
bf16_compress_hook.__name__ = "gradcomm_bf16_compress_hook"


def _compress_wrapper(dtype: torch.dtype, hook: CommHook) -> CommHook:
    def compress_wrapper_hook(hook_state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        bucket.set_buffer(buffer.to(dtype))

        def decompress(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            bucket.set_buffer(buffer)
            return _copy_into(buffer, fut)

        return hook(hook_state, bucket).then(decompress)

    return compress_wrapper_hook


def fp16_compress_wrapper(hook: CommHook) -> CommHook:
    """Run ``hook`` on a ``torch.float16`` copy of the bucket and cast its result back to the bucket's dtype.

    The wrapped hook sees the compressed bucket (``bucket.buffer()`` is float16) and communicates it; its
    result is copied back into the bucket's original buffer, which the returned future holds.
    ``fp16_compress_wrapper(allreduce_hook)`` does what :func:`fp16_compress_hook` does, except that it
    divides by the world size after the cast rather than before (one more rounding).

    Example::

        >>> state = PowerSGDState(process_group=process_group, matrix_approximation_rank=1)
        >>> ddp_model.register_comm_hook(state, fp16_compress_wrapper(powerSGD_hook))
    """
    return _compress_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: CommHook) -> CommHook:
    """Run ``hook`` on a ``torch.bfloat16`` copy of the bucket and cast its result back to the bucket's dtype.

    As :func:`fp16_compress_wrapper`, with bfloat16; works on every backend.

    Example::

        >>> state = PowerSGDState(process_group=process_group, matrix_approximation_rank=1)
        >>> ddp_model.register_comm_hook(state, bf16_compress_wrapper(powerSGD_hook))
    """
    return _compress_wrapper(torch.bfloat16, hook)
