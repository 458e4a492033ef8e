"""The outer exchange of one fragment: its pseudo-gradients averaged through the DDP hook machinery.

The pseudo-gradient of a parameter is its anchor (the value at the fragment's last sync) minus its current
value (of each part of it the fragment holds: see :mod:`gradcomm.diloco.fragments`). They are flattened per
dtype and device into buffers, each wrapped as a :class:`~gradcomm.GradBucket`
and handed to a :class:`~gradcomm.ddp.hook_runner.HookRunner`, exactly as the DDPs hand gradient buckets:
the default averaging allreduce, or any registered hook (a compressor, with its error feedback keyed by
parameter). Launching and collecting are separate so that the exchange can run behind the next inner steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gradcomm.ddp.hook_runner import HookRunner
from gradcomm.diloco.fragments import Fragment
from gradcomm.hooks.grad_bucket import GradBucket
from gradcomm.hooks.parameter_keys import name_tensor

__all__ = ["FragmentExchange", "PendingExchange"]


@dataclass
class PendingExchange:
    """An exchange launched after inner step ``launched_at``: its futures, or (resolved, or loaded from a
    checkpoint) the averaged pseudo-gradient of every parameter of the fragment."""

    fragment: int
    launched_at: int
    futures: list[torch.futures.Future] = field(default_factory=list)
    averaged: list[torch.Tensor] | None = None
    buffers: dict[str, torch.Tensor] | None = None
    """The model's buffers as synced with this exchange (fragment 0's, where the model has buffers)."""


class FragmentExchange:
    """Builds, launches and collects the buckets of one fragment's pseudo-gradients (one bucket per dtype and
    device, numbered from 0: each fragment's exchange is one iteration of its own hook state).

    A bucket lists, for each part of the fragment, the parameter itself where the part is a whole parameter,
    else a view of the part registered under the part's key (``name[start:stop]``): to a compressor the part is
    the tensor, with the part's shape and its own error-feedback residual and random stream."""

    def __init__(self, fragment: Fragment, anchors: list[torch.Tensor]) -> None:
        self.fragment = fragment
        self.anchors = anchors
        self._listed: list[torch.Tensor] = []
        for part in fragment.parts:
            if part.whole:
                self._listed.append(part.param)
            else:
                view = part.of(part.param.detach())
                name_tensor(view, part.key)
                self._listed.append(view)
        by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for position, param in enumerate(fragment.params):
            by_kind.setdefault((param.dtype, param.device), []).append(position)
        self.runs = list(by_kind.values())
        self.indices = list(range(len(self.runs)))
        self._offsets = [[0] for _ in self.runs]
        for run, offsets in zip(self.runs, self._offsets, strict=True):
            for i in run[:-1]:
                offsets.append(offsets[-1] + fragment.parts[i].numel)
        self._buffers: list[torch.Tensor] = []

    def _bucket(self, k: int) -> GradBucket:
        run, offsets = self.runs[k], self._offsets[k]
        parts = [self.fragment.parts[i] for i in run]
        lengths = [part.numel for part in parts]
        buffer = torch.empty(sum(lengths), dtype=parts[0].param.dtype, device=parts[0].param.device)
        with torch.no_grad():
            for i, part, offset, length in zip(run, parts, offsets, lengths, strict=True):
                view = buffer[offset : offset + length]
                view.copy_(self.anchors[i].reshape(-1))
                view.sub_(part.of(part.param.detach()).reshape(-1))
        is_last = k == len(self.runs) - 1
        listed = [self._listed[i] for i in run]
        return GradBucket(
            self.indices[k], buffer, offsets, lengths, [part.shape for part in parts], listed, is_last
        )

    def launch(self, runner: HookRunner, inner_step: int, world_size: int) -> PendingExchange:
        """Hand every bucket of pseudo-gradients to ``runner``; the futures come back in a pending exchange."""
        pending = PendingExchange(self.fragment.index, inner_step)
        self._buffers = []
        for k in range(len(self.runs)):
            bucket = self._bucket(k)
            if runner.averages_itself:
                bucket.buffer().div_(world_size)
            self._buffers.append(bucket.buffer())
            pending.futures.append(runner.launch(bucket, inner_step))
        return pending

    def collect(self, runner: HookRunner, pending: PendingExchange) -> list[torch.Tensor]:
        """Wait for ``pending`` (once) and return the averaged pseudo-gradient of each part, in order, shaped
        as the part."""
        if pending.averaged is None:
            averaged: dict[int, torch.Tensor] = {}
            for k, future in enumerate(pending.futures):
                result = runner.result(future, self.indices[k], self._buffers[k], pending.launched_at)
                for i, offset in zip(self.runs[k], self._offsets[k], strict=True):
                    part = self.fragment.parts[i]
                    averaged[i] = result[offset : offset + part.numel].view(part.shape)
            pending.averaged = [averaged[i] for i in range(len(self.fragment.parts))]
            pending.futures = []
        return pending.averaged
