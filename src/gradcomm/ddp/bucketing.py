"""Assigning parameters to gradient buckets.

Gradients are reduced in buckets of a few MB: large enough that each collective is efficient, small enough
that the first buckets can be sent while backward is still computing the rest. The layouts are torch's DDP's,
bucket for bucket (:func:`initial_buckets` before the first iteration, :func:`assign_buckets` in the observed
ready order after it), grouped by dtype and device, since a bucket is one flat tensor. Also here: the
:class:`Bucket` itself, with the checks that let ``.grad`` be views of it by default.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradcomm.ddp.grad_hooks import after_accumulation
from gradcomm.ddp.staging import StagedWrites
from gradcomm.hooks.grad_bucket import GradBucket

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_FIRST_BUCKET_BYTES",
    "Bucket",
    "assign_buckets",
    "initial_buckets",
    "bucket_size_limits",
    "bucket_size_list",
    "same_tensor",
]

DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
"""torch's default for the first bucket: small, so the first collective starts early in backward."""

_MB = 1024 * 1024


def bucket_size_limits(bucket_cap_mb: float | None) -> tuple[int, int]:
    """(first bucket limit, limit of the others) in bytes, as torch's DDP derives them.

    With the default cap the first bucket is limited to 1 MB; with an explicit cap every bucket uses it.
    """
    if bucket_cap_mb is None:
        return DEFAULT_FIRST_BUCKET_BYTES, int(DEFAULT_BUCKET_CAP_MB * _MB)
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    cap = max(1, int(bucket_cap_mb * _MB))
    return cap, cap


def bucket_size_list(bucket_cap_mb_list: Sequence[float] | None) -> list[int] | None:
    """torch's ``bucket_cap_mb_list`` in bytes (``None`` or empty: not given)."""
    if not bucket_cap_mb_list:
        return None
    if any(cap <= 0 for cap in bucket_cap_mb_list):
        raise ValueError(f"bucket_cap_mb_list must hold positive sizes in MB, got {list(bucket_cap_mb_list)}")
    return [max(1, int(cap * _MB)) for cap in bucket_cap_mb_list]


def initial_buckets(
    tensors: Sequence[torch.Tensor],
    first_limit: int,
    limit: int,
    *,
    one_per_kind: bool,
    limits: Sequence[int] | None = None,
    alone: Sequence[bool] | None = None,
) -> list[list[int]]:
    """The buckets before the first iteration, as torch's DDP lays them out.

    Assigned in registration order (``first_limit`` applies to the first registered parameters), then the
    list of buckets reversed, so that the last registered parameters, whose gradients usually come first,
    are in bucket 0; within a bucket, registration order. With ``one_per_kind`` (torch, unless
    ``find_unused_parameters`` without a static graph) every (dtype, device) gets one bucket: the first
    iteration is not overlapped, and the buckets are rebuilt in the observed order after it. ``limits``
    (``bucket_cap_mb_list``) applies in every case. The same layout as torch's matters beyond the first step
    wherever buckets are not rebuilt (``find_unused_parameters``), for hooks that work on whole buckets, and
    from 3 ranks on for the last bits of a ring allreduce, which depend on an element's offset.
    """
    if one_per_kind and not limits:
        first_limit = limit = sys.maxsize
    groups = assign_buckets(tensors, range(len(tensors)), first_limit, limit, limits=limits, alone=alone)
    return groups[::-1]


@dataclass
class _OpenBucket:
    indices: list[int] = field(default_factory=list)
    nbytes: int = 0
    closed_count: int = 0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def assign_buckets(
    tensors: Sequence[torch.Tensor],
    order: Sequence[int],
    first_limit: int,
    limit: int,
    *,
    size: Callable[[torch.Tensor], int] = _nbytes,
    strict: bool = False,
    limits: Sequence[int] | None = None,
    alone: Sequence[bool] | None = None,
) -> list[list[int]]:
    """Group ``tensors`` (visited in ``order``) into buckets; return each bucket's tensor indices.

    Per (dtype, device), a bucket is closed as soon as its size (``size``: bytes by default) reaches its
    limit: ``first_limit`` for the first bucket of that kind, ``limit`` after; a tensor larger than the limit
    closes the bucket it joins. This is torch's ``_compute_bucket_assignment_by_size``, tested against it.
    With ``strict`` (fairseq's legacy DDP, whose buffers have a fixed size) a bucket is closed *before* a
    tensor that would take it past the limit instead, and a tensor larger than ``limit`` gets a bucket of its
    own. Buckets are returned in the order of their first tensor in ``order``, so they become ready one after
    another.

    ``limits`` (torch's ``bucket_cap_mb_list``) replaces the two limits by one per bucket of a kind: the
    ``k``-th uses ``limits[k]``, the last applies to the rest. ``alone`` marks tensors that get a bucket of
    their own whatever their size (sparse gradients).
    """

    def cap(closed_count: int) -> int:
        if limits:
            return limits[min(closed_count, len(limits) - 1)]
        return first_limit if closed_count == 0 else limit

    position = {index: pos for pos, index in enumerate(order)}
    open_buckets: dict[tuple[torch.dtype, torch.device], _OpenBucket] = {}
    closed: list[list[int]] = []

    def close(bucket: _OpenBucket) -> None:
        closed.append(bucket.indices)
        bucket.indices, bucket.nbytes = [], 0
        bucket.closed_count += 1

    for index in order:
        if alone is not None and alone[index]:
            closed.append([index])
            continue
        tensor = tensors[index]
        bucket = open_buckets.setdefault((tensor.dtype, tensor.device), _OpenBucket())
        nbytes = size(tensor)
        current_limit = cap(bucket.closed_count)
        oversized = nbytes > (max(limits) if limits else limit)
        if strict and bucket.indices and (oversized or bucket.nbytes + nbytes > current_limit):
            close(bucket)
        bucket.indices.append(index)
        bucket.nbytes += nbytes
        if bucket.nbytes >= cap(bucket.closed_count):
            close(bucket)
    closed.extend(bucket.indices for bucket in open_buckets.values() if bucket.indices)
    closed.sort(key=lambda indices: position[indices[0]])
    return closed


