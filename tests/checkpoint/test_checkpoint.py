"""Checkpoints: a run stopped, saved and resumed in fresh processes equals an uninterrupted one bit for bit.

The run is post-local SGD with subgroups ([[0], [1]] at two ranks, [[0, 1], [2]] at three), momentum SGD and a periodic model
averager, stopped after the local phase has begun and between two averagings, so the model, the optimizer
state, the hook's iteration counter and the averager's step all matter. The resuming processes first try a
one-rank checkpoint, which they must refuse; this process, outside any group, refuses the three-rank one.
"""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gradcomm.checkpoint import MANIFEST, load_checkpoint, rank_file, save_checkpoint
from gradcomm.hooks.averagers import PeriodicModelAverager
from gradcomm.hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from gradcomm.testing import run_on_ranks
from tests.support.models import mlp
from tests.support.ranks import DDP_KINDS, make_ddp
from tests.support.training import flat_parameters, random_batch, train_step

SUBGROUPS = {2: [[0], [1]], 3: [[0, 1], [2]]}
# One world size per DDP kind, to spare the two shared cores; both sizes are covered.
KIND_WORLD_SIZES = [(kind, 2 if kind == "torch" else 3) for kind in DDP_KINDS]
START = 2
PERIOD = 3
STOP = 4  # after step 3 of 0..7: local phase, between the averagings after steps 2 and 5
STEPS = 8


def _model() -> torch.nn.Module:
    return mlp(6, 12, 3)



