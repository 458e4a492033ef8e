"""The PowerSGD hooks: what each bucket compresses, and the order of its collectives.

:func:`powerSGD_hook` compresses each worthwhile matrix of a bucket on its own (layer-wise);
:func:`batched_powerSGD_hook` compresses the whole bucket as one square matrix. Both average plainly for the
first ``start_powerSGD_iter`` iterations. The algorithm and its trade-offs are described in
:mod:`gradcomm.hooks.powerSGD_hook`.
"""

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradcomm import comm
from gradcomm.comm.futures import when_all
from gradcomm.hooks.powersgd import kernel
from gradcomm.hooks.powersgd.state import (
    BucketKeys,
    Layout,
    PowerSGDState,
    add_error,
    batched_q,
    bind_error,
    bind_q,
    claim,
    count,
    describe,
    end_of_bucket,
    layout_of,
)

__all__ = ["batched_powerSGD_hook", "powerSGD_hook"]


def _end_call(state: PowerSGDState, bucket: dist.GradBucket) -> None:
    """Count the iteration; the last bucket's call returns once the iteration's collectives are launched."""
    state.maybe_increase_iter(bucket)
    if bucket.is_last():
        state._runtime.launcher.wait_until_launched()


def _coalesces(world_size: int) -> bool:
    """Whether P and the uncompressed tensors share one allreduce, on a group of ``world_size`` ranks.

    Torch's hook allreduces them separately. On two ranks (or one) each element's sum is a single addition,
    which is commutative, so one allreduce of both gives the same bits as two. On three or more the backend
    chunks the tensor along the ring and each chunk's sum starts at another rank: moving an element to
    another offset changes the order of its additions (measured with gloo at 3 and 4 ranks: a few hundred
    elements of 10^4 differ in the last bit), so there they stay separate, as in torch.
    """
    return world_size <= 2


