"""Post-local SGD and the periodic model averager: phases, agreement with torch, ranks kept identical.

One spawned group per world size runs every scenario on both DDP kinds and returns per-step losses and
parameters; the assertions run here. Subgroups are given explicitly ([[0], [1]] at two ranks: local only;
[[0, 1], [2]] at three) so the post-local phase differs from global averaging on one machine.
"""

import inspect
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_post_local
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers

from gradcomm import comm
from gradcomm.hooks.averagers import PeriodicModelAverager
from gradcomm.hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from gradcomm.testing import run_on_ranks
from tests.support.models import mlp
from tests.support.ranks import DDP_KINDS, make_ddp
from tests.support.training import flat_parameters, random_batch, train_step

START = 3
PERIOD = 2
STEPS = 9
SUBGROUPS = {2: [[0], [1]], 3: [[0, 1], [2]]}
# Several buckets, so the iteration count must come from is_last(); torch 2.13 starts with one bucket
# unless find_unused_parameters is set.
SEVERAL_BUCKETS = dict(bucket_cap_mb=0.0002, find_unused_parameters=True)


def _model() -> torch.nn.Module:
    return mlp(6, 12, 3)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(1000 * rank + step, 8, 6, 3)



def _optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)


def _train(kind, hook, state, averager, **ddp_kwargs) -> dict:
    """Train STEPS steps with ``hook`` and ``averager``; per-step losses, parameters and traffic."""
    rank = dist.get_rank()
    ddp = make_ddp(kind, _model(), **ddp_kwargs)
    buckets: list[int] = []

    def counting_hook(hook_state, bucket):
        buckets[-1] += 1
        return hook(hook_state, bucket)

    ddp.register_comm_hook(state, counting_hook)
    optimizer = _optimizer(ddp)
    out = {"losses": [], "params": [], "all_reduce_calls": [], "iter": [], "buckets": buckets}
    for step in range(STEPS):
        before = comm.traffic.calls.get("all_reduce", 0)
        buckets.append(0)
        loss = train_step(ddp, optimizer, *_batch(rank, step))
        averager.average_parameters(ddp.parameters())
        out["losses"].append(loss)
        out["params"].append(flat_parameters(ddp))
        out["all_reduce_calls"].append(comm.traffic.calls.get("all_reduce", 0) - before)
        out["iter"].append(state.iter)
    return out


def _averages_at(step: int) -> bool:
    return step >= START and (step - START) % PERIOD == 0


def _reference(group_after, post_local: bool = True) -> dict:
    """The algorithm by hand, without DDP: mean gradients over WORLD, then over ``group_after``."""
    rank = dist.get_rank()
    model = _model()
    optimizer = _optimizer(model)
    params = list(model.parameters())
    out = {"losses": [], "params": []}
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        group = dist.group.WORLD if step < START else group_after
        if step < START or post_local:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            flat /= dist.get_world_size(group)
            dist.all_reduce(flat, group=group)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        optimizer.step()
        if _averages_at(step):
            flat = torch.cat([p.detach().reshape(-1) for p in params]) / dist.get_world_size()
            dist.all_reduce(flat)
            offset = 0
            with torch.no_grad():
                for p in params:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        out["losses"].append(loss.item())
        out["params"].append(flat_parameters(model))
    return out


def _rank_post_local_one_kind(kind: str, built_before_init: PostLocalSGDState) -> dict:
    world_size = dist.get_world_size()
    subgroup, _ = dist.new_subgroups_by_enumeration(SUBGROUPS[world_size])
    runs = {}
    runs["ours"] = _train(
        kind,
        post_localSGD_hook,
        PostLocalSGDState(None, subgroup, START),
        PeriodicModelAverager(PERIOD, START),
        **SEVERAL_BUCKETS,
    )
    runs["torch"] = _train(
        kind,
        torch_post_local.post_localSGD_hook,
        torch_post_local.PostLocalSGDState(None, subgroup, START),
        torch_averagers.PeriodicModelAverager(PERIOD, START),
        **SEVERAL_BUCKETS,
    )
    runs["reference"] = _reference(subgroup)
    # Local only: no subgroup is created or needed.
    local_state = PostLocalSGDState(None, None, START, post_local_gradient_allreduce=False)
    assert local_state.subgroup is None
    runs["ours_local"] = _train(kind, post_localSGD_hook, local_state, PeriodicModelAverager(PERIOD, START))
    runs["torch_local"] = _train(
        kind,
        torch_post_local.post_localSGD_hook,
        torch_post_local.PostLocalSGDState(None, None, START, post_local_gradient_allreduce=False),
        torch_averagers.PeriodicModelAverager(PERIOD, START),
    )
    runs["reference_local"] = _reference(None, post_local=False)
    # Default subgroup: the intra-node one, which on one machine is every rank, created on first use by a
    # state built in the test's process, where no process group exists (as Lightning builds it).
    assert built_before_init.subgroup is None
    runs["ours_default"] = _train(
        kind, post_localSGD_hook, built_before_init, PeriodicModelAverager(PERIOD, START)
    )
    runs["default_subgroup_ranks"] = dist.get_process_group_ranks(built_before_init.subgroup)
    runs["reference_global"] = _reference(dist.group.WORLD)

    # Pickling leaves both groups out; the state dict holds only plain values.
    state = PostLocalSGDState(None, subgroup, START)
    state.iter = 2
    restored = pickle.loads(pickle.dumps(state))
    assert (restored.process_group, restored.subgroup, restored.iter) == (None, None, 2)
    fresh = PostLocalSGDState(None, subgroup, START)
    fresh.load_state_dict(state.state_dict())
    assert fresh.subgroup is subgroup and fresh.iter == 2
    return runs


