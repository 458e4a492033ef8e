"""The five ways replicas once diverged silently, each as a check that failed before its fix.

1. PowerSGD dropped 0-dim parameters from averaging.
2. (a torn checkpoint: see ``tests/checkpoint/test_atomic_saves.py``)
3. A hook whose future fails on one rank put the collectives out of step: the next bucket's collective
   paired with the peers' version of the failed one. Also a PowerSGD stage failing on one rank.
4. A backward inside the DDP's forward (Lightning's manual optimization) was not synchronised.
5. Callable-object hooks that differ passed the cross-rank agreement check.

And the default replica check: a hook that does not average is caught within ``CHECK_PARAMETERS_EVERY``
steps; hooks that leave replicas different on purpose are exempt, and the model averager checks right after
it averages. One spawned group of two ranks runs everything; each fault runs on a fresh gloo subgroup with a
short timeout, and what the *other* rank went on to exchange is returned and asserted here.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradcomm
from gradcomm.ddp.distributed import CHECK_PARAMETERS_EVERY
from gradcomm.hooks import default_hooks, powerSGD_hook
from gradcomm.hooks.averagers import PeriodicModelAverager
from gradcomm.hooks.debugging_hooks import noop_hook
from gradcomm.hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from gradcomm.hooks.powersgd import kernel as powersgd_kernel
from gradcomm.testing import run_on_ranks
from tests.support.ranks import error_text
from tests.support.training import random_batch

pytestmark = pytest.mark.slow  # every test reads one spawned group's results

FAULT_TIMEOUT = 3.0


def _fault_group() -> dist.ProcessGroup:
    dist.barrier()
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=FAULT_TIMEOUT))


def _batch(step: int, features: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(1000 * dist.get_rank() + step, 6, features, 1)


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _steps(ddp: nn.Module, steps: int, first: int = 0) -> list[str]:
    """Train; return what happened at each step ("ok" or the error), stopping at the first error."""
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    outcome = []
    for step in range(first, first + steps):
        x, y = _batch(step)
        try:
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            outcome.append("ok")
        except Exception as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")
            break
    return outcome


# -- 1. PowerSGD and 0-dim parameters ------------------------------------------------------------------------
class Gated(nn.Module):
    """A scalar gate (a temperature, a ReZero alpha) beside matrices PowerSGD compresses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.gate = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate * self.body(x)


def _powersgd_scalar() -> dict[str, Any]:
    out = {}
    for hook in ("powerSGD_hook", "batched_powerSGD_hook"):
        ddp = gradcomm.DistributedDataParallel(Gated(), check_parameters_every=0)
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, getattr(powerSGD_hook, hook))
        out[hook] = {"outcome": _steps(ddp, 5), "params": _params(ddp.module)}
    return out


# -- 3. a bucket failing on one rank ---------------------------------------------------------------------------
def failed_future_on_rank_one_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The issue's case: a future already failed, returned on rank 1 for bucket 0 of step 1."""
    if dist.get_rank() == 1 and bucket.index() == 0 and failed_future_on_rank_one_hook.step == 1:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_exception(RuntimeError("no codebook on rank 1"))
        return future
    if bucket.is_last():
        failed_future_on_rank_one_hook.step += 1
    return default_hooks.allreduce_hook(group, bucket)


failed_future_on_rank_one_hook.step = 0  # type: ignore[attr-defined]


class EqualBuckets(nn.Module):
    """Three parameters of 64 elements each; with a 256-byte cap every bucket holds one of them, so a
    collective of one bucket pairs silently with another bucket's on a peer (gloo cannot tell them apart)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (nn.Parameter(torch.randn(8, 8)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.a @ self.b @ self.c).sum(1, keepdim=True)


def _failed_bucket() -> dict[str, Any]:
    out: dict[str, Any] = {}
    group = _fault_group()
    ddp = gradcomm.DistributedDataParallel(EqualBuckets(), process_group=group, bucket_cap_mb_list=[256 / 2**20])  # buckets from the first step
    ddp.register_comm_hook(group, failed_future_on_rank_one_hook)
    out["buckets"] = ddp.reducer.bucket_count
    out["outcome"] = _steps(ddp, 3)
    out["params"] = _params(ddp.module)
    return out


class _FailingOnP:
    """Replaces PowerSGD's orthogonalisation on rank 1: raises for the first P with ``rows`` rows, which is
    orthogonalised in a callback once P's allreduce has completed (fresh Qs have other shapes)."""

    def __init__(self, original: Any, rows: int) -> None:
        self.original, self.rows, self.failed = original, rows, False

    def __call__(self, matrices: torch.Tensor, *args: Any) -> Any:
        if dist.get_rank() == 1 and not self.failed and matrices.shape[-2] == self.rows:
            self.failed = True
            raise FloatingPointError("orthogonalisation failed on rank 1")
        return self.original(matrices, *args)


