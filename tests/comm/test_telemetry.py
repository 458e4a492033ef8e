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
from gradcomm.compression import ByteGrad
from gradcomm.hooks import allgather_hooks, debugging_hooks, default_hooks
from gradcomm.hooks.compression_hook import CompressionState, compressed_allreduce_hook
from gradcomm.hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from gradcomm.testing import run_on_ranks
from tests.support.models import mlp

# Linear(10, 20) + Linear(20, 5): 220 + 105 = 325 float32 parameters, one bucket of 1300 bytes.
DENSE_BYTES = 325 * 4
# ByteGrad's model: one 64 x 64 float32 weight, 16,384 bytes, every element compressed.
BYTEGRAD_DENSE = 64 * 64 * 4


def _model() -> nn.Module:
    return mlp(10, 20, 5)


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

    torch.manual_seed(0)
    ddp = gradcomm.DistributedDataParallel(nn.Linear(64, 64, bias=False))
    ddp.register_comm_hook(CompressionState(ByteGrad(), min_numel=0), compressed_allreduce_hook)
    for step in range(2):
        g = torch.Generator().manual_seed(10 * dist.get_rank() + step)
        ddp(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
    out["bytegrad"] = ddp.comm_stats().last.as_dict()

    # collectives on a subgroup of ranks 0 and 1 are counted with its size, next to one on the whole world
    pair = dist.new_group([0, 1])
    account = comm.Traffic()
    with comm.counting_into(account):
        if dist.get_rank() < 2:
            comm.all_reduce(torch.ones(10), pair).wait()
            comm.all_gather_into_tensor(torch.ones(3), pair).wait()
        comm.all_reduce(torch.ones(20)).wait()
    out["subgroup"] = {"by_group": sorted(account.bytes_by_group.items()), "wire": account.wire_bytes}

    ddp = gradcomm.DistributedDataParallel(_model())
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    stats = ddp.comm_stats()
    collector = _Collect()
    logging.getLogger("gradcomm.comm.telemetry").addHandler(collector)
    logging.getLogger("gradcomm.comm.telemetry").setLevel(logging.INFO)
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
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_telemetry(tmp_path: Any, world_size: int) -> None:
    observed = run_on_ranks(telemetry_checks, world_size, args=(str(tmp_path),), timeout=150)
    for rank, out in enumerate(observed):
        default, fp16, allgather, noop = out["default"], out["fp16"], out["allgather"], out["noop"]
        assert default["last"]["bytes_sent"] == DENSE_BYTES and default["last"]["collective_calls"] == 1
        assert default["total"]["bytes_sent"] == 3 * DENSE_BYTES and default["total"]["steps"] == 3
        assert default["last"]["handed_ratio"] == 1.0 and default["last"]["wire_ratio"] == 1.0
        assert default["last"]["wire_bytes"] == default["last"]["dense_wire_bytes"] == pytest.approx(
            2 * (world_size - 1) / world_size * DENSE_BYTES
        )
        assert default["last"]["compression_error"] < 1e-7
        assert fp16["last"]["bytes_sent"] == DENSE_BYTES // 2
        assert fp16["last"]["handed_ratio"] == 2.0 and fp16["last"]["wire_ratio"] == pytest.approx(2.0)
        assert 0 < fp16["last"]["compression_error"] < 1e-2, fp16["last"]
        assert fp16["hook"] == "fp16_compress_hook"
        # all-gather hands each rank's whole bucket to the collective, which sends it to W - 1 peers where an
        # allreduce sends 2(W - 1)/W of it: the same on the wire at W = 2, 1.5 times more at W = 3
        assert allgather["last"]["bytes_sent"] == DENSE_BYTES and allgather["last"]["compression_error"] < 1e-6
        assert allgather["last"]["handed_ratio"] == 1.0
        assert allgather["last"]["wire_ratio"] == pytest.approx(2 / world_size)
        assert allgather["total"]["wire_ratio"] == pytest.approx(2 / world_size)
        # ByteGrad: the weight in W rows of ceil(4096 / W) codes and a float32 minimum and maximum each; all W
        # rows to the all-to-all, which sends (W - 1)/W of them, then the mean row to the all-gather, sent W - 1
        # times: handed (W + 1) rows, on the wire 2(W - 1) rows against 2(W - 1)/W of the dense weight
        row = -(-4096 // world_size) + 8
        bytegrad = out["bytegrad"]
        assert bytegrad["bytes_by_kind"] == {"all_to_all": world_size * row, "all_gather": row}, bytegrad
        assert bytegrad["handed_ratio"] == pytest.approx(BYTEGRAD_DENSE / ((world_size + 1) * row))
        assert bytegrad["wire_bytes"] == pytest.approx(2 * (world_size - 1) * row)
        assert bytegrad["wire_ratio"] == pytest.approx(BYTEGRAD_DENSE / (world_size * row))
        if world_size == 2:
            assert bytegrad["handed_ratio"] == pytest.approx(2.656, abs=1e-3)  # 16384 / 6168
            assert bytegrad["wire_ratio"] == pytest.approx(3.984, abs=1e-3)  # 16384 / 4112
        subgroup = out["subgroup"]
        if rank < 2:
            expected = [(("all_gather", 2), 12), (("all_reduce", 2), 40), (("all_reduce", world_size), 80)]
            if world_size == 2:
                expected = [(("all_gather", 2), 12), (("all_reduce", 2), 120)]
            pair_wire = 40 + 12
        else:
            expected, pair_wire = [(("all_reduce", world_size), 80)], 0
        assert [(tuple(key), n) for key, n in subgroup["by_group"]] == expected, subgroup
        assert subgroup["wire"] == pytest.approx(pair_wire + 2 * (world_size - 1) / world_size * 80)
        # noop sends nothing and keeps local gradients: infinite ratios, a real error
        assert noop["last"]["bytes_sent"] == 0 and noop["last"]["handed_ratio"] == float("inf")
        assert noop["last"]["wire_ratio"] == float("inf")
        assert noop["last"]["compression_error"] > 0.01
        assert all(stat["last"]["hook_seconds"] >= 0 for stat in (default, fp16, allgather, noop))
        assert len(out["log_messages"]) == 2 and (
            "fp16_compress_hook step 2: 650 bytes in 1 collectives (handed ratio 2.00, wire ratio 2.00)"
        ) in out["log_messages"][0], out["log_messages"]
        assert out["after_reset"]["steps"] == 0 and out["after_reset"]["bytes_sent"] == 0
        assert out["legacy"]["bytes_sent"] == 2 * DENSE_BYTES and out["legacy"]["steps"] == 2
        plain, powersgd = out["two_ddps"]["plain"], out["two_ddps"]["powersgd"]
        assert plain["bytes_sent"] == DENSE_BYTES and plain["collective_calls"] == 1, plain
        # rank 1: P and Q of both weights ((20 + 10) + (5 + 20) floats) and the 25 biases, in 3 collectives, or
        # in 2 on two ranks, where the biases share P's allreduce (hooks/powersgd/hook.py)
        calls = 2 if world_size == 2 else 3
        assert powersgd["bytes_sent"] == (30 + 25 + 25) * 4 and powersgd["collective_calls"] == calls, powersgd
        lines = (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["step"] for r in records] == [1, 2, 3, 4]
        assert all(r["bytes_sent"] == DENSE_BYTES // 2 and r["hook"] == "fp16_compress_hook" for r in records)
        assert all(r["handed_ratio"] == 2.0 and r["wire_ratio"] == pytest.approx(2.0) for r in records)


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


def test_wire_bytes_use_each_collective_s_group_size() -> None:
    """Without a process group a call counts on a group of 1 (nothing on the wire) unless its size is given."""
    traffic = comm.Traffic()
    traffic.record("all_reduce", torch.zeros(10))
    traffic.record("all_reduce", torch.zeros(10), group_size=4)
    traffic.record("all_gather", torch.zeros(5), group_size=2)
    traffic.record("all_to_all", torch.zeros(8), group_size=8)
    assert traffic.bytes_sent == {"all_reduce": 80, "all_gather": 20, "all_to_all": 32}
    assert traffic.bytes_by_group == {("all_reduce", 1): 40, ("all_reduce", 4): 40, ("all_gather", 2): 20,
                                      ("all_to_all", 8): 32}
    assert traffic.wire_bytes == pytest.approx(0 + 1.5 * 40 + 20 + 32 * 7 / 8)
    # the single-size form, for callers that know their collectives all ran on one group
    assert comm.wire_bytes({"all_reduce": 40, "all_gather": 20}, 4) == pytest.approx(1.5 * 40 + 3 * 20)
    assert comm.group_wire_bytes({("all_reduce", 4): 40, ("all_gather", 4): 20}) == pytest.approx(1.5 * 40 + 3 * 20)
    traffic.reset()
    assert traffic.bytes_by_group == {} and traffic.wire_bytes == 0