def _rank_post_local(built_before_init: dict[str, PostLocalSGDState]) -> dict[str, dict]:
    """Every scenario on each DDP kind in turn, in one group (a spawn per kind cost more than its scenarios)."""
    return {kind: _rank_post_local_one_kind(kind, built_before_init[kind]) for kind in DDP_KINDS}


def _ranks_equal(run_by_rank: list[dict], ranks: list[int], step: int) -> bool:
    first = run_by_rank[ranks[0]]["params"][step]
    return all(np.array_equal(first, run_by_rank[r]["params"][step]) for r in ranks[1:])


def _assert_same_run(a: dict, b: dict, exact: bool) -> None:
    if exact:
        assert a["losses"] == b["losses"]
        for step, (pa, pb) in enumerate(zip(a["params"], b["params"], strict=True)):
            assert np.array_equal(pa, pb), f"parameters differ after step {step}"
    else:
        np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.stack(a["params"]), np.stack(b["params"]), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}")
def results_by_kind(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, dict]]]:
    assert not dist.is_initialized()
    built_before_init = {kind: PostLocalSGDState(None, None, START) for kind in DDP_KINDS}
    return request.param, run_on_ranks(_rank_post_local, request.param, args=(built_before_init,), timeout=170)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", DDP_KINDS)
def test_post_local_sgd_phases_and_agreement_with_reference_hook(kind, results_by_kind):
    world_size, by_rank = results_by_kind
    results = [r[kind] for r in by_rank]
    runs = {name: [r[name] for r in results] for name in results[0]}
    everyone = list(range(world_size))

    for rank in everyone:
        # Bit for bit like torch's hook and averager on the same DDP; like the hand-written algorithm.
        _assert_same_run(runs["ours"][rank], runs["torch"][rank], exact=True)
        _assert_same_run(runs["ours_local"][rank], runs["torch_local"][rank], exact=True)
        _assert_same_run(runs["ours"][rank], runs["reference"][rank], exact=False)
        _assert_same_run(runs["ours_local"][rank], runs["reference_local"][rank], exact=False)
        _assert_same_run(runs["ours_default"][rank], runs["reference_global"][rank], exact=False)
        assert runs["ours"][rank]["iter"] == [min(step + 1, START) for step in range(STEPS)]
        assert runs["default_subgroup_ranks"][rank] == everyone
    assert min(runs["ours"][0]["buckets"]) > 1, "the iteration count was not tested with several buckets"

    for step in range(STEPS):
        if step < START or _averages_at(step):
            for name in ("ours", "ours_local", "ours_default"):
                assert _ranks_equal(runs[name], everyone, step), f"{name}: ranks differ after step {step}"
            continue
        for members in SUBGROUPS[world_size]:
            assert _ranks_equal(runs["ours"], members, step), f"subgroup {members} differs after step {step}"
        assert not _ranks_equal(runs["ours"], [0, world_size - 1], step)
        assert not _ranks_equal(runs["ours_local"], everyone, step)
        assert _ranks_equal(runs["ours_default"], everyone, step)

    # Local only: after the warm-up the hook sends nothing; the averager one all-reduce per period.
    calls = runs["ours_local"][0]["all_reduce_calls"]
    assert all(c >= 1 for c in calls[:START])
    assert calls[START:] == [1 if _averages_at(s) else 0 for s in range(START, STEPS)]


def test_hook_signature_follows_the_contract():
    parameters = inspect.signature(post_localSGD_hook).parameters
    assert parameters["bucket"].annotation is dist.GradBucket
    assert inspect.signature(post_localSGD_hook).return_annotation == torch.futures.Future[torch.Tensor]


def test_state_without_process_group_pickles_and_round_trips_weights_only(tmp_path):
    state = PostLocalSGDState(None, None, start_localSGD_iter=5, post_local_gradient_allreduce=False)
    state.iter = 4
    restored = pickle.loads(pickle.dumps(state))
    assert (restored.iter, restored.start_localSGD_iter, restored.post_local_gradient_allreduce) == (4, 5, False)
    torch.save(state.state_dict(), tmp_path / "state.pt")
    loaded = PostLocalSGDState(None, None, start_localSGD_iter=0, post_local_gradient_allreduce=False)
    loaded.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert (loaded.iter, loaded.start_localSGD_iter) == (4, 5)
    with pytest.raises(ValueError, match="start_localSGD_iter must be >= 0"):
        PostLocalSGDState(None, None, start_localSGD_iter=-1, post_local_gradient_allreduce=False)


def test_default_subgroup_needs_a_process_group_at_first_use():
    state = PostLocalSGDState(None, None, start_localSGD_iter=0)
    assert state.subgroup is None
    with pytest.raises(RuntimeError, match=r"intra-node subgroup \(subgroup=None\) is created on first use.*"
                       r"init_process_group"):
        state.post_local_group()


def test_averager_schedule_checks_and_state_dict(tmp_path):
    averager = PeriodicModelAverager(period=3, warmup_steps=4)
    expected = [s >= 4 and (s - 4) % 3 == 0 for s in range(12)]
    assert [averager.averages_at(s) for s in range(12)] == expected
    averager.step = 7
    torch.save(averager.state_dict(), tmp_path / "averager.pt")
    other = PeriodicModelAverager(period=3, warmup_steps=4)
    other.load_state_dict(torch.load(tmp_path / "averager.pt", weights_only=True))
    assert (other.step, other.period, other.warmup_steps) == (7, 3, 4)
    assert pickle.loads(pickle.dumps(averager)).step == 7
    with pytest.raises(ValueError, match="period must be >= 1"):
        PeriodicModelAverager(period=0)
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        PeriodicModelAverager(period=2, warmup_steps=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PeriodicModelAverager(period=1)
    assert any("period=1" in str(w.message) for w in caught)
