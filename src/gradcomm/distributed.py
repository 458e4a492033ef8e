"""gradcomm's DistributedDataParallel: torch's DDP interface, a Python reducer, pluggable communication hooks.

Construction checks that every rank has the same parameters, broadcasts parameters and buffers from rank 0
and hands the trainable parameters to a :class:`~gradcomm.reducer.Reducer`. Each forward optionally
broadcasts buffers (BatchNorm statistics) from rank 0 and arms the reducer for the coming backward, in which
gradients are averaged bucket by bucket, overlapped with the rest of backward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from .hook_contract import CommHook
from .reducer import Reducer
from .telemetry import CommStats

__all__ = ["DistributedDataParallel"]


def _require_process_group(process_group: ProcessGroup | None, who: str) -> ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{who} needs an initialized default process group: call torch.distributed.init_process_group(...) "
            "first (torchrun sets the environment it needs), or use gradcomm.testing.run_on_ranks in tests"
        )
    return process_group if process_group is not None else dist.group.WORLD


def _check_same_parameters(module: nn.Module, group: ProcessGroup) -> None:
    """Raise on every rank if the ranks' parameters differ in number, name, shape or dtype."""
    local = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, local, group=group)
    reference = everyone[0]
    for rank, described in enumerate(everyone[1:], start=1):
        for position, (mine, theirs) in enumerate(zip(reference, described, strict=False)):
            if mine != theirs:
                raise ValueError(
                    "gradcomm.DistributedDataParallel: ranks disagree on the model's parameters. "
                    f"Parameter #{position} is {mine[0]} {mine[1]} {mine[2]} on rank 0 but {theirs[0]} "
                    f"{theirs[1]} {theirs[2]} on rank {rank}. Build the same model on every rank."
                )
        if len(described) != len(reference):
            longer = described if len(described) > len(reference) else reference
            raise ValueError(
                "gradcomm.DistributedDataParallel: ranks disagree on the model's parameters: rank 0 has "
                f"{len(reference)} parameters, rank {rank} has {len(described)} (the first parameter only one "
                f"of them has is {longer[min(len(reference), len(described))][0]}). Build the same model on "
                "every rank."
            )


def broadcast_coalesced(tensors: Sequence[torch.Tensor], group: ProcessGroup, src_group_rank: int = 0) -> None:
    """Overwrite ``tensors`` with rank ``src_group_rank``'s values, one broadcast per dtype and device."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    src = dist.get_global_rank(group, src_group_rank)
    for same_kind in by_kind.values():
        flat = torch._utils._flatten_dense_tensors([t.detach() for t in same_kind])
        dist.broadcast(flat, src=src, group=group)
        with torch.no_grad():
            for tensor, synced in zip(same_kind, torch._utils._unflatten_dense_tensors(flat, same_kind), strict=True):
                tensor.copy_(synced)


def _move_to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_move_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _move_to(v, device) for k, v in value.items()}
    return value


class DistributedDataParallel(nn.Module):
    """Data parallelism at the module level, with gradient communication done by a pluggable hook.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel`` for a module on one device: the same
    constructor arguments that matter for communication, ``no_sync()``, ``register_comm_hook(state, hook)``
    and checkpoints with the ``module.`` prefix, so torch DDP checkpoints load here and the reverse.

    Args:
        module: the model, already on its device; the same architecture on every rank.
        process_group: the group to average over; ``None`` for the default group.
        bucket_cap_mb: bucket size limit in MB; ``None`` means 25 MB with a 1 MB first bucket (torch's
            defaults), an explicit value applies to every bucket.
        find_unused_parameters: traverse the autograd graph from the forward output each iteration and treat
            parameters it does not reach as ready (costs a graph traversal and a small allreduce).
        gradient_as_bucket_view: make each ``.grad`` a view into its bucket, saving one gradient-sized copy.
        broadcast_buffers: broadcast buffers from rank 0 at every forward.
        device_ids: ``None`` or one device; inputs are moved to it.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        init_sync: bool = True,
    ) -> None:
        super().__init__()
        group = _require_process_group(process_group, "gradcomm.DistributedDataParallel")
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(
                f"gradcomm.DistributedDataParallel supports one device per process; got device_ids={list(device_ids)}"
            )
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise RuntimeError(
                "gradcomm.DistributedDataParallel: the module has no parameter that requires a gradient, so "
                "there is nothing to synchronise; train it without DDP or unfreeze a parameter"
            )
        self.module = module
        self.process_group = process_group
        self.device = torch.device(device_ids[0]) if device_ids else None
        self.output_device = output_device
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True
        self._group = group
        _check_same_parameters(module, group)
        if init_sync:
            broadcast_coalesced([p for p in module.parameters()] + list(module.buffers()), group)
        self.reducer = Reducer(
            [p for _, p in named],
            [name for name, _ in named],
            process_group,
            bucket_cap_mb,
            find_unused_parameters,
            gradient_as_bucket_view,
        )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        synchronise = torch.is_grad_enabled() and self.require_backward_grad_sync
        if synchronise:
            self.reducer.prepare_for_forward()
        else:
            self.reducer.disarm()
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers:
                broadcast_coalesced(buffers, self._group)
        if self.device is not None:
            inputs, kwargs = _move_to(inputs, self.device), _move_to(kwargs, self.device)
        output = self.module(*inputs, **kwargs)
        if synchronise:
            self.reducer.prepare_for_backward(output)
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in the backward passes inside; the next synchronised one reduces them."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Register ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]`` to reduce every bucket.

        Once per DDP, before the first backward. The bucket holds the local, undivided gradients; the future
        must complete with a tensor of the bucket buffer's shape and dtype, which becomes the gradients.
        """
        self.reducer.register_comm_hook(state, hook)

    def bucket_layout(self) -> dict[str, Any]:
        """The bucket layout as plain values; saved by :func:`gradcomm.checkpoint.save_checkpoint`.

        Hook state that is kept per bucket (PowerSGD's error feedback and warm start) only fits the buckets it
        was made for, so a resumed run must reduce in the original run's buckets from its first step.
        """
        return self.reducer.bucket_layout()

    def load_bucket_layout(self, layout: dict[str, Any]) -> None:
        """Adopt a layout from :meth:`bucket_layout` (before the resumed run's first backward)."""
        self.reducer.load_bucket_layout(layout)

    def comm_stats(self) -> CommStats:
        """Per-step and cumulative communication statistics on this rank (see :mod:`gradcomm.telemetry`).

        Resettable (``.reset()``); set ``.measure_error = True`` for the compression error, ``.log_every`` to
        log through :mod:`logging`, ``.jsonl_path`` to append every step as a JSON line.
        """
        return self.reducer.stats
