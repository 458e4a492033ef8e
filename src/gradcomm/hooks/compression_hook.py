"""A DDP communication hook for any :mod:`gradcomm.compression` method, with optional error feedback.

Register it in one line on torch's DistributedDataParallel or gradcomm's (overlapping or legacy)::

    from gradcomm.compression import TopK
    from gradcomm.hooks.compression_hook import CompressionState, compressed_allreduce_hook

    ddp.register_comm_hook(CompressionState(TopK(ratio=0.01)), compressed_allreduce_hook)

Per bucket, large gradients are compressed together, as one segmented bucket, where the method is a
:class:`~gradcomm.compression.base.SegmentedCompressor` (each tensor keeps its own statistics; the number of
torch calls per bucket does not grow with its number of tensors), else one by one (with the compressor's
error feedback, keyed by parameter), or as one concatenation where the method is elementwise and keeps no
residuals.
Small ones (biases, norms: fewer than ``min_numel`` elements, or compressed less than
``min_compression_rate`` times) are sent dense, as one flat tensor per bucket, in an allreduce of their own
or, where the method's communicator carries them at no cost (an all-gather on two ranks), in its
collective. Tensors that share a communicator share its collectives, so a bucket costs one collective per
communicator (per stage), whatever its number of parameters. The future holds the bucket's averaged
gradient, decompressed into the bucket's buffer (as torch's hooks do).

Error-feedback residuals and random streams are keyed by parameter, not by bucket position, so they follow
their parameter when DDP rebuilds its buckets after the first iteration: a parameter's key is its name where
it is registered (gradcomm's DDP registers them; with torch's DDP call
:func:`gradcomm.hooks.parameter_keys.name_parameters`), else the order in which the hook first sees it, the
same in a resumed run (see :mod:`gradcomm.hooks.parameter_keys`). A :meth:`CompressionState.state_dict`
checkpoint therefore resumes whatever the bucket layout; one whose keys do not fit the model is refused at
the first step, naming the parameter.
"""

# No ``from __future__ import annotations``: torch's DDP compares the hook's annotations with real types.

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm import comm
from gradcomm.comm.futures import when_all
from gradcomm.comm.launcher import OrderedLauncher
from gradcomm.compression.base import Compressor, SegmentedCompressor
from gradcomm.compression.communicators import Communicator, Message
from gradcomm.compression.fusion import codec as fused_codec
from gradcomm.compression.memory import Memory, NoMemory, ResidualMemory
from gradcomm.compression.wire import Wire, writing_into
from gradcomm.hooks.compression_plan import _DENSE, _itemsize, _Part, _Plan, _Workspace
from gradcomm.hooks.hook_state import HookState
from gradcomm.hooks.parameter_keys import Key, ParameterKeys, SavedKeyCheck

__all__ = ["CompressionState", "compressed_allreduce_hook"]

_NO_MEMORY = NoMemory()


@dataclass
class _Runtime:
    """What a compression state holds for this process only, rebuilt by :meth:`CompressionState.reset_runtime`."""

    codec: Any  # the compressor, or its compiled passes (compile=True)
    check: SavedKeyCheck | None  # a loaded state's check of the first buckets against the saved residuals
    launcher: OrderedLauncher = field(default_factory=OrderedLauncher)
    keys: ParameterKeys = field(default_factory=ParameterKeys)
    compressible: dict[tuple[torch.Size, torch.dtype], bool] = field(default_factory=dict)
    plans: dict[tuple[Any, ...], _Plan] = field(default_factory=dict)  # per bucket layout: index tensors, workspaces
    used: set[_Plan] = field(default_factory=set)  # the plans of this iteration's buckets so far


