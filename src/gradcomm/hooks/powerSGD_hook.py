"""PowerSGD gradient compression (Vogels et al., NeurIPS 2019, https://arxiv.org/abs/1905.13727).

The same algorithm, options and results as ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``,
for torch's DistributedDataParallel or gradcomm's.

The algorithm
-------------
A gradient matrix ``M`` (``n x m``; a higher-dimensional tensor is viewed as ``shape[0] x rest``) is replaced
by a rank-``r`` approximation ``P Q^T`` found by one step of power iteration, with two small allreduces:

1. ``Q`` (``m x r``) is orthonormalized; ``P = M Q`` (``n x r``) is computed and summed over the ranks;
2. ``P`` is orthonormalized; ``Q = M^T P`` is computed and averaged over the ranks;
3. every rank decompresses ``P Q^T``, which approximates the averaged gradient.

Since the ``P`` and ``Q`` sums are linear in ``M``, the result is the approximation of the *average*
gradient, the same on every rank. Instead of ``n * m`` numbers a rank sends ``(n + m) * r``.

* **When tensors go uncompressed.** A matrix is compressed only when that saves enough:
  ``(n + m) * r * min_compression_rate < n * m``. Vectors (biases, norms), scalars and small or thin
  matrices fail the test; they are concatenated and averaged by one plain allreduce. For the first
  ``start_powerSGD_iter`` iterations nothing is compressed: the whole bucket is averaged, as without a hook.
  Early training is the most sensitive to gradient error, and DDP rebuilds its buckets after the first
  iteration, which must happen before any per-bucket state is kept.
* **Error feedback** (``use_error_feedback``). PowerSGD is biased: what the approximation misses is kept
  per rank and added to the next step's gradient, so nothing is lost, only delayed. The sum of the applied
  updates equals the sum of the true averaged gradients minus the ranks' mean current error, which stays
  bounded. It costs one gradient-sized buffer per bucket, which also holds ``gradient + error`` while the
  bucket is compressed (torch additionally copies the whole input every step).
* **Warm start** (``warm_start``). ``Q`` is kept from one step to the next instead of drawn afresh, so the
  single power-iteration step per training step keeps refining the same subspace. It costs the ``Q``
  matrices (``m * r`` per compressed matrix); ``P`` is recomputed every step and is not kept.

Random ``Q`` come from a NumPy generator seeded with ``random_seed``: every rank draws the same values.

:func:`batched_powerSGD_hook` views the whole bucket as one zero-padded square matrix instead of per-layer
matrices: less compute and one matrix per bucket, but mixing unrelated layers in one matrix destroys most of
the low-rank structure, so accuracy is usually much worse unless ``matrix_approximation_rank`` is 1.

Trade-offs
----------
Higher ``matrix_approximation_rank`` approximates better but costs more communication and compute (the
orthonormalization switches from Gram-Schmidt to QR above rank 2). Later ``start_powerSGD_iter`` trades
communication savings for accuracy. Error feedback and warm start are recommended; each costs memory.
``batch_tensors_with_same_shape`` runs one batched matrix product per shape instead of one per matrix:
faster with many same-shaped layers, at the cost of a stacked copy of them.

Differences from torch's implementation (otherwise the same results, bit for bit for :func:`powerSGD_hook`)
------------------------------------------------------------------------------------------------------------
* Error feedback holds one gradient-sized buffer per bucket; no copy of the input is made.
* Columns of zeros (vanishing gradients) stay zero instead of becoming NaN when
  ``orthogonalization_epsilon`` is 0. A warm-start ``Q`` column that has become zero is drawn afresh: in
  torch's a layer whose gradient was exactly zero in one step (a branch not used yet) stays at zero, or
  NaN, for the rest of training.
* :func:`batched_powerSGD_hook` works (torch 2.13's fails on a 2-D ``_orthogonalize`` check), honours
  ``orthogonalization_epsilon`` (torch's ignores it), and matches torch's up to rounding: it multiplies out
  the rows holding the zero padding separately instead of padding the bucket.
* ``P`` is not kept between steps (torch keeps a ``p_memory_dict`` whose contents every step overwrites).
* No waiting inside callbacks, and one order of collectives on every rank. A collective that needs an
  earlier one's result is launched from that one's callback, but all of a state's collectives are launched
  in the order DDP called the hook. The call for the last bucket of an iteration returns only once the
  iteration's collectives are all launched (DDP waits for them right after anyway), so that collectives DDP
  issues after the last bucket (the used-parameter map of ``find_unused_parameters=True``) come after them.
  Torch's hooks wait inside gloo callbacks, which deadlocks gloo's worker threads, and launch from whichever
  thread gets there first, which pairs different collectives across ranks: on gloo they fail or hang once a
  model has several buckets, or with ``find_unused_parameters=True``.
* The state remembers each bucket's gradient shapes and refuses, with an error naming the bucket, to apply
  saved buffers to a bucket of another layout (torch silently adds a saved error of the same length).
* ``state_dict()`` holds only tensors and plain values (``torch.load(weights_only=True)`` loads it).
"""

