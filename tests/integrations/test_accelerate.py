"""gradcomm under Hugging Face Accelerate 1.15 on 2 CPU ranks (gloo), for real: no mocks.

The spawned group runs ``GradcommAccelerator(cpu=True)`` inside :func:`gradcomm.testing.run_on_ranks`, whose
ranks already hold an initialised gloo process group and the ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_*`` variables; ``cpu=True`` with ``LOCAL_RANK`` set makes Accelerate's ``PartialState`` pick
``MULTI_CPU`` with gloo and adopt that group. One group checks, for each DDP kind, against references driven by
hand:

(a) every hook that torch's own fail with on gloo (bf16, both quantizations, batched PowerSGD; torch's
    PowerSGD too, once a model has several buckets: its callbacks launch collectives in different orders on
    different ranks), plus allreduce, fp16 and PowerSGD, trains 3 steps: gradients equal the same hook on a
    hand-driven DDP of the same kind bit for bit (torch's DDP without a hook for allreduce), the first
    step's equal the exact big-batch mean within the hook's precision, ``unwrap_model`` gives the module back,
    and replicas end identical;
(b) ``accumulate()`` with ``gradient_accumulation_steps=2``: the hook is not called on the accumulating
    micro-batch, and the synchronised gradients equal one big-batch gradient;
(c) ``join_uneven_inputs(even_batches=False)`` with 3 batches on rank 0 and 2 on rank 1 completes, equals a
    hand-driven ``Join`` bit for bit, and leaves the replicas identical;
(e) ``save_state``/``load_state`` with the per-rank hook-state checkpoint resumes PowerSGD bit for bit.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradcomm
from gradcomm.hooks import default_hooks
from gradcomm.testing import run_on_ranks
from tests.support.models import HeadFirst
from tests.support.ranks import each_part, error_text, part_results
from tests.support.training import flat_gradients, flat_parameters, random_batch

pytest.importorskip("accelerate")

from gradcomm.integrations.accelerate import GradcommAccelerator, GradcommKwargs  # noqa: E402

STEPS = 3
RUN_TIMEOUT = 400  # the one spawned group: every part, on both DDP kinds
POWERSGD = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
# hook name -> (options, tolerance of the first step's gradient to the exact mean, relative to its largest entry)
HOOKS: dict[str, tuple[dict[str, Any], float]] = {
    "allreduce": ({}, 1e-6),
    "fp16_compress": ({}, 2e-3),
    "bf16_compress": ({}, 2e-2),
    "quantize_per_tensor": ({}, 5e-2),
    "quantize_per_channel": ({}, 5e-2),
    "powersgd": (POWERSGD, 1e-6),  # the first step is before start_powerSGD_iter: an exact allreduce
    "batched_powersgd": (POWERSGD, 1e-6),
}


HOOK_CALLS = [0]


def counting_allreduce_hook(state, bucket):
    """gradcomm's allreduce hook, counting its calls in ``HOOK_CALLS`` (unannotated: torch's DDP compares a
    hook's annotations with ``dist.GradBucket`` itself, and this module's annotations are strings)."""
    HOOK_CALLS[0] += 1
    return default_hooks.allreduce_hook(state, bucket)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return HeadFirst(inputs=8, hidden=32, features=16)


def _batch(rank: int, step: int, size: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(1000 * rank + step, size, 8, 4)


def _accelerator(kind: str, hook: Any = None, accumulation: int = 1, **options: Any) -> GradcommAccelerator:
    kwargs = GradcommKwargs(hook, ddp=kind, bucket_cap_mb=0.002, **options)
    accelerator = GradcommAccelerator(cpu=True, kwargs_handlers=[kwargs], gradient_accumulation_steps=accumulation)
    accelerator.gradcomm_kwargs = kwargs
    return accelerator


def _train(model: nn.Module, optimizer: Any, backward: Any, steps: int) -> list[np.ndarray]:
    grads = []
    for step in range(steps):
        x, y = _batch(dist.get_rank(), step)
        optimizer.zero_grad()
        backward(nn.functional.mse_loss(model(x), y))
        grads.append(flat_gradients(model))
        optimizer.step()
    return grads


def _reference_ddp(kind: str, hook: Any, state: Any) -> nn.Module:
    """The DDP of ``kind`` Accelerate would build, driven by hand (the bucket layouts of the two differ)."""
    ddp_class = gradcomm.DistributedDataParallel if kind == "gradcomm" else nn.parallel.DistributedDataParallel
    ddp = ddp_class(_model(), bucket_cap_mb=0.002)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    return ddp


def _exact_first_gradient() -> np.ndarray:
    """The gradient of the mean loss over both ranks' first batches, on one process."""
    model = _model()
    xs, ys = zip(*(_batch(rank, 0) for rank in range(dist.get_world_size())), strict=True)
    nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
    return flat_gradients(model)


