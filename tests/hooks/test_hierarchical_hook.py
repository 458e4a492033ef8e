"""The hierarchical hook: exact averaging within emulated nodes, an inner hook among their leaders.

Nodes are emulated on localhost: 4 gloo ranks with ``ranks_per_node=2`` are two nodes of two ranks. One
spawned group of 4 checks, on gradcomm's and torch's DDP: with ``inner=allreduce`` the result equals torch's
DDP averaging (to a few float32 ulps, not bitwise: gloo's ring sums the 4 ranks' terms in a different order
per chunk, ``((a + b) + c) + d`` and rotations, while the hierarchy sums ``(a + b) + (c + d)``; division by
the power-of-two group sizes is exact either way); with ``inner=powersgd`` (by registry name) replicas stay
bit-identical on all 4 ranks, gradients are identical within a node, the inner state runs on the leaders'
group only, and a checkpoint resumes bit for bit; and a failing inner hook fails every rank. A group of 2
checks the degenerate topologies and the topology errors. The rest needs no process group.
"""

from __future__ import annotations

import datetime
import io
import os
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradcomm
from gradcomm.comm.faults import process_group_timeout
from gradcomm.hooks import default_hooks
from gradcomm.hooks.hierarchical_hook import HierarchicalState, hierarchical_hook
from gradcomm.hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from gradcomm.hooks.registry import check_options, make_comm_hook, register_comm_hook_by_name
from gradcomm.testing import run_on_ranks
from tests.support.models import mlp
from tests.support.ranks import DDP_KINDS, error_text, make_ddp
from tests.support.training import flat_gradients, flat_parameters, random_batch

STEPS = 5
POWERSGD = {"inner": "powersgd", "matrix_approximation_rank": "1", "start_powerSGD_iter": "2", "ranks_per_node": "2"}
# a few float32 ulps of the gradients and parameters (see the module's docstring for why not bitwise)
RTOL, ATOL = 1e-6, 1e-8


def _model() -> nn.Module:
    return mlp(8, 32, 16, 4)


def _train(ddp: nn.Module, steps: range, grads: list | None = None) -> np.ndarray:
    """Plain SGD (no optimizer state), so a module's parameters are all a resumed run needs."""
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in steps:
        x, y = random_batch(100 * dist.get_rank() + step, 16, 8, 4)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        if grads is not None:
            grads.append(flat_gradients(ddp))
        optimizer.step()
    return flat_parameters(ddp)


def _raising_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    if dist.get_rank() == 0:
        raise ValueError("the inner hook failed on purpose")
    return default_hooks.allreduce_hook(state, bucket)


