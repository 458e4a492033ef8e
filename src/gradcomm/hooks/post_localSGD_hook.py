"""Post-local SGD: global gradient averaging for a warm-up, then local SGD with periodic model averaging.

`Post-local SGD <https://arxiv.org/abs/1808.07217>`_ trains like ordinary DDP for the first
``start_localSGD_iter`` iterations (every bucket is all-reduced over ``process_group`` and divided by its
size). From then on the hook stops global gradient synchronisation: each bucket is averaged only within
``subgroup`` (by default the ranks of one machine), or not at all when ``post_local_gradient_allreduce`` is
false, so the replicas drift apart. A model averager run after ``optimizer.step()``
(:class:`gradcomm.hooks.averagers.PeriodicModelAverager`, with ``warmup_steps`` equal to ``start_localSGD_iter``)
pulls them back together by averaging the parameters globally every ``period`` steps.

Trade-offs:

* Global traffic drops from one gradient all-reduce per step to one parameter all-reduce per ``period``
  steps; the cheap intra-node all-reduce remains (or nothing, with ``post_local_gradient_allreduce=False``).
* Between averagings the replicas differ, which adds noise that often helps generalisation late in training
  but hurts early on: hence the global warm-up. Momentum and other optimizer state stay per rank.
* ``post_local_gradient_allreduce`` is worth tuning: either setting may converge faster.

Differences from ``torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook``, results unchanged:

* ``subgroup=None`` with ``post_local_gradient_allreduce=True`` means the intra-node subgroup, created with
  :func:`torch.distributed.new_subgroups` on first use, as in torch, so the state can be built before
  ``init_process_group`` (Lightning builds it among the Trainer's arguments). First use is the hook's first
  call, at the very start of training on every rank (torch's waits until the first post-local step). The
  node size is ``LOCAL_WORLD_SIZE`` (set by torchrun and :func:`gradcomm.testing.run_on_ranks`), else the
  number of CUDA devices as torch assumes; on one machine the intra-node subgroup is every rank. It takes the
  timeout of ``process_group`` (torch's takes the backend's default, 30 minutes).
* A subgroup of one rank skips the all-reduce (its average is the buffer itself).
* The state is checkpointable (:class:`~gradcomm.hooks.hook_state.HookState`). Neither ``process_group``
  nor ``subgroup`` is saved: :meth:`PostLocalSGDState.load_state_dict` keeps the groups of the live state,
  which is built with the groups of the resumed run and then loaded; an unpickled state has the default
  group and ``subgroup=None``, and creates the intra-node subgroup on first use unless ``state.subgroup``
  is assigned before.
"""

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm import comm
from gradcomm.comm.faults import derived_group_timeout
from gradcomm.hooks.hook_state import HookState, _group_ranks, takes_options
from gradcomm.hooks.options import PostLocalSGDOptions

logger = logging.getLogger(__name__)

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]

_SUBGROUP_RANKS_KEY = "_saved_subgroup_ranks"


def _ranks_per_node() -> int:
    """The number of ranks on a machine: ``LOCAL_WORLD_SIZE``, else the number of CUDA devices."""
    local_world_size = os.environ.get("LOCAL_WORLD_SIZE")
    if local_world_size:
        return int(local_world_size)
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    raise ValueError(
        "PostLocalSGDState: subgroup=None asks for the intra-node subgroup, but the number of ranks per "
        "node is unknown: LOCAL_WORLD_SIZE is not set (torchrun sets it) and CUDA is unavailable. Pass "
        "subgroup=dist.new_subgroups(group_size=...)[0], or post_local_gradient_allreduce=False."
    )