def _hooks_train(kind: str) -> dict[str, Any]:
    """(a): every hook under Accelerate against a hand-driven DDP and the exact mean."""
    from gradcomm.hooks.registry import make_comm_hook

    exact = _exact_first_gradient()
    out: dict[str, Any] = {}
    for name, (options, tolerance) in HOOKS.items():
        accelerator = _accelerator(kind, name, **options)
        model = accelerator.prepare(_model())
        optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        grads = _train(model, optimizer, accelerator.backward, STEPS)

        # no hook for allreduce (DDP's own); gradcomm's hook on a hand-driven DDP otherwise
        hook, state = (None, None) if name == "allreduce" else make_comm_hook(name, **options)
        reference = _reference_ddp(kind, hook, state)
        expected = _train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), lambda loss: loss.backward(), STEPS)
        out[name] = {
            "ddp": type(model).__module__,
            "unwrapped": type(accelerator.unwrap_model(model)).__name__,
            "bitwise": all(np.array_equal(a, b) for a, b in zip(grads, expected, strict=True)),
            "to_exact": float(np.abs(grads[0] - exact).max() / np.abs(exact).max()),
            "tolerance": tolerance,
            "params": flat_parameters(accelerator.unwrap_model(model)),
        }
    return out


def _accumulate(kind: str) -> dict[str, Any]:
    """(b): two micro-batches per step; the hook runs only on the second."""
    HOOK_CALLS[0] = 0  # counted from here: the process ran the other DDP kind's parts before
    accelerator = _accelerator(kind, counting_allreduce_hook, accumulation=2)
    model = accelerator.prepare(_model())
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    calls, synced = [], []
    for micro in range(4):
        x, y = _batch(dist.get_rank(), micro)
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            calls.append(HOOK_CALLS[0])
            if accelerator.sync_gradients:
                synced.append(flat_gradients(model))
            optimizer.step()
            optimizer.zero_grad()
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for first in (0, 2):  # the big batch of an optimizer step: both micro-batches of both ranks
        xs, ys = zip(
            *(_batch(r, m) for r in range(dist.get_world_size()) for m in (first, first + 1)), strict=True
        )
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(torch.cat(xs)), torch.cat(ys)).backward()
        expected.append(flat_gradients(reference))
        ref_opt.step()
    return {
        "calls": calls,
        "max_error": max(float(np.abs(a - b).max()) for a, b in zip(synced, expected, strict=True)),
        "synced_steps": len(synced),
        "params": flat_parameters(accelerator.unwrap_model(model)),
    }


def _join(kind: str) -> dict[str, Any]:
    """(c): a prepared loader with uneven batches (even_batches=False) under join_uneven_inputs."""
    accelerator = _accelerator(kind, "fp16_compress")
    g = torch.Generator().manual_seed(7)
    dataset = torch.utils.data.TensorDataset(torch.randn(9, 8, generator=g), torch.randn(9, 4, generator=g))
    model = accelerator.prepare(_model())
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    loader = accelerator.prepare(torch.utils.data.DataLoader(dataset, batch_size=2))
    batches = []
    with accelerator.join_uneven_inputs([model], even_batches=False):
        for x, y in loader:
            batches.append((x, y))
            optimizer.zero_grad()
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
    from torch.distributed.algorithms.join import Join

    reference = _reference_ddp(kind, default_hooks.fp16_compress_hook, None)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    with Join([reference]):
        for x, y in batches:
            ref_opt.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
    return {
        "batches": len(batches),
        "even_batches_restored": loader.batch_sampler.even_batches,
        "params": flat_parameters(accelerator.unwrap_model(model)),
        "reference": flat_parameters(reference.module),
    }