# -- 4 ranks: two nodes of two ------------------------------------------------------------------------------
def _four_ranks() -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for kind in DDP_KINDS:
        reference_grads: list = []
        out[f"{kind} reference"] = _train(make_ddp("torch", _model()), range(STEPS), reference_grads)
        out[f"{kind} reference grads"] = reference_grads
        ddp = make_ddp(kind, _model())
        ddp.register_comm_hook(HierarchicalState(default_hooks.allreduce_hook, ranks_per_node=2), hierarchical_hook)
        grads: list = []
        out[f"{kind} allreduce"] = _train(ddp, range(STEPS), grads)
        out[f"{kind} allreduce grads"] = grads

        # on gradcomm's DDP over a group of all ranks with a timeout of its own (as gradcomm bench does)
        group = dist.new_group(timeout=datetime.timedelta(seconds=20)) if kind == "gradcomm" else None
        ddp = make_ddp(kind, _model(), process_group=group)
        state = register_comm_hook_by_name(ddp, "hierarchical", process_group=group, **POWERSGD)
        grads = []
        out[f"{kind} powersgd"] = _train(ddp, range(STEPS), grads)
        out[f"{kind} powersgd grads"] = grads
        inner = state.inner_state
        out[f"{kind} powersgd inner"] = {
            "iter": inner.iter,
            "errors": len(inner.error_dict),
            "group": dist.get_process_group_ranks(inner.process_group) if inner.process_group is not None else None,
            "timeout": process_group_timeout(inner.process_group) if inner.process_group is not None else None,
        }
        if kind == "gradcomm":
            out["bytes sent"] = ddp.comm_stats().total.bytes_sent

    flat = make_ddp("torch", _model())
    flat.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2), powerSGD_hook)
    out["flat powersgd"] = _train(flat, range(STEPS))

    # checkpoint: save after 3 steps, go on 2; a fresh DDP and state loaded from the save do the same 2
    ddp = gradcomm.DistributedDataParallel(_model())
    state = register_comm_hook_by_name(ddp, "hierarchical", **POWERSGD)
    _train(ddp, range(3))
    saved_module = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    out["checkpoint continued"] = _train(ddp, range(3, STEPS))
    module = _model()
    module.load_state_dict(saved_module)
    resumed = gradcomm.DistributedDataParallel(module)
    buffer.seek(0)
    hook, fresh = make_comm_hook("hierarchical", **POWERSGD)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))  # leaders' inner counters now differ from the others'
    resumed.register_comm_hook(fresh, hook)  # the ranks still agree
    out["checkpoint resumed"] = _train(resumed, range(3, STEPS))

    sparse = gradcomm.DistributedDataParallel(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)))
    sparse.register_comm_hook(HierarchicalState(default_hooks.allreduce_hook, ranks_per_node=2), hierarchical_hook)
    out["sparse"] = error_text(lambda: sparse(torch.tensor([1, 2])).sum().backward())

    partial = dist.new_group([0, 1, 2])
    if dist.get_rank() < 3:
        out["partial group"] = error_text(lambda: HierarchicalState(powerSGD_hook, PowerSGDState(None), 2, partial).topology())

    # a failing inner hook (on rank 0, a leader): rank 0's step fails at once, the others at the timeout
    ddp = gradcomm.DistributedDataParallel(_model())
    ddp.register_comm_hook(HierarchicalState(_raising_hook, ranks_per_node=2), hierarchical_hook)
    out["failure"] = error_text(lambda: _train(ddp, range(1)))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_nodes_of_two_ranks() -> None:
    by_rank = run_on_ranks(_four_ranks, world_size=4, timeout=280, collective_timeout=25)
    for kind in DDP_KINDS:
        for rank, result in enumerate(by_rank):
            for step, (got, expected) in enumerate(
                zip(result[f"{kind} allreduce grads"], result[f"{kind} reference grads"], strict=True)
            ):
                np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=f"{kind}, rank {rank}, step {step}")
            np.testing.assert_allclose(result[f"{kind} allreduce"], result[f"{kind} reference"], rtol=RTOL, atol=ATOL)
            np.testing.assert_array_equal(result[f"{kind} allreduce"], by_rank[0][f"{kind} allreduce"])

            np.testing.assert_array_equal(result[f"{kind} powersgd"], by_rank[0][f"{kind} powersgd"])
            leader = rank - rank % 2
            for got, same_node in zip(result[f"{kind} powersgd grads"], by_rank[leader][f"{kind} powersgd grads"], strict=True):
                np.testing.assert_array_equal(got, same_node)
            inner = result[f"{kind} powersgd inner"]
            if rank == leader:  # the inner PowerSGD runs among the leaders, compressing from step 2
                timeout = 20.0 if kind == "gradcomm" else 25.0  # the hook's process group's
                assert inner == {"iter": STEPS, "errors": 6, "group": [0, 2], "timeout": timeout}, (kind, rank, inner)
            else:
                assert inner == {"iter": 0, "errors": 0, "group": None, "timeout": None}, (kind, rank, inner)
        # across nodes the averaged gradients are the same, but not the exact average once PowerSGD compresses
        final_grads = [r[f"{kind} powersgd grads"][-1] for r in by_rank]
        assert all(np.array_equal(final_grads[0], g) for g in final_grads)
        assert not np.allclose(final_grads[0], by_rank[0][f"{kind} reference grads"][-1], rtol=1e-3)
    # PowerSGD is linear in the summed matrix (P = sum M_i Q, Q = sum M_i^T P) and its error feedback sums
    # alike, so compressing node averages among the leaders gives flat PowerSGD's result, to rounding
    for result in by_rank:
        np.testing.assert_allclose(result["torch powersgd"], result["flat powersgd"], rtol=1e-4, atol=1e-6)
    assert all(r["bytes sent"] > 0 for r in by_rank)
    for rank, result in enumerate(by_rank):
        np.testing.assert_array_equal(result["checkpoint resumed"], result["checkpoint continued"], err_msg=f"rank {rank}")
    for result in by_rank:
        assert "hierarchical_hook raised on bucket 1" in result["sparse"], result["sparse"]
        assert "hierarchical_hook: bucket 1 is sparse (nn.Embedding(sparse=True)); a sparse gradient cannot be broadcast" in result["sparse"]
    for result in by_rank[:3]:
        assert result["partial group"] == (
            "ValueError: HierarchicalState: process_group has 3 of the 4 ranks, but the node groups are created by "
            "every rank of the default group (torch.distributed.new_group), so it must hold every rank: pass "
            "process_group=None, or a group of all ranks"
        )
    failures = [r["failure"] for r in by_rank]
    assert failures[0].startswith("CommHookError: Communication hook hierarchical_hook: the future it returned for bucket 0")
    assert "hierarchical_hook: inner hook _raising_hook raised on bucket 0 on node leader rank 0: ValueError: the inner " in failures[0]
    for rank in (1, 2, 3):
        assert failures[rank].startswith(f"PeerLostError: rank {rank} lost contact with its peers during step 0"), failures[rank]


