"""gradcomm.DiLoCo around a DDP on hosts of several ranks: one copy of each host's pseudo-gradients crosses hosts.

Four gloo ranks stand for 2 hosts x 2 ranks, a gradcomm DDP over each host's ranks. Only each host's first rank
(the first rank of its DDP's group) takes part in the outer exchange, among the hosts' first ranks; it then
broadcasts the averaged pseudo-gradients (and the synced buffers) inside its host. So the outer exchanges'
bytes per sync, summed over all ranks, are one host's worth per host (they were one per rank: every local
rank exchanged its own copy with its peers of the same local rank), the replicas are identical after every
sync, with a compressor too, and a run resumed from each rank's state (an exchange in flight) equals the
uninterrupted one; whether the replica check runs is the host's first rank's hook's answer. A compressor
failing on a host's first rank fails every rank: that rank with CommHookError, the others, waiting for its
exchange or its broadcast, with PeerLostError. DDP groups that do not split the ranks into disjoint
replicas are refused on every rank.
"""

from __future__ import annotations

import datetime
import io
import re
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist

import gradcomm
from gradcomm.diloco import DiLoCo
from gradcomm.diloco.groups import replica_leaders_group
from gradcomm.hooks import default_hooks
from gradcomm.testing import run_on_ranks
from tests.diloco.test_diloco import _backward, _batch_norm_model, _inner
from tests.support.ranks import error_text

H = 3
QSGD = "qsgd:bucket_size=8,min_numel=0,min_compression_rate=0"


def _hosts(timeout: float | None = None) -> list[Any]:
    options = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    return [dist.new_group([0, 1], **options), dist.new_group([2, 3], **options)]