def _intra_node_subgroup(process_group: ProcessGroup | None) -> ProcessGroup:
    """This rank's subgroup of the ranks on its machine, creating every machine's subgroup (a collective),
    with ``process_group``'s timeout (torch's default would wait 30 minutes for a hung peer)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "PostLocalSGDState: the intra-node subgroup (subgroup=None) is created on first use, which needs "
            "the default process group: call torch.distributed.init_process_group(...) before training"
        )
    subgroup, _ = dist.new_subgroups(group_size=_ranks_per_node(), timeout=derived_group_timeout(process_group))
    logger.info("PostLocalSGDState: created the intra-node subgroups (%s ranks each).", _ranks_per_node())
    return subgroup


class PostLocalSGDState(HookState):
    """State of :func:`post_localSGD_hook`.

    Args:
        process_group: group for the global all-reduce of the first ``start_localSGD_iter`` iterations;
            ``None`` for the default group.
        subgroup: group for the gradient all-reduce afterwards. ``None`` means the intra-node subgroup,
            created on the hook's first call (no process group is needed to construct the state) when
            ``post_local_gradient_allreduce`` is true; it is not needed, and stays ``None``, when that is
            false.
        start_localSGD_iter: number of iterations with global all-reduce; give the model averager the
            same number as ``warmup_steps``.
        post_local_gradient_allreduce: whether gradients are still averaged within ``subgroup`` after
            ``start_localSGD_iter``; if false each rank keeps its own gradients.

    ``iter`` counts the iterations seen by the hook up to ``start_localSGD_iter`` (it is advanced on the last
    bucket of each iteration and stops there, as in torch).
    """

    options_class = PostLocalSGDOptions

    @takes_options(PostLocalSGDOptions)
    def __init__(
        self, process_group: ProcessGroup | None, subgroup: ProcessGroup | None, *options: Any, **named: Any
    ) -> None:
        self._set_options(options, named)
        if subgroup is not None and not isinstance(subgroup, ProcessGroup):
            raise TypeError(
                f"PostLocalSGDState: subgroup must be a ProcessGroup or None (the intra-node subgroup), got "
                f"{subgroup!r}"
            )
        logger.info("Local SGD will be started after %s iterations", self.start_localSGD_iter)
        self.process_group = process_group
        self.subgroup = subgroup
        self.iter = 0

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count an iteration when its last bucket is processed."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_localSGD_iter:
            logger.info("Start to apply local SGD after %s iterations.", self.iter)

    def post_local_group(self) -> ProcessGroup:
        """The subgroup for the post-local all-reduce, creating the intra-node one if none is attached."""
        if self.subgroup is None:
            self.subgroup = _intra_node_subgroup(self.process_group)
        return self.subgroup

    # -- checkpointing: the subgroup is left out like the process group ------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        subgroup = state.pop("subgroup", None)
        state[_SUBGROUP_RANKS_KEY] = _group_ranks(subgroup) if subgroup is not None else None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state.pop(_SUBGROUP_RANKS_KEY, None)
        super().__setstate__(state)
        self.subgroup = None

    def _plain_state(self) -> dict[str, Any]:
        state = super()._plain_state()
        subgroup = state.pop("subgroup", None)
        state[_SUBGROUP_RANKS_KEY] = _group_ranks(subgroup) if subgroup is not None else None
        return state

    def _restore_plain_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        saved = state.pop(_SUBGROUP_RANKS_KEY, None)
        current = _group_ranks(self.subgroup) if self.subgroup is not None else None
        if saved is not None and current is not None and saved != current:
            logger.warning(
                "PostLocalSGDState: checkpoint was saved with subgroup ranks %s; keeping this state's "
                "subgroup with ranks %s.",
                saved,
                current,
            )
        state.pop("subgroup", None)
        super()._restore_plain_state(state)


def _allreduce_mean(group: ProcessGroup | None, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` in place over ``group``, dividing first (as torch does) to avoid overflow."""
    size = comm.group_size(group)
    if size == 1:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(tensor)
        return done
    tensor.div_(size)
    return comm.all_reduce(tensor, group)


def post_localSGD_hook(state: PostLocalSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce globally for ``start_localSGD_iter`` iterations, then within ``state.subgroup`` (or not at all).

    Run a model averager after every ``optimizer.step()``::

        state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=100)
        ddp_model.register_comm_hook(state, post_localSGD_hook)
        averager = PeriodicModelAverager(period=4, warmup_steps=100)
        for batch in loader:
            ...
            optimizer.step()
            averager.average_parameters(ddp_model.parameters())

    Returns:
        A future completing with the averaged bucket buffer (the buffer itself when nothing is reduced).
    """
    buffer = bucket.buffer()
    if state.subgroup is None and state.post_local_gradient_allreduce:
        state.post_local_group()  # on the first call, while every rank is at the same point
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return _allreduce_mean(state.process_group, buffer)
    if not state.post_local_gradient_allreduce:
        local: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        local.set_result(buffer)
        return local
    return _allreduce_mean(state.post_local_group(), buffer)


def _in_local_phase(state: PostLocalSGDState) -> bool:
    """After the warm-up the replicas differ until a model averager averages them."""
    return state.iter >= state.start_localSGD_iter


post_localSGD_hook.replicas_may_differ = _in_local_phase  # type: ignore[attr-defined]  # see hooks.protocols