class CompressionState(HookState):
    """State of :func:`compressed_allreduce_hook`: the compressor, its error-feedback residuals and settings.

    Args:
        compressor: the compression method.
        error_feedback: ``None`` for the method's default, or force it on or off (refused where the method
            requires or forbids it; see :class:`~gradcomm.compression.base.ErrorFeedback`).
        process_group: the group to average over (``None``: the default group).
        min_compression_rate: compress a gradient only if its dense bytes are at least this many times the
            payload's; otherwise it is sent dense.
        min_numel: gradients with fewer elements are sent dense.
        compile: run the method's encoding and decoding through :func:`torch.compile`, per bucket layout (the
            collectives stay outside); meant for CUDA, where the eager codec is bound by launching its
            kernels. Off by default; each layout compiles at its second step (see
            :mod:`gradcomm.compression.fusion`). Results are the eager codec's, but for the last bit of a
            fused reduction (which can move a value across a rounding boundary); the state and its
            checkpoints are the same either way.
    """

    def __init__(
        self,
        compressor: Compressor,
        error_feedback: bool | None = None,
        process_group: ProcessGroup | None = None,
        min_compression_rate: float = 2.0,
        min_numel: int = 1024,
        compile: bool = False,
    ):
        if not isinstance(compressor, Compressor):
            raise TypeError(f"CompressionState: compressor must be a Compressor, got {type(compressor).__name__}")
        if not min_compression_rate >= 0:
            raise ValueError(
                f"CompressionState: min_compression_rate must be a number >= 0 (0: compress every gradient of "
                f"min_numel elements or more), got {min_compression_rate!r}"
            )
        if isinstance(min_numel, bool) or not isinstance(min_numel, int):
            raise TypeError(f"CompressionState: min_numel must be an integer, got {min_numel!r}")
        if min_numel < 0:
            raise ValueError(f"CompressionState: min_numel must be at least 0, got {min_numel}")
        if not isinstance(compile, bool):
            raise TypeError(f"CompressionState: compile must be True or False, got {compile!r}")
        if compile and not compressor.segmented:
            raise ValueError(
                f"CompressionState: compile=True compiles a segmented method's passes, and "
                f"{type(compressor).__name__} is not a SegmentedCompressor; leave compile off"
            )
        self.compressor = compressor
        self.error_feedback = compressor.error_feedback.resolve(error_feedback, type(compressor).__name__)
        self.process_group = process_group
        self.min_compression_rate = min_compression_rate
        self.min_numel = min_numel
        self.compile = compile
        self.memory: Memory = ResidualMemory() if self.error_feedback else NoMemory()
        self.server_memory = ResidualMemory()
        self.reset_runtime()

    def reset_runtime(self, loaded: bool = False) -> None:
        """Forget the keys, plans and workspaces and make the codec (compiled where ``compile``); for a state
        just ``loaded``, check the next buckets against the saved residuals' shapes. A state loaded in place
        keeps its launcher (its order goes on)."""
        existing: _Runtime | None = self.__dict__.get("_runtime")
        residuals = self.memory.state_dict()
        check = (
            SavedKeyCheck("CompressionState", {key: tuple(r.shape) for key, r in residuals.items()})
            if loaded and residuals
            else None
        )
        codec = fused_codec(self.compressor, self.compile)
        self._runtime = _Runtime(codec, check) if existing is None else _Runtime(codec, check, existing.launcher)

    def keys(self, bucket: dist.GradBucket) -> Sequence[Key]:
        """One key per gradient of ``bucket`` (see :mod:`gradcomm.hooks.parameter_keys`)."""
        return self._runtime.keys.of(bucket)

    def check_loaded(self, bucket: dist.GradBucket, keys: Sequence[Key], gradients: Sequence[Any]) -> None:
        """In the first iteration after loading: refuse residuals that do not fit this model's parameters
        (``gradients``: the gradients, or their shapes)."""
        runtime = self._runtime
        if runtime.check is None:
            return
        runtime.check.check_bucket(keys, (g if isinstance(g, torch.Size) else g.shape for g in gradients))
        if bucket.is_last():
            check, runtime.check = runtime.check, None
            check.end_iteration()

    def compresses(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is compressed; depends only on its shape and dtype, hence equal on all ranks. An
        empty tensor never is, whatever ``min_numel``: it has nothing to compress (and no scale to compute)."""
        if tensor.numel() < max(self.min_numel, 1):
            return False
        return self._compresses(tensor.shape, tensor.dtype)

    def _compresses(self, shape: torch.Size, dtype: torch.dtype) -> bool:
        if shape.numel() < max(self.min_numel, 1):
            return False
        signature = (shape, dtype)
        compressible = self._runtime.compressible
        if signature not in compressible:
            layout = self.compressor.payload_layout((shape.numel(),), dtype)
            payload_bytes = sum(numel * _itemsize(part_dtype) for numel, part_dtype in layout)
            dense_bytes = shape.numel() * _itemsize(dtype)
            compressible[signature] = dense_bytes >= self.min_compression_rate * payload_bytes
        return compressible[signature]

    def plan(self, bucket: dist.GradBucket, keys: Sequence[Key]) -> "_Plan":
        """Which of ``bucket``'s gradients are compressed and which sent dense, with their layouts (kept per
        bucket layout: the index tensors are made once)."""
        buffer = bucket.buffer()
        parameters = bucket.parameters()
        shapes = tuple(p.shape for p in parameters) if parameters else tuple(g.shape for g in bucket.gradients())
        signature = (tuple(keys), shapes, buffer.dtype, buffer.device)
        plans = self._runtime.plans
        found = plans.get(signature)
        if found is None:
            found = plans[signature] = _Plan.of(self, keys, shapes, buffer)
        return found

    def end_iteration(self, plan: "_Plan", bucket: dist.GradBucket) -> None:
        """Note that ``plan`` was used; after the iteration's last bucket, release the workspaces of the bucket
        layouts it did not use (DDP rebuilt its buckets: they would hold their memory for nothing)."""
        runtime = self._runtime
        runtime.used.add(plan)
        if bucket.is_last():
            for other in runtime.plans.values():
                if other not in runtime.used:
                    other.release()
            runtime.used.clear()

    # -- checkpointing: residuals and the compressor's random-stream counters, never the caches ------------
    def _plain_state(self) -> dict[str, Any]:
        return {
            "memory": self.memory.state_dict(),
            "server_memory": self.server_memory.state_dict(),
            "compressor": self.compressor.state_dict(),
        }

    def _restore_plain_state(self, state: dict[str, Any]) -> None:
        self.memory.load_state_dict(state["memory"])
        self.server_memory.load_state_dict(state["server_memory"])
        self.compressor.load_state_dict(state["compressor"])

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__({"compile": False, **state})  # a pickle from before the option: eager


def _segmented_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The hook for a :class:`SegmentedCompressor`: the bucket's compressed gradients encoded as one segmented
    flat tensor, its dense ones as one flat tensor; a number of torch calls that does not depend on the
    number of gradients, in buffers made once per bucket layout (:class:`_Workspace`)."""
    world_size = comm.group_size(state.process_group)
    keys = state.keys(bucket)
    plan = state.plan(bucket, keys)
    state.check_loaded(bucket, plan.keys, plan.shapes)
    work = plan.workspace(state, world_size)
    state.end_iteration(plan, bucket)
    try:
        batches, kept = _encoded(state, plan, work, bucket.buffer(), world_size)
    except BaseException:
        work.busy = False
        raise
    result_buffer = bucket.buffer()
    buffer = result_buffer if result_buffer.dim() == 1 else result_buffer.view(-1)

    def assemble(fut: torch.futures.Future[list[list[torch.Tensor]]]) -> torch.Tensor:
        try:
            for items, tensors in zip(batches.values(), fut.value(), strict=True):
                for (part, _), tensor in zip(items, tensors, strict=True):
                    flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)
                    part.put(buffer, flat, keep=any(flat is tensor_kept for tensor_kept in kept))
            return result_buffer
        finally:
            work.busy = False

    return _exchanged(state, bucket, batches, assemble, work.wires)


