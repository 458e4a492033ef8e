"""Regression tests for reducer behaviours torch's own DDP tests found wrong, each against torch's DDP.

Every scenario runs twice in the same ranks, with torch's ``DistributedDataParallel`` and with gradcomm's, on
a fresh gloo group each, and returns what it observed (gradients, buffers, the error raised); the parent
asserts that gradcomm's observation equals torch's. One spawned group of two ranks runs them all.

* reentrant ``torch.utils.checkpoint`` inside the model: the step is averaged (the reducer finalises at the
  end of the outer backward, not of the checkpoint's inner one), with and without ``static_graph``;
  checkpointing a layer twice raises torch's "Expected to mark a variable ready only once" (a static graph
  allows it, as torch does);
* ``backward(create_graph=True)`` averages the gradients;
* ``no_sync`` with ``find_unused_parameters``: a parameter used only in the accumulation iterations gets its
  averaged gradient at the synchronised step;
* ``find_unused_parameters`` finds the tensors inside a dataclass output;
* two forwards before one backward with BatchNorm (the buffer broadcast keeps the version counters);
* a backward that leaves buckets unreduced is still reported at the next forward, with the parameter names;
* the whole DDP under non-reentrant checkpointing (its forward re-runs during backward), also with
  ``find_unused_parameters`` and ``static_graph``.
"""

from __future__ import annotations

import datetime
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import gradcomm
from gradcomm.testing import run_on_ranks
from tests.support.ranks import error_text


class Checkpointed(nn.Module):
    """``first`` plainly, then ``second`` under reentrant checkpointing ``times`` times."""

    def __init__(self, times: int = 1) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.times = times

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for _ in range(self.times):
            x = checkpoint(self.second, x, use_reentrant=True)
        return x


