"""Count the torch operators a communication hook runs: the measure of a hook's fixed cost per bucket.

On a GPU every operator is a kernel launched from Python, and on the CPU a call of a few microseconds; a
hook whose number of operators grows with the number of tensors in its bucket costs, on a model of
thousands of tensors, what its bytes could never save. :func:`count_aten_calls` counts every ``aten::``
operator that runs on any thread while a function runs (torch's profiler with ``profile_all_threads``: a
future's callbacks may run on the backend's thread), nested ones included (an ``aten::to`` counts with the
``aten::copy_`` it calls), so counts compare between two versions of the same code and between hooks, not
with other tools' counts. :func:`hook_calls` applies it to one call of a hook (its ``wait`` included) after
two untimed calls, so that caches filled on a first call are not counted; :func:`many_tensor_bucket` makes a
bucket of any number of tensors, half of them large enough to be compressed at the hook's defaults.

::

    bucket = many_tensor_bucket(800)
    hook, state = make_comm_hook("topk", process_group=group)
    hook_calls(hook, state, bucket) - hook_calls(allreduce_hook, group, bucket)

:func:`calls_at_world_size` runs such counts on ``world_size`` local gloo ranks (one process each: a rank
counts its own process) and returns rank 0's: a method that decodes the ranks' payloads one by one costs
more calls the more ranks there are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

from gradcomm.hooks.grad_bucket import GradBucket

__all__ = [
    "bucket_named",
    "calls_at_world_size",
    "calls_per_bucket",
    "count_aten_calls",
    "hook_calls",
    "many_tensor_bucket",
    "workload_bucket",
]


def count_aten_calls(fn: Callable[[], Any]) -> int:
    """The number of ``aten::`` operators run, on every thread, while ``fn()`` runs."""
    with profile(
        activities=[ProfilerActivity.CPU], experimental_config=_ExperimentalConfig(profile_all_threads=True)
    ) as profiler:
        fn()
    return sum(1 for event in profiler.events() if event.name.startswith("aten::"))


def hook_calls(hook: Callable[[Any, Any], torch.futures.Future[Any]], state: Any, bucket: GradBucket) -> int:
    """Operators of one call of ``hook(state, bucket)``, waited for; the bucket's values are restored before
    each of the two untimed calls and the counted one, and after it (a hook writes its result into the
    bucket: the next hook counted on it sees the same gradients, not this one's mean)."""
    values = bucket.buffer().clone()

    def call() -> None:
        bucket.buffer().copy_(values)
        hook(state, bucket).wait()

    for _ in range(2):
        call()
    bucket.buffer().copy_(values)
    try:
        return count_aten_calls(lambda: hook(state, bucket).wait())
    finally:
        bucket.buffer().copy_(values)


def many_tensor_bucket(
    count: int, width: int = 32, device: torch.device | str = "cpu", seed: int = 0
) -> GradBucket:
    """One bucket of ``count`` gradients: ``count // 2`` linear layers' weights (``width x width``: 1,024
    elements, compressed at the hook's defaults) and biases (``width``: sent dense), plus one more weight
    where ``count`` is odd; values normal, of a scale that differs by tensor (per-tensor statistics
    matter)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [torch.Size([width, width]) if index % 2 == 0 else torch.Size([width]) for index in range(count)]
    gradients = [
        torch.randn(shape, generator=generator) * 10.0 ** (index % 7 - 3) for index, shape in enumerate(shapes)
    ]
    lengths = [shape.numel() for shape in shapes]
    offsets = [sum(lengths[:index]) for index in range(count)]
    buffer = torch.cat([gradient.reshape(-1) for gradient in gradients]).to(device)
    parameters = [torch.nn.Parameter(torch.empty(shape, device=device)) for shape in shapes]
    return GradBucket(0, buffer, offsets, lengths, shapes, parameters, is_last=True)


def workload_bucket(workload_name: str, device: torch.device | str = "cpu") -> GradBucket:
    """All the gradients of one training batch of a bench workload (``gradcomm.bench.workloads``), as one
    bucket. Real gradients, not random values: the compressors' data-dependent work (top-k's sampled
    threshold) depends on their structure, and on random values top-k's selection had looked half as costly
    as in training."""
    from gradcomm.bench.workloads import WORKLOADS

    workload = WORKLOADS[workload_name](device=device)
    torch.manual_seed(0)
    model = workload.build_model()
    inputs, target = workload.batch(0, 0)
    workload.loss(model(inputs), target).backward()
    parameters = [p for p in model.parameters() if p.requires_grad]
    lengths = [p.numel() for p in parameters]
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in parameters]
    buffer = torch.cat([g.reshape(-1) for g in grads]).detach()
    return GradBucket(0, buffer, offsets, lengths, [p.shape for p in parameters], parameters, is_last=True)


def bucket_named(name: str, device: torch.device | str = "cpu") -> GradBucket:
    """``"N tensors"``: :func:`many_tensor_bucket` of ``N``; else the bench workload's :func:`workload_bucket`."""
    if name.endswith(" tensors"):
        return many_tensor_bucket(int(name.split()[0]), device=device)
    return workload_bucket(name, device)


def calls_per_bucket(
    buckets: Sequence[str], hooks: Sequence[str], device: torch.device | str = "cpu"
) -> dict[str, dict[str, int]]:
    """Per bucket (:func:`bucket_named`), per registry hook (``make_comm_hook`` on the default group), the
    operators of one hook call on this rank. Every rank of the group must call it alike (the hooks'
    collectives); one torch thread, so that counts do not depend on the machine."""
    import torch.distributed as dist

    from gradcomm.hooks.registry import make_comm_hook

    torch.set_num_threads(1)
    counts: dict[str, dict[str, int]] = {}
    for name in buckets:
        bucket = bucket_named(name, device)
        counts[name] = {}
        for hook in hooks:
            fn, state = make_comm_hook(hook, process_group=dist.group.WORLD)
            counts[name][hook] = hook_calls(fn, state, bucket)
    return counts


def calls_at_world_size(
    buckets: Sequence[str],
    hooks: Sequence[str],
    world_size: int,
    *,
    device: str = "cpu",
    backend: str = "gloo",
    timeout: float = 600.0,
) -> dict[str, dict[str, int]]:
    """:func:`calls_per_bucket` on ``world_size`` local ranks joined in one group, as rank 0 counts them."""
    from gradcomm.testing.ranks import run_on_ranks

    results = run_on_ranks(
        calls_per_bucket, world_size, args=(list(buckets), list(hooks), device), backend=backend, timeout=timeout
    )
    return results[0]