def _encoded(
    state: CompressionState, plan: _Plan, work: _Workspace, bucket_buffer: torch.Tensor, world_size: int
) -> tuple[dict[Communicator, list[tuple[_Part, Message]]], list[torch.Tensor]]:
    """Each communicator's messages of a bucket, with the part each one's mean is written to, and the
    workspace tensors that a mean may be (whose pieces are kept)."""
    assert isinstance(state.compressor, SegmentedCompressor)
    compressor = state._runtime.codec  # the compressor, or its compiled passes (compile=True)
    method = state.compressor.communicator
    buffer = bucket_buffer if bucket_buffer.dim() == 1 else bucket_buffer.view(-1)
    batches: dict[Communicator, list[tuple[_Part, Message]]] = {}
    kept: list[torch.Tensor] = []
    if plan.dense is not None:
        communicator = work.dense_communicator
        wire = work.wires[communicator]
        if wire is not None:  # the dense values go straight into their slot of the wire
            slot = wire.slots[0]
            plan.dense.write_into(buffer, slot, wire.divisor(0))
            message = Message(None, work.dense_codec, [slot], None)
            if work.dense_mean is not None:
                kept.append(work.dense_mean)
        else:
            flat, _ = plan.dense.take(buffer)
            message = communicator.encode(_DENSE, None, flat, _NO_MEMORY, world_size)
            message.out = flat if plan.dense.span is not None else None
        batches.setdefault(communicator, []).append((plan.dense, message))
    if plan.compressed is not None:
        flat, owned, compensated = _compensated_take(plan.compressed, buffer, state.memory, work.values)
        with writing_into(work.wires.get(method), work.compressed_first):  # parts computed into their slots
            message = method.encode_segments(
                compressor, plan.compressed.segments, flat, state.memory, world_size, owned, compensated
            )
        message.out = flat if not owned else work.decoded
        if work.decoded is not None:
            kept.append(work.decoded)
        batches.setdefault(method, []).append((plan.compressed, message))
    return batches, kept


