"""gradcomm's DistributedDataParallel against torch's, on identical models, data and seeds.

Each case trains a torch-DDP replica and a gradcomm-DDP replica side by side for five steps, comparing the
gradients after every backward and the parameters after every optimizer step: bit for bit, on 2 and 3 ranks.
All cases of one world size share one spawned process group. On CPU tensors over gloo unless
``GRADCOMM_TEST_DEVICE`` / ``_BACKEND`` / ``_WORLD_SIZES`` say otherwise (:mod:`tests.support.ranks`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import (
    debugging_hooks,
    default_hooks,
    powerSGD_hook,
    quantization_hooks,
)

import gradcomm
from gradcomm.compression.registry import methods
from gradcomm.hooks.compression_hook import CompressionState, compressed_allreduce_hook
from gradcomm.hooks.parameter_keys import name_parameters
from gradcomm.testing import run_on_ranks
from tests.support.ranks import TEST_BACKEND, TEST_DEVICE, world_sizes_to_test

pytestmark = pytest.mark.slow  # every case on 2 and 3 ranks; tests/engine/test_reducer_regressions.py is the fast comparison

STEPS = 5
TOLERANCE = 0.0  # bit for bit: the same bucket layouts as torch's, so the same sums in the same order


class UnusedBranch(nn.Module):
    """``unused`` never takes part; ``rank_zero_only`` is used on rank 0 only (globally used, locally not)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)
        self.rank_zero_only = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.trunk(x))
        if dist.get_rank() == 0:
            x = x + self.rank_zero_only(x)
        return self.head(x)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


class MixedPrecision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.single = nn.Linear(8, 16)
        self.wide = nn.Linear(16, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(torch.relu(self.single(x)).double()).float()


class ScalarAndWide(nn.Module):
    """A 0-dim parameter (a learned temperature) and a weight larger than a staged run of gradient writes
    (``gradcomm.ddp.staging.RUN_BYTES``), beside small ones."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()
        self.wide = nn.Linear(4, 20_000)
        self.narrow = nn.Linear(20_000, 4)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.tanh(self.wide(self.body(x))) / self.wide.out_features  # SGD stays stable
        return self.narrow(features) * self.temperature


class Strided(nn.Module):
    """Dense parameters that are not contiguous: a transposed weight and a channels-last convolution kernel.
    torch lays their gradients out in the bucket in the parameter's memory order, and a hook's
    ``bucket.gradients()`` reinterprets that memory in the parameter's shape: a layout-sensitive hook
    (PowerSGD's matrices) sees those tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
        self.transposed = nn.Parameter(torch.randn(4, 8).t())  # [8, 4], strides (1, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.conv(x.contiguous(memory_format=torch.channels_last))).mean(dim=(2, 3))
        return self.head(features) + features @ self.transposed


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)
    )


def _frozen() -> nn.Module:
    model = _mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def _big() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _vector_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _image_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 4, generator=g)


def _token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randint(0, 20, (5, 3), generator=g), torch.randn(5, 3, 20, generator=g)


def _two_dim_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, _ = _vector_batch(step)
    return x, torch.randn(6, 2, generator=torch.Generator().manual_seed(step))


@dataclass
class Case:
    model: Callable[[], nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] = _vector_batch
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    hook: tuple[Callable[[], Any], Any] | None = None  # (state factory, hook)
    micro_batches: int = 1
    # torch's own hook is broken on gloo: where it fails, both DDPs must raise the same error; where it works
    # (NCCL, another torch version), both must match as in any other case
    fails_in_torch: bool = False


def _powersgd_state(batch: bool = False) -> Callable[[], Any]:
    def make() -> Any:
        return powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=1,
            start_powerSGD_iter=2,
            min_compression_rate=0.5,
            batch_tensors_with_same_shape=batch,
        )

    return make


