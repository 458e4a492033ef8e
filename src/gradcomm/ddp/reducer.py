"""The reducer: gradient buckets, readiness tracking, and launching communication hooks during backward.

Mechanism only; what a bucket's communication does is the hook's business. Per synchronised iteration:

1. ``prepare_for_backward`` (called by DDP's forward) arms the reducer and, with
   ``find_unused_parameters``, finds the parameters the output does not depend on.
2. During backward each parameter's post-accumulate-grad hook copies its gradient into its bucket. When a
   bucket is complete, it and every complete bucket after it in order are launched: the communication hook
   (or the default averaging allreduce) starts while backward goes on computing other gradients. Buckets
   are launched strictly in index order so that all ranks issue collectives in the same order.
3. An autograd-engine callback, run when backward finishes, waits for every bucket's future and writes the
   results into the parameters' ``.grad`` (or makes ``.grad`` a view into the bucket).

After the first synchronised iteration the buckets are rebuilt once, in the order gradients actually became
ready (rank 0's order, broadcast so all ranks agree), as torch's DDP does.

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
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm.comm.faults import NonFiniteGradientError, PeerLostError, reporting_lost_peers
from gradcomm.comm.futures import wait_quietly
from gradcomm.ddp.bucketing import Bucket, assign_buckets, bucket_size_limits, same_tensor
from gradcomm.ddp.hook_runner import HookRunner
from gradcomm.ddp.sparse import SparseBucket
from gradcomm.ddp.telemetry import CommStats
from gradcomm.ddp.unused import UsedParameters, parameters_reached
from gradcomm.hooks.contract import CommHook

__all__ = ["Reducer"]

logger = logging.getLogger(__name__)


class Reducer:
    """Buckets the gradients of ``params`` and reduces them with a communication hook during backward."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        process_group: ProcessGroup | None,
        bucket_cap_mb: float | None,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
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
        self._as_view = gradient_as_bucket_view
        self._check_finite = check_finite
        # what every rank must agree on besides the hook and the buckets (the DDP's options that add collectives)
        self._settings = dict(settings or {})
        self._grad_scale = 1.0 / self._world_size  # the default reduction's factor (join() may change it)
        self._grad_divisor = self._world_size  # the same as a divisor, for sparse gradients (torch divides them)
        self._runner = HookRunner("gradcomm.DistributedDataParallel", process_group)
        self._synced_backwards = 0
        # torch does not rebuild with find_unused_parameters (unless the graph is static): the ready order then
        # varies between iterations.
        self._rebuild_done = find_unused_parameters and not static_graph
        self._static = UsedParameters(len(self._params), static_graph)
        self._ready_order: list[int] = []
        self._has_rebuilt = False
        self._rebuild_order: list[int] | None = None
        self._unfinished: list[str] = []
        self._armed = False
        self._build_buckets(list(reversed(range(len(self._params)))))
        self._reset_iteration()
        self_ref = weakref.ref(self)
        # the per-gradient step of each parameter: dense into its bucket view, or sparse into a bucket of its own
        self._markers = [
            self._mark_sparse_ready if self._sparse and self._sparse[index] else self._mark_ready
            for index in range(len(self._params))
        ]
        self._grad_hook_handles = [
            param.register_post_accumulate_grad_hook(_GradReadyHook(self_ref, index))
            for index, param in enumerate(self._params)
        ]

    # -- public API ----------------------------------------------------------------------------------------
    @property
    def stats(self) -> CommStats:
        """This DDP's communication statistics (see :mod:`gradcomm.ddp.telemetry`)."""
        return self._runner.stats

    @property
    def bucket_count(self) -> int:
        return len(self._buckets)

    @property
    def synchronised_steps(self) -> int:
        """Synchronised steps completed (shadow steps of a joined rank included); the step numbers in errors
        count from 0, so step ``n`` is the one after ``n`` completed steps."""
        return self._synced_backwards

    def bucket_parameter_names(self) -> list[list[str]]:
        """The parameter names in each bucket, in bucket order."""
        return [[self._names[i] for i in bucket.param_indices] for bucket in self._buckets]

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Register ``hook``; a collective: every rank must register, and the same hook with the same options.

        The ranks compare the hook's qualified name, its state's plain options and the bucket layout in one
        ``all_gather_object`` and all raise :class:`~gradcomm.ddp.agreement.RanksDisagreeError` if they differ.
        """
        too_late = None
        if self._synced_backwards or self._armed and self._callback_queued or self._runner.setup_checked:
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

    def bucket_layout(self) -> dict[str, Any]:
        """The bucket layout as plain values, for checkpoints: the parameter order the buckets are (or, after
        a pending rebuild, will be) built from, and whether the one-time rebuild has happened."""
        order = self._rebuild_order if self._rebuild_order is not None else self._layout_order
        return {"order": list(order), "rebuilt": self._rebuild_done, "names": list(self._names)}

    def load_bucket_layout(self, layout: dict[str, Any]) -> None:
        """Adopt a saved :meth:`bucket_layout`, so a resumed run reduces in the same buckets as the original."""
        if self._armed and self._callback_queued:
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
            self._rebuild_in_order(list(layout["order"]), broadcast=False)
            self._rebuild_done, self._rebuild_order, self._ready_order = True, None, []

    def replicas_may_differ(self) -> bool:
        """Whether the registered hook leaves the replicas different on purpose at this point."""
        return self._runner.replicas_may_differ()

    def check_usable(self) -> None:
        """Raise if an earlier synchronised step failed on this rank: the ranks may be out of step."""
        self._runner.check_usable()

    def _fail(self, exc: BaseException) -> None:
        self._runner.fail(exc)
        self._armed = False

    def set_active_ranks(self, count: int | None) -> None:
        """Average the default reduction over ``count`` ranks (``None``: all), for ``join()`` with
        ``divide_by_initial_world_size=False``. A registered hook divides as it does itself."""
        self._grad_divisor = count or self._world_size
        self._grad_scale = 1.0 / self._grad_divisor

    def prepare_for_forward(self, source_rank: int = 0) -> None:
        """Called before a forward whose backward will synchronise: report trouble, compare the ranks' setup
        (once), rebuild buckets (once, broadcasting group rank ``source_rank``'s order)."""
        self.check_usable()
        if self._unfinished:
            names, self._unfinished = self._unfinished, []
            shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
            raise RuntimeError(
                "gradcomm.DistributedDataParallel: the previous backward produced no gradient for "
                f"{len(names)} parameter(s) that take part in reduction: {shown}. Their buckets could not be "
                "reduced, so that iteration's gradients were not synchronised. If these parameters are unused "
                "in forward on purpose, pass find_unused_parameters=True; if they are not trained, set "
                "requires_grad=False on them before wrapping the model."
            )
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
        self._reset_iteration()
        self._armed = True
        if self._static.enabled:
            # a static graph: the parameters without a gradient are those of the first iteration, found at its
            # end; later iterations mark them ready at once (and, as a safety net, any other one at the end)
            self._unused = self._static.locally_unused
            self._unused_at_end = True
        elif self._find_unused:
            if outputs is None:
                self._unused_at_end = True
            else:
                reached = parameters_reached(outputs)
                self._unused = [i for i, p in enumerate(self._params) if id(p) not in reached]

    def disarm(self) -> None:
        """Forget a prepared backward (the next backward accumulates locally)."""
        self._armed = False

    # -- bucket layout -------------------------------------------------------------------------------------
    def _build_buckets(self, order: list[int]) -> None:
        self._layout_order = order
        groups = assign_buckets(
            self._params, order, self._first_limit, self._limit, limits=self._bucket_caps, alone=self._sparse
        )
        last = len(groups) - 1
        self._buckets: list[Bucket | SparseBucket] = [
            SparseBucket(index, indices[0], self._params, index == last)
            if self._sparse and self._sparse[indices[0]]
            else Bucket(index, indices, self._params, index == last)
            for index, indices in enumerate(groups)
        ]
        self._location: list[tuple[Any, Any]] = [None] * len(self._params)  # type: ignore[list-item]
        for bucket in self._buckets:
            views = [None] if bucket.sparse else bucket.views
            for index, view in zip(bucket.param_indices, views, strict=True):
                self._location[index] = (bucket, view)

    def _rebuild_in_order(self, ready_order: list[int], broadcast: bool = True, source_rank: int = 0) -> None:
        order = torch.tensor(ready_order, dtype=torch.int64)
        if broadcast:  # one rank's order (rank 0's), so that every rank has the same buckets
            src = dist.get_global_rank(self._group or dist.group.WORLD, source_rank)
            dist.broadcast(order, src=src, group=self._group)
        old_grads = [p.grad for p in self._params] if self._as_view else []
        self._build_buckets(order.tolist())
        self._has_rebuilt = True
        for index, grad in enumerate(old_grads):
            view = self._location[index][1]
            if grad is not None and view is not None:
                view.copy_(grad)
                self._params[index].grad = view
        self._reset_iteration()
        logger.debug("rebuilt %d buckets in gradient-ready order", len(self._buckets))

    # -- per-iteration mechanics ----------------------------------------------------------------------------
    def _reset_iteration(self) -> None:
        self._ready = bytearray(len(self._params))
        self._pending = [len(bucket.param_indices) for bucket in self._buckets]
        self._futures: list[torch.futures.Future | None] = [None] * len(self._buckets)
        self._next_bucket = 0
        self._callback_queued = False
        self._unused: list[int] = []
        self._unused_at_end = False
        self._locally_used = (
            torch.zeros(len(self._params), dtype=torch.int32) if self._static.reduces_used_map(self._find_unused) else None
        )

    def _on_grad_ready(self, index: int) -> None:
        if not self._armed:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            for unused in self._unused:
                self._markers[unused](unused)
        if self._locally_used is not None:
            self._locally_used[index] = 1
        self._markers[index](index)

    def _received_twice(self, index: int) -> RuntimeError:
        return RuntimeError(
            f"gradcomm.DistributedDataParallel: parameter {self._names[index]} received its gradient twice "
            "in one backward (is it used in two backward passes, or by reentrant checkpointing?)"
        )

    def _mark_ready(self, index: int) -> None:
        if self._ready[index]:
            raise self._received_twice(index)
        self._ready[index] = 1
        if not self._rebuild_done:
            self._ready_order.append(index)
        bucket, view = self._location[index]
        param = self._params[index]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif not self._runner.averages_itself:
            if not same_tensor(grad, view):
                view.copy_(grad)
        else:
            torch.mul(grad, self._grad_scale, out=view)  # as torch: pre-divide, then sum
        if self._as_view and grad is not None and not same_tensor(grad, view):
            param.grad = view
        self._pending[bucket.index] -= 1
        if self._pending[bucket.index] == 0:
            self._launch_ready_buckets()

    def _mark_sparse_ready(self, index: int) -> None:
        """:meth:`_mark_ready` for a parameter with a sparse gradient (a bucket of its own; see ddp/sparse.py)."""
        if self._ready[index]:
            raise self._received_twice(index)
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
                if self._check_finite:
                    self._check_bucket_finite(bucket)
                if bucket.index == 0:
                    self.stats.begin_step()
                future = self._runner.launch(bucket.grad_bucket(), self._synced_backwards)
                self._futures[bucket.index] = future
                self._next_bucket += 1
                if future.done():  # if it failed, stop before the next bucket's collectives are launched
                    self._raise_if_failed(bucket, future)
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

    def _check_bucket_finite(self, bucket: Bucket) -> None:
        """``check_finite``: raise before ``bucket`` is sent if it holds NaN or infinity, naming the parameter."""
        if bool(torch.isfinite(bucket.finite_values() if bucket.sparse else bucket.buffer).all()):
            return
        offending = []
        views = [bucket.finite_values()] if bucket.sparse else bucket.views
        for index, view in sorted(zip(bucket.param_indices, views, strict=True), key=lambda item: item[0]):
            finite = torch.isfinite(view)
            if not bool(finite.all()):
                nans = int(torch.isnan(view).sum())
                offending.append((self._names[index], nans, int((~finite).sum()) - nans, view.numel()))
        name, nans, infs, numel = offending[0]
        others = [item[0] for item in offending[1:]]
        also = f" (also non-finite in this bucket: {', '.join(others[:5])}{' ...' if len(others) > 5 else ''})"
        rank = dist.get_rank()
        raise NonFiniteGradientError(
            f"gradcomm.DistributedDataParallel(check_finite=True): rank {rank} has a non-finite gradient for "
            f"parameter {name!r} ({nans} NaN and {infs} infinite of {numel} values) in step "
            f"{self._synced_backwards}{also if others else ''}. Its bucket {bucket.index} was not sent; the "
            "other ranks fail with a lost-contact error when the process group's timeout passes. Find the "
            f"cause on rank {rank} (learning rate, loss scale, an input holding NaN) and resume from the last "
            "checkpoint."
        )

    def _finalize(self) -> None:
        """Autograd-engine callback at the end of backward: wait for the buckets and write ``.grad``."""
        self._armed = False
        step = self._synced_backwards
        peer_lost = False
        try:
            if self._unused_at_end:
                index = self._ready.find(0)
                while index != -1:
                    self._markers[index](index)
                    index = self._ready.find(0, index + 1)
            if self._next_bucket < len(self._buckets):
                self._unfinished = [self._names[i] for i in range(len(self._params)) if not self._ready[i]]
                return
            results = [
                self._runner.result(future, bucket.index, bucket.buffer, step)
                for bucket, future in zip(self._buckets, self._futures, strict=True)
            ]
            globally_used = self._after_last_bucket(step, results, self._locally_used)
            globally_used = self._static.after_step(self._locally_used, globally_used)
            for bucket, result in zip(self._buckets, results, strict=True):
                if bucket.sparse:
                    if globally_used is None or globally_used[bucket.param_indices[0]]:
                        bucket.write(result)
                    continue
                if not same_tensor(result, bucket.buffer):
                    bucket.buffer.copy_(result)
                self._write_gradients(bucket, globally_used)
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
                reduced = locally_used.clone()  # the local flags are kept for the static-graph record
                dist.all_reduce(reduced, group=self._group)
                globally_used = reduced.tolist()
            for bucket, result in zip(self._buckets, results, strict=True):
                self.stats.compare_result(bucket.index, result, self._group)
        return globally_used

    def _write_gradients(self, bucket: Bucket, globally_used: list[int] | None) -> None:
        for index, param, view in zip(bucket.param_indices, bucket.params, bucket.views, strict=True):
            if globally_used is not None and not globally_used[index]:
                continue  # unused on every rank: .grad is left as it was, as torch does
            if self._as_view:
                if param.grad is None or not same_tensor(param.grad, view):
                    param.grad = view
            elif param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)

    def _drain_futures(self) -> None:
        """Wait for every launched future so no collective outlives the iteration (errors already raised)."""
        wait_quietly(self._futures)

    # -- torch's Reducer methods that frameworks call, and what torch's DDP methods need --------------------
    def _rebuild_buckets(self) -> bool:
        """torch's ``Reducer._rebuild_buckets()``: do the one-time rebuild now if it is due; whether it ran.

        The DDP's forward does it anyway; Lightning calls it again before a manual backward. A collective when
        due (rank 0's ready order is broadcast), so every rank must call it.
        """
        if self._rebuild_order is None:
            return False
        with reporting_lost_peers(self._synced_backwards, "rebuilding buckets", self._group):
            self._rebuild_in_order(self._rebuild_order)
        self._rebuild_order = None
        return True

    def _delay_all_reduce(self) -> None:
        """torch's first-iteration flush of a static graph, which Lightning calls after a manual backward.

        Nothing to do here: a static graph's first iteration is reduced by the end of its backward already
        (parameters without a gradient are found and marked ready then).
        """

    def set_static_graph(self) -> None:
        """Treat the graph as static from now on; only before the first synchronised iteration, as in torch."""
        if self._synced_backwards or self._armed and self._callback_queued:
            raise RuntimeError(
                "gradcomm.DistributedDataParallel._set_static_graph() must be called before the first "
                f"synchronised iteration ({self._synced_backwards} already ran); pass static_graph=True to the "
                "constructor instead"
            )
        self._static = UsedParameters(len(self._params), True)
        self._rebuild_done = False
        self._runner.setup_checked = False  # the ranks compare the new setting at the next synchronised forward

    @property
    def has_rebuilt_buckets(self) -> bool:
        return self._has_rebuilt

    @property
    def hook_name(self) -> str:
        return self._runner.name

    def bucket_sizes_bytes(self) -> list[int]:
        """Each bucket's size in bytes (a sparse bucket: its parameter's dense size)."""
        return [sum(p.numel() * p.element_size() for p in bucket.params) for bucket in self._buckets]

    def can_set_static_graph(self) -> bool:
        """Whether the iterations so far suggest ``static_graph=True`` would hold (see ``UsedParameters``)."""
        return self._synced_backwards > 0 and self._static.consistent

    def check_finalized(self) -> None:
        """Raise if the last synchronised backward left buckets unreduced (torch's ``_check_reducer_finalized``)."""
        if self._unfinished or (self._armed and self._callback_queued):
            unready = self._unfinished or [self._names[i] for i in range(len(self._params)) if not self._ready[i]]
            raise RuntimeError(
                "gradcomm.DistributedDataParallel: the last backward did not finish reducing: no gradient "
                f"arrived for {', '.join(unready[:10])}. Pass find_unused_parameters=True if they are unused on "
                "purpose."
            )

    def remove_hooks(self) -> None:
        for handle in self._grad_hook_handles:
            handle.remove()
        self._grad_hook_handles = []


class _GradReadyHook:
    """Post-accumulate-grad hook on one parameter; holds the reducer weakly so the DDP can be collected."""

    __slots__ = ("index", "reducer")

    def __init__(self, reducer: weakref.ref[Reducer], index: int) -> None:
        self.reducer = reducer
        self.index = index

    def __call__(self, _param: torch.Tensor) -> None:
        reducer = self.reducer()
        if reducer is not None:
            reducer._on_grad_ready(self.index)
