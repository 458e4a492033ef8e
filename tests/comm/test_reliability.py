"""Reliability: dead ranks, failing hooks, disagreeing ranks, uneven inputs and non-finite values never hang
and never corrupt.

One spawned group of two ranks runs every check that leaves the processes alive; each fault that breaks a
process group (a hook raising on rank 1 only, a future failing on rank 1 only, a NaN on rank 1) runs on a
fresh gloo subgroup with a 3-second timeout, so the rank left waiting fails within seconds and the next
check starts on a healthy group. Two more spawned groups each have a rank killed with SIGKILL: during a plain
allreduce, and right after it posted an all-gather's receive and send (gradcomm exchanges point to point on
gloo). Messages are collected in the ranks and asserted here, in the parent. No test bounds wall-clock time
from above: that a rank failed through the timeout, or at once through a closed connection, is read from its
error.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

import gradcomm
from gradcomm.bench.runner import solo_groups
from gradcomm.comm.faults import process_group_timeout
from gradcomm.compression.registry import methods as compression_methods
from gradcomm.hooks import allgather_hooks, default_hooks, powerSGD_hook
from gradcomm.hooks.grad_bucket import GradBucket
from gradcomm.hooks.registry import hook_names, make_comm_hook
from gradcomm.testing import RankError, run_on_ranks
from tests.support.models import mlp
from tests.support.ranks import GLOO_TIMEOUT, counting_point_to_point, error_text
from tests.support.training import random_batch

FAULT_TIMEOUT = 3.0  # seconds: the timeout of the subgroup each fault runs on


# -- models, batches, helpers -----------------------------------------------------------------------------
def _mlp(seed: int = 0) -> nn.Module:
    return mlp(8, 32, 16, 4, activation=nn.ReLU, seed=seed)


def _bn_model() -> nn.Module:
    """Several buckets' worth of matrices (PowerSGD compresses them) and BatchNorm buffers to broadcast."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def _batch(step: int, inputs: int = 8, outputs: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(1000 * dist.get_rank() + step, 6, inputs, outputs)


def _train_step(ddp: nn.Module, step: int, optimizer: torch.optim.Optimizer | None = None, inputs: int = 8) -> None:
    x, y = _batch(step, inputs)
    if optimizer is not None:
        optimizer.zero_grad()
    nn.functional.mse_loss(ddp(x), y).backward()
    if optimizer is not None:
        optimizer.step()



def _fault_group() -> dist.ProcessGroup:
    """A fresh gloo group with a short timeout; the barrier waits until the previous fault has ended on
    every rank (the default group's timeout is long)."""
    dist.barrier()
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=FAULT_TIMEOUT))


def _first_failure(ddp: nn.Module, steps: int, **kwargs: Any) -> dict[str, Any]:
    """Train until the first error; its message, full traceback, step and how long the failing step took."""
    for step in range(steps):
        start = time.monotonic()
        try:
            _train_step(ddp, step, **kwargs)
        except Exception as exc:
            return {
                "message": f"{type(exc).__name__}: {exc}",
                "traceback": "".join(traceback.format_exception(exc)),
                "step": step,
                "seconds": time.monotonic() - start,
                "next_forward": error_text(lambda step=step: _train_step(ddp, step + 1, **kwargs)),
            }
    return {"message": "no error", "step": None, "seconds": 0.0}


def _checksum(module: nn.Module) -> list[float]:
    return [t.detach().double().sum().item() for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()]


def _same_on_all_ranks(values: list[float]) -> bool:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return all(g == gathered[0] for g in gathered)


# -- hooks for the faults -----------------------------------------------------------------------------------
def raise_on_rank_one_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    if dist.get_rank() == 1 and bucket.index() == 1:
        raise KeyError("no compression table on rank 1")
    return default_hooks.allreduce_hook(group, bucket)


