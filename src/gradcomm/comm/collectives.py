"""Asynchronous collectives for communication hooks, returning ``torch.futures.Future`` and counting traffic.

Hooks call these instead of ``torch.distributed`` directly so that every byte a gradcomm hook hands to a
collective is counted in one place, whatever DDP the hook is registered on: in this process's :data:`traffic`,
and in the account of the DDP whose hook launched it (:func:`counting_into`; collectives launched later from a
callback through :class:`~gradcomm.comm.launcher.OrderedLauncher` are counted where they were reserved). They
are thin: each launches one ``torch.distributed`` collective with ``async_op=True`` and adapts its future,
except that on gloo an all-gather or all-to-all goes as point-to-point sends and receives
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

from gradcomm.comm.futures import future_of, future_of_works

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


EXCHANGE_TAG = 0x67636F6D
"""The point-to-point tag of :func:`all_gather_into_tensor` and :func:`all_to_all_single` on gloo, apart
from the tags a user's own sends and receives are likely to use."""


def all_gather_into_tensor(
    tensor: torch.Tensor, group: ProcessGroup | None = None, out: torch.Tensor | None = None
) -> torch.futures.Future[torch.Tensor]:
    """Gather ``tensor`` from every rank into one tensor of ``world_size * numel`` elements, rank-major.

    On gloo (CPU tensors) the rows are exchanged with every peer by point-to-point sends and receives, every
    receive posted before any send (:func:`_exchange`), instead of gloo's all-gather. gloo's all-gather posts
    each send before the matching receive, and a send waits until the peer has posted its receive. The rank
    that reaches the collective later therefore sends its "ready to receive" behind half of its own data, and
    only then does its peer start sending to it: that rank takes about 1.5x the link time of its bytes. With
    the receives first it takes 1.0x (measured in ``docs/notes/2026-11-24-hooks-at-the-link-floor.md``,
    "Receives before sends"). Counted as one collective. ``out``: a flat tensor of ``world_size * numel``
    elements of ``tensor``'s dtype to gather into (a buffer reused every step), else a new one.
    """
    _record("all_gather", group, tensor)
    world_size = group_size(group)
    flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)
    output = tensor.new_empty((world_size * flat.numel(),)) if out is None else out
    if not _exchanges(flat, group):
        return future_of(_all_gather_single(output, flat, group=group, async_op=True), output)
    rows = output.view(world_size, -1)
    rows[group_rank(group)].copy_(flat)
    return _exchange([flat] * world_size, list(rows.unbind(0)), group, output)


def _exchanges(tensor: torch.Tensor, group: ProcessGroup | None) -> bool:
    """Whether :func:`all_gather_into_tensor` and :func:`all_to_all_single` exchange ``tensor`` point to point
    (:func:`_exchange`): CPU tensors on a gloo group of several ranks. gloo's sends and receives take CPU
    tensors only, and NCCL's collectives do not have gloo's ordering of sends and receives."""
    return group_size(group) > 1 and tensor.device.type == "cpu" and dist.get_backend(group) == "gloo"


def _exchange(
    outgoing: Sequence[torch.Tensor], incoming: Sequence[torch.Tensor], group: ProcessGroup | None, result: T
) -> torch.futures.Future[T]:
    """Send ``outgoing[peer]`` to every peer and receive ``incoming[peer]`` from it (``group`` ranks; this
    rank's own entries are not touched), posting every receive before any send: the peer that is already
    waiting starts sending the moment this rank arrives. A future holds ``result`` once all are done; it
    fails with the first failure (gloo's timeout, or a peer's closed connection).

    gloo's point-to-point work has no future of its own: a background thread waits for it
    (:func:`~gradcomm.comm.futures.future_of_works`). Every exchange is posted in the same order on every
    rank, and gloo matches a peer's sends with the receives of the same tag in the order they were posted."""
    me = group_rank(group)
    peers = [(me + offset) % len(outgoing) for offset in range(1, len(outgoing))]
    works = [dist.irecv(incoming[peer], group=group, group_src=peer, tag=EXCHANGE_TAG) for peer in peers]
    works += [dist.isend(outgoing[peer], group=group, group_dst=peer, tag=EXCHANGE_TAG) for peer in peers]
    return future_of_works(works, result)


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


def all_to_all_single(
    tensor: torch.Tensor, group: ProcessGroup | None = None, out: torch.Tensor | None = None
) -> torch.futures.Future[torch.Tensor]:
    """Send chunk ``j`` of ``tensor`` (``world_size`` equal chunks along dim 0) to rank ``j``; the future holds
    the chunks received, ordered by source rank, in a tensor shaped like ``tensor``.

    On gloo (CPU tensors) the chunks go point to point, every receive posted first, as in
    :func:`all_gather_into_tensor` and for the same reason, only more so: gloo's all-to-all sends a whole
    chunk before posting the matching receive, so the later rank's "ready to receive" waits behind all of its
    data (measured in ``docs/notes/2026-11-24-hooks-at-the-link-floor.md``, "Receives before sends").
    Counted as one collective. ``out``: a contiguous tensor shaped like ``tensor`` to receive into (a buffer
    reused every step), else a new one."""
    world_size = group_size(group)
    if tensor.shape[0] % world_size:
        raise ValueError(
            f"all_to_all_single: dimension 0 of size {tensor.shape[0]} does not split into {world_size} equal "
            "chunks; pad it to a multiple of the world size"
        )
    _record("all_to_all", group, tensor)
    source = tensor if tensor.is_contiguous() else tensor.contiguous()
    output = torch.empty_like(source) if out is None else out
    if not _exchanges(source, group):
        return future_of(dist.all_to_all_single(output, source, group=group, async_op=True), output)
    rows, received = source.view(world_size, -1), output.view(world_size, -1)
    me = group_rank(group)
    received[me].copy_(rows[me])
    return _exchange(list(rows.unbind(0)), list(received.unbind(0)), group, output)


def broadcast(tensor: torch.Tensor, src: int = 0, group: ProcessGroup | None = None) -> torch.futures.Future[torch.Tensor]:
    """Broadcast ``tensor`` in place from global rank ``src``; the future holds ``tensor``."""
    _record("broadcast", group, tensor)
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    return future_of(work, tensor)
