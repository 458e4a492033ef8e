"""The compressor interface: what a gradient compression method implements.

A method is one small class with two halves of a codec, ``compress(tensor) -> (payload, ctx)`` and
``decompress(payload, ctx) -> tensor``. The payload is a list of tensors, the only thing sent; ``ctx``
stays on the rank (shape, dtype, indices drawn from a shared seed). The class also declares

* ``communicator``: how payloads travel (:mod:`gradcomm.compression.communicators`): summed by an allreduce,
  all-gathered and aggregated on every rank, or a method-specific exchange;
* ``error_feedback``: whether the method needs, benefits from, tolerates or forbids error feedback
  (:mod:`gradcomm.compression.memory`), which the hook applies around it.

A payload's tensor shapes and dtypes must depend only on the input's shape and dtype, never on its values:
ranks exchange payloads of equal size without first agreeing on it.

A method may instead work on a whole bucket at once (:class:`SegmentedCompressor`): the bucket's compressed
tensors back to back, with their lengths and keys (:class:`~gradcomm.compression.segments.Segments`), each
still with its own statistics. The hook then encodes, exchanges and decodes a bucket in a number of torch
calls that does not grow with its number of tensors; ``compress``/``decompress`` of one tensor are derived
from the segmented form (a bucket of one), so both give the same payloads.
"""

from __future__ import annotations

import array
import contextlib
import contextvars
import enum
import functools
import hashlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from gradcomm.compression._numerics.reductions import add_rows_in_order, ordered_mean
from gradcomm.compression.segment_noise import seed_of
from gradcomm.compression.segments import Segments

if TYPE_CHECKING:
    from gradcomm.compression.communicators import Communicator

__all__ = [
    "Compressor",
    "ErrorFeedback",
    "OwnDecoding",
    "Payload",
    "RandomizedCompressor",
    "RowwiseCompressor",
    "SegmentedCompressor",
    "SegmentedRowwiseCompressor",
    "TensorSpec",
]

Payload = list[torch.Tensor]

_STREAM_KEY: contextvars.ContextVar[Hashable] = contextvars.ContextVar("gradcomm_compression_stream", default=None)


@contextlib.contextmanager
def tensor_stream(key: Hashable) -> Iterator[None]:
    """Scope in which a compressor's per-tensor state (its random draws, DGC's buffers, SparseLoCo's
    accumulator) is that of the tensor ``key``: a context variable, so each thread sees its own."""
    token = _STREAM_KEY.set(key)
    try:
        yield
    finally:
        _STREAM_KEY.reset(token)
"""The key of the tensor being compressed on this thread: a second stage may compress on a backend thread
while the hook's thread compresses the next bucket."""


