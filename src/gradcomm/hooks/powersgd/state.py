"""PowerSGD's state: hyperparameters, per-bucket buffers (error feedback, warm-start ``Q``) and checkpointing.

Buffers are kept per bucket, with the gradient shapes they were made for (``bucket_layouts``), and refused
with an error naming the bucket when applied to a bucket of another layout. The state also owns the
:class:`~gradcomm.comm.launcher.OrderedLauncher` that orders its hooks' collectives.
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

__all__ = [
    "Layout",
    "PowerSGDState",
    "add_error",
    "check_saved_state",
    "count",
    "describe",
    "layout_of",
    "q_buffer",
]

logger = logging.getLogger("gradcomm.hooks.powerSGD_hook")

Shape = tuple[int, ...]
Layout = tuple[Shape, ...]

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
_BUFFERS = ("error_dict", "q_memory_dict")


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

    Per-bucket state, keyed by bucket index: ``error_dict`` (each rank's compression error, one flat tensor
    per bucket), ``q_memory_dict`` (the warm-start ``Q`` matrices, one flat tensor per bucket) and
    ``bucket_layouts`` (the gradient shapes the buffers were made for).
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
        self.error_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.bucket_layouts: dict[int, Layout] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.next_stats_report = 0
        self._launcher = OrderedLauncher()
        logger.info(
            "PowerSGD config: %s; random_seed = %s",
            "; ".join(f"{name} = {getattr(self, name)}" for name in _HYPERPARAMETERS),
            random_seed,
        )

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
        del state["_launcher"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._launcher = OrderedLauncher()
        super().__setstate__(state)

    def _plain_state(self) -> dict[str, Any]:
        _, keys, pos, has_gauss, cached_gaussian = self.rng.get_state()
        return {
            **{name: getattr(self, name) for name in _HYPERPARAMETERS + _COUNTERS},
            **{name: dict(getattr(self, name)) for name in _BUFFERS},
            "bucket_layouts": {index: _plain_layout(layout) for index, layout in self.bucket_layouts.items()},
            "rng_state": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            },
        }

    def _restore_plain_state(self, state: dict[str, Any]) -> None:
        expected = set(_HYPERPARAMETERS + _COUNTERS + _BUFFERS) | {"bucket_layouts", "rng_state"}
        if set(state) != expected:
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
        for name in _BUFFERS:
            setattr(self, name, {int(index): tensor.clone() for index, tensor in state[name].items()})
        self.bucket_layouts = {
            int(index): tuple(tuple(int(d) for d in shape) for shape in layout)
            for index, layout in state["bucket_layouts"].items()
        }
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


def _plain_layout(layout: Layout) -> list[list[int]]:
    return [list(shape) for shape in layout]

# -- per-bucket buffers --------------------------------------------------------------------------------------
def layout_of(bucket: dist.GradBucket) -> Layout:
    return tuple(tuple(grad.shape) for grad in bucket.gradients())


def describe(layout: Layout, limit: int = 6) -> str:
    numel = sum(math.prod(shape) for shape in layout)
    shapes = ", ".join(str(shape) for shape in layout[:limit]) + (", ..." if len(layout) > limit else "")
    return f"{numel} elements in {len(layout)} tensors of shapes [{shapes}]"


def _layout_error(index: int, detail: str) -> ValueError:
    return ValueError(
        f"PowerSGDState: the saved state of bucket {index} does not match bucket {index} of this model: "
        f"{detail}. The state comes from another model or bucket layout (bucket_cap_mb, parameter order). "
        "With the same model, DDP's first iteration in a process may bucket differently from later ones "
        "(torch's DDP starts with one bucket in registration order and rebuilds it after that iteration, "
        "unless find_unused_parameters=True). Resume with the same layout, or start from a new PowerSGDState."
    )


def check_saved_state(
    state: PowerSGDState, index: int, layout: Layout, error_numel: int, q_numel: int
) -> None:
    """Refuse saved buffers that were not made for this bucket, before anything is changed."""
    saved = state.bucket_layouts.get(index)
    if saved is not None and saved != layout:
        raise _layout_error(
            index, f"it was made for {describe(saved)}, but this bucket has {describe(layout)}"
        )
    expected = [("error-feedback buffer", state.error_dict, error_numel, state.use_error_feedback)]
    expected.append(("warm-start Q memory", state.q_memory_dict, q_numel, state.warm_start))
    for what, buffers, numel, used in expected:
        tensor = buffers.get(index)
        if used and tensor is not None and tensor.numel() != numel:
            raise _layout_error(
                index, f"its {what} has {tensor.numel()} elements, but this bucket needs {numel}"
            )


def _stored(buffers: dict[int, torch.Tensor], index: int, like: torch.Tensor) -> torch.Tensor | None:
    """The bucket's saved buffer, moved to the gradients' device if it was loaded elsewhere."""
    tensor = buffers.get(index)
    if tensor is not None and tensor.device != like.device:
        tensor = buffers[index] = tensor.to(like.device)
    return tensor


def _remember_layout(state: PowerSGDState, index: int, layout: Layout) -> None:
    state.bucket_layouts.setdefault(index, layout)


def add_error(
    state: PowerSGDState, index: int, layout: Layout, buffer: torch.Tensor, length: int
) -> torch.Tensor:
    """The bucket's error buffer (``length`` elements, zero-padded past the buffer), now holding gradient + error.

    The sum is built in the error buffer, not the bucket: the compressed parts are read from it and the new
    error is computed in it by subtracting the decompressed result, with no copy of the input.
    """
    error = _stored(state.error_dict, index, buffer)
    if error is None:
        error = buffer.new_zeros(length)
        error[: buffer.numel()].copy_(buffer)
        state.error_dict[index] = error
        _remember_layout(state, index, layout)
        logger.info("A zero tensor of length %s that represents local error is created.", length)
    else:
        error[: buffer.numel()].add_(buffer)
    return error


def q_buffer(
    state: PowerSGDState, index: int, layout: Layout, numel: int, like: torch.Tensor
) -> tuple[torch.Tensor, bool]:
    """Flat memory for the bucket's ``Q`` matrices, and whether it must be filled with random values."""
    if state.warm_start:
        memory = _stored(state.q_memory_dict, index, like)
        if memory is not None:
            return memory, False
    memory = like.new_empty(numel)
    if state.warm_start:
        state.q_memory_dict[index] = memory
        _remember_layout(state, index, layout)
        logger.info("Allocating contiguous memory of length %s for Qs.", numel)
    return memory, True


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