def failing_future_on_rank_one_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    def decode(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        value = fut.value()
        if dist.get_rank() == 1:
            raise ValueError("cannot decode on rank 1")
        return value

    return default_hooks.allreduce_hook(group, bucket).then(decode)


def raise_on_rank_one_gather_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The all-gather hook, but rank 1 raises before gathering bucket 1: rank 0's receive has no partner."""
    if dist.get_rank() == 1 and bucket.index() == 1:
        raise KeyError("no gather buffer on rank 1")
    return allgather_hooks.allgather_then_aggregate_hook(group, bucket)


# -- the checks ------------------------------------------------------------------------------------------
def _faults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    group = _fault_group()
    ddp = gradcomm.DistributedDataParallel(_mlp(), process_group=group, bucket_cap_mb_list=[0.001])
    ddp.register_comm_hook(group, raise_on_rank_one_hook)
    out["buckets"] = ddp.reducer.bucket_count
    out["hook_raises"] = _first_failure(ddp, 3)

    group = _fault_group()
    ddp = gradcomm.DistributedDataParallel(_mlp(), process_group=group, bucket_cap_mb_list=[0.001])
    ddp.register_comm_hook(group, failing_future_on_rank_one_hook)
    out["future_fails"] = _first_failure(ddp, 3)

    group = _fault_group()
    ddp = gradcomm.DistributedDataParallel(_mlp(), process_group=group, bucket_cap_mb_list=[0.001], check_finite=True)
    if dist.get_rank() == 1:
        weight = ddp.module[2].weight
        weight.register_hook(lambda grad: grad.clone().fill_(math.nan) if ddp.synchronised_steps == 1 else grad)
    out["nan"] = _first_failure(ddp, 3)

    # An all-gather hook, whose buckets are exchanged point to point: rank 0's receive has no partner
    group = _fault_group()
    ddp = gradcomm.DistributedDataParallel(_mlp(), process_group=group, bucket_cap_mb_list=[0.001])
    ddp.register_comm_hook(group, raise_on_rank_one_gather_hook)
    with counting_point_to_point() as posted:
        out["gather_hook_raises"] = _first_failure(ddp, 3)
    out["gather_hook_raises"]["buckets"] = ddp.reducer.bucket_count
    out["gather_hook_raises"]["posted"] = posted
    return out


def _disagreements() -> dict[str, Any]:
    out: dict[str, Any] = {}
    rank = dist.get_rank()
    hooks = [default_hooks.allreduce_hook, default_hooks.fp16_compress_hook]
    ddp = gradcomm.DistributedDataParallel(_mlp())
    out["different_hooks"] = error_text(lambda: ddp.register_comm_hook(None, hooks[rank]))

    # bucket_cap_mb_list: different layouts from the first step (with bucket_cap_mb, as in torch, the first
    # step has one bucket on every rank and only the option differs)
    ddp = gradcomm.DistributedDataParallel(_mlp(), bucket_cap_mb_list=[[0.0001], [25]][rank])
    out["different_buckets"] = error_text(lambda: ddp.register_comm_hook(None, default_hooks.allreduce_hook))
    ddp = gradcomm.DistributedDataParallel(_mlp(), bucket_cap_mb_list=[[0.0001], [25]][rank])
    out["different_buckets_no_hook"] = error_text(lambda: _train_step(ddp, 0))
    ddp = gradcomm.DistributedDataParallel(_mlp(), bucket_cap_mb=[0.0001, 25][rank])
    out["different_bucket_cap"] = error_text(lambda: _train_step(ddp, 0))

    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank + 1)
    ddp = gradcomm.DistributedDataParallel(_mlp())
    out["different_options"] = error_text(lambda: ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook))

    wrapped = default_hooks.fp16_compress_wrapper([default_hooks.allreduce_hook, powerSGD_hook.powerSGD_hook][rank])
    state = powerSGD_hook.PowerSGDState(process_group=None)
    ddp = gradcomm.DistributedDataParallel(_mlp())
    out["different_wrapped"] = error_text(lambda: ddp.register_comm_hook(state, wrapped))

    ddp = gradcomm.DistributedDataParallel(_mlp())
    if rank == 0:
        out["hook_on_rank_0_only"] = error_text(lambda: ddp.register_comm_hook(None, default_hooks.allreduce_hook))
    else:
        out["hook_on_rank_0_only"] = error_text(lambda: _train_step(ddp, 0))

    ddp = gradcomm.DistributedDataParallel(_mlp(), check_parameters_every=[0, 5][rank])
    out["different_ddp_options"] = error_text(lambda: _train_step(ddp, 0))

    legacy = gradcomm.LegacyDistributedDataParallel(_mlp(), world_size=2)
    out["legacy_different_hooks"] = error_text(lambda: legacy.register_comm_hook(None, hooks[rank]))

    # agreeing ranks still train, and the group is healthy after all of the above
    ddp = gradcomm.DistributedDataParallel(_mlp())
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    _train_step(ddp, 0)
    out["agreeing_ranks_train"] = True
    return out