def _failed_powersgd_stage() -> dict[str, Any]:
    """In the first compressed step, orthogonalising bucket 0's P fails on rank 1 after P was summed, so
    rank 1 never sums Q: it must launch nothing after it either (its bucket 1 would pair with rank 0's Q)."""
    group = _fault_group()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = gradcomm.DistributedDataParallel(model, process_group=group, bucket_cap_mb=2048 / 2**20)
    state = powerSGD_hook.PowerSGDState(group, matrix_approximation_rank=2, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    original = powersgd_kernel.orthogonalize
    powersgd_kernel.orthogonalize = _FailingOnP(original, rows=16)  # the P of the 16x32 weight
    try:
        outcome = _steps(ddp, 4)
    finally:
        powersgd_kernel.orthogonalize = original
    dist.barrier()  # rank 1 stays until rank 0 has failed: its exit would close the connections early
    return {"buckets": ddp.reducer.bucket_parameter_names(), "outcome": outcome}


# -- 4. backward inside the DDP's forward -------------------------------------------------------------------------
class ManualOptimization(nn.Module):
    """``training_step`` with manual optimization: the loss's backward runs inside the forward."""

    def __init__(self, with_unused: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.unused = nn.Linear(4, 4) if with_unused else None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.net(x), y)
        loss.backward()
        return loss.detach()


def _backward_in_forward() -> dict[str, Any]:
    out = {}
    for find_unused in (False, True):
        ddp = gradcomm.DistributedDataParallel(ManualOptimization(find_unused), find_unused_parameters=find_unused)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        grads = []
        for step in range(3):
            optimizer.zero_grad()
            ddp(*_batch(step))
            grads.append([p.grad.clone() for p in ddp.module.net.parameters()])
            optimizer.step()
        local = ManualOptimization(False)  # the same initial weights: this rank's unsynchronised gradients
        local(*_batch(0))
        out[find_unused] = {
            "grads_step0": grads[0],
            "local_step0": [p.grad.clone() for p in local.net.parameters()],
            "steps_counted": ddp.comm_stats().total.steps,
            "params": _params(ddp.module.net),
        }
    return out


# -- 5. callable-object hooks ---------------------------------------------------------------------------------------
class Wrapper:
    """A hook as a callable object around another hook."""

    def __init__(self, hook: Any) -> None:
        self.hook = hook

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return self.hook(state, bucket)


def _callable_objects() -> dict[str, str]:
    inner = default_hooks.allreduce_hook if dist.get_rank() == 0 else default_hooks.fp16_compress_hook
    ddp = gradcomm.DistributedDataParallel(nn.Linear(8, 1))
    differing = error_text(lambda: ddp.register_comm_hook(None, Wrapper(inner)))
    ddp = gradcomm.DistributedDataParallel(nn.Linear(8, 1))
    same = error_text(lambda: ddp.register_comm_hook(None, Wrapper(default_hooks.allreduce_hook)))
    return {"differing": differing, "same": same}


# -- the default replica check ------------------------------------------------------------------------------------------
def local_only_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A user hook that, by a bug, never averages (and does not declare it)."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _default_replica_check() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, hook in (("undeclared", local_only_hook), ("noop", noop_hook)):
        ddp = gradcomm.DistributedDataParallel(nn.Linear(8, 1))
        ddp.register_comm_hook(None, hook)
        out[name] = _steps(ddp, CHECK_PARAMETERS_EVERY + 2)
    # post-local SGD: the DDP's check skips the local phase; the averager checks after averaging, and
    # catches a frozen parameter that one rank changed (averaging leaves parameters without gradients alone)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    model[0].bias.requires_grad_(False)
    ddp = gradcomm.DistributedDataParallel(model, check_parameters_every=2)
    ddp.register_comm_hook(PostLocalSGDState(None, None, start_localSGD_iter=2), post_localSGD_hook)
    averager = PeriodicModelAverager(period=4, warmup_steps=2)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    outcome = []
    for step in range(8):
        x, y = _batch(step)
        try:
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            if step == 4 and dist.get_rank() == 1:
                with torch.no_grad():
                    model[0].bias.add_(1.0)
            averager.average_parameters(ddp.parameters())
            outcome.append("ok")
        except Exception as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")
            break
    out["post_localsgd"] = outcome
    return out


def trust_checks() -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "powersgd_scalar": _powersgd_scalar(),
        "backward_in_forward": _backward_in_forward(),
        "callable_objects": _callable_objects(),
        "replica_check": _default_replica_check(),
        "failed_bucket": _failed_bucket(),
        "failed_powersgd_stage": _failed_powersgd_stage(),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_on_ranks(trust_checks, 2, timeout=150, collective_timeout=30)


def _identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("hook", ["powerSGD_hook", "batched_powerSGD_hook"])
def test_powersgd_averages_0dim_parameters(ranks: list[dict[str, Any]], hook: str) -> None:
    zero, one = ranks[0]["powersgd_scalar"][hook], ranks[1]["powersgd_scalar"][hook]
    assert zero["outcome"] == one["outcome"] == ["ok"] * 5
    assert _identical(zero["params"], one["params"]), "replicas differ: the scalar gate was not averaged"


@pytest.mark.timeout(180)
def test_already_failed_future_stops_the_step_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    zero, one = ranks[0]["failed_bucket"], ranks[1]["failed_bucket"]
    assert zero["buckets"] == 3
    assert one["outcome"][:1] == ["ok"] and re.match(
        r"CommHookError: Communication hook failed_future_on_rank_one_hook: the future it returned for bucket 0 "
        r"failed: RuntimeError: no codebook on rank 1 \(rank 1, step 1\)",
        one["outcome"][1],
    ), one["outcome"]
    # rank 0 waits for bucket 0, which rank 1 never sends; before the fix rank 1's bucket 1 paired with it
    # (and bucket 2 with rank 0's bucket 1), so rank 0 got wrong gradients and only bucket 2 timed out
    assert zero["outcome"][0] == "ok" and zero["outcome"][1].startswith(
        "PeerLostError: rank 0 lost contact with its peers during step 1, bucket 0 "
    ), zero["outcome"]
    assert len(zero["outcome"]) == len(one["outcome"]) == 2


@pytest.mark.timeout(180)
def test_failed_powersgd_stage_launches_nothing_after_it(ranks: list[dict[str, Any]]) -> None:
    zero, one = ranks[0]["failed_powersgd_stage"], ranks[1]["failed_powersgd_stage"]
    assert zero["buckets"] == [["4.bias", "4.weight", "2.bias", "2.weight"], ["0.bias", "0.weight"]]
    assert one["outcome"][:2] == ["ok", "ok"], one
    assert one["outcome"][2].startswith("CommHookError: Communication hook powerSGD_hook"), one
    assert "orthogonalisation failed on rank 1" in one["outcome"][2], one
    # before the fix rank 1's bucket 1 collectives paired with rank 0's Q of bucket 0: a size mismatch that
    # gloo answered with SIGABRT. Now rank 0 waits in vain for bucket 0's Q or bucket 1's first collective
    # (both time out; which one it reports first depends on timing)
    assert zero["outcome"][:2] == ["ok", "ok"] and re.match(
        r"PeerLostError: rank 0 lost contact with its peers during step 2, bucket [01] \(hook: powerSGD_hook\)",
        zero["outcome"][2],
    ), zero["outcome"]
    assert re.search(r"(?i)timed out|timeout|connection (closed|reset)", zero["outcome"][2]), zero["outcome"][2]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("find_unused", [False, True])
def test_backward_inside_forward_is_synchronised(ranks: list[dict[str, Any]], find_unused: bool) -> None:
    zero, one = ranks[0]["backward_in_forward"][find_unused], ranks[1]["backward_in_forward"][find_unused]
    for side in (zero, one):
        assert side["steps_counted"] == 3
        for synced, mine, theirs in zip(side["grads_step0"], zero["local_step0"], one["local_step0"], strict=True):
            torch.testing.assert_close(synced, (mine + theirs) / 2, rtol=1e-6, atol=1e-7)
    assert _identical(zero["params"], one["params"])


@pytest.mark.timeout(180)
def test_differing_callable_object_hooks_are_refused(ranks: list[dict[str, Any]]) -> None:
    for side in ranks:
        text = side["callable_objects"]["differing"]
        assert text.startswith("RanksDisagreeError"), text
        assert "Wrapper(hook=gradcomm.hooks.default_hooks.allreduce_hook)" in text, text
        assert "Wrapper(hook=gradcomm.hooks.default_hooks.fp16_compress_hook)" in text, text
        assert side["callable_objects"]["same"] == "no error"


@pytest.mark.timeout(180)
def test_replicas_are_checked_by_default(ranks: list[dict[str, Any]]) -> None:
    for side in ranks:
        checks = side["replica_check"]
        undeclared = checks["undeclared"]
        assert undeclared[:-1] == ["ok"] * CHECK_PARAMETERS_EVERY, undeclared[-3:]
        assert undeclared[-1].startswith(
            f"ParameterDriftError: gradcomm.DistributedDataParallel(check_parameters_every={CHECK_PARAMETERS_EVERY}): "
            f"after {CHECK_PARAMETERS_EVERY} synchronised steps the parameters of rank(s) [1] differ from rank 0's"
        ), undeclared[-1]
        assert "replicas_may_differ" in undeclared[-1]
        assert checks["noop"] == ["ok"] * (CHECK_PARAMETERS_EVERY + 2), "noop declares that replicas differ"
        local_sgd = checks["post_localsgd"]
        # averagings after steps 2 and 6; rank 1 changed a frozen parameter after step 4
        assert local_sgd[:6] == ["ok"] * 6, local_sgd
        assert local_sgd[6].startswith(
            "ParameterDriftError: PeriodicModelAverager(check_after_averaging=True): right after averaging at "
            "averager step 6, the parameters of rank(s) [1] differ from rank 0's (first differing parameter: "
            "'parameter #1')"
        ), local_sgd[6]