import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm import comm
from gradcomm.hooks.hook_state import HookState

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]
Layout = tuple[Shape, ...]
Launch = Callable[[], torch.futures.Future[torch.Tensor]]


# -- ordered, non-blocking launching of collectives --------------------------------------------------------
class _Slot:
    """One collective in a :class:`_OrderedLauncher`; ``future`` completes with the collective's result."""

    def __init__(self, device: torch.device) -> None:
        self.launch: Launch | None = None
        self.future: torch.futures.Future[torch.Tensor] = _new_future(device)

    def run(self) -> BaseException | None:
        """Launch the collective; return the exception if launching it failed."""
        assert self.launch is not None
        launch, self.launch = self.launch, None  # drop the closure: it holds the process group
        try:
            collective = launch()
        except BaseException as exc:
            self.fail(exc)
            return exc
        collective.then(self._complete)
        return None

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)

    def _complete(self, collective: torch.futures.Future[torch.Tensor]) -> None:
        try:
            value = collective.value()
        except BaseException as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(value)


class _OrderedLauncher:
    """Launches collectives in the order they were reserved, from whichever thread makes the next one ready.

    Every rank must enter a group's collectives in the same order. A hook launches its first collectives
    when DDP calls it, but the next ones from callbacks that run when earlier collectives finish, at
    different moments on different ranks. Reserving every slot in hook-call order and launching only from
    the head of the queue keeps the order identical on all ranks without blocking.

    A slot that cannot be launched (its input failed, or launching raised) stops the launcher for good:
    the slots after it would pair with its peers' version of the missing collective, so they fail without
    launching, and so does every later one. The peers then wait for a collective this rank never enters and
    fail when the process group's timeout passes, instead of exchanging mismatched data.

    DDP may issue collectives of its own right after the last bucket's hook returns (the map of used
    parameters, with ``find_unused_parameters=True``): :meth:`wait_until_launched` holds that last hook call
    until all of the iteration's collectives are launched, so DDP's come after them on every rank.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._all_launched = threading.Condition(self._lock)
        self._queue: deque[_Slot] = deque()
        self._draining = False
        self._stopped_by: BaseException | None = None

    def reserve(self, device: torch.device) -> _Slot:
        slot = _Slot(device)
        with self._lock:
            self._queue.append(slot)
            if self._stopped_by is not None:
                self._drain()
        return slot

    def release(self, slot: _Slot, launch: Launch) -> None:
        with self._lock:
            slot.launch = launch
            self._drain()

    def launch(self, launch: Launch, device: torch.device) -> torch.futures.Future[torch.Tensor]:
        slot = self.reserve(device)
        self.release(slot, launch)
        return slot.future

    def cancel(self, slot: _Slot, error: BaseException) -> None:
        """``slot`` will never be launched (``error`` says why): fail it and stop the launcher."""
        with self._lock:
            if slot in self._queue:
                self._queue.remove(slot)
            slot.fail(error)
            self._stop(error)
            self._drain()

    def wait_until_launched(self) -> None:
        """Block until every reserved collective is launched or failed (not finished)."""
        with self._all_launched:
            self._all_launched.wait_for(lambda: not self._queue)

    def _stop(self, error: BaseException) -> None:
        if self._stopped_by is None:
            self._stopped_by = error

    def _not_launched(self) -> RuntimeError:
        return RuntimeError(
            "collective not launched: an earlier collective of this hook failed on this rank "
            f"({type(self._stopped_by).__name__}: {self._stopped_by}), and launching later ones would pair "
            "them with different collectives on the other ranks"
        )

    def _drain(self) -> None:
        if self._draining:  # a collective completed inline, inside run(): the loop below continues
            return
        self._draining = True
        try:
            while self._queue and (self._stopped_by is not None or self._queue[0].launch is not None):
                slot = self._queue.popleft()
                if self._stopped_by is not None:
                    slot.fail(self._not_launched())
                    continue
                error = slot.run()
                if error is not None:
                    self._stop(error)
        finally:
            self._draining = False
        if not self._queue:
            self._all_launched.notify_all()


def _new_future(device: torch.device) -> torch.futures.Future[torch.Tensor]:
    return torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()


# -- state -----------------------------------------------------------------------------------------------
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
        self._launcher = _OrderedLauncher()
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
        self._launcher = _OrderedLauncher()
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


# -- orthonormalization ------------------------------------------------------------------------------------
def _orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
    """Orthonormalize, in place, the columns of each matrix of a ``(batch, rows, cols)`` tensor.

    QR is usually faster from 3 columns on, but has no half-precision kernels.
    """
    if matrices.dim() != 3 or matrices.shape[2] > matrices.shape[1]:
        raise ValueError(
            f"expected a batch of matrices with no more columns than rows, got {tuple(matrices.shape)}"
        )
    if matrices.shape[2] <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        _orthogonalize_gram_schmidt(matrices, epsilon)
    else:
        r = matrices.new_empty(matrices.shape[0], matrices.shape[2], matrices.shape[2])
        torch.linalg.qr(matrices, out=(matrices, r))


def _orthogonalize_gram_schmidt(matrices: torch.Tensor, epsilon: float) -> None:
    """Gram-Schmidt; a column of zeros stays zeros (torch's divides it by its zero norm when epsilon is 0)."""
    num_cols = matrices.shape[2]
    for i in range(num_cols):
        col = matrices[:, :, i : i + 1]
        norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
        if epsilon == 0:
            col /= norm.masked_fill_(norm == 0, 1)
        else:
            col /= norm + epsilon
        if i + 1 < num_cols:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def _fill_random(matrices: Sequence[torch.Tensor], state: PowerSGDState) -> None:
    """Fill with standard normal values, the same on every rank, from one seed drawn from ``state.rng``."""
    generator = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
    for matrix in matrices:
        matrix.copy_(torch.randn(matrix.shape, generator=generator, dtype=matrix.dtype))


def _prepare_qs(qs: Sequence[torch.Tensor], memory: torch.Tensor, fresh: bool, state: PowerSGDState) -> None:
    """Orthonormalize the bucket's ``Q`` matrices (views into ``memory``), drawn at random if ``fresh``.

    A warm-started column that is zero (its gradient was exactly zero last step, as for a branch not used
    yet) would stay zero under power iteration, and that direction would never be sent again: torch's hook
    then divides by zero, or, with an epsilon, stalls. Such columns are drawn afresh. Q is the same on every
    rank, so every rank draws for the same columns.
    """
    if fresh:
        _fill_random(qs, state)
    for q in qs:
        _orthogonalize(q, state.orthogonalization_epsilon)
    if fresh or not qs:
        return
    live_columns = sum(q.shape[0] * q.shape[2] for q in qs)
    if torch.sum(memory.square(), dtype=torch.float32).item() > live_columns - 0.5:
        return  # every column has norm 1: nothing to revive (checked with one reduction)
    generator = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
    for q in qs:
        dead = torch.nonzero(q.abs().amax(dim=1) == 0).tolist()
        for batch, column in dead:
            q[batch, :, column].copy_(torch.randn(q.shape[1], generator=generator, dtype=q.dtype))
        if dead:
            _orthogonalize(q, state.orthogonalization_epsilon)


# -- per-bucket buffers --------------------------------------------------------------------------------------
def _layout_of(bucket: dist.GradBucket) -> Layout:
    return tuple(tuple(grad.shape) for grad in bucket.gradients())


def _describe(layout: Layout, limit: int = 6) -> str:
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


def _check_saved_state(
    state: PowerSGDState, index: int, layout: Layout, error_numel: int, q_numel: int
) -> None:
    """Refuse saved buffers that were not made for this bucket, before anything is changed."""
    saved = state.bucket_layouts.get(index)
    if saved is not None and saved != layout:
        raise _layout_error(
            index, f"it was made for {_describe(saved)}, but this bucket has {_describe(layout)}"
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


def _add_error(
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


def _q_memory(
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
def _count(state: PowerSGDState, bucket: dist.GradBucket, before: int, after: int) -> None:
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


def _end_call(state: PowerSGDState, bucket: dist.GradBucket) -> None:
    """Count the iteration; the last bucket's call returns once the iteration's collectives are launched."""
    state.maybe_increase_iter(bucket)
    if bucket.is_last():
        state._launcher.wait_until_launched()


def _allreduce_mean(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Plain averaging, before compression starts (divided first, like torch's allreduce hook)."""
    buffer = bucket.buffer()
    group = state.process_group
    buffer.div_(comm.group_size(group))
    future = state._launcher.launch(lambda: comm.all_reduce(buffer, group), buffer.device)
    _end_call(state, bucket)
    return future


def _sum_p_then_q(
    state: PowerSGDState, p: torch.Tensor, q: torch.Tensor, compute_q: Callable[[], None]
) -> torch.futures.Future[torch.Tensor]:
    """Sum ``p`` over the ranks, then run ``compute_q`` (orthonormalize P, ``Q = M^T P`` into ``q``) and sum
    ``q``; the future completes with the summed ``q``. Both collectives keep their place in the launch order.
    """
    launcher, group = state._launcher, state.process_group
    p_summed = launcher.launch(lambda: comm.all_reduce(p, group), p.device)
    q_slot = launcher.reserve(p.device)

    def after_p(fut: torch.futures.Future[torch.Tensor]) -> None:
        try:
            fut.value()
            compute_q()
        except BaseException as exc:
            launcher.cancel(q_slot, exc)
        else:
            launcher.release(q_slot, lambda: comm.all_reduce(q, group))

    p_summed.then(after_p)
    return q_slot.future


# -- layer-wise compression -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Batch:
    """Same-shaped gradient matrices of a bucket compressed together: their offsets in the bucket."""

    offsets: tuple[int, ...]
    rows: int
    cols: int
    rank: int

    @property
    def matrix_numel(self) -> int:
        return self.rows * self.cols

    @property
    def p_numel(self) -> int:
        return len(self.offsets) * self.rows * self.rank

    @property
    def q_numel(self) -> int:
        return len(self.offsets) * self.cols * self.rank

    def matrices(self, flat: torch.Tensor) -> torch.Tensor:
        """``(batch, rows, cols)``: a view of ``flat`` for one matrix, a stacked copy for several."""
        views = [flat[o : o + self.matrix_numel].view(self.rows, self.cols) for o in self.offsets]
        return views[0].unsqueeze(0) if len(views) == 1 else torch.stack(views)

    def decompress(self, p: torch.Tensor, q: torch.Tensor, matrices: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``P Q^T`` for each matrix into ``out`` (the bucket), through ``matrices`` if it is a copy."""
        if len(self.offsets) == 1:
            o = self.offsets[0]
            torch.bmm(p, q.transpose(1, 2), out=out[o : o + self.matrix_numel].view(1, self.rows, self.cols))
            return
        torch.bmm(p, q.transpose(1, 2), out=matrices)
        for i, o in enumerate(self.offsets):
            out[o : o + self.matrix_numel].view(self.rows, self.cols).copy_(matrices[i])


@dataclass(frozen=True)
class _Plan:
    """How a bucket is split: batches of matrices to compress, and (offset, numel) spans sent as they are."""

    batches: tuple[_Batch, ...]
    uncompressed: tuple[tuple[int, int], ...]
    numel_before: int
    numel_after: int


def _plan(state: PowerSGDState, layout: Layout) -> _Plan:
    """Torch's choice and order: compressed matrices grouped by shape, shapes in order of first appearance.

    A tensor with no rows or columns (a 0-dim scalar, an empty tensor) has rank 0 and goes with the
    uncompressed ones; torch's hook fails on 0-dim tensors with an IndexError.
    """
    by_shape: dict[tuple[int, int, int], list[int]] = {}
    uncompressed: list[tuple[int, int]] = []
    offset = before = after = 0
    for shape in layout:
        numel = math.prod(shape)
        before += numel
        n = shape[0] if len(shape) > 0 else 0
        m = numel // n if n > 0 else 0
        rank = min(n, m, state.matrix_approximation_rank)
        compressed_numel = (n + m) * rank
        if rank > 0 and compressed_numel * state.min_compression_rate < numel:
            by_shape.setdefault((n, m, rank), []).append(offset)
            after += compressed_numel
        else:
            uncompressed.append((offset, numel))
            after += numel
        offset += numel
    if state.batch_tensors_with_same_shape:
        groups = [(offsets, key) for key, offsets in by_shape.items()]
    else:
        groups = [([o], key) for key, offsets in by_shape.items() for o in offsets]
    batches = tuple(_Batch(tuple(offsets), n, m, rank) for offsets, (n, m, rank) in groups)
    return _Plan(batches, tuple(uncompressed), before, after)


def _split(memory: torch.Tensor, sizes: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Consecutive ``(batch, rows, rank)`` views of a flat tensor."""
    views, offset = [], 0
    for batch, rows, rank in sizes:
        views.append(memory[offset : offset + batch * rows * rank].view(batch, rows, rank))
        offset += batch * rows * rank
    return views


def _scatter(flat: torch.Tensor, spans: Sequence[tuple[int, int]], out: torch.Tensor) -> None:
    """Copy consecutive pieces of ``flat`` to the ``(offset, numel)`` spans of ``out``."""
    position = 0
    for offset, numel in spans:
        out[offset : offset + numel].copy_(flat[position : position + numel])
        position += numel


def powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients, each matrix compressed to rank ``state.matrix_approximation_rank``.

    Matrices worth compressing (see :class:`PowerSGDState`) are compressed layer by layer; the other
    tensors are averaged by one allreduce. Plain averaging for the first ``state.start_powerSGD_iter``
    iterations.

    Example::

        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> ddp_model.register_comm_hook(state, powerSGD_hook)
    """
    if state.iter < state.start_powerSGD_iter:
        return _allreduce_mean(state, bucket)

    buffer = bucket.buffer()
    index = bucket.index()
    layout = _layout_of(bucket)
    if sum(math.prod(shape) for shape in layout) != buffer.numel():
        raise ValueError(
            f"powerSGD_hook: bucket {index} holds {buffer.numel()} elements but its gradients "
            f"{_describe(layout)}: the gradients must tile the bucket buffer"
        )
    plan = _plan(state, layout)
    q_numel = sum(b.q_numel for b in plan.batches)
    _check_saved_state(state, index, layout, buffer.numel(), q_numel)
    _count(state, bucket, plan.numel_before, plan.numel_after)

    source = _add_error(state, index, layout, buffer, buffer.numel()) if state.use_error_feedback else buffer
    q_memory, fresh = _q_memory(state, index, layout, q_numel, buffer)
    p_memory = buffer.new_empty(sum(b.p_numel for b in plan.batches))
    ps = _split(p_memory, [(len(b.offsets), b.rows, b.rank) for b in plan.batches])
    qs = _split(q_memory, [(len(b.offsets), b.cols, b.rank) for b in plan.batches])
    matrices = [batch.matrices(source) for batch in plan.batches]

    _prepare_qs(qs, q_memory, fresh, state)
    for m, q, p in zip(matrices, qs, ps, strict=True):
        torch.bmm(m, q, out=p)

    pending: list[torch.futures.Future[torch.Tensor]] = []
    uncompressed = torch.cat([source[o : o + n] for o, n in plan.uncompressed]) if plan.uncompressed else None
    if uncompressed is not None:
        pending.append(
            state._launcher.launch(lambda: comm.all_reduce(uncompressed, state.process_group), buffer.device)
        )
    if plan.batches:

        def compute_qs() -> None:
            for p in ps:
                _orthogonalize(p, state.orthogonalization_epsilon)
            for m, p, q in zip(matrices, ps, qs, strict=True):
                torch.bmm(m.transpose(1, 2), p, out=q)

        pending.append(_sum_p_then_q(state, p_memory, q_memory, compute_qs))
    world_size = comm.group_size(state.process_group)

    def decompress(fut: torch.futures.Future[list[torch.futures.Future[torch.Tensor]]]) -> torch.Tensor:
        for done in fut.value():
            done.value()
        q_memory.div_(world_size)
        for batch, p, q, m in zip(plan.batches, ps, qs, matrices, strict=True):
            batch.decompress(p, q, m, buffer)
        if uncompressed is not None:
            _scatter(uncompressed.div_(world_size), plan.uncompressed, buffer)
        if state.use_error_feedback:
            source.sub_(buffer)
        return buffer

    result = torch.futures.collect_all(pending).then(decompress)
    _end_call(state, bucket)
    return result


# -- whole-bucket compression ------------------------------------------------------------------------------------
def _square_side(length: int) -> int:
    """Side of the smallest square holding ``length`` elements."""
    return math.isqrt(length - 1) + 1 if length > 0 else 0


def _square_matrix(
    state: PowerSGDState, index: int, layout: Layout, buffer: torch.Tensor, side: int
) -> torch.Tensor:
    """The bucket (plus error) zero-padded to ``side x side``: the error buffer, the bucket itself, or a copy."""
    if state.use_error_feedback:
        return _add_error(state, index, layout, buffer, side * side).view(side, side)
    if buffer.numel() == side * side:
        return buffer.view(side, side)
    padded = buffer.new_zeros(side * side)
    padded[: buffer.numel()].copy_(buffer)
    return padded.view(side, side)


def _decompress_with_error(
    p: torch.Tensor, q: torch.Tensor, buffer: torch.Tensor, error: torch.Tensor, side: int
) -> None:
    """``buffer = (P Q^T)[:length]`` and ``error -= P Q^T``, without a padded temporary.

    Whole rows go straight into the bucket; the (at most two) rows that hold the padding go through a small
    temporary.
    """
    length = buffer.numel()
    full_rows = length // side
    head = full_rows * side
    torch.matmul(p[:full_rows], q.t(), out=buffer[:head].view(full_rows, side))
    tail = torch.matmul(p[full_rows:], q.t()).view(-1)
    buffer[head:].copy_(tail[: length - head])
    flat_error = error.view(-1)
    flat_error[:length].sub_(buffer)
    flat_error[length:].sub_(tail[length - head :])


def batched_powerSGD_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients, the whole bucket compressed as one zero-padded square matrix.

    Faster than :func:`powerSGD_hook` but usually much less accurate unless ``matrix_approximation_rank``
    is 1: unrelated layers share one matrix. Plain averaging for the first ``state.start_powerSGD_iter``
    iterations.

    Example::

        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> ddp_model.register_comm_hook(state, batched_powerSGD_hook)
    """
    if state.iter < state.start_powerSGD_iter:
        return _allreduce_mean(state, bucket)

    buffer = bucket.buffer()
    index = bucket.index()
    layout = _layout_of(bucket)
    length = buffer.numel()
    side = _square_side(length)
    rank = min(state.matrix_approximation_rank, side)
    _check_saved_state(state, index, layout, side * side, side * rank)
    _count(state, bucket, length, 2 * side * rank)

    matrix = _square_matrix(state, index, layout, buffer, side)
    q_memory, fresh = _q_memory(state, index, layout, side * rank, buffer)
    q = q_memory.view(side, rank)
    _prepare_qs([q.unsqueeze(0)], q_memory, fresh, state)
    p = torch.matmul(matrix, q)

    def compute_q() -> None:
        _orthogonalize(p.unsqueeze(0), state.orthogonalization_epsilon)
        torch.matmul(matrix.t(), p, out=q)

    q_summed = _sum_p_then_q(state, p, q_memory, compute_q)
    world_size = comm.group_size(state.process_group)

    def decompress(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        fut.value()
        q.div_(world_size)
        if state.use_error_feedback:
            _decompress_with_error(p, q, buffer, matrix, side)
        else:
            torch.matmul(p, q.t(), out=matrix)
            if matrix.data_ptr() != buffer.data_ptr():
                buffer.copy_(matrix.view(-1)[:length])
        return buffer

    result = q_summed.then(decompress)
    _end_call(state, bucket)
    return result
