"""The bucket a communication hook receives: torch's ``GradBucket`` API, in Python.

A bucket is a flat 1-D tensor holding the gradients of several parameters back to back. Hooks written for
torch's DDP use only the methods below, so they run unchanged on gradcomm's DDPs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["GradBucket"]


class GradBucket:
    """One bucket of flattened gradients, as handed to ``hook(state, bucket)``.

    The buffer holds the local (not yet averaged) gradients: a hook that averages must divide by the world
    size itself.
    """

    __slots__ = ("_buffer", "_index", "_is_last", "_lengths", "_offsets", "_parameters", "_shapes")

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        offsets: Sequence[int],
        lengths: Sequence[int],
        shapes: Sequence[torch.Size],
        parameters: Sequence[torch.nn.Parameter],
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._offsets = offsets
        self._lengths = lengths
        self._shapes = shapes
        self._parameters = parameters
        self._is_last = is_last

    def index(self) -> int:
        """Position of this bucket in the order buckets are reduced (0 is reduced first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D tensor of this bucket's gradients."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """One view into :meth:`buffer` per parameter, shaped like the parameter."""
        return [
            self._buffer[offset : offset + length].view(shape)
            for offset, length, shape in zip(self._offsets, self._lengths, self._shapes, strict=True)
        ]

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients this bucket holds, in buffer order."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the iteration (the one reduced last)."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the tensor that :meth:`buffer` and :meth:`gradients` return, as torch's ``set_buffer`` does.

        The reducer's own storage is untouched: what counts is the tensor in the hook's returned future.
        """
        if buffer.numel() != self._buffer.numel():
            raise ValueError(
                f"GradBucket {self._index}: set_buffer got a tensor of {buffer.numel()} elements, but the "
                f"bucket holds {self._buffer.numel()}"
            )
        self._buffer = buffer

    def __repr__(self) -> str:
        return (
            f"GradBucket(index={self._index}, numel={self._buffer.numel()}, dtype={self._buffer.dtype}, "
            f"parameters={len(self._parameters)}, is_last={self._is_last})"
        )
