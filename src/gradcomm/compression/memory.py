"""Error feedback: what compression dropped this step is added back to the gradient the next step.

``compensate`` adds the stored residual to a tensor before it is compressed; ``update`` stores the new
residual ``corrected - sent`` (or ``store`` a residual computed by the caller), so that, summed over steps,
everything a rank ever put in is either sent or still held: ``sum(sent) + residual == sum(gradients)``. One
residual per compressed tensor: one gradient-sized buffer in all. :class:`ResidualMemory` adds in place, into
that buffer, which is the compensated tensor until the step's residual is stored (``discard`` drops it if the
compression failed in between).
Keys are whatever identifies a tensor from step to step (the hook uses one per parameter).

A bucket compressed at once (:class:`~gradcomm.compression.base.SegmentedCompressor`) is compensated and
stored as one flat tensor (:meth:`Memory.compensate_segments`, :meth:`Memory.store_segments`):
:class:`ResidualMemory` keeps one flat residual per bucket layout, one addition per step, and its
per-parameter views are what :meth:`Memory.state_dict` holds, so a checkpoint resumes in any layout (a
layout not seen before gathers its residuals from wherever they are, once).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any

import torch

from gradcomm.compression.segments import Segments

__all__ = ["Memory", "NoMemory", "ResidualMemory"]


class Memory(ABC):
    """Where residuals of compression are kept between steps."""

    enabled: bool

    @abstractmethod
    def compensate(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` plus the residual stored for ``key``; ``tensor`` itself is not modified. The result may
        be the memory's own buffer (then the caller may overwrite it, and stores this step's residual by
        :meth:`update` or :meth:`store`, or calls :meth:`discard`)."""

    @abstractmethod
    def update(self, key: Hashable, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        """Store ``corrected - sent``: what this step's compression left out."""

    def store(self, key: Hashable, residual: torch.Tensor) -> None:
        """Store ``residual`` itself as what this step's compression left out; the memory may keep the tensor
        (the caller hands it over) rather than copy it."""
        self.update(key, residual, torch.zeros_like(residual))

    def discard(self, key: Hashable) -> None:
        """Forget ``key``'s residual: its compression failed between :meth:`compensate` and storing, so what
        is held may already include this step's tensor. By default nothing: a memory whose ``compensate``
        returns a new tensor still holds the last residual, which is right."""
        return None

    def compensate_segments(self, segments: Segments, flat: torch.Tensor) -> torch.Tensor:
        """:meth:`compensate` of every segment of ``flat`` at once (by default one by one, concatenated)."""
        views = flat.split(segments.lengths)
        parts = [
            self.compensate(key, view.view(shape))
            for key, view, shape in zip(segments.keys, views, segments.shapes, strict=True)
        ]
        if all(part.data_ptr() == view.data_ptr() for part, view in zip(parts, views, strict=True)):
            return flat
        return torch.cat([part.reshape(-1) for part in parts])

    def store_segments(self, segments: Segments, residual: torch.Tensor) -> None:
        """:meth:`store` of every segment of a flat residual (which the memory may keep)."""
        for key, view, shape in zip(segments.keys, residual.split(segments.lengths), segments.shapes, strict=True):
            self.store(key, view.view(shape))

    def discard_segments(self, segments: Segments) -> None:
        """:meth:`discard` of every segment's key."""
        for key in segments.keys:
            self.discard(key)

    def state_dict(self) -> dict[Hashable, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[Hashable, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no residuals, but was given {len(state)}")


class NoMemory(Memory):
    """No error feedback."""

    enabled = False

    def compensate(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def update(self, key: Hashable, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        pass

    def store(self, key: Hashable, residual: torch.Tensor) -> None:
        pass

    def compensate_segments(self, segments: Segments, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def store_segments(self, segments: Segments, residual: torch.Tensor) -> None:
        pass


class ResidualMemory(Memory):
    """Error feedback with one residual buffer per key (Seide et al. 2014; Karimireddy et al. 2019), or one
    flat buffer per bucket layout of keys."""

    enabled = True

    def __init__(self, describe: str = "error feedback: the residual kept for {key} has shape") -> None:
        self._describe = describe
        self._loose: dict[Hashable, torch.Tensor] = {}
        self._flats: dict[tuple[Hashable, ...], tuple[torch.Tensor, Segments]] = {}

    @property
    def residuals(self) -> dict[Hashable, torch.Tensor]:
        """Every key's residual: its own tensor, or its view of a bucket's flat residual."""
        held = dict(self._loose)
        for flat, segments in self._flats.values():
            for key, view, shape in zip(segments.keys, flat.split(segments.lengths), segments.shapes, strict=True):
                held[key] = view.view(shape)
        return held

    def _take(self, key: Hashable) -> torch.Tensor | None:
        """Remove and return ``key``'s residual; a flat one holding it is broken up into loose views."""
        if key in self._loose:
            return self._loose.pop(key)
        for keys, (flat, segments) in list(self._flats.items()):
            if key in keys:
                del self._flats[keys]
                for other, view, shape in zip(keys, flat.split(segments.lengths), segments.shapes, strict=True):
                    self._loose[other] = view.view(shape)
                return self._loose.pop(key)
        return None

    def _check(self, key: Hashable, residual: torch.Tensor, shape: torch.Size) -> None:
        if residual.shape != shape:
            raise ValueError(
                f"{self._describe.format(key=repr(key))} {tuple(residual.shape)}, but the "
                f"tensor now under that key has shape {tuple(shape)} (a checkpoint of another model?)"
            )

    def compensate(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        residual = self._take(key)
        if residual is None:
            return tensor
        self._check(key, residual, tensor.shape)
        if residual.device != tensor.device or residual.dtype != tensor.dtype or not residual.is_contiguous():
            residual = residual.to(tensor.device, tensor.dtype, memory_format=torch.contiguous_format)
        self._loose[key] = residual
        return residual.add_(tensor)  # the same sums as tensor + residual, without a new buffer per step

    def update(self, key: Hashable, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        residual = self._take(key)
        if residual is None or residual.shape != corrected.shape:
            self._loose[key] = corrected - sent
        else:
            self._loose[key] = torch.sub(corrected, sent, out=residual)

    def store(self, key: Hashable, residual: torch.Tensor) -> None:
        self._take(key)
        self._loose[key] = residual

    def discard(self, key: Hashable) -> None:
        self._take(key)

    def compensate_segments(self, segments: Segments, flat: torch.Tensor) -> torch.Tensor:
        held = self.held_segments(segments, flat)
        return flat if held is None else held.add_(flat)

    def held_segments(self, segments: Segments, like: torch.Tensor) -> torch.Tensor | None:
        """The flat residual of ``segments``' keys (zeros for a key without one), on ``like``'s device and in
        its dtype; ``None`` where no key has one. Gathered from wherever the residuals are the first time
        (another layout, a loaded state), then kept flat."""
        held = self._flats.get(segments.keys)
        if held is not None and held[1].lengths == segments.lengths and held[0].dtype == like.dtype:
            return held[0]
        parts = [self._take(key) for key in segments.keys]
        if all(part is None for part in parts):
            return None
        flat = like
        pieces = []
        for key, part, shape, length in zip(segments.keys, parts, segments.shapes, segments.lengths, strict=True):
            if part is None:
                pieces.append(flat.new_zeros(length))
            else:
                self._check(key, part, shape)
                pieces.append(part.reshape(-1).to(flat.device, flat.dtype))
        residual = torch.cat(pieces)
        self._flats[segments.keys] = (residual, segments)
        return residual

    def store_segments(self, segments: Segments, residual: torch.Tensor) -> None:
        self._flats[segments.keys] = (residual, segments)

    def discard_segments(self, segments: Segments) -> None:
        self._flats.pop(segments.keys, None)
        for key in segments.keys:
            self._take(key)

    def state_dict(self) -> dict[Hashable, torch.Tensor]:
        return self.residuals

    def load_state_dict(self, state: dict[Hashable, Any]) -> None:
        # copies: compensate adds into the residuals in place, which must not change the caller's checkpoint
        self._flats = {}
        self._loose = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
