"""How the compression hook lays out one bucket: which of its gradients are compressed and which go dense
(:class:`_Plan`, made once per bucket layout), how each part is copied out of the bucket and written back
(:class:`_Part`: a slice where contiguous, else one concatenation of its runs out, and strided groups of runs
or one index back in), and the buffers a
layout reuses every step (:class:`_Workspace`: the compressed part's copy, the decoded mean and one
:class:`~gradcomm.compression.wire.Wire` per communicator), so that a step makes no new bucket-sized tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gradcomm.compression._numerics import ordered_mean
from gradcomm.compression.communicators import Communicator
from gradcomm.compression.methods.identity import NoCompression
from gradcomm.compression.segments import Segments, _arithmetic_runs
from gradcomm.compression.wire import GatherWire
from gradcomm.hooks.parameter_keys import Key

if TYPE_CHECKING:
    from gradcomm.hooks.compression_hook import CompressionState

_DENSE = NoCompression()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


_MAX_GROUPS = 8
"""A part of a bucket in at most this many strided groups of runs is written back group by group (memory
speed, a call per group); in more, by one scatter with an index (a call, but several times slower per element
than a copy on the CPU: torch has no scatter of runs at memory speed). Copying a part out is one
concatenation of its runs, whatever their number."""

_SMALL_PART = 1 << 16
"""A part of at most this many elements in more groups than one is written back by one scatter with an index:
its index costs less than a call per group (a bucket's biases and norms, between its weights)."""

_GRAIN_SIZE = 32768
"""torch's ``at::internal::GRAIN_SIZE``: a CPU concatenation of fewer elements, or on one thread, runs its serial
kernel (one call); of more on several threads, it narrows its output once per input (three calls each)."""

_KEPT_PIECES = 4
"""How many tensors' pieces a :class:`_Part` keeps (its workspace, a residual, a wire's slot)."""


def _concatenated_in_one_call(into: torch.Tensor) -> bool:
    """Whether ``torch.cat(..., out=into)`` of contiguous runs is one call: on a GPU (one kernel per batch of
    runs), or on the CPU where it runs its serial kernel (see :data:`_GRAIN_SIZE`; floating values)."""
    if into.device.type == "cuda":
        return True
    return (
        into.device.type == "cpu"
        and into.is_floating_point()
        and (into.numel() < _GRAIN_SIZE or torch.get_num_threads() == 1)
    )


def _same_memory(kept: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``values`` is the tensor ``kept`` (held, so its memory is no other storage's) in another
    object: the same elements of the same storage."""
    return (
        values.data_ptr() == kept.data_ptr()
        and values.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr()
        and values.dtype == kept.dtype
        and values.shape == kept.shape
        and values.stride() == kept.stride()
    )


@dataclass(frozen=True, eq=False)
class _Part:
    """Some gradients of a bucket, as one flat tensor: where they lie in the bucket's buffer.

    The gradients' contiguous runs in the buffer are grouped into runs of one length at one stride (a layer
    repeated in every block, a weight between two biases): each group is one strided view of the buffer, so
    the part is written back in a call per group (or one scatter), whatever the number of gradients; it is
    copied out in one call, a concatenation of its runs' views (made once per buffer). The part's segments
    follow the groups' order (not necessarily the bucket's)."""

    segments: Segments
    groups: tuple[tuple[int, int, int, int], ...]
    """``(count, length, stride, start)`` of each group of runs."""
    index: torch.Tensor | None
    """Each element's place in the buffer, where there are more than :data:`_MAX_GROUPS` groups, or more than
    one and at most :data:`_SMALL_PART` elements: to write the part back (and add it to a residual)."""
    _kept: list[tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=list, repr=False)
    """The pieces of tensors used every step (most recent first), made once."""
    _buffer_views: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = field(
        default_factory=list, repr=False
    )
    """The bucket's buffer last seen, its groups' views and its runs' views."""
    _last_put: list[tuple[StorageWeakRef, int]] = field(default_factory=list, repr=False)
    """Where the values last written back lay (their storage, held weakly, and address): values written back
    from the same place twice are a workspace of the caller's, whose pieces are then kept."""

    @classmethod
    def of(cls, positions: list[int], keys: Sequence[Key], shapes: Sequence[torch.Size], buffer: torch.Tensor) -> _Part:
        lengths = [shape.numel() for shape in shapes]
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        runs: list[list[int]] = []  # the positions of each contiguous run
        for i in positions:
            if runs and starts[runs[-1][-1]] + lengths[runs[-1][-1]] == starts[i]:
                runs[-1].append(i)
            else:
                runs.append([i])
        run_starts = [starts[run[0]] for run in runs]
        run_lengths = [sum(lengths[i] for i in run) for run in runs]
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for r, run in enumerate(runs):
            by_shape.setdefault(tuple(lengths[i] for i in run), []).append(r)
        groups, order = [], []
        for members in by_shape.values():
            for group, stride in _arithmetic_runs(members, run_starts, run_lengths[members[0]]):
                groups.append((len(group), run_lengths[group[0]], stride, run_starts[group[0]]))
                order.extend(i for r in group for i in runs[r])
        segments = Segments(
            tuple(lengths[i] for i in order),
            tuple(keys[i] for i in order),
            tuple(shapes[i] for i in order),
            buffer.dtype,
            buffer.device,
        )
        index = None
        if len(groups) > _MAX_GROUPS or (len(groups) > 1 and segments.numel <= _SMALL_PART):
            index = torch.cat([torch.arange(starts[i], starts[i] + lengths[i], device=buffer.device) for i in order])
        return cls(segments, tuple(groups), index)

    @property
    def span(self) -> tuple[int, int] | None:
        if len(self.groups) == 1 and self.groups[0][0] == 1:
            _, length, _, start = self.groups[0]
            return start, start + length
        return None

    def _views(self, buffer: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each group's strided view of the bucket's ``buffer`` and each run's flat one, in the part's order,
        kept for the buffer last seen (a bucket's buffer is the same tensor every step)."""
        if self._buffer_views:
            seen, views, runs = self._buffer_views[0]
            start = self.groups[0][3]
            if seen is buffer and views[0].data_ptr() == buffer.data_ptr() + start * buffer.element_size():
                return views, runs
        offset = buffer.storage_offset()
        views = [
            buffer.as_strided((count, length), (stride, 1), offset + start)
            for count, length, stride, start in self.groups
        ]
        runs = [
            buffer.as_strided((length,), (1,), offset + start + k * stride)
            for count, length, stride, start in self.groups
            for k in range(count)
        ]
        self._buffer_views[:] = [(buffer, views, runs)]
        return views, runs

    def release(self) -> None:
        """Drop the views kept (and so the tensors they hold)."""
        self._kept.clear()
        self._buffer_views.clear()
        self._last_put.clear()

    def pieces(self, values: torch.Tensor, keep: bool = False) -> list[torch.Tensor]:
        """Flat ``values`` (laid out as the part's segments) as one ``(count, length)`` view per group, to
        copy to or from the buffer's views. ``keep``: ``values`` is used every step (a workspace, a residual,
        a wire's slot), so its pieces are made once and kept."""
        for tensor, pieces in self._kept:
            if tensor is values or _same_memory(tensor, values):
                return pieces
        if values.is_contiguous():  # one call per group
            pieces, offset = [], values.storage_offset()
            for count, length, _, _ in self.groups:
                pieces.append(values.as_strided((count, length), (length, 1), offset))
                offset += count * length
        else:
            flats = [values] if len(self.groups) == 1 else values.split([c * n for c, n, _, _ in self.groups])
            pieces = [flat.reshape(c, n) for flat, (c, n, _, _) in zip(flats, self.groups, strict=True)]
        if keep:
            self._kept.insert(0, (values, pieces))
            del self._kept[_KEPT_PIECES:]
        return pieces

    def take(self, buffer: torch.Tensor, into: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """The part's values, and whether they are a copy (else a view of the buffer): copied into ``into``
        (a workspace, flat) where given, else into a new tensor."""
        span = self.span
        if span is not None:
            return buffer[span[0] : span[1]], False
        if into is None:
            into = buffer.new_empty(self.segments.numel)
            self.write_into(buffer, into, keep=False)
        else:
            self.write_into(buffer, into)
        return into, True

    def write_into(
        self, buffer: torch.Tensor, into: torch.Tensor, divisor: torch.Tensor | None = None, keep: bool = True
    ) -> None:
        """Copy the part's values into flat ``into`` (divided by ``divisor`` where given): one concatenation
        of the runs' views, at memory speed (where a gather by index is several times slower per element,
        and a copy per group costs a call each), then one division in place. Group by group in one pass
        instead where that is fewer calls (several CPU threads, see :data:`_GRAIN_SIZE`; one group, divided)
        or ``into`` has another dtype (divided before it is rounded to it). ``keep``: ``into`` is used
        every step (see :meth:`pieces`)."""
        grouped = not _concatenated_in_one_call(into) or into.dtype != buffer.dtype
        if grouped or (divisor is not None and len(self.groups) == 1):
            for view, piece in zip(self._views(buffer)[0], self.pieces(into, keep), strict=True):
                if divisor is None:
                    piece.copy_(view)
                else:
                    torch.div(view, divisor, out=piece)
            return
        torch.cat(self._views(buffer)[1], out=into)
        if divisor is not None:
            into.div_(divisor)

    def add_into(self, values: torch.Tensor, buffer: torch.Tensor) -> None:
        """Add the part's values in ``buffer`` to the flat ``values`` (laid out as the part's segments; a
        residual, the same every step)."""
        if self.index is not None:
            values.add_(buffer.index_select(0, self.index))
            return
        for view, piece in zip(self._views(buffer)[0], self.pieces(values, keep=True), strict=True):
            piece.add_(view)

    def put(self, buffer: torch.Tensor, values: torch.Tensor, keep: bool = False) -> None:
        """Write flat ``values`` (laid out as the part's segments) into the part's place in ``buffer``;
        ``keep``: as for :meth:`pieces`."""
        values = values if values.dtype == buffer.dtype else values.to(buffer.dtype)
        span = self.span
        if span is not None:
            if values.data_ptr() != buffer.data_ptr() + span[0] * buffer.element_size():
                buffer[span[0] : span[1]].copy_(values)
        elif self.index is not None:
            buffer.scatter_(0, self.index, values)  # a call fewer than index_copy_, and faster on the CPU
        else:
            keep = keep or self._put_again(values)
            for view, piece in zip(self._views(buffer)[0], self.pieces(values, keep), strict=True):
                view.copy_(piece)

    def _put_again(self, values: torch.Tensor) -> bool:
        """Whether ``values`` lie where the values last written back lay, their memory held since (a
        caller's workspace, in a new tensor object every step: its pieces are worth keeping); where a new
        tensor is written back every step, nothing is kept, so nothing holds its memory."""
        place = (StorageWeakRef(values.untyped_storage()), values.data_ptr())
        last = self._last_put[0] if self._last_put else None
        self._last_put[:] = [place]
        return last is not None and not last[0].expired() and last[0] == place[0] and last[1] == place[1]


@dataclass(frozen=True, eq=False)
class _Plan:
    """A bucket layout's compressed part and dense part (either may be absent), and its workspaces."""

    keys: tuple[Key, ...]
    shapes: tuple[torch.Size, ...]
    compressed: _Part | None
    dense: _Part | None
    workspaces: dict[int, _Workspace] = field(default_factory=dict, repr=False)
    """By world size."""

    @classmethod
    def of(cls, state: CompressionState, keys: Sequence[Key], shapes: tuple[torch.Size, ...], buffer: torch.Tensor) -> _Plan:
        flags = [state._compresses(shape, buffer.dtype) for shape in shapes]
        parts = []
        for wanted in (True, False):
            positions = [i for i, flag in enumerate(flags) if flag == wanted]
            parts.append(_Part.of(positions, keys, shapes, buffer) if positions else None)
        return cls(tuple(keys), shapes, parts[0], parts[1])

    def release(self) -> None:
        """Drop the workspaces and the views kept: the layout was not used in the last iteration (DDP rebuilt
        its buckets)."""
        self.workspaces.clear()
        for part in (self.compressed, self.dense):
            if part is not None:
                part.release()

    def workspace(self, state: CompressionState, world_size: int) -> _Workspace:
        """This layout's workspace, marked busy; a new one, not kept, where it is busy (an exchange of this
        layout that is not yet assembled: a caller that did not wait for the last call's future)."""
        work = self.workspaces.get(world_size)
        if work is None:
            work = self.workspaces[world_size] = _Workspace(self, state, world_size)
        elif work.busy:
            work = _Workspace(self, state, world_size)
        work.busy = True
        return work


class _Workspace:
    """A bucket layout's buffers, made once (a step then makes no bucket-sized tensor of its own, and the pages
    of the ones it reuses are already there): the compressed part's copy, where it is strided in the bucket
    and no residual takes its place (:attr:`values`); where its mean is decoded (:attr:`decoded`:
    ``values`` itself, which nothing reads once encoded, or, with error feedback, a buffer of its own); each
    communicator's wire (:mod:`gradcomm.compression.wire`). Nothing in it is handed to DDP: the hook writes
    every mean into the bucket, and returns the bucket. One exchange at a time uses it (:attr:`busy`)."""

    def __init__(self, plan: _Plan, state: CompressionState, world_size: int) -> None:
        compressor = state.compressor
        self.busy = False
        self.values: torch.Tensor | None = None
        self.decoded: torch.Tensor | None = None
        compressed = plan.compressed
        if compressed is not None and compressed.span is None:
            segments = compressed.segments
            self.decoded = torch.empty(segments.numel, dtype=segments.dtype, device=segments.device)
            if not state.memory.enabled:  # else the residual takes the values' place (or keeps their copy)
                self.values = self.decoded
        method = compressor.communicator
        layouts: dict[Communicator, list[tuple[int, torch.dtype]]] = {}
        if plan.dense is not None:
            segments = plan.dense.segments
            self.dense_communicator = method if method.carries_dense(world_size) else _DENSE.communicator
            layouts.setdefault(self.dense_communicator, []).append((segments.numel, segments.dtype))
        self.compressed_first = 0
        """The compressed payload's first part in its communicator's wire (after a dense part it carries)."""
        if compressed is not None:
            segments = compressed.segments
            parts = method.payload_layout(compressor, segments, world_size)
            self.compressed_first = len(layouts.get(method, ()))
            layouts.setdefault(method, []).extend(parts)
        name = compressor.name or type(compressor).__name__
        device = (compressed or plan.dense).segments.device  # type: ignore[union-attr]
        self.wires = {
            communicator: communicator.wire(layout, world_size, device, name) for communicator, layout in layouts.items()
        }
        self.dense_codec: Any = _DENSE
        self.dense_mean: torch.Tensor | None = None
        """The tensor the dense part's mean will be, where it is the same every step."""
        wire = self.wires.get(self.dense_communicator) if plan.dense is not None else None
        if isinstance(wire, GatherWire):
            rows = wire.rows(0)
            self.dense_codec = _RowsMean(rows, None if len(rows) == 1 else torch.empty_like(rows[0]))
            self.dense_mean = self.dense_codec.out if self.dense_codec.out is not None else rows[0]
        elif wire is not None:
            self.dense_mean = wire.slots[0]


@dataclass(frozen=True, eq=False)
class _RowsMean:
    """The dense part's codec on a wired all-gather: the mean of the ranks' rows (views made once, summed in
    rank order into :attr:`out`; on one rank, its row itself)."""

    rows: tuple[torch.Tensor, ...]
    out: torch.Tensor | None

    def aggregate(self, gathered: list[torch.Tensor], ctx: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        return ordered_mean(self.rows, len(self.rows), self.out)
