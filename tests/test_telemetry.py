"""Communication telemetry on gradcomm's DDPs: byte counts by hand, ratios, error pass, reset, logging, JSON lines."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradcomm
from gradcomm import comm
from gradcomm.hooks import allgather_hooks, debugging_hooks, default_hooks
from gradcomm.hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from gradcomm.testing import run_on_ranks

# Linear(10, 20) + Linear(20, 5): 220 + 105 = 325 float32 parameters, one bucket of 1300 bytes.
DENSE_BYTES = 325 * 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 20), nn.Tanh(), nn.Linear(20, 5))


def _train(ddp: Any, steps: int, legacy: bool = False) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * dist.get_rank() + step)
        loss = ddp(torch.randn(8, 10, generator=g)).pow(2).mean()
        ddp.zero_grad()
        loss.backward()
        if legacy:
            ddp.all_reduce()


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def telemetry_checks(jsonl_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, state, hook in [
        ("default", None, None),
        ("fp16", None, default_hooks.fp16_compress_hook),
        ("allgather", None, allgather_hooks.allgather_then_aggregate_hook),
        ("noop", None, debugging_hooks.noop_hook),
    ]:
        ddp = gradcomm.DistributedDataParallel(_model())
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        stats = ddp.comm_stats()
        stats.measure_error = True
        _train(ddp, 3)
        out[name] = {"last": stats.last.as_dict(), "total": stats.total.as_dict(), "hook": stats.hook_name}

    ddp = gradcomm.DistributedDataParallel(_model())
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    stats = ddp.comm_stats()
    collector = _Collect()
    logging.getLogger("gradcomm.ddp.telemetry").addHandler(collector)
    logging.getLogger("gradcomm.ddp.telemetry").setLevel(logging.INFO)
    stats.log_every = 2
    stats.jsonl_path = os.path.join(jsonl_dir, f"rank{dist.get_rank()}.jsonl")
    _train(ddp, 4)
    out["log_messages"] = collector.messages
    stats.reset()
    out["after_reset"] = stats.total.as_dict()

    legacy = gradcomm.LegacyDistributedDataParallel(_model(), world_size=dist.get_world_size())
    _train(legacy, 2, legacy=True)
    out["legacy"] = legacy.comm_stats().total.as_dict()

    # two DDPs in one process, reduced in the same backward: each counts its own hook's traffic only, PowerSGD's
    # Q (launched later, from a callback) included, and nothing launched outside the hooks
    plain, compressed = gradcomm.DistributedDataParallel(_model()), gradcomm.DistributedDataParallel(_model())
    compressed.register_comm_hook(PowerSGDState(None, start_powerSGD_iter=2), powerSGD_hook)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * dist.get_rank() + step)
        x = torch.randn(8, 10, generator=g)
        (plain(x).pow(2).mean() + compressed(x).pow(2).mean()).backward()
        comm.all_reduce(torch.ones(100)).wait()  # counted for the process, not for either DDP
    out["two_ddps"] = {"plain": plain.comm_stats().last.as_dict(), "powersgd": compressed.comm_stats().last.as_dict()}
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
def test_telemetry(tmp_path: Any, world_size: int) -> None:
    observed = run_on_ranks(telemetry_checks, world_size, args=(str(tmp_path),), timeout=150)
    for rank, out in enumerate(observed):
        default, fp16, allgather, noop = out["default"], out["fp16"], out["allgather"], out["noop"]
        assert default["last"]["bytes_sent"] == DENSE_BYTES and default["last"]["collective_calls"] == 1
        assert default["total"]["bytes_sent"] == 3 * DENSE_BYTES and default["total"]["steps"] == 3
        assert default["last"]["compression_ratio"] == 1.0 and default["last"]["compression_error"] < 1e-7
        assert fp16["last"]["bytes_sent"] == DENSE_BYTES // 2 and fp16["last"]["compression_ratio"] == 2.0
        assert 0 < fp16["last"]["compression_error"] < 1e-2, fp16["last"]
        assert fp16["hook"] == "fp16_compress_hook"
        # all-gather hands each rank's whole bucket to the collective
        assert allgather["last"]["bytes_sent"] == DENSE_BYTES and allgather["last"]["compression_error"] < 1e-6
        # noop sends nothing and keeps local gradients: infinite ratio, a real error
        assert noop["last"]["bytes_sent"] == 0 and noop["last"]["compression_ratio"] == float("inf")
        assert noop["last"]["compression_error"] > 0.01
        assert all(stat["last"]["hook_seconds"] >= 0 for stat in (default, fp16, allgather, noop))
        assert len(out["log_messages"]) == 2 and "fp16_compress_hook step 2: 650 bytes in 1 collectives" in (
            out["log_messages"][0]
        ), out["log_messages"]
        assert out["after_reset"]["steps"] == 0 and out["after_reset"]["bytes_sent"] == 0
        assert out["legacy"]["bytes_sent"] == 2 * DENSE_BYTES and out["legacy"]["steps"] == 2
        plain, powersgd = out["two_ddps"]["plain"], out["two_ddps"]["powersgd"]
        assert plain["bytes_sent"] == DENSE_BYTES and plain["collective_calls"] == 1, plain
        # rank 1: P and Q of both weights ((20 + 10) + (5 + 20) floats) and the 25 biases, in 3 collectives
        assert powersgd["bytes_sent"] == (30 + 25 + 25) * 4 and powersgd["collective_calls"] == 3, powersgd
        lines = (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["step"] for r in records] == [1, 2, 3, 4]
        assert all(r["bytes_sent"] == DENSE_BYTES // 2 and r["hook"] == "fp16_compress_hook" for r in records)


def test_sparse_tensors_count_their_indices_and_values() -> None:
    """A sparse allreduce carries indices and values, not the dense size (an embedding table's gradient)."""
    from gradcomm.comm.collectives import Traffic

    gradient = torch.sparse_coo_tensor(
        torch.tensor([[2, 7, 7]]), torch.ones(3, 4), size=(1000, 4), check_invariants=True
    )
    traffic = Traffic()
    traffic.record("all_reduce", gradient)
    assert traffic.bytes_sent == {"all_reduce": 3 * 8 + 3 * 4 * 4}  # int64 indices, float32 rows
    traffic.record("all_reduce", torch.zeros(5))
    assert traffic.total_bytes == 3 * 8 + 3 * 4 * 4 + 5 * 4
