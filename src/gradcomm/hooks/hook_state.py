"""The lifecycle of a stateful communication hook's state: options, runtime, checkpoints.

A state has three parts, as Bagua splits an algorithm's configuration from its runtime:

* **options**: a frozen dataclass of :mod:`gradcomm.hooks.options` (``options_class``), whose fields are also
  plain attributes of the state (torch's hooks read ``state.matrix_approximation_rank``).
  :meth:`HookState.options` gives them back as the dataclass; the registry's options, the constructor's keyword
  options and what ``state_dict()`` saves of them are derived from its fields.
* **saved state**: every other attribute that is not runtime (counters, error feedback, warm-start matrices,
  random generators).
* **runtime**: what belongs to this process and is rebuilt, never saved (caches, groups, launchers): one
  object in ``self._runtime``, built by :meth:`HookState.reset_runtime`, the one method that builds it, called
  by the constructor, after unpickling and after :meth:`HookState.load_state_dict`.

The extension points gradcomm's DDP looks for on a state or a hook are described in
:mod:`gradcomm.hooks.protocols`.

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

import dataclasses
import inspect
import logging
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)

__all__ = ["HookState", "options_text", "takes_options"]

_GROUP_RANKS_KEY = "_saved_group_ranks"
_RUNTIME = "_runtime"
_NOT_SAVED = ("process_group", _RUNTIME)


def options_text(options: Any) -> str:
    """An options dataclass as text, ``field=value, ...``: what the ranks compare of them."""
    return ", ".join(f"{f.name}={getattr(options, f.name)!r}" for f in dataclasses.fields(options))


_Init = TypeVar("_Init", bound=Callable[..., None])


def takes_options(options_class: type) -> Callable[[_Init], _Init]:
    """Give a constructor ``__init__(self, <its own arguments>, *options, **options)`` the signature its
    options make: its own arguments, then each field of ``options_class`` with its default, so that
    ``inspect.signature`` and ``help()`` show the options (PowerSGDState's read like torch's) while the
    dataclass stays the one place that declares them."""

    def decorate(init: _Init) -> _Init:
        own = [p for p in inspect.signature(init).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        hints = typing.get_type_hints(options_class)
        options = [
            inspect.Parameter(
                f.name,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                default=f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty,
                annotation=hints[f.name],
            )
            for f in dataclasses.fields(options_class)
        ]
        init.__signature__ = inspect.Signature([*own, *options], return_annotation=None)  # type: ignore[attr-defined]
        return init

    return decorate


def _group_ranks(group: ProcessGroup | None) -> list[int] | None:
    if not dist.is_initialized():
        return None
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


class HookState:
    """Base class for a stateful hook's state; subclasses keep their group in ``self.process_group``.

    Subclasses declare their options as ``options_class`` (a frozen dataclass) and set them with
    :meth:`_set_options`; they keep their runtime in ``self._runtime``, built by :meth:`reset_runtime`.
    Subclasses whose saved attributes are not all tensors and plain values override :meth:`_plain_state` and
    :meth:`_restore_plain_state` to convert them (a numpy generator to its state tuple, for example).
    """

    options_class: ClassVar[type | None] = None
    process_group: ProcessGroup | None

    # -- options -------------------------------------------------------------------------------------------
    def _set_options(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Check the constructor's options against ``options_class`` and make them attributes; returns them."""
        assert self.options_class is not None
        try:
            inspect.signature(self.options_class).bind(*args, **kwargs)
        except TypeError as exc:
            valid = ", ".join(f.name for f in dataclasses.fields(self.options_class))
            raise TypeError(f"{type(self).__name__}: {exc}; its options are {valid}") from None
        options = self.options_class(*args, **kwargs)  # checks the values, naming the state
        for field in dataclasses.fields(options):
            setattr(self, field.name, getattr(options, field.name))
        return options

    def options(self) -> Any:
        """The options as the frozen ``options_class`` dataclass (from the attributes, as they are now)."""
        if self.options_class is None:
            raise TypeError(f"{type(self).__name__} declares no options_class")
        return self.options_class(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self.options_class)})

    @classmethod
    def _option_defaults(cls) -> dict[str, Any]:
        if cls.options_class is None:
            return {}
        fields = dataclasses.fields(cls.options_class)
        return {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}

    # -- runtime -------------------------------------------------------------------------------------------
    def reset_runtime(self, loaded: bool = False) -> None:
        """Build this process's runtime (``self._runtime``): caches, groups, launchers, nothing saved.

        Called by the constructor, after unpickling and after :meth:`load_state_dict` (``loaded=True``: the
        state holds what a checkpoint saved, to be checked against the model at the next step). Caches derived
        from the saved state are rebuilt; a state loaded in place may keep what is still valid, its groups and
        launchers (an unpickled state has none). The base class has no runtime.
        """

    # -- pickling ------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in _NOT_SAVED}
        state[_GROUP_RANKS_KEY] = _group_ranks(self.__dict__.get("process_group"))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = {**self._option_defaults(), **state}  # a pickle from before an option was added: its default
        saved_ranks = state.pop(_GROUP_RANKS_KEY, None)
        self.__dict__.update(state)
        self.process_group = None  # the default group
        self._check_group(saved_ranks, attached="the default process group")
        self.reset_runtime(loaded=True)

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
        self.reset_runtime(loaded=True)

    def _plain_state(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in _NOT_SAVED}

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
