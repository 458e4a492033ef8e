"""Asynchronous collectives for communication hooks, returning ``torch.futures.Future`` and counting traffic.

Hooks call these instead of ``torch.distributed`` directly so that every byte a gradcomm hook hands to a
collective is counted in one place, whatever DDP the hook is registered on: in this process's :data:`traffic`,
and in the account of the DDP whose hook launched it (:func:`counting_into`; collectives launched later from a
callback through :class:`~gradcomm.comm.launcher.OrderedLauncher` are counted where they were reserved). They
are thin: each launches one ``torch.distributed`` collective with ``async_op=True`` and adapts its future,
except that a large all-gather or all-to-all on gloo goes as a few concurrent ones
(:func:`all_gather_into_tensor`).

``group`` is a process group or ``None`` for the default (WORLD) group. Each call is counted with the size
of its own group (:attr:`Traffic.bytes_by_group`), so :func:`group_wire_bytes` is right for collectives on
subgroups (hierarchical hooks, PostLocalSGD) where :func:`wire_bytes` assumes one size for all.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm.comm.futures import future_of, when_all

__all__ = [
    "Traffic",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "bytes_by_kind",
    "collective_device",
    "counting_into",
    "group_rank",
    "group_size",
    "group_wire_bytes",
    "reduce_scatter_tensor",
    "traffic",
    "wire_bytes",
]


def _payload_bytes(tensor: torch.Tensor) -> int:
    """Bytes a collective carries for ``tensor``: a sparse COO tensor sends its indices and values."""
    if tensor.is_sparse:
        indices, values = tensor._indices(), tensor._values()
        return indices.numel() * indices.element_size() + values.numel() * values.element_size()
    return tensor.numel() * tensor.element_size()


@dataclass
class Traffic:
    """Bytes handed to collectives and number of collective calls in this process, by ``(collective kind,
    group size)`` (:attr:`bytes_by_group`, what :func:`group_wire_bytes` needs) and, summed, by kind."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes_by_group: dict[tuple[str, int], int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, kind: str, *tensors: torch.Tensor, group_size: int | None = None) -> None:
        """Count one ``kind`` collective carrying ``tensors`` on a group of ``group_size`` ranks (``None``: the
        default group's size, 1 without one)."""
        if group_size is None:
            group_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        nbytes = sum(_payload_bytes(t) for t in tensors)
        key = (kind, group_size)
        with self._lock:
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.bytes_by_group[key] = self.bytes_by_group.get(key, 0) + nbytes

    @property
    def bytes_sent(self) -> dict[str, int]:
        """Bytes per collective kind so far (a new dict)."""
        return bytes_by_kind(self.snapshot_by_group())

    def snapshot(self) -> dict[str, int]:
        """Bytes per collective kind so far (a copy)."""
        return self.bytes_sent

    def snapshot_by_group(self) -> dict[tuple[str, int], int]:
        """Bytes per ``(collective kind, group size)`` so far (a copy)."""
        with self._lock:
            return dict(self.bytes_by_group)

    @property
    def total_bytes(self) -> int:
        return sum(self.snapshot_by_group().values())

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def wire_bytes(self) -> float:
        """Bytes this process put on its link for everything counted, each collective at its group's size."""
        return group_wire_bytes(self.snapshot_by_group())

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.bytes_by_group.clear()


def bytes_by_kind(bytes_by_group: Mapping[tuple[str, int], int]) -> dict[str, int]:
    """Bytes keyed by ``(collective kind, group size)`` summed per kind."""
    summed: dict[str, int] = {}
    for (kind, _), nbytes in bytes_by_group.items():
        summed[kind] = summed.get(kind, 0) + nbytes
    return summed


T = TypeVar("T")

# torch 2.13 renamed these; older releases (the 2.4 floor) only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

traffic = Traffic()
"""This process's cumulative traffic through :mod:`gradcomm.comm`."""


_ACCOUNT: contextvars.ContextVar[Traffic | None] = contextvars.ContextVar("gradcomm_traffic_account", default=None)


@contextmanager
def counting_into(account: Traffic) -> Iterator[None]:
    """Count the collectives launched inside (on this thread) in ``account`` too: one DDP's own traffic."""
    token = _ACCOUNT.set(account)
    try:
        yield
    finally:
        _ACCOUNT.reset(token)


