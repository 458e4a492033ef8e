"""A bucket layout's exchange buffers, made once and reused every step: the segmented hook's wire.

The payload of a bucket has the same parts, of the same sizes and dtypes, at every step
(:meth:`~gradcomm.compression.base.SegmentedCompressor.payload_layout`). So the buffers an exchange needs,
and every view of them, are made once per bucket layout: each payload part is copied into its slot of one
send buffer (one call), the collective writes into a receive buffer of its own, and each part is read back
through a view made with the buffer. Packing a list of parts and unpacking it cost a reshape, a view, a
slice and a clone per part and two bucket-sized allocations per step (fresh pages, faulted in every step).

* :class:`GatherWire` (all-gather): the parts' bytes back to back, as :func:`~gradcomm.compression.
  communicators._pack_rows` packs them (the same bytes on the link); a part received at an offset that its
  dtype cannot view is copied out of the receive buffer into an aligned one.
* :class:`SumWire` (allreduce): one flat buffer per dtype, summed in place; a part is divided by the world
  size into its slot, and its slot is the sum read back.

A part already written into its slot (the hook copies a bucket's dense gradients straight from the bucket)
is recognised by being the slot itself, and not copied again. A wire serves one exchange at a time: the
hook keeps one per bucket layout and marks it :attr:`Wire.busy` until its exchange has been assembled.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["GatherWire", "RowWire", "Slot", "SumWire", "TwoStageWire", "Wire", "payload_slot", "writing_into"]

PartLayout = tuple[int, torch.dtype]
"""``(elements, dtype)`` of one payload part."""


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True)
class Slot:
    """Where a payload part goes on the wire: :attr:`view`, in the shape its encoding writes it (an ``out=``),
    and :attr:`flat`, the slot itself, to return as the payload part (the wire then copies nothing)."""

    view: torch.Tensor
    flat: torch.Tensor


_WRITING: contextvars.ContextVar[tuple[Wire, int] | None] = contextvars.ContextVar("gradcomm_wire", default=None)


@contextlib.contextmanager
def writing_into(wire: Wire | None, first: int = 0) -> Iterator[None]:
    """Within it, the payload an encoding makes goes into ``wire``, its part ``i`` into slot ``first + i``
    (:func:`payload_slot`): a context variable, so each thread sees its own."""
    token = _WRITING.set(None if wire is None else (wire, first))
    try:
        yield
    finally:
        _WRITING.reset(token)


def payload_slot(index: int, shape: tuple[int, ...], dtype: torch.dtype) -> Slot | None:
    """The slot of part ``index`` of the payload being encoded (:func:`writing_into`), where it is one
    contiguous run of ``shape``'s elements of ``dtype`` that its part may be written into as it is computed
    (one ``out=`` where a copy into the wire cost a call, and a new tensor often one more); ``None``
    elsewhere (no wire, a compiled encoding, a slot of rows for several ranks, another size or dtype)."""
    writing = _WRITING.get()
    if writing is None or torch.compiler.is_compiling():
        return None
    wire, first = writing
    return wire.slot(first + index, tuple(shape), dtype)


class Wire:
    """The buffers of one exchange of a bucket layout (see the module docstring)."""

    def __init__(self, layout: Sequence[PartLayout], name: str) -> None:
        self.layout = tuple(layout)
        self.name = name
        self.slots: list[torch.Tensor] = []
        """Where each part is written before the collective (flat, of its dtype)."""
        self.busy = False

    def load(self, parts: Sequence[torch.Tensor]) -> None:
        """Write ``parts`` (the payload parts of the exchange, in order) into their slots."""
        if len(parts) != len(self.layout):
            raise ValueError(
                f"{self.name}: the payload has {len(parts)} parts, but its payload_layout states "
                f"{len(self.layout)}; payload_layout must describe what compress_segments returns"
            )
        for index, part in enumerate(parts):
            if part is not self.slots[index]:
                self._load(index, self._checked(index, part))

    def slot(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> Slot | None:
        """:func:`payload_slot`'s slot ``index`` (views made once per shape); ``None`` where a part is not
        sent as it is (an allreduce's is divided as it is loaded)."""
        return None

    def divisor(self, index: int) -> torch.Tensor | None:
        """What part ``index`` is divided by as it is written into its slot (``None``: nothing)."""
        return None

    def _checked(self, index: int, part: torch.Tensor) -> torch.Tensor:
        numel, dtype = self.layout[index]
        if part.numel() != numel or part.dtype != dtype:
            raise ValueError(
                f"{self.name}: payload part {index} is {part.numel()} elements of {part.dtype}, but its "
                f"payload_layout states {numel} of {dtype}; payload_layout must describe what "
                "compress_segments returns"
            )
        return part if part.dim() == 1 else part.reshape(-1)

    def _load(self, index: int, part: torch.Tensor) -> None:
        raise NotImplementedError


class RowWire(Wire):
    """Buffers of rows of bytes: each payload part cut into ``send_rows`` equal rows, row ``j`` of every part
    back to back in row ``j`` of the send buffer (as :func:`~gradcomm.compression.communicators._pack_rows`
    packs them), and ``receive_rows`` such rows received. :attr:`received`: each part as a ``(receive_rows,
    elements per row)`` tensor; with ``flat``, as one contiguous flat tensor instead (copied out of the
    receive buffer where its rows are not contiguous)."""

    def __init__(
        self,
        layout: Sequence[PartLayout],
        send_rows: int,
        receive_rows: int,
        device: torch.device,
        name: str,
        flat: bool = False,
    ) -> None:
        super().__init__(layout, name)
        offsets, total = [], 0
        for numel, dtype in self.layout:
            offsets.append(total)
            total += numel // send_rows * _itemsize(dtype)
        self.send = torch.empty(send_rows * total, dtype=torch.uint8, device=device)
        self.receive = torch.empty(receive_rows * total, dtype=torch.uint8, device=device)
        self._byte_slots: list[torch.Tensor | None] = []
        self.received: list[torch.Tensor] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for (numel, dtype), offset in zip(self.layout, offsets, strict=True):
            size = _itemsize(dtype)
            width = numel // send_rows
            shape = (receive_rows * width,) if flat else (receive_rows, width)
            if width == 0:  # nothing to view: an empty part stands alone
                self.slots.append(torch.empty(numel, dtype=dtype, device=device))
                self._byte_slots.append(None)
                self.received.append(torch.empty(shape, dtype=dtype, device=device))
                continue
            aligned = offset % size == 0 and (send_rows == 1 or total % size == 0)
            byte_slot = _columns(self.send, send_rows, total, offset, width * size)
            slot = byte_slot.view(dtype) if aligned else torch.empty((send_rows, width), dtype=dtype, device=device)
            self.slots.append(slot.view(-1) if send_rows == 1 else slot)
            self._byte_slots.append(None if aligned else byte_slot)
            source = _columns(self.receive, receive_rows, total, offset, width * size)
            readable = offset % size == 0 and (receive_rows == 1 or total % size == 0)
            if readable and (not flat or receive_rows == 1):
                self.received.append(source.view(dtype).view(shape))
            else:  # copied out to where its dtype can view it, contiguous
                target = torch.empty(shape, dtype=dtype, device=device)
                self._copies.append((target.view(receive_rows, -1).view(torch.uint8), source))
                self.received.append(target)
        self._send_rows = send_rows

    def _load(self, index: int, part: torch.Tensor) -> None:
        slot, byte_slot = self.slots[index], self._byte_slots[index]
        if slot.dim() == 2:
            part = part.view(slot.shape)
        if byte_slot is None:
            slot.copy_(part)
        else:
            slot.copy_(part)
            byte_slot.copy_(slot.view(self._send_rows, -1).view(torch.uint8))

    def load(self, parts: Sequence[torch.Tensor]) -> None:
        super().load(parts)
        for index, byte_slot in enumerate(self._byte_slots):  # a part the hook wrote into a detached slot
            if byte_slot is not None and parts[index] is self.slots[index]:
                byte_slot.copy_(self.slots[index].view(self._send_rows, -1).view(torch.uint8))

    def slot(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> Slot | None:
        if index >= len(self.slots):
            return None
        numel, part_dtype = self.layout[index]
        flat = self.slots[index]
        if part_dtype != dtype or math.prod(shape) != numel or flat.dim() != 1 or not flat.is_contiguous():
            return None
        cache = self.__dict__.setdefault("_slots", {})
        if (index, shape) not in cache:
            cache[index, shape] = Slot(flat if shape == (numel,) else flat.view(shape), flat)
        return cache[index, shape]

    def rows(self, index: int) -> tuple[torch.Tensor, ...]:
        """Part ``index`` as received, one tensor per row (made once)."""
        cache = self.__dict__.setdefault("_rows", {})
        if index not in cache:
            cache[index] = self.received[index].unbind(0)
        return cache[index]

    def unpack(self) -> list[torch.Tensor]:
        """Each part as received (after the collective into :attr:`receive`)."""
        for target, source in self._copies:
            target.copy_(source)
        return self.received


class GatherWire(RowWire):
    """An all-gather's buffers: one send row of the parts' bytes back to back, ``world_size`` rows received;
    :attr:`received`: each part as a ``(world_size, elements)`` tensor."""

    def __init__(self, layout: Sequence[PartLayout], world_size: int, device: torch.device, name: str) -> None:
        super().__init__(layout, 1, world_size, device, name)


class TwoStageWire(Wire):
    """A two-stage allreduce's buffers: stage 1's all-to-all of every part's ``world_size`` rows (received flat,
    one row from each rank), stage 2's all-gather of the recompressed row (received flat)."""

    def __init__(
        self,
        layout: Sequence[PartLayout],
        row_layout: Sequence[PartLayout],
        world_size: int,
        device: torch.device,
        name: str,
    ) -> None:
        super().__init__(layout, name)
        self.scatter = RowWire(layout, world_size, world_size, device, name, flat=True)
        self.gather = RowWire(row_layout, 1, world_size, device, name, flat=True)
        self.slots = self.scatter.slots

    def load(self, parts: Sequence[torch.Tensor]) -> None:
        self.scatter.load(parts)

    def slot(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> Slot | None:
        return self.scatter.slot(index, shape, dtype)


class SumWire(Wire):
    """An allreduce's buffers: one flat buffer per dtype (in the order of their first part), each part's slot
    a piece of it; a part is divided by the world size into its slot, and the slots hold the sums after the
    allreduces, in place."""

    def __init__(self, layout: Sequence[PartLayout], world_size: int, device: torch.device, name: str) -> None:
        super().__init__(layout, name)
        for _, dtype in self.layout:
            if not dtype.is_floating_point:
                raise TypeError(f"Allreduce: payloads must be floating point, got {dtype}")
        by_dtype: dict[torch.dtype, list[int]] = {}
        for index, (_, dtype) in enumerate(self.layout):
            by_dtype.setdefault(dtype, []).append(index)
        self.flats: list[torch.Tensor] = []
        self.slots = [torch.empty(0)] * len(self.layout)
        for dtype, indices in by_dtype.items():
            flat = torch.empty(sum(self.layout[i][0] for i in indices), dtype=dtype, device=device)
            self.flats.append(flat)
            for index, piece in zip(indices, flat.split([self.layout[i][0] for i in indices]), strict=True):
                self.slots[index] = piece
        self.divisors = {dtype: torch.tensor(world_size, dtype=dtype, device=device) for dtype in by_dtype}
        """The world size as a tensor of each dtype: a division by it is one call (a Python number is
        wrapped into a tensor first, four more) and gives the same bits."""

    def divisor(self, index: int) -> torch.Tensor:
        return self.divisors[self.layout[index][1]]

    def _load(self, index: int, part: torch.Tensor) -> None:
        torch.div(part, self.divisor(index), out=self.slots[index])


def _columns(buffer: torch.Tensor, rows: int, row_bytes: int, offset: int, nbytes: int) -> torch.Tensor:
    """Bytes ``[offset, offset + nbytes)`` of each of the ``rows`` rows of ``row_bytes`` bytes in the flat
    ``buffer``, as a ``(rows, nbytes)`` view. A single row is cut from the flat buffer, so that its row stride
    is ``nbytes`` and a wider dtype can view it: torch releases before 2.13 refuse ``view(dtype)`` of a row
    whose stride (the whole row's bytes) the dtype's size does not divide, even where there is one row."""
    if rows == 1:
        return buffer[offset : offset + nbytes].view(1, nbytes)
    return buffer.view(rows, row_bytes)[:, offset : offset + nbytes]