def _references(views: list[torch.Tensor], k: int) -> int:
    """``sys.getrefcount`` of ``views[k]``: compared with :data:`_UNHELD_VIEW_REFS`, measured the same way on
    a tensor held by nothing but its list (the absolute count is an interpreter detail)."""
    return sys.getrefcount(views[k])


_UNHELD_VIEW_REFS = _references([torch.empty(0)], 0)


def _references_as_checked(grad: torch.Tensor) -> int:
    """``sys.getrefcount`` at the same call depth as in :func:`grad_held_elsewhere` (each frame that binds
    the tensor counts), for the calibration below."""
    return sys.getrefcount(grad)


@functools.cache
def _unheld_grad_references() -> int:
    """The reference count :func:`grad_held_elsewhere` sees for a ``.grad`` nobody else holds, read as the
    reducer reads it (a local ``grad = param.grad`` in its hook, :func:`~gradcomm.ddp.grad_hooks.after_accumulation`),
    measured once on a one-element parameter (the absolute count is an interpreter and torch detail)."""
    param = torch.nn.Parameter(torch.zeros(1))
    seen: list[int] = []

    def measure(_grad_inputs: Any, _grad_outputs: Any) -> None:
        grad = param.grad
        seen.append(_references_as_checked(grad))

    _handle, _accumulator = after_accumulation(param, measure)
    with torch.enable_grad():
        param.sum().backward()
    return seen[0]


def grad_held_elsewhere(grad: torch.Tensor) -> bool:
    """Whether a parameter's ``.grad`` tensor (not a bucket view), read into a local ``grad = param.grad``
    in a post-accumulate-grad hook and passed here, is also held by someone else (the user): torch's copies
    would give it the reduced values, so it must not be swapped for a view. Call
    :func:`prepare_grad_references` first, outside any backward."""
    return sys.getrefcount(grad) > _unheld_grad_references()


def prepare_grad_references() -> None:
    """Measure the reference count :func:`grad_held_elsewhere` compares with (a tiny backward, once)."""
    _unheld_grad_references()


