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
The buckets are torch's, and rebuilt once in ready order as torch's (:mod:`gradcomm.ddp.layout`): the same
layouts give the same sums in the same order, bit for bit torch's results.

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

from gradcomm.comm.faults import PeerLostError, reporting_lost_peers
from gradcomm.comm.futures import wait_quietly
from gradcomm.ddp.bucketing import bucket_size_limits, prepare_grad_references
from gradcomm.ddp.finite import check_bucket_finite
from gradcomm.ddp.grad_hooks import hook_end_of_backward, hook_parameters
from gradcomm.ddp.hook_runner import HookRunner
from gradcomm.ddp.iteration import Iteration
from gradcomm.ddp.layout import BucketLayout, broadcast_order
from gradcomm.ddp.reducer_errors import (
    marked_twice_error,
    not_finalized_error,
    registering_too_late,
    static_graph_too_late_error,
    unfinished_reduction_error,
)
from gradcomm.ddp.results import (
    after_last_bucket,
    bucket_results,
    raise_first_failure,
    shadow_results,
    write_results,
)
from gradcomm.ddp.unused import StaticCounting, UsedParameters, parameters_reached
from gradcomm.hooks.contract import CommHook

__all__ = ["Reducer"]

logger = logging.getLogger(__name__)


class Reducer:
    """Buckets the gradients of ``params`` and reduces them with a communication hook during backward.

    The DDP drives it (``prepare_for_forward``, ``arm_for_forward``/``prepare_for_backward``, ``disarm``,
    ``shadow_backward``); ``ddp.reducer`` is :class:`~gradcomm.ddp.reducer_surface.ReducerSurface`, torch's
    C++ reducer's surface over it, which reads the parts below. They are the reducer's to change:

    * ``names``: the parameters' names, in the reducer's order;
    * ``layout``: the buckets, where each parameter is in them and their one-time rebuild
      (:class:`~gradcomm.ddp.layout.BucketLayout`);
    * ``static``: the static graph's record (:class:`~gradcomm.ddp.unused.UsedParameters`);
    * ``runner``: the hook, its launches and statistics (:class:`~gradcomm.ddp.hook_runner.HookRunner`).

    The backward being reduced is one :class:`~gradcomm.ddp.iteration.Iteration`, replaced at each arming.
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
        self.names = list(names)
        self._group = process_group
        self._world_size = dist.get_world_size(process_group)
        self._bucket_cap_mb = bucket_cap_mb
        self._bucket_caps = list(bucket_caps) if bucket_caps else None
        self._sparse = list(sparse) if sparse is not None and any(sparse) else None
        self._find_unused = find_unused_parameters
        # True: .grad are bucket views (torch's option); None: views where safe (the default, see
        # BucketLayout.grads_as_views and Bucket.take_gradient); False: .grad are copies, as torch's default
        self._as_view = gradient_as_bucket_view
        if gradient_as_bucket_view is None:
            prepare_grad_references()
        self._check_finite = check_finite
        # what every rank must agree on besides the hook and the buckets (the DDP's options that add collectives)
        self._settings = dict(settings or {})
        self.set_active_ranks(None)  # the default reduction's divisor and factor (join() may change them)
        self.runner = HookRunner("gradcomm.DistributedDataParallel", process_group)
        self._synced_backwards = 0
        self.layout = BucketLayout(
            self._params,
            bucket_size_limits(bucket_cap_mb),
            self._bucket_caps,
            self._sparse,
            gradient_as_bucket_view,
            find_unused_parameters,
            static_graph,
        )
        self.static = UsedParameters(len(self._params), static_graph)
        self._unfinished: list[int] = []  # the parameters a started backward left without gradient
        self._armed = False
        # which parameters got a gradient since the last synchronised step (no_sync iterations included)
        self._used_map = torch.zeros(len(self._params), dtype=torch.int32)
        self._warned_create_graph = False
        self._new_iteration()
        self._grad_hook_handles, self._accumulators = hook_parameters(self._params, weakref.ref(self))

    # -- what the DDP, the surface and checkpoints read ---------------------------------------------------
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
        self.runner.check_usable()

    def _fail(self, exc: BaseException) -> None:
        self.runner.fail(exc)
        self._armed = False

    # -- setup: the hook, the settings, the static graph ------------------------------------------------------
    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Register ``hook``; a collective in which the ranks compare hook, options and setup (see
        ``DistributedDataParallel.register_comm_hook``)."""
        too_late = None
        if self._synced_backwards or self.in_backward or self.runner.setup_checked:
            too_late = registering_too_late(self._synced_backwards, self.runner.name)
        self.runner.register(state, hook, too_late, self._setup())

    def _setup(self) -> dict[str, str]:
        """What the ranks must agree on besides the hook: bucket layout and the DDP's settings."""
        sizes = [bucket.buffer.numel() for bucket in self.layout.buckets]
        dtypes = sorted({str(bucket.buffer.dtype) for bucket in self.layout.buckets})
        return {
            "bucket layout": f"{len(sizes)} bucket(s) of {sizes} elements ({', '.join(dtypes)})",
            "bucket_cap_mb": repr(self._bucket_cap_mb),
            "find_unused_parameters": repr(self._find_unused),
            "static_graph": repr(self.static.enabled),
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
            raise static_graph_too_late_error(self._synced_backwards)
        self.static = UsedParameters(len(self._params), True)
        self.layout.expect()
        self.runner.setup_checked = False  # the ranks compare the new setting at the next synchronised forward

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
            names = [self.names[i] for i in indices]
            rank = dist.get_rank(self._group)
            raise unfinished_reduction_error(names, indices, rank, self.static.enabled, self._find_unused)
        if self._synced_backwards == 0 and not self.layout.has_rebuilt:
            self._adopt_hook_state_layout()
        if not self.runner.setup_checked:
            self.runner.check_same_setup(self._setup())
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
        if self.static.enabled:
            if self.static.arm(it):
                self._end_of_backward_at(outputs)
        elif self._find_unused:
            if outputs is None:
                it.unused_at_end = True
                self._end_of_backward_at(None)
            else:
                reached = parameters_reached(outputs)
                it.unused = [i for i, p in enumerate(self._params) if id(p) not in reached]

    def _new_iteration(self) -> Iteration:
        """Start a new :class:`Iteration` (for an armed backward, or after the buckets changed)."""
        for bucket in self.layout.buckets:
            if not bucket.sparse:
                bucket.staged.discard()
        locally_used = self._used_map if self.static.reduces_used_map(self._find_unused) else None
        self._iteration = Iteration.start(len(self._params), self.layout.buckets, locally_used)
        return self._iteration

    def _end_of_backward_at(self, outputs: Any) -> None:
        """Arrange for :meth:`_end_of_backward` to run when the backward through ``outputs`` ends; without
        outputs (a backward inside the forward) it is queued at the first gradient instead."""
        self._iteration.end_at_first_grad = not hook_end_of_backward(outputs, weakref.ref(self))

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
            raise not_finalized_error([self.names[i] for i in self._unfinished or self._unready()])

    # -- bucket layout -------------------------------------------------------------------------------------
    def load_bucket_layout(self, layout: dict[str, Any]) -> None:
        """Adopt a saved :meth:`bucket_layout`, so a resumed run reduces in the same buckets as the original."""
        if self.in_backward:
            raise RuntimeError("load_bucket_layout: cannot change buckets during a backward pass")
        order = BucketLayout.loaded_order(layout, self.names)
        if order is not None:
            self.layout.adopt(order)
            self._new_iteration()

    def rebuild_if_due(self, source_rank: int = 0) -> bool:
        """Do the one-time rebuild now if it is due (a collective then: group rank ``source_rank``'s ready
        order is broadcast, so every rank builds the same buckets); whether it ran."""
        order = self.layout.take_due()
        if order is None:
            return False
        with reporting_lost_peers(self._synced_backwards, "rebuilding buckets", self._group):
            self.layout.rebuild(broadcast_order(order, self._group, source_rank))
        self._new_iteration()
        return True

    def _adopt_hook_state_layout(self) -> None:
        """Before the first iteration: reduce in the buckets the hook state was made in, where this DDP's own
        rebuild would have made them (see :meth:`BucketLayout.hook_state_order`)."""
        order = self.layout.hook_state_order(getattr(self.runner.state, "bucket_layout", None), self.names)
        if order is not None:
            self.layout.adopt(order)
            self._new_iteration()
            self.runner.setup_checked = False  # the ranks compare the adopted buckets before the first step
            logger.debug("adopted the hook state's %d buckets", len(self.layout.buckets))

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
        if counting is StaticCounting.FIRST and self.static.count_first(it, index, self.layout.ready_order):
            return
        if counting is StaticCounting.DOWN and self.static.count_down(it, index, self.names[index]):
            return
        self._mark(index)

    def _mark(self, index: int) -> None:
        """Parameter ``index`` is ready: its gradient goes into its bucket (dense: into the bucket's view;
        sparse: a bucket of its own, see ddp/sparse.py), and the buckets this completes are launched."""
        it = self._iteration
        if it.ready[index]:
            raise marked_twice_error(self.names[index])
        it.ready[index] = 1
        layout = self.layout
        order = layout.ready_order
        if order is not None:
            order.append(index)
        bucket, position = layout.location[index]
        pending = it.pending
        if bucket.sparse:
            divisor = self._grad_divisor if self.runner.averages_itself else None
            bucket.take(self._params[index].grad, divisor, self.names[index])
        else:
            by_default = self._as_view is None
            first = by_default and pending[bucket.index] == len(bucket.views)
            if bucket.take_gradient(position, self._write_scale(), by_default, first):
                self._warn_create_graph()
        pending[bucket.index] -= 1
        if pending[bucket.index] == 0:
            self._launch_ready_buckets()

    def _write_scale(self) -> float | None:
        """The factor gradients are multiplied by on their way into the bucket: with the default reduction,
        as torch, each is pre-divided by the world size before the sum; a registered hook gets them as they are."""
        return self._scale if self.runner.averages_itself else None

    def _warn_create_graph(self) -> None:
        if not self._warned_create_graph:
            self._warned_create_graph = True
            warnings.warn(
                "Using gradcomm.DistributedDataParallel with create_graph=True is not well-supported (as in torch): "
                "the gradients are averaged, but the higher-order gradient is not synchronised across ranks.",
                stacklevel=2,
            )

    def _launch_ready_buckets(self) -> None:
        it = self._iteration
        buckets = self.layout.buckets
        try:
            while it.next_bucket < len(buckets) and it.pending[it.next_bucket] == 0:
                bucket = buckets[it.next_bucket]
                if not bucket.sparse:
                    bucket.staged.flush(self._write_scale())
                if self._check_finite:
                    check_bucket_finite(bucket, self.names, self._synced_backwards)
                if bucket.index == 0:
                    self.runner.stats.begin_step()
                future = self.runner.launch(bucket.grad_bucket(), self._synced_backwards)
                it.futures[bucket.index] = future
                it.next_bucket += 1
                if future.done():  # if it failed, stop before the next bucket's collectives are launched
                    raise_first_failure(self.runner, buckets, it.futures, bucket.index, self._synced_backwards)
            if it.next_bucket == len(buckets) and not it.finalize_queued:
                # as torch: finalize at the end of the backward in which the last bucket became ready, which
                # under reentrant checkpointing is the outer one whenever outer gradients are still to come
                it.finalize_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        except BaseException as exc:
            self._fail(exc)
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
                for index in self.static.end_first_iteration(it, self.layout.restart_recording()):
                    self._mark(index)
            elif it.unused_at_end:
                index = it.ready.find(0)
                while index != -1:
                    self._mark(index)
                    index = it.ready.find(0, index + 1)
        except BaseException as exc:
            self._fail(exc)
            raise
        if it.next_bucket == len(self.layout.buckets) and not queued:
            self._finalize()

    def _finalize(self) -> None:
        """Autograd-engine callback once the last bucket is launched: wait for the buckets and write ``.grad``."""
        self._armed = False
        it = self._iteration
        step = self._synced_backwards
        peer_lost = False
        try:
            self._write_results(step, it)
            self.runner.stats.end_step()
            self._synced_backwards += 1
            self.layout.step_done(ready_order_known=True)
        except BaseException as exc:
            peer_lost = isinstance(exc, PeerLostError)
            self._fail(exc)
            raise
        finally:
            if not peer_lost:  # after a lost peer the remaining collectives can only time out one by one
                wait_quietly(it.futures)  # no collective outlives the iteration (errors already raised)
            it.futures = [None] * len(self.layout.buckets)
        self.layout.handed_out()  # only now: the futures' values may have been further views of the buffers

    def _write_results(self, step: int, it: Iteration) -> None:
        """Wait for every bucket's future, run the collectives after the last bucket, write ``.grad``."""
        buckets = self.layout.buckets
        results = bucket_results(self.runner, buckets, it.futures, step)
        globally_used = after_last_bucket(self.runner, buckets, results, it.locally_used, self._group, step)
        globally_used = self.static.after_step(it.locally_used, globally_used)
        if it.locally_used is not None:
            it.locally_used.zero_()
        write_results(buckets, results, globally_used)

    def shadow_backward(self) -> None:
        """A joined rank's part in a step it has no input for: the hook on zero buckets, in bucket order.

        Issues exactly the collectives a real backward issues (each bucket's hook, then the used-parameter
        map and the telemetry's error pass if enabled), so that the ranks still training are matched; the
        results are dropped, ``.grad`` is left alone. Counts as a synchronised step.
        """
        self.check_usable()
        step = self._synced_backwards
        try:
            buckets = self.layout.buckets
            results = shadow_results(self.runner, buckets, step)
            reduces_map = self.static.reduces_used_map(self._find_unused)
            unused = torch.zeros(len(self._params), dtype=torch.int32) if reduces_map else None
            globally_used = after_last_bucket(self.runner, buckets, results, unused, self._group, step)
            self.static.after_step(None, globally_used)
        except BaseException as exc:
            self._fail(exc)
            raise
        self._synced_backwards += 1
        # rebuild with the others at the next step; a training rank's order is broadcast to this one
        self.layout.step_done(ready_order_known=False)