def _accelerate_group(kind: str) -> dict[str, Any]:
    os.environ["OMP_NUM_THREADS"] = "1"
    return {"hooks": _hooks_train(kind), "accumulate": _accumulate(kind), "join": _join(kind)}


def _check_group(results: list[dict[str, Any]], kind: str) -> None:
    for name in HOOKS:
        per_rank = [r["hooks"][name] for r in results]
        assert per_rank[0]["ddp"].startswith("gradcomm" if kind == "gradcomm" else "torch"), per_rank[0]["ddp"]
        assert per_rank[0]["unwrapped"] == "HeadFirst", per_rank[0]["unwrapped"]
        assert all(r["bitwise"] for r in per_rank), f"{name}: gradients differ from the hand-driven reference"
        assert all(r["to_exact"] <= r["tolerance"] for r in per_rank), (name, [r["to_exact"] for r in per_rank])
        np.testing.assert_array_equal(per_rank[0]["params"], per_rank[1]["params"], err_msg=name)

    for r in results:
        accumulate = r["accumulate"]
        calls = accumulate["calls"]  # cumulative hook calls after each micro-batch: none on accumulating ones
        assert calls[0] == 0 and calls[1] > 0 and calls[2] == calls[1] and calls[3] > calls[2], calls
        assert accumulate["synced_steps"] == 2
        assert accumulate["max_error"] < 1e-6, accumulate["max_error"]
    np.testing.assert_array_equal(results[0]["accumulate"]["params"], results[1]["accumulate"]["params"])

    assert [r["join"]["batches"] for r in results] == [3, 2]
    assert all(r["join"]["even_batches_restored"] for r in results)
    for r in results:
        np.testing.assert_array_equal(r["join"]["params"], r["join"]["reference"])
    np.testing.assert_array_equal(results[0]["join"]["params"], results[1]["join"]["params"])


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_gradcomm_hooks_on_torch_ddp_under_accelerate(accelerate_ranks: list[dict[str, Any]]) -> None:
    _check_group(part_results(accelerate_ranks, "torch group"), "torch")


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_gradcomm_ddp_under_accelerate(accelerate_ranks: list[dict[str, Any]]) -> None:
    _check_group(part_results(accelerate_ranks, "gradcomm group"), "gradcomm")


def _resume_run(kind: str, folder: str, steps: range, load: bool, save: bool) -> np.ndarray:
    accelerator = _accelerator(kind, "powersgd", **POWERSGD)
    model = accelerator.prepare(_model())
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    accelerator.register_for_checkpointing(accelerator.gradcomm_kwargs.checkpoint)
    if load:
        accelerator.load_state(folder)
    for step in steps:
        x, y = _batch(dist.get_rank(), step)
        optimizer.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    if save:
        accelerator.save_state(folder)
    return flat_parameters(accelerator.unwrap_model(model))


def _resume(kind: str, folder: str) -> dict[str, Any]:
    """(e): 6 steps straight, against 3 steps, save_state, fresh objects, load_state, 3 steps."""
    os.environ["OMP_NUM_THREADS"] = "1"
    straight = _resume_run(kind, folder + "/unused", range(6), load=False, save=False)
    _resume_run(kind, folder, range(3), load=False, save=True)
    resumed = _resume_run(kind, folder, range(3, 6), load=True, save=False)
    return {"straight": straight, "resumed": resumed}


