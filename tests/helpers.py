"""Small helpers shared by the test modules (importable by spawned ranks as ``tests.helpers``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

# Where the suites that compare numbers (test_properties, test_ddp_vs_torch) run. By default on CPU tensors
# over gloo, as in CI. On a machine with a GPU, GRADCOMM_TEST_DEVICE=cuda runs them on CUDA tensors (gloo's
# CUDA path, every rank on the current device); GRADCOMM_TEST_BACKEND=nccl with GRADCOMM_TEST_WORLD_SIZES=1
# runs them on a one-rank NCCL group (NCCL needs a GPU per rank).
TEST_DEVICE = torch.device(os.environ.get("GRADCOMM_TEST_DEVICE", "cpu"))
TEST_BACKEND = os.environ.get("GRADCOMM_TEST_BACKEND", "gloo")


def world_sizes_to_test(default: tuple[int, ...] = (2, 3)) -> tuple[int, ...]:
    """The world sizes to spawn: ``GRADCOMM_TEST_WORLD_SIZES`` (comma-separated) or ``default``."""
    chosen = os.environ.get("GRADCOMM_TEST_WORLD_SIZES")
    return tuple(int(n) for n in chosen.split(",")) if chosen else default


def flat_parameters(module: torch.nn.Module) -> np.ndarray:
    """The parameters as one numpy array, a copy that survives the trip back from a rank process."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy().copy()


@contextlib.contextmanager
def counting_point_to_point() -> Iterator[list[tuple[str, int, int]]]:
    """While inside, every ``dist.isend``/``dist.irecv`` is recorded as ``(kind, group peer, elements)``, in the
    order posted (gradcomm's all-gathers and all-to-alls on gloo)."""
    posted: list[tuple[str, int, int]] = []
    originals = {"isend": dist.isend, "irecv": dist.irecv}

    def counting(kind: str, post: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            posted.append((kind, int(kwargs.get("group_dst", kwargs.get("group_src"))), tensor.numel()))
            return post(tensor, *args, **kwargs)

        return counted

    for kind, post in originals.items():
        setattr(dist, kind, counting(kind, post))
    try:
        yield posted
    finally:
        for kind, post in originals.items():
            setattr(dist, kind, post)


def error_text(fn: Callable[[], Any]) -> str:
    """``"Type: message"`` of what ``fn()`` raises, or ``"no error"``; messages are asserted in the parent."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


class HeadFirst(nn.Module):
    """Registers its head first but uses it last, so DDP's rebuilt buckets differ from the initial ones."""

    def __init__(self, inputs: int = 16, hidden: int = 64, features: int = 32, outputs: int = 4) -> None:
        super().__init__()
        self.head = nn.Linear(features, outputs)
        self.body = nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, features), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))
