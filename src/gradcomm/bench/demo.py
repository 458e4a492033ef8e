"""A short distributed training run on local ranks: the smallest end-to-end use of gradcomm.

Each rank trains the same small regression MLP on its own shard of a synthetic data set with gradcomm's
DistributedDataParallel, optionally with a communication hook picked by name, and rank 0 prints the loss.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

import gradcomm
from gradcomm.testing import run_on_ranks

logger = logging.getLogger(__name__)


def _synthetic_batch(step: int, rank: int, batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.Generator().manual_seed(1234)
    weights = torch.randn(32, 1, generator=teacher) / 32**0.5
    data = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(batch_size, 32, generator=data)
    return x, torch.sin(x @ weights) + 0.05 * torch.randn(batch_size, 1, generator=data)


def train(steps: int, hook: str | None) -> list[float]:
    """Train on this rank; return the rank-averaged loss of every step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))
    ddp = gradcomm.DistributedDataParallel(model)
    if hook is not None:
        from gradcomm.hooks.registry import register_comm_hook_by_name

        register_comm_hook_by_name(ddp, hook)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        x, y = _synthetic_batch(step, dist.get_rank())
        loss = nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        averaged = loss.detach().clone()
        dist.all_reduce(averaged)
        losses.append(averaged.item() / dist.get_world_size())
    return losses


def run_demo(world_size: int = 2, steps: int = 60, hook: str | None = None) -> list[float]:
    """Spawn ``world_size`` local gloo ranks, train, print the loss every few steps; return the losses."""
    losses = run_on_ranks(train, world_size, args=(steps, hook), timeout=300)[0]
    for step, loss in enumerate(losses):
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss:.4f}")
    print(f"trained on {world_size} ranks with {hook or 'the default allreduce'}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses
