"""gradcomm.DiLoCo when a peer fails during an outer exchange, and nested in a DDP across "nodes".

A failing compressor on one rank gives it CommHookError and the other rank PeerLostError (at the group's
timeout); a killed rank gives the other PeerLostError at once. Either way the anchors still hold the last
synced parameters, loadable into a fresh model, and the DiLoCo refuses further steps. Exchanges of several
fragments overlapping in time through multi-stage hooks keep their collectives in the same order on every
rank. Nested in a DDP over each node (4 ranks, LOCAL_WORLD_SIZE=2), the node's replicas agree at every step
and all four right after each outer sync only, batch-norm buffers included, with a compressor that rounds
at random too.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import gradcomm
from gradcomm.diloco import DiLoCo
from gradcomm.hooks import default_hooks
from gradcomm.testing import RankError, run_on_ranks
from tests.diloco.test_diloco import _backward, _batch_norm_model, _inner, _model, _same_on_every_rank, _train
from tests.support.ranks import error_text

FAULT_TIMEOUT = 5


def raise_at_second_sync_on_rank_one(
    group: Any, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    raise_at_second_sync_on_rank_one.calls += 1  # type: ignore[attr-defined]
    if dist.get_rank() == 1 and raise_at_second_sync_on_rank_one.calls == 2:  # type: ignore[attr-defined]
        raise KeyError("no codebook on rank 1")
    return default_hooks.allreduce_hook(group, bucket)


raise_at_second_sync_on_rank_one.calls = 0  # type: ignore[attr-defined]


def failing_compressor() -> dict[str, Any]:
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=FAULT_TIMEOUT))
    model = _model()
    diloco = DiLoCo(
        model,
        _inner(model),
        sync_every=3,
        compressor=(group, raise_at_second_sync_on_rank_one),
        process_group=group,
    )
    _train(diloco, model, 1, 3)
    after_first_sync = {name: p.detach().clone() for name, p in model.named_parameters()}
    _train(diloco, model, 4, 5)
    out = {"message": error_text(lambda: _train(diloco, model, 6, 6))}
    fresh = _model()
    fresh.load_state_dict(diloco.synced_parameters())
    out["synced_kept"] = all(torch.equal(p, after_first_sync[name]) for name, p in fresh.named_parameters())
    out["state_dict"] = error_text(diloco.state_dict)
    out["next_step"] = error_text(lambda: _train(diloco, model, 7, 7))
    out["synced_steps"] = diloco.synced_steps
    return out


@pytest.mark.timeout(120)
def test_failing_compressor_fails_every_rank_and_keeps_the_synced_parameters() -> None:
    zero, one = run_on_ranks(failing_compressor, 2, timeout=90, collective_timeout=30)
    assert re.match(
        r"CommHookError: Communication hook raise_at_second_sync_on_rank_one raised on bucket 0 \(67 elements\): "
        r"KeyError: 'no codebook on rank 1' \(rank 1, step 6\)",
        one["message"],
    ), one["message"]
    assert zero["message"].startswith(
        "PeerLostError: rank 0 lost contact with its peers during step 6, bucket 0 (hook: raise_at_second_sync_on_rank_one)"
    ), zero["message"]
    for rank in (zero, one):
        assert rank["synced_kept"] and rank["synced_steps"] == 1, rank
        assert rank["state_dict"].startswith(
            "RuntimeError: gradcomm.DiLoCo.state_dict: an outer exchange failed"
        ), rank
        assert rank["next_step"].startswith(
            "RuntimeError: gradcomm.DiLoCo: an earlier outer exchange failed"
        ), rank
        assert "so this DiLoCo does not continue" in rank["next_step"], rank
        assert "DDP" not in rank["next_step"], rank


def killed_during_exchange() -> int:
    model = _model()
    diloco = DiLoCo(model, _inner(model), sync_every=3)
    for t in range(1, 10):
        if t == 6 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        _train(diloco, model, t, t)
    return diloco.synced_steps


@pytest.mark.timeout(120)
def test_killed_rank_fails_the_other_at_its_outer_exchange() -> None:
    with pytest.raises(RankError) as caught:
        run_on_ranks(killed_during_exchange, 2, timeout=90, collective_timeout=10)
    message = str(caught.value)
    assert caught.value.rank == 1 and "exited with code -9" in message, message
    assert re.search(
        r"rank 0: PeerLostError: rank 0 lost contact with its peers during step 6, bucket 0 \(hook: default allreduce",
        message,
    ), message


def second_stage_late_on_rank_zero(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A two-stage hook whose second allreduce starts from another thread once the first is done (as a
    completion callback on a backend thread would), late on rank 0."""
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    buffer = bucket.buffer().div_(dist.get_world_size(group))

    def second(first: torch.futures.Future[Any]) -> None:
        def launch() -> None:
            if dist.get_rank() == 0:
                time.sleep(0.5)
            mean = first.value()[0].div(dist.get_world_size(group))
            future = dist.all_reduce(mean, group=group, async_op=True).get_future()
            future.then(lambda f: result.set_result(f.value()[0]))

        threading.Thread(target=launch, daemon=True).start()

    dist.all_reduce(buffer, group=group, async_op=True).get_future().then(second)
    return result


