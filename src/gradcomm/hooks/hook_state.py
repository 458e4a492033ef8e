"""Checkpointing for the state objects of stateful communication hooks.

A hook's state (error-feedback buffers, warm-start matrices, counters, random generators) must survive a
checkpoint so that a resumed run continues exactly like an uninterrupted one. The process group cannot be
saved: it is left out and, on load, the state is attached to the default group (or kept on the group the
live object already has, for :meth:`HookState.load_state_dict`).

Two ways to save, as with torch's PowerSGDState:

* pickling (``torch.save(state)`` and ``torch.load(..., weights_only=False)``) through
  ``__getstate__``/``__setstate__``;
* :meth:`HookState.state_dict` / :meth:`HookState.load_state_dict`, whose dict holds only tensors and plain
  Python values and therefore also loads with ``torch.load(..., weights_only=True)``.

A checkpoint written at one world size is refused at another: per-rank buffers would be silently misapplied.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)

__all__ = ["HookState"]

_GROUP_RANKS_KEY = "_saved_group_ranks"


def _group_ranks(group: ProcessGroup | None) -> list[int] | None:
    if not dist.is_initialized():
        return None
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


class HookState:
    """Base class for a stateful hook's state; subclasses keep their group in ``self.process_group``.

    Subclasses whose attributes are not all tensors and plain values override :meth:`_plain_state` and
    :meth:`_restore_plain_state` to convert them (a numpy generator to its state tuple, for example).
    """

    process_group: ProcessGroup | None

    # -- pickling ------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k != "process_group"}
        state[_GROUP_RANKS_KEY] = _group_ranks(self.__dict__.get("process_group"))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        saved_ranks = state.pop(_GROUP_RANKS_KEY, None)
        self.__dict__.update(state)
        self.process_group = None  # the default group
        self._check_group(saved_ranks, attached="the default process group")

    # -- weights_only-safe dicts -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state as tensors and plain values (loadable with ``torch.load(weights_only=True)``)."""
        state = self._plain_state()
        state[_GROUP_RANKS_KEY] = _group_ranks(self.process_group)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`, keeping this object's process group."""
        state = dict(state_dict)
        saved_ranks = state.pop(_GROUP_RANKS_KEY, None)
        self._check_group(saved_ranks, attached="this state's process group")
        self._restore_plain_state(state)

    def _plain_state(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "process_group"}

    def _restore_plain_state(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- checks ------------------------------------------------------------------------------------------
    def _check_group(self, saved_ranks: list[int] | None, attached: str) -> None:
        current = _group_ranks(self.process_group)
        if saved_ranks is None or current is None or saved_ranks == current:
            return
        name = type(self).__name__
        if len(saved_ranks) != len(current):
            raise ValueError(
                f"{name}: this checkpoint was written by a process group of {len(saved_ranks)} ranks, but "
                f"{attached} has {len(current)}; per-rank hook state cannot be moved to another world size. "
                "Start the hook state afresh (a new state object) or resume at the original world size."
            )
        logger.warning(
            "%s: checkpoint was saved with process group ranks %s; attached to %s with ranks %s. "
            "Set `state.process_group` if another group is wanted.",
            name,
            saved_ranks,
            attached,
            current,
        )
