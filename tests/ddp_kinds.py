"""Build torch's or gradcomm's DistributedDataParallel by name, so one test body checks both."""

from __future__ import annotations

from typing import Any

import torch

DDP_KINDS = ("torch", "gradcomm")


def make_ddp(kind: str, module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """``kind`` is "torch" (torch.nn.parallel.DistributedDataParallel) or "gradcomm"."""
    if kind == "torch":
        return torch.nn.parallel.DistributedDataParallel(module, **kwargs)
    if kind == "gradcomm":
        import gradcomm

        return gradcomm.DistributedDataParallel(module, **kwargs)
    raise ValueError(f"unknown DDP kind {kind!r}; expected one of {DDP_KINDS}")
