"""Communication telemetry: what each synchronised step cost, for any hook.

A DDP keeps one :class:`CommStats` (``ddp.comm_stats()``). Per step, on this rank, it records:

* ``bytes_sent`` and ``collective_calls``: counted by :mod:`gradcomm.comm` from the tensors actually handed
  to collectives by this DDP's hook (in its own :class:`~gradcomm.comm.Traffic` account, so two DDPs in one
  process do not mix; hooks that bypass ``gradcomm.comm``, such as torch's own, are not seen: 0 bytes);
* ``dense_bytes``: the size of the gradient buckets, i.e. what a plain allreduce would hand over;
* ``wire_bytes``: what those collectives put on this rank's link with ring algorithms, each on its own group's
  size (:func:`gradcomm.comm.group_wire_bytes`), and ``dense_wire_bytes``, the same for a plain allreduce of
  the buckets on the DDP's group;
* two ratios: the *handed* ratio ``dense_bytes / bytes_sent`` (bytes handed to collectives) and the *wire*
  ratio ``dense_wire_bytes / wire_bytes``, the saving on the link, which is the one papers publish. They
  differ when the hook's collectives are not one allreduce: ByteGrad's all-to-all then all-gather hands over
  ``W + 1`` rows of its 8-bit codes and sends ``2(W - 1)`` (on 2 ranks: handed 2.7x, wire 4x), and an
  all-gather sends ``W - 1`` times its input where an allreduce sends ``2(W - 1)/W`` (on ``W > 2`` ranks the
  handed ratio overstates the saving ``W/2`` times). See :func:`byte_ratio` for the edge cases;
* ``hook_seconds``: time spent inside the hook calls themselves (encoding, and launching collectives, which
  return at once), i.e. outside the collectives;
* ``compression_error`` when ``measure_error`` is on: ``‖result − exact‖ / ‖exact‖`` over all buckets, where
  ``exact`` is the true average obtained by a second, uncounted allreduce of the original gradients. It costs a
  gradient-sized copy and a full allreduce per step, so it is off by default.

A hook state may report on itself by a ``comm_stats_details() -> dict`` method (the ``auto`` hook: its
choice and the figures behind it); ``hook_details`` holds its latest report, refreshed every step.

Steps can be logged through :mod:`logging` (``log_every``) and appended to a JSON-lines file (``jsonl_path``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm import comm

__all__ = ["CommStats", "StepStats", "byte_ratio"]

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """The cost of one synchronised step (or the sum over many, in :attr:`CommStats.total`)."""

    steps: int = 0
    bytes_sent: int = 0
    collective_calls: int = 0
    dense_bytes: int = 0
    hook_seconds: float = 0.0
    compression_error: float | None = None
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    wire_bytes: float = 0.0
    dense_wire_bytes: float = 0.0

    @property
    def handed_ratio(self) -> float:
        """Dense bucket bytes over the bytes handed to collectives."""
        return byte_ratio(self.dense_bytes, self.bytes_sent)

    @property
    def wire_ratio(self) -> float:
        """Wire bytes of a plain allreduce of the buckets over the wire bytes of what the hook sent."""
        return byte_ratio(self.dense_wire_bytes, self.wire_bytes)

    @property
    def compression_ratio(self) -> float:
        """The handed ratio (:attr:`handed_ratio`), under its former name."""
        return self.handed_ratio

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "handed_ratio": self.handed_ratio, "wire_ratio": self.wire_ratio}


def byte_ratio(dense: float, sent: float) -> float:
    """``dense / sent``, the saving of a hook that sent ``sent`` bytes where a plain allreduce sends ``dense``:
    ``inf`` when nothing was sent, ``nan`` when a plain allreduce would send nothing either (one rank's wire)."""
    if sent:
        return dense / sent
    return math.inf if dense else math.nan


@dataclass
class CommStats:
    """Per-step and cumulative communication statistics of one DDP on this rank."""

    hook_name: str = ""
    group: ProcessGroup | None = field(default=None, repr=False)
    """The DDP's process group (``None``: the default group): the plain allreduce the wire ratio compares with."""
    measure_error: bool = False
    log_every: int = 0
    jsonl_path: str | Path | None = None
    last: StepStats = field(default_factory=StepStats)
    total: StepStats = field(default_factory=StepStats)
    traffic: comm.Traffic = field(default_factory=comm.Traffic, repr=False)
    """Everything this DDP's hook handed to collectives (the DDP counts its hook calls into it)."""
    hook_details: dict[str, object] = field(default_factory=dict)
    """The hook state's own report (``state.comm_stats_details()``, where it has one), as of the last step."""
    details_source: Callable[[], dict[str, object]] | None = field(default=None, repr=False)
    _current: StepStats | None = field(default=None, repr=False)
    _traffic_at_start: tuple[dict[tuple[str, int], int], int] = field(default=({}, 0), repr=False)
    _error_sums: list[float] = field(default_factory=lambda: [0.0, 0.0], repr=False)
    _error_steps: int = field(default=0, repr=False)
    _inputs: dict[int, tuple[torch.Tensor, bool]] = field(default_factory=dict, repr=False)

    def reset(self) -> None:
        """Forget all recorded steps."""
        self.last, self.total, self._current, self._error_steps = StepStats(), StepStats(), None, 0

    def as_dict(self) -> dict[str, object]:
        summary: dict[str, object] = {"hook": self.hook_name, "last": self.last.as_dict(), "total": self.total.as_dict()}
        if self.hook_details:
            summary["hook_details"] = self.hook_details
        return summary

    # -- recording, called by the reducers -------------------------------------------------------------
    def begin_step(self) -> None:
        self._current = StepStats(steps=1)
        self._traffic_at_start = (self.traffic.snapshot_by_group(), self.traffic.total_calls)
        self._error_sums = [0.0, 0.0]
        self._inputs.clear()

    @contextmanager
    def timing_hook(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._current is not None:
                self._current.hook_seconds += time.perf_counter() - start

    def add_bucket(self, dense_bytes: int) -> None:
        if self._current is not None:
            self._current.dense_bytes += dense_bytes

    def remember_input(self, index: int, buffer: torch.Tensor, averaged: bool) -> None:
        """Keep a copy of bucket ``index``'s input for the error pass (``averaged``: already divided)."""
        if self.measure_error:
            self._inputs[index] = (buffer.detach().clone(), averaged)

    def compare_result(self, index: int, result: torch.Tensor, group: ProcessGroup | None) -> None:
        """Second pass: the exact average of the remembered input, against the hook's ``result``."""
        remembered = self._inputs.pop(index, None)
        if remembered is None:
            return
        exact, averaged = remembered
        dist.all_reduce(exact, group=group)  # deliberately not through gradcomm.comm: not hook traffic
        if not averaged:
            exact.div_(dist.get_world_size(group))
        exact = exact.double()
        self._error_sums[0] += (result.double() - exact).pow(2).sum().item()
        self._error_sums[1] += exact.pow(2).sum().item()

    def end_step(self) -> None:
        step, self._current = self._current, None
        if step is None:
            return
        before, calls_before = self._traffic_at_start
        sent = _difference(self.traffic.snapshot_by_group(), before)
        step.bytes_by_kind = comm.bytes_by_kind(sent)
        step.bytes_sent = sum(step.bytes_by_kind.values())
        step.collective_calls = self.traffic.total_calls - calls_before
        step.wire_bytes = comm.group_wire_bytes(sent)
        group_size = comm.group_size(self.group) if dist.is_initialized() else 1
        step.dense_wire_bytes = comm.wire_bytes({"all_reduce": step.dense_bytes}, group_size)
        if self.measure_error:
            difference, exact = self._error_sums
            step.compression_error = math.sqrt(difference / exact) if exact > 0 else math.sqrt(difference)
        self.last = step
        if self.details_source is not None:
            self.hook_details = self.details_source()
        self._accumulate(step)
        self._emit(step)

    def _accumulate(self, step: StepStats) -> None:
        total = self.total
        total.steps += 1
        total.bytes_sent += step.bytes_sent
        total.collective_calls += step.collective_calls
        total.dense_bytes += step.dense_bytes
        total.hook_seconds += step.hook_seconds
        total.wire_bytes += step.wire_bytes
        total.dense_wire_bytes += step.dense_wire_bytes
        for kind, nbytes in step.bytes_by_kind.items():
            total.bytes_by_kind[kind] = total.bytes_by_kind.get(kind, 0) + nbytes
        if step.compression_error is not None:
            self._error_steps += 1
            mean = total.compression_error or 0.0
            total.compression_error = mean + (step.compression_error - mean) / self._error_steps

    def _emit(self, step: StepStats) -> None:
        if self.log_every and self.total.steps % self.log_every == 0:
            logger.info(
                "%s step %d: %d bytes in %d collectives (handed ratio %.2f, wire ratio %.2f), hook %.2f ms%s",
                self.hook_name,
                self.total.steps,
                step.bytes_sent,
                step.collective_calls,
                step.handed_ratio,
                step.wire_ratio,
                1e3 * step.hook_seconds,
                "" if step.compression_error is None else f", error {step.compression_error:.3g}",
            )
        if self.jsonl_path is not None:
            record = {"hook": self.hook_name, "step": self.total.steps, **step.as_dict()}
            with open(self.jsonl_path, "a", encoding="utf-8") as stream:
                stream.write(json.dumps(record) + "\n")


K = TypeVar("K")


def _difference(after: dict[K, int], before: dict[K, int]) -> dict[K, int]:
    """The counts that grew from ``before`` to ``after``, by how much."""
    return {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}
