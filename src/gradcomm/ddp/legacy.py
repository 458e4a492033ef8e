"""The legacy DistributedDataParallel (after fairseq's): no overlap, an explicit ``all_reduce()`` after backward.

Simpler and more predictable than the overlapping DDP, which makes it useful for debugging and for code
that wants to decide itself when gradients are synchronised. After backward, ``all_reduce()`` packs the
gradients into a flat buffer of at most ``buffer_size`` elements at a time and reduces each buffer in turn.
``no_sync()`` turns ``all_reduce()`` into a no-op for gradient accumulation.

Beyond fairseq's, it accepts ``register_comm_hook(state, hook)``: each buffer is then handed to the hook as
a :class:`~gradcomm.GradBucket`, exactly as the overlapping DDP hands its buckets.

Failures behave as in the overlapping DDP: ``register_comm_hook`` (or the first ``all_reduce()``) is a
collective that compares hook, options and buffer size across the ranks; a lost peer raises
:class:`~gradcomm.comm.faults.PeerLostError` naming the reduction and the buffer, within the process
group's timeout; after a failed ``all_reduce()`` the DDP refuses further reductions.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from gradcomm.comm.faults import reporting_lost_peers
from gradcomm.comm.telemetry import CommStats
from gradcomm.ddp.bucketing import assign_buckets
from gradcomm.ddp.hook_runner import HookRunner
from gradcomm.hooks.contract import CommHook
from gradcomm.hooks.grad_bucket import GradBucket

__all__ = ["LegacyDistributedDataParallel"]


class LegacyDistributedDataParallel(nn.Module):
    """Data parallelism with explicit gradient reduction: call :meth:`all_reduce` after ``backward()``.

    Args:
        module: the model; the same on every rank (parameters are not broadcast: seed every rank alike).
        world_size: number of ranks the gradients are averaged over.
        process_group: the group to reduce over; ``None`` for the default group.
        buffer_size: elements per reduction buffer (a parameter larger than that is reduced alone).
    """

    def __init__(
        self, module: nn.Module, world_size: int, process_group: ProcessGroup | None = None, buffer_size: int = 2**28
    ) -> None:
        super().__init__()
        if world_size < 1:
            raise ValueError(f"LegacyDistributedDataParallel: world_size must be at least 1, got {world_size}")
        if buffer_size < 1:
            raise ValueError(f"LegacyDistributedDataParallel: buffer_size must be at least 1, got {buffer_size}")
        self.module = module
        self.world_size = world_size
        self.process_group = process_group
        self.buffer_size = min(buffer_size, sum(p.numel() for p in module.parameters()))
        self.accumulate_grads = False
        self._reductions = 0
        self._runner = HookRunner("gradcomm.LegacyDistributedDataParallel", process_group)
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Make :meth:`all_reduce` a no-op inside, so gradients accumulate locally."""
        previous = self.accumulate_grads
        self.accumulate_grads = True
        try:
            yield
        finally:
            self.accumulate_grads = previous

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each buffer with ``hook(state, bucket)`` instead of the averaging allreduce (once, before use).

        A collective: every rank must call it with the same hook and options; the ranks compare them and all
        raise :class:`~gradcomm.comm.agreement.RanksDisagreeError` if they differ.
        """
        too_late = f"before the first all_reduce(); {self._reductions} already ran" if self._reductions else None
        self._runner.register(state, hook, too_late, self._setup())

    def _setup(self) -> dict[str, str]:
        return {"buffer_size": repr(self.buffer_size), "world_size": repr(self.world_size)}

    def comm_stats(self) -> CommStats:
        """This DDP's communication statistics on this rank (see :mod:`gradcomm.comm.telemetry`)."""
        return self._runner.stats

    def all_reduce(self) -> None:
        """Average the gradients over the ranks; call after ``backward()`` (a no-op inside ``no_sync()``)."""
        if self.accumulate_grads:
            return
        self._runner.check_usable("all_reduce()")
        try:
            if not self._runner.setup_checked:
                self._runner.check_same_setup(self._setup())
            chunks = self._chunks()
            self._runner.stats.begin_step()
            for index, params in enumerate(chunks):
                self._reduce(index, params, is_last=index == len(chunks) - 1)
        except BaseException as exc:
            self._runner.fail(exc)
            raise
        self._runner.stats.end_step()
        self._reductions += 1

    def _chunks(self) -> list[list[nn.Parameter]]:
        """Trainable parameters in registration order, split by dtype and device into buffer-sized runs."""
        params = [param for param in self.module.parameters() if param.requires_grad]
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            if param.grad.requires_grad:
                raise RuntimeError(
                    "LegacyDistributedDataParallel only works with gradients that don't require grad "
                    "(was backward called with create_graph=True?)"
                )
        runs = assign_buckets(
            params, range(len(params)), self.buffer_size, self.buffer_size, size=torch.Tensor.numel, strict=True
        )
        return [[params[i] for i in run] for run in runs]

    def _buffer_for(self, params: list[nn.Parameter]) -> torch.Tensor:
        numel = sum(p.numel() for p in params)
        key = (params[0].dtype, params[0].device)
        if numel > self.buffer_size:
            return torch.empty(numel, dtype=key[0], device=key[1])
        if key not in self._buffers:
            self._buffers[key] = torch.empty(self.buffer_size, dtype=key[0], device=key[1])
        return self._buffers[key][:numel]

    def _reduce(self, index: int, params: list[nn.Parameter], is_last: bool) -> None:
        lengths = [p.numel() for p in params]
        offsets = [sum(lengths[:k]) for k in range(len(params))]
        buffer = self._buffer_for(params)
        for param, offset, length in zip(params, offsets, lengths, strict=True):
            buffer[offset : offset + length].copy_(param.grad.reshape(-1))
        if self._runner.averages_itself:
            buffer.div_(self.world_size)
        step, group = self._reductions, self.process_group
        bucket = GradBucket(index, buffer, offsets, lengths, [p.shape for p in params], params, is_last)
        future = self._runner.launch(bucket, step)
        result = self._runner.result(future, index, buffer, step)
        with reporting_lost_peers(step, f"bucket {index} (telemetry)", group):
            self._runner.stats.compare_result(index, result, group)
        for param, offset, length in zip(params, offsets, lengths, strict=True):
            param.grad.copy_(result[offset : offset + length].view_as(param))