def _exchanged(
    state: CompressionState,
    bucket: dist.GradBucket,
    batches: dict[Communicator, list[tuple[Any, Message]]],
    assemble: Callable[[torch.futures.Future[list[list[torch.Tensor]]]], torch.Tensor],
    wires: dict[Communicator, Wire | None] | None = None,
) -> torch.futures.Future[torch.Tensor]:
    """Launch each communicator's batch of messages (through its wire, where it has one); the bucket's
    future, ``assemble``-d from all of them."""
    futures = []
    for communicator, items in batches.items():
        messages = [message for _, message in items]
        wire = wires.get(communicator) if wires else None
        extra = {} if wire is None else {"wire": wire}
        futures.append(communicator.exchange(messages, state.process_group, state.server_memory, state._runtime.launcher, **extra))
    result = when_all(futures, bucket.buffer().device).then(assemble)
    if bucket.is_last():  # DDP's own collectives after the last bucket must come after all of the hook's
        state._runtime.launcher.wait_until_launched()
    return result


def _compensated_take(
    part: _Part, buffer: torch.Tensor, memory: Memory, into: torch.Tensor | None = None
) -> tuple[torch.Tensor, bool, bool]:
    """The part's values as :meth:`_Part.take` gives them (copied into ``into`` where given; and whether they
    are a copy), or, where they are strided in the buffer and a flat residual is held for them, that
    residual with them added (one pass where a copy and an addition were two): ``(flat, owned,
    compensated)``."""
    if part.span is None and isinstance(memory, ResidualMemory):
        held = memory.held_segments(part.segments, buffer)
        if held is not None:
            part.add_into(held, buffer)
            return held, True, True
    flat, owned = part.take(buffer, into)
    return flat, owned, False