CASES: dict[str, Case] = {
    "mlp": Case(_mlp),
    "cnn_batchnorm": Case(_cnn, _image_batch),
    "unused_branch": Case(UnusedBranch, _two_dim_batch, {"find_unused_parameters": True}),
    "frozen": Case(_frozen),
    "scalar_and_wide": Case(ScalarAndWide),
    "tied": Case(Tied, _token_batch),
    "fp32_and_fp64": Case(MixedPrecision),
    "param_larger_than_cap": Case(_big, ddp_kwargs={"bucket_cap_mb": 0.005}),
    "gradient_as_bucket_view": Case(_mlp, ddp_kwargs={"gradient_as_bucket_view": True}),
    "no_sync_4_micro_batches": Case(_mlp, micro_batches=4),
    "hook_allreduce": Case(_mlp, hook=(lambda: None, default_hooks.allreduce_hook)),
    # From 3 ranks on, gloo's ring sums each element in an order that depends on its offset in the bucket:
    # bit for bit only because the bucket layouts are torch's, the first iteration's included.
    "hook_fp16": Case(_mlp, hook=(lambda: None, default_hooks.fp16_compress_hook)),
    "hook_powerSGD": Case(_mlp, hook=(_powersgd_state(), powerSGD_hook.powerSGD_hook)),
    # torch 2.13's batched_powerSGD_hook hands a 2-D Q to an orthogonalizer that asserts a 3-D batch, so it
    # fails on torch's own DDP once PowerSGD starts; gradcomm.hooks has a working one.
    "hook_batched_powerSGD": Case(
        _mlp, hook=(_powersgd_state(), powerSGD_hook.batched_powerSGD_hook), fails_in_torch=True
    ),
    # torch 2.13's quantization hooks index the all-gather future's value as NCCL shapes it; on gloo they
    # fail on torch's own DDP. gradcomm.hooks.quantization_hooks work on every backend.
    "hook_quantization_per_tensor": Case(
        _mlp, hook=(lambda: None, quantization_hooks.quantization_pertensor_hook), fails_in_torch=True
    ),
    "hook_quantization_per_channel": Case(
        _mlp, hook=(lambda: None, quantization_hooks.quantization_perchannel_hook), fails_in_torch=True
    ),
    "hook_noop": Case(_mlp, hook=(lambda: None, debugging_hooks.noop_hook)),
    "strided": Case(Strided, _image_batch),
    "strided_bucket_views": Case(Strided, _image_batch, {"gradient_as_bucket_view": True}),
    "strided_powerSGD": Case(Strided, _image_batch, hook=(_powersgd_state(), powerSGD_hook.powerSGD_hook)),
    "hook_powerSGD_no_sync": Case(_mlp, hook=(_powersgd_state(), powerSGD_hook.powerSGD_hook), micro_batches=3),
    # Every compression method, every tensor compressed, on layouts where a misplaced element would show:
    # the lossy methods' results are only checked here, against the same hook on torch's DDP.
    **{
        f"strided_{name}": Case(
            Strided,
            _image_batch,
            hook=(
                lambda method=method: CompressionState(method(), min_numel=1, min_compression_rate=0),
                compressed_allreduce_hook,
            ),
        )
        for name, method in methods().items()
    },
}


def _relative_error(ours: torch.Tensor | None, theirs: torch.Tensor | None) -> float:
    if ours is None or theirs is None:
        return 0.0 if ours is None and theirs is None else float("inf")
    scale = theirs.abs().max().item()
    return (ours - theirs).abs().max().item() / max(scale, 1e-12)


def _train_step(ddp: nn.Module, optimizer: torch.optim.Optimizer, case: Case, step: int) -> float:
    optimizer.zero_grad()
    total = 0.0
    for micro in range(case.micro_batches):
        x, y = (t.to(TEST_DEVICE) for t in case.batch(step * case.micro_batches + micro))
        last = micro == case.micro_batches - 1
        context = ddp.no_sync() if not last else contextlib.nullcontext()
        with context:
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
        total += loss.item()
    return total


