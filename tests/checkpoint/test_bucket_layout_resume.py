"""Resuming gradcomm's DDP with per-bucket hook state: the checkpoint carries the bucket layout.

The model registers its head before its body but uses the body first, so the buckets rebuilt after the first
iteration (gradient-ready order) differ from the initial ones (reverse registration order). PowerSGD keeps
error feedback and warm-start matrices per bucket: a resumed run must reduce in the original run's rebuilt
buckets from its first step, which :func:`gradcomm.checkpoint.load_checkpoint` arranges.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import gradcomm
from gradcomm.checkpoint import load_checkpoint, save_checkpoint
from gradcomm.hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from gradcomm.testing import run_on_ranks
from tests.support.models import HeadFirst
from tests.support.training import flat_parameters, random_batch, train_step

STEPS, STOP = 8, 4




def _setup() -> tuple[Any, torch.optim.Optimizer, PowerSGDState]:
    torch.manual_seed(0)
    ddp = gradcomm.DistributedDataParallel(HeadFirst(), bucket_cap_mb=0.004)
    state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5)
    ddp.register_comm_hook(state, powerSGD_hook)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), state


def _steps(ddp: Any, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    return [train_step(ddp, optimizer, *random_batch(100 * dist.get_rank() + step, 8, 16, 4)) for step in steps]


def uninterrupted_and_first_half(path: str) -> dict[str, Any]:
    ddp, optimizer, _ = _setup()
    initial_layout = ddp.reducer.bucket_parameter_names()
    losses = _steps(ddp, optimizer, range(STEPS))
    full = {"losses": losses, "params": flat_parameters(ddp), "initial": initial_layout,
            "rebuilt": ddp.reducer.bucket_parameter_names()}
    ddp, optimizer, state = _setup()
    _steps(ddp, optimizer, range(STOP))
    save_checkpoint(path, ddp, optimizer, state)
    return full


def resumed(path: str) -> dict[str, Any]:
    ddp, optimizer, state = _setup()
    load_checkpoint(path, ddp, optimizer, state)
    layout = ddp.reducer.bucket_parameter_names()
    return {"losses": _steps(ddp, optimizer, range(STOP, STEPS)), "params": flat_parameters(ddp), "layout": layout}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_powersgd_resumes_bit_for_bit_on_gradcomm_ddp(tmp_path: Any) -> None:
    path = str(tmp_path / "checkpoint")
    full = run_on_ranks(uninterrupted_and_first_half, 2, args=(path,), timeout=120)
    again = run_on_ranks(resumed, 2, args=(path,), timeout=120)
    assert full[0]["initial"] != full[0]["rebuilt"], "the test needs a rebuild that changes the buckets"
    for rank in range(2):
        assert again[rank]["layout"] == full[rank]["rebuilt"]
        assert again[rank]["losses"] == full[rank]["losses"][STOP:], rank
        assert np.array_equal(again[rank]["params"], full[rank]["params"]), rank
