"""gradcomm's DistributedDataParallel: torch's DDP interface, a Python reducer, pluggable communication hooks.

Construction checks that every rank has the same parameters, broadcasts parameters and buffers from rank 0
and hands the trainable parameters to a :class:`~gradcomm.ddp.reducer.Reducer`. Each forward optionally
broadcasts buffers (BatchNorm statistics) from rank 0 and arms the reducer for the coming backward, in which
gradients are averaged bucket by bucket, overlapped with the rest of backward.

Failure behaviour
-----------------
Nothing waits without a timeout: every collective is bounded by the process group's timeout (the
``timeout=`` of ``torch.distributed.init_process_group``; torch's default is 30 minutes for gloo, so set a
shorter one). When a peer dies or stalls, this rank raises :class:`~gradcomm.comm.faults.PeerLostError`
naming the step and the bucket (or buffer broadcast, join flag, ...) it was communicating, at once when the
peer's connection closes, at the latest when the timeout passes. A hook that raises or whose future fails
raises :class:`~gradcomm.CommHookError` with the hook, bucket, step and the original traceback. After any
failure in a synchronised step the DDP refuses to continue (its collectives may be out of step with its
peers'): restart and resume from a checkpoint (:mod:`gradcomm.checkpoint`).

At the first synchronised forward (or at ``register_comm_hook``) the ranks compare hook, hook options, bucket
layout and the options that add collectives, and all raise
:class:`~gradcomm.comm.agreement.RanksDisagreeError` if they differ. Every ``check_parameters_every`` steps
(20 by default) they compare checksums of their parameters and all raise
:class:`~gradcomm.comm.faults.ParameterDriftError` if the replicas differ. Optional: ``check_finite`` (no NaN
or infinity leaves the rank), and :meth:`join` for ranks with different numbers of batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _get_device_index
from torch.distributed import ProcessGroup
from torch.distributed.algorithms.join import Join, Joinable

from gradcomm.comm import collective_device
from gradcomm.comm.agreement import broadcast_coalesced, check_same_parameters
from gradcomm.comm.faults import reporting_lost_peers
from gradcomm.comm.telemetry import CommStats
from gradcomm.ddp import join as uneven
from gradcomm.ddp.bucketing import bucket_size_limits, bucket_size_list
from gradcomm.ddp.reducer import Reducer
from gradcomm.ddp.reducer_surface import ReducerSurface
from gradcomm.ddp.sparse import expects_sparse_gradient
from gradcomm.ddp.torch_compat import (
    NoProcessGroup,
    TorchDDPSurface,
    check_arguments,
    marked_as_ddp_forward,
    move_to,
    resolve_buffer_sync,
)
from gradcomm.errors import GradcommError
from gradcomm.hooks import parameter_keys
from gradcomm.hooks.contract import CommHook

__all__ = ["CHECK_PARAMETERS_EVERY", "DistributedDataParallel", "ParameterMismatchError"]


class ParameterMismatchError(GradcommError, ValueError, RuntimeError):
    """The ranks' models differ in their parameters (a ``RuntimeError`` as torch's, and a ``ValueError``)."""


def _check_same_parameters(module: nn.Module, group: ProcessGroup) -> None:
    """Raise on every rank if the ranks' parameters differ in number, name, shape or dtype."""
    local = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, local, group=group)
    reference = everyone[0]
    for rank, described in enumerate(everyone[1:], start=1):
        for position, (mine, theirs) in enumerate(zip(reference, described, strict=False)):
            if mine != theirs:
                raise ParameterMismatchError(
                    "gradcomm.DistributedDataParallel: ranks disagree on the model's parameters. "
                    f"Parameter #{position} is {mine[0]} {mine[1]} {mine[2]} on rank 0 but {theirs[0]} "
                    f"{theirs[1]} {theirs[2]} on rank {rank}. Build the same model on every rank."
                )
        if len(described) != len(reference):
            longer = described if len(described) > len(reference) else reference
            raise ParameterMismatchError(
                "gradcomm.DistributedDataParallel: ranks disagree on the model's parameters: rank 0 has "
                f"{len(reference)} parameters, rank {rank} has {len(described)} (the first parameter only one "
                f"of them has is {longer[min(len(reference), len(described))][0]}). Build the same model on "
                "every rank."
            )


CHECK_PARAMETERS_EVERY = 20
"""The default interval, in synchronised steps, of the replica check (see ``check_parameters_every``)."""


class DistributedDataParallel(TorchDDPSurface):
    """Data parallelism at the module level, with gradient communication done by a pluggable hook.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel`` (torch 2.13), and an instance of it:
    ``isinstance(ddp, torch.nn.parallel.DistributedDataParallel)`` holds, so Lightning, Accelerate and
    torch's own utilities treat it as torch's DDP, but no C++ reducer is built (torch's ``__init__`` never
    runs); :mod:`gradcomm.ddp.torch_compat` lists the torch internals it honours and refuses. The constructor
    takes torch's arguments in torch's order; those it does not implement raise
    :class:`~gradcomm.ddp.torch_compat.UnsupportedArgumentError` when given a non-default value.

    Args:
        module: the model, already on its device; the same architecture on every rank.
        device_ids: ``None`` or one device; inputs are moved to it.
        output_device: accepted and recorded, as torch (outputs stay where the module puts them).
        dim: accepted and recorded; torch only uses it to scatter inputs over several ``device_ids``, which
            neither torch 2.13 nor gradcomm supports, so it has no effect (any value is harmless).
        broadcast_buffers: deprecated in torch 2.13 for ``forward_sync_buffers`` (a ``FutureWarning``, as in
            torch); ``False`` also leaves buffers out of the initial broadcast.
        init_sync: check that the ranks' parameters agree and broadcast parameters (and buffers) from rank 0.
        process_group: the group to average over; ``None`` for the default group.
        bucket_cap_mb: bucket size limit in MB; ``None`` means 25 MB with a 1 MB first bucket (torch's
            defaults), an explicit value applies to every bucket.
        find_unused_parameters: traverse the autograd graph from the forward output each iteration and treat
            parameters it does not reach as ready (costs a graph traversal and a small allreduce).
        check_reduction: deprecated no-op, as in torch (a ``FutureWarning`` when true).
        gradient_as_bucket_view: ``True``: each ``.grad`` is a view into its bucket, as torch's option (no copy
            back after the reduction, one gradient-sized buffer less). ``False``: ``.grad`` are separate
            tensors the reduced buckets are copied into, as torch's default. ``None`` (the default): views
            where nothing a user sees changes: contiguous dense parameters; a ``.grad`` the user still
            holds after ``zero_grad()`` (or a ``.data`` alias or view of it) keeps its values, since its
            bucket then gets new memory before the next step writes into it; and a ``.grad`` tensor the user
            holds through the backward (made by a ``no_sync()`` backward, or assigned) receives the reduced
            values, as torch's copies give it, instead of being replaced by a view. The difference from ``False``
            that remains visible: ``.grad`` is a view (``._base`` is the bucket, ``torch.save`` of a lone
            ``.grad`` stores the bucket). Pass ``False`` for torch's default exactly.
        static_graph: the same parameters are used in every iteration. The first iteration finds those without
            a gradient at the end of backward (no ``find_unused_parameters`` needed); later ones mark them
            ready at once, without a graph search or the used-map allreduce, and leave the ``.grad`` of
            parameters no rank uses untouched. Buckets are rebuilt after the first iteration.
        bucket_cap_mb_list: torch's per-bucket limits in MB: bucket ``k`` (of a dtype and device) uses entry
            ``k``, the last entry applies to the rest; overrides ``bucket_cap_mb``.
        forward_sync_buffers: broadcast buffers from rank 0 at every forward (``None``: true).
        delay_all_reduce_named_params: not supported, nor are ``param_to_hook_all_reduce``,
            ``mixed_precision``, ``device_mesh``, ``skip_all_reduce_unused_params`` and ``batched_grad_copy``;
            each is accepted at its default only.
        check_finite: before a bucket is communicated, check that it holds no NaN or infinity, and raise
            :class:`~gradcomm.comm.faults.NonFiniteGradientError` naming the first such parameter and the
            rank otherwise (the values never leave the rank). Costs one pass over the gradients per step
            (and a device synchronisation per bucket on GPUs). Off by default.
        check_parameters_every: every this many synchronised steps (default
            :data:`CHECK_PARAMETERS_EVERY`, 20), compare a checksum of every parameter's bits across
            ranks (one pass over the parameters and one ``all_gather`` of three integers) and raise
            :class:`~gradcomm.comm.faults.ParameterDriftError` on every rank, naming the step, the ranks that
            differ from the lowest rank and the first differing parameter, if the replicas drifted apart.
            So a silent divergence, whatever its cause, stops training within this many steps. Skipped
            while the hook leaves replicas different on purpose (noop, post-local SGD after its warm-up;
            :func:`~gradcomm.hooks.contract.replicas_may_differ`): the model averagers check right after
            each averaging instead. 0 or ``None``: never.

    Parameters of ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True`` are reduced as sparse tensors, as
    in torch (:mod:`gradcomm.ddp.sparse`). Pickling (``torch.save(ddp)``) works as in torch: the process group,
    reducer and hook are dropped and rebuilt on the default group when unpickled.

    The timeout of every collective is the process group's (``init_process_group(timeout=...)``).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool | None = None,
        static_graph: bool = False,
        delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        check_finite: bool = False,
        check_parameters_every: int | None = CHECK_PARAMETERS_EVERY,
    ) -> None:
        nn.Module.__init__(self)
        Joinable.__init__(self)
        group = check_arguments(
            module,
            process_group,
            device_ids,
            check_reduction,
            check_parameters_every,
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            mixed_precision=mixed_precision,
            device_mesh=device_mesh,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            batched_grad_copy=batched_grad_copy,
        )
        forward_sync, init_sync_buffers = resolve_buffer_sync(broadcast_buffers, forward_sync_buffers)
        bucket_caps = bucket_size_list(bucket_cap_mb_list)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise RuntimeError(
                "gradcomm.DistributedDataParallel: the module has no parameter that requires a gradient, so "
                "there is nothing to synchronise; train it without DDP or unfreeze a parameter"
            )
        self.module = module
        self.process_group = group
        self.dim = dim
        self.device = named[0][1].device
        self.device_type = self.device.type
        on_accelerator = bool(device_ids) and self.device_type != "cpu"
        self.device_ids = [_get_device_index(d, True) for d in device_ids] if on_accelerator else None
        self.output_device = _get_device_index(output_device or device_ids[0], True) if on_accelerator else None
        self.is_multi_device_module = len({p.device for _, p in named}) > 1
        self.forward_sync_buffers = forward_sync
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = False
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.mixed_precision = None
        self.skip_all_reduce_unused_params = False
        self.batched_grad_copy = False
        self.parameters_to_ignore: set[str] = set()
        self.bucket_bytes_cap = max(bucket_caps) if bucket_caps else bucket_size_limits(bucket_cap_mb)[1]
        self.bucket_bytes_cap_list = list(bucket_caps or [])
        self.bucket_bytes_cap_default = bucket_cap_mb is None and not bucket_caps
        self.logger = None  # torch's C++ logger; gradcomm logs through logging and ddp.comm_stats()
        self._use_python_reducer = False
        self._delay_all_reduce_all_params = False
        self.check_finite = check_finite
        self.check_parameters_every = check_parameters_every or 0
        self._input_device = torch.device(device_ids[0]) if device_ids else None
        self._reducer_options = {
            "bucket_cap_mb": bucket_cap_mb,
            "bucket_caps": bucket_caps,
            "static_graph": static_graph,
        }
        self._join: uneven.JoinState | None = None  # set while a Join context holds this DDP
        self._buffer_owners: list[nn.Module] | None = None  # see _module_buffers
        self._last_parameter_check = 0
        _check_same_parameters(module, group)
        if init_sync:
            buffers = list(module.buffers()) if init_sync_buffers else []
            broadcast_coalesced([p for p in module.parameters()] + buffers, group)
        self._build_reducer()
        if static_graph:
            self._set_static_graph()

    def _build_reducer(self) -> None:
        """Build the reducer over the trainable parameters (at construction, and again after unpickling)."""
        parameter_keys.name_parameters(self.module)  # hook state keyed by name resumes whatever the buckets
        named = [(name, p) for name, p in self.module.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        self._group = self.process_group
        self._reducer = Reducer(
            params,
            [name for name, _ in named],
            self.process_group,
            self._reducer_options["bucket_cap_mb"],
            self.find_unused_parameters,
            self.gradient_as_bucket_view,
            check_finite=self.check_finite,
            settings={
                "forward_sync_buffers": repr(self.forward_sync_buffers),
                "check_parameters_every": repr(self.check_parameters_every),
            },
            sparse=expects_sparse_gradient(self.module, params),
            bucket_caps=self._reducer_options["bucket_caps"],
        )
        self.reducer = ReducerSurface(self._reducer)  # torch's C++ reducer's place, which frameworks reach into

    def _restore_after_unpickling(self) -> None:
        """Rebuild the reducer on the default group, as torch does, or leave the module for inspection only."""
        static, self.static_graph = self.static_graph, False
        if dist.is_available() and dist.is_initialized():
            self.process_group = dist.group.WORLD
            self._build_reducer()
            if static:
                self._set_static_graph()
        else:
            self.process_group = self._group = None
            self.reducer = self._reducer = NoProcessGroup()  # type: ignore[assignment]
            self.static_graph = static

    @property
    def synchronised_steps(self) -> int:
        """Synchronised steps completed on this rank; errors name steps counting from 0 (step ``n`` is the one
        after ``n`` completed steps). Under :meth:`join` a joined rank's shadow steps count too."""
        return self._reducer.synchronised_steps

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._reducer.check_usable()
        synchronise = torch.is_grad_enabled() and self.require_backward_grad_sync
        self.require_forward_param_sync = synchronise
        source = 0
        if self._join is not None and self._join_config.enable:
            source = uneven.training_step(self, synchronise)
        if synchronise:
            self._reducer.prepare_for_forward(source)
            self._maybe_check_parameters(joined=False)
            self._reducer.arm_for_forward()  # a backward inside the forward (manual optimization) syncs too
        else:
            self._reducer.disarm()
        self._broadcast_buffers(source)
        if self._input_device is not None:
            inputs, kwargs = move_to(inputs, self._input_device), move_to(kwargs, self._input_device)
        with marked_as_ddp_forward(self):
            output = self.module(*inputs, **kwargs)
        if synchronise and self.require_backward_grad_sync:  # Lightning turns it off inside manual optimization
            self._reducer.prepare_for_backward(output)
        elif synchronise:
            self._reducer.disarm()
        return output

    def _broadcast_buffers(self, source: int) -> None:
        if self.forward_sync_buffers:
            buffers = self._module_buffers()
            if buffers:
                # as torch: the broadcast keeps the buffers' version counters, so a backward through an earlier
                # forward that saved them (two forwards, one backward) still finds them unchanged
                with (
                    reporting_lost_peers(self.synchronised_steps, "broadcasting buffers", self._group),
                    torch.autograd._unsafe_preserve_version_counter(tuple(buffers)),
                ):
                    broadcast_coalesced(buffers, self._group, source)

    def _module_buffers(self) -> list[torch.Tensor]:
        """``list(self.module.buffers())`` without walking the module tree at every forward (a cost per
        submodule, most of them without buffers; figures in
        ``docs/notes/2026-11-27-figures-from-docstrings.md``): the submodules that hold buffers are listed at
        the first forward (torch's DDP lists the buffers themselves once, at construction), and their buffers
        are read afresh, so a reassigned one (``bn.running_mean = t``) is the one broadcast; one registered
        later on a submodule that had none is not."""
        if self._buffer_owners is None:
            self._buffer_owners = [module for module in self.module.modules() if module._buffers]
        unique: dict[int, torch.Tensor] = {}
        for module in self._buffer_owners:
            for buffer in module._buffers.values():
                if buffer is not None:
                    unique.setdefault(id(buffer), buffer)
        return list(unique.values())

    # -- uneven inputs: torch's Joinable interface (see gradcomm.ddp.join) ---------------------------------
    @contextmanager
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Iterator[None]:
        """Train on uneven inputs: ranks that run out of batches keep matching the others' collectives.

        ::

            with ddp.join():  # or: with torch.distributed.algorithms.join.Join([ddp]):
                for batch in my_batches:  # any number of batches per rank
                    loss_fn(ddp(batch)).backward()
                    optimizer.step()

        torch's ``Join`` context drives it (:mod:`gradcomm.ddp.join`): every forward inside costs two small
        allreduces (torch's "not joined yet" notification and one flag per rank); a rank that has left the
        loop waits at the end of the ``with`` block and does its part of each step the others still take
        (buffer broadcast, bucket rebuild, and the communication hook on zero buckets, in bucket order, so
        any hook's collectives match). When every rank has finished, parameters and buffers are broadcast
        from a rank that trained longest, so all replicas leave identical. A joined rank's optimizer state
        is not updated in the steps it missed.

        Averaging follows torch: joined ranks contribute zeros. With ``divide_by_initial_world_size=True``
        (the default) the sum is divided by the initial world size, so a step with ``k`` active ranks
        takes ``k / world_size`` of a full step; with ``False`` the default reduction divides by the
        number of active ranks instead. A registered hook divides as it always does (by its group's size),
        whatever this flag says, as in torch.

        Args:
            divide_by_initial_world_size: see above.
            enable: ``False`` makes this a no-op (no flags, no shadowing).
            throw_on_early_termination: raise on every rank, naming the ranks that ran out and the step, as
                soon as any rank runs out of inputs, instead of shadowing.

        Every forward inside must be followed by its backward (on the ranks still training), as in torch;
        a rank that raises inside leaves the others to fail at the process group's timeout.
        """
        try:
            with Join(
                [self],
                enable=enable,
                divide_by_initial_world_size=divide_by_initial_world_size,
                stop_on_uneven_inputs=throw_on_early_termination,
            ):
                yield
        finally:
            uneven.leave(self)

    def join_hook(self, **kwargs: Any) -> uneven.DDPJoinHook:
        """torch's ``Joinable`` interface: the hook a ``Join`` context runs on this rank once it has joined.

        Keyword arguments (given to ``Join(...)``): ``divide_by_initial_world_size`` (default ``True``) and
        ``stop_on_uneven_inputs`` (default ``False``); see :meth:`join`.
        """
        return uneven.DDPJoinHook(self, **kwargs)

    @property
    def join_device(self) -> torch.device:
        """torch's ``Joinable`` interface: the device of the join context's collectives."""
        return collective_device(self._group)

    @property
    def join_process_group(self) -> ProcessGroup:
        """torch's ``Joinable`` interface: the process group of the join context's collectives."""
        return self._group

    # -- drift check -----------------------------------------------------------------------------------------
    def _maybe_check_parameters(self, joined: bool) -> None:
        every = self.check_parameters_every
        step = self.synchronised_steps
        if not every or step == 0 or step % every or step == self._last_parameter_check:
            return
        if self._reducer.runner.replicas_may_differ():  # the model averager checks right after it averages
            return
        self._last_parameter_check = step
        with reporting_lost_peers(step, "comparing parameter checksums", self._group):
            self._check_parameters(step, joined)

    def check_parameters(self) -> None:
        """Compare the ranks' parameters now (a collective: every rank must call it); raise
        :class:`~gradcomm.comm.faults.ParameterDriftError` on every rank if they differ."""
        with reporting_lost_peers(self.synchronised_steps, "comparing parameter checksums", self._group):
            self._check_parameters(self.synchronised_steps, joined=False)

    def _check_parameters(self, step: int, joined: bool) -> None:
        check_same_parameters(
            list(self.module.named_parameters()),
            self._group,
            f"gradcomm.DistributedDataParallel(check_parameters_every={self.check_parameters_every})",
            f"after {step} synchronised steps",
            take_part=not joined,  # a joined rank keeps stale parameters until the end of join()
            advice=" A hook that leaves replicas different on purpose declares it (see "
            "gradcomm.hooks.contract.replicas_may_differ); check_parameters_every=0 turns this check off.",
        )

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in the backward passes inside; the next synchronised one reduces them."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Register ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]`` to reduce every bucket.

        Once per DDP, before the first forward. The bucket holds the local, undivided gradients; the future
        must complete with a tensor of the bucket buffer's shape and dtype, which becomes the gradients.

        This is a collective: every rank must call it, with the same hook and options. The ranks compare
        the hook's qualified name, its state's plain options (numbers, strings, flags; not tensors), the
        bucket layout and the DDP options that add collectives, and all raise
        :class:`~gradcomm.comm.agreement.RanksDisagreeError`, naming what differs on which ranks, if they
        disagree. A state that holds rank-specific plain values can define ``comm_hook_fingerprint() ->
        str`` to say what must agree.
        """
        self._reducer.register_comm_hook(state, hook)

    def bucket_layout(self) -> dict[str, Any]:
        """The bucket layout as plain values; saved by :func:`gradcomm.checkpoint.save_checkpoint`.

        Hook state is kept per parameter and resumes in any layout; a resumed run that reduces in the original
        run's buckets from its first step also sums in the same order, so it continues bit for bit.
        """
        return self._reducer.layout.bucket_layout(self._reducer.names)

    def load_bucket_layout(self, layout: dict[str, Any]) -> None:
        """Adopt a layout from :meth:`bucket_layout` (before the resumed run's first backward)."""
        self._reducer.load_bucket_layout(layout)

    def comm_stats(self) -> CommStats:
        """Per-step and cumulative communication statistics on this rank (see :mod:`gradcomm.comm.telemetry`).

        Resettable (``.reset()``); set ``.measure_error = True`` for the compression error, ``.log_every`` to
        log through :mod:`logging`, ``.jsonl_path`` to append every step as a JSON line.
        """
        return self._reducer.runner.stats
