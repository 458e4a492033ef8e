"""The two-stage compressed allreduce: a compressed reduce-scatter (all-to-all of every rank's rows), the rows
averaged and recompressed by their owner, then a compressed all-gather, for
:class:`~gradcomm.compression.base.RowwiseCompressor` s (8-bit ByteGrad, 1-bit compressed allreduce with
server-side error feedback). A whole bucket is one row per rank and one exchange per stage.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.distributed import ProcessGroup

from gradcomm import comm
from gradcomm.comm.launcher import Launch, OrderedLauncher
from gradcomm.compression._numerics import ordered_mean
from gradcomm.compression.base import (
    Compressor,
    OwnDecoding,
    Payload,
    RowwiseCompressor,
    SegmentedCompressor,
    TensorSpec,
)
from gradcomm.compression.communicators import (
    Communicator,
    Message,
    SegmentCodec,
    _all_gather,
    _pack_rows,
    _split_by_message,
    _unpack_rows,
    compensated_compress,
    compensated_compress_segments,
)
from gradcomm.compression.memory import Memory, NoMemory
from gradcomm.compression.row_layout import RowLayout
from gradcomm.compression.segments import Segments
from gradcomm.compression.wire import PartLayout, TwoStageWire, Wire, writing_into

__all__ = ["TwoStageAllreduce"]


@dataclass(frozen=True)
class _Chunked:
    """``ctx`` of a tensor split into one padded row per rank."""

    spec: TensorSpec
    rows: Any
    decoded: torch.Tensor | None = field(default=None, compare=False)
    """This rank's payload decompressed, one row per rank, where its error feedback computed it."""