def _record(kind: str, group: ProcessGroup | None, *tensors: torch.Tensor) -> None:
    size = group_size(group)
    traffic.record(kind, *tensors, group_size=size)
    account = _ACCOUNT.get()
    if account is not None:
        account.record(kind, *tensors, group_size=size)


_WIRE_FACTORS = {
    # bytes each rank puts on its link per byte it hands to the collective, for ring algorithms on n ranks
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
}


def wire_bytes(bytes_by_kind: Mapping[str, int], world_size: int) -> float:
    """Bytes one rank sends over its link for the given collective inputs, all on groups of ``world_size``
    ranks, with bandwidth-optimal (ring) algorithms: allreduce 2(n-1)/n of its input, all-gather (n-1) times,
    reduce-scatter and all-to-all (n-1)/n, broadcast once. For collectives on groups of different sizes use
    :func:`group_wire_bytes`."""
    return sum(_WIRE_FACTORS[kind](world_size) * nbytes for kind, nbytes in bytes_by_kind.items())


def group_wire_bytes(bytes_by_group: Mapping[tuple[str, int], int]) -> float:
    """:func:`wire_bytes` of inputs keyed by ``(collective kind, group size)`` (:attr:`Traffic.bytes_by_group`):
    each collective at its own group's size."""
    return sum(_WIRE_FACTORS[kind](size) * nbytes for (kind, size), nbytes in bytes_by_group.items())


def collective_device(group: ProcessGroup | None) -> torch.device:
    """The device of small tensors gradcomm exchanges on ``group`` itself (flags, checksums): NCCL needs CUDA."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_size(group: ProcessGroup | None) -> int:
    """World size of ``group`` (the default group when ``None``)."""
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank within ``group`` (the default group when ``None``)."""
    return dist.get_rank(group)


