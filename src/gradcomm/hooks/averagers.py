"""Model averagers: average parameters across ranks after the optimizer step, for local SGD.

With :func:`gradcomm.hooks.post_localSGD_hook.post_localSGD_hook` the replicas stop averaging gradients
globally after a warm-up and drift apart; :class:`PeriodicModelAverager` brings them back into agreement by
averaging the parameters over ``process_group`` every ``period`` steps once ``warmup_steps`` steps have
passed. Set ``warmup_steps`` to the hook state's ``start_localSGD_iter``: during the warm-up DDP already
keeps the replicas identical, so averaging would only cost traffic.

Averaging flattens the parameters into one buffer (extra memory of the model's size, one collective per
averaging), divides it by the group size and all-reduces it, exactly like
``torch.distributed.algorithms.model_averaging``, so the results agree bit for bit. Unlike torch, the
averaged values are copied back into the parameters' own storage instead of rebinding ``param.data``, so
views of the parameters (flat buffers, optimizer references) stay valid.

The averager's ``step`` counter is the only state that changes; :meth:`PeriodicModelAverager.state_dict`
saves it (with ``period`` and ``warmup_steps``) for checkpoints loadable with ``weights_only=True``.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm import comm
from gradcomm.comm.agreement import check_same_parameters
from gradcomm.comm.faults import reporting_lost_peers
from gradcomm.hooks.hook_state import HookState

__all__ = ["ModelAverager", "PeriodicModelAverager", "average_parameters", "params_to_average"]

Params = Iterable[torch.nn.Parameter] | Iterable[dict[str, list[torch.nn.Parameter]]]


def _flatten(params: Params) -> list[torch.nn.Parameter]:
    """The parameters of ``model.parameters()`` or ``optimizer.param_groups``, as one list."""
    flat: list[torch.nn.Parameter] = []
    for item in params:
        if isinstance(item, torch.Tensor):
            flat.append(item)
        elif isinstance(item, dict):
            flat.extend(item["params"])
        else:
            raise TypeError(
                f"average_parameters: expected parameters or optimizer parameter groups (dicts), "
                f"got {type(item).__name__}"
            )
    return flat


def params_to_average(params: Params) -> list[torch.nn.Parameter]:
    """The parameters that have a gradient, from ``model.parameters()`` or ``optimizer.param_groups``."""
    return [p for p in _flatten(params) if p.grad is not None]


def average_parameters(params: Iterable[torch.nn.Parameter], process_group: ProcessGroup | None = None) -> None:
    """Replace each parameter by its mean over ``process_group`` (``None``: the default group), in place.

    A collective: every rank of the group must call it with parameters of the same shapes and order.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    if dist._rank_not_in_group(group):
        return
    params = list(params)
    if not params:
        return
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    flat /= comm.group_size(group)
    comm.all_reduce(flat, group).wait()
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


class ModelAverager(HookState, ABC):
    """Base class of model averagers; ``step`` counts calls of :meth:`average_parameters`.

    ``process_group`` is the group to average over, ``None`` for the default group.
    """

    def __init__(self, process_group: ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.step = 0

    @abstractmethod
    def average_parameters(self, params: Params) -> None:
        """Average ``params`` if this step calls for it, and advance ``step``."""


class PeriodicModelAverager(ModelAverager):
    """Average parameters every ``period`` steps after ``warmup_steps`` steps (torch's semantics).

    Call :meth:`average_parameters` once per training step, after ``optimizer.step()``. It averages when
    ``step >= warmup_steps`` and ``(step - warmup_steps) % period == 0``, then increments ``step``; the
    first averaging is thus at the first step after the warm-up.

    Args:
        period: steps per averaging; 1 averages every step (which DDP's gradient averaging already does
            more cheaply, hence a warning).
        warmup_steps: steps without averaging; use the post-local SGD state's ``start_localSGD_iter``.
        process_group: group to average over; ``None`` for the default group.
        check_after_averaging: right after each averaging, compare a checksum of the averaged parameters
            across the group (one pass over them and one ``all_gather`` of three integers) and raise
            :class:`~gradcomm.comm.faults.ParameterDriftError` on every rank if they differ. This is where
            post-local SGD's replicas must be identical, so it replaces the DDP's periodic check, which
            skips the local phase.
    """

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        process_group: ProcessGroup | None = None,
        check_after_averaging: bool = True,
    ) -> None:
        super().__init__(process_group)
        if warmup_steps < 0:
            raise ValueError(f"PeriodicModelAverager: warmup_steps must be >= 0, got {warmup_steps}")
        if period < 1:
            raise ValueError(f"PeriodicModelAverager: period must be >= 1, got {period}")
        if period == 1:
            warnings.warn(
                "PeriodicModelAverager: period=1 averages parameters every step, which costs at least as "
                "much as DDP's gradient all-reduce; use plain DDP instead.",
                stacklevel=2,
            )
        self.period = period
        self.warmup_steps = warmup_steps
        self.check_after_averaging = check_after_averaging

    def averages_at(self, step: int) -> bool:
        """Whether the call at ``step`` (counted from 0) averages."""
        return step >= self.warmup_steps and (step - self.warmup_steps) % self.period == 0

    def average_parameters(self, params: Params) -> None:
        """Average ``params`` (a model's parameters or an optimizer's param groups) if due; advance ``step``.

        Only parameters with a gradient are averaged, as in torch. With ``check_after_averaging`` all of
        ``params`` are then compared across the group (:func:`~gradcomm.comm.agreement.check_same_parameters`).
        """
        if self.averages_at(self.step):
            given = _flatten(params)
            where = f"averaging parameters (model averager, step {self.step})"
            with reporting_lost_peers(None, where, self.process_group):
                average_parameters([p for p in given if p.grad is not None], self.process_group)
                if self.check_after_averaging and not dist._rank_not_in_group(self.process_group):
                    check_same_parameters(
                        [(f"parameter #{i}", p) for i, p in enumerate(given)],
                        self.process_group,
                        f"{type(self).__name__}(check_after_averaging=True)",
                        f"right after averaging at averager step {self.step},",
                    )
        self.step += 1