JOIN_BATCHES = (3, 5)  # rank 0, rank 1
JOIN_HOOKS = ["(none)", *hook_names()]
# more setups under join(): (hook, batches per rank, DDP options)
JOIN_VARIANTS: dict[str, tuple[str, tuple[int, int], dict[str, Any]]] = {
    "find_unused_parameters": ("(none)", JOIN_BATCHES, {"find_unused_parameters": True}),
    "gradient_as_bucket_view": ("fp16_compress", JOIN_BATCHES, {"gradient_as_bucket_view": True}),
    "powersgd, rank 0 has no batch": ("powersgd", (0, 4), {}),
    "allreduce, rank 1 has fewer": ("allreduce", (5, 2), {}),
    # torch's own Join context manager driving the DDP through the Joinable interface
    "torch Join([ddp]), powersgd": ("powersgd", JOIN_BATCHES, {"torch_join": True}),
    "torch Join([ddp]), rank 0 has no batch": ("(none)", (0, 3), {"torch_join": True}),
}
DRIFTING_HOOKS = {"noop", "post_localsgd"}  # replicas differ by design until join() syncs them at the end
JOIN_OPTIONS: dict[str, dict[str, Any]] = {
    "powersgd": {"start_powerSGD_iter": 2, "matrix_approximation_rank": 1},
    "powersgd_rank2": {"start_powerSGD_iter": 2},
    "batched_powersgd": {"start_powerSGD_iter": 2},
    "batched_powersgd_rank2": {"start_powerSGD_iter": 2},
    "post_localsgd": {"start_localSGD_iter": 2},
    **{name: {"min_numel": 16} for name in compression_methods()},
}


def _join_run(name: str, batches: int, torch_join: bool = False, **options: Any) -> dict[str, Any]:
    # the drift check runs along: the joined rank's stale parameters must not count as drift
    every = 0 if name in DRIFTING_HOOKS else 2
    ddp = gradcomm.DistributedDataParallel(_bn_model(), bucket_cap_mb=0.01, check_parameters_every=every, **options)
    if name != "(none)":
        hook, state = make_comm_hook(name, **JOIN_OPTIONS.get(name, {}))
        ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    losses = []
    with Join([ddp]) if torch_join else ddp.join():
        for step in range(batches):
            x, y = _batch(step, inputs=16)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return {
        "steps": ddp.synchronised_steps,
        "identical": _same_on_all_ranks(_checksum(ddp.module)),
        "finite": all(math.isfinite(v) for v in [*losses, *_checksum(ddp.module)]),
        "buckets": ddp.reducer.bucket_count,
    }


def _join_divisor(divide_by_initial_world_size: bool) -> float:
    """Rank 0 has one batch, rank 1 two: in rank 1's second step its gradient is averaged over 2 or 1 ranks."""
    ddp = gradcomm.DistributedDataParallel(_mlp())
    local = _mlp()
    worst = 0.0
    with ddp.join(divide_by_initial_world_size=divide_by_initial_world_size):
        for step in range(dist.get_rank() + 1):
            ddp.zero_grad()
            _train_step(ddp, step)
            if step == 1:
                local.zero_grad()
                x, y = _batch(step)
                nn.functional.mse_loss(local(x), y).backward()
                divisor = 2.0 if divide_by_initial_world_size else 1.0
                worst = max(
                    (p.grad - q.grad / divisor).abs().max().item()
                    for p, q in zip(ddp.parameters(), local.parameters(), strict=True)
                )
    return worst