def _split_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` as ``rows`` rows, zero padded (a view where no padding is needed: compressors read it)."""
    flat = tensor.reshape(-1)
    padding = -flat.numel() % rows
    return (torch.nn.functional.pad(flat, (0, padding)) if padding else flat).view(rows, -1)


def _join_rows(rows: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    return rows.reshape(-1)[: spec.numel].view(spec.shape)


def _subtracting(
    decompress: Callable[[Payload, Any], torch.Tensor], kept: list[torch.Tensor]
) -> Callable[[torch.Tensor, Payload, Any], torch.Tensor]:
    """The residual ``corrected - decompress(payload, ctx)``, subtracted in place (row-wise codes and scales
    never share ``corrected``'s memory); the decompressed tensor is appended to ``kept``, to be reused."""

    def residual(corrected: torch.Tensor, payload: Payload, ctx: Any) -> torch.Tensor:
        kept.append(decompress(payload, ctx))
        return corrected.sub_(kept[-1])

    return residual


def _own(ctx: Any, world_size: int) -> torch.Tensor | None:
    """On one rank, the payload an exchange receives is the one this rank sent: its decoding where the encoding
    kept it (:class:`~gradcomm.compression.base.OwnDecoding`), else ``None``."""
    if world_size == 1 and isinstance(ctx, OwnDecoding):
        return ctx.decoded
    return None


def _all_to_all(rows: torch.Tensor, group: ProcessGroup | None, out: torch.Tensor | None = None) -> Launch:
    """Send row ``j`` of ``rows`` to rank ``j``; the future holds the rows received, one per source rank."""
    return lambda: comm.all_to_all_single(rows, group, out)


@dataclass(frozen=True, eq=False)
class _SegmentedRows:
    """``ctx`` of a bucket encoded for :class:`TwoStageAllreduce`."""

    layout: RowLayout
    ctx: Any


@dataclass(frozen=True)
class TwoStageAllreduce(Communicator):
    """A compressed allreduce in two stages, for :class:`~gradcomm.compression.base.RowwiseCompressor` s.

    Each tensor is split into one row per rank and compressed row-wise (one scale per row). Stage 1 (a
    reduce-scatter done as an all-to-all): rank ``j`` receives row ``j`` from every rank, decompresses and
    averages them, so partial sums never live in the compressed format and cannot overflow it; it compresses
    the mean again, with a second error-feedback residual of a row's size when ``server_error_feedback``
    (DeepSpeed's 1-bit compressed allreduce; Bagua's ByteGrad has none). Stage 2: an all-gather of the
    recompressed rows, which every rank decompresses identically.
    """

    server_error_feedback: bool = False

    @staticmethod
    def _rowwise(compressor: Compressor) -> RowwiseCompressor:
        if not isinstance(compressor, RowwiseCompressor):
            raise TypeError(f"TwoStageAllreduce needs a RowwiseCompressor, got {type(compressor).__name__}")
        return compressor

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
        """A whole bucket cut in rows (:class:`RowLayout`) and compressed at once, one scale per chunk."""
        layout = RowLayout.of(segments, world_size)
        corrected = flat if compensated else memory.compensate_segments(segments, flat)
        try:
            payload, ctx = compressor.compress_segments(layout.cut(corrected), layout.rows)
            if memory.enabled:
                sent = layout.join(compressor.decompress_own(payload, ctx, layout.rows))
                kept = corrected.clone() if corrected is flat and not owned else corrected
                memory.store_segments(segments, kept.sub_(sent))
        except BaseException:
            memory.discard_segments(segments)
            raise
        return Message(segments.keys, SegmentCodec(compressor, segments), payload, _SegmentedRows(layout, ctx))  # type: ignore[arg-type]

    def payload_layout(
        self, compressor: SegmentedCompressor, segments: Segments, world_size: int
    ) -> list[PartLayout]:
        return compressor.payload_layout(RowLayout.of(segments, world_size).rows.lengths, segments.dtype)

    def wire(self, layout: Sequence[PartLayout], world_size: int, device: torch.device, name: str) -> Wire | None:
        """Stage 1's rows and stage 2's row: a row's payload is each part's share of the rows' (a bucket of
        rows of one layout splits into equal rows, :class:`~gradcomm.compression.base.
        SegmentedRowwiseCompressor`)."""
        row = [(numel // world_size, dtype) for numel, dtype in layout]
        return TwoStageWire(layout, row, world_size, device, name)

    def _exchange_wired(
        self, message: Message, group: ProcessGroup | None, memory: Memory, launcher: OrderedLauncher, wire: TwoStageWire
    ) -> torch.futures.Future[list[torch.Tensor]]:
        """:meth:`_exchange_segments` through ``wire``'s buffers."""
        world_size = comm.group_size(group)
        compressor = message.compressor.compressor  # type: ignore[attr-defined]
        layout, ctx = message.ctx.layout, message.ctx.ctx
        server_memory = memory if self.server_error_feedback else NoMemory()
        wire.load(message.payload)
        send = wire.scatter.send
        received = launcher.launch(_all_to_all(send, group, wire.scatter.receive), send.device)
        reduced: list[Any] = []  # stage 2's ctx, once encoded

        def reduce(fut: torch.futures.Future[torch.Tensor]) -> Launch:
            fut.value()
            decoded = _own(ctx, world_size)  # one rank: what it received is its own payload
            if decoded is None:
                decoded = compressor.decompress_segments(wire.scatter.unpack(), ctx, layout.rows)
            mean = decoded if world_size == 1 else ordered_mean(decoded.view(world_size, -1).unbind(0), world_size)
            with writing_into(wire.gather):  # parts computed into their slots
                payload, server_ctx = compensated_compress_segments(
                    compressor, server_memory, layout.row, mean, owned=True
                )
            reduced.append(server_ctx)
            wire.gather.load(payload)
            return _all_gather(wire.gather.send, group, wire.gather.receive)

        def decompress(fut: torch.futures.Future[torch.Tensor]) -> list[torch.Tensor]:
            fut.value()
            decoded = _own(reduced[0], world_size)
            if decoded is None:  # on one rank the rows are the bucket: decoded into the mean's place
                out = message.out if world_size == 1 else None
                decoded = compressor.decompress_segments(wire.gather.unpack(), ctx, layout.rows, out)
            return [layout.join(decoded, message.out)]

        return launcher.launch_after(received, reduce, send.device).then(decompress)

    def _exchange_segments(
        self, message: Message, group: ProcessGroup | None, memory: Memory, launcher: OrderedLauncher
    ) -> torch.futures.Future[list[torch.Tensor]]:
        """Both stages for a whole bucket: one all-to-all of every chunk's row, one decoding and mean of the
        rows received, one recompression (with the server residuals, flat) and one all-gather."""
        world_size = comm.group_size(group)
        compressor = message.compressor.compressor  # type: ignore[attr-defined]
        layout, ctx = message.ctx.layout, message.ctx.ctx
        server_memory = memory if self.server_error_feedback else NoMemory()
        parts = [part.reshape(world_size, -1) for part in message.payload]
        rows = _pack_rows(parts, world_size)
        received = launcher.launch(_all_to_all(rows, group), rows.device)
        reduced: list[Payload] = []

        def reduce(fut: torch.futures.Future[torch.Tensor]) -> Launch:
            got = _unpack_rows(fut.value(), [part[0] for part in parts])
            decoded = compressor.decompress_segments([part.reshape(-1) for part in got], ctx, layout.rows)
            mean = ordered_mean(decoded.view(world_size, -1).unbind(0), world_size)
            payload, _ = compensated_compress_segments(compressor, server_memory, layout.row, mean, owned=True)
            reduced.append(payload)
            return _all_gather(_pack_rows([part.reshape(1, -1) for part in payload], 1).view(-1), group)

        def decompress(fut: torch.futures.Future[torch.Tensor]) -> list[torch.Tensor]:
            gathered = _unpack_rows(fut.value().view(world_size, -1), [part.reshape(-1) for part in reduced[0]])
            values = compressor.decompress_segments([part.reshape(-1) for part in gathered], ctx, layout.rows)
            return [layout.join(values)]

        return launcher.launch_after(received, reduce, rows.device).then(decompress)

    def encode(
        self, compressor: Compressor, key: Hashable, tensor: torch.Tensor, memory: Memory, world_size: int
    ) -> Message:
        rowwise = self._rowwise(compressor)

        def compress(corrected: torch.Tensor) -> tuple[Payload, _Chunked]:
            payload, ctx = rowwise.compress_rows(_split_rows(corrected, world_size))
            return payload, _Chunked(TensorSpec.of(corrected), ctx)

        decoded: list[torch.Tensor] = []

        def residual(corrected: torch.Tensor, payload: Payload, ctx: _Chunked) -> torch.Tensor:
            decoded.append(rowwise.decompress_rows(payload, ctx.rows))
            return corrected.sub_(_join_rows(decoded[0], ctx.spec))

        payload, ctx = compensated_compress(compressor, memory, key, tensor, compress, residual)
        return Message(key, compressor, payload, replace(ctx, decoded=decoded[0]) if decoded else ctx)

    @staticmethod
    def _received(
        rowwise: RowwiseCompressor, parts: Payload, ctx: _Chunked, rank: int
    ) -> torch.Tensor | list[torch.Tensor]:
        """The rows received in stage 1 decompressed, in source rank order; this rank's own row is taken
        from its encoding's decompression where error feedback computed it (the same values)."""
        if ctx.decoded is None:
            return rowwise.decompress_rows(parts, ctx.rows)
        world_size = ctx.decoded.shape[0]
        own = ctx.decoded[rank]
        if world_size == 1:
            return [own]
        others = [torch.cat([part[:rank], part[rank + 1 :]]) for part in parts]
        rows = list(rowwise.decompress_rows(others, ctx.rows).unbind(0))
        rows.insert(rank, own)
        return rows

    def exchange(
        self,
        messages: Sequence[Message],
        group: ProcessGroup | None,
        memory: Memory,
        launcher: OrderedLauncher,
        wire: Wire | None = None,
    ) -> torch.futures.Future[list[torch.Tensor]]:
        if len(messages) == 1 and isinstance(messages[0].compressor, SegmentCodec):
            if isinstance(wire, TwoStageWire):
                return self._exchange_wired(messages[0], group, memory, launcher, wire)
            return self._exchange_segments(messages[0], group, memory, launcher)
        world_size = comm.group_size(group)
        rank = comm.group_rank(group)
        server_memory = memory if self.server_error_feedback else NoMemory()
        worker_parts = [part for message in messages for part in message.payload]
        worker_templates = [part[0] for part in worker_parts]
        rows = _pack_rows(worker_parts, world_size)
        received = launcher.launch(_all_to_all(rows, group), rows.device)
        reduced: list[tuple[Payload, Any]] = []  # stage 1's recompressed means, filled when it completes
        # their decompressions where the server residual computed them: all that one rank gathers in stage 2
        server_decoded: list[torch.Tensor] = []

        def reduce(fut: torch.futures.Future[torch.Tensor]) -> Launch:
            parts = _unpack_rows(fut.value(), worker_templates)
            for message, its_parts in zip(messages, _split_by_message(parts, messages), strict=True):
                rowwise = self._rowwise(message.compressor)
                mean = ordered_mean(self._received(rowwise, its_parts, message.ctx, rank), world_size)
                reduced.append(
                    compensated_compress(
                        rowwise,
                        server_memory,
                        message.key,
                        mean.unsqueeze(0),
                        rowwise.compress_rows,
                        _subtracting(rowwise.decompress_rows, server_decoded),
                    )
                )
            server_parts = [part for payload, _ in reduced for part in payload]
            return _all_gather(_pack_rows(server_parts, 1).view(-1), group)

        def decompress(fut: torch.futures.Future[torch.Tensor]) -> list[torch.Tensor]:
            if world_size == 1 and len(server_decoded) == len(messages):  # gathered: this rank's rows alone
                return [_join_rows(rows, message.ctx.spec) for message, rows in zip(messages, server_decoded, strict=True)]
            templates = [part[0] for payload, _ in reduced for part in payload]
            rows = _unpack_rows(fut.value().view(world_size, -1), templates)
            return [
                _join_rows(self._rowwise(message.compressor).decompress_rows(its_rows, ctx), message.ctx.spec)
                for message, its_rows, (_, ctx) in zip(
                    messages, _split_by_message(rows, messages), reduced, strict=True
                )
            ]

        return launcher.launch_after(received, reduce, rows.device).then(decompress)
