"""Side-by-side timing of DDPs and hooks: seeded models of a chosen shape and one timed training step.

The benchmark scripts under ``benchmarks/`` (which measure gradcomm against torch and write
``benchmarks/RESULTS.md``) build on this and on :mod:`gradcomm.bench.workloads`, so all benchmark code lives
in :mod:`gradcomm.bench`, beside the ``gradcomm bench`` command.
"""

from __future__ import annotations

import time

import torch
from torch import nn

__all__ = ["mlp", "narrow_mlp", "timed_step"]


def mlp(width: int, depth: int) -> nn.Module:
    """``depth`` square ReLU layers of ``width`` and a 10-way head, seeded: the same model in every process."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def narrow_mlp(width: int, depth: int) -> nn.Module:
    """``depth`` blocks of a square layer of ``width``, a LayerNorm and a ReLU, and a 10-way head, seeded.

    Four parameter tensors per block: at ``width=128, depth=400`` it has about as many parameters as
    :func:`mlp` ``(1000, 6)`` (6.7M) in 1602 tensors instead of 14, so a DDP's per-tensor costs dominate.
    """
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def timed_step(ddp: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """Seconds for one training step (zero_grad, forward, backward with its reduction, optimizer step)."""
    start = time.perf_counter()
    optimizer.zero_grad()
    nn.functional.cross_entropy(ddp(x), y).backward()
    optimizer.step()
    return time.perf_counter() - start