def _uneven_inputs() -> dict[str, Any]:
    out: dict[str, Any] = {}
    batches = JOIN_BATCHES[dist.get_rank()]
    out["join"] = {name: _join_run(name, batches) for name in JOIN_HOOKS}
    out["join_variants"] = {
        label: _join_run(name, counts[dist.get_rank()], **options)
        for label, (name, counts, options) in JOIN_VARIANTS.items()
    }
    out["divisor_initial"] = _join_divisor(True)
    out["divisor_active"] = _join_divisor(False)
    ddp = gradcomm.DistributedDataParallel(_mlp())

    def early() -> None:
        with ddp.join(throw_on_early_termination=True):
            for step in range(dist.get_rank() + 1):
                _train_step(ddp, step)

    out["throw_on_early_termination"] = error_text(early)

    def second_joinable() -> None:  # gradcomm's DDP must notify the Join context first
        first = gradcomm.DistributedDataParallel(_mlp())
        with Join([first, ddp]):
            _train_step(ddp, 0)

    out["not_first_joinable"] = error_text(second_joinable)
    return out


def _drift() -> dict[str, Any]:
    out: dict[str, Any] = {}
    ddp = gradcomm.DistributedDataParallel(_mlp(), check_parameters_every=1)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        _train_step(ddp, step, optimizer)
    out["no_drift"] = "no error"
    ddp = gradcomm.DistributedDataParallel(_mlp(), check_parameters_every=2)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def drift() -> None:
        for step in range(6):
            _train_step(ddp, step, optimizer)
            if step == 2 and dist.get_rank() == 1:
                with torch.no_grad():
                    ddp.module[2].weight[0, 0] += 1e-6

    out["drift"] = error_text(drift)
    out["drift_step"] = ddp.synchronised_steps
    return out


# Gradients that must not become NaN or infinity in any hook.
def _special_inputs() -> dict[str, torch.Tensor]:
    numel = 64 * 32 + 32
    rank_sign = 1.0 if dist.get_rank() == 0 else -1.0
    return {
        "zeros": torch.zeros(numel),
        "constant": torch.full((numel,), 3.0),
        "denormal": torch.full((numel,), 1e-40),
        "huge": torch.full((numel,), 1e30),
        "huge_mixed": torch.full((numel,), 1e30 * rank_sign),
    }


HOOK_OPTIONS: dict[str, dict[str, Any]] = {
    "powersgd": {"start_powerSGD_iter": 2},
    "powersgd_rank2": {"start_powerSGD_iter": 2},
    "batched_powersgd": {"start_powerSGD_iter": 2},
    "batched_powersgd_rank2": {"start_powerSGD_iter": 2},
    "post_localsgd": {"start_localSGD_iter": 1},
    "auto": {"candidates": "allreduce+powersgd:matrix_approximation_rank=2,start_powerSGD_iter=2"},  # not fp16: 1e30
}
HOOK_ITERATIONS = 4  # PowerSGD compresses from the third


def _hook_numerics() -> dict[str, list[str]]:
    """Every registry hook, a few iterations on each special input: which outputs were not finite."""
    shapes = [torch.Size([64, 32]), torch.Size([32])]
    params = [nn.Parameter(torch.zeros(shape)) for shape in shapes]
    lengths = [shape.numel() for shape in shapes]
    offsets = [0, lengths[0]]
    bad: dict[str, list[str]] = {}
    for name in hook_names():
        for label, gradient in _special_inputs().items():
            hook, state = make_comm_hook(name, **HOOK_OPTIONS.get(name, {}))
            for iteration in range(HOOK_ITERATIONS):
                bucket = GradBucket(0, gradient.clone(), offsets, lengths, shapes, params, True)
                result = hook(state, bucket).wait()
                result = result[0] if isinstance(result, list) else result
                if not torch.isfinite(result).all():
                    bad.setdefault(name, []).append(f"{label}@{iteration}")
                    break
    return bad


def reliability_checks() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, part in [
        ("faults", _faults),
        ("disagreements", _disagreements),
        ("uneven", _uneven_inputs),
        ("drift", _drift),
        ("numerics", _hook_numerics),
    ]:
        out[name] = part()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_on_ranks(reliability_checks, 2, timeout=150, collective_timeout=30)


