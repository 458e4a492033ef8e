"""``.grad`` as bucket views by default (``gradient_as_bucket_view=None``), where nothing a user sees changes.

The default saves the copy of every reduced bucket back into ``.grad`` (issue 13). What must not change
against torch's default (copies): the values of every gradient, bit for bit; a ``.grad`` the user still holds
after ``zero_grad()`` (the tensor itself, its ``.data`` or a view of it) keeps the values of its step; a
``.grad`` tensor held through a backward (made by ``no_sync()``, or assigned) receives the reduced values; a
``.grad`` kept by ``zero_grad(set_to_none=False)`` is accumulated into in place, as torch does; a
channels-last parameter keeps its memory format. And the saving must be real: without such references the
buckets keep their memory from step to step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradcomm
from gradcomm.testing import run_on_ranks
from tests.support.models import mlp

pytestmark = pytest.mark.slow  # every test reads one spawned comparison with torch's DDP

STEPS = 4


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


def _mlp() -> nn.Module:
    return mlp(6, 8, 8, 3, activation=nn.ReLU)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def _step(ddp: nn.Module, optimizer: torch.optim.Optimizer, step: int, set_to_none: bool = True) -> None:
    optimizer.zero_grad(set_to_none=set_to_none)
    x, y = _batch(step)
    nn.functional.cross_entropy(ddp(x), y).backward()


def _pair(torch_views: bool = False, **kwargs: Any) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """torch's DDP (its defaults, or ``gradient_as_bucket_view=torch_views``) and gradcomm's (``kwargs``) on
    the same model, with SGD each."""
    model = _mlp()
    ddps = [
        nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.0002, gradient_as_bucket_view=torch_views),
        gradcomm.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.0002, **kwargs),
    ]
    return ddps, [torch.optim.SGD(ddp.parameters(), lr=0.1) for ddp in ddps]


def _bucket_pointers(ddp: gradcomm.DistributedDataParallel) -> list[int]:
    return [bucket.buffer.data_ptr() for bucket in ddp._reducer.layout.buckets]


def _same_grads(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _user_hook(seen: list[tuple[bool, torch.Tensor]]) -> Any:
    """A post-accumulate-grad hook that records what ``.grad`` is when it runs, then changes it in place."""

    def hook(param: torch.Tensor) -> None:
        seen.append((param.grad._base is not None, param.grad.clone()))
        param.grad.mul_(1.0 + dist.get_rank())

    return hook


def _views_by_default() -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}

    # the default: the same gradients as torch's, .grad views of the buckets, no new memory per step
    (theirs, ours), optimizers = _pair()
    equal, pointers = [], []
    for step in range(STEPS):
        for ddp, optimizer in zip((theirs, ours), optimizers, strict=True):
            _step(ddp, optimizer, step)
        equal.append(_same_grads(theirs, ours))
        pointers.append(_bucket_pointers(ours))
        for optimizer in optimizers:
            optimizer.step()
    out["default_equal"] = equal
    out["default_views"] = all(p.grad._base is not None for p in ours.parameters())
    out["default_memory_kept"] = all(p == pointers[1] for p in pointers[1:])  # after the rebuild at step 1

    # references held across a step keep their values; the new gradients are still right
    for how in ("tensor", "data", "view"):
        (theirs, ours), optimizers = _pair()
        for ddp, optimizer in zip((theirs, ours), optimizers, strict=True):
            for step in range(2):
                _step(ddp, optimizer, step)
        if how == "tensor":
            held = [p.grad for p in ours.parameters()]
        elif how == "data":
            held = [p.grad.data for p in ours.parameters()]
        else:
            held = [p.grad.view(-1) for p in ours.parameters()]
        values = [h.clone() for h in held]
        for ddp, optimizer in zip((theirs, ours), optimizers, strict=True):
            _step(ddp, optimizer, 2)
        out[f"held_{how}_kept"] = all(torch.equal(h, v) for h, v in zip(held, values, strict=True))
        out[f"held_{how}_new_equal"] = _same_grads(theirs, ours)
        del held

    # a .grad held during the synchronised backward (made by a no_sync backward, or assigned by the user)
    # gets the reduced values, as torch's copies give it; the others are still views
    for how in ("no_sync", "assigned"):
        (theirs, ours), optimizers = _pair()
        held = []
        for ddp, optimizer in zip((theirs, ours), optimizers, strict=True):
            _step(ddp, optimizer, 0)
            optimizer.zero_grad()
            weight = ddp.module[0].weight
            if how == "no_sync":
                with ddp.no_sync():
                    x, y = _batch(20)
                    nn.functional.cross_entropy(ddp(x), y).backward()
            else:
                weight.grad = torch.full_like(weight, 0.5)
            held.append(weight.grad)
            x, y = _batch(21)
            nn.functional.cross_entropy(ddp(x), y).backward()
        out[f"{how}_held_reduced"] = torch.equal(held[0], held[1]) and ours.module[0].weight.grad is held[1]
        out[f"{how}_others_views"] = all(p.grad._base is not None for p in list(ours.parameters())[1:])
        out[f"{how}_equal"] = _same_grads(theirs, ours)
        del held

    # zero_grad(set_to_none=False): .grad stays the same tensor, accumulated into and reduced in place
    (theirs, ours), optimizers = _pair()
    for ddp, optimizer in zip((theirs, ours), optimizers, strict=True):
        _step(ddp, optimizer, 0, set_to_none=False)
        _step(ddp, optimizer, 1, set_to_none=False)
    kept = [p.grad for p in ours.parameters()]
    pointers = _bucket_pointers(ours)
    equal = []
    for step in (2, 3):
        for ddp, optimizer in zip((theirs, ours), optimizers, strict=True):
            with ddp.no_sync():  # accumulates into the bucket views
                x, y = _batch(10 + step)
                nn.functional.cross_entropy(ddp(x), y).backward()
            _step(ddp, optimizer, step, set_to_none=False)
        equal.append(_same_grads(theirs, ours))
    out["in_place_equal"] = equal
    out["in_place_same_tensors"] = all(p.grad is k for p, k in zip(ours.parameters(), kept, strict=True))
    out["in_place_memory_kept"] = _bucket_pointers(ours) == pointers

    # a channels-last parameter keeps its memory format (its bucket is copied into, as torch's default)
    torch.manual_seed(0)
    conv = ConvNet()
    conv.conv.weight.data = conv.conv.weight.data.contiguous(memory_format=torch.channels_last)
    nets = [nn.parallel.DistributedDataParallel(copy.deepcopy(conv)), gradcomm.DistributedDataParallel(conv)]
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 3, (2,), generator=g)
    for _ in range(2):
        for net in nets:
            net.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
    weight = nets[1].module.conv.weight.grad
    out["channels_last_kept"] = weight.is_contiguous(memory_format=torch.channels_last) and weight._base is None
    out["channels_last_equal"] = _same_grads(*nets)

    # a post-accumulate-grad hook the user registers after the DDP runs before the reduction, as torch's: it
    # sees the local gradient in .grad (not a bucket view) and what it changes in place is what is reduced
    for mode in (None, True, False):
        ddps, optimizers = _pair(torch_views=bool(mode), gradient_as_bucket_view=mode)
        seen: list[list[tuple[bool, torch.Tensor]]] = [[], []]
        for which, ddp in enumerate(ddps):
            for param in ddp.module.parameters():
                param.register_post_accumulate_grad_hook(_user_hook(seen[which]))
        equal = []
        for step in range(3):
            for ddp, optimizer in zip(ddps, optimizers, strict=True):
                _step(ddp, optimizer, step)
                optimizer.step()
            equal.append(_same_grads(*ddps))
        out[f"user_hook_{mode}_equal"] = equal
        out[f"user_hook_{mode}_saw_the_same"] = len(seen[0]) == len(seen[1]) and all(
            a == b and torch.equal(x, y) for (a, x), (b, y) in zip(*seen, strict=True)
        )

    # False is torch's default exactly: .grad are no views
    (theirs, ours), optimizers = _pair(gradient_as_bucket_view=False)
    for step in range(2):
        for ddp, optimizer in zip((theirs, ours), optimizers, strict=True):
            _step(ddp, optimizer, step)
    out["copies_when_false"] = all(p.grad._base is None for p in ours.parameters())
    out["copies_equal"] = _same_grads(theirs, ours)
    return out


@pytest.fixture(scope="module")
def observed() -> dict[str, Any]:
    return run_on_ranks(_views_by_default, 2, timeout=120)[0]


@pytest.mark.timeout(180)
def test_default_views_equal_torch_and_reuse_the_buckets(observed: dict[str, Any]) -> None:
    assert observed["default_equal"] == [True] * STEPS
    assert observed["default_views"]
    assert observed["default_memory_kept"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["tensor", "data", "view"])
def test_a_held_grad_keeps_its_values(observed: dict[str, Any], how: str) -> None:
    assert observed[f"held_{how}_kept"], f"a held .grad ({how}) was overwritten by the next step"
    assert observed[f"held_{how}_new_equal"]


@pytest.mark.timeout(180)
def test_zero_grad_without_none_accumulates_in_place(observed: dict[str, Any]) -> None:
    assert observed["in_place_equal"] == [True, True]
    assert observed["in_place_same_tensors"]
    assert observed["in_place_memory_kept"]


@pytest.mark.timeout(180)
def test_channels_last_and_false_are_copies(observed: dict[str, Any]) -> None:
    assert observed["channels_last_kept"] and observed["channels_last_equal"]
    assert observed["copies_when_false"] and observed["copies_equal"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["no_sync", "assigned"])
def test_a_grad_held_during_backward_gets_the_reduced_values(observed: dict[str, Any], how: str) -> None:
    assert observed[f"{how}_held_reduced"], f"a .grad held through the backward ({how}) kept the local values"
    assert observed[f"{how}_others_views"] and observed[f"{how}_equal"]


@pytest.mark.parametrize("mode", [None, True, False])
def test_a_later_post_accumulate_grad_hook_runs_before_the_reduction(observed: dict[str, Any], mode: Any) -> None:
    assert observed[f"user_hook_{mode}_saw_the_same"], "the user's hook saw a different .grad than under torch's DDP"
    assert all(observed[f"user_hook_{mode}_equal"]), "the gradients it changed were reduced differently from torch's"