def all_reduce(
    tensor: torch.Tensor, group: ProcessGroup | None = None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.futures.Future[torch.Tensor]:
    """Reduce ``tensor`` in place across ``group``; the future holds ``tensor``."""
    _record("all_reduce", group, tensor)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return future_of(work, tensor)


def all_gather(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.futures.Future[list[torch.Tensor]]:
    """Gather ``tensor`` from every rank; the future holds the list, ordered by rank."""
    _record("all_gather", group, tensor)
    outputs = [torch.empty_like(tensor) for _ in range(group_size(group))]
    work = dist.all_gather(outputs, tensor, group=group, async_op=True)
    return future_of(work, outputs)


GATHER_PART_BYTES = 128 << 10
"""On gloo, an all-gather of at least twice this many bytes per rank (an all-to-all: per peer) is sent as
several concurrent ones of its parts, each at least this large and at most :data:`GATHER_PARTS` of them
(:func:`all_gather_into_tensor`)."""
GATHER_PARTS = 4


def all_gather_into_tensor(
    tensor: torch.Tensor, group: ProcessGroup | None = None
) -> torch.futures.Future[torch.Tensor]:
    """Gather ``tensor`` from every rank into one tensor of ``world_size * numel`` elements, rank-major.

    On gloo, twice :data:`GATHER_PART_BYTES` or more per rank go as up to :data:`GATHER_PARTS` concurrent
    all-gathers of consecutive parts, each received straight into its place in the result. gloo's
    all-gather posts each send before the matching receive, and a send waits until the peer has posted its
    receive. The rank that reaches the collective later therefore sends its "ready to receive" behind half of
    its own data, and only then does its peer start sending to it: that rank takes about 1.5x the link time of
    the bytes, where an allreduce of the same bytes (whose segments are small, each receive posted before its
    send) takes 1.0x. In parts, the data ahead of that message is a part's. On 2 ranks behind 100 Mbit/s links,
    the later rank 20 ms late: 0.35-1.65 MB per rank took it 1.44-1.47x the earlier rank's time in one
    message, 1.06-1.11x in 4 parts (``benchmarks/RESULTS.md``, "The later rank's all-gather"). Parts smaller
    than about 128 KiB cost more in per-collective overhead than they save. Counted as one collective.
    """
    _record("all_gather", group, tensor)
    world_size = group_size(group)
    flat = tensor.reshape(-1)
    output = tensor.new_empty((world_size * flat.numel(),))
    parts = _parts(flat, group)
    if parts == 1:
        return future_of(_all_gather_single(output, flat, group=group, async_op=True), output)
    received = _stretches(output.view(world_size, -1), parts)
    return _when_all_done(
        [
            dist.all_gather(into, chunk, group=group, async_op=True)
            for into, chunk in zip(received, flat.tensor_split(parts), strict=True)
        ],
        output,
    )


def _stretches(rows: torch.Tensor, parts: int) -> list[list[torch.Tensor]]:
    """``rows`` (one row per rank) cut into ``parts`` stretches of columns: for each stretch, its piece of every
    row. Each piece is a contiguous view, so a list collective reads or writes ``rows`` in place: gloo copies
    between them and its own buffer on its worker thread, and nothing is reassembled here."""
    return [list(stretch.unbind(0)) for stretch in rows.tensor_split(parts, dim=1)]


def _when_all_done(works: Sequence[dist.Work], result: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future holding ``result`` once every one of ``works`` is done; it fails with the first that fails."""

    def done(all_done: torch.futures.Future[list[None]]) -> torch.Tensor:
        all_done.value()  # re-raises the failure: a part that timed out must not pass for a gathered one
        return result

    return when_all([future_of(work, None) for work in works], result.device).then(done)


def _parts(flat: torch.Tensor, group: ProcessGroup | None) -> int:
    """In how many concurrent collectives :func:`all_gather_into_tensor` and :func:`all_to_all_single` send
    ``flat``, what each rank sends to each peer. Only CPU tensors on gloo go in parts: gloo's list all-to-all
    takes CPU tensors only, and NCCL's collectives do not have gloo's ordering of sends and receives."""
    if group_size(group) < 2 or flat.device.type != "cpu" or dist.get_backend(group) != "gloo":
        return 1
    nbytes = flat.numel() * flat.element_size()
    return max(1, min(GATHER_PARTS, nbytes // GATHER_PART_BYTES))


def reduce_scatter_tensor(
    tensor: torch.Tensor, group: ProcessGroup | None = None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.futures.Future[torch.Tensor]:
    """Reduce ``tensor`` (``world_size`` equal chunks) and give each rank its chunk of the result."""
    world_size = group_size(group)
    if tensor.numel() % world_size:
        raise ValueError(
            f"reduce_scatter_tensor: {tensor.numel()} elements do not split into {world_size} equal chunks; "
            "pad the tensor to a multiple of the world size"
        )
    _record("reduce_scatter", group, tensor)
    output = tensor.new_empty((tensor.numel() // world_size,))
    work = _reduce_scatter_single(output, tensor.reshape(-1), op=op, group=group, async_op=True)
    return future_of(work, output)


def all_to_all_single(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.futures.Future[torch.Tensor]:
    """Send chunk ``j`` of ``tensor`` (``world_size`` equal chunks along dim 0) to rank ``j``; the future holds
    the chunks received, ordered by source rank, in a tensor shaped like ``tensor``.

    On gloo, chunks of twice :data:`GATHER_PART_BYTES` or more go as concurrent all-to-alls of stretches of
    every chunk, as :func:`all_gather_into_tensor` does and for the same reason, only more so: gloo's
    all-to-all sends a whole chunk before posting the matching receive, so the later rank's "ready to receive"
    waits behind all of its data (2 ranks, 0.17-1.65 MB per peer at 100 Mbit/s, the later rank 20 ms late:
    1.5-2.0x the earlier rank's time). Counted as one collective."""
    world_size = group_size(group)
    if tensor.shape[0] % world_size:
        raise ValueError(
            f"all_to_all_single: dimension 0 of size {tensor.shape[0]} does not split into {world_size} equal "
            "chunks; pad it to a multiple of the world size"
        )
    _record("all_to_all", group, tensor)
    source = tensor.contiguous()
    output = torch.empty_like(source)
    rows = source.view(world_size, -1)
    parts = _parts(rows[0], group)
    if parts == 1:
        return future_of(dist.all_to_all_single(output, source, group=group, async_op=True), output)
    # each part a stretch of every rank's chunk, so that each rank still receives its own chunk's stretch
    received = _stretches(output.view(world_size, -1), parts)
    return _when_all_done(
        [
            dist.all_to_all(into, sent, group=group, async_op=True)
            for into, sent in zip(received, _stretches(rows, parts), strict=True)
        ],
        output,
    )


def broadcast(tensor: torch.Tensor, src: int = 0, group: ProcessGroup | None = None) -> torch.futures.Future[torch.Tensor]:
    """Broadcast ``tensor`` in place from global rank ``src``; the future holds ``tensor``."""
    _record("broadcast", group, tensor)
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    return future_of(work, tensor)