class Branches(nn.Module):
    """``extra`` takes part only when asked (used in the no_sync iterations only)."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(6, 6)
        self.extra = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        return self.main(x) + (self.extra(x) if use_extra else 0)


@dataclass
class Pair:
    left: torch.Tensor | None
    right: dict[str, torch.Tensor]


class DataclassOut(nn.Module):
    def __init__(self, skip_left: bool) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(5, 5), nn.Linear(5, 5)
        self.skip_left = skip_left

    def forward(self, x: torch.Tensor) -> Pair:
        return Pair(None if self.skip_left else self.left(x), {"out": self.right(x)})


class Power(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor([1.5, -0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.p.pow(2) * x).sum()


def _batch(step: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 * dist.get_rank() + step))


def _grads(module: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]


def _checkpointing(ddp_class: type, group: dist.ProcessGroup, times: int, **options: Any) -> Any:
    torch.manual_seed(0)
    ddp = ddp_class(Checkpointed(times), process_group=group, bucket_cap_mb=1e-4, **options)
    grads = []
    for step in range(3):
        ddp.zero_grad()
        try:
            ddp(_batch(step, 4, 8)).square().mean().backward()
        except RuntimeError as exc:
            return f"RuntimeError at step {step}: {exc}"
        grads.append(_grads(ddp.module))
    return grads


def _create_graph(ddp_class: type, group: dist.ProcessGroup) -> Any:
    torch.manual_seed(0)
    ddp = ddp_class(Power(), process_group=group)
    grads = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # both DDPs warn that the higher-order gradient is not synchronised
        for step in range(3):
            ddp.zero_grad()
            ddp(_batch(step, 2)).backward(create_graph=True)
            grads.append(_grads(ddp.module))
    return grads


def _no_sync_unused(ddp_class: type, group: dist.ProcessGroup) -> Any:
    torch.manual_seed(0)
    ddp = ddp_class(Branches(), process_group=group, find_unused_parameters=True)
    grads = []
    for step in range(2):
        ddp.zero_grad(set_to_none=True)
        with ddp.no_sync():
            ddp(_batch(step, 3, 6), use_extra=True).sum().backward()
        ddp(_batch(step + 10, 3, 6), use_extra=False).sum().backward()
        grads.append(_grads(ddp.module))
    return grads


def _dataclass(ddp_class: type, group: dist.ProcessGroup, skip_left: bool) -> Any:
    torch.manual_seed(0)
    ddp = ddp_class(DataclassOut(skip_left), process_group=group, find_unused_parameters=True)
    grads = []
    for step in range(2):
        ddp.zero_grad()
        out = ddp(_batch(step, 3, 5))
        (out.right["out"].sum() + (0 if out.left is None else out.left.square().sum())).backward()
        grads.append(_grads(ddp.module))
    return grads


def _two_forwards_batchnorm(ddp_class: type, group: dist.ProcessGroup) -> Any:
    torch.manual_seed(0)
    ddp = ddp_class(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), process_group=group)
    x = _batch(0, 6, 4)
    (ddp(x).mean() + ddp(x * 2).square().mean()).backward()
    return {"grads": _grads(ddp.module), "buffers": [b.clone() for b in ddp.module.buffers()]}


def _whole_model_checkpointed(ddp_class: type, group: dist.ProcessGroup, **options: Any) -> Any:
    """The whole DDP under non-reentrant checkpointing: its forward runs again inside backward (recomputation,
    which may stop early), re-arming the reducer there; each step is still reduced once."""
    torch.manual_seed(0)
    ddp = ddp_class(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), process_group=group, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = []
    for step in range(3):
        optimizer.zero_grad()
        checkpoint(ddp, _batch(step, 3, 4), use_reentrant=False).square().sum().backward()
        grads.append(_grads(ddp.module))
        optimizer.step()
    return grads


def _unfinished_backward(ddp_class: type, group: dist.ProcessGroup) -> Any:
    """A parameter that gets no gradient, without find_unused_parameters: both DDPs raise at the next forward."""
    torch.manual_seed(0)
    ddp = ddp_class(Branches(), process_group=group)
    ddp(_batch(0, 3, 6), use_extra=False).sum().backward()
    return error_text(lambda: ddp(_batch(1, 3, 6), use_extra=False))


SCENARIOS = {
    "checkpointing_once": lambda cls, g: _checkpointing(cls, g, 1),
    "checkpointing_once_static_graph": lambda cls, g: _checkpointing(cls, g, 1, static_graph=True),
    "checkpointing_once_bucket_view": lambda cls, g: _checkpointing(cls, g, 1, gradient_as_bucket_view=True),
    "checkpointing_twice": lambda cls, g: _checkpointing(cls, g, 2),
    "checkpointing_twice_static_graph": lambda cls, g: _checkpointing(cls, g, 2, static_graph=True),
    "checkpointing_find_unused": lambda cls, g: _checkpointing(cls, g, 1, find_unused_parameters=True),
    "create_graph": _create_graph,
    "no_sync_find_unused": _no_sync_unused,
    "dataclass_output": lambda cls, g: _dataclass(cls, g, skip_left=False),
    "dataclass_output_unused": lambda cls, g: _dataclass(cls, g, skip_left=True),
    "two_forwards_batchnorm": _two_forwards_batchnorm,
    "unfinished_backward": _unfinished_backward,
    "whole_model_checkpointed": _whole_model_checkpointed,
    "whole_model_checkpointed_find_unused": lambda cls, g: _whole_model_checkpointed(
        cls, g, find_unused_parameters=True
    ),
    "whole_model_checkpointed_static_graph": lambda cls, g: _whole_model_checkpointed(cls, g, static_graph=True),
}


def _observe(name: str, ddp_class: type) -> Any:
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    try:
        return SCENARIOS[name](ddp_class, group)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def reducer_cases() -> dict[str, tuple[Any, Any]]:
    torch.set_num_threads(1)
    return {name: (_observe(name, TorchDDP), _observe(name, gradcomm.DistributedDataParallel)) for name in SCENARIOS}


@pytest.fixture(scope="module")
def observed() -> list[dict[str, tuple[Any, Any]]]:
    return run_on_ranks(reducer_cases, 2, timeout=240)


def _same(torch_value: Any, ours: Any, where: str) -> None:
    if isinstance(torch_value, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{where}: torch has a tensor, gradcomm {ours!r}"
        torch.testing.assert_close(ours, torch_value, rtol=1.3e-6, atol=1e-6, msg=lambda m: f"{where}: {m}")
    elif isinstance(torch_value, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(torch_value), f"{where}: {ours!r}"
        for i, (a, b) in enumerate(zip(torch_value, ours, strict=True)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(torch_value, dict):
        assert isinstance(ours, dict) and ours.keys() == torch_value.keys(), f"{where}: {ours!r}"
        for key in torch_value:
            _same(torch_value[key], ours[key], f"{where}.{key}")
    else:
        assert ours == torch_value, f"{where}: torch {torch_value!r}, gradcomm {ours!r}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name", [name for name in SCENARIOS if name not in ("checkpointing_twice", "checkpointing_find_unused")]
)
def test_same_gradients_as_torch(observed: list[dict[str, tuple[Any, Any]]], name: str) -> None:
    for rank, outcomes in enumerate(observed):
        torch_value, ours = outcomes[name]
        if name == "unfinished_backward":
            assert torch_value.startswith("RuntimeError: Expected to have finished reduction"), torch_value
            assert ours.startswith(torch_value.split(" This error")[0]), ours  # torch's sentence first
            assert "gradcomm.DistributedDataParallel: the previous backward " in ours, ours
            assert "extra.weight, extra.bias" in ours, ours
            continue
        assert not isinstance(torch_value, str), f"rank {rank}: torch's DDP failed: {torch_value}"
        _same(torch_value, ours, f"rank {rank} {name}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["checkpointing_twice", "checkpointing_find_unused"])
def test_reentrant_gradient_twice_raises_torchs_error(observed: list[dict[str, tuple[Any, Any]]], name: str) -> None:
    """torch's regex ``Expected to mark a variable ready only once`` matches gradcomm's message, which also
    names the parameter and the way out."""
    for outcomes in observed:
        torch_value, ours = outcomes[name]
        assert torch_value.startswith("RuntimeError at step 0: Expected to mark a variable ready only once"), torch_value
        assert ours.startswith("RuntimeError at step 0: Expected to mark a variable ready only once."), ours
        assert "parameter second." in ours and "use_reentrant=False" in ours, ours
