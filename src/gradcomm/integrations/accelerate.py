"""gradcomm's communication hooks (and, optionally, gradcomm's DDP) under Hugging Face Accelerate.

Accelerate
----------

``pip install gradcomm[accelerate]``; launch as usual (``accelerate launch``, ``torchrun``)::

    from gradcomm.integrations.accelerate import GradcommAccelerator, GradcommKwargs

    comm = GradcommKwargs(hook="powersgd", matrix_approximation_rank=1, start_powerSGD_iter=10)
    accelerator = GradcommAccelerator(kwargs_handlers=[comm], gradient_accumulation_steps=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.register_for_checkpointing(comm.checkpoint)   # per-rank hook state in save_state/load_state
    with accelerator.join_uneven_inputs([model], even_batches=False):   # gloo (MULTI_CPU) too
        for x, y in loader:
            with accelerator.accumulate(model):                # no_sync on accumulating steps
                accelerator.backward(loss_fn(model(x), y)); optimizer.step(); optimizer.zero_grad()

``hook`` is any name of :func:`gradcomm.hooks.registry.hook_names` (its options as keywords, ``wrapper="bf16"``)
or a hook callable with ``state=``. ``GradcommKwargs(..., ddp="gradcomm")`` wraps the model in gradcomm's own
DistributedDataParallel instead of torch's.

What this module adds to Accelerate 1.15, and why:

- :class:`GradcommKwargs` is a ``DistributedDataParallelKwargs``: the DDP constructor options keep their
  names and meaning, and its ``register_comm_hook(model)``, which Accelerate calls right after wrapping the
  model, registers a gradcomm hook. Accelerate's own ``comm_hook``/``comm_wrapper`` know only torch's five
  hooks, and torch's bf16, quantization and batched PowerSGD hooks fail on gloo; gradcomm's do not.
- :class:`GradcommAccelerator` is needed because ``Accelerator`` looks kwargs handlers up by their exact class,
  so it refuses any subclass of ``DistributedDataParallelKwargs``. It also makes ``join_uneven_inputs`` work on
  CPU: Accelerate enables ``torch.distributed.algorithms.Join`` only for GPU-like devices and otherwise just
  warns, so ranks with different numbers of batches would wait for each other forever on gloo.
- With ``ddp="gradcomm"`` the model is wrapped in :class:`gradcomm.DistributedDataParallel` (by
  :meth:`GradcommAccelerator.prepare_model`, after Accelerate has placed the model and applied mixed precision).
  Accelerate's ``no_sync``/``accumulate``, ``trigger_sync_in_backward``, ``join_uneven_inputs``,
  ``unwrap_model`` and ``save_state`` see it as a torch DDP, which it subclasses.
- Accelerate's ``save_state`` writes custom objects from the main process only, but a hook's state (PowerSGD's
  error feedback) differs between ranks. :attr:`GradcommKwargs.checkpoint` gathers every rank's hook state
  into the one file and gives each rank its own back on ``load_state``; for gradcomm's DDP it also carries the
  bucket layout, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable

try:
    from accelerate import Accelerator
    from accelerate.data_loader import DataLoaderDispatcher
    from accelerate.utils import DistributedDataParallelKwargs, DistributedType
except ImportError as exc:  # pragma: no cover - exercised by a test that hides accelerate
    raise ImportError(
        "gradcomm.integrations.accelerate needs Hugging Face Accelerate: pip install 'gradcomm[accelerate]' "
        f"(or pip install accelerate); importing it failed: {exc}"
    ) from exc

from gradcomm.checkpoint import from_every_rank
from gradcomm.hooks.registry import check_options, get_hook, make_comm_hook, resolve_hook_name

__all__ = ["GradcommAccelerator", "GradcommKwargs", "HookStateCheckpoint"]

logger = logging.getLogger(__name__)

_DDP_OPTIONS = tuple(
    f.name
    for f in dataclasses.fields(DistributedDataParallelKwargs)
    if f.name not in ("comm_hook", "comm_wrapper", "comm_state_option")
)
_ACCELERATE_HOOK_FIELDS = ("comm_hook", "comm_wrapper", "comm_state_option")
_DDP_KINDS = ("torch", "gradcomm")


class GradcommKwargs(DistributedDataParallelKwargs):
    """How Accelerate wraps the model in DDP, and which gradcomm hook that DDP communicates with.

    Pass it to :class:`GradcommAccelerator` (``kwargs_handlers=[...]``). A plain ``Accelerator`` refuses it.

    Args:
        hook: a registry name (``"powersgd"``, ``"bf16_compress"``, ``"quantize_per_tensor"``, ...; see
            :func:`gradcomm.hooks.registry.hook_names`), a torch ``DDPCommHookType``, a hook callable
            ``hook(state, bucket) -> Future``, or ``None`` for DDP's own allreduce.
        state: the state registered with a hook callable (``None``: the default process group). Only with a
            callable; a named hook builds its state from the options.
        wrapper: ``"fp16"`` or ``"bf16"`` to run a named hook on a half-precision copy of each bucket.
        ddp: ``"torch"`` (``torch.nn.parallel.DistributedDataParallel``, as Accelerate does) or ``"gradcomm"``
            (:class:`gradcomm.DistributedDataParallel`).
        process_group: the group a named hook communicates over; ``None``: the default group (the one the
            DDP averages over).
        options: torch DDP constructor options (``bucket_cap_mb``, ``find_unused_parameters``,
            ``gradient_as_bucket_view``, ``static_graph``, ...; the fields of ``DistributedDataParallelKwargs``)
            and the named hook's options (``matrix_approximation_rank=1``), told apart by name.

    Options are checked when it is constructed, before any process group exists, so a typo fails at once on
    every rank. After ``accelerator.prepare(model)``, :attr:`hook_state` is the registered state.
    """

    def __init__(
        self,
        hook: str | Enum | Callable[..., Any] | None = None,
        *,
        state: Any = None,
        wrapper: str | None = None,
        ddp: Literal["torch", "gradcomm"] = "torch",
        process_group: dist.ProcessGroup | None = None,
        **options: Any,
    ) -> None:
        accelerate_fields = [name for name in _ACCELERATE_HOOK_FIELDS if name in options]
        if accelerate_fields:
            raise TypeError(
                f"GradcommKwargs: {', '.join(accelerate_fields)} are Accelerate's own hook fields, which know only "
                "torch's hooks; choose the hook with GradcommKwargs(hook='powersgd', matrix_approximation_rank=1) "
                "or GradcommKwargs(hook=my_hook, state=my_state)"
            )
        if ddp not in _DDP_KINDS:
            raise ValueError(f"GradcommKwargs: ddp must be 'torch' or 'gradcomm', got {ddp!r}")
        super().__init__(**{name: options.pop(name) for name in _DDP_OPTIONS if name in options})
        if hook is None or isinstance(hook, str | Enum):
            if state is not None:
                raise TypeError(
                    "GradcommKwargs: state= goes with a hook callable; a named hook builds its state from "
                    f"its options (hook={hook!r})"
                )
            if hook is None and (options or wrapper is not None):
                given = ", ".join([*options, *(["wrapper"] if wrapper is not None else [])])
                raise TypeError(
                    f"GradcommKwargs: {given} configure a hook, but no hook was given; name one with hook=..., "
                    f"or drop them (the DDP options are: {', '.join(_DDP_OPTIONS)})"
                )
            if hook is not None:
                hook = resolve_hook_name(hook).value.name
                options = check_options(hook, **options)
                if wrapper is not None:
                    get_hook(hook, wrapper=wrapper)
        elif callable(hook):
            if options or wrapper is not None:
                given = ", ".join([*options, *(["wrapper"] if wrapper is not None else [])])
                raise TypeError(
                    f"GradcommKwargs: {given} are not DDP options, and hook options apply to named hooks only; "
                    f"build the state of {getattr(hook, '__name__', hook)!r} yourself and pass it as state= "
                    f"(the DDP options are: {', '.join(_DDP_OPTIONS)})"
                )
        else:
            raise TypeError(
                "GradcommKwargs: hook must be a registry name, a DDPCommHookType, a hook callable or None; "
                f"got {type(hook).__name__}"
            )
        self.hook = hook
        self.hook_options = options
        self.state = state
        self.wrapper = wrapper
        self.ddp = ddp
        self.process_group = process_group
        self.hook_state: Any = None
        self.model: torch.nn.Module | None = None
        self.checkpoint = HookStateCheckpoint(self)

    def to_dict(self, ignore_keys: Sequence[str] = ()) -> dict[str, Any]:
        """The DDP constructor options only (Accelerate builds ``to_kwargs()``, the non-default ones, from it)."""
        return {name: getattr(self, name) for name in _DDP_OPTIONS if name not in ignore_keys}

    def __repr__(self) -> str:
        options = {**self.to_kwargs(), **self.hook_options}
        shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
        hook = getattr(self.hook, "__name__", self.hook)
        return f"GradcommKwargs(hook={hook!r}, ddp={self.ddp!r}{', ' if shown else ''}{shown})"

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    def register_comm_hook(self, model: torch.nn.Module) -> None:
        """Register the hook on ``model`` (a torch or gradcomm DDP); Accelerate calls this after wrapping.

        Every rank must call it (hook registration is a collective on gradcomm's DDP). A handler registers
        on one model: prepare one model per handler.
        """
        if self.model is not None:
            raise RuntimeError(
                "GradcommKwargs: this handler already registered its hook on a model prepared earlier; hook "
                "state belongs to one DDP, so prepare only one model per GradcommAccelerator"
            )
        self.model = model
        if self.hook is None:
            return
        if callable(self.hook) and not isinstance(self.hook, str):
            model.register_comm_hook(self.state, self.hook)
            self.hook_state = self.state
        else:
            hook, state = make_comm_hook(
                self.hook, process_group=self.process_group, wrapper=self.wrapper, **self.hook_options
            )
            model.register_comm_hook(state, hook)
            self.hook_state = state
        logger.info("registered communication hook %r on %s", self.hook, type(model).__name__)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


class HookStateCheckpoint:
    """The per-rank part of a run for ``accelerator.register_for_checkpointing``: hook state and bucket layout.

    ``save_state`` calls :meth:`state_dict` on every rank and writes the main process's result; so
    :meth:`state_dict` gathers every rank's hook state (a collective) and :meth:`load_state_dict` restores
    this rank's. The checkpoint records the world size and is refused at another. For gradcomm's DDP the
    bucket layout is included, so PowerSGD's per-bucket state meets the same buckets after resuming.
    """

    def __init__(self, handler: GradcommKwargs) -> None:
        self.handler = handler

    def _prepared(self, action: str) -> Any:
        if self.handler.model is None:
            raise RuntimeError(
                f"GradcommKwargs.checkpoint: cannot {action} before accelerator.prepare(model) has registered "
                "the hook; call save_state/load_state after prepare"
            )
        return self.handler.model

    def state_dict(self) -> dict[str, Any]:
        model = self._prepared("save")
        hook_state = self.handler.hook_state
        own: dict[str, Any] = {
            "hook_state": _to_cpu(hook_state.state_dict()) if callable(getattr(hook_state, "state_dict", None)) else None,
            "bucket_layout": model.bucket_layout() if callable(getattr(model, "bucket_layout", None)) else None,
        }
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        return {"world_size": world_size, "ranks": from_every_rank(own, world_size, (None, "save_state"))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        model = self._prepared("load")
        world_size, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        if state.get("world_size") != world_size:
            raise ValueError(
                f"GradcommKwargs.checkpoint: the checkpoint holds the hook state of {state.get('world_size')} "
                f"ranks, but this run has {world_size}; per-rank hook state cannot be redistributed, so resume "
                "at the saved world size"
            )
        own = state["ranks"][rank]
        if own["bucket_layout"] is not None and callable(getattr(model, "load_bucket_layout", None)):
            model.load_bucket_layout(own["bucket_layout"])
        if own["hook_state"] is not None:
            self.handler.hook_state.load_state_dict(own["hook_state"])


class GradcommAccelerator(Accelerator):
    """An ``Accelerator`` that takes a :class:`GradcommKwargs` among its ``kwargs_handlers``.

    Everything else is Accelerate's. Differences: the model's DDP registers the gradcomm hook (and is
    gradcomm's own with ``GradcommKwargs(ddp="gradcomm")``), and :meth:`join_uneven_inputs` works on CPU
    (gloo) as on GPUs.
    """

    def __init__(self, *args: Any, kwargs_handlers: Sequence[Any] | None = None, **kwargs: Any) -> None:
        handlers = list(kwargs_handlers or [])
        ours = [h for h in handlers if isinstance(h, GradcommKwargs)]
        if len(ours) > 1:
            raise ValueError(f"GradcommAccelerator: pass one GradcommKwargs in kwargs_handlers, got {len(ours)}")
        if ours and any(type(h) is DistributedDataParallelKwargs for h in handlers):
            raise ValueError(
                "GradcommAccelerator: kwargs_handlers holds both a DistributedDataParallelKwargs and a "
                "GradcommKwargs; GradcommKwargs takes the same DDP options, so pass only it"
            )
        rest = [h for h in handlers if not isinstance(h, GradcommKwargs)]
        super().__init__(*args, kwargs_handlers=rest or None, **kwargs)
        if ours:
            self.ddp_handler = ours[0]

    def _wraps_in_gradcomm(self, model: torch.nn.Module, evaluation_mode: bool) -> bool:
        handler = self.ddp_handler
        return (
            isinstance(handler, GradcommKwargs)
            and handler.ddp == "gradcomm"
            and not evaluation_mode
            and not getattr(model, "_is_accelerate_prepared", False)
            and self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
            and any(p.requires_grad for p in model.parameters())
        )

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Accelerate's ``prepare_model``; with ``GradcommKwargs(ddp="gradcomm")`` the DDP is gradcomm's.

        Accelerate prepares the model as for evaluation (device placement, mixed precision, ``torch.compile``
        of the module if configured), then the prepared module is wrapped in
        :class:`gradcomm.DistributedDataParallel` with the handler's DDP options and the hook is registered.
        As for torch's DDP, the accelerator keeps the unwrapped module in its list of models, so ``save_state``
        checkpoints are the same (no ``module.`` prefix) whichever DDP trained.
        """
        if not self._wraps_in_gradcomm(model, evaluation_mode):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        import gradcomm

        handler = self.ddp_handler
        inner = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        del inner._is_accelerate_prepared
        device_ids = [self.local_process_index] if self.distributed_type == DistributedType.MULTI_GPU else None
        wrapped = gradcomm.DistributedDataParallel(inner, device_ids=device_ids, **handler.to_kwargs())
        handler.register_comm_hook(wrapped)
        wrapped._is_accelerate_prepared = True
        return wrapped

    @contextlib.contextmanager
    def join_uneven_inputs(
        self, joinables: list[Joinable], even_batches: bool | None = None
    ) -> Iterator[None]:
        """Accelerate's ``join_uneven_inputs``, enabled on CPU (gloo) too.

        Accelerate 1.15 enables ``Join`` only for GPU-like devices; on ``MULTI_CPU`` it only warns, and a rank
        with fewer batches would leave its peers waiting in their next gradient allreduce. Here ``MULTI_CPU``
        gets what GPUs get: ``even_batches`` (this call's, else the Accelerator's) is applied to the prepared
        map-style data loaders for the duration, and unless batches are even the joinables (the prepared
        models, torch's or gradcomm's DDP) run under ``torch.distributed.algorithms.Join``.
        """
        if self.distributed_type != DistributedType.MULTI_CPU:
            with super().join_uneven_inputs(joinables, even_batches=even_batches):
                yield
            return
        overridden: list[tuple[int, bool]] = []
        if even_batches is not None:
            for index, loader in enumerate(self._dataloaders):
                if isinstance(loader, DataLoaderDispatcher):
                    warnings.warn(
                        "Overriding even_batches is only supported for map-style datasets, yet some dataloaders "
                        "given were iterable",
                        stacklevel=3,
                    )
                    continue
                overridden.append((index, loader.batch_sampler.even_batches))
                loader.batch_sampler.even_batches = even_batches
        else:
            even_batches = self.even_batches
        try:
            with Join(joinables, enable=not even_batches, throw_on_early_termination=False):
                yield
        finally:
            for index, value in overridden:
                self._dataloaders[index].batch_sampler.even_batches = value
