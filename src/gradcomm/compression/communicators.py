"""How compressed payloads travel between ranks: the exchange half of a compression method.

A compressor names one communicator in its ``communicator`` attribute:

* :data:`ALLREDUCE` (:class:`Allreduce`): payloads that can be summed element-wise (random-k values at shared
  coordinates, casts, dense tensors): one allreduce per dtype, then one ``decompress`` of the sum.
* :data:`ALLGATHER` (:class:`Allgather`): payloads that cannot be summed (top-k values and indices, signs with
  per-rank scales): one all-gather of their bytes, then every rank decompresses all ranks' payloads (a
  segmented method that allows it a batch of ranks at once:
  :attr:`~gradcomm.compression.base.SegmentedCompressor.world_decoding`) and
  ``aggregate`` s them in rank order.
* :class:`~gradcomm.compression.two_stage.TwoStageAllreduce` (in its own module; its old name here
  warns): compressed reduce-scatter then compressed all-gather, for
  :class:`~gradcomm.compression.base.RowwiseCompressor` s (8-bit ByteGrad, 1-bit compressed allreduce).

A communicator serves all the tensors of one bucket that use it with one collective (per stage), whatever
their count; on two ranks :data:`ALLGATHER` carries the bucket's dense tensors too (:meth:`Communicator.
carries_dense`). Every collective goes through :mod:`gradcomm.comm`, so it is counted, and is launched through the
hook state's :class:`~gradcomm.comm.launcher.OrderedLauncher`: a second stage starts when the first one's
result is in, in its reserved place, without blocking the hook's thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from gradcomm import comm
from gradcomm._moved import moved_names
from gradcomm.comm.futures import when_all
from gradcomm.comm.launcher import Launch, OrderedLauncher
from gradcomm.compression.base import Compressor, Payload, SegmentedCompressor
from gradcomm.compression.memory import Memory
from gradcomm.compression.segments import Segments
from gradcomm.compression.wire import GatherWire, PartLayout, SumWire, Wire

__all__ = [
    "ALLGATHER",
    "ALLREDUCE",
    "Allgather",
    "Allreduce",
    "Communicator",
    "Message",
]


@dataclass
class Message:
    """One compressed tensor on its way: the payload to send and what the receiving side needs."""

    key: Hashable
    compressor: Compressor
    payload: Payload
    ctx: Any
    out: torch.Tensor | None = None
    """Where the mean may be decoded to (see :meth:`Compressor.aggregate` and :meth:`Compressor.decompress`):
    the tensor's place in its bucket, once nothing reads it any more."""


def compensated_compress(
    compressor: Compressor,
    memory: Memory,
    key: Hashable,
    tensor: torch.Tensor,
    compress: Callable[[torch.Tensor], tuple[Payload, Any]] | None = None,
    residual: Callable[[torch.Tensor, Payload, Any], torch.Tensor] | None = None,
) -> tuple[Payload, Any]:
    """Compress ``tensor`` plus its residual and keep what the compression dropped as the next residual.

    ``compress`` and ``residual`` (``corrected - decompress(payload, ctx)``, :meth:`Compressor.residual`,
    which may overwrite ``corrected``) default to the compressor's; random draws come from ``key``'s stream.
    """
    compress = compress or compressor.compress
    residual = residual or compressor.residual
    corrected = memory.compensate(key, tensor)
    try:
        with compressor.stream(key):
            payload, ctx = compress(corrected)
        if memory.enabled:
            owned = corrected.clone() if corrected is tensor else corrected  # the first step: no residual yet
            memory.store(key, residual(owned, payload, ctx))
    except BaseException:
        memory.discard(key)  # it may hold this step's tensor already: dropped rather than counted twice
        raise
    return payload, ctx


def compensated_compress_segments(
    compressor: SegmentedCompressor,
    memory: Memory,
    segments: Segments,
    flat: torch.Tensor,
    owned: bool = False,
    compensated: bool = False,
) -> tuple[Payload, Any]:
    """:func:`compensated_compress` of a whole bucket: ``flat`` holds ``segments``, compensated and stored
    as one flat residual. ``owned``: ``flat`` is the caller's to overwrite (a copy of the bucket's values);
    ``compensated``: ``flat`` is ``memory``'s own flat residual, to which the caller already added the
    values (the hook adds a bucket's strided gradients into it, with no copy of them in between)."""
    corrected = flat if compensated else memory.compensate_segments(segments, flat)
    try:
        payload, ctx = compressor.compress_segments(corrected, segments)
        if memory.enabled:
            kept = corrected.clone() if corrected is flat and not owned else corrected
            memory.store_segments(segments, compressor.residual_segments(kept, payload, ctx, segments))
    except BaseException:
        memory.discard_segments(segments)
        raise
    return payload, ctx