def _written_into(buffer: torch.Tensor, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The bucket's averaged gradients ``pieces``, in order, written into its ``buffer``, which is returned, as
    torch's hooks return theirs: DDP then has nothing to copy, and no gradient-sized tensor is allocated.
    Pieces decoded in their own place in the buffer are left there. A new tensor instead where a piece has
    another dtype or lies elsewhere in the buffer (a method whose decoding returns what it was given)."""
    if any(piece.dtype != buffer.dtype for piece in pieces):
        return torch.cat(pieces).to(buffer.dtype).view(buffer.shape)
    memory = buffer.untyped_storage().data_ptr()
    inside = [piece.untyped_storage().data_ptr() == memory for piece in pieces]
    if not any(inside):
        return torch.cat(pieces, out=buffer.view(-1)).view(buffer.shape)
    slots = buffer.view(-1).split([piece.numel() for piece in pieces])
    placed = [piece.data_ptr() == slot.data_ptr() for piece, slot in zip(pieces, slots, strict=True)]
    if any(is_inside and not is_placed for is_inside, is_placed in zip(inside, placed, strict=True)):
        return torch.cat(pieces).view(buffer.shape)  # writing in place could overwrite a piece not yet read
    moved = [position for position, is_placed in enumerate(placed) if not is_placed]
    if moved:
        torch._foreach_copy_([slots[i] for i in moved], [pieces[i].reshape(-1) for i in moved])
    return buffer


def compressed_allreduce_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket``'s gradients over ``state.process_group``, compressed with ``state.compressor``."""
    if bucket.buffer().is_sparse:
        method = state.compressor.name or type(state.compressor).__name__
        raise NotImplementedError(
            f"compression method {method!r} encodes dense gradients only, and this bucket holds a sparse one "
            "(nn.Embedding(sparse=True)); make the embedding dense, or train with no hook"
        )
    if state.compressor.segmented:
        return _segmented_hook(state, bucket)
    world_size = comm.group_size(state.process_group)
    gradients = bucket.gradients()
    keys = state.keys(bucket)
    state.check_loaded(bucket, keys, gradients)
    method = state.compressor.communicator
    dense = method if method.carries_dense(world_size) else _DENSE.communicator
    compressed = [state.compresses(gradient) for gradient in gradients]
    # Per communicator, its messages, each with its gradients' positions in the bucket. The dense gradients
    # come first, as one flat message: one encoding and decoding for all of a bucket's biases and norms, and
    # a bucket sent all dense is summed as the bucket itself, at the same offsets as a plain allreduce.
    batches: dict[Communicator, list[tuple[list[int], Message]]] = {}
    for compressor, memory, communicator, is_compressed in (
        (_DENSE, _NO_MEMORY, dense, False),
        (state.compressor, state.memory, method, True),
    ):
        positions = [position for position, flag in enumerate(compressed) if flag == is_compressed]
        together = compressor.elementwise and not memory.enabled
        for group in [positions] if together and positions else [[position] for position in positions]:
            if len(group) == 1:  # the bucket is not read after encoding: its mean may be decoded in place
                key, tensor = keys[group[0]], gradients[group[0]]
                out: torch.Tensor | None = tensor
            else:
                key, tensor, out = None, torch.cat([gradients[i].reshape(-1) for i in group]), None
            message = communicator.encode(compressor, key, tensor, memory, world_size)
            message.out = out
            batches.setdefault(communicator, []).append((group, message))
    buffer = bucket.buffer()

    def assemble(fut: torch.futures.Future[list[list[torch.Tensor]]]) -> torch.Tensor:
        averaged: dict[int, torch.Tensor] = {}
        for items, tensors in zip(batches.values(), fut.value(), strict=True):
            for (positions, _), tensor in zip(items, tensors, strict=True):
                pieces = tensor.reshape(-1).split([gradients[position].numel() for position in positions])
                averaged.update(zip(positions, pieces, strict=True))
        return _written_into(buffer, [averaged[position] for position in range(len(gradients))])

    return _exchanged(state, bucket, batches, assemble)
