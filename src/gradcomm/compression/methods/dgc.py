"""Deep Gradient Compression: top-k sparsification with momentum correction and momentum factor masking.

Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression: Reducing the Communication Bandwidth for Distributed
Training", ICLR 2018, https://arxiv.org/abs/1712.01887 (Algorithm 1 with momentum correction, section 3.1).

Per tensor, each rank keeps a momentum buffer ``u`` and an accumulation buffer ``v``, zero at first. With ``g``
this step's local gradient, ``m`` the momentum and ``k = ceil(ratio * numel)`` (at least one)::

    u = m * u + g              momentum correction: momentum is accumulated locally, before sparsification
    v = v + u                  local accumulation of everything not sent yet
    send v at the k largest |v|   values and indices; the ranks' messages are averaged
    u[sent] = v[sent] = 0      momentum factor masking: a sent coordinate restarts from zero

Top-k of the accumulated gradient alone (:class:`~gradcomm.compression.methods.topk.TopK` with error
feedback) delays most coordinates by many steps, and an optimizer's momentum applied after the exchange then
works on a sparse, stale signal; DGC accumulates the velocity instead, so what is sent (summed over steps) is
what momentum SGD would have applied, and masking keeps the stale momentum of a just-sent coordinate from
pushing it again. With ``momentum=0`` it is exactly top-k with error feedback.

Trade-offs and use:

* The momentum lives here, so train with an optimizer **without** momentum (``torch.optim.SGD(...,
  momentum=0)``); keeping both applies momentum twice. Tensors the hook sends dense (fewer than its
  ``min_numel`` elements, or compressed fewer than ``min_compression_rate`` times) bypass this class and get
  no momentum; ``min_numel=1, min_compression_rate=0`` routes every tensor through it.
* ``v`` is DGC's error feedback: the declared policy is :attr:`ErrorFeedback.UNSUPPORTED`, so the hook adds
  no residual of its own by default and refuses ``error_feedback=True`` (a second residual would add back
  what ``v`` still holds, counting every unsent value twice).
* Memory: two gradient-sized buffers per compressed tensor, in the gradient's dtype (top-k with error
  feedback keeps one). State is keyed by the hook's per-parameter key (the ``stream(key)`` scope, as for
  :class:`~gradcomm.compression.base.RandomizedCompressor`), so it follows its parameter when DDP rebuilds
  its buckets, and :meth:`DGC.state_dict` checkpoints it (``torch.load(weights_only=True)``-safe) for an exact
  resume. Called outside any ``stream`` scope, all tensors share the key ``None``: one tensor per instance.
* Selection is exact and identical to :class:`TopK`'s
  (:func:`~gradcomm.compression._numerics.top_magnitudes`): DGC's sampled threshold estimate only narrows
  the candidates of a ``topk`` on the CPU; k itself never varies with the values, because payload sizes here
  must depend on the shape alone. DGC's local gradient clipping, its
  exponential sparsity warm-up and the Nesterov variant are left out.
* Wire format and traffic are top-k's: k values in the gradient's dtype plus k int32 indices (int64 beyond
  2**31 elements), all-gathered (coordinates differ between ranks) and averaged in rank order.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Hashable
from typing import Any

import torch

from gradcomm.compression.base import ErrorFeedback, Payload, tensor_stream
from gradcomm.compression.communicators import ALLGATHER
from gradcomm.compression.memory import ResidualMemory
from gradcomm.compression.methods.topk import SparseSegments
from gradcomm.compression.segment_sparse import segment_topk
from gradcomm.compression.segment_stats import constant
from gradcomm.compression.segments import Segments

__all__ = ["DGC"]

_BUFFERS = ("momentum", "accumulation")
_DESCRIBE = "DGC: the buffers kept for {key} have shape"


class DGC(SparseSegments, name="dgc", summary="Deep Gradient Compression: momentum-corrected top-k"):
    """Send the ``ceil(ratio * numel)`` (at least one) largest coordinates of each tensor's accumulated
    momentum-corrected gradient; see the module docstring. A bucket's buffers are kept as one flat tensor each
    (per-parameter copies in :meth:`state_dict`).

    Args:
        ratio: fraction of each tensor's coordinates sent per step, in (0, 1]; DGC's final density is 0.001.
        momentum: the momentum factor ``m``, in [0, 1); 0 is top-k with error feedback.
    """

    communicator = ALLGATHER
    error_feedback = ErrorFeedback.UNSUPPORTED

    def __init__(self, ratio: float = 0.001, momentum: float = 0.9):
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
            raise ValueError(f"DGC: ratio must be a number in (0, 1], got {ratio!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0 <= momentum < 1:
            raise ValueError(f"DGC: momentum must be a number in [0, 1), got {momentum!r}")
        self.ratio = ratio
        self.momentum = momentum
        self._momentum = ResidualMemory(_DESCRIBE)
        self._accumulation = ResidualMemory(_DESCRIBE)

    def k(self, numel: int) -> int:
        """Number of coordinates sent of a tensor of ``numel`` elements."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def stream(self, key: Hashable) -> contextlib.AbstractContextManager[None]:
        """Scope in which :meth:`compress` reads and updates the buffers of the tensor ``key``: the context
        variable :class:`~gradcomm.compression.base.RandomizedCompressor` sets, so each thread sees its own."""
        return tensor_stream(key)

    def compress_segments(self, flat: torch.Tensor, segments: Segments) -> tuple[Payload, torch.Tensor]:
        u = self._momentum.held_segments(segments, flat)
        v = self._accumulation.held_segments(segments, flat)
        # Updated in place (a new bucket-sized tensor every step cost more than the arithmetic: fresh pages),
        # the two buffers the rows of one (2, n) tensor, so that one index_fill_ masks both; state_dict()
        # copies, so an earlier one keeps its values. A step that fails midway drops the bucket's buffers
        # rather than keep half an update (as error feedback drops its residual).
        try:
            both = _rows_of_one(u, v)
            if both is None:  # the first step, or buffers loaded: one (2, n) tensor from now on
                both = torch.empty((2, flat.numel()), dtype=flat.dtype, device=flat.device)
                if u is None or self.momentum == 0:
                    both[0].copy_(flat)
                else:
                    both[0].copy_(u).mul_(constant(self.momentum, flat.dtype, flat.device)).add_(flat)
                if v is None:
                    both[1].copy_(both[0])
                else:
                    both[1].copy_(v).add_(both[0])
                u, v = both[0], both[1]
            else:
                if self.momentum == 0:
                    u.copy_(flat)
                else:
                    u.mul_(constant(self.momentum, u.dtype, u.device)).add_(flat)
                v.add_(u)
            indices = segment_topk(v, self.budget(segments))
            payload = self.payload(v, indices, segments)
            both.index_fill_(1, indices, 0)
            self._momentum.store_segments(segments, u)
            self._accumulation.store_segments(segments, v)
        except BaseException:
            self._momentum.discard_segments(segments)
            self._accumulation.discard_segments(segments)
            raise
        return payload, indices

    # -- checkpointing -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"momentum": {key: u}, "accumulation": {key: v}}``: tensors keyed by the hook's tensor keys."""
        return {
            "momentum": {key: u.clone() for key, u in self._momentum.residuals.items()},
            "accumulation": {key: v.clone() for key, v in self._accumulation.residuals.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != set(_BUFFERS):
            raise ValueError(f"DGC: state must have the entries {list(_BUFFERS)}, got {sorted(state)}")
        momentum, accumulation = dict(state["momentum"]), dict(state["accumulation"])
        if set(momentum) != set(accumulation):
            raise ValueError(
                f"DGC: state has momentum for keys {sorted(map(repr, momentum))} but accumulation for "
                f"{sorted(map(repr, accumulation))}"
            )
        for key in momentum:
            u, v = momentum[key], accumulation[key]
            if not isinstance(u, torch.Tensor) or not isinstance(v, torch.Tensor) or u.shape != v.shape:
                raise ValueError(f"DGC: the state of {key!r} must be two tensors of one shape")
        self._momentum.load_state_dict(momentum)
        self._accumulation.load_state_dict(accumulation)


def _rows_of_one(u: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor | None:
    """The ``(2, n)`` tensor whose rows ``u`` and ``v`` are, if they are (as :meth:`DGC.compress_segments`
    keeps them)."""
    base = None if u is None or v is None else u._base
    if base is None or v._base is not base or base.dim() != 2 or base.shape[0] != 2 or not base.is_contiguous():
        return None
    if u.data_ptr() != base.data_ptr() or v.data_ptr() != base[1].data_ptr() or u.numel() != base.shape[1]:
        return None
    return base
