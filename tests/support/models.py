"""Small models that every rank builds identically (each seeds torch's generator before it draws weights)."""

from __future__ import annotations

import torch
from torch import nn


def mlp(*widths: int, activation: type[nn.Module] = nn.Tanh, seed: int = 0) -> nn.Sequential:
    """Linear layers ``widths[0] -> widths[1] -> ...`` with ``activation`` between them, drawn after
    ``torch.manual_seed(seed)`` so that every rank starts from the same replica."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(widths[0], widths[1])]
    for i in range(1, len(widths) - 1):
        layers += [activation(), nn.Linear(widths[i], widths[i + 1])]
    return nn.Sequential(*layers)


class HeadFirst(nn.Module):
    """Registers its head first but uses it last, so DDP's rebuilt buckets differ from the initial ones."""

    def __init__(self, inputs: int = 16, hidden: int = 64, features: int = 32, outputs: int = 4) -> None:
        super().__init__()
        self.head = nn.Linear(features, outputs)
        self.body = nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, features), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class WithUnused(nn.Module):
    """``used`` takes part in every forward, ``unused`` in none (``find_unused_parameters`` territory)."""

    def __init__(self, inputs: int = 8, outputs: int = 4) -> None:
        super().__init__()
        self.used = nn.Linear(inputs, outputs)
        self.unused = nn.Linear(inputs, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)
