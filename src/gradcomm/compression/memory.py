"""Error feedback: what compression dropped this step is added back to the gradient the next step.

``compensate`` adds the stored residual to a tensor before it is compressed; ``update`` stores the new
residual ``corrected - sent`` (or ``store`` a residual computed by the caller), so that, summed over steps,
everything a rank ever put in is either sent or still held: ``sum(sent) + residual == sum(gradients)``. One
residual per compressed tensor: one gradient-sized buffer in all. :class:`ResidualMemory` adds in place, into
that buffer, which is the compensated tensor until the step's residual is stored (``discard`` drops it if the
compression failed in between).
Keys are whatever identifies a tensor from step to step (the hook uses one per parameter).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any

import torch

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


class ResidualMemory(Memory):
    """Error feedback with one residual buffer per key (Seide et al. 2014; Karimireddy et al. 2019)."""

    enabled = True

    def __init__(self) -> None:
        self.residuals: dict[Hashable, torch.Tensor] = {}

    def compensate(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        residual = self.residuals.get(key)
        if residual is None:
            return tensor
        if residual.shape != tensor.shape:
            raise ValueError(
                f"error feedback: the residual kept for {key!r} has shape {tuple(residual.shape)}, but the "
                f"tensor now under that key has shape {tuple(tensor.shape)} (a checkpoint of another model?)"
            )
        if residual.device != tensor.device or residual.dtype != tensor.dtype:
            residual = self.residuals[key] = residual.to(tensor.device, tensor.dtype)
        return residual.add_(tensor)  # the same sums as tensor + residual, without a new buffer per step

    def update(self, key: Hashable, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        residual = self.residuals.get(key)
        if residual is None or residual.shape != corrected.shape:
            self.residuals[key] = corrected - sent
        else:
            torch.sub(corrected, sent, out=residual)

    def store(self, key: Hashable, residual: torch.Tensor) -> None:
        self.residuals[key] = residual

    def discard(self, key: Hashable) -> None:
        self.residuals.pop(key, None)

    def state_dict(self) -> dict[Hashable, torch.Tensor]:
        return dict(self.residuals)

    def load_state_dict(self, state: dict[Hashable, Any]) -> None:
        # copies: compensate adds into the residuals in place, which must not change the caller's checkpoint
        self.residuals = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