# -- failing hooks ----------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_hook_raising_on_one_rank(ranks: list[dict[str, Any]]) -> None:
    zero, one = ranks[0]["faults"]["hook_raises"], ranks[1]["faults"]["hook_raises"]
    assert ranks[0]["faults"]["buckets"] >= 3
    assert re.match(
        r"CommHookError: Communication hook raise_on_rank_one_hook raised on bucket 1 \(\d+ elements\): KeyError: "
        r"'no compression table on rank 1' \(rank 1, step 0\)",
        one["message"],
    ), one["message"]
    # the original traceback is chained: the line that raised, inside the hook
    assert 'raise KeyError("no compression table on rank 1")' in one["traceback"], one["traceback"]
    assert re.match(
        r"PeerLostError: rank 0 lost contact with its peers during step 0, bucket 1 \(hook: raise_on_rank_one_hook\): "
        rf"RuntimeError: .*{GLOO_TIMEOUT}",
        zero["message"],
    ), zero["message"]
    assert "the process group's timeout (3 s)" in zero["message"]
    assert zero["seconds"] >= FAULT_TIMEOUT - 0.5, zero["seconds"]  # it waited for the timeout, not less
    for side in (zero, one):  # no further step on a DDP whose ranks are out of step
        assert "an earlier synchronised step failed on this rank" in side["next_forward"], side["next_forward"]


@pytest.mark.timeout(180)
def test_future_failing_on_one_rank(ranks: list[dict[str, Any]]) -> None:
    zero, one = ranks[0]["faults"]["future_fails"], ranks[1]["faults"]["future_fails"]
    assert one["step"] == 0 and re.match(
        r"(?s)CommHookError: Communication hook failing_future_on_rank_one_hook: the future it returned for bucket 0 "
        r"failed: RuntimeError: .*ValueError: cannot decode on rank 1.*decode.*\(rank 1, step 0\)",
        one["message"],
    ), one["message"]
    assert "test_reliability.py" in one["message"], "the callback's traceback location is in the message"
    # Every bucket's future fails on rank 1 once its allreduce is done. Rank 1 stops launching at the first bucket
    # k whose future has already failed when it is launched (the reducer checks right after each launch; which k
    # depends on when rank 0's part of the allreduce arrives): rank 0 then waits in vain in step 0 for bucket k + 1.
    # If no future is done at its launch, rank 1 launches every bucket and fails at the end of step 0; rank 0's
    # step 0 completes (the collectives matched) and step 1 starts with the one-time bucket rebuild, whose
    # broadcast rank 1 never joins. Either way rank 0 fails loudly and no collective is mismatched.
    assert re.match(
        r"PeerLostError: rank 0 lost contact with its peers during "
        r"(step 0, bucket [1-9]\d* \(hook: failing_future_on_rank_one_hook\)|step 1, rebuilding buckets): RuntimeError: "
        r"(?s:.*)(?i:timed out|timeout|connection closed|connection reset)",
        zero["message"],
    ), zero["message"]
    assert zero["step"] == (1 if "rebuilding buckets" in zero["message"] else 0), zero


@pytest.mark.timeout(180)
def test_hook_raising_while_the_peer_exchanges_point_to_point(ranks: list[dict[str, Any]]) -> None:
    zero, one = ranks[0]["faults"]["gather_hook_raises"], ranks[1]["faults"]["gather_hook_raises"]
    assert one["buckets"] >= 3, one
    # rank 1 exchanged bucket 0 (a receive, then a send) and raised at bucket 1; rank 0 posted bucket 1's too
    assert [kind for kind, _, _ in one["posted"]] == ["irecv", "isend"], one["posted"]
    assert [kind for kind, _, _ in zero["posted"][:4]] == ["irecv", "isend"] * 2, zero["posted"]
    assert re.match(
        r"CommHookError: Communication hook raise_on_rank_one_gather_hook raised on bucket 1 \(\d+ elements\): "
        r"KeyError: 'no gather buffer on rank 1' \(rank 1, step 0\)",
        one["message"],
    ), one["message"]
    # bucket 0's exchange matched (the error is at bucket 1); bucket 1's receive found no partner and timed out
    assert re.match(
        r"(?s)PeerLostError: rank 0 lost contact with its peers during step 0, bucket 1 \(hook: "
        rf"raise_on_rank_one_gather_hook\): RuntimeError: .*{GLOO_TIMEOUT}"
        r".*the process group's timeout \(3 s\)",
        zero["message"],
    ), zero["message"]
    for side in (zero, one):
        assert "an earlier synchronised step failed on this rank" in side["next_forward"], side["next_forward"]