def _check_resume(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        np.testing.assert_array_equal(r["resumed"], r["straight"], err_msg=f"rank {rank}")
    np.testing.assert_array_equal(results[0]["resumed"], results[1]["resumed"])


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_save_state_resumes_powersgd_on_gradcomm_ddp(accelerate_ranks: list[dict[str, Any]]) -> None:
    _check_resume(part_results(accelerate_ranks, "gradcomm resume"))


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_save_state_resumes_powersgd_on_torch_ddp(accelerate_ranks: list[dict[str, Any]]) -> None:
    _check_resume(part_results(accelerate_ranks, "torch resume"))



@pytest.fixture(scope="module")
def accelerate_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """(a) to (c), then (e), for each DDP kind, in one spawned group (its start costs more than a part)."""
    folder = tmp_path_factory.mktemp("accelerate")
    parts = [
        *((f"{kind} group", _accelerate_group, (kind,)) for kind in ("torch", "gradcomm")),
        *((f"{kind} resume", _resume, (kind, str(folder / kind))) for kind in ("gradcomm", "torch")),
    ]
    return run_on_ranks(each_part, world_size=2, args=(parts,), timeout=RUN_TIMEOUT)


def test_misuse_messages() -> None:
    """Every refusal names what was wrong and what to do (no process group needed)."""
    from accelerate.utils import DistributedDataParallelKwargs

    assert "comm_hook are Accelerate's own hook fields" in error_text(lambda: GradcommKwargs(comm_hook="fp16"))
    assert "ddp must be 'torch' or 'gradcomm', got 'fsdp'" in error_text(lambda: GradcommKwargs(ddp="fsdp"))
    assert "unknown communication hook 'powrsgd'" in error_text(lambda: GradcommKwargs("powrsgd"))
    assert "got unknown option(s) 'bucket_cap'" in error_text(lambda: GradcommKwargs("powersgd", bucket_cap=1))
    assert "matrix_approximation_rank" in error_text(
        lambda: GradcommKwargs("powersgd", matrix_approximation_rank=-1)
    )
    assert "unknown hook wrapper 'fp8'" in error_text(lambda: GradcommKwargs("powersgd", wrapper="fp8"))
    assert "state= goes with a hook callable" in error_text(lambda: GradcommKwargs("fp16_compress", state=1))
    assert "configure a hook, but no hook was given" in error_text(
        lambda: GradcommKwargs(matrix_approximation_rank=2)
    )
    assert "hook options apply to named hooks only" in error_text(
        lambda: GradcommKwargs(default_hooks.allreduce_hook, matrix_approximation_rank=2)
    )
    assert "hook must be a registry name" in error_text(lambda: GradcommKwargs(3))
    assert "pass only it" in error_text(
        lambda: GradcommAccelerator(cpu=True, kwargs_handlers=[GradcommKwargs(), DistributedDataParallelKwargs()])
    )
    assert "pass one GradcommKwargs" in error_text(
        lambda: GradcommAccelerator(cpu=True, kwargs_handlers=[GradcommKwargs(), GradcommKwargs()])
    )
    kwargs = GradcommKwargs("powersgd", matrix_approximation_rank=2, bucket_cap_mb=5, static_graph=True)
    assert kwargs.to_kwargs() == {"bucket_cap_mb": 5, "static_graph": True}
    assert kwargs.hook_options == {"matrix_approximation_rank": 2}
    assert "cannot save before accelerator.prepare(model)" in error_text(kwargs.checkpoint.state_dict)
    kwargs.model = nn.Linear(1, 1)
    assert "already registered its hook" in error_text(lambda: kwargs.register_comm_hook(nn.Linear(1, 1)))
    assert "holds the hook state of 3 ranks, but this run has 1" in error_text(
        lambda: kwargs.checkpoint.load_state_dict({"world_size": 3, "ranks": [None] * 3})
    )


def test_import_without_accelerate_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.delitem(sys.modules, "gradcomm.integrations.accelerate")
    with pytest.raises(ImportError, match=r"pip install 'gradcomm\[accelerate\]'"):
        import gradcomm.integrations.accelerate  # noqa: F401