def _run_case(name: str, torch_may_fail: bool = True) -> dict[str, float]:
    case = CASES[name]
    torch.manual_seed(0)
    reference_model = case.model().to(TEST_DEVICE)
    our_model = copy.deepcopy(reference_model)
    name_parameters(reference_model)  # gradcomm's hooks key their state by name, as on gradcomm's DDP
    reference = nn.parallel.DistributedDataParallel(reference_model, **case.ddp_kwargs)
    ours = gradcomm.DistributedDataParallel(our_model, **case.ddp_kwargs)
    if case.hook is not None:
        make_state, hook = case.hook
        reference.register_comm_hook(make_state(), hook)
        ours.register_comm_hook(make_state(), hook)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    worst = {"grad": 0.0, "param": 0.0, "loss": 0.0, "buffer": 0.0, "grad_layout": 0.0}
    if case.fails_in_torch and torch_may_fail:
        failed = _first_failure(reference, opt_ref, case)
        if failed is None:  # torch's hook works here: compare the values, from a fresh start
            return _run_case(name, torch_may_fail=False)
        return _compare_failures(failed, ours, opt_ours, case)
    for step in range(STEPS):
        loss_ref = _train_step(reference, opt_ref, case, step)
        loss_ours = _train_step(ours, opt_ours, case, step)
        worst["loss"] = max(worst["loss"], abs(loss_ref - loss_ours) / max(abs(loss_ref), 1e-12))
        for p_ref, p_ours in zip(reference.parameters(), ours.parameters(), strict=True):
            worst["grad"] = max(worst["grad"], _relative_error(p_ours.grad, p_ref.grad))
            if p_ref.grad is not None and p_ours.grad is not None and p_ours.grad.stride() != p_ref.grad.stride():
                worst["grad_layout"] = 1.0
        opt_ref.step()
        opt_ours.step()
        for p_ref, p_ours in zip(reference.parameters(), ours.parameters(), strict=True):
            worst["param"] = max(worst["param"], _relative_error(p_ours.detach(), p_ref.detach()))
        for b_ref, b_ours in zip(reference.buffers(), ours.buffers(), strict=True):
            if b_ref.is_floating_point():
                worst["buffer"] = max(worst["buffer"], _relative_error(b_ours, b_ref))
    checksum = torch.stack([p.detach().double().sum() for p in ours.parameters()])
    gathered = [torch.empty_like(checksum) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, checksum)
    worst["ranks_identical"] = float(all(torch.equal(g, gathered[0]) for g in gathered))
    worst["world_size"] = dist.get_world_size()
    return worst


def _first_failure(
    ddp: nn.Module, optimizer: torch.optim.Optimizer, case: Case
) -> tuple[int, BaseException] | None:
    for step in range(STEPS):
        try:
            _train_step(ddp, optimizer, case, step)
        except Exception as exc:
            return step, exc
        optimizer.step()
    return None


def _compare_failures(
    torch_failure: tuple[int, BaseException], ours: nn.Module, opt_ours: torch.optim.Optimizer, case: Case
) -> dict[str, float]:
    step_ref, error_ref = torch_failure
    failed = _first_failure(ours, opt_ours, case)
    assert failed is not None, "gradcomm's DDP did not fail where torch's did"
    step_ours, error_ours = failed
    assert isinstance(error_ours, gradcomm.CommHookError), repr(error_ours)
    same = step_ref == step_ours and type(error_ours.__cause__) is type(error_ref)
    return {"grad": 0.0, "param": 0.0, "loss": 0.0, "buffer": 0.0, "ranks_identical": 1.0, "same_failure": float(same)}


def compare_all(names: list[str]) -> dict[str, dict[str, float]]:
    return {name: _run_case(name) for name in names}


@pytest.fixture(scope="module", params=world_sizes_to_test(), ids=lambda n: f"world{n}")
def results(request: pytest.FixtureRequest) -> dict[str, dict[str, float]]:
    return run_on_ranks(compare_all, request.param, args=(list(CASES),), backend=TEST_BACKEND, timeout=240)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_ddp(results: dict[str, dict[str, float]], name: str) -> None:
    worst = results[name]
    if "same_failure" in worst:
        assert worst["same_failure"] == 1.0, f"{name}: gradcomm's DDP did not fail like torch's"
        return
    for quantity in ("grad", "param", "loss", "buffer"):
        assert worst[quantity] <= TOLERANCE, f"{name}: {quantity} differs from torch's DDP by {worst[quantity]:.3g}"
    assert worst["grad_layout"] == 0.0, f"{name}: a .grad has other strides than under torch's DDP"
    if name != "hook_noop" or worst["world_size"] == 1:
        assert worst["ranks_identical"] == 1.0, f"{name}: ranks ended with different parameters"
    else:
        assert worst["ranks_identical"] == 0.0, "noop hook: ranks should have diverged (local gradients only)"
