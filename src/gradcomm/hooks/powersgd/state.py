"""PowerSGD's state: hyperparameters, per-parameter buffers (error feedback, warm-start ``Q``), checkpointing.

Buffers are keyed by parameter (:mod:`gradcomm.hooks.parameter_keys`), not by bucket, so a saved state
resumes whatever bucket layout the resumed DDP has: torch's DDP starts every process in its initial layout
and rebuilds it after the first iteration, gradcomm's restores the saved layout. At run time a bucket's
buffers are one flat tensor per bucket (what the kernel reads and writes, with no copy per step) and the
per-parameter entries are views into it; when a parameter first appears in a bucket of another layout, its
entries are gathered into that bucket's flat tensor, once.

The state also owns the :class:`~gradcomm.comm.launcher.OrderedLauncher` that orders its hooks' collectives.
"""

import logging
import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm.comm.launcher import OrderedLauncher
from gradcomm.hooks.hook_state import HookState
from gradcomm.hooks.parameter_keys import Key, ParameterKeys, SavedKeyCheck

__all__ = ["BucketKeys", "Layout", "PowerSGDState", "count", "describe", "layout_of"]

logger = logging.getLogger("gradcomm.hooks.powerSGD_hook")

Shape = tuple[int, ...]
Layout = tuple[Shape, ...]
BucketKeys = tuple[Key, ...]

_HYPERPARAMETERS = (
    "matrix_approximation_rank",
    "start_powerSGD_iter",
    "min_compression_rate",
    "use_error_feedback",
    "warm_start",
    "orthogonalization_epsilon",
    "compression_stats_logging_frequency",
    "batch_tensors_with_same_shape",
)
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

    def __init__(
        self,
        process_group: ProcessGroup | None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        # Checked here, before any rank trains: the registry and `gradcomm bench` build a state without a
        # process group to refuse bad values up front, so this is the one place that knows the valid ranges.
        whole = {
            "matrix_approximation_rank": matrix_approximation_rank,
            "start_powerSGD_iter": start_powerSGD_iter,
            "random_seed": random_seed,
            "compression_stats_logging_frequency": compression_stats_logging_frequency,
        }
        for name, value in whole.items():
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"PowerSGDState: {name} must be an integer, got {value!r}")
        if matrix_approximation_rank < 1:
            raise ValueError(
                f"PowerSGDState: matrix_approximation_rank must be at least 1, got {matrix_approximation_rank}"
            )
        if start_powerSGD_iter < 0:
            raise ValueError(f"PowerSGDState: start_powerSGD_iter must be at least 0, got {start_powerSGD_iter}")
        if not min_compression_rate >= 0:
            raise ValueError(
                f"PowerSGDState: min_compression_rate must be a number >= 0 (0: compress every matrix), got "
                f"{min_compression_rate!r}"
            )
        if not 0 <= orthogonalization_epsilon < math.inf:
            raise ValueError(
                f"PowerSGDState: orthogonalization_epsilon must be a finite number >= 0, got "
                f"{orthogonalization_epsilon!r}"
            )
        if not 0 <= random_seed < 2**32:
            raise ValueError(f"PowerSGDState: random_seed must be in 0..2**32-1 (NumPy's range), got {random_seed}")
        if compression_stats_logging_frequency < 0:
            raise ValueError(
                "PowerSGDState: compression_stats_logging_frequency must be >= 0 (0 and 1 both log every "
                f"iteration), got {compression_stats_logging_frequency}"
            )
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
                "because PowerSGD can only be applied after the first two iterations in DDP "
                f"(got start_powerSGD_iter={start_powerSGD_iter}): DDP rebuilds its buckets after the first "
                "iteration, which would invalidate per-bucket error-feedback and warm-start buffers."
            )
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.rng = np.random.RandomState(random_seed)
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
        self._launcher = OrderedLauncher()
        self._reset_runtime(check=False)
        logger.info(
            "PowerSGD config: %s; random_seed = %s",
            "; ".join(f"{name} = {getattr(self, name)}" for name in _HYPERPARAMETERS),
            random_seed,
        )

    def _reset_runtime(self, check: bool) -> None:
        """Forget what belongs to this process (keys, bound buffers); ``check`` the next buckets against the
        saved parameter shapes, for a state just loaded."""
        self._keys = ParameterKeys()
        self._iteration_keys: list[BucketKeys] = []  # the buckets seen so far in this iteration
        self._buckets: dict[BucketKeys, Any] = {}
        self._owner: dict[Key, BucketKeys] = {}
        self._reinit_logged = False
        self._check = SavedKeyCheck("PowerSGDState", self.parameter_shapes) if check else None

    def keys(self, bucket: dist.GradBucket) -> BucketKeys:
        """The keys of ``bucket``'s parameters in this state (see :mod:`gradcomm.hooks.parameter_keys`)."""
        return self._keys.of(bucket)

    def note_bucket(self, bucket: dist.GradBucket) -> BucketKeys:
        """The keys of ``bucket``'s parameters, recorded in :attr:`bucket_layout` once its iteration is whole."""
        keys = self._keys.of(bucket)
        if bucket.index() == 0:
            self._iteration_keys = []
        self._iteration_keys.append(keys)
        if bucket.is_last():
            self.bucket_layout, self._iteration_keys = self._iteration_keys, []
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
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for runtime in ("_launcher", "_keys", "_iteration_keys", "_buckets", "_owner", "_reinit_logged", "_check"):
            state.pop(runtime, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "bucket_layouts" in state:
            raise ValueError(_older_gradcomm("a pickled PowerSGDState"))
        self._launcher = OrderedLauncher()
        logger.warning(DEFAULT_GROUP_NOTE)
        super().__setstate__(state)
        self.__dict__.setdefault("bucket_layout", None)  # pickled before the layout was recorded
        self._reset_runtime(check=True)

    def _plain_state(self) -> dict[str, Any]:
        _, keys, pos, has_gauss, cached_gaussian = self.rng.get_state()
        return {
            **{name: getattr(self, name) for name in _HYPERPARAMETERS + _COUNTERS},
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
        expected = set(_HYPERPARAMETERS + _COUNTERS + _BUFFERS + _BUCKET_BUFFERS) | {"rng_state", "bucket_layout"}
        if set(state) | {"bucket_layout"} != expected:  # saved before the layout was recorded: none
            raise ValueError(
                "PowerSGDState.load_state_dict: not a PowerSGDState state dict; "
                f"missing keys {sorted(expected - set(state))}, unexpected keys {sorted(set(state) - expected)}"
            )
        changed = [
            f"{name} {getattr(self, name)} -> {state[name]}"
            for name in _HYPERPARAMETERS
            if getattr(self, name) != state[name]
        ]
        if changed:
            logger.warning(
                "PowerSGDState.load_state_dict: options taken from the checkpoint: %s", "; ".join(changed)
            )
        for name in _HYPERPARAMETERS + _COUNTERS:
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
        self._reset_runtime(check=True)


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
    if state._check is not None:
        state._check.check_bucket(keys, layout)
    for key, shape in zip(keys, layout, strict=True):
        previous = state._owner.get(key)
        if previous is not None and previous != keys:
            state._buckets.pop(previous, None)
        state._owner[key] = keys
        state.parameter_shapes[key] = shape


def end_of_bucket(state: PowerSGDState, bucket: dist.GradBucket) -> None:
    """After a compressed bucket: once a loaded state has met a whole iteration, refuse what no bucket held."""
    if state._check is not None and bucket.is_last():
        check, state._check = state._check, None
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
    if state.bucket_q_memory_dict and not state._reinit_logged:
        state._reinit_logged = True
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
