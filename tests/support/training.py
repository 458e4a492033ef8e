"""Seeded batches, one training step, and parameters and gradients as arrays a rank can hand back."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def random_batch(seed: int, rows: int, inputs: int, outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard normal inputs ``[rows, inputs]`` and targets ``[rows, outputs]`` drawn from ``seed`` alone, so
    a rank (with its rank in the seed) or a resumed run draws the same batch again."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, inputs, generator=generator), torch.randn(rows, outputs, generator=generator)


def linear_target_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """16 inputs of 20 features and a learnable target (a fixed linear map of them, 5 outputs): the loss of a
    method that trains falls."""
    x = torch.randn(16, 20, generator=generator)
    return x, x[:, :5] - x[:, 5:10]


def train_step(ddp: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward, zero the gradients, backward (the DDP reduces), optimizer step; the step's MSE loss."""
    loss = nn.functional.mse_loss(ddp(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def flat_parameters(module: nn.Module) -> np.ndarray:
    """The parameters as one numpy array (from any device), a copy that survives the trip back from a rank
    process."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).cpu().numpy().copy()


def flat_gradients(module: nn.Module) -> np.ndarray:
    """The ``.grad`` of every parameter as one numpy array (from any device), a copy that later steps leave
    alone."""
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()]).cpu().numpy().copy()
