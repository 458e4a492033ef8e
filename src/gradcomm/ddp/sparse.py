"""Sparse gradients (``nn.Embedding(..., sparse=True)``, ``nn.EmbeddingBag(..., sparse=True)``), as torch's DDP
reduces them.

A sparse gradient cannot be flattened into a bucket with others, so, as in torch, each parameter that
produces one (found the way torch finds them: it belongs to an ``Embedding``/``EmbeddingBag`` with
``sparse=True``) gets a bucket of its own whose buffer *is* the sparse gradient. The bucket goes through the
same path as the dense ones, in bucket order:

* without a hook, the gradient is divided in place by the world size and summed by an allreduce of the
  sparse tensor (gloo supports it), exactly torch's default;
* with a hook registered, the hook receives the sparse bucket too (torch does the same): ``bucket.buffer()``
  is then a sparse COO tensor, ``bucket.gradients()`` is ``[bucket.buffer()]``. torch's and gradcomm's
  ``allreduce_hook`` handle it; hooks that flatten or compress (fp16, PowerSGD, top-k, ...) expect dense
  buffers and fail on it with a :class:`~gradcomm.CommHookError` that says the bucket is sparse.

The reduced sparse tensor is copied into the parameter's ``.grad`` (``gradient_as_bucket_view`` has no
meaning for it). Models without sparse parameters never reach this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gradcomm.hooks.grad_bucket import GradBucket

__all__ = ["SparseBucket", "SparseGradBucket", "expects_sparse_gradient"]


def expects_sparse_gradient(module: nn.Module, params: Sequence[nn.Parameter]) -> list[bool]:
    """For each of ``params``, whether it belongs to a module that produces sparse gradients (torch's rule)."""
    sparse = {
        id(p)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        for p in m.parameters(recurse=False)
    }
    return [id(p) in sparse for p in params]


def _empty_sparse(param: torch.Tensor) -> torch.Tensor:
    """A sparse COO zero of ``param``'s shape (rows sparse, as an embedding's gradient)."""
    return torch.sparse_coo_tensor(
        torch.empty(1, 0, dtype=torch.int64, device=param.device),
        torch.empty(0, *param.shape[1:], dtype=param.dtype, device=param.device),
        param.shape,
        check_invariants=False,
    )


class SparseGradBucket(GradBucket):
    """The hook-facing view of a sparse bucket: one parameter, ``buffer()`` its sparse gradient."""

    __slots__ = ()

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer]

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer


class SparseBucket:
    """A bucket of one parameter with a sparse gradient; its :attr:`buffer` is that gradient this iteration."""

    sparse = True
    grads_are_views = False

    def __init__(self, index: int, param_index: int, params: Sequence[nn.Parameter], is_last: bool) -> None:
        param = params[param_index]
        self.index = index
        self.param_indices = [param_index]
        self.params = [param]
        self.is_last = is_last
        self.buffer = _empty_sparse(param)

    def take(self, grad: torch.Tensor | None, divisor: float | None, name: str) -> None:
        """Make ``grad`` (``None``: a sparse zero) this iteration's buffer; divide it in place by ``divisor``
        when the default reduction runs (torch's order: divide, then sum)."""
        if grad is None:
            self.buffer = _empty_sparse(self.params[0])
            return
        if not grad.is_sparse:
            raise RuntimeError(
                f"gradcomm.DistributedDataParallel: parameter {name} belongs to an nn.Embedding/EmbeddingBag "
                "with sparse=True, so its bucket expects a sparse gradient, but it received a dense one (was the "
                "module's sparse flag changed after wrapping?). Set sparse before wrapping the model."
            )
        if divisor is not None:
            grad.div_(divisor)
        self.buffer = grad

    def write(self, result: torch.Tensor) -> None:
        """Put the reduced ``result`` into the parameter's ``.grad`` (copied into it, as torch does)."""
        param = self.params[0]
        if param.grad is None:
            param.grad = result
        elif param.grad is not result:
            param.grad.copy_(result)

    def finite_values(self) -> torch.Tensor:
        return self.buffer._values()

    def grad_bucket(self, buffer: torch.Tensor | None = None) -> GradBucket:
        tensor = self.buffer if buffer is None else buffer
        return SparseGradBucket(self.index, tensor, [0], [tensor.numel()], [tensor.shape], self.params, self.is_last)
