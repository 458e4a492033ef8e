"""The link as a hook sees it: ``latency + wire bytes / bandwidth`` per collective, fitted from timed allreduces.

:func:`measure_link` times allreduces of a few sizes on a process group and fits that model, the same figures
on every rank (:func:`agree_max`). :mod:`gradcomm.hooks.auto_hook` uses it to predict each candidate hook's
network time from the collective calls and wire bytes it measured.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm import comm

__all__ = ["Link", "agree_max", "fit_link", "measure_link"]

PROBE_BYTES = (4 << 10, 64 << 10, 1 << 20)
"""The fixed sizes of the first fit."""
PROBE_REPEATS = 2
"""Allreduces per size; the fastest counts."""
PROBE_SECONDS = 0.03
"""How long the last, larger probe should take at the first fit's bandwidth."""
PROBE_MAX_BYTES = 16 << 20


@dataclass(frozen=True)
class Link:
    """Seconds per collective call and bytes per second on the wire."""

    latency: float
    bandwidth: float

    def seconds(self, calls: float, wire_bytes: float) -> float:
        """Predicted network time of ``calls`` collectives putting ``wire_bytes`` on each rank's link."""
        return calls * self.latency + (wire_bytes / self.bandwidth if self.bandwidth > 0 else math.inf)

    def describe(self) -> str:
        rate = "unlimited" if math.isinf(self.bandwidth) else f"{8 * self.bandwidth / 1e6:.1f} Mbit/s"
        return f"latency {1e3 * self.latency:.3f} ms, bandwidth {rate}"


def measure_link(group: ProcessGroup | None) -> Link:
    """Time allreduces of a few sizes on ``group`` and fit ``latency + wire bytes / bandwidth`` (a collective).

    The fixed sizes (4 KiB to 1 MiB) give a first fit; then one size that takes about :data:`PROBE_SECONDS` at
    that bandwidth (1 to 16 MiB) is timed too, so that a link shaper's burst allowance or a collective's fixed
    cost does not pass for bandwidth. Every rank times the same sizes: the second size follows from the first
    fit of times agreed over the ranks. On one rank there is no link: latency 0, bandwidth infinite.
    """
    world = comm.group_size(group)
    if world == 1:
        return Link(0.0, math.inf)
    sizes = list(PROBE_BYTES)
    wire = [comm.wire_bytes({"all_reduce": n}, world) for n in sizes]
    seconds = agree_max([_time_allreduce(size, group) for size in sizes], group)
    first = fit_link(wire, seconds)
    if math.isfinite(first.bandwidth):
        large = int(min(max(first.bandwidth * PROBE_SECONDS, 1 << 20), PROBE_MAX_BYTES)) // 4 * 4
        if large > 2 * sizes[-1]:
            wire.append(comm.wire_bytes({"all_reduce": large}, world))
            seconds += agree_max([_time_allreduce(large, group)], group)
    return fit_link(wire, seconds)


def agree_max(values: list[float], group: ProcessGroup | None) -> list[float]:
    """The maximum of ``values`` over the ranks of ``group`` (a collective; the same list on every rank)."""
    if comm.group_size(group) == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=comm.collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def fit_link(wire: Sequence[float], seconds: Sequence[float]) -> Link:
    """Least-squares ``seconds = latency + wire / bandwidth``, kept physical (latency >= 0, bandwidth > 0)."""
    n = len(wire)
    mean_x, mean_y = sum(wire) / n, sum(seconds) / n
    variance = sum((x - mean_x) ** 2 for x in wire)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(wire, seconds, strict=True)) / variance
    latency = mean_y - slope * mean_x
    if latency < 0:
        latency = 0.0
        slope = sum(x * y for x, y in zip(wire, seconds, strict=True)) / sum(x * x for x in wire)
    if slope <= 0:
        return Link(min(seconds), math.inf)
    return Link(latency, 1.0 / slope)


def _time_allreduce(size: int, group: ProcessGroup | None) -> float:
    """The fastest of :data:`PROBE_REPEATS` allreduces of ``size`` bytes on ``group`` (uncounted)."""
    device = comm.collective_device(group)
    tensor = torch.zeros(size // 4, dtype=torch.float32, device=device)
    dist.all_reduce(tensor[:1], group=group)  # lines the ranks up; not timed
    fastest = math.inf
    for _ in range(PROBE_REPEATS):
        _synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        _synchronize(device)
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
