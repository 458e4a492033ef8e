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
    bucket_size_limits,
    grad_held_elsewhere,
    prepare_grad_references,
    same_tensor,
)
from gradcomm.ddp.finite import check_bucket_finite
from gradcomm.ddp.grad_hooks import EndOfBackwardHook, GradReadyHook, after_accumulation
from gradcomm.ddp.hook_runner import HookRunner
from gradcomm.ddp.iteration import Iteration
from gradcomm.ddp.rebuild import BucketRebuild, broadcast_order
from gradcomm.ddp.reducer_errors import graph_changed_error, marked_twice_error, unfinished_reduction_error
from gradcomm.ddp.sparse import SparseBucket
from gradcomm.ddp.unused import StaticCounting, UsedParameters, parameters_reached, tensors_in
from gradcomm.hooks.contract import CommHook

__all__ = ["Reducer"]

logger = logging.getLogger(__name__)


class Reducer:
    """Buckets the gradients of ``params`` and reduces them with a communication hook during backward.

    The DDP drives it (``prepare_for_forward``, ``arm_for_forward``/``prepare_for_backward``, ``disarm``,
    ``shadow_backward``); ``ddp.reducer`` is :class:`~gradcomm.ddp.reducer_surface.ReducerSurface`, torch's
    C++ reducer's surface over it. Its state: the buckets and where each parameter is in them, the
    :class:`~gradcomm.ddp.rebuild.BucketRebuild`, the static graph's record
    (:class:`~gradcomm.ddp.unused.UsedParameters`), the hook (:class:`~gradcomm.ddp.hook_runner.HookRunner`)
    and the :class:`~gradcomm.ddp.iteration.Iteration` being reduced.
    """

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
        self._rebuild = BucketRebuild(
            self._params,
            bucket_size_limits(bucket_cap_mb),
            self._bucket_caps,
            self._sparse,
            find_unused_parameters,
            static_graph,
        )
        self._static = UsedParameters(len(self._params), static_graph)
        self._unfinished: list[int] = []  # the parameters a started backward left without gradient
        self._armed = False
        # which parameters got a gradient since the last synchronised step (no_sync iterations included)
        self._used_map = torch.zeros(len(self._params), dtype=torch.int32)
        self._warned_create_graph = False
        self._build_buckets(self._rebuild.initial_groups(), rebuilt=False)
        self_ref = weakref.ref(self)
        self._grad_hook_handles, self._accumulators = [], []  # the nodes are kept: see after_accumulation
        for index, param in enumerate(self._params):
            handle, accumulator = after_accumulation(param, GradReadyHook(self_ref, index))
            self._grad_hook_handles.append(handle)
            self._accumulators.append(accumulator)

    # -- what the DDP, the surface and checkpoints read ---------------------------------------------------
    @property
    def runner(self) -> HookRunner:
        """The registered hook (its name, whether it leaves replicas different) and its launches."""
        return self._runner

    @property
    def buckets(self) -> list[Bucket | SparseBucket]:
        """The buckets, in order (read-only: the reducer rebuilds them, never the caller)."""
        return self._buckets

    @property
    def names(self) -> list[str]:
        """The parameters' names, in the reducer's order."""
        return self._names

    @property
    def rebuild(self) -> BucketRebuild:
        """The one-time bucket rebuild's state (read-only: see :meth:`rebuild_if_due`)."""
        return self._rebuild

    @property
    def static(self) -> UsedParameters:
        """The static graph's record, and the evidence for torch's ``can_set_static_graph``."""
        return self._static

    @property
    def synchronised_steps(self) -> int:
        """Synchronised steps completed (shadow steps of a joined rank included); the step numbers in errors
        count from 0, so step ``n`` is the one after ``n`` completed steps."""
        return self._synced_backwards

    @property
    def in_backward(self) -> bool:
        """A gradient of the armed backward has arrived and its reduction has not finished."""
        return self._armed and self._iteration.started

    def check_usable(self) -> None:
        """Raise if an earlier synchronised step failed on this rank: the ranks may be out of step."""
        self._runner.check_usable()

    def _fail(self, exc: BaseException) -> None:
        self._runner.fail(exc)
        self._armed = False

    # -- setup: the hook, the settings, the static graph ------------------------------------------------------
    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Register ``hook``; a collective: every rank must register, and the same hook with the same options.

        The ranks compare the hook's qualified name, its state's plain options and the bucket layout in one
        ``all_gather_object`` and all raise :class:`~gradcomm.ddp.agreement.RanksDisagreeError` if they differ.
        """
        too_late = None
        if self._synced_backwards or self.in_backward or self._runner.setup_checked:
            too_late = (
                "before the first backward, and before the first synchronised forward (where the ranks compare "
                f"their setup); {self._synced_backwards} synchronised backward pass(es) already ran with "
                f"{self._runner.name}"
            )
        self._runner.register(state, hook, too_late, self._setup())

    def _setup(self) -> dict[str, str]:
        """What the ranks must agree on besides the hook: bucket layout and the DDP's settings."""
        sizes = [bucket.buffer.numel() for bucket in self._buckets]
        dtypes = sorted({str(bucket.buffer.dtype) for bucket in self._buckets})
        return {
            "bucket layout": f"{len(sizes)} bucket(s) of {sizes} elements ({', '.join(dtypes)})",
            "bucket_cap_mb": repr(self._bucket_cap_mb),
            "find_unused_parameters": repr(self._find_unused),
            "static_graph": repr(self._static.enabled),
            "bucket_cap_mb_list": repr(self._bucket_caps),
            **self._settings,
        }

    def set_active_ranks(self, count: int | None) -> None:
        """Average the default reduction over ``count`` ranks (``None``: all), for ``join()`` with
        ``divide_by_initial_world_size=False``. A registered hook divides as it does itself."""
        self._grad_divisor = count or self._world_size  # sparse gradients are divided by it (as torch)
        # dense ones multiplied by its inverse, as a Python number: the kernel reads it as torch's reducer's
        # wrapped scalar, in the gradient's compute type (a 0-dim tensor would promote a 0-dim gradient)
        self._scale = 1.0 / self._grad_divisor

    def set_static_graph(self) -> None:
        """Treat the graph as static from now on; only before the first synchronised iteration, as in torch."""
        if self._synced_backwards or self.in_backward:
            raise RuntimeError(
                "set_static_graph() should be called before training loop starts and after "
                "DistributedDataParallel is constructed. "
                "gradcomm.DistributedDataParallel._set_static_graph() must be called before the first "
                f"synchronised iteration ({self._synced_backwards} already ran); pass static_graph=True to the "
                "constructor instead"
            )
        self._static = UsedParameters(len(self._params), True)
        self._rebuild.expect()
        self._runner.setup_checked = False  # the ranks compare the new setting at the next synchronised forward

    def remove_hooks(self) -> None:
        """Remove the per-parameter gradient hooks: backward no longer reaches the reducer."""
        for handle in self._grad_hook_handles:
            handle.remove()
        self._grad_hook_handles, self._accumulators = [], []

    # -- arming for a backward -----------------------------------------------------------------------------
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
        if self._synced_backwards == 0 and not self._rebuild.has_rebuilt:
            self._adopt_hook_state_layout()
        if not self._runner.setup_checked:
            self._runner.check_same_setup(self._setup())
        self.rebuild_if_due(source_rank)

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
        it = self._new_iteration()
        self._armed = True
        if self._static.enabled:
            if not self._static.recorded:
                # torch's first static iteration: count each parameter's gradients, reduce everything at the end
                it.first_counts = [0] * len(self._params)
                it.counting = StaticCounting.FIRST
                self._end_of_backward_at(outputs)
            else:
                it.unused = self._static.locally_unused
                it.countdown = list(self._static.hook_counts)
                it.counting = StaticCounting.DOWN
        elif self._find_unused:
            if outputs is None:
                it.unused_at_end = True
                self._end_of_backward_at(None)
            else:
                reached = parameters_reached(outputs)
                it.unused = [i for i, p in enumerate(self._params) if id(p) not in reached]

    def _new_iteration(self) -> Iteration:
        """Start a new :class:`Iteration` (for an armed backward, or after the buckets changed)."""
        for bucket in self._buckets:
            if not bucket.sparse:
                bucket.staged.discard()
        locally_used = self._used_map if self._static.reduces_used_map(self._find_unused) else None
        self._iteration = Iteration(
            bytearray(len(self._params)),
            [len(bucket.param_indices) for bucket in self._buckets],
            [None] * len(self._buckets),
            locally_used,
        )
        return self._iteration

    def _end_of_backward_at(self, outputs: Any) -> None:
        """Arrange for :meth:`_end_of_backward` to run when the backward through ``outputs`` ends.

        As torch's ``_DDPSink``: a pre-hook on the outputs' autograd nodes queues it in the backward that
        reaches them, the outermost one even under reentrant checkpointing. Without outputs (a backward inside
        the forward) it is queued at the first gradient instead.
        """
        it = self._iteration
        it.end_at_first_grad = True
        self_ref = weakref.ref(self)
        for tensor in tensors_in(outputs):
            if tensor.grad_fn is not None:
                tensor.grad_fn.register_prehook(EndOfBackwardHook(self_ref))
                it.end_at_first_grad = False

    def _queue_end_of_backward(self) -> None:
        it = self._iteration
        if self._armed and not it.end_queued:
            it.end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def disarm(self) -> None:
        """Forget a prepared backward (the next backward accumulates locally)."""
        self._take_unfinished()
        self._armed = False

    def _take_unfinished(self) -> None:
        """Record the parameters a started backward left without gradient (its buckets were never reduced)."""
        if self.in_backward:
            self._unfinished = self._unready()
            self._armed = False

    def _unready(self) -> list[int]:
        ready = self._iteration.ready
        return [i for i in range(len(self._params)) if not ready[i]]

    def check_finalized(self) -> None:
        """Raise if the last synchronised backward left buckets unreduced (torch's ``_check_reducer_finalized``)."""
        if self._unfinished or self.in_backward:
            unready = [self._names[i] for i in self._unfinished or self._unready()]
            raise RuntimeError(
                "gradcomm.DistributedDataParallel: the last backward did not finish reducing: no gradient "
                f"arrived for {', '.join(unready[:10])}. Pass find_unused_parameters=True if they are unused on "
                "purpose."
            )

    # -- bucket layout -------------------------------------------------------------------------------------
    def _build_buckets(self, groups: list[list[int]], rebuilt: bool) -> None:
        """Make the buckets: ``groups`` holds each bucket's parameter indices, in bucket order."""
        self._rebuild.built(groups, rebuilt)
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
        self._new_iteration()

    def _grads_as_views(self, indices: list[int]) -> bool:
        """Whether these parameters' ``.grad`` become views of their bucket. By default (``None``) only for
        contiguous parameters, where that changes nothing a user sees; held ``.grad`` are protected in
        :meth:`_mark_ready`. (A transposed or channels-last parameter's view has its memory format too, see
        :func:`~gradcomm.ddp.bucketing.bucket_view`, but such buckets keep torch's copies.)"""
        if self._as_view is None:
            return all(self._params[i].is_contiguous() for i in indices)
        return self._as_view

    def bucket_layout(self) -> dict[str, Any]:
        """The bucket layout as plain values, for checkpoints (see :meth:`BucketRebuild.bucket_layout`)."""
        return self._rebuild.bucket_layout(self._names)

    def load_bucket_layout(self, layout: dict[str, Any]) -> None:
        """Adopt a saved :meth:`bucket_layout`, so a resumed run reduces in the same buckets as the original."""
        if self.in_backward:
            raise RuntimeError("load_bucket_layout: cannot change buckets during a backward pass")
        if list(layout["names"]) != self._names:
            mismatch = next(
                (f"{a!r} here, {b!r} saved" for a, b in zip(self._names, layout["names"], strict=False) if a != b),
                f"{len(self._names)} parameters here, {len(layout['names'])} saved",
            )
            raise ValueError(
                "load_bucket_layout: the checkpoint's bucket layout is for other parameters "
                f"({mismatch}); load it into the model it was saved from"
            )
        if layout["rebuilt"]:
            self._rebuild_in_order(list(layout["order"]))
            self._rebuild.settle()

    def rebuild_if_due(self, source_rank: int = 0) -> bool:
        """Do the one-time rebuild now if it is due (a collective then: group rank ``source_rank``'s ready
        order is broadcast, so every rank builds the same buckets); whether it ran."""
        order = self._rebuild.take_due()
        if order is None:
            return False
        with reporting_lost_peers(self._synced_backwards, "rebuilding buckets", self._group):
            self._rebuild_in_order(broadcast_order(order, self._group, source_rank))
        return True

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
        order = self._rebuild.hook_state_order(layout, self._names)
        if order is None:
            return
        self._rebuild_in_order(order)
        self._rebuild.settle()
        self._runner.setup_checked = False  # the ranks compare the adopted buckets before the first step
        logger.debug("adopted the hook state's %d buckets", len(self._buckets))

    def _rebuild_in_order(self, order: list[int]) -> None:
        # gradient_as_bucket_view=True: .grad move into the new buckets, as torch's; by default they stay
        # where they are until their next gradient (a .grad held there must keep receiving the results)
        old_grads = [p.grad for p in self._params] if self._as_view else []
        self._build_buckets(self._rebuild.groups(order), rebuilt=True)
        for index, grad in enumerate(old_grads):
            bucket, position = self._location[index]
            if grad is not None and bucket.grads_are_views:
                view = bucket.views[position]
                view.copy_(grad)
                self._params[index].grad = view
        if old_grads:
            self._note_views_handed_out()
        logger.debug("rebuilt %d buckets in gradient-ready order", len(self._buckets))

    # -- per-gradient mechanics ------------------------------------------------------------------------------
    def _on_grad_ready(self, index: int) -> None:
        if not self._armed:
            if self._find_unused:  # torch carries the used map across no_sync iterations
                self._used_map[index] = 1
            return
        it = self._iteration
        if not it.started:
            it.started = True
            if it.end_at_first_grad:
                self._queue_end_of_backward()
            for unused in it.unused:
                self._mark(unused)
        if it.locally_used is not None:
            it.locally_used[index] = 1
        counting = it.counting
        if counting is StaticCounting.FIRST and self._count_first(it, index):
            return
        if counting is StaticCounting.DOWN and self._count_down(it, index):
            return
        self._mark(index)

    def _count_first(self, it: Iteration, index: int) -> bool:
        """First static iteration: count the gradient, defer marking to the end of backward (as torch)."""
        it.first_counts[index] += 1
        order = self._rebuild.ready_order
        if it.first_counts[index] == 1 and order is not None:
            order.append(index)
        return True

    def _count_down(self, it: Iteration, index: int) -> bool:
        """Later static iterations: a parameter is ready at its last gradient of the first iteration's count."""
        left = it.countdown[index] - 1
        if left < 0:
            raise graph_changed_error(self._names[index], self._static.hook_counts[index])
        it.countdown[index] = left
        return left > 0

    def _mark(self, index: int) -> None:
        """The per-gradient step of a parameter: dense into its bucket view, or sparse into a bucket of its own."""
        if self._sparse and self._sparse[index]:
            self._mark_sparse_ready(index)
        else:
            self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        it = self._iteration
        if it.ready[index]:
            raise marked_twice_error(self._names[index])
        it.ready[index] = 1
        order = self._rebuild.ready_order
        if order is not None:
            order.append(index)
        bucket, position = self._location[index]
        pending = it.pending
        if self._as_view is None and pending[bucket.index] == len(bucket.views):
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
        pending[bucket.index] -= 1
        if pending[bucket.index] == 0:
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
        it = self._iteration
        if it.ready[index]:
            raise marked_twice_error(self._names[index])
        it.ready[index] = 1
        order = self._rebuild.ready_order
        if order is not None:
            order.append(index)
        bucket = self._location[index][0]
        divisor = self._grad_divisor if self._runner.averages_itself else None
        bucket.take(self._params[index].grad, divisor, self._names[index])
        it.pending[bucket.index] -= 1
        if it.pending[bucket.index] == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        it = self._iteration
        try:
            while it.next_bucket < len(self._buckets) and it.pending[it.next_bucket] == 0:
                bucket = self._buckets[it.next_bucket]
                if not bucket.sparse:
                    bucket.staged.flush(self._write_scale())
                if self._check_finite:
                    check_bucket_finite(bucket, self._names, self._synced_backwards)
                if bucket.index == 0:
                    self._runner.stats.begin_step()
                future = self._runner.launch(bucket.grad_bucket(), self._synced_backwards)
                it.futures[bucket.index] = future
                it.next_bucket += 1
                if future.done():  # if it failed, stop before the next bucket's collectives are launched
                    self._raise_if_failed(bucket, future)
            if it.next_bucket == len(self._buckets) and not it.finalize_queued:
                # as torch: finalize at the end of the backward in which the last bucket became ready, which
                # under reentrant checkpointing is the outer one whenever outer gradients are still to come
                it.finalize_queued = True
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
            futures = self._iteration.futures
            for earlier in self._buckets[: bucket.index]:
                if futures[earlier.index].done():
                    self._runner.result(futures[earlier.index], earlier.index, earlier.buffer, step)
            raise

    # -- the end of backward ---------------------------------------------------------------------------------
    def delay_all_reduce(self) -> None:
        """A static graph's first iteration: reduce every bucket now if the running backward has not done it
        yet (torch's ``_delay_all_reduce``, which Lightning calls after a manual backward)."""
        if self.in_backward and self._iteration.counting is StaticCounting.FIRST:
            self._end_of_backward()

    def _end_of_backward(self) -> None:
        """Autograd-engine callback at the end of the outermost backward, when parameters without a gradient
        are only known then: a static graph's first iteration (every bucket is reduced now, as torch's
        ``_delay_all_reduce``) and ``find_unused_parameters`` without an output to search."""
        if not self._armed:
            return
        it = self._iteration
        queued, it.finalize_queued = it.finalize_queued, True  # finalize here or in the one queued
        try:
            if it.counting is StaticCounting.FIRST:
                it.counting = None
                self._static.hook_counts = list(it.first_counts)
                order = self._rebuild.restart_recording()
                seen = set(order)
                for index in [*order, *(i for i in range(len(self._params)) if i not in seen)]:
                    self._mark(index)
            elif it.unused_at_end:
                index = it.ready.find(0)
                while index != -1:
                    self._mark(index)
                    index = it.ready.find(0, index + 1)
        except BaseException as exc:
            self._fail(exc)
            raise
        if it.next_bucket == len(self._buckets) and not queued:
            self._finalize()

    def _finalize(self) -> None:
        """Autograd-engine callback once the last bucket is launched: wait for the buckets and write ``.grad``."""
        self._armed = False
        it = self._iteration
        step = self._synced_backwards
        peer_lost = False
        try:
            self._write_results(step, it)
            self._runner.stats.end_step()
            self._synced_backwards += 1
            self._rebuild.step_done(ready_order_known=True)
        except BaseException as exc:
            peer_lost = isinstance(exc, PeerLostError)
            self._fail(exc)
            raise
        finally:
            if not peer_lost:  # after a lost peer the remaining collectives can only time out one by one
                wait_quietly(it.futures)  # no collective outlives the iteration (errors already raised)
            it.futures = [None] * len(self._buckets)
        self._note_views_handed_out()  # only now: the futures' values may have been further views of the buffers

    def _note_views_handed_out(self) -> None:
        """The buckets' views are now ``.grad``: each bucket records what refers to its memory (see
        :meth:`Bucket.seen_by_user`)."""
        for bucket in self._buckets:
            if bucket.grads_are_views:
                bucket.handed_out()

    def _write_results(self, step: int, it: Iteration) -> None:
        """Wait for every bucket's future, run the collectives after the last bucket, write ``.grad``."""
        results = [
            self._runner.result(future, bucket.index, bucket.buffer, step)
            for bucket, future in zip(self._buckets, it.futures, strict=True)
        ]
        globally_used = self._after_last_bucket(step, results, it.locally_used)
        globally_used = self._static.after_step(it.locally_used, globally_used)
        if it.locally_used is not None:
            it.locally_used.zero_()
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
        # rebuild with the others at the next step; a training rank's order is broadcast to this one
        self._rebuild.step_done(ready_order_known=False)

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
                self._runner.stats.compare_result(bucket.index, result, self._group)
        return globally_used