class ErrorFeedback(enum.Enum):
    """A method's relation to error feedback; :meth:`resolve` turns a user's choice into on/off."""

    RECOMMENDED = "recommended"
    """Biased (sparsifiers, deterministic quantizers): on unless switched off."""
    OPTIONAL = "optional"
    """Unbiased (stochastic quantizers): off unless switched on."""
    REQUIRED = "required"
    """Diverges without it (scaled signs): always on."""
    UNSUPPORTED = "unsupported"
    """The aggregate is not the sum of what ranks sent (majority vote): a residual would be meaningless."""

    def resolve(self, requested: bool | None, method: str) -> bool:
        """Whether error feedback is on, given the hook's ``error_feedback`` (``None``: the default)."""
        if requested is None:
            return self in (ErrorFeedback.RECOMMENDED, ErrorFeedback.REQUIRED)
        if self is ErrorFeedback.REQUIRED and not requested:
            raise ValueError(f"{method} requires error feedback; pass error_feedback=True or leave it unset")
        if self is ErrorFeedback.UNSUPPORTED and requested:
            raise ValueError(
                f"{method} does not support error feedback; pass error_feedback=False or leave it unset"
            )
        return requested


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a compressed tensor, kept in ``ctx`` to restore it."""

    shape: torch.Size
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tensor.shape, tensor.dtype)

    @property
    def numel(self) -> int:
        return self.shape.numel()


def _ignoring_out(
    decoder: Callable[[Compressor, Payload, Any], torch.Tensor],
) -> Callable[..., torch.Tensor]:
    """A ``decompress`` or ``aggregate`` written without the ``out`` argument, accepting and ignoring it: its
    result is a new tensor, which the hook copies into the bucket."""

    @functools.wraps(decoder)
    def accepting_out(
        self: Compressor, payload: Payload, ctx: Any, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return decoder(self, payload, ctx)

    return accepting_out


class Compressor(ABC):
    """A gradient compression method (see the module docstring).

    A method registers itself under a name by its class keywords, which makes it a communication hook of
    the registry (``register_comm_hook_by_name(ddp, "topk", ratio=0.01)``, ``gradcomm bench --hooks topk``)
    whose options are its constructor's parameters::

        class TopK(Compressor, name="topk", summary="top-k sparsification, error feedback"):
            def __init__(self, ratio: float = 0.01): ...

    Base classes and helpers (:class:`NoCompression`) leave ``name`` out and are not registered.
    """

    communicator: ClassVar[Communicator]
    error_feedback: ErrorFeedback = ErrorFeedback.RECOMMENDED
    elementwise: ClassVar[bool] = False
    """Whether each element is encoded and decoded on its own (no statistic over a tensor, no random draws):
    then a concatenation of tensors decodes to the concatenation of their results, bit for bit, and the
    hook sends a bucket's tensors as one (where no error feedback keeps a residual per parameter)."""
    name: ClassVar[str | None] = None
    """The registry name of a registered method; ``None`` otherwise."""
    summary: ClassVar[str] = ""
    """One line for help texts."""

    def __init_subclass__(cls, *, name: str | None = None, summary: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = name
        cls.summary = summary
        for decoder in ("decompress", "aggregate"):
            function = cls.__dict__.get(decoder)
            if function is not None and "out" not in inspect.signature(function).parameters:
                setattr(cls, decoder, _ignoring_out(function))
        if name is not None:
            from gradcomm.compression.registry import register

            register(cls)

    segmented: ClassVar[bool] = False
    """Whether the method encodes a whole bucket at once (:class:`SegmentedCompressor`)."""

    @abstractmethod
    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Any]:
        """Encode ``tensor``; the payload is what is sent, ``ctx`` what :meth:`decompress` needs locally."""

    @abstractmethod
    def decompress(self, payload: Payload, ctx: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """A tensor of the original shape and dtype from a payload (or, for allreduce, a sum of payloads).

        ``out``, as for :meth:`aggregate`: where the result may be written. A method that cannot use it may
        leave it out of its signature (it is then accepted and ignored for it); random-k uses it."""

    def residual(self, corrected: torch.Tensor, payload: Payload, ctx: Any) -> torch.Tensor:
        """What error feedback keeps after ``corrected`` was compressed to ``payload``: ``corrected -
        decompress(payload, ctx)``.

        ``corrected`` is the caller's to overwrite (never a gradient itself), once ``payload`` no longer
        needs it: a method that sends some coordinates exactly and nothing of the rest (top-k, random-k
        without rescaling) overrides this to zero the sent coordinates of ``corrected`` in place, the same
        values for finite inputs without a dense decompression and subtraction.
        """
        return corrected - self.decompress(payload, ctx)

    def aggregate(self, gathered: Payload, ctx: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """The mean over ranks of decompressed payloads; each tensor of ``gathered`` has a leading rank axis.

        Ranks are summed in rank order so that every rank computes bit-identical results. ``out``, when given,
        is a tensor shaped and typed like the original (the gradient's place in its bucket) that the method may
        write the mean into and return, rather than a new tensor for the caller to copy there (sparse methods
        do: they zero it and add their few values); a method is free to ignore it, or to leave it out of its
        signature.
        """
        world_size = gathered[0].shape[0]
        return ordered_mean(
            (self.decompress([part[rank] for part in gathered], ctx) for rank in range(world_size)),
            world_size,
            out,
        )

    def stream(self, key: Hashable) -> contextlib.AbstractContextManager[None]:
        """Scope for compressing the tensor identified by ``key`` (see :class:`RandomizedCompressor`)."""
        return contextlib.nullcontext()

    def payload_layout(self, lengths: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        """The payload of tensors of ``lengths`` elements and ``dtype``: ``(elements, dtype)`` per payload
        tensor. The hook decides from it which tensors are worth compressing. By default, for one tensor,
        from compressing a tensor of the meta device (a :class:`SegmentedCompressor` states it instead)."""
        [numel] = lengths
        payload, _ = self.compress(torch.empty(numel, dtype=dtype, device="meta"))
        return [(part.numel(), part.dtype) for part in payload]

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint with the hook's (tensors and plain values only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, but was given {sorted(state)}")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


@dataclass(eq=False)
class OwnDecoding:
    """``ctx`` of a segmented encoding that can keep this rank's own payload decoded, where error feedback
    computed it (``decompress_segments`` of the payload, the same bits): on one rank the mean over ranks is
    that decoding, and the exchange's decoding of the same payload is skipped. ``state``: what else the
    method's decoding of its own payload needs (its signs as computed, say)."""

    state: Any = None
    decoded: torch.Tensor | None = None


@dataclass(frozen=True)
class _OneTensor:
    """``ctx`` of one tensor compressed by a :class:`SegmentedCompressor`: its own ``ctx`` and layout."""

    ctx: Any
    segments: Segments


WORLD_BATCH = 8
"""Ranks whose payloads :meth:`SegmentedCompressor.aggregate_segments` decodes at once: its calls are flat in
the world size up to this many ranks, and its memory at most this many decodings of the bucket."""


def _shares_storage(tensor: torch.Tensor, parts: Payload) -> bool:
    """Whether ``tensor`` lies in the memory of one of ``parts`` (a decoding that is its payload's view)."""
    pointer = tensor.untyped_storage().data_ptr()
    return any(part.untyped_storage().data_ptr() == pointer for part in parts)


def _flat_out(out: torch.Tensor | None, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    usable = out is not None and out.is_contiguous() and out.numel() == numel and out.dtype == dtype
    return out.view(-1) if usable else None


class SegmentedCompressor(Compressor):
    """A method written for a whole bucket: a flat tensor holding several tensors back to back, with their
    layout (:class:`~gradcomm.compression.segments.Segments`: lengths, keys, shapes).

    Subclasses implement :meth:`compress_segments`, :meth:`decompress_segments` and :meth:`payload_layout`
    (and :meth:`aggregate_segments`, :meth:`residual_segments` where they can do better than the defaults);
    per-tensor statistics come from segmented operations (:mod:`gradcomm.compression.segments`), so that the
    number of torch calls does not depend on the number of segments. ``compress``/``decompress`` of a single
    tensor are the segmented form on a bucket of one tensor, keyed by the current :meth:`stream`'s key.
    """

    segmented = True

    @abstractmethod
    def compress_segments(self, flat: torch.Tensor, segments: Segments) -> tuple[Payload, Any]:
        """Encode every segment of ``flat``; the payload is what is sent, ``ctx`` what decoding needs."""

    @abstractmethod
    def decompress_segments(
        self, payload: Payload, ctx: Any, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The flat tensor of every segment decoded (or, for allreduce, of a sum of payloads); ``out``: a flat
        tensor of ``segments.numel`` elements it may be written into. Parts with a leading rank axis: see
        :attr:`world_decoding`."""

    @abstractmethod
    def payload_layout(self, lengths: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        """``(elements, dtype)`` of each payload tensor of a bucket of segments of ``lengths`` elements."""

    world_decoding: ClassVar[bool] = False
    """Whether :meth:`decompress_segments` also decodes parts with a leading rank axis (``(world, elements)``)
    into ``(world, numel)``, row ``r`` rank ``r``'s decoding bit for bit (as ``decode_segments`` does), so that
    :meth:`aggregate_segments`' calls do not grow with the world size (up to :data:`WORLD_BATCH` ranks).
    ``False`` (the default, which any decoder meets): payloads are decoded rank by rank."""

    def aggregate_segments(
        self, gathered: Payload, ctx: Any, segments: Segments, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The mean over ranks (leading axis of ``gathered``) of their decodings, in rank order: a batch of up to
        :data:`WORLD_BATCH` ranks at a time where :attr:`world_decoding` (:meth:`decompress_world`), else rank by
        rank. On one rank, this rank's own decoding where its encoding kept one (:class:`OwnDecoding`)."""
        world_size = gathered[0].shape[0]
        if world_size == 1:
            if isinstance(ctx, OwnDecoding) and ctx.decoded is not None:
                return ctx.decoded
            own = [part.view(-1) if part.is_contiguous() else part[0] for part in gathered]
            return self.decompress_segments(own, ctx, segments, out)
        if not self.world_decoding:
            return ordered_mean(
                (self.decompress_segments([p[rank] for p in gathered], ctx, segments) for rank in range(world_size)),
                world_size,
                out,
            )
        total = None
        for start in range(0, world_size, WORLD_BATCH):
            batch = [part[start : start + WORLD_BATCH] for part in gathered]
            decoded = self.decompress_world(batch, ctx, segments)
            total = add_rows_in_order(total, decoded, world_size, out, not _shares_storage(decoded, batch))
        assert total is not None
        return total

    def decompress_world(self, gathered: Payload, ctx: Any, segments: Segments) -> torch.Tensor:
        """Every rank's payload decoded (``gathered``: parts with a leading rank axis), ``(world, numel)``: by
        one :meth:`decompress_segments` where :attr:`world_decoding`, else rank by rank. The caller may
        overwrite it unless it is a view of a payload part (never a shared tensor, such as a cached table)."""
        world_size = gathered[0].shape[0]
        if not self.world_decoding:
            return torch.stack([self.decompress_segments([p[r] for p in gathered], ctx, segments) for r in range(world_size)])
        parts = [part if part.is_contiguous() else part.contiguous() for part in gathered]
        decoded = self.decompress_segments(parts, ctx, segments)
        if decoded.shape != (world_size, segments.numel):
            raise RuntimeError(
                f"{type(self).__name__}.decompress_segments decoded {world_size} ranks' payloads to a tensor of "
                f"shape {tuple(decoded.shape)}, not ({world_size}, {segments.numel}); decode a leading rank "
                "axis, or set world_decoding = False on the class to decode rank by rank"
            )
        return decoded

    def residual_segments(self, corrected: torch.Tensor, payload: Payload, ctx: Any, segments: Segments) -> torch.Tensor:
        """``corrected - decompress_segments(...)``, which may overwrite ``corrected`` (see :meth:`residual`)."""
        return corrected.sub_(self.decompress_own(payload, ctx, segments))

    def decompress_own(self, payload: Payload, ctx: Any, segments: Segments) -> torch.Tensor:
        """:meth:`decompress_segments` of the payload this rank's :meth:`compress_segments` just made, with its
        ``ctx`` (a method may decode it from what its encoding kept, the same values), kept in ``ctx`` where
        that is an :class:`OwnDecoding`."""
        decoded = self.decompress_segments(payload, ctx, segments)
        if isinstance(ctx, OwnDecoding):
            ctx.decoded = decoded
        return decoded

    # -- one tensor: a bucket of one segment --------------------------------------------------------------
    def compress(self, tensor: torch.Tensor) -> tuple[Payload, _OneTensor]:
        segments = Segments.of([tensor], [_STREAM_KEY.get()])
        payload, ctx = self.compress_segments(tensor.reshape(-1), segments)
        return payload, _OneTensor(ctx, segments)

    def decompress(self, payload: Payload, ctx: _OneTensor, out: torch.Tensor | None = None) -> torch.Tensor:
        segments = ctx.segments
        flat_out = _flat_out(out, segments.numel, segments.dtype)
        return self.decompress_segments(payload, ctx.ctx, segments, flat_out).view(segments.shapes[0])

    def aggregate(self, gathered: Payload, ctx: _OneTensor, out: torch.Tensor | None = None) -> torch.Tensor:
        segments = ctx.segments
        flat_out = _flat_out(out, segments.numel, segments.dtype)
        return self.aggregate_segments(gathered, ctx.ctx, segments, flat_out).view(segments.shapes[0])

    def residual(self, corrected: torch.Tensor, payload: Payload, ctx: _OneTensor) -> torch.Tensor:
        shape = corrected.shape
        flat = corrected.contiguous().view(-1)
        return self.residual_segments(flat, payload, ctx.ctx, ctx.segments).view(shape)


class RandomizedCompressor(Compressor):
    """A compressor drawing random numbers from its own generators, never from torch's global one.

    Draws are keyed: inside ``with compressor.stream(key)`` (the hook uses one key per parameter), the
    ``n``-th call of :meth:`generator` returns a generator seeded from ``(seed, rank, key, n)``. The numbers a
    tensor gets therefore do not depend on the order in which tensors are compressed (DDP reorders its
    buckets after the first iteration), and the state to checkpoint is one counter per key. With
    ``shared_randomness`` the rank is left out and every rank draws the same numbers (random-k's shared
    coordinates); otherwise rounding noise is independent across ranks and averages out.
    """

    shared_randomness: ClassVar[bool] = False

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._draws: dict[Hashable, int] = {}

    def stream(self, key: Hashable) -> contextlib.AbstractContextManager[None]:
        return tensor_stream(key)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A generator on ``device`` for the next draw of the current key (``None`` on the meta device)."""
        if device.type == "meta":
            return None
        key = _STREAM_KEY.get()
        count = self._draws.get(key, 0)
        self._draws[key] = count + 1
        rank = 0 if self.shared_randomness or not dist.is_initialized() else dist.get_rank()
        digest = hashlib.blake2b(repr((self.seed, rank, key, count)).encode(), digest_size=8).digest()
        return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)

    def segment_seeds(self, segments: Segments) -> torch.Tensor:
        """One 64-bit seed per segment for its next draw, from ``(seed, rank, key, count)`` as
        :meth:`generator` (for :func:`~gradcomm.compression.segments.segment_noise`): what a tensor draws
        depends on its key and count alone, whichever bucket it is in."""
        rank = 0 if self.shared_randomness or not dist.is_initialized() else dist.get_rank()
        seeds = []
        for key in segments.keys:
            count = self._draws.get(key, 0)
            self._draws[key] = count + 1
            digest = hashlib.blake2b(repr(("segments", self.seed, rank, key, count)).encode(), digest_size=8)
            seeds.append(seed_of(digest.digest()))
        return _int64_tensor(seeds, segments.device)

    def state_dict(self) -> dict[str, Any]:
        return {"draws": dict(self._draws)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._draws = dict(state["draws"])


def _int64_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``: on the CPU a view of their bytes (``frombuffer``, no torch
    call, where ``as_tensor`` of a list costs three), holding them."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    flat = torch.frombuffer(array.array("q", values), dtype=torch.int64)
    return flat if device.type == "cpu" else flat.to(device)


class RowwiseCompressor(Compressor):
    """A compressor with one scale (or range) per row of a matrix, for exchanges splitting tensors in chunks.

    Subclasses implement :meth:`compress_rows` and :meth:`decompress_rows`, whose payload tensors all have the
    row axis first so that rows can be sent to different ranks; ``compress`` treats a tensor as one row.
    """

    @abstractmethod
    def compress_rows(self, rows: torch.Tensor) -> tuple[Payload, Any]:
        """Encode each row of a 2-D tensor; every payload tensor has ``rows.shape[0]`` as first dimension."""

    @abstractmethod
    def decompress_rows(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """Decode rows (any number: payload rows may come from different ranks) to a 2-D tensor."""

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Any]:
        payload, ctx = self.compress_rows(tensor.reshape(1, -1))
        return payload, (ctx, tensor.shape)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        row_ctx, shape = ctx
        return self.decompress_rows(payload, row_ctx).reshape(shape)


def _row_segments(rows: int, length: int, dtype: torch.dtype, device: torch.device) -> Segments:
    return Segments((length,) * rows, (None,) * rows, (torch.Size([length]),) * rows, dtype, device)


class SegmentedRowwiseCompressor(RowwiseCompressor, SegmentedCompressor):
    """A row-wise method written in segmented form (one scale or range per segment): its rows are segments,
    and :class:`~gradcomm.compression.two_stage.TwoStageAllreduce` sends a whole bucket's chunks at once.
    Every payload tensor of a bucket of segments is the segments' parts back to back, so a bucket of rows of
    one layout splits into equal rows."""

    def compress_rows(self, rows: torch.Tensor) -> tuple[Payload, Any]:
        segments = _row_segments(rows.shape[0], rows.shape[1], rows.dtype, rows.device)
        payload, ctx = self.compress_segments(rows.reshape(-1), segments)
        return [part.reshape(rows.shape[0], -1) for part in payload], (ctx, rows.shape[1], rows.dtype)

    def decompress_rows(self, payload: Payload, ctx: Any) -> torch.Tensor:
        inner, length, dtype = ctx
        rows = payload[0].shape[0]
        segments = _row_segments(rows, length, dtype, payload[0].device)
        flat = self.decompress_segments([part.reshape(-1) for part in payload], inner, segments)
        return flat.view(rows, length)

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Any]:
        return RowwiseCompressor.compress(self, tensor)

    def decompress(self, payload: Payload, ctx: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        return RowwiseCompressor.decompress(self, payload, ctx)

    def aggregate(self, gathered: Payload, ctx: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        return Compressor.aggregate(self, gathered, ctx, out)

    def residual(self, corrected: torch.Tensor, payload: Payload, ctx: Any) -> torch.Tensor:
        return Compressor.residual(self, corrected, payload, ctx)
