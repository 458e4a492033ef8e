"""Train with gradcomm inside PyTorch Lightning (2.6): a DDP strategy whose DDP is gradcomm's.

Lightning
---------

``GradcommDDPStrategy`` is Lightning's ``DDPStrategy`` with gradcomm's ``DistributedDataParallel`` as the
wrapper. Name a hook of gradcomm's registry (or pass any hook and state, as to ``DDPStrategy``); it is
registered on every device, CPU/gloo included, and its state is saved in Lightning checkpoints, so a resumed
fit continues bit for bit::

    import lightning.pytorch as pl
    from gradcomm.integrations.lightning import GradcommDDPStrategy

    strategy = GradcommDDPStrategy(ddp_comm_hook="powersgd",
                                   ddp_comm_hook_options={"matrix_approximation_rank": 4})
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy)
    trainer.fit(model)                       # trainer.fit(model, ckpt_path=...) resumes exactly

After the import, ``Trainer(strategy="gradcomm_ddp")`` works too. Post-local SGD:
``GradcommDDPStrategy(ddp_comm_hook="post_localsgd", ddp_comm_hook_options={"start_localSGD_iter": 100},
model_averaging_period=4)`` averages the parameters every 4 steps with :class:`gradcomm.PeriodicModelAverager`.

What it changes in ``DDPStrategy``
----------------------------------

* The model is wrapped in :class:`gradcomm.DistributedDataParallel` with the strategy's DDP keyword arguments
  (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``, ``check_finite``, ...).
* The hook is registered on any device; Lightning registers ``ddp_comm_hook`` on CUDA only. Besides a hook
  callable with ``ddp_comm_state``/``ddp_comm_wrapper`` (torch's hooks and states work too),
  ``ddp_comm_hook`` may be a name of :mod:`gradcomm.hooks.registry` with ``ddp_comm_hook_options`` and
  ``ddp_comm_wrapper="fp16"``/``"bf16"``: the options are checked when the strategy is built and the state is
  built once the process group exists, which a state such as ``PostLocalSGDState`` may need.
* Post-local SGD model averaging is enabled for gradcomm's ``PostLocalSGDState`` as for torch's (Lightning
  recognises only torch's class), with :class:`gradcomm.PeriodicModelAverager`, which averages bit for bit as
  torch's does and checks right after each averaging that the replicas agree.
* Manual optimization: every ``manual_backward`` (several per ``training_step`` too) arms gradcomm's reducer,
  so each backward is synchronised; the first iteration of a static graph needs no delayed flush.
* Checkpoints carry gradcomm's per-rank state under the key ``"gradcomm"``.

Checkpoints: per-rank state gathered into the one checkpoint file
-----------------------------------------------------------------

Lightning builds the checkpoint on every rank but writes only rank 0's. The hook state (PowerSGD's error
feedback and warm-start matrices, post-local SGD's counter), the bucket layout it was made for and the model
averager's counter belong to each rank, and PowerSGD's error feedback differs between ranks. So at every save
each rank's part is gathered to rank 0 (``gather_object``) and stored in the checkpoint as
``checkpoint["gradcomm"] = {"format", "world_size", "ranks": [rank 0's part, rank 1's part, ...]}``; on
resume every rank reads the file (Lightning loads it on every rank anyway) and restores its own part, after
the model is wrapped and the hook registered, and before the first step. During post-local SGD's local phase
the replicas and optimizer states differ between ranks too, so then each rank's model and optimizer state are
part of its share as well.

Gathering was chosen over one sidecar file per rank because the checkpoint stays one file: Lightning's
``CheckpointIO`` plugins (remote filesystems, asynchronous saving), ``ModelCheckpoint``'s removal of older
checkpoints and ``last.ckpt`` keep working unchanged, a checkpoint cannot be separated from its per-rank state,
and ranks on machines without a shared filesystem need nothing beyond what Lightning already needs. The cost:
rank 0 holds, and the file stores, every rank's hook state at once (with PowerSGD about one gradient-sized
buffer per rank). Where that is too much, use :func:`gradcomm.save_checkpoint`, which writes one file per rank.
A checkpoint is refused at another world size, since per-rank state cannot be redistributed.

Only the parts whose objects are given are restored: hook states with ``state_dict()`` (every gradcomm state)
are saved; torch's states are not checkpointable without pickling, except ``PostLocalSGDState``, whose
counter is saved. A stateful hook whose state cannot be saved gets a warning at set-up.

The process group and its timeout are Lightning's (``GradcommDDPStrategy(timeout=...)``); gradcomm bounds
every collective by it, so set a shorter one than torch's 30-minute default to fail fast when a rank is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_post_local_sgd

import gradcomm
from gradcomm.checkpoint import CheckpointError
from gradcomm.comm.faults import reporting_lost_peers
from gradcomm.hooks import post_localSGD_hook as gradcomm_post_local_sgd
from gradcomm.hooks.contract import replicas_may_differ
from gradcomm.hooks.registry import check_options, make_comm_hook, resolve_hook_name, wrapper_names

__all__ = ["CHECKPOINT_KEY", "FORMAT", "GradcommDDPStrategy"]

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "gradcomm"
"""The key of a Lightning checkpoint that holds gradcomm's per-rank state."""