def _allreduce_mean(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Plain averaging, before compression starts (divided first, like torch's allreduce hook)."""
    buffer = bucket.buffer()
    group = state.process_group
    buffer.div_(comm.group_size(group))
    future = state._runtime.launcher.launch(lambda: comm.all_reduce(buffer, group), buffer.device)
    _end_call(state, bucket)
    return future


def _sum_p_then_q(
    state: PowerSGDState, p: torch.Tensor, q: torch.Tensor, compute_q: Callable[[], None]
) -> torch.futures.Future[torch.Tensor]:
    """Sum ``p`` over the ranks, then run ``compute_q`` (orthonormalize P, ``Q = M^T P`` into ``q``) and sum
    ``q``; the future completes with the summed ``q``. Both collectives keep their place in the launch order.
    """
    launcher, group = state._runtime.launcher, state.process_group
    p_summed = launcher.launch(lambda: comm.all_reduce(p, group), p.device)

    def after_p(fut: torch.futures.Future[torch.Tensor]) -> Callable[[], torch.futures.Future[torch.Tensor]]:
        fut.value()
        compute_q()
        return lambda: comm.all_reduce(q, group)

    return launcher.launch_after(p_summed, after_p, p.device)


@dataclass(frozen=True)
class _Plan:
    """How a bucket is split: batches of matrices to compress, and (offset, numel) spans sent as they are."""

    batches: tuple[kernel.Batch, ...]
    uncompressed: tuple[tuple[int, int], ...]
    numel_before: int
    numel_after: int


def _plan(state: PowerSGDState, layout: Layout) -> _Plan:
    """Torch's choice and order: compressed matrices grouped by shape, shapes in order of first appearance.

    A tensor with no rows or columns (a 0-dim scalar, an empty tensor) has rank 0 and goes with the
    uncompressed ones; torch's hook fails on 0-dim tensors with an IndexError.
    """
    by_shape: dict[tuple[int, int, int], list[int]] = {}
    uncompressed: list[tuple[int, int]] = []
    offset = before = after = 0
    for shape in layout:
        numel = math.prod(shape)
        before += numel
        n = shape[0] if len(shape) > 0 else 0
        m = numel // n if n > 0 else 0
        rank = min(n, m, state.matrix_approximation_rank)
        compressed_numel = (n + m) * rank
        if rank > 0 and compressed_numel * state.min_compression_rate < numel:
            by_shape.setdefault((n, m, rank), []).append(offset)
            after += compressed_numel
        else:
            uncompressed.append((offset, numel))
            after += numel
        offset += numel
    if state.batch_tensors_with_same_shape:
        groups = [(offsets, key) for key, offsets in by_shape.items()]
    else:
        groups = [([o], key) for key, offsets in by_shape.items() for o in offsets]
    batches = tuple(kernel.Batch(tuple(offsets), n, m, rank) for offsets, (n, m, rank) in groups)
    return _Plan(batches, tuple(uncompressed), before, after)


@dataclass(frozen=True)
class _Bound:
    """A bucket's plan and its flat buffers, whose slices are its parameters' entries in the state."""

    plan: _Plan
    q_numel: int
    error: torch.Tensor | None
    q_memory: torch.Tensor | None
    qs: list[torch.Tensor]


def _bind(state: PowerSGDState, bucket: dist.GradBucket, keys: BucketKeys) -> tuple[_Bound, bool, bool]:
    """Plan a bucket not seen in this layout yet and gather its parameters' buffers; also whether its error
    and its ``Q`` start afresh. Refuses, before anything is changed, what cannot be applied to it."""
    buffer = bucket.buffer()
    layout = layout_of(bucket)
    if sum(math.prod(shape) for shape in layout) != buffer.numel():
        raise ValueError(
            f"powerSGD_hook: bucket {bucket.index()} holds {buffer.numel()} elements but its gradients "
            f"{describe(layout)}: the gradients must tile the bucket buffer"
        )
    plan = _plan(state, layout)
    q_numel = sum(b.q_numel for b in plan.batches)
    claim(state, keys, layout)
    error, fresh_error = None, False
    if state.use_error_feedback:
        error, fresh_error = bind_error(state, keys, layout, buffer, buffer.numel())
    q_memory, qs, fresh_q = None, [], True
    if state.warm_start:
        q_memory = buffer.new_empty(q_numel)
        qs = _split_qs(plan, q_memory)
        key_at = dict(zip(itertools.accumulate((math.prod(s) for s in layout), initial=0), keys, strict=False))
        matrices = [
            (key_at[offset], q[i]) for batch, q in zip(plan.batches, qs, strict=True)
            for i, offset in enumerate(batch.offsets)
        ]
        missing = bind_q(state, matrices)
        fresh_q = len(missing) == len(matrices)
        if missing and not fresh_q:
            kernel.fill_random(missing, state.rng)
    return _Bound(plan, q_numel, error, q_memory, qs), fresh_error, fresh_q


def _split_qs(plan: _Plan, q_memory: torch.Tensor) -> list[torch.Tensor]:
    return kernel.split(q_memory, [(len(b.offsets), b.cols, b.rank) for b in plan.batches])


def powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients, each matrix compressed to rank ``state.matrix_approximation_rank``.

    Matrices worth compressing (see :class:`PowerSGDState`) are compressed layer by layer; the other
    tensors are averaged by one allreduce, on two ranks the same one as ``P`` (see :func:`_coalesces`). Plain
    averaging for the first ``state.start_powerSGD_iter`` iterations.

    Example::

        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> ddp_model.register_comm_hook(state, powerSGD_hook)
    """
    keys = state.note_bucket(bucket)  # from the first iteration on: the order of first appearance is the key
    if state.iter < state.start_powerSGD_iter:
        return _allreduce_mean(state, bucket)

    buffer = bucket.buffer()
    bound, fresh_error, fresh = state._runtime.buckets.get(keys), False, False
    if bound is None:
        bound, fresh_error, fresh = _bind(state, bucket, keys)
        state._runtime.buckets[keys] = bound
    end_of_bucket(state, bucket)
    plan = bound.plan
    count(state, bucket, plan.numel_before, plan.numel_after)

    source = add_error(bound.error, buffer, fresh_error) if bound.error is not None else buffer
    if bound.q_memory is not None:
        q_memory, qs = bound.q_memory, bound.qs
    else:
        q_memory, fresh = buffer.new_empty(bound.q_numel), True
        qs = _split_qs(plan, q_memory)
    world_size = comm.group_size(state.process_group)
    p_numel = sum(b.p_numel for b in plan.batches)
    uncompressed_numel = sum(n for _, n in plan.uncompressed)
    # P and the uncompressed tensors in one allreduce: the same sums, bit for bit, only where every element's
    # sum is one addition whatever the chunking (see _coalesces)
    coalesced = bool(plan.batches) and uncompressed_numel > 0 and _coalesces(world_size)
    p_memory = buffer.new_empty(p_numel + (uncompressed_numel if coalesced else 0))
    ps = kernel.split(p_memory, [(len(b.offsets), b.rows, b.rank) for b in plan.batches])
    matrices = [batch.matrices(source) for batch in plan.batches]

    uncompressed = None
    if uncompressed_numel:
        uncompressed = p_memory[p_numel:] if coalesced else buffer.new_empty(uncompressed_numel)
        kernel.gather(source, plan.uncompressed, uncompressed)
    kernel.prepare_qs(qs, q_memory, fresh, state.rng, state.orthogonalization_epsilon)
    for m, q, p in zip(matrices, qs, ps, strict=True):
        kernel.bmm(m, kernel.staged(q), p)

    pending: list[torch.futures.Future[torch.Tensor]] = []
    if uncompressed is not None and not coalesced:
        group = state.process_group
        pending.append(state._runtime.launcher.launch(lambda: comm.all_reduce(uncompressed, group), buffer.device))
    if plan.batches:
        epsilon = state.orthogonalization_epsilon  # the closures below must not hold the state (see comm.launcher)

        def compute_qs() -> None:
            for p in ps:
                kernel.orthogonalize(p, epsilon)
            for m, p, q in zip(matrices, ps, qs, strict=True):
                kernel.bmm(m.transpose(1, 2), kernel.staged(p), q)

        pending.append(_sum_p_then_q(state, p_memory, q_memory, compute_qs))

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        fut.value()  # re-raises a collective's error
        q_memory.div_(world_size)
        for batch, p, q, m in zip(plan.batches, ps, qs, matrices, strict=True):
            batch.decompress(p, q, m, buffer)
        if uncompressed is not None:
            kernel.scatter(uncompressed.div_(world_size), plan.uncompressed, buffer)
        if bound.error is not None:
            source.sub_(buffer)
        return buffer

    result = when_all(pending, buffer.device).then(decompress)
    _end_call(state, bucket)
    return result



@dataclass(frozen=True)
class _SquareBound:
    """A bucket's square matrix: its side and rank, its flat error buffer (``side x side``: the parameters'
    errors, then the padding's) and its warm-start ``Q``."""

    side: int
    rank: int
    error: torch.Tensor | None
    q_memory: torch.Tensor | None


def _bind_square(
    state: PowerSGDState, bucket: dist.GradBucket, keys: BucketKeys
) -> tuple[_SquareBound, bool, bool]:
    """As :func:`_bind` for :func:`batched_powerSGD_hook`; the padding's error and ``Q`` are the bucket's."""
    buffer = bucket.buffer()
    layout = layout_of(bucket)
    length = buffer.numel()
    side = kernel.square_side(length)
    rank = min(state.matrix_approximation_rank, side)
    claim(state, keys, layout)
    error, fresh_error = None, False
    if state.use_error_feedback:
        error, fresh_error = bind_error(state, keys, layout, buffer, side * side)
        padding = state.bucket_padding_error_dict.get(keys)
        if padding is not None and padding.numel() == side * side - length and not fresh_error:
            error[length:].copy_(padding)
        state.bucket_padding_error_dict[keys] = error[length:]
    q_memory, fresh_q = None, True
    if state.warm_start:
        q_memory, fresh_q = batched_q(state, keys, side * rank, buffer)
    return _SquareBound(side, rank, error, q_memory), fresh_error, fresh_q


def _square_matrix(bound: _SquareBound, buffer: torch.Tensor, fresh_error: bool) -> torch.Tensor:
    """The bucket (plus error) zero-padded to ``side x side``: the error buffer, the bucket itself, or a copy."""
    side = bound.side
    if bound.error is not None:
        return add_error(bound.error, buffer, fresh_error).view(side, side)
    if buffer.numel() == side * side:
        return buffer.view(side, side)
    padded = buffer.new_zeros(side * side)
    padded[: buffer.numel()].copy_(buffer)
    return padded.view(side, side)


def batched_powerSGD_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients, the whole bucket compressed as one zero-padded square matrix.

    Faster than :func:`powerSGD_hook` but usually much less accurate unless ``matrix_approximation_rank``
    is 1: unrelated layers share one matrix. Plain averaging for the first ``state.start_powerSGD_iter``
    iterations.

    Example::

        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> ddp_model.register_comm_hook(state, batched_powerSGD_hook)
    """
    keys = state.note_bucket(bucket)
    if state.iter < state.start_powerSGD_iter:
        return _allreduce_mean(state, bucket)

    buffer = bucket.buffer()
    bound, fresh_error, fresh = state._runtime.buckets.get(keys), False, False
    if bound is None:
        bound, fresh_error, fresh = _bind_square(state, bucket, keys)
        state._runtime.buckets[keys] = bound
    end_of_bucket(state, bucket)
    length, side, rank = buffer.numel(), bound.side, bound.rank
    count(state, bucket, length, 2 * side * rank)

    matrix = _square_matrix(bound, buffer, fresh_error)
    if bound.q_memory is not None:
        q_memory = bound.q_memory
    else:
        q_memory, fresh = buffer.new_empty(side * rank), True
    q = q_memory.view(side, rank)
    kernel.prepare_qs([q.unsqueeze(0)], q_memory, fresh, state.rng, state.orthogonalization_epsilon)
    p = torch.matmul(matrix, q)

    epsilon = state.orthogonalization_epsilon  # the closures below must not hold the state (see comm.launcher)

    def compute_q() -> None:
        kernel.orthogonalize(p.unsqueeze(0), epsilon)
        torch.matmul(matrix.t(), p, out=q)

    q_summed = _sum_p_then_q(state, p, q_memory, compute_q)
    world_size = comm.group_size(state.process_group)

    def decompress(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        fut.value()
        q.div_(world_size)
        if bound.error is not None:
            kernel.decompress_with_error(p, q, buffer, matrix, side)
        else:
            torch.matmul(p, q.t(), out=matrix)
            if matrix.data_ptr() != buffer.data_ptr():
                buffer.copy_(matrix.view(-1)[:length])
        return buffer

    result = q_summed.then(decompress)
    _end_call(state, bucket)
    return result