def _on_hosts(model: torch.nn.Module, hosts: list[Any]) -> torch.nn.Module:
    return gradcomm.DistributedDataParallel(model, process_group=hosts[dist.get_rank() // 2])


def _run(ddp: torch.nn.Module, diloco: DiLoCo, first: int, last: int) -> None:
    for t in range(first, last + 1):
        _backward(ddp, t)
        diloco.step()
        diloco.zero_grad()


def bytes_per_sync(compressor: str | None) -> dict[str, Any]:
    hosts = _hosts()
    model = _batch_norm_model()
    ddp = _on_hosts(model, hosts)
    diloco = DiLoCo(ddp, _inner(model), sync_every=H, compressor=compressor)
    _run(ddp, diloco, 1, 2 * H)
    flat = torch.cat([t.detach().reshape(-1).double() for t in [*model.parameters(), *model.buffers()]])
    everyone = [torch.empty_like(flat) for _ in range(4)]
    dist.all_gather(everyone, flat)
    total = diloco.comm_stats().total
    return {
        "group": dist.get_process_group_ranks(diloco.group) if diloco.group is not None else None,
        "sent": total.bytes_sent,
        "syncs": total.steps,
        "dense": sum(p.numel() * p.element_size() for p in model.parameters())
        + sum(b.numel() * b.element_size() for b in model.buffers()),
        "all_same": all(torch.equal(e, everyone[0]) for e in everyone),
    }


@pytest.mark.timeout(200)
@pytest.mark.parametrize("compressor", [None, QSGD])
def test_one_copy_per_host_crosses_hosts_per_sync(compressor: str | None) -> None:
    ranks = run_on_ranks(bytes_per_sync, 4, args=(compressor,), timeout=150, collective_timeout=30)
    dense, sent = ranks[0]["dense"], [r["sent"] for r in ranks]
    # 2 syncs, each one copy per host (2 hosts) crossing hosts, not one per rank (4)
    if compressor is None:
        assert sum(sent) == 2 * 2 * dense, (sent, dense)
    assert sent[1] == sent[3] == 0, sent
    assert sent[0] == sent[2] and 0 < sent[0] <= 2 * dense, (sent, dense)
    assert [r["group"] for r in ranks] == [[0, 2], None, [0, 2], None]
    for r in ranks:
        assert r["syncs"] == 2 and r["all_same"], r


def resumed_on_hosts() -> dict[str, Any]:
    """Straight through 10 steps, and stopped after step 6 (fragment 1's exchange in flight) to resume from
    each rank's own ``weights_only`` state in fresh DDPs and DiLoCos."""
    hosts = _hosts()
    options = dict(sync_every=4, fragments=2, overlap=1, compressor="topk:ratio=0.5")
    model = _batch_norm_model()
    ddp = _on_hosts(model, hosts)
    straight = DiLoCo(ddp, _inner(model), **options)
    _run(ddp, straight, 1, 10)

    first = _batch_norm_model()
    first_ddp = _on_hosts(first, hosts)
    inner = _inner(first)
    interrupted = DiLoCo(first_ddp, inner, **options)
    _run(first_ddp, interrupted, 1, 6)
    in_flight = sorted(interrupted._pending)
    saved = io.BytesIO()
    torch.save({"model": first.state_dict(), "inner": inner.state_dict(), "diloco": interrupted.state_dict()}, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)
    second = _batch_norm_model()
    second_ddp = _on_hosts(second, hosts)
    second_inner = _inner(second)
    resumed = DiLoCo(second_ddp, second_inner, **options)
    second.load_state_dict(loaded["model"])
    second_inner.load_state_dict(loaded["inner"])
    resumed.load_state_dict(loaded["diloco"])
    _run(second_ddp, resumed, 7, 10)
    straight_state, resumed_state = model.state_dict(), second.state_dict()  # parameters and buffers
    return {
        "in_flight": in_flight,
        "equal": all(torch.equal(straight_state[name], resumed_state[name]) for name in straight_state),
        "synced_steps": (straight.synced_steps, resumed.synced_steps),
    }


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_resume_on_hosts_equals_the_uninterrupted_run() -> None:
    for r in run_on_ranks(resumed_on_hosts, 4, timeout=150, collective_timeout=30):
        assert r["in_flight"] == [1], r
        assert r["equal"] and r["synced_steps"] == (4, 4), r


def raise_at_second_sync_on_rank_two(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    raise_at_second_sync_on_rank_two.calls += 1  # type: ignore[attr-defined]
    if dist.get_rank() == 2 and raise_at_second_sync_on_rank_two.calls == 2:  # type: ignore[attr-defined]
        raise KeyError("no codebook on rank 2")
    return default_hooks.allreduce_hook(state.group, bucket)


raise_at_second_sync_on_rank_two.calls = 0  # type: ignore[attr-defined]


def failing_on_a_host_leader() -> dict[str, str]:
    model = _batch_norm_model()
    ddp = _on_hosts(model, _hosts(timeout=5))
    state = types.SimpleNamespace(group=None)  # the hosts' first ranks' group, made by the DiLoCo
    diloco = DiLoCo(ddp, _inner(model), sync_every=H, compressor=(state, raise_at_second_sync_on_rank_two))
    state.group = diloco.group
    _run(ddp, diloco, 1, 2 * H - 1)
    return {"message": error_text(lambda: _run(ddp, diloco, 2 * H, 2 * H)), "next": error_text(diloco.state_dict)}


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_a_failing_compressor_on_a_hosts_first_rank_fails_every_rank() -> None:
    ranks = run_on_ranks(failing_on_a_host_leader, 4, timeout=150, collective_timeout=5)
    assert re.match(
        r"CommHookError: Communication hook raise_at_second_sync_on_rank_two raised on bucket 0 .*"
        r"KeyError: 'no codebook on rank 2' \(rank 2, step 6\)",
        ranks[2]["message"],
    ), ranks[2]["message"]
    assert ranks[0]["message"].startswith("PeerLostError: rank 0 lost contact with its peers during step 6"), ranks[0]
    for rank in (1, 3):  # waiting for their host's first rank's broadcast
        message = ranks[rank]["message"]
        assert message.startswith(f"PeerLostError: rank {rank} lost contact with its peers during step 6"), message
        assert "broadcasting the averaged pseudo-gradients inside the DDP's group" in message, message
    for r in ranks:
        assert r["next"].startswith("RuntimeError: gradcomm.DiLoCo.state_dict: an outer exchange failed"), r


def averaging_then_local(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages; from its second call on it declares that replicas may differ (as post-local SGD does once
    local steps start), a state that advances on the ranks that call it: the hosts' first ranks only."""
    state.calls += 1
    return default_hooks.allreduce_hook(state.group, bucket)


averaging_then_local.replicas_may_differ = lambda state: state.calls >= 2  # type: ignore[attr-defined]


def state_dependent_check() -> int:
    model = _batch_norm_model()
    ddp = _on_hosts(model, _hosts())
    state = types.SimpleNamespace(group=None, calls=0)
    diloco = DiLoCo(ddp, _inner(model), sync_every=H, compressor=(state, averaging_then_local))
    state.group = diloco.group
    _run(ddp, diloco, 1, 3 * H)
    return diloco.synced_steps


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_a_hosts_other_ranks_follow_its_first_ranks_hook_on_the_replica_check() -> None:
    """Whether the replica check runs after a sync is the hook's answer on the host's first rank: asked on
    its own never-called state, a host's other rank would run a check that no first rank joins."""
    assert run_on_ranks(state_dependent_check, 4, timeout=150, collective_timeout=10) == [3, 3, 3, 3]


def leaders_of_overlapping_ddp_groups() -> str:
    """Rank 1's DDP group (1, 2, 3) overlaps ranks 2 and 3's (2, 3): no split into replicas."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3]), dist.new_group([1, 2, 3])]
    mine = [groups[0], groups[2], groups[1], groups[1]][dist.get_rank()]
    return error_text(lambda: replica_leaders_group(types.SimpleNamespace(process_group=mine)))


@pytest.mark.timeout(120)
def test_ddp_groups_that_are_not_disjoint_replicas_are_refused_on_every_rank() -> None:
    for message in run_on_ranks(leaders_of_overlapping_ddp_groups, 4, timeout=90, collective_timeout=30):
        assert message.startswith(
            "ValueError: gradcomm.DiLoCo: the model is wrapped in a DDP, so DiLoCo works across the DDPs' groups "
            "(one replica each), but rank 0's DDP group is [0, 1] and its members' are [[0, 1], [1, 2, 3]]"
        ), message
