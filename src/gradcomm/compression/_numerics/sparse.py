"""Sparse payloads, values at indices (top-k, DGC, random-k): selection, scattering and their means.

No host synchronisation on accelerators: the selections :func:`top_magnitudes` and :func:`random_subset` take
their faster, data-dependent paths only on the CPU, where ``topk`` and ``randperm`` over a whole tensor for a
few percent of it are slow.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "add_in_rank_order",
    "dense_rows",
    "index_dtype",
    "random_subset",
    "rank_offsets",
    "sample_stride",
    "sparse_nonzero",
    "top_magnitudes",
    "zero_at",
    "zeros_in",
]


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest index dtype for a tensor of ``numel`` elements: int32, or int64 above 2**31 - 1."""
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


_SAMPLE = 4096
"""Magnitudes sampled by :func:`top_magnitudes` to estimate its threshold."""


def sample_stride(numel: int) -> int:
    """The stride of :func:`top_magnitudes`' sample of a flat tensor of ``numel`` elements: about ``numel /
    4096``, and odd. Weights are row-major matrices whose rows are mostly powers of two long, and an even stride
    visits a few columns of them only: where the gradient's magnitude differs by column (an MLP's output
    projection: each column scaled by one hidden unit's activation), the threshold came out far too low (10x
    the candidates needed, in the transformer workload's training). An odd stride visits every column."""
    return (numel // _SAMPLE) | 1


def top_magnitudes(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest ``|flat|`` (NaN counting as largest, as in ``torch.topk``), in no order.

    The set is ``torch.topk``'s (up to the choice among equal magnitudes at the k-th place). On the CPU a
    large tensor goes a faster way (a full ``topk`` is costly per element there): the magnitude at
    the ``2k``-th place of an evenly strided sample of about 4096 (:func:`sample_stride`) estimates a
    threshold, every element not below it is a candidate, and the top k of the candidates are the top k of all
    when there are at least k of them (otherwise, rarely, the full ``topk`` runs). Where the threshold is 0
    (a mostly zero tensor: an embedding's gradient, say), every element would be a candidate: the candidates
    are the elements above it, and where fewer than k are, the first zeros make up the rest. The sample needs
    no random draws, so ranks compute it alike; only the amount of work depends on the values, never the
    result's size.
    """
    magnitudes = flat.abs()
    stride = sample_stride(magnitudes.numel())
    if flat.device.type != "cpu" or stride < 16 or k > magnitudes.numel() // 4:
        return magnitudes.topk(k, sorted=False).indices
    sample = magnitudes[::stride]
    place = min(sample.numel(), -(-2 * k * sample.numel() // magnitudes.numel()) + 1)
    # a Python number, not a 0-dim tensor: compared with one, into int8, the mask is written faster
    threshold = sample.topk(place, sorted=True).values[-1].item()
    mostly_zero = threshold == 0
    below = (torch.le if mostly_zero else torch.lt)(
        magnitudes, threshold, out=torch.empty(magnitudes.shape, dtype=torch.int8)
    )
    candidate = below.view(torch.bool).logical_not_()  # NaN is never below: a candidate
    candidates = sparse_nonzero(candidate) if 64 * k <= magnitudes.numel() else candidate.nonzero().squeeze(1)
    if candidates.numel() >= k:
        return candidates[magnitudes[candidates].topk(k, sorted=False).indices]
    if mostly_zero:  # every nonzero element, then zeros: the first k elements hold enough of them
        zeros = candidate[:k].logical_not().nonzero().squeeze(1)[: k - candidates.numel()]
        return torch.cat([candidates, zeros])
    return magnitudes.topk(k, sorted=False).indices


def sparse_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """The indices of a flat boolean ``mask``'s true elements in ascending order, as ``mask.nonzero()``, faster
    where they are few: ``nonzero`` first finds the 8-byte words holding any (a scan of an eighth of the
    elements), then searches those words alone: faster at low densities, slower at high ones. The ``j``-th
    word found, at word ``w``, holds bytes ``8 j ..`` of the words found and ``8 w ..`` of the mask."""
    length = mask.numel()
    head = length - length % 8
    if mask.storage_offset() % 8 or not mask.is_contiguous():
        mask = mask.clone()
    all_words = mask.view(torch.int64) if head == length else mask[:head].view(torch.int64)
    words = all_words.nonzero().view(-1)
    found = all_words.index_select(0, words).view(torch.bool).nonzero().view(-1)
    shifts = words.sub_(_counting(words.numel(), words.device)).mul_(8)  # 8 (w - j) of each word found
    indices = found.add_(shifts.index_select(0, found.div(8, rounding_mode="floor")))
    if head == length:
        return indices
    return torch.cat([indices, mask[head:].nonzero().squeeze(1).add_(head)])


_COUNTING: dict[torch.device, torch.Tensor] = {}


def _counting(count: int, device: torch.device) -> torch.Tensor:
    """``arange(count)`` (int64), a view of one kept per device and grown as needed: read it only."""
    counting = _COUNTING.get(device)
    if counting is None or counting.numel() < count:
        counting = _COUNTING[device] = torch.arange(max(2 * count, 1024), device=device)
    return counting[:count]


def random_subset(numel: int, k: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``k`` distinct indices of ``range(numel)``, a uniformly random subset in random order (as
    ``randperm(numel)[:k]``, whose cost grows with ``numel`` however small ``k`` is).

    On the CPU, for ``k`` up to a quarter of ``numel``: draws with replacement, and the first ``k`` distinct
    draws in drawing order (sequential rejection sampling: each new index is uniform over those not drawn yet),
    at a cost that grows with ``k``. The draws depend only on the generator, so ranks sharing a seed agree.
    """
    if device.type != "cpu" or 4 * k > numel:
        return torch.randperm(numel, generator=generator, device=device)[:k]
    draws = torch.empty(0, dtype=torch.int64, device=device)
    while True:  # one round but for about one time in a million
        more = torch.randint(numel, (k + k // 8 + 16,), generator=generator, device=device)
        draws = torch.cat([draws, more])
        distinct, which = torch.unique(draws, return_inverse=True)
        if distinct.numel() >= k:
            break
    positions = torch.arange(draws.numel(), device=device)
    first = torch.full_like(distinct, draws.numel()).scatter_reduce_(0, which, positions, "amin")
    return distinct[first.argsort()[:k]]


def zero_at(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``tensor`` with the elements at flat ``indices`` set to 0: in place (and returned) where it is
    contiguous, else in a contiguous copy."""
    tensor = tensor.contiguous()
    return tensor.view(-1).index_fill_(0, indices.long(), 0).view(tensor.shape)


def zeros_in(out: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``numel`` zeros of ``dtype``, flat: ``out`` zeroed where it is contiguous with that size and dtype (a
    decoder's ``out``, the gradient's place in its bucket), else a new tensor."""
    if out is not None and out.is_contiguous() and out.numel() == numel and out.dtype == dtype:
        return (out if out.dim() == 1 else out.view(-1)).zero_()  # ``out`` itself where flat: a caller may keep it
    return torch.zeros(numel, dtype=dtype, device=device)


@functools.lru_cache(maxsize=32)
def rank_offsets(
    world: int, stride: int, device: torch.device, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """``stride * r`` for each rank ``r``, a ``(world, 1)`` column (made once per world size, stride, device
    and dtype: read it, never write it)."""
    return torch.arange(0, world * stride, stride, dtype=dtype, device=device).view(world, 1)


def add_in_rank_order(total: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``total`` (flat, zeros) plus every rank's ``values`` at its ``indices`` (``(world, k)`` each, indices
    distinct within a rank), added rank after rank. On the CPU one ``index_add_`` of all ranks' values, which
    adds them in index order (rank after rank). Elsewhere ``index_add_`` adds in no set order: one per rank
    (:func:`_per_rank`), ``world`` small calls where a dense row per rank would cost a pass over the bucket
    each, and its memory."""
    if values.device.type == "cpu":
        return total.index_add_(0, indices.view(-1), values.view(-1))
    return _per_rank(total, indices, values)


def _per_rank(total: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """:func:`add_in_rank_order` off the CPU: one ``index_add_`` per rank, in rank order."""
    for rank in range(values.shape[0]):
        total.index_add_(0, indices[rank], values[rank])
    return total


def dense_rows(indices: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """Every rank's sparse values made dense: ``(world, numel)`` zeros but ``values[r]`` at ``indices[r]`` in
    row ``r`` (indices distinct within a rank), by one ``index_put_``."""
    world = values.shape[0]
    rows = values.new_zeros(world, numel)
    places = torch.add(indices, rank_offsets(world, numel, indices.device, torch.int64))
    rows.view(-1).index_put_((places.view(-1),), values.reshape(-1))
    return rows