def overlapping_two_stage_exchanges() -> int:
    """Fragment 1's exchange (launched at step 2, applied at 5) is still in its second stage on rank 0 when
    fragment 0's starts at step 4: the second must wait, or the ranks' collectives pair up wrongly."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=FAULT_TIMEOUT))
    model = _model()
    hook = second_stage_late_on_rank_zero
    diloco = DiLoCo(
        model,
        _inner(model),
        sync_every=4,
        fragments=2,
        overlap=3,
        compressor=lambda: (group, hook),
        process_group=group,
    )
    _train(diloco, model, 1, 9)
    return diloco.synced_steps


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_hooks_late_second_stage_is_not_overtaken_by_the_next_fragment() -> None:
    assert run_on_ranks(overlapping_two_stage_exchanges, 2, timeout=90, collective_timeout=30) == [3, 3]


def overlapping_compressed_exchanges() -> list[bool]:
    """Fragments whose exchanges overlap in time (fragments * overlap > sync_every) through a compressor
    (the built-in replica check off): whether each fragment agrees on every rank right after its syncs."""
    model = _model()
    overlap = 3
    options = dict(
        sync_every=4, fragments=2, overlap=overlap, compressor="bytegrad:min_numel=0", check_replicas=False
    )
    diloco = DiLoCo(model, _inner(model), **options)
    agreed = []
    for t in range(1, 14):
        _train(diloco, model, t, t)
        for fragment in diloco.fragments:
            if t > overlap and fragment.syncs_at(t - overlap):
                parts = [part.of(part.param.detach()) for part in fragment.parts]  # its own elements (0.bias is cut)
                agreed.append(_same_on_every_rank(parts))
    return agreed


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_compressed_exchanges_overlapping_in_time_keep_every_fragment_identical() -> None:
    for agreed in run_on_ranks(overlapping_compressed_exchanges, 3, timeout=90, collective_timeout=30):
        assert len(agreed) >= 4 and all(agreed), agreed


def nested_in_ddp(kind: str) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    rank = dist.get_rank()
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = _batch_norm_model()
    node = nodes[rank // 2]
    if kind.startswith("gradcomm"):
        ddp: torch.nn.Module = gradcomm.DistributedDataParallel(model, process_group=node)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=node)
    # QSGD rounds at random: the nodes' first ranks, 0 and 2, exchange, and each broadcasts the average in
    # its node
    compressor = "qsgd:bucket_size=8,min_numel=0,min_compression_rate=0" if kind.endswith("qsgd") else None
    diloco = DiLoCo(ddp, _inner(model), sync_every=3, compressor=compressor)
    out: dict[str, Any] = {
        "group": dist.get_process_group_ranks(diloco.group) if diloco.group is not None else None,
        "node_same": [],
        "all_same": [],
        "buffers_same": [],
    }
    for t in range(1, 8):
        _backward(ddp, t)
        diloco.step()
        diloco.zero_grad()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(4)]
        dist.all_gather(everyone, flat)
        out["node_same"].append(
            torch.equal(everyone[0], everyone[1]) and torch.equal(everyone[2], everyone[3])
        )
        out["all_same"].append(all(torch.equal(e, everyone[0]) for e in everyone))
        stats = torch.cat([b.detach().reshape(-1).double() for b in model.buffers()])
        buffers = [torch.empty_like(stats) for _ in range(4)]
        dist.all_gather(buffers, stats)
        out["buffers_same"].append(all(torch.equal(b, buffers[0]) for b in buffers))
    return out


@pytest.mark.timeout(200)
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gradcomm", "torch", "gradcomm-qsgd"])
def test_nested_in_a_ddp_works_across_nodes(kind: str) -> None:
    ranks = run_on_ranks(nested_in_ddp, 4, args=(kind,), timeout=150, collective_timeout=30)
    assert [r["group"] for r in ranks] == [[0, 2], None, [0, 2], None]  # the nodes' first ranks exchange
    for r in ranks:
        assert all(r["node_same"]), r
        assert r["all_same"] == [t % 3 == 0 for t in range(1, 8)], r
        # the node's buffers are its first rank's (the DDP broadcasts them at every forward): averaged across
        # the nodes from those, they are the same on all four right after a sync
        assert [same for t, same in enumerate(r["buffers_same"], 1) if t % 3 == 0] == [True, True], r