def _segment(kind: str, subgroup, first: int, last: int, save: str | None = None, load: str | None = None) -> dict:
    """Train steps ``first``..``last - 1`` from a fresh setup, loading and/or saving a checkpoint."""
    rank = dist.get_rank()
    ddp = make_ddp(kind, _model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    state = PostLocalSGDState(None, subgroup, START)
    ddp.register_comm_hook(state, post_localSGD_hook)
    averager = PeriodicModelAverager(PERIOD, START)
    if load is not None:
        checkpoint = load_checkpoint(load, ddp, optimizer, state)
        averager.load_state_dict(checkpoint["averager"])
        assert checkpoint["step"] == first
        assert state.subgroup is subgroup, "loading must keep the subgroup of the live state"
    losses = []
    for step in range(first, last):
        losses.append(train_step(ddp, optimizer, *random_batch(1000 * rank + step, 8, 6, 3)))
        averager.average_parameters(ddp.parameters())
    if save is not None:
        save_checkpoint(save, ddp, optimizer, state, averager=averager.state_dict(), step=last)
    return {"losses": losses, "params": flat_parameters(ddp), "iter": state.iter, "averager_step": averager.step}


def _rank_first_half(kind: str, path: str) -> dict:
    subgroup, _ = dist.new_subgroups_by_enumeration(SUBGROUPS[dist.get_world_size()])
    return {
        "uninterrupted": _segment(kind, subgroup, 0, STEPS),
        "first": _segment(kind, subgroup, 0, STOP, save=path),
    }


def _rank_resume(kind: str, path: str, one_rank_path: str) -> dict:
    subgroup, _ = dist.new_subgroups_by_enumeration(SUBGROUPS[dist.get_world_size()])
    try:
        _segment(kind, subgroup, STOP, STEPS, load=one_rank_path)
    except ValueError as exc:
        refusal = str(exc)
    else:
        raise AssertionError("a checkpoint of another world size was loaded")
    return {"refusal": refusal, **_segment(kind, subgroup, STOP, STEPS, load=path)}


def _save_one_rank_checkpoint(path: str) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = PostLocalSGDState(None, None, START, post_local_gradient_allreduce=False)
    save_checkpoint(path, model, optimizer, state, averager=PeriodicModelAverager(PERIOD, START).state_dict(), step=STOP)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind, world_size", KIND_WORLD_SIZES, ids=[kind for kind, _ in KIND_WORLD_SIZES])
def test_resume_in_fresh_processes_equals_uninterrupted_run_and_other_world_size_is_refused(
    kind, world_size, tmp_path
):
    path = str(tmp_path / "checkpoint")
    first = run_on_ranks(_rank_first_half, world_size, args=(kind, path), timeout=70)
    files = [os.path.basename(rank_file(path, r)) for r in range(world_size)]
    assert sorted(os.listdir(path)) == sorted([MANIFEST, *files]), "only the committed checkpoint remains"
    saved = torch.load(rank_file(path, world_size - 1), weights_only=True)
    assert saved["world_size"] == world_size and saved["step"] == STOP and saved["rank"] == world_size - 1
    assert saved["hook_state"]["iter"] == START and saved["averager"]["step"] == STOP
    assert "process_group" not in saved["hook_state"] and "subgroup" not in saved["hook_state"]

    one_rank_path = str(tmp_path / "one_rank")
    _save_one_rank_checkpoint(one_rank_path)
    resumed = run_on_ranks(_rank_resume, world_size, args=(kind, path, one_rank_path), timeout=70)
    # Another world size is refused on every rank alike: rank 0's manifest says 1 rank.
    refusal = f"was written by 1 rank, but this run has {world_size}; per-rank model, optimizer and hook state"
    for rank in range(world_size):
        assert refusal in resumed[rank]["refusal"], resumed[rank]["refusal"]
    for rank in range(world_size):
        whole = first[rank]["uninterrupted"]
        assert first[rank]["first"]["losses"] + resumed[rank]["losses"] == whole["losses"], f"rank {rank}"
        assert np.array_equal(resumed[rank]["params"], whole["params"]), f"rank {rank}: parameters differ"
        assert (resumed[rank]["iter"], resumed[rank]["averager_step"]) == (whole["iter"], whole["averager_step"])
    # The run really was in its local phase: the subgroups' replicas differ at the end.
    for members in SUBGROUPS[world_size]:
        assert all(np.array_equal(resumed[members[0]]["params"], resumed[r]["params"]) for r in members)
    assert not np.array_equal(resumed[0]["params"], resumed[world_size - 1]["params"])
    # Outside a process group this process is a one-rank run: the checkpoint is refused.
    with pytest.raises(ValueError, match=f"was written by {world_size} ranks, but this run has 1;"):
        load_checkpoint(path, _model())


def test_single_process_round_trip_and_argument_checks(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 6)).sum().backward()
    optimizer.step()
    state = PostLocalSGDState(None, None, START, post_local_gradient_allreduce=False)
    state.iter = 1
    written = save_checkpoint(tmp_path, model, optimizer, state, step=7, note="plain")
    assert written == rank_file(tmp_path, 0)
    assert torch.load(written, weights_only=True)["note"] == "plain"

    other = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    other_state = PostLocalSGDState(None, None, START, post_local_gradient_allreduce=False)
    checkpoint = load_checkpoint(tmp_path, other, other_optimizer, other_state)
    assert checkpoint["step"] == 7 and other_state.iter == 1
    assert np.array_equal(flat_parameters(other), flat_parameters(model))
    assert other_optimizer.state_dict()["state"][0]["momentum_buffer"].equal(
        optimizer.state_dict()["state"][0]["momentum_buffer"]
    )

    with pytest.raises(TypeError, match=r"averager is a PeriodicModelAverager.*save its state_dict\(\) instead"):
        save_checkpoint(tmp_path, model, averager=PeriodicModelAverager(2))
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path, model, world_size=1)
    with pytest.raises(TypeError, match="has no state_dict"):
        save_checkpoint(tmp_path, model, hook_state=object())
    save_checkpoint(tmp_path / "bare", model)
    with pytest.raises(ValueError, match="has no hook_state saved"):
        load_checkpoint(tmp_path / "bare", model, hook_state=other_state)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in .*missing.* it has no manifest.json"):
        load_checkpoint(tmp_path / "missing", model)