def _storage_refs(tensor: torch.Tensor) -> int:
    """How many tensors (views, ``.data`` aliases) share ``tensor``'s memory."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class Bucket:
    """A flat gradient buffer for some parameters, with one view per parameter.

    ``grads_are_views``: the parameters' ``.grad`` are made views of the buffer (no copy back after the
    reduction). Where that is only the default, not asked for (``gradient_as_bucket_view=None``), the reducer
    asks :meth:`seen_by_user` before the first write of a step and :meth:`renew` s the buffer if the user
    still holds a ``.grad`` of the last step, so that it keeps its values as with torch's copies.
    """

    sparse = False

    def __init__(
        self,
        index: int,
        param_indices: list[int],
        params: Sequence[torch.nn.Parameter],
        is_last: bool,
        grads_are_views: bool = False,
    ):
        members = [params[i] for i in param_indices]
        self.index = index
        self.param_indices = param_indices
        self.params = members
        self.is_last = is_last
        self.grads_are_views = grads_are_views
        self.lengths = [p.numel() for p in members]
        self.offsets = [sum(self.lengths[:k]) for k in range(len(members))]
        self.shapes = [p.shape for p in members]
        self._handed_out_refs: int | None = None
        self.nbytes = [length * members[0].element_size() for length in self.lengths]
        self.copy_back: set[int] = set()  # this step: positions whose .grad the user holds (torch's copies)
        self.staged = StagedWrites(self)  # gradients on their way into the buffer
        self.renew()

    def renew(self) -> None:
        """Give the bucket fresh memory (zeros) and views; the old buffer is left to whoever holds it."""
        first = self.params[0]
        self.buffer = torch.zeros(sum(self.lengths), dtype=first.dtype, device=first.device)
        self.views = [
            bucket_view(self.buffer, offset, param) for offset, param in zip(self.offsets, self.params, strict=True)
        ]
        self._handed_out_refs = None

    def handed_out(self) -> None:
        """Note that the views are now the parameters' ``.grad`` (the end of a synchronised step)."""
        self._handed_out_refs = _storage_refs(self.buffer)

    def seen_by_user(self) -> bool:
        """Whether a ``.grad`` handed out at the last step is still held although it is no longer the
        parameter's ``.grad`` (the optimizer's ``zero_grad`` set it to ``None``), or an alias of the buffer
        (``.grad.data``, a view of ``.grad``) was taken since: writing into the buffer would change it."""
        if self._handed_out_refs is None:
            return False
        if _storage_refs(self.buffer) > self._handed_out_refs:
            return True
        views = self.views
        for k, param in enumerate(self.params):
            if param.grad is not views[k] and _references(views, k) > _UNHELD_VIEW_REFS:
                return True
        return False

    def take_gradient(self, position: int, scale: float | None, by_default: bool, first: bool) -> bool:
        """Take the ``.grad`` of the parameter at ``position`` (``None``: zeros) on its way into the buffer,
        multiplied by ``scale`` if given, and make ``.grad`` the parameter's view (``grads_are_views``).

        ``by_default``: views are only the default (``gradient_as_bucket_view=None``), so a ``.grad`` the
        user holds keeps receiving the results (:attr:`copy_back`), and before the step's ``first`` write a
        ``.grad`` of the last step still held makes the bucket :meth:`renew` itself. Returns whether the
        gradient was part of a graph (``backward(create_graph=True)``): as torch, the bucket takes its value,
        outside the graph.
        """
        if first and self.seen_by_user():
            self.renew()
            logger.debug("bucket %d: a .grad of the last step is still held; the bucket gets new memory", self.index)
        view = self.views[position]
        param = self.params[position]
        grad = param.grad
        in_graph = False
        if grad is None:
            view.zero_()
        else:
            in_bucket = grad is view or same_tensor(grad, view)
            if self.grads_are_views and not in_bucket:
                if by_default and grad_held_elsewhere(grad):
                    self.copy_back.add(position)  # the user holds this .grad: torch's copy back into it
                else:
                    param.grad = view
            if grad.requires_grad:
                grad, in_graph = grad.detach(), True
            if in_bucket:
                grad = None
        self.staged.put(position, grad, scale)
        return in_graph

    def write_gradients(self, globally_used: list[int] | None) -> None:
        """Give the parameters their reduced gradients (the buffer, reduced): the views (``grads_are_views``,
        except at :attr:`copy_back` positions) or copies of them into the existing ``.grad`` tensors, with one
        call per bucket. A parameter no rank used (``globally_used[index]`` false, with
        ``find_unused_parameters``) keeps its ``.grad``, as in torch."""
        positions = range(len(self.params))
        if globally_used is not None:
            positions = [k for k in positions if globally_used[self.param_indices[k]]]
        copy_back, self.copy_back = self.copy_back, set()
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for k in positions:
            param, view = self.params[k], self.views[k]
            grad = param.grad
            if grad is None:
                param.grad = view if self.grads_are_views else view.clone()
            elif self.grads_are_views and k not in copy_back:
                if grad is not view and not same_tensor(grad, view):
                    param.grad = view
            else:
                targets.append(grad)
                sources.append(view)
        if targets:
            torch._foreach_copy_(targets, sources)

    def grad_bucket(self, buffer: torch.Tensor | None = None) -> GradBucket:
        """A fresh hook-facing view of this bucket (``set_buffer`` on it must not outlive the iteration);
        ``buffer`` replaces the bucket's own (a zero bucket for a joined rank's shadow step)."""
        return GradBucket(
            self.index,
            self.buffer if buffer is None else buffer,
            self.offsets,
            self.lengths,
            self.shapes,
            self.params,
            self.is_last,
        )


def bucket_view(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """``param``'s gradient's place in ``buffer`` from ``offset``, laid out as torch's reducer lays it out: in the
    parameter's own memory order where its elements are dense in memory (a transposed weight, a channels-last
    kernel), as ``AccumulateGrad`` makes its gradient; C-contiguous otherwise. The buffer's bytes are then
    torch's, so are gloo's sums of them and what a hook reads through ``bucket.gradients()`` (torch's
    reinterpretation of those bytes in the parameter's shape)."""
    if param.is_contiguous() or not _dense_in_memory(param):
        return buffer[offset : offset + param.numel()].view(param.shape)
    return buffer.as_strided(param.shape, param.stride(), buffer.storage_offset() + offset)


def _dense_in_memory(tensor: torch.Tensor) -> bool:
    """torch's ``is_non_overlapping_and_dense``: the elements fill ``numel`` consecutive places of memory, in
    some order of the dimensions."""
    expected = 1
    dims = zip(tensor.stride(), tensor.shape, strict=True)
    for stride, size in sorted((stride, size) for stride, size in dims if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same memory seen the same way (a gradient already in its bucket)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
