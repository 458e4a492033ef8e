"""A segmented bucket cut into one row per rank, for the two-stage compressed allreduce."""

from __future__ import annotations

import torch

from gradcomm.compression.segments import Segments

__all__ = ["RowLayout"]


class RowLayout:
    """A bucket of segments cut for a two-stage exchange over ``world_size`` ranks: each tensor zero padded to
    ``world_size`` chunks of ``chunks[s]`` elements, and row ``j`` (sent to rank ``j``) holding chunk ``j`` of
    every tensor, back to back. ``rows``: the ``world_size`` rows as segments (one per chunk); ``row``: one
    row's segments, keyed and shaped as the server residuals, ``(1, chunk)`` per parameter."""

    def __init__(self, segments: Segments, world_size: int):
        device = segments.device
        self.segments = segments
        self.world_size = world_size
        self.chunks = tuple(-(-n // world_size) for n in segments.lengths)
        width = sum(self.chunks)
        self.row = Segments(
            self.chunks, segments.keys, tuple(torch.Size([1, c]) for c in self.chunks), segments.dtype, device
        )
        self.rows = Segments(
            self.chunks * world_size,
            tuple((key, j) for j in range(world_size) for key in segments.keys),
            tuple(torch.Size([c]) for c in self.chunks) * world_size,
            segments.dtype,
            device,
        )
        ranks = torch.arange(world_size, device=device).unsqueeze(1)
        to_rows, from_rows, row_start = [], [], 0
        for start, length, chunk in zip(segments.starts, segments.lengths, self.chunks, strict=True):
            place = ranks * chunk + torch.arange(chunk, device=device)  # (world_size, chunk): place in the tensor
            to_rows.append(torch.where(place < length, place + start, segments.numel))  # padding: a zero
            within = torch.arange(length, device=device)
            from_rows.append((within // chunk) * width + row_start + within % chunk)
            row_start += chunk
        self.to_rows = torch.cat(to_rows, dim=1).reshape(-1)
        self.from_rows = torch.cat(from_rows)

    def cut(self, flat: torch.Tensor) -> torch.Tensor:
        """The rows of ``flat``, flat (``world_size`` rows back to back); on one rank, ``flat`` itself."""
        if self.world_size == 1:
            return flat
        return torch.cat([flat, flat.new_zeros(1)]).index_select(0, self.to_rows)

    def join(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse of :meth:`cut`: the bucket's elements of rows, without the padding; ``out``: a flat tensor
        of the bucket's elements and dtype they may be written into (a workspace used every step, where a
        new tensor's pages are new every step), else a new one."""
        if self.world_size == 1:
            return rows if rows.dim() == 1 else rows.reshape(-1)
        flat = rows.reshape(-1)
        usable = out is not None and out.dim() == 1 and out.is_contiguous() and out.dtype == rows.dtype
        if usable and out.numel() == self.segments.numel and out.data_ptr() != flat.data_ptr():
            return torch.index_select(flat, 0, self.from_rows, out=out)
        return flat.index_select(0, self.from_rows)

    @staticmethod
    def of(segments: Segments, world_size: int) -> RowLayout:
        cache = segments.__dict__.setdefault("_row_layouts", {})
        if world_size not in cache:
            cache[world_size] = RowLayout(segments, world_size)
        return cache[world_size]
