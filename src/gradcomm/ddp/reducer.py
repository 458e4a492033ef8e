"""The reducer: gradient buckets, readiness tracking, and launching communication hooks during backward.

Mechanism only; what a bucket's communication does is the hook's business. Per synchronised iteration:

1. ``prepare_for_backward`` (called by DDP's forward) arms the reducer and, with
   ``find_unused_parameters``, finds the parameters the output does not depend on.
2. During backward each parameter's hook (:mod:`gradcomm.ddp.grad_hooks`: on its ``AccumulateGrad`` node, after
   the user's post-accumulate-grad hooks, as torch's) copies its gradient into its bucket (small ones a run of
   neighbours at a time: :mod:`gradcomm.ddp.staging`). When a bucket is complete, it and every complete
   bucket after it in order are launched (hook, or the default averaging allreduce) while backward goes on;
   strictly in index order, so all ranks match collectives.
3. When the last bucket is launched, an autograd-engine callback is queued, as torch does, in the backward
   that launched it (the outer one under reentrant checkpointing, if outer gradients were still to come):
   it waits for every bucket's future and writes ``.grad`` (or makes it a view into the bucket). A backward
   that ends with buckets unlaunched is reported at the next forward, naming the parameters.

A static graph's first iteration and ``find_unused_parameters`` without an output (a backward inside the
forward) learn which parameters have no gradient only at the end of backward (:meth:`Reducer._end_of_backward`).
The buckets start as torch's first-iteration layout (:func:`~gradcomm.ddp.bucketing.initial_buckets`: one per
dtype and device unless ``find_unused_parameters``); after the first synchronised iteration they are rebuilt
once, in the order gradients actually became ready (rank 0's order, broadcast so all ranks agree), as torch's
DDP does. The same layouts give the same sums in the same order: bit for bit torch's results.

Failures never hang and never leave a half-reduced step behind. Every wait ends when the process group's
timeout passes (a collective that a peer never joins fails then); a failure is reported with the step and
bucket (:class:`~gradcomm.comm.faults.PeerLostError` when a peer was lost,
:class:`~gradcomm.hooks.contract.CommHookError` when the hook failed), and the reducer then refuses further
synchronised steps, since its collectives may no longer match its peers'. A rank that has run out of inputs
under ``DistributedDataParallel.join()`` calls :meth:`Reducer.shadow_backward` instead of backward: the hook
runs on zero buckets, in bucket order, so its collectives match the other ranks'.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm.comm.collectives import collective_device
from gradcomm.comm.faults import PeerLostError, reporting_lost_peers
from gradcomm.comm.futures import wait_quietly
from gradcomm.ddp.bucketing import (
    Bucket,
    assign_buckets,
    bucket_size_limits,
    grad_held_elsewhere,
    initial_buckets,
    prepare_grad_references,
    same_tensor,
)
from gradcomm.ddp.finite import check_bucket_finite
from gradcomm.ddp.grad_hooks import EndOfBackwardHook, GradReadyHook, after_accumulation
from gradcomm.ddp.hook_runner import HookRunner
from gradcomm.ddp.reducer_surface import (
    ReducerSurface,
    graph_changed_error,
    marked_twice_error,
    unfinished_reduction_error,
)
from gradcomm.ddp.sparse import SparseBucket
from gradcomm.ddp.unused import StaticCounting, UsedParameters, parameters_reached, tensors_in

__all__ = ["Reducer"]

logger = logging.getLogger(__name__)


class Reducer(ReducerSurface):
    """Buckets the gradients of ``params`` and reduces them with a communication hook during backward."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        process_group: ProcessGroup | None,
        bucket_cap_mb: float | None,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool | None,
        check_finite: bool = False,
        settings: dict[str, str] | None = None,
        *,
        sparse: Sequence[bool] | None = None,
        bucket_caps: Sequence[int] | None = None,
        static_graph: bool = False,
    ) -> None:
        self._params = list(params)
        self._names = list(names)
        self._group = process_group
        self._world_size = dist.get_world_size(process_group)
        self._bucket_cap_mb = bucket_cap_mb
        self._first_limit, self._limit = bucket_size_limits(bucket_cap_mb)
        self._bucket_caps = list(bucket_caps) if bucket_caps else None
        self._sparse = list(sparse) if sparse is not None and any(sparse) else None
        self._find_unused = find_unused_parameters
        # True: .grad are bucket views (torch's option); None: views where safe (the default, see
        # _build_buckets and _mark_ready); False: .grad are copies, as torch's default
        self._as_view = gradient_as_bucket_view
        if gradient_as_bucket_view is None:
            prepare_grad_references()
        self._check_finite = check_finite
        # what every rank must agree on besides the hook and the buckets (the DDP's options that add collectives)
        self._settings = dict(settings or {})
        self.set_active_ranks(None)  # the default reduction's divisor and factor (join() may change them)
        self._runner = HookRunner("gradcomm.DistributedDataParallel", process_group)
        self._synced_backwards = 0
        # torch does not rebuild with find_unused_parameters (unless the graph is static): the ready order then
        # varies between iterations.
        self._rebuild_done = find_unused_parameters and not static_graph
        self._static = UsedParameters(len(self._params), static_graph)
        self._ready_order: list[int] = []
        self._has_rebuilt = False
        self._rebuild_order: list[int] | None = None
        self._unfinished: list[int] = []  # the parameters a started backward left without gradient
        self._armed = False
        # which parameters got a gradient since the last synchronised step (no_sync iterations included)
        self._used_map = torch.zeros(len(self._params), dtype=torch.int32)
        self._first_counts: list[int] = []
        self._countdown: list[int] = []
        self._warned_create_graph = False
        self._build_buckets(
            initial_buckets(
                self._params,
                self._first_limit,
                self._limit,
                one_per_kind=static_graph or not find_unused_parameters,
                limits=self._bucket_caps,
                alone=self._sparse,
            )
        )
        self._reset_iteration()
        self_ref = weakref.ref(self)
        self._grad_hook_handles, self._accumulators = [], []  # the nodes are kept: see after_accumulation
        for index, param in enumerate(self._params):
            handle, accumulator = after_accumulation(param, GradReadyHook(self_ref, index))
            self._grad_hook_handles.append(handle)
            self._accumulators.append(accumulator)

    def _fail(self, exc: BaseException) -> None:
        self._runner.fail(exc)
        self._armed = False

    def prepare_for_forward(self, source_rank: int = 0) -> None:
        """Called before a forward whose backward will synchronise: report trouble, compare the ranks' setup
        (once), rebuild buckets (once, broadcasting group rank ``source_rank``'s order)."""
        self.check_usable()
        self._take_unfinished()
        if self._unfinished:
            indices, self._unfinished = self._unfinished, []
            names = [self._names[i] for i in indices]
            rank = dist.get_rank(self._group)
            raise unfinished_reduction_error(names, indices, rank, self._static.enabled, self._find_unused)
        if self._synced_backwards == 0 and not self._has_rebuilt:
            self._adopt_hook_state_layout()
        if not self._runner.setup_checked:
            self._runner.check_same_setup(self._setup())
        if self._rebuild_order is not None:
            with reporting_lost_peers(self._synced_backwards, "rebuilding buckets", self._group):
                self._rebuild_in_order(self._rebuild_order, source_rank=source_rank)
            self._rebuild_order = None

    def arm_for_forward(self) -> None:
        """Arm the reducer for a backward that runs inside the module's forward.

        Lightning's manual optimization (and any ``training_step`` called through the DDP's forward) runs
        backward before the forward returns: that backward must be synchronised like any other. There is no
        output yet to search for unused parameters, so under ``find_unused_parameters`` the parameters it
        has not reached by its end are treated as unused then (their buckets launch last, without overlap).
        """
        self._arm(None)

    def prepare_for_backward(self, outputs: Any) -> None:
        """Arm the reducer for the backward of ``outputs`` (any nesting of tensors; torch's reducer method,
        which Lightning's manual optimization and Accelerate's ``trigger_sync_in_backward`` call)."""
        self.check_usable()
        self._arm(outputs)

    def _arm(self, outputs: Any) -> None:
        """Arm for the coming backward; ``outputs`` is ``None`` when it runs inside the forward (no output yet)."""
        self._take_unfinished()
        self._reset_iteration()
        self._armed = True
        if self._static.enabled:
            if not self._static.recorded:
                # torch's first static iteration: count each parameter's gradients, reduce everything at the end
                self._first_counts = [0] * len(self._params)
                self._counting = StaticCounting.FIRST
                self._end_of_backward_at(outputs)
            else:
                self._unused = self._static.locally_unused
                self._countdown = list(self._static.hook_counts)
                self._counting = StaticCounting.DOWN
        elif self._find_unused:
            if outputs is None:
                self._unused_at_end = True
                self._end_of_backward_at(None)
            else:
                reached = parameters_reached(outputs)
                self._unused = [i for i, p in enumerate(self._params) if id(p) not in reached]

    def _end_of_backward_at(self, outputs: Any) -> None:
        """Arrange for :meth:`_end_of_backward` to run when the backward through ``outputs`` ends.

        As torch's ``_DDPSink``: a pre-hook on the outputs' autograd nodes queues it in the backward that
        reaches them, the outermost one even under reentrant checkpointing. Without outputs (a backward inside
        the forward) it is queued at the first gradient instead.
        """
        self._end_at_first_grad = True
        self_ref = weakref.ref(self)
        for tensor in tensors_in(outputs):
            if tensor.grad_fn is not None:
                tensor.grad_fn.register_prehook(EndOfBackwardHook(self_ref))
                self._end_at_first_grad = False

    def _queue_end_of_backward(self) -> None:
        if self._armed and not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _count_first(self, index: int) -> bool:
        """First static iteration: count the gradient, defer marking to the end of backward (as torch)."""
        self._first_counts[index] += 1
        if self._first_counts[index] == 1 and not self._rebuild_done:
            self._ready_order.append(index)
        return True

    def _count_down(self, index: int) -> bool:
        """Later static iterations: a parameter is ready at its last gradient of the first iteration's count."""
        left = self._countdown[index] - 1
        if left < 0:
            raise graph_changed_error(self._names[index], self._static.hook_counts[index])
        self._countdown[index] = left
        return left > 0

    def disarm(self) -> None:
        """Forget a prepared backward (the next backward accumulates locally)."""
        self._take_unfinished()
        self._armed = False

    def _take_unfinished(self) -> None:
        """Record the parameters a started backward left without gradient (its buckets were never reduced)."""
        if self._armed and self._started:
            self._unfinished = self._unready()
            self._armed = False

    def _unready(self) -> list[int]:
        return [i for i in range(len(self._params)) if not self._ready[i]]

    # -- bucket layout -------------------------------------------------------------------------------------
    def _build_buckets(self, groups: list[list[int]]) -> None:
        """Make the buckets: ``groups`` holds each bucket's parameter indices, in bucket order."""
        self._layout_order = [index for group in groups for index in group]
        last = len(groups) - 1
        self._buckets: list[Bucket | SparseBucket] = [
            SparseBucket(index, indices[0], self._params, index == last)
            if self._sparse and self._sparse[indices[0]]
            else Bucket(index, indices, self._params, index == last, self._grads_as_views(indices))
            for index, indices in enumerate(groups)
        ]
        # each parameter's bucket and position in it (not its view: see Bucket.seen_by_user)
        self._location: list[tuple[Any, int]] = [None] * len(self._params)  # type: ignore[list-item]
        for bucket in self._buckets:
            for position, index in enumerate(bucket.param_indices):
                self._location[index] = (bucket, position)

    def _grads_as_views(self, indices: list[int]) -> bool:
        """Whether these parameters' ``.grad`` become views of their bucket. By default (``None``) only for
        contiguous parameters, where that changes nothing a user sees; held ``.grad`` are protected in
        :meth:`_mark_ready`. (A transposed or channels-last parameter's view has its memory format too, see
        :func:`~gradcomm.ddp.bucketing.bucket_view`, but such buckets keep torch's copies.)"""
        if self._as_view is None:
            return all(self._params[i].is_contiguous() for i in indices)
        return self._as_view

    def _adopt_hook_state_layout(self) -> None:
        """Before the first iteration: reduce in the buckets the hook state was made in (its ``bucket_layout``:
        each bucket's parameter names), where this DDP's own rebuild would have made them from that order.

        A state resumed through ``torch.save`` then reduces in its buckets from the first step, as after
        :meth:`load_bucket_layout`; otherwise the first iteration would run in the initial layout, in which
        per-bucket state (batched PowerSGD's ``Q``) does not fit and sums round differently from three ranks
        on. A layout of other parameters, or one this DDP would bucket differently (another
        ``bucket_cap_mb``), is left alone: the state is keyed by parameter and resumes in any layout.
        """
        layout = getattr(self._runner.state, "bucket_layout", None)
        if not layout or self._rebuild_done:  # no rebuild to anticipate (find_unused_parameters: the initial)
            return
        index = {name: i for i, name in enumerate(self._names)}
        if not all(isinstance(key, str) and key in index for keys in layout for key in keys):
            return
        groups = [[index[key] for key in keys] for keys in layout]
        order = [i for group in groups for i in group]
        if sorted(order) != list(range(len(self._params))):
            return
        rebuilt = assign_buckets(
            self._params, order, self._first_limit, self._limit, limits=self._bucket_caps, alone=self._sparse
        )
        if rebuilt != groups:
            logger.debug("the hook state's bucket layout is not what this DDP would build; keeping its own")
            return
        self._rebuild_in_order(order, broadcast=False)
        self._rebuild_done, self._rebuild_order, self._ready_order = True, None, []
        self._runner.setup_checked = False  # the ranks compare the adopted buckets before the first step
        logger.debug("adopted the hook state's %d buckets", len(groups))

    def _rebuild_in_order(self, ready_order: list[int], broadcast: bool = True, source_rank: int = 0) -> None:
        order = torch.tensor(ready_order, dtype=torch.int64, device=collective_device(self._group))
        if broadcast:  # one rank's order (rank 0's), so that every rank has the same buckets
            src = dist.get_global_rank(self._group or dist.group.WORLD, source_rank)
            dist.broadcast(order, src=src, group=self._group)
        # gradient_as_bucket_view=True: .grad move into the new buckets, as torch's; by default they stay
        # where they are until their next gradient (a .grad held there must keep receiving the results)
        old_grads = [p.grad for p in self._params] if self._as_view else []
        self._build_buckets(
            assign_buckets(
                self._params, order.tolist(), self._first_limit, self._limit, limits=self._bucket_caps, alone=self._sparse
            )
        )
        self._has_rebuilt = True
        for index, grad in enumerate(old_grads):
            bucket, position = self._location[index]
            if grad is not None and bucket.grads_are_views:
                view = bucket.views[position]
                view.copy_(grad)
                self._params[index].grad = view
        if old_grads:
            self._note_views_handed_out()
        self._reset_iteration()
        logger.debug("rebuilt %d buckets in gradient-ready order", len(self._buckets))

    # -- per-iteration mechanics ----------------------------------------------------------------------------
    def _reset_iteration(self) -> None:
        self._ready = bytearray(len(self._params))
        for bucket in self._buckets:
            if not bucket.sparse:
                bucket.staged.discard()
        self._pending = [len(bucket.param_indices) for bucket in self._buckets]
        self._futures: list[torch.futures.Future | None] = [None] * len(self._buckets)
        self._next_bucket = 0
        self._started = False  # a gradient of the armed backward has arrived
        self._finalize_queued = False
        self._end_queued = False
        self._end_at_first_grad = False
        # static graph: how a gradient is counted before its parameter is ready (None: it is ready at once)
        self._counting: StaticCounting | None = None
        self._unused: list[int] = []
        self._unused_at_end = False
        self._locally_used = self._used_map if self._static.reduces_used_map(self._find_unused) else None

    def _on_grad_ready(self, index: int) -> None:
        if not self._armed:
            if self._find_unused:  # torch carries the used map across no_sync iterations
                self._used_map[index] = 1
            return
        if not self._started:
            self._started = True
            if self._end_at_first_grad:
                self._queue_end_of_backward()
            for unused in self._unused:
                self._mark(unused)
        if self._locally_used is not None:
            self._locally_used[index] = 1
        if self._counting is StaticCounting.FIRST and self._count_first(index):
            return
        if self._counting is StaticCounting.DOWN and self._count_down(index):
            return
        self._mark(index)

    def _mark(self, index: int) -> None:
        """The per-gradient step of a parameter: dense into its bucket view, or sparse into a bucket of its own."""
        if self._sparse and self._sparse[index]:
            self._mark_sparse_ready(index)
        else:
            self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        if self._ready[index]:
            raise marked_twice_error(self._names[index])
        self._ready[index] = 1
        if not self._rebuild_done:
            self._ready_order.append(index)
        bucket, position = self._location[index]
        if self._as_view is None and self._pending[bucket.index] == len(bucket.views):
            self._protect_handed_out(bucket)
        view = bucket.views[position]
        param = self._params[index]
        grad = param.grad
        if grad is None:
            view.zero_()
        else:
            in_bucket = grad is view or same_tensor(grad, view)
            if bucket.grads_are_views and not in_bucket:
                if self._as_view is None and grad_held_elsewhere(grad):
                    bucket.copy_back.add(position)  # the user holds this .grad: torch's copy back into it
                else:
                    param.grad = view
            if grad.requires_grad:
                grad = self._graph_gradient_value(grad)
            if in_bucket:
                grad = None
        bucket.staged.put(position, grad, self._write_scale())
        self._pending[bucket.index] -= 1
        if self._pending[bucket.index] == 0:
            self._launch_ready_buckets()

    def _write_scale(self) -> float | None:
        """The factor gradients are multiplied by on their way into the bucket: with the default reduction,
        as torch, each is pre-divided by the world size before the sum; a registered hook gets them as they are."""
        return self._scale if self._runner.averages_itself else None

    def _protect_handed_out(self, bucket: Bucket) -> None:
        """Before a step's first write into ``bucket``: if the user still holds one of last step's ``.grad``
        (views of it), give the bucket new memory, so that what they hold keeps its values, as with torch's
        copies."""
        if bucket.seen_by_user():
            bucket.renew()
            logger.debug("bucket %d: a .grad of the last step is still held; the bucket gets new memory", bucket.index)

    def _graph_gradient_value(self, grad: torch.Tensor) -> torch.Tensor:
        """``backward(create_graph=True)``: as torch, the bucket takes the gradient's value, outside the graph
        (the higher-order gradient is not synchronised)."""
        if not self._warned_create_graph:
            self._warned_create_graph = True
            warnings.warn(
                "Using gradcomm.DistributedDataParallel with create_graph=True is not well-supported (as in torch): "
                "the gradients are averaged, but the higher-order gradient is not synchronised across ranks.",
                stacklevel=2,
            )
        return grad.detach()

    def _mark_sparse_ready(self, index: int) -> None:
        """:meth:`_mark_ready` for a parameter with a sparse gradient (a bucket of its own; see ddp/sparse.py)."""
        if self._ready[index]:
            raise marked_twice_error(self._names[index])
        self._ready[index] = 1
        if not self._rebuild_done:
            self._ready_order.append(index)
        bucket = self._location[index][0]
        divisor = self._grad_divisor if self._runner.averages_itself else None
        bucket.take(self._params[index].grad, divisor, self._names[index])
        self._pending[bucket.index] -= 1
        if self._pending[bucket.index] == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        try:
            while self._next_bucket < len(self._buckets) and self._pending[self._next_bucket] == 0:
                bucket = self._buckets[self._next_bucket]
                if not bucket.sparse:
                    bucket.staged.flush(self._write_scale())
                if self._check_finite:
                    check_bucket_finite(bucket, self._names, self._synced_backwards)
                if bucket.index == 0:
                    self.stats.begin_step()
                future = self._runner.launch(bucket.grad_bucket(), self._synced_backwards)
                self._futures[bucket.index] = future
                self._next_bucket += 1
                if future.done():  # if it failed, stop before the next bucket's collectives are launched
                    self._raise_if_failed(bucket, future)
            if self._next_bucket == len(self._buckets) and not self._finalize_queued:
                # as torch: finalize at the end of the backward in which the last bucket became ready, which
                # under reentrant checkpointing is the outer one whenever outer gradients are still to come
                self._finalize_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _raise_if_failed(self, bucket: Bucket, future: torch.futures.Future) -> None:
        """Raise if the completed ``future`` of ``bucket`` failed, naming the first launched bucket that did."""
        step = self._synced_backwards
        try:
            self._runner.result(future, bucket.index, bucket.buffer, step)
        except BaseException:
            for earlier in self._buckets[: bucket.index]:
                if self._futures[earlier.index].done():
                    self._runner.result(self._futures[earlier.index], earlier.index, earlier.buffer, step)
            raise

    def _end_of_backward(self) -> None:
        """Autograd-engine callback at the end of the outermost backward, when parameters without a gradient
        are only known then: a static graph's first iteration (every bucket is reduced now, as torch's
        ``_delay_all_reduce``) and ``find_unused_parameters`` without an output to search."""
        if not self._armed:
            return
        queued, self._finalize_queued = self._finalize_queued, True  # finalize here or in the one queued
        try:
            if self._counting is StaticCounting.FIRST:
                self._counting = None
                self._static.hook_counts = list(self._first_counts)
                order, self._ready_order = self._ready_order, []
                seen = set(order)
                for index in [*order, *(i for i in range(len(self._params)) if i not in seen)]:
                    self._mark(index)
            elif self._unused_at_end:
                index = self._ready.find(0)
                while index != -1:
                    self._mark(index)
                    index = self._ready.find(0, index + 1)
        except BaseException as exc:
            self._fail(exc)
            raise
        if self._next_bucket == len(self._buckets) and not queued:
            self._finalize()

    def _finalize(self) -> None:
        """Autograd-engine callback once the last bucket is launched: wait for the buckets and write ``.grad``."""
        self._armed = False
        step = self._synced_backwards
        peer_lost = False
        try:
            self._write_results(step)
            self.stats.end_step()
            self._synced_backwards += 1
            if not self._rebuild_done:
                self._rebuild_done = True
                self._rebuild_order = self._ready_order
        except BaseException as exc:
            peer_lost = isinstance(exc, PeerLostError)
            self._fail(exc)
            raise
        finally:
            if not peer_lost:  # after a lost peer the remaining collectives can only time out one by one
                self._drain_futures()
            self._futures = [None] * len(self._buckets)
        self._note_views_handed_out()  # only now: the futures' values may have been further views of the buffers

    def _note_views_handed_out(self) -> None:
        """The buckets' views are now ``.grad``: each bucket records what refers to its memory (see
        :meth:`Bucket.seen_by_user`)."""
        for bucket in self._buckets:
            if bucket.grads_are_views:
                bucket.handed_out()

    def _write_results(self, step: int) -> None:
        """Wait for every bucket's future, run the collectives after the last bucket, write ``.grad``."""
        results = [
            self._runner.result(future, bucket.index, bucket.buffer, step)
            for bucket, future in zip(self._buckets, self._futures, strict=True)
        ]
        globally_used = self._after_last_bucket(step, results, self._locally_used)
        globally_used = self._static.after_step(self._locally_used, globally_used)
        if self._locally_used is not None:
            self._locally_used.zero_()
        for bucket, result in zip(self._buckets, results, strict=True):
            if bucket.sparse:
                if globally_used is None or globally_used[bucket.param_indices[0]]:
                    bucket.write(result)
                continue
            if not same_tensor(result, bucket.buffer):
                bucket.buffer.copy_(result)
            bucket.write_gradients(globally_used)

    def shadow_backward(self) -> None:
        """A joined rank's part in a step it has no input for: the hook on zero buckets, in bucket order.

        Issues exactly the collectives a real backward issues (each bucket's hook, then the used-parameter
        map and the telemetry's error pass if enabled), so that the ranks still training are matched; the
        results are dropped, ``.grad`` is left alone. Counts as a synchronised step.
        """
        self.check_usable()
        step = self._synced_backwards
        try:
            launched = []
            for bucket in self._buckets:
                zeros = torch.zeros_like(bucket.buffer)
                launched.append((bucket, zeros, self._runner.launch(bucket.grad_bucket(zeros), step)))
            results = [self._runner.result(future, bucket.index, zeros, step) for bucket, zeros, future in launched]
            reduces_map = self._static.reduces_used_map(self._find_unused)
            unused = torch.zeros(len(self._params), dtype=torch.int32) if reduces_map else None
            globally_used = self._after_last_bucket(step, results, unused)
            self._static.after_step(None, globally_used)
        except BaseException as exc:
            self._fail(exc)
            raise
        self._synced_backwards += 1
        if not self._rebuild_done:
            # Rebuild with the others at the next step; a training rank's order is broadcast to this one.
            self._rebuild_done = True
            self._rebuild_order = list(self._layout_order)

    def _after_last_bucket(
        self, step: int, results: list[torch.Tensor], locally_used: torch.Tensor | None
    ) -> list[int] | None:
        """The collectives after the last bucket, the same in real and shadow steps: the used-parameter map
        (with ``find_unused_parameters``), then the telemetry's error pass (with ``measure_error``).

        Only after every bucket's future: a hook may launch collectives from its futures' callbacks, and these
        must not interleave with them differently on different ranks. Returns the globally-used flags.
        """
        with reporting_lost_peers(step, "after the last bucket (used-parameter map, telemetry)", self._group):
            globally_used = None
            if locally_used is not None:
                # a copy (on the device NCCL needs): the local flags are kept for the static-graph record
                reduced = locally_used.to(collective_device(self._group), copy=True)
                dist.all_reduce(reduced, group=self._group)
                globally_used = reduced.tolist()
            for bucket, result in zip(self._buckets, results, strict=True):
                self.stats.compare_result(bucket.index, result, self._group)
        return globally_used

    def _drain_futures(self) -> None:
        """Wait for every launched future so no collective outlives the iteration (errors already raised)."""
        wait_quietly(self._futures)