# -- 2 ranks: one node of two, two nodes of one, and topology errors ------------------------------------------
def _two_ranks() -> dict[str, Any]:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    out: dict[str, Any] = {"reference": _train(make_ddp("torch", _model()), range(STEPS))}
    powersgd_alone = gradcomm.DistributedDataParallel(_model())
    powersgd_alone.register_comm_hook(PowerSGDState(None, start_powerSGD_iter=2), powerSGD_hook)
    out["powersgd alone"] = _train(powersgd_alone, range(STEPS))
    for ranks_per_node in (1, 2, None):  # None: LOCAL_WORLD_SIZE, 2 here
        for inner in ("allreduce", "powersgd"):
            ddp = gradcomm.DistributedDataParallel(_model())
            options = {"start_powerSGD_iter": 2} if inner == "powersgd" else {}
            state = register_comm_hook_by_name(ddp, "hierarchical", inner=inner, ranks_per_node=ranks_per_node, **options)
            out[f"{ranks_per_node} {inner}"] = _train(ddp, range(STEPS))
            if inner == "powersgd":
                out[f"{ranks_per_node} iter"] = state.inner_state.iter

    # a group of this rank alone (gradcomm bench times each hook so): the inner hook alone, whatever ranks_per_node
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    ddp = gradcomm.DistributedDataParallel(_model(), process_group=solo)
    state = register_comm_hook_by_name(ddp, "hierarchical", process_group=solo, **POWERSGD)
    _train(ddp, range(STEPS))
    out["solo iter"] = state.inner_state.iter
    out["solo saved ranks_per_node"] = state.state_dict()["ranks_per_node"]

    ddp = gradcomm.DistributedDataParallel(_model())
    out["inner options differ"] = error_text(
        lambda: register_comm_hook_by_name(ddp, "hierarchical", inner="powersgd", matrix_approximation_rank=1 + rank)
    )

    out["inner state bound"] = error_text(lambda: HierarchicalState(powerSGD_hook, PowerSGDState(dist.new_group([0, 1]))))

    def topology(ranks_per_node: int | None, process_group: Any = None) -> str:
        return error_text(lambda: HierarchicalState(powerSGD_hook, PowerSGDState(None), ranks_per_node, process_group).topology())

    out["not a multiple"] = topology(3)
    out["disagree"] = topology([1, 2][rank])
    local_world_size = os.environ.pop("LOCAL_WORLD_SIZE")
    out["unknown"] = topology(None)
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # as if each rank were alone on its node, but LOCAL_RANK is still the rank
    out["local rank"] = topology(None)
    os.environ["LOCAL_WORLD_SIZE"] = local_world_size

    # a checkpoint of one topology is refused at another, before or after the groups exist
    used = HierarchicalState(powerSGD_hook, PowerSGDState(None), ranks_per_node=1)
    used.topology()
    saved = used.state_dict()
    other = HierarchicalState(powerSGD_hook, PowerSGDState(None), ranks_per_node=2)
    other.load_state_dict(saved)
    out["moved at first use"] = error_text(other.topology)
    in_use = HierarchicalState(powerSGD_hook, PowerSGDState(None), ranks_per_node=2)
    in_use.topology()
    out["moved after use"] = error_text(lambda: in_use.load_state_dict(saved))
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_one_node_one_rank_per_node_and_topology_errors() -> None:
    by_rank = run_on_ranks(_two_ranks, world_size=2, timeout=180)
    for rank, result in enumerate(by_rank):
        # two nodes of one rank: the inner hook alone, on the default group
        np.testing.assert_allclose(result["1 allreduce"], result["reference"], rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(result["1 powersgd"], result["powersgd alone"])
        assert result["1 iter"] == STEPS
        # one node: exact averaging, the inner hook never runs
        for ranks_per_node in (2, None):
            for inner in ("allreduce", "powersgd"):
                np.testing.assert_allclose(result[f"{ranks_per_node} {inner}"], result["reference"], rtol=RTOL, atol=ATOL)
            assert result[f"{ranks_per_node} iter"] == 0
        assert result["not a multiple"] == (
            "ValueError: HierarchicalState: world size 2 is not a multiple of ranks_per_node=3: the nodes must all "
            "have the same number of ranks. Pass the number of ranks on each node as ranks_per_node"
        )
        assert result["disagree"] == (
            "ValueError: HierarchicalState: the ranks disagree on the number of ranks per node (ranks 0: 1; "
            "ranks 1: 2); pass the same ranks_per_node on every rank"
        )
        assert result["unknown"] == (
            f"ValueError: HierarchicalState: the number of ranks per node is unknown on rank {rank}: ranks_per_node "
            "was not given and LOCAL_WORLD_SIZE is not set. Pass ranks_per_node=..., or launch with torchrun, "
            "which sets LOCAL_WORLD_SIZE"
        )
        assert result["solo iter"] == STEPS and result["solo saved ranks_per_node"] == 2
        assert result["inner state bound"] == (
            "ValueError: HierarchicalState: the state of inner hook powerSGD_hook is bound to a process group of 2 "
            "ranks, but it runs on the group of the node leaders, which is created at the first call: build the "
            "inner state with process_group=None"
        )
        assert result["inner options differ"].startswith("RanksDisagreeError: ")
        assert "matrix_approximation_rank=1" in result["inner options differ"]
        assert "matrix_approximation_rank=2" in result["inner options differ"]
    assert by_rank[0]["local rank"] == (
        "ValueError: HierarchicalState: rank(s) 1 could not determine the number of ranks per node (their own "
        "errors say why); every rank needs the same ranks_per_node"
    )
    assert by_rank[1]["local rank"].startswith(
        "ValueError: HierarchicalState: rank 1 has LOCAL_RANK=1, but with LOCAL_WORLD_SIZE=1 it would be local rank 0: "
        "the ranks are not numbered node by node"
    )
    for result in by_rank:
        moved = (
            "ValueError: HierarchicalState: this checkpoint was written with 1 ranks per node, but this run has 2: "
            "the inner hook's state belongs to the node leaders of that topology. Resume with ranks_per_node=1, "
            "or start the hook state afresh"
        )
        assert result["moved at first use"] == moved and result["moved after use"] == moved


# -- no process group -------------------------------------------------------------------------------------------
def test_registry_passes_inner_options_to_the_inner_entry() -> None:
    hook, state = make_comm_hook("hierarchical", inner="powersgd", matrix_approximation_rank="4", ranks_per_node="2")
    assert hook is hierarchical_hook and isinstance(state, HierarchicalState)
    assert isinstance(state.inner_state, PowerSGDState) and state.inner_state.matrix_approximation_rank == 4
    assert state.ranks_per_node == 2 and state.inner_state.process_group is None
    _, plain = make_comm_hook("hierarchical")
    assert plain.inner_hook is default_hooks.allreduce_hook and plain.inner_state is None
    _, wrapped = make_comm_hook("hierarchical", inner="allreduce", inner_wrapper="fp16")
    assert "compress_wrapper" in wrapped.inner_hook.__qualname__
    assert default_hooks.allreduce_hook in [cell.cell_contents for cell in wrapped.inner_hook.__closure__]
    assert check_options("hierarchical", inner="topk", ratio="0.1") == {"inner": "topk", "ratio": "0.1"}
    # the ranks compare the inner hook through its wrapper: fp16 and bf16 around allreduce must differ
    bf16 = make_comm_hook("hierarchical", inner="allreduce", inner_wrapper="bf16")[1]
    assert "dtype=torch.float16" in wrapped.comm_hook_fingerprint()
    assert wrapped.comm_hook_fingerprint() != bf16.comm_hook_fingerprint()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"inner": "powersgd", "rank": 4}, r"'hierarchical': communication hook 'powersgd' got unknown option\(s\) 'rank'"),
        ({"inner": "powersgd", "matrix_approximation_rank": 0}, r"'powersgd': PowerSGDState: matrix_approximation_rank must be"),
        ({"inner": "warp"}, r"'hierarchical': unknown communication hook 'warp'; valid names: allreduce"),
        ({"inner": "hierarchical"}, r"inner='hierarchical': the inner hook cannot be hierarchical itself"),
        ({"inner": "noop"}, r"inner hook noop_hook leaves replicas different on purpose"),
        ({"ranks_per_node": "0"}, r"HierarchicalState: ranks_per_node must be at least 1, got 0"),
        ({"ranks_per_node": "two"}, r"option 'ranks_per_node' expects int, got 'two'"),
    ],
)
def test_registry_refuses_bad_options(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_options("hierarchical", **options)


def test_state_refuses_misuse() -> None:
    with pytest.raises(TypeError, match="Communication hook must be callable"):
        HierarchicalState("powersgd")
    with pytest.raises(ValueError, match="the inner hook cannot be hierarchical_hook itself"):
        HierarchicalState(hierarchical_hook)
    with pytest.raises(TypeError, match="inner_state of inner hook powerSGD_hook must be None or a ProcessGroup .* got dict"):
        HierarchicalState(powerSGD_hook, {"rank": 1})
    with pytest.raises(TypeError, match="ranks_per_node must be an integer, got True"):
        HierarchicalState(default_hooks.allreduce_hook, ranks_per_node=True)
    with pytest.raises(RuntimeError, match=r"needs the default process group: call torch.distributed.init_process_group"):
        HierarchicalState(default_hooks.allreduce_hook).topology()


def test_state_checkpoints_before_use() -> None:
    """The inner state's dict travels inside the hierarchical one (weights_only), and pickling works."""
    state = HierarchicalState(powerSGD_hook, PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=3), 2)
    state.inner_state.iter = 7
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    fresh = HierarchicalState(powerSGD_hook, PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=3), 2)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.inner_state.iter == 7
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    unpickled = torch.load(buffer, weights_only=False)
    assert unpickled.inner_state.iter == 7 and unpickled.inner_hook is powerSGD_hook and unpickled.ranks_per_node == 2
    with pytest.raises(ValueError, match="this checkpoint holds an inner state, but inner hook allreduce_hook has none"):
        HierarchicalState(default_hooks.allreduce_hook).load_state_dict(state.state_dict())


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_local_world_size_must_be_a_positive_integer(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from gradcomm.hooks.hierarchical_hook import _local_ranks_per_node

    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(ValueError, match=rf"LOCAL_WORLD_SIZE='{value}' on rank 1 is not a positive integer"):
        _local_ranks_per_node(None, 1, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _local_ranks_per_node(None, 1, 4) == 2
