"""The bench's ``diloco`` on hosts of several ranks: a DDP inside each host, DiLoCo across the hosts.

Four gloo ranks in one process group stand for 2 hosts x 2 ranks through ``LOCAL_WORLD_SIZE=2``, as torchrun
sets it on each of ``gradcomm bench --nodes 2 --procs-per-node 2``'s hosts. The ranks of a host are bit for
bit identical after every step (their DDP averages every gradient), all four only right after an outer sync,
buffers included (batch norms: the CNN workload); each step hands over the DDP's allreduce inside the host,
a sync step DiLoCo's exchange too, on each host's first rank only (one copy per host crosses); and the
bench's row evaluates the synchronised parameters, the same final loss on all four ranks. On one host (the bench's local ranks) DiLoCo still runs over every rank.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradcomm.bench.methods import DiLoCoMethod, ranks_per_host
from gradcomm.bench.runner import BenchConfig, HookChoice, run_hook, solo_groups
from gradcomm.bench.workloads import WORKLOADS

H = 3
STEPS = 7


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def _gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor)
    return everyone


def two_hosts_of_two() -> dict[str, Any]:
    rank = dist.get_rank()
    solo = solo_groups()
    out: dict[str, Any] = {"flat_on_one_host": ranks_per_host(None), "flat_on_solo": None}
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out["flat_on_solo"] = ranks_per_host(solo[rank])
    workload = WORKLOADS["cnn"](device="cpu")
    torch.manual_seed(0)
    model = workload.build_model()
    trainer = DiLoCoMethod().trainer(workload, model, {"sync_every": str(H)}, 1e-3, None)
    assert trainer.ddp is not None
    out["ddp_group"] = dist.get_process_group_ranks(trainer.ddp.process_group)
    group = trainer.diloco.group
    out["diloco_group"] = dist.get_process_group_ranks(group) if group is not None else None
    floating = [b for b in model.buffers() if b.is_floating_point()]
    out.update(host_same=[], all_same=[], buffers_same=[], bytes=[])
    for step in range(STEPS):
        trainer.step(workload.batch(rank, step))
        params = _gathered(_flat(model.parameters()))
        buffers = _gathered(_flat(floating))
        out["host_same"].append(torch.equal(params[0], params[1]) and torch.equal(params[2], params[3]))
        out["all_same"].append(all(torch.equal(p, params[0]) for p in params))
        out["buffers_same"].append(all(torch.equal(b, buffers[0]) for b in buffers))
        out["bytes"].append(trainer.step_bytes()[0])
    out["dense"] = trainer.dense_bytes()[0]
    out["buffer_bytes"] = sum(b.numel() * b.element_size() for b in model.buffers())
    config = BenchConfig(workload="cnn", steps=STEPS, warmup=1, calibration_steps=1)
    run = run_hook(workload, HookChoice.parse(f"diloco:sync_every={H}"), config, solo[rank])
    out["run"] = {key: run.as_dict()[key] for key in ("bytes_per_step", "final_loss", "final_metric", "losses")}
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_diloco_on_two_hosts_nests_a_ddp_in_each_and_syncs_across() -> None:
    from gradcomm.testing import run_on_ranks

    ranks = run_on_ranks(two_hosts_of_two, 4, timeout=270, collective_timeout=60)
    synced = [(step + 1) % H == 0 for step in range(STEPS)]
    for rank, r in enumerate(ranks):
        assert r["flat_on_one_host"] is None and r["flat_on_solo"] is None  # LOCAL_WORLD_SIZE 4 = world; solo
        assert r["ddp_group"] == [[0, 1], [2, 3]][rank // 2]
        assert r["diloco_group"] == ([0, 2] if rank % 2 == 0 else None)  # the hosts' first ranks exchange
        assert all(r["host_same"]), r["host_same"]
        assert r["all_same"] == synced, r["all_same"]
        assert [same for same, at in zip(r["buffers_same"], synced, strict=True) if at] == [True] * sum(synced)
        dense, exchange = r["dense"], (r["dense"] + r["buffer_bytes"] if rank % 2 == 0 else 0)
        assert r["bytes"] == [dense + (exchange if at else 0) for at in synced]
        assert r["run"]["bytes_per_step"] == r["bytes"]
    finals = {(r["run"]["final_loss"], r["run"]["final_metric"]) for r in ranks}
    assert len(finals) == 1, finals  # the synchronised parameters and buffers, whatever each rank did since
