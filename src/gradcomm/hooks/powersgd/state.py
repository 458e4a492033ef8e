"""PowerSGD's state: hyperparameters, per-parameter buffers (error feedback, warm-start ``Q``), checkpointing.

Buffers are keyed by parameter (:mod:`gradcomm.hooks.parameter_keys`), not by bucket, so a saved state
resumes whatever bucket layout the resumed DDP has: torch's DDP starts every process in its initial layout
and rebuilds it after the first iteration, gradcomm's restores the saved layout. At run time a bucket's
buffers are one flat tensor per bucket (what the kernel reads and writes, with no copy per step) and the
per-parameter entries are views into it; when a parameter first appears in a bucket of another layout, its
entries are gathered into that bucket's flat tensor, once.

The state also owns the :class:`~gradcomm.comm.launcher.OrderedLauncher` that orders its hooks' collectives.
"""

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm.comm.launcher import OrderedLauncher
from gradcomm.hooks.hook_state import HookState, takes_options
from gradcomm.hooks.options import PowerSGDOptions, saved_option_names
from gradcomm.hooks.parameter_keys import Key, ParameterKeys, SavedKeyCheck

__all__ = ["BucketKeys", "Layout", "PowerSGDState", "count", "describe", "layout_of"]

logger = logging.getLogger("gradcomm.hooks.powerSGD_hook")

Shape = tuple[int, ...]
Layout = tuple[Shape, ...]
BucketKeys = tuple[Key, ...]

_COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report")
_BUFFERS = ("error_dict", "q_memory_dict", "parameter_shapes")
_BUCKET_BUFFERS = ("bucket_q_memory_dict", "bucket_padding_error_dict")

# torch's PowerSGDState.__setstate__ logs this, word for word (the spaces are its string's continued line), and
# torch's test_ddp_hook_pickling_powerSGD expects it
DEFAULT_GROUP_NOTE = (
    "NOTE: Process group will be set to a default group (i.e. the world size)."
    + " " * 16
    + "If a different group is desired, please set `self.process_group` after PowerSGD state is loaded."
)


@dataclass
class _Runtime:
    """What a PowerSGD state holds for this process only, rebuilt by :meth:`PowerSGDState.reset_runtime`."""

    check: SavedKeyCheck | None  # a loaded state's check of the first buckets against the saved shapes
    launcher: OrderedLauncher = field(default_factory=OrderedLauncher)
    keys: ParameterKeys = field(default_factory=ParameterKeys)
    iteration_keys: list[BucketKeys] = field(default_factory=list)  # the buckets seen so far in this iteration
    buckets: dict[BucketKeys, Any] = field(default_factory=dict)  # the hook's bindings of buffers to buckets
    owner: dict[Key, BucketKeys] = field(default_factory=dict)
    reinit_logged: bool = False