# -- non-finite gradients ---------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_nan_gradient_is_caught_before_it_is_sent(ranks: list[dict[str, Any]]) -> None:
    zero, one = ranks[0]["faults"]["nan"], ranks[1]["faults"]["nan"]
    assert one["step"] == 1 and re.match(
        r"NonFiniteGradientError: gradcomm.DistributedDataParallel\(check_finite=True\): rank 1 has a non-finite "
        r"gradient for parameter '2.weight' \(512 NaN and 0 infinite of 512 values\) in step 1\.",
        one["message"],
    ), one["message"]
    assert zero["step"] == 1 and zero["message"].startswith("PeerLostError: rank 0 lost contact with its peers "
                                                             "during step 1, bucket"), zero["message"]


@pytest.mark.timeout(180)
def test_no_hook_turns_finite_gradients_into_nan_or_inf(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["numerics"] == KNOWN_OVERFLOWS, rank["numerics"]


# fp16 cannot hold magnitudes above 65504: an averaged 1e30 overflows to infinity (documented in
# gradcomm.hooks.default_hooks, as in torch's hook). Everything else stays finite.
KNOWN_OVERFLOWS: dict[str, list[str]] = {"fp16_compress": ["huge@0", "huge_mixed@0"]}


# -- ranks that disagree ------------------------------------------------------------------------------------
DISAGREEMENTS = {
    "different_hooks": r"RanksDisagreeError: gradcomm.DistributedDataParallel: the ranks disagree .*\n"
    r"  hook differs: rank 0: gradcomm.hooks.default_hooks.allreduce_hook; "
    r"rank 1: gradcomm.hooks.default_hooks.fp16_compress_hook\n",
    "different_buckets": r"(?s)RanksDisagreeError: .*bucket layout differs: rank 0: \d+ bucket\(s\) .*; rank 1: 1 "
    r"bucket\(s\) of \[\d+\] elements .*bucket_cap_mb_list differs: rank 0: \[104\]; rank 1: \[26214400\]",
    "different_bucket_cap": r"bucket_cap_mb differs: rank 0: 0.0001; rank 1: 25",
    "different_buckets_no_hook": r"(?s)RanksDisagreeError: .*bucket layout differs: rank 0: \d+ bucket\(s\)",
    "different_options": r"(?s)hook options differs: rank 0: PowerSGDState\(.*matrix_approximation_rank=1.*\); "
    r"rank 1: PowerSGDState\(.*matrix_approximation_rank=2",
    "different_wrapped": r"hook differs: rank 0: gradcomm.hooks.default_hooks._compress_wrapper.<locals>."
    r"compress_wrapper_hook\(dtype=torch.float16, hook=gradcomm.hooks.default_hooks.allreduce_hook\); rank 1: .*"
    r"hook=gradcomm.hooks.powerSGD_hook.powerSGD_hook\)",
    "hook_on_rank_0_only": r"hook differs: rank 0: gradcomm.hooks.default_hooks.allreduce_hook; rank 1: default "
    r"allreduce \(no hook registered\)",
    "different_ddp_options": r"check_parameters_every differs: rank 0: 0; rank 1: 5",
    "legacy_different_hooks": r"RanksDisagreeError: gradcomm.LegacyDistributedDataParallel: .*\n  hook differs",
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_disagreeing_ranks_all_raise(ranks: list[dict[str, Any]], case: str) -> None:
    for rank in ranks:  # the same error on every rank
        message = rank["disagreements"][case]
        assert re.search(DISAGREEMENTS[case], message), message
        assert "Every rank must wrap the same model" in message
    assert ranks[0]["disagreements"][case] == ranks[1]["disagreements"][case]
    assert all(rank["disagreements"]["agreeing_ranks_train"] for rank in ranks)


# -- uneven inputs ----------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("hook", JOIN_HOOKS)
def test_join_with_uneven_inputs(ranks: list[dict[str, Any]], hook: str) -> None:
    for rank in ranks:
        run = rank["uneven"]["join"][hook]
        assert run["steps"] == max(JOIN_BATCHES), run  # the joined rank shadowed the others' steps
        assert run["identical"], f"{hook}: parameters or buffers differ across ranks after join()"
        assert run["finite"], run
        assert run["buckets"] >= 2, run


@pytest.mark.timeout(180)
@pytest.mark.parametrize("variant", list(JOIN_VARIANTS))
def test_join_variants(ranks: list[dict[str, Any]], variant: str) -> None:
    for rank in ranks:
        run = rank["uneven"]["join_variants"][variant]
        assert run["steps"] == max(JOIN_VARIANTS[variant][1]), run
        assert run["identical"] and run["finite"], run


@pytest.mark.timeout(180)
def test_join_divisor_and_early_termination(ranks: list[dict[str, Any]]) -> None:
    one = ranks[1]["uneven"]
    assert one["divisor_initial"] <= 1e-6, one["divisor_initial"]  # joined ranks count as zeros: sum / 2
    assert one["divisor_active"] <= 1e-6, one["divisor_active"]  # divided by the one active rank
    torch_sentences = ("Rank 0 exhausted all inputs.", "Detected at least one rank that exhausted inputs.")
    for rank, torch_sentence in zip(ranks, torch_sentences, strict=True):  # torch's Join says these, per rank
        assert re.search(
            rf"{torch_sentence} .*join\(throw_on_early_termination=True\): rank\(s\) \[0\] ran out of inputs at "
            r"step 1",
            rank["uneven"]["throw_on_early_termination"],
        ), rank["uneven"]["throw_on_early_termination"]
        # refused on every rank before any collective of the step, so no rank is left waiting
        assert rank["uneven"]["not_first_joinable"].startswith(
            "RuntimeError: gradcomm.DistributedDataParallel must be the first joinable of its Join context"
        ), rank["uneven"]["not_first_joinable"]


# -- drift ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_parameter_drift_is_detected(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["drift"]["no_drift"] == "no error"
        assert re.match(
            r"ParameterDriftError: gradcomm.DistributedDataParallel\(check_parameters_every=2\): after 4 "
            r"synchronised steps the parameters of rank\(s\) \[1\] differ from rank 0's \(first differing "
            r"parameter: '2.weight'\)",
            rank["drift"]["drift"],
        ), rank["drift"]["drift"]


# -- a rank killed with SIGKILL ----------------------------------------------------------------------------
def killed_mid_training(kill_at: int = 3) -> int:
    ddp = gradcomm.DistributedDataParallel(_mlp(), bucket_cap_mb=0.001)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(kill_at + 100):
        if step == kill_at and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        _train_step(ddp, step, optimizer)
    return ddp.synchronised_steps


def kill_after_launching_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The all-gather hook, but rank 1 dies right after posting step 2's bucket 0 (a receive, then a send): the
    first of the step's several buckets, so rank 0 cannot finish step 2."""
    kill_after_launching_hook.step += bucket.index() == 0  # type: ignore[attr-defined]
    future = allgather_hooks.allgather_then_aggregate_hook(group, bucket)
    if dist.get_rank() == 1 and bucket.index() == 0 and kill_after_launching_hook.step == 2:  # type: ignore[attr-defined]
        os.kill(os.getpid(), signal.SIGKILL)
    return future


kill_after_launching_hook.step = -1  # type: ignore[attr-defined]


def killed_mid_gather() -> int:
    ddp = gradcomm.DistributedDataParallel(_mlp(), bucket_cap_mb_list=[0.001])
    ddp.register_comm_hook(None, kill_after_launching_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(100):
        _train_step(ddp, step, optimizer)
    return ddp.synchronised_steps


def _rank_processes() -> set[int]:
    """This process's live children that are multiprocessing ranks (not the resource tracker)."""
    me = os.getpid()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if int(stat[1]) == me and stat[0] != "Z" and "spawn_main" in cmdline:
            found.add(int(entry.name))
    return found


KILLED = {
    # how the rank is killed: (the function its ranks run, what rank 0's error must say)
    "during_allreduce": (
        killed_mid_training,
        r"step 3, bucket 0 \(hook: default allreduce \(no hook registered\)\)",
    ),
    "after_posting_an_exchange": (killed_mid_gather, r"step 2, bucket \d \(hook: kill_after_launching_hook\)"),
}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(KILLED))
def test_killed_rank_fails_the_others_quickly_and_leaves_no_process(case: str) -> None:
    ranks_run, where = KILLED[case]
    before = _rank_processes()
    with pytest.raises(RankError) as caught:
        run_on_ranks(ranks_run, 2, timeout=90, collective_timeout=10)
    message = str(caught.value)
    assert caught.value.rank == 1 and "rank 1 of 2 exited with code -9" in message, message
    assert re.search(
        rf"rank 0: PeerLostError: rank 0 lost contact with its peers during {where}: RuntimeError: "
        r".*Connection (closed|reset) by peer",
        message,
    ), message
    time.sleep(0.5)
    assert _rank_processes() - before == set(), "rank processes left behind"


# -- a rank stopped (SIGSTOP) inside backward, in the groups a hook makes ----------------------------------
STOP_TIMEOUT = 5.0  # seconds: the timeout of the DDP's group, which the hooks' own groups must take
STOP_AT = 4
STOPPED_HOOKS = {
    # hook that makes groups of its own: (world size, its options); rank 1 stops at step STOP_AT
    "post_localsgd": (3, {"start_localSGD_iter": 2}),  # the intra-node subgroup (every rank, on one machine)
    "hierarchical": (4, {"ranks_per_node": 2}),  # two node groups per node and the leaders' group
}


def _stop_in_backward(folder: Path) -> None:
    (folder / "stopped").write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)


def _wait_for_survivors(folder: Path, world_size: int, seconds: float = 60.0) -> None:
    """Every rank but 1 stays until all of them have failed (one leaving early would close its connections)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(
        (folder / f"rank{r}.json").exists() for r in range(world_size) if r != 1
    ):
        time.sleep(0.1)


def stopped_in_backward(hook: str, options: dict[str, Any], folder: str) -> None:
    """Train with ``hook``; rank 1 stops itself with SIGSTOP in the middle of step STOP_AT's backward, after
    its last bucket was handed to the hook. Every other rank writes what it raised and when; rank 0 then kills
    rank 1."""
    rank, path = dist.get_rank(), Path(folder)
    solo_timeout = process_group_timeout(solo_groups()[rank])  # gradcomm bench's groups, made before the stop
    group = dist.new_group(timeout=datetime.timedelta(seconds=STOP_TIMEOUT))
    ddp = gradcomm.DistributedDataParallel(_mlp(), process_group=group, bucket_cap_mb=0.001)
    hook_fn, state = make_comm_hook(hook, process_group=group, **options)
    ddp.register_comm_hook(state, hook_fn)
    step = 0

    def stop_after_the_last_bucket(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if rank == 1 and step == STOP_AT:
            output.register_hook(lambda grad: _stop_in_backward(path))

    ddp.module[1].register_forward_hook(stop_after_the_last_bucket)
    outcome: dict[str, Any] = {"message": "no error", "seconds": None}
    for step in range(STOP_AT + 3):
        started = time.monotonic()
        try:
            _train_step(ddp, step)
        except Exception as exc:
            outcome = {"message": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
            break
    outcome["step"] = step
    outcome["solo_group_timeout"], outcome["world_timeout"] = solo_timeout, process_group_timeout()
    (path / f"rank{rank}.json").write_text(json.dumps(outcome))
    _wait_for_survivors(path, dist.get_world_size())
    if rank == 0:
        os.kill(int((path / "stopped").read_text()), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("hook", list(STOPPED_HOOKS))
def test_stopped_rank_fails_every_other_rank_within_the_group_timeout(hook: str, tmp_path: Path) -> None:
    world_size, options = STOPPED_HOOKS[hook]
    before = _rank_processes()
    with pytest.raises(RankError) as caught:
        run_on_ranks(stopped_in_backward, world_size, (hook, options, str(tmp_path)), timeout=75)
    for rank in range(world_size):
        if rank == 1:
            continue
        report = tmp_path / f"rank{rank}.json"
        assert report.exists(), f"{hook}: rank {rank} still waited for the stopped rank 1 after 75 s: {caught.value}"
        outcome = json.loads(report.read_text())
        assert outcome["step"] == STOP_AT and outcome["message"].startswith(
            f"PeerLostError: rank {rank} lost contact with its peers during step {STOP_AT}"
        ), (hook, rank, outcome)
        assert outcome["seconds"] < STOP_TIMEOUT + 10, (hook, rank, outcome)
        assert outcome["solo_group_timeout"] == outcome["world_timeout"] == 30.0, (hook, rank, outcome)
    assert caught.value.rank == 1 and f"rank 1 of {world_size} exited with code -9" in str(caught.value)
    time.sleep(0.5)
    assert _rank_processes() - before == set(), "rank processes left behind"