@dataclass(frozen=True, eq=False)
class SegmentCodec:
    """A segmented compressor's decoding of one bucket, as a :class:`Message`'s ``compressor`` (the
    exchanges call ``decompress`` and ``aggregate`` with a payload, a ``ctx`` and an ``out``)."""

    compressor: SegmentedCompressor
    segments: Segments

    def decompress(self, payload: Payload, ctx: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.compressor.decompress_segments(payload, ctx, self.segments, out)

    def aggregate(self, gathered: Payload, ctx: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.compressor.aggregate_segments(gathered, ctx, self.segments, out)


class Communicator(ABC):
    """Encodes tensors (with error feedback) and exchanges a batch of their payloads asynchronously."""

    def encode_segments(
        self,
        compressor: SegmentedCompressor,
        segments: Segments,
        flat: torch.Tensor,
        memory: Memory,
        world_size: int,
        owned: bool = False,
        compensated: bool = False,
    ) -> Message:
        """Compress a whole bucket's ``flat`` tensors for this exchange, with ``memory``'s error feedback
        (``owned``, ``compensated``: as for :func:`compensated_compress_segments`)."""
        payload, ctx = compensated_compress_segments(compressor, memory, segments, flat, owned, compensated)
        return Message(segments.keys, SegmentCodec(compressor, segments), payload, ctx)  # type: ignore[arg-type]

    def encode(
        self, compressor: Compressor, key: Hashable, tensor: torch.Tensor, memory: Memory, world_size: int
    ) -> Message:
        """Compress ``tensor`` for this exchange, with ``memory``'s error feedback."""
        payload, ctx = compensated_compress(compressor, memory, key, tensor)
        return Message(key, compressor, payload, ctx)

    def payload_layout(
        self, compressor: SegmentedCompressor, segments: Segments, world_size: int
    ) -> list[PartLayout]:
        """The payload of a bucket of ``segments`` as :meth:`encode_segments` encodes it."""
        return compressor.payload_layout(segments.lengths, segments.dtype)

    def wire(self, layout: Sequence[PartLayout], world_size: int, device: torch.device, name: str) -> Wire | None:
        """Buffers for exchanging payloads of ``layout`` (every part of a batch, in order) step after step
        (:mod:`gradcomm.compression.wire`), which :meth:`exchange` then takes as ``wire``; ``None`` where the
        communicator has none (it then packs its payloads itself). ``name``: the method, for errors."""
        return None

    def carries_dense(self, world_size: int) -> bool:
        """Whether a bucket's dense (uncompressed) tensors can travel in this communicator's collective rather
        than in an allreduce of their own, with the same bytes on the link and the same result, bit for bit."""
        return False

    @abstractmethod
    def exchange(
        self,
        messages: Sequence[Message],
        group: ProcessGroup | None,
        memory: Memory,
        launcher: OrderedLauncher,
        wire: Wire | None = None,
    ) -> torch.futures.Future[list[torch.Tensor]]:
        """Send ``messages``; the future holds each one's mean over ranks, decompressed, in order.

        ``memory`` is for the communicator's own residuals (:class:`TwoStageAllreduce`'s second stage);
        every collective is launched through ``launcher``. ``wire``: from :meth:`wire`, for the layout of
        these messages' payloads; what the future holds may then be views of it, valid until its next use.
        """


def _pack_rows(parts: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    """The bytes of ``parts`` side by side, row by row: a ``(rows, total bytes per row)`` uint8 tensor."""
    return torch.cat([part.reshape(rows, -1).contiguous().view(torch.uint8) for part in parts], dim=1)


def _unpack_rows(data: torch.Tensor, templates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`_pack_rows` for rows shaped like ``templates`` (leading row axis excluded)."""
    rows, out, offset = data.shape[0], [], 0
    for template in templates:
        nbytes = template.numel() * template.element_size()
        if nbytes == 0:  # an empty tensor's bytes: nothing to view (an empty chunk's strides forbid it)
            out.append(data.new_empty((rows, *template.shape), dtype=template.dtype))
            continue
        chunk = data[:, offset : offset + nbytes].clone(memory_format=torch.contiguous_format)
        out.append(chunk.view(template.dtype).view(rows, *template.shape))
        offset += nbytes
    return out


def _split_by_message(parts: list[torch.Tensor], messages: Sequence[Message]) -> list[list[torch.Tensor]]:
    out, start = [], 0
    for message in messages:
        out.append(parts[start : start + len(message.payload)])
        start += len(message.payload)
    return out


def _divided_flat(parts: Sequence[torch.Tensor], world_size: int) -> torch.Tensor:
    """``parts`` flattened into one new tensor, divided by ``world_size``: one pass for a single part."""
    if len(parts) == 1:
        return parts[0].reshape(-1).div(world_size)
    return torch.cat([part.reshape(-1) for part in parts]).div_(world_size)


@dataclass(frozen=True)
class Allreduce(Communicator):
    """Sum the payloads with allreduce: they must be floating point and linear in the compressed tensor.

    Payloads are divided by the world size before the sum (as torch's allreduce hook does), so the sum cannot
    overflow where the mean does not.
    """

    def exchange(
        self,
        messages: Sequence[Message],
        group: ProcessGroup | None,
        memory: Memory,
        launcher: OrderedLauncher,
        wire: Wire | None = None,
    ) -> torch.futures.Future[list[torch.Tensor]]:
        if isinstance(wire, SumWire):
            return self._exchange_wired(messages, group, launcher, wire)
        world_size = comm.group_size(group)
        parts = [part for message in messages for part in message.payload]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for index, part in enumerate(parts):
            if not part.is_floating_point():
                raise TypeError(f"Allreduce: payloads must be floating point, got {part.dtype}")
            by_dtype.setdefault(part.dtype, []).append(index)
        flats = [_divided_flat([parts[i] for i in indices], world_size) for indices in by_dtype.values()]
        futures = [launcher.launch(_all_reduce(flat, group), flat.device) for flat in flats]

        def decompress(_: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
            summed: dict[int, torch.Tensor] = {}
            for indices, flat in zip(by_dtype.values(), flats, strict=True):
                pieces = flat.split([parts[i].numel() for i in indices])
                summed.update(
                    (i, piece.view(parts[i].shape)) for i, piece in zip(indices, pieces, strict=True)
                )
            in_order = [summed[i] for i in range(len(parts))]
            return [
                message.compressor.decompress(payload, message.ctx, message.out)
                for message, payload in zip(messages, _split_by_message(in_order, messages), strict=True)
            ]

        return when_all(futures, flats[0].device).then(decompress)

    def wire(self, layout: Sequence[PartLayout], world_size: int, device: torch.device, name: str) -> Wire | None:
        return SumWire(layout, world_size, device, name)

    @staticmethod
    def _exchange_wired(
        messages: Sequence[Message], group: ProcessGroup | None, launcher: OrderedLauncher, wire: SumWire
    ) -> torch.futures.Future[list[torch.Tensor]]:
        wire.load([part for message in messages for part in message.payload])
        futures = [launcher.launch(_all_reduce(flat, group), flat.device) for flat in wire.flats]
        summed = _split_by_message(wire.slots, messages)

        def decompress(fut: torch.futures.Future[Any]) -> list[torch.Tensor]:
            fut.value()
            return [
                message.compressor.decompress(payload, message.ctx, message.out)
                for message, payload in zip(messages, summed, strict=True)
            ]

        future = futures[0] if len(futures) == 1 else when_all(futures, wire.flats[0].device)
        return future.then(decompress)


@dataclass(frozen=True)
class Allgather(Communicator):
    """All-gather the payloads' bytes in one collective; each rank aggregates everyone's payloads itself.

    Traffic grows with the world size (every rank receives every payload), the price of payloads that cannot
    be summed without decompressing them.
    """

    def carries_dense(self, world_size: int) -> bool:
        """On one or two ranks: an all-gather of B bytes then puts B on each link, as a ring allreduce of B
        does, and the mean of two pre-divided addends is the same in either order. So a bucket costs one
        collective instead of two; from three ranks on an all-gather costs more bytes and sums in another
        order than gloo's ring."""
        return world_size <= 2

    def exchange(
        self,
        messages: Sequence[Message],
        group: ProcessGroup | None,
        memory: Memory,
        launcher: OrderedLauncher,
        wire: Wire | None = None,
    ) -> torch.futures.Future[list[torch.Tensor]]:
        if isinstance(wire, GatherWire):
            return self._exchange_wired(messages, group, launcher, wire)
        world_size = comm.group_size(group)
        templates = [part for message in messages for part in message.payload]
        packed = _pack_rows(templates, 1).view(-1)
        future = launcher.launch(_all_gather(packed, group), packed.device)

        def aggregate(fut: torch.futures.Future[torch.Tensor]) -> list[torch.Tensor]:
            gathered = _unpack_rows(fut.value().view(world_size, -1), templates)
            return [
                message.compressor.aggregate(parts, message.ctx, message.out)
                for message, parts in zip(messages, _split_by_message(gathered, messages), strict=True)
            ]

        return future.then(aggregate)

    def wire(self, layout: Sequence[PartLayout], world_size: int, device: torch.device, name: str) -> Wire | None:
        return GatherWire(layout, world_size, device, name)

    @staticmethod
    def _exchange_wired(
        messages: Sequence[Message], group: ProcessGroup | None, launcher: OrderedLauncher, wire: GatherWire
    ) -> torch.futures.Future[list[torch.Tensor]]:
        wire.load([part for message in messages for part in message.payload])
        future = launcher.launch(_all_gather(wire.send, group, wire.receive), wire.send.device)

        def aggregate(fut: torch.futures.Future[torch.Tensor]) -> list[torch.Tensor]:
            fut.value()
            return [
                message.compressor.aggregate(parts, message.ctx, message.out)
                for message, parts in zip(messages, _split_by_message(wire.unpack(), messages), strict=True)
            ]

        return future.then(aggregate)


def _all_reduce(flat: torch.Tensor, group: ProcessGroup | None) -> Launch:
    return lambda: comm.all_reduce(flat, group)


def _all_gather(flat: torch.Tensor, group: ProcessGroup | None, out: torch.Tensor | None = None) -> Launch:
    return lambda: comm.all_gather_into_tensor(flat, group, out)


ALLREDUCE = Allreduce()
ALLGATHER = Allgather()


__getattr__ = moved_names(__name__, {"TwoStageAllreduce": "gradcomm.compression.two_stage"})