class PowerSGDState(HookState):
    r"""Hyperparameters and per-bucket state of :func:`powerSGD_hook` and :func:`batched_powerSGD_hook`.

    Args:
        process_group: the group to average over; ``None`` for the default group.
        matrix_approximation_rank: rank ``r`` of the approximations. Start at 1 and double until accuracy
            suffices; 1 to 4 is typical.
        start_powerSGD_iter: iterations of plain averaging before compression starts. Must be > 1 with
            error feedback or warm start (DDP rebuilds its buckets after the first iteration).
        min_compression_rate: a matrix is compressed only if ``(n + m) * r * min_compression_rate < n * m``.
        use_error_feedback: carry each rank's compression error over to its next gradient.
        warm_start: reuse ``Q`` from the previous iteration instead of a fresh random one.
        orthogonalization_epsilon: added to column norms when orthonormalizing by Gram-Schmidt; with 0,
            columns of zeros are left as zeros.
        random_seed: seed of the generator of the random ``Q``; the same on every rank.
        compression_stats_logging_frequency: log :meth:`compression_stats` every this many iterations.
        batch_tensors_with_same_shape: compress same-shaped matrices of a bucket in one batched product.

    State kept between steps, keyed by parameter (its name, or its order of first appearance; see
    :mod:`gradcomm.hooks.parameter_keys`): ``error_dict`` (each rank's compression error, shaped like the
    parameter), ``q_memory_dict`` (:func:`powerSGD_hook`'s warm-start ``Q``, ``cols x rank`` per compressed
    matrix) and ``parameter_shapes``. :func:`batched_powerSGD_hook` compresses a bucket as one square
    matrix, so its ``Q`` and the error of the matrix's zero padding belong to the bucket's parameters in
    their order: ``bucket_q_memory_dict`` and ``bucket_padding_error_dict`` are keyed by the tuple of the
    bucket's parameter keys, reused only by a bucket of the same parameters in the same order; another
    bucket starts with a fresh random ``Q``, as at the first compressed iteration.

    ``bucket_layout`` records the buckets of the last whole iteration (each bucket's parameter keys, in
    bucket order) and is saved with the rest. gradcomm's DDP adopts it before the first iteration of a
    resumed run where its own buckets would have come out the same after its rebuild, so that a state resumed
    through ``torch.save`` reduces in the buckets it was made in from the first step, as
    :func:`gradcomm.checkpoint.load_checkpoint` arranges: batched PowerSGD's per-bucket ``Q``, and from
    three ranks on any sum, depend on the buckets. torch's DDP cannot adopt a layout.
    """

    options_class = PowerSGDOptions

    @takes_options(PowerSGDOptions)
    def __init__(self, process_group: ProcessGroup | None, *options: Any, **named: Any) -> None:
        self.process_group = process_group
        self._set_options(options, named)
        self.compression_stats_logging_frequency = max(1, self.compression_stats_logging_frequency)
        self.rng = np.random.RandomState(self.random_seed)
        self.error_dict: dict[Key, torch.Tensor] = {}
        self.q_memory_dict: dict[Key, torch.Tensor] = {}
        self.parameter_shapes: dict[Key, Shape] = {}
        self.bucket_q_memory_dict: dict[BucketKeys, torch.Tensor] = {}
        self.bucket_padding_error_dict: dict[BucketKeys, torch.Tensor] = {}
        self.bucket_layout: list[BucketKeys] | None = None
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.next_stats_report = 0
        self.reset_runtime()
        options = dataclasses.asdict(self.options())
        logger.info("PowerSGD config: %s", "; ".join(f"{name} = {value}" for name, value in options.items()))

    def reset_runtime(self, loaded: bool = False) -> None:
        """Forget the keys and the buffers bound to buckets; for a state just ``loaded``, check the next buckets
        against the saved parameter shapes. A state loaded in place keeps its launcher (its order goes on)."""
        existing: _Runtime | None = self.__dict__.get("_runtime")
        check = SavedKeyCheck("PowerSGDState", self.parameter_shapes) if loaded else None
        self._runtime = _Runtime(check) if existing is None else _Runtime(check, launcher=existing.launcher)

    def keys(self, bucket: dist.GradBucket) -> BucketKeys:
        """The keys of ``bucket``'s parameters in this state (see :mod:`gradcomm.hooks.parameter_keys`)."""
        return self._runtime.keys.of(bucket)

    def note_bucket(self, bucket: dist.GradBucket) -> BucketKeys:
        """The keys of ``bucket``'s parameters, recorded in :attr:`bucket_layout` once its iteration is whole."""
        runtime = self._runtime
        keys = runtime.keys.of(bucket)
        if bucket.index() == 0:
            runtime.iteration_keys = []
        runtime.iteration_keys.append(keys)
        if bucket.is_last():
            self.bucket_layout, runtime.iteration_keys = runtime.iteration_keys, []
        return keys

    def compression_stats(self) -> tuple[float, int, int]:
        """``(compress_rate, numel_before_compression, numel_after_compression)`` since compression started.

        ``compress_rate`` is before / after, or 0 while nothing has been compressed.
        """
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after > 0 else 0, before, after)

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count an iteration when its last bucket is handled."""
        if not bucket.is_last():
            return
        self.iter += 1
        if self.iter == self.start_powerSGD_iter:
            logger.info("Start to apply PowerSGD after %s iterations.", self.iter)

    # -- checkpointing ------------------------------------------------------------------------------------
    def __setstate__(self, state: dict[str, Any]) -> None:
        if "bucket_layouts" in state:
            raise ValueError(_older_gradcomm("a pickled PowerSGDState"))
        logger.warning(DEFAULT_GROUP_NOTE)
        super().__setstate__({"bucket_layout": None, **state})  # pickled before the layout was recorded: none

    def _saved_options(self) -> tuple[str, ...]:
        """The options a state dict holds: every field of the options dataclass but the seed, whose generator's
        state is saved instead."""
        return saved_option_names(self.options_class)

    def _plain_state(self) -> dict[str, Any]:
        _, keys, pos, has_gauss, cached_gaussian = self.rng.get_state()
        return {
            **{name: getattr(self, name) for name in (*self._saved_options(), *_COUNTERS)},
            "error_dict": dict(self.error_dict),
            "q_memory_dict": dict(self.q_memory_dict),
            "parameter_shapes": {key: list(shape) for key, shape in self.parameter_shapes.items()},
            **{
                name: [{"keys": list(keys), "tensor": tensor} for keys, tensor in getattr(self, name).items()]
                for name in _BUCKET_BUFFERS
            },
            "bucket_layout": None if self.bucket_layout is None else [list(keys) for keys in self.bucket_layout],
            "rng_state": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            },
        }

    def _restore_plain_state(self, state: dict[str, Any]) -> None:
        if "bucket_layouts" in state:
            raise ValueError(_older_gradcomm("PowerSGDState.load_state_dict: this state dict"))
        options = self._saved_options()
        expected = {*options, *_COUNTERS, *_BUFFERS, *_BUCKET_BUFFERS, "rng_state", "bucket_layout"}
        # saved before the layout was recorded, or before an option was added: those keep their values here
        if set(state) | {"bucket_layout", *options} != expected:
            raise ValueError(
                "PowerSGDState.load_state_dict: not a PowerSGDState state dict; "
                f"missing keys {sorted(expected - set(state))}, unexpected keys {sorted(set(state) - expected)}"
            )
        saved_options = [name for name in options if name in state]
        changed = [
            f"{name} {getattr(self, name)} -> {state[name]}"
            for name in saved_options
            if getattr(self, name) != state[name]
        ]
        if changed:
            logger.warning(
                "PowerSGDState.load_state_dict: options taken from the checkpoint: %s", "; ".join(changed)
            )
        for name in (*saved_options, *_COUNTERS):
            setattr(self, name, state[name])
        self.error_dict = {key: tensor.clone() for key, tensor in state["error_dict"].items()}
        self.q_memory_dict = {key: tensor.clone() for key, tensor in state["q_memory_dict"].items()}
        self.parameter_shapes = {
            key: tuple(int(d) for d in shape) for key, shape in state["parameter_shapes"].items()
        }
        for name in _BUCKET_BUFFERS:
            setattr(self, name, {tuple(entry["keys"]): entry["tensor"].clone() for entry in state[name]})
        layout = state.get("bucket_layout")
        self.bucket_layout = None if layout is None else [tuple(keys) for keys in layout]
        rng_state = state["rng_state"]
        self.rng = np.random.RandomState()
        self.rng.set_state(
            (
                "MT19937",
                rng_state["keys"].numpy().astype(np.uint32),
                rng_state["pos"],
                rng_state["has_gauss"],
                rng_state["cached_gaussian"],
            )
        )


def _older_gradcomm(what: str) -> str:
    return (
        f"{what} was saved by an older gradcomm, which kept PowerSGD's error feedback and warm-start Q per "
        "bucket index (it has 'bucket_layouts'); this version keeps them per parameter, so that a state "
        "resumes whatever the bucket layout. Resume it with the gradcomm version that saved it, or load only "
        "the model and optimizer (load_checkpoint(..., hook_state=None)) and start from a new PowerSGDState."
    )


# -- per-bucket views of the per-parameter buffers ----------------------------------------------------------
def layout_of(bucket: dist.GradBucket) -> Layout:
    return tuple(tuple(grad.shape) for grad in bucket.gradients())


def describe(layout: Layout, limit: int = 6) -> str:
    numel = sum(math.prod(shape) for shape in layout)
    shapes = ", ".join(str(shape) for shape in layout[:limit]) + (", ..." if len(layout) > limit else "")
    return f"{numel} elements in {len(layout)} tensors of shapes [{shapes}]"


def claim(state: PowerSGDState, keys: BucketKeys, layout: Layout) -> None:
    """Check a bucket's parameters against a loaded state, and make them this bucket's from now on.

    A bucket whose parameters were held by another bucket (before DDP rebuilt its buckets, or in the saved
    run) takes their entries over; that other bucket's binding is dropped and would be bound again.
    """
    runtime = state._runtime
    if runtime.check is not None:
        runtime.check.check_bucket(keys, layout)
    for key, shape in zip(keys, layout, strict=True):
        previous = runtime.owner.get(key)
        if previous is not None and previous != keys:
            runtime.buckets.pop(previous, None)
        runtime.owner[key] = keys
        state.parameter_shapes[key] = shape


def end_of_bucket(state: PowerSGDState, bucket: dist.GradBucket) -> None:
    """After a compressed bucket: once a loaded state has met a whole iteration, refuse what no bucket held."""
    runtime = state._runtime
    if runtime.check is not None and bucket.is_last():
        check, runtime.check = runtime.check, None
        check.end_iteration()


def bind_error(
    state: PowerSGDState, keys: BucketKeys, layout: Layout, like: torch.Tensor, length: int
) -> tuple[torch.Tensor, bool]:
    """The bucket's flat error buffer of ``length`` elements (zero-padded past the gradients), gathered from the
    parameters' saved errors, and whether none was saved (the buffer is then filled by the first step).

    ``error_dict`` then holds views into it, one per parameter.
    """
    flat = like.new_zeros(length)
    offset, found = 0, False
    for key, shape in zip(keys, layout, strict=True):
        numel = math.prod(shape)
        view = flat[offset : offset + numel].view(shape)
        saved = state.error_dict.get(key)
        if saved is not None:
            view.copy_(saved.reshape(shape))
            found = True
        state.error_dict[key] = view
        offset += numel
    if not found:
        logger.info("A zero tensor of length %s that represents local error is created.", length)
    return flat, not found


def add_error(error: torch.Tensor, buffer: torch.Tensor, fresh: bool) -> torch.Tensor:
    """``error`` (the bucket's flat error buffer) now holding gradient + error; returned.

    The sum is built in the error buffer, not the bucket: the compressed parts are read from it and the new
    error is computed in it by subtracting the decompressed result, with no copy of the input.
    """
    if fresh:
        error[: buffer.numel()].copy_(buffer)
    else:
        error[: buffer.numel()].add_(buffer)
    return error


def bind_q(
    state: PowerSGDState, matrices: list[tuple[Key, torch.Tensor]]
) -> list[torch.Tensor]:
    """Point ``q_memory_dict`` at this bucket's ``Q`` views (``(key, cols x rank view)`` per compressed matrix),
    filled from the saved ones; returns the views that had none saved (to be drawn at random)."""
    missing = []
    for key, view in matrices:
        saved = state.q_memory_dict.get(key)
        if saved is not None and saved.shape == view.shape:
            view.copy_(saved)
        else:
            missing.append(view)
        state.q_memory_dict[key] = view
    if matrices and len(missing) == len(matrices):
        logger.info("Allocating contiguous memory of length %s for Qs.", sum(v.numel() for _, v in matrices))
    return missing


def batched_q(state: PowerSGDState, keys: BucketKeys, numel: int, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``batched_powerSGD_hook``'s warm-start ``Q`` for the bucket of ``keys``: the one kept for these
    parameters in this order, or a new one (to be drawn at random), and whether it is new."""
    saved = state.bucket_q_memory_dict.get(keys)
    if saved is not None and saved.numel() == numel:
        if saved.device != like.device or saved.dtype != like.dtype:
            saved = state.bucket_q_memory_dict[keys] = saved.to(like.device, like.dtype)
        return saved, False
    if state.bucket_q_memory_dict and not state._runtime.reinit_logged:
        state._runtime.reinit_logged = True
        logger.info(
            "batched_powerSGD_hook: a bucket holds parameters (%s) in a combination or order no warm-start Q "
            "was kept for (DDP buckets differently than when the state was saved); its Q starts afresh, as "
            "at the first compressed iteration. Error feedback is kept per parameter and carries over.",
            describe_keys(keys),
        )
    else:
        logger.info("Allocating contiguous memory of length %s for Qs.", numel)
    memory = state.bucket_q_memory_dict[keys] = like.new_empty(numel)
    return memory, True


def describe_keys(keys: BucketKeys, limit: int = 4) -> str:
    return ", ".join(repr(key) for key in keys[:limit]) + (f", ... {len(keys)} in all" if len(keys) > limit else "")


# -- statistics and iterations -------------------------------------------------------------------------------
def count(state: PowerSGDState, bucket: dist.GradBucket, before: int, after: int) -> None:
    state.total_numel_before_compression += before
    state.total_numel_after_compression += after
    if bucket.is_last() and state.iter >= state.next_stats_report:
        rate, total_before, total_after = state.compression_stats()
        logger.info(
            "Compression stats: iter %s, total before compression %s, total after compression %s, rate %s",
            state.iter,
            total_before,
            total_after,
            rate,
        )
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency
