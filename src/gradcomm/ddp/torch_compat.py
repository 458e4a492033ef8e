"""What makes gradcomm's DDP pass for ``torch.nn.parallel.DistributedDataParallel``: the torch-facing surface.

Lightning, Accelerate and torch itself branch on ``isinstance(model, torch.nn.parallel.DistributedDataParallel)``
and then reach for torch-DDP internals (``model.reducer.prepare_for_backward([])``,
``model._get_ddp_logging_data()``, ``model.static_graph``, ...). gradcomm's DDP therefore subclasses torch's
class without running its ``__init__`` (no C++ reducer is ever built), and this module supplies:

* :class:`TorchDDPSurface`, the base class between torch's DDP and gradcomm's: the torch-internal methods it
  can honour (logging data, built-in hooks, static graph, pickling), and a clear refusal,
  :class:`UnsupportedTorchMethodError`, for every inherited method that would otherwise reach torch's C++
  reducer or state gradcomm does not have;
* the constructor-argument rules of torch 2.13: :func:`check_arguments` (with
  :func:`refuse_unsupported_arguments`: one :class:`UnsupportedArgumentError` naming the argument and what to
  do instead) and :func:`resolve_buffer_sync` (``broadcast_buffers``' deprecation in favour of
  ``forward_sync_buffers``); :func:`move_to`, torch's move of the inputs to the device;
* :func:`marked_as_ddp_forward`, torch's marker of a DDP forward in progress.
"""

from __future__ import annotations

import copy
import logging
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradcomm.errors import GradcommError
from gradcomm.hooks.contract import check_hook

__all__ = [
    "NoProcessGroup",
    "TorchDDPSurface",
    "UnsupportedArgumentError",
    "UnsupportedTorchMethodError",
    "check_arguments",
    "marked_as_ddp_forward",
    "move_to",
    "refuse_unsupported_arguments",
    "resolve_buffer_sync",
]

logger = logging.getLogger(__name__)

_OWNER = "gradcomm.DistributedDataParallel"


class UnsupportedArgumentError(GradcommError, NotImplementedError, ValueError):
    """A torch DDP constructor argument gradcomm's DDP does not implement was given a non-default value.

    A ``NotImplementedError`` (so a ``RuntimeError``) and a ``ValueError``, what torch raises for bad values.
    """


class UnsupportedTorchMethodError(GradcommError, NotImplementedError):
    """A torch-DDP-internal method that has no meaning for gradcomm's Python reducer was called."""


# argument -> (its default, what to do instead)
_UNSUPPORTED_ARGUMENTS: dict[str, tuple[Any, str]] = {
    "delay_all_reduce_named_params": (
        None,
        "leave those parameters out of DDP (set requires_grad=False on them before wrapping and reduce them "
        "yourself), or use torch.nn.parallel.DistributedDataParallel",
    ),
    "param_to_hook_all_reduce": (None, "it only works with delay_all_reduce_named_params, which is not supported"),
    "mixed_precision": (
        None,
        "run the forward under torch.autocast (or cast the module) and register a compressing hook such as "
        "gradcomm.hooks.default_hooks.bf16_compress_hook to communicate in low precision",
    ),
    "device_mesh": (None, "pass process_group=device_mesh.get_group(0) for a 1-D mesh"),
    "skip_all_reduce_unused_params": (
        False,
        "use find_unused_parameters=True: unused parameters are then reduced as zeros and their .grad is left "
        "untouched where no rank used them",
    ),
    "batched_grad_copy": (
        False,
        "leave it False; gradcomm copies each gradient into its bucket as it becomes ready, and by default "
        "(gradient_as_bucket_view=None) makes .grad a view of the bucket, with no copy back",
    ),
}


def refuse_unsupported_arguments(**given: Any) -> None:
    """Raise :class:`UnsupportedArgumentError` for the first argument of ``given`` that is not at its default."""
    for name, value in given.items():
        default, advice = _UNSUPPORTED_ARGUMENTS[name]
        if value is not default and value != default:
            raise UnsupportedArgumentError(
                f"{_OWNER} does not support {name}={value!r} (torch's DDP argument); {advice}."
                f"{_torch_also_refuses(name, value)}"
            )


def check_arguments(
    module: nn.Module,
    process_group: ProcessGroup | None,
    device_ids: Sequence[int | torch.device] | None,
    check_reduction: bool,
    check_parameters_every: int | None,
    **unsupported: Any,
) -> ProcessGroup:
    """The constructor's rules, in torch's order (and gradcomm's for its own arguments): raise, or warn, as
    they say; returns the process group to reduce over (``None``: the default group)."""
    refuse_unsupported_arguments(**unsupported)
    if getattr(module, "_ddp_params_and_buffers_to_ignore", None):
        raise UnsupportedArgumentError(
            f"{_OWNER} does not support parameters and buffers to ignore "
            "(torch's _set_params_and_buffers_to_ignore_for_model): set requires_grad=False on parameters "
            "that must not be reduced, and keep rank-local state out of the module's buffers"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{_OWNER} needs an initialized default process group: call torch.distributed.init_process_group(...) "
            "first (torchrun sets the environment it needs), or use gradcomm.testing.run_on_ranks in tests"
        )
    if check_parameters_every is not None and check_parameters_every < 0:
        raise ValueError(
            f"{_OWNER}: check_parameters_every must be a positive number of steps, "
            f"or None or 0 to never check; got {check_parameters_every}"
        )
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"{_OWNER} supports one device per process; got device_ids={list(device_ids)}")
    if check_reduction:
        warnings.warn(
            "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please avoid "
            "using it.",
            FutureWarning,
            stacklevel=3,
        )
    return process_group if process_group is not None else dist.group.WORLD


def move_to(value: Any, device: torch.device) -> Any:
    """``value`` (tensors, nested in lists, tuples and dicts) on ``device``, as torch's DDP moves its inputs."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(move_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: move_to(v, device) for k, v in value.items()}
    return value


def _torch_also_refuses(name: str, value: Any) -> str:
    """torch's own sentence where torch's DDP refuses ``value`` too (so a test of torch's message matches)."""
    if name == "device_mesh" and getattr(value, "ndim", 1) != 1:
        return f" Only 1D device mesh is supported, but got {value}."
    return ""


def resolve_buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """torch 2.13's rule for the two buffer flags: ``(sync buffers at each forward, sync buffers at init)``.

    ``broadcast_buffers`` is deprecated (a ``FutureWarning`` whenever it is given, as in torch);
    ``forward_sync_buffers`` wins when both are given. The deprecated ``broadcast_buffers=False`` also
    leaves buffers out of the initial broadcast; ``forward_sync_buffers=False`` does not.
    """
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            message = (
                "Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` is "
                "deprecated and its value is ignored when `forward_sync_buffers` is provided."
            )
        else:
            message = (
                "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
                "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init."
            )
        warnings.warn(message, FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    effective = True if broadcast_buffers is None else bool(broadcast_buffers)
    return effective, effective


class TorchDDPSurface(TorchDDP):
    """torch's DDP class as gradcomm's DDP presents it: torch-internal methods honoured or refused clearly.

    Subclasses set, in ``__init__`` (which never calls torch's), the attributes torch's methods and the
    frameworks read: ``module``, ``process_group``, ``reducer``, ``static_graph``, ``forward_sync_buffers``
    (``broadcast_buffers`` is torch's property onto it), ``bucket_bytes_cap``, ... (see
    :meth:`gradcomm.ddp.distributed.DistributedDataParallel.__init__`).
    """

    # -- logging data and runtime knobs --------------------------------------------------------------------
    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's logging dictionary, with the keys frameworks read and the values gradcomm knows.

        ``can_set_static_graph`` is true once at least one synchronised step ran and every such step left the
        same parameters without a gradient (always the case without ``find_unused_parameters``, where an
        unused parameter is an error), as torch decides it.
        """
        reducer = self.reducer
        sizes = reducer.bucket_sizes_bytes()
        parameters = [p for p in self.module.parameters() if p.requires_grad]
        group = self.process_group
        return {
            "module_name": type(self.module).__name__,
            "backend_name": str(dist.get_backend(group)),
            "world_size": dist.get_world_size(group),
            "rank": dist.get_rank(group),
            "device_ids": "" if self.device_ids is None else ", ".join(map(str, self.device_ids)),
            "output_device": -1 if self.output_device is None else self.output_device,
            "dtypes": ", ".join(sorted({str(p.dtype).replace("torch.", "") for p in parameters})),
            "num_parameter_tensors": len(parameters),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in parameters),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "bucket_sizes": ", ".join(map(str, sizes)),
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view is not False),
            "broadcast_buffers": int(self.forward_sync_buffers),
            "static_graph": int(self.static_graph),
            "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in self.module.modules())),
            "is_multi_device_module": int(self.is_multi_device_module),
            "iteration": reducer.synchronised_steps,
            "has_rebuilt_buckets": int(reducer.has_rebuilt_buckets),
            "can_set_static_graph": int(reducer.can_set_static_graph()),
            "comm_hook": reducer.hook_name,
        }

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Accepted for compatibility: gradcomm has no ``_DDPSink`` and never clones the forward's outputs."""

    def _check_comm_hook(self, hook: Any) -> None:
        """torch's registration check, done by gradcomm's (torch's sentences and exception types, then the
        hook's name and what to do)."""
        check_hook(hook)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's built-in hooks, as their Python equivalents: ``ALLREDUCE`` and ``FP16_COMPRESS``."""
        from gradcomm.hooks import default_hooks

        builtin = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        if comm_hook_type not in builtin:
            raise TypeError(
                f"{_OWNER}._register_builtin_comm_hook: comm_hook_type must be dist.BuiltinCommHookType.ALLREDUCE "
                f"or dist.BuiltinCommHookType.FP16_COMPRESS, got {type(comm_hook_type).__name__} "
                f"{comm_hook_type!r}; for any other hook use register_comm_hook(state, hook)"
            )
        self.register_comm_hook(self.process_group, builtin[comm_hook_type])

    def _remove_autograd_hooks(self) -> None:
        """Remove the reducer's per-parameter gradient hooks: backward no longer synchronises."""
        self.reducer.remove_hooks()

    def _check_reducer_finalized(self) -> None:
        """Raise if the last synchronised backward left buckets unreduced (a parameter got no gradient)."""
        self.reducer.check_finalized()

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts buffers (``forward_sync_buffers`` and there are buffers)."""
        return bool(self.require_forward_param_sync and self.forward_sync_buffers and any(self.module.buffers()))

    def _set_static_graph(self) -> None:
        """Declare the graph static (the same used parameters every iteration); before the first iteration."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self.reducer.set_static_graph()
        self.static_graph = True
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` will "
                "detect unused parameters automatically, so you do not need to set find_unused_parameters=true, "
                "just be sure these unused parameters will not change during training loop while calling "
                "`_set_static_graph`.",
                stacklevel=2,
            )

    # -- pickling, as torch: no process group, no reducer, no hook -----------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        if self.process_group is not None and self.process_group is not _default_group():
            raise RuntimeError(
                f"{_OWNER}: pickling is only supported for a DDP on the default process group (torch's rule): "
                "this one was built with process_group=... Pickle ddp.module instead, or its state_dict()."
            )
        state = copy.copy(self.__dict__)
        for dropped in ("process_group", "reducer", "_reducer", "_group"):
            state.pop(dropped, None)
        state["_join"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state)
        self._restore_after_unpickling()

    def _restore_after_unpickling(self) -> None:
        raise NotImplementedError  # the subclass rebuilds its reducer


class NoProcessGroup:
    """The reducer of a DDP unpickled without a process group: every use says what to do."""

    def __getattr__(self, name: str) -> NoReturn:
        raise RuntimeError(
            f"{_OWNER} was unpickled while no default process group was initialized, so "
            "it has no reducer and cannot train or synchronise. Call torch.distributed.init_process_group(...) "
            "before loading it (the reducer is then rebuilt on the default group, without a hook, as torch "
            "does), or use its .module for inspection."
        )


def _default_group() -> Any:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


_REFUSED: dict[str, str] = {
    "_register_fused_optim": "step the optimizer after backward as usual (gradcomm reduces every bucket by the "
    "end of backward)",
    "_update_process_group": "build a new gradcomm.DistributedDataParallel on the new group and load the "
    "state_dict() into it",
    "_set_ddp_runtime_logging_sample_rate": "use ddp.comm_stats() (with .log_every) for gradcomm's per-step "
    "statistics",
    "_set_sparse_metadata": "sparse gradients are reduced without metadata; nothing to set",
    "_register_buffer_comm_hook": "buffers are broadcast from rank 0 at every forward (forward_sync_buffers); "
    "reduce them yourself for another policy",
    "_register_delay_all_reduce_hook": "delay_all_reduce_named_params is not supported",
    "_register_accum_grad_hook": "compiled-autograd's python reducer is not used; gradcomm's reducer hooks each "
    "parameter itself",
    "_setup_in_backward_optimizers": "step the optimizer after backward",
    "_ddp_init_helper": "build a new gradcomm.DistributedDataParallel",
    "_pre_forward": "call the DDP itself (ddp(inputs)), whose forward prepares the reducer",
    "_post_forward": "call the DDP itself (ddp(inputs)), whose forward prepares the reducer",
    "_lazy_init": "call the DDP itself (ddp(inputs))",
    "_match_all_reduce_for_bwd_pass": "use Join([ddp]) or ddp.join(): gradcomm's join hook matches the "
    "collectives",
    "_match_unused_params_allreduce": "use Join([ddp]) or ddp.join()",
    "_check_global_requires_backward_grad_sync": "use Join([ddp]) or ddp.join()",
    "_check_and_sync_module_buffers": "use Join([ddp]) or ddp.join()",
    "_sync_final_model": "use Join([ddp]) or ddp.join()",
    "_sync_buffers": "buffers are broadcast at every forward (forward_sync_buffers=True)",
    "_sync_module_buffers": "buffers are broadcast at every forward (forward_sync_buffers=True)",
    "_find_common_rank": "use Join([ddp]) or ddp.join()",
    "_delayed_all_reduce_hook": "delay_all_reduce_named_params is not supported",
    "_fire_reducer_autograd_hook": "gradcomm's reducer hooks each parameter itself",
    "_root_copy_hook": "mixed_precision is not supported",
    "_module_wait_for_copy_hook": "mixed_precision is not supported",
    "_clear_grad_buffer": "delay_all_reduce_named_params is not supported",
}


def _refusal(name: str, advice: str) -> Any:
    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedTorchMethodError(
            f"{_OWNER}.{name}() is torch's C++-reducer internals and has no gradcomm equivalent; {advice}."
        )

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Refused: torch-DDP internals without a gradcomm equivalent ({advice})."
    return refused


for _name, _advice in _REFUSED.items():
    setattr(TorchDDPSurface, _name, _refusal(_name, _advice))
del _name, _advice


@contextmanager
def marked_as_ddp_forward(ddp: torch.nn.parallel.DistributedDataParallel) -> Iterator[None]:
    """torch's marker of a DDP forward in progress (``DistributedDataParallel._active_ddp_module``, which
    dynamo's DDPOptimizer reads). torch's ``_inside_ddp_forward`` sets it under ``torch._disable_dynamo``,
    whose first call imports ``torch._dynamo``: about 1.5 CPU-s in every process, compiled or not. Where
    dynamo is not loaded nothing can be compiling, so the class attribute is set here directly."""
    if "torch._dynamo" in sys.modules:
        with ddp._inside_ddp_forward():
            yield
        return
    marked = torch.nn.parallel.DistributedDataParallel
    previous = marked._active_ddp_module
    marked._active_ddp_module = ddp
    try:
        yield
    finally:
        marked._active_ddp_module = previous