FORMAT = "gradcomm.lightning/1"

_POST_LOCAL_SGD_STATES = (gradcomm_post_local_sgd.PostLocalSGDState, torch_post_local_sgd.PostLocalSGDState)


def _plain_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class GradcommDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` training with :class:`gradcomm.DistributedDataParallel`.

    Takes every argument of ``DDPStrategy``; keyword arguments it does not know go to the DDP constructor.

    Args:
        ddp_comm_hook: a hook ``hook(state, bucket) -> Future`` (gradcomm's or torch's), or the name of one in
            :mod:`gradcomm.hooks.registry` (``"powersgd"``, ``"fp16_compress"``, ``"topk"``, ...). ``None``:
            gradcomm's default allreduce.
        ddp_comm_state: the hook's state, for a hook callable; ``None`` for the default process group.
        ddp_comm_wrapper: a wrapper callable (``fp16_compress_wrapper``) or, with a hook name, ``"fp16"`` or
            ``"bf16"``.
        ddp_comm_hook_options: with a hook name, the options of its state (``{"matrix_approximation_rank":
            4}``); checked here, the state is built on every rank once the process group exists.
        model_averaging_period: with a post-local SGD state (gradcomm's or torch's), average the parameters
            every this many optimizer steps after the state's ``start_localSGD_iter``.

    Raises:
        ValueError: an unknown hook name, option or wrapper, options without a hook name, or a hook name
            together with a state.
    """

    def __init__(
        self,
        *args: Any,
        ddp_comm_hook: Callable[..., Any] | str | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_wrapper: Callable[..., Any] | str | None = None,
        ddp_comm_hook_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._hook_name: str | None = None
        self._hook_options: dict[str, Any] = {}
        self._wrapper_name: str | None = None
        if isinstance(ddp_comm_hook, str):
            if ddp_comm_state is not None:
                raise ValueError(
                    f"GradcommDDPStrategy: ddp_comm_hook={ddp_comm_hook!r} is a name, so its state is built from "
                    "ddp_comm_hook_options; pass the options instead of ddp_comm_state, or pass the hook function "
                    "with its state"
                )
            self._hook_name = resolve_hook_name(ddp_comm_hook).value.name
            self._hook_options = check_options(self._hook_name, **dict(ddp_comm_hook_options or {}))
            ddp_comm_hook = None
        elif ddp_comm_hook_options:
            raise ValueError(
                "GradcommDDPStrategy: ddp_comm_hook_options are the options of a hook named in ddp_comm_hook, but "
                f"ddp_comm_hook is {ddp_comm_hook!r}; name the hook (e.g. ddp_comm_hook='powersgd') or build its "
                "state yourself and pass it as ddp_comm_state"
            )
        if isinstance(ddp_comm_wrapper, str):
            if self._hook_name is None:
                raise ValueError(
                    f"GradcommDDPStrategy: ddp_comm_wrapper={ddp_comm_wrapper!r} is a name, which needs a hook "
                    "name in ddp_comm_hook; with a hook function pass the wrapper function "
                    "(gradcomm.hooks.default_hooks.fp16_compress_wrapper)"
                )
            if ddp_comm_wrapper.lower() not in wrapper_names():
                raise ValueError(
                    f"GradcommDDPStrategy: unknown ddp_comm_wrapper {ddp_comm_wrapper!r}; valid wrappers: "
                    f"{', '.join(wrapper_names())}"
                )
            self._wrapper_name = ddp_comm_wrapper.lower()
            ddp_comm_wrapper = None
        super().__init__(
            *args,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_wrapper=ddp_comm_wrapper,
            **kwargs,
        )
        self._registered_hook: Callable[..., Any] | None = None

    # -- wrapping and the hook --------------------------------------------------------------------------
    def _setup_model(self, model: nn.Module) -> gradcomm.DistributedDataParallel:
        """Wrap ``model`` in gradcomm's DDP with the strategy's DDP keyword arguments."""
        device_ids = self.determine_ddp_device_ids()
        log.debug("setting up gradcomm DDP with device ids %s, kwargs %s", device_ids, self._ddp_kwargs)
        return gradcomm.DistributedDataParallel(module=model, device_ids=device_ids, **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        """Register the hook on every device (Lightning's own registration is CUDA-only)."""
        model = self.model
        if not isinstance(model, gradcomm.DistributedDataParallel):
            raise TypeError(
                f"GradcommDDPStrategy: expected the model to be wrapped in gradcomm.DistributedDataParallel, got "
                f"{type(model).__name__}; a subclass overriding _setup_model must return gradcomm's DDP"
            )
        if self._hook_name is not None:
            hook, state = make_comm_hook(self._hook_name, wrapper=self._wrapper_name, **self._hook_options)
            self._ddp_comm_state = state
            self._ddp_comm_hook = hook
            if self._ddp_comm_wrapper is not None:
                hook = self._ddp_comm_wrapper(hook)
        elif self._ddp_comm_hook is not None:
            hook = self._ddp_comm_hook
            if self._ddp_comm_wrapper is not None:
                hook = self._ddp_comm_wrapper(hook)
        else:
            return
        model.register_comm_hook(self._ddp_comm_state, hook)
        self._registered_hook = hook
        if _stateful(self._ddp_comm_state) and _state_saver(self._ddp_comm_state) is None:
            log.warning(
                "GradcommDDPStrategy: the state of hook %s (%s) has no state_dict(), so checkpoints will not "
                "hold it and a resumed fit starts it afresh; gradcomm's hooks (gradcomm.hooks) have "
                "checkpointable states with torch's names",
                getattr(hook, "__qualname__", hook),
                type(self._ddp_comm_state).__name__,
            )

    @property
    def comm_state(self) -> Any:
        """The registered hook's state (built from the options where the hook was given by name)."""
        return self._ddp_comm_state

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if (
            self._model_averager is None
            and isinstance(self._ddp_comm_state, _POST_LOCAL_SGD_STATES)
            and self.lightning_module is not None
            and trainer.state.fn == TrainerFn.FITTING
        ):
            self._enable_model_averaging()

    def _enable_model_averaging(self) -> None:
        """Build a :class:`gradcomm.PeriodicModelAverager` for gradcomm's or torch's post-local SGD state."""
        if self._model_averaging_period is None:
            raise ValueError(
                f"GradcommDDPStrategy: the hook state is a post-local SGD state "
                f"({type(self._ddp_comm_state).__name__}), whose replicas drift apart after start_localSGD_iter "
                "unless the parameters are averaged; pass model_averaging_period=N to average every N steps"
            )
        super()._enable_model_averaging()  # Lightning's refusal of distributed optimizers
        self._model_averager = gradcomm.PeriodicModelAverager(
            period=self._model_averaging_period,
            warmup_steps=self._ddp_comm_state.start_localSGD_iter,  # type: ignore[attr-defined]
        )

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Under manual optimization, arm gradcomm's reducer for the backward of ``closure_loss``.

        ``manual_backward`` runs inside the DDP's forward (``training_step`` is redirected through it), possibly
        several times; each backward must be synchronised, so each is prepared here, as Lightning prepares
        torch's reducer. Under ``find_unused_parameters`` the parameters ``closure_loss`` does not reach are
        treated as unused.
        """
        model = self.model
        module = self.lightning_module
        if not isinstance(model, gradcomm.DistributedDataParallel) or module is None:
            return
        if not module.automatic_optimization and torch.is_grad_enabled() and model.require_backward_grad_sync:
            model.reducer.prepare_for_backward([closure_loss])

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Nothing to do: gradcomm's reducer launches every bucket during backward, also in the first
        iteration of a static graph, so there is no delayed reduction to flush (Lightning flushes torch's
        for manual optimization with ``static_graph=True``)."""

    def teardown(self) -> None:
        if isinstance(self.model, gradcomm.DistributedDataParallel) and not isinstance(
            self.model, torch.nn.parallel.DistributedDataParallel
        ):
            self.model = self.lightning_module  # Lightning unwraps only torch's DDP
        super().teardown()

    # -- checkpoints --------------------------------------------------------------------------------------
    def _rank_share(self) -> dict[str, Any]:
        """What this rank contributes to a checkpoint: hook state, bucket layout, averager; in post-local SGD's
        local phase also its model and optimizer states."""
        model = self.model
        ddp = model if isinstance(model, gradcomm.DistributedDataParallel) else None
        saver = _state_saver(self._ddp_comm_state)
        share: dict[str, Any] = {
            "hook_state": saver() if saver is not None else None,
            "bucket_layout": ddp.bucket_layout() if ddp is not None else None,
            "averager": self._model_averager.state_dict()
            if isinstance(self._model_averager, gradcomm.PeriodicModelAverager)
            else None,
            "model": None,
            "optimizers": None,
        }
        if ddp is not None and replicas_may_differ(self._registered_hook, self._ddp_comm_state):
            share["model"] = ddp.module.state_dict()
            share["optimizers"] = [_plain_optimizer(o).state_dict() for o in self.optimizers]
        return move_data_to_device(share, torch.device("cpu"))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Gather every rank's share into ``checkpoint["gradcomm"]``, then write it on rank 0 (a collective)."""
        if isinstance(self.model, gradcomm.DistributedDataParallel):
            share = self._rank_share()
            world_size = dist.get_world_size() if dist.is_initialized() else 1
            shares: list[Any] | None = [None] * world_size if self.global_rank == 0 else None
            if world_size > 1:
                with reporting_lost_peers(None, f"gathering gradcomm state for checkpoint {str(filepath)!r}"):
                    dist.gather_object(share, shares, dst=0)
            elif shares is not None:
                shares[0] = share
            if shares is not None:
                checkpoint[CHECKPOINT_KEY] = {"format": FORMAT, "world_size": world_size, "ranks": shares}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore the optimizers (Lightning), then this rank's gradcomm share, before the first step."""
        super().load_optimizer_state_dict(checkpoint)
        self._restore_rank_share(checkpoint)

    def _restore_rank_share(self, checkpoint: Mapping[str, Any]) -> None:
        model = self.model
        if not isinstance(model, gradcomm.DistributedDataParallel):
            return
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            if _stateful(self._ddp_comm_state) or self._model_averager is not None:
                log.warning(
                    "GradcommDDPStrategy: the checkpoint holds no gradcomm state (saved by another strategy?); "
                    "the hook state and model averager start afresh"
                )
            return
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        if saved.get("format") != FORMAT or saved.get("world_size") != world_size:
            raise CheckpointError(
                f"GradcommDDPStrategy: the checkpoint's gradcomm state ({saved.get('format')!r}) was saved by "
                f"{saved.get('world_size')} rank(s), but this fit has {world_size}; per-rank hook state cannot be "
                f"redistributed. Resume with {saved.get('world_size')} ranks, or drop checkpoint[{CHECKPOINT_KEY!r}] "
                "to start the hook state afresh."
            )
        share = move_data_to_device(saved["ranks"][self.global_rank], self.root_device)
        if share["model"] is not None:
            model.module.load_state_dict(share["model"])
        if share["optimizers"] is not None:
            for optimizer, state in zip(self.optimizers, share["optimizers"], strict=True):
                _plain_optimizer(optimizer).load_state_dict(state)
        if share["bucket_layout"] is not None:
            model.load_bucket_layout(share["bucket_layout"])
        if share["hook_state"] is not None:
            _state_loader(self._ddp_comm_state, share["hook_state"])
        if share["averager"] is not None and isinstance(self._model_averager, gradcomm.PeriodicModelAverager):
            self._model_averager.load_state_dict(share["averager"])

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "gradcomm_ddp",
            cls,
            description="DDP with gradcomm's DistributedDataParallel and communication hooks",
            override=True,
        )


def _stateful(state: Any) -> bool:
    return state is not None and not isinstance(state, dist.ProcessGroup)


def _state_saver(state: Any) -> Callable[[], Any] | None:
    """How to save ``state``: its ``state_dict``, torch's post-local SGD counter, or None (not saveable)."""
    if callable(getattr(state, "state_dict", None)):
        return state.state_dict
    if isinstance(state, torch_post_local_sgd.PostLocalSGDState):
        return lambda: {"iter": state.iter}
    return None


def _state_loader(state: Any, saved: Any) -> None:
    if callable(getattr(state, "load_state_dict", None)):
        state.load_state_dict(saved)
    elif isinstance(state, torch_post_local_sgd.PostLocalSGDState):
        state.iter = saved["iter"]


GradcommDDPStrategy.register_strategies(StrategyRegistry)
