"""Stable keys for the gradients of a bucket, so that hook state follows its parameter, not its bucket.

Stateful hooks (PowerSGD's error feedback and warm-start matrices, the compression hook's residuals) keep
state per gradient between steps. Bucket positions are not stable: DDP rebuilds its buckets after the first
iteration, and a fresh torch DDP in a resumed process starts again from its initial layout. State keyed by
parameter survives both.

A parameter's key is its name when it is registered (:func:`name_parameters`), else the order in which a
state first sees it (``0, 1, ...``):

* names are what gradcomm's DDP uses (it calls :func:`name_parameters` on its module), and what a user of
  torch's DDP gets by calling ``name_parameters(model)``; they identify a parameter whatever the layout, so
  state saved on one DDP resumes on the other;
* the order of first appearance is stable on torch's DDP across resumes, because every fresh torch DDP
  hands its first iteration's buckets to the hook in the same initial layout. A hook state must then be
  registered before the first iteration of a process (as it always is).

Keys are plain ``str`` or ``int``, so a state keyed by them saves with ``state_dict()`` and loads with
``torch.load(weights_only=True)``. :class:`SavedKeyCheck` refuses a loaded state whose keys do not fit the
model: keys of the other kind, parameters of other shapes, or parameters the model does not have.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Key", "ParameterKeys", "SavedKeyCheck", "name_parameters", "name_tensor", "parameter_name"]

Key = str | int

_NAMES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # by identity: tensors compare elementwise
_generation = itertools.count()
_current_generation = next(_generation)


def name_parameters(module: nn.Module, prefix: str = "") -> None:
    """Register the names of ``module``'s parameters as their keys in hook state (tied ones: the first name).

    gradcomm's DDP calls it on its module. With torch's DDP, call ``name_parameters(model)`` (the module
    inside the DDP, so that the names match gradcomm's) on every rank before training, in the run that
    saves a hook state and in the run that resumes it. A later call renames.
    """
    global _current_generation
    for name, parameter in module.named_parameters(prefix=prefix):
        _NAMES[parameter] = name
    _current_generation = next(_generation)


def name_tensor(tensor: torch.Tensor, name: str) -> None:
    """Register ``name`` as the key in hook state of ``tensor``, a tensor that a bucket lists in place of a
    parameter (DiLoCo's part of a parameter split between fragments: a view of it, keyed apart from the rest
    of the parameter). Keep ``tensor`` alive as long as buckets list it: names are held by identity, weakly."""
    global _current_generation
    _NAMES[tensor] = name
    _current_generation = next(_generation)


def parameter_name(parameter: torch.Tensor) -> str | None:
    """The name registered for ``parameter`` by :func:`name_parameters`, or None."""
    return _NAMES.get(parameter)


class ParameterKeys:
    """One state's keys for the gradients of the buckets it is given; not saved (it is rebuilt in a run).

    The keys of a bucket are cached by the identity of its parameters, so a step costs one tuple lookup per
    bucket beyond listing the bucket's parameters.
    """

    def __init__(self) -> None:
        self._order: dict[int, int] = {}
        self._cache: dict[tuple[int, ...], tuple[Key, ...]] = {}
        self._generation = _current_generation

    def of(self, bucket: Any) -> tuple[Key, ...]:
        """One key per gradient of ``bucket`` (a ``GradBucket``), in buffer order.

        A bucket that lists no parameters (a stand-in made by hand) gets positional keys
        ``"bucket<index>.<position>"``.
        """
        parameters = bucket.parameters() if callable(getattr(bucket, "parameters", None)) else []
        if not parameters:
            return tuple(f"bucket{bucket.index()}.{i}" for i in range(len(bucket.gradients())))
        if self._generation != _current_generation:
            self._cache.clear()
            self._generation = _current_generation
        identity = tuple(map(id, parameters))
        keys = self._cache.get(identity)
        if keys is None:
            keys = self._cache[identity] = tuple(self._key(p) for p in parameters)
        return keys

    def _key(self, parameter: torch.Tensor) -> Key:
        name = _NAMES.get(parameter)
        if name is not None:
            return name
        return self._order.setdefault(id(parameter), len(self._order))


def _kind(key: Key) -> str:
    return "name" if isinstance(key, str) else "order"


def _kind_advice(saved: Key, found: Key) -> str:
    if _kind(saved) == "name":
        return (
            f"the saved state keys parameters by name (e.g. {saved!r}), but this model's parameters have no "
            "registered names (they are keyed by order of first appearance). With torch's DDP, call "
            "gradcomm.hooks.parameter_keys.name_parameters(model) on every rank before training"
        )
    return (
        f"the saved state keys parameters by order of first appearance (e.g. {saved!r}: it was saved on "
        f"torch's DDP without name_parameters), but this model's parameters are named (e.g. {found!r}; "
        "gradcomm's DDP names them). Load it on torch's DDP without name_parameters, or save it from a run "
        "that called gradcomm.hooks.parameter_keys.name_parameters(model)"
    )


class SavedKeyCheck:
    """Checks, once, that a loaded state's per-parameter entries fit the model they are applied to.

    Built from the saved entries' shapes; :meth:`check_bucket` is called with each bucket before its state
    is used, :meth:`end_iteration` after the last bucket of an iteration. Every refusal names the state
    (``owner``) and the parameter.
    """

    def __init__(self, owner: str, shapes: Mapping[Key, Sequence[int]]) -> None:
        self.owner = owner
        self._shapes = {key: tuple(shape) for key, shape in shapes.items()}
        self._unseen = set(self._shapes)
        self._sample = next(iter(self._shapes), None)

    @property
    def done(self) -> bool:
        return self._sample is None

    def check_bucket(self, keys: Sequence[Key], shapes: Iterable[Sequence[int]]) -> None:
        """Refuse keys of the other kind, and saved entries of another shape than the parameter's."""
        if self._sample is None or not keys:
            return
        if _kind(keys[0]) != _kind(self._sample):
            raise ValueError(f"{self.owner}: the state cannot be applied to this model: " + _kind_advice(
                self._sample, keys[0]
            ) + ".")
        for key, shape in zip(keys, shapes, strict=True):
            saved = self._shapes.get(key)
            if saved is not None and saved != tuple(shape):
                raise ValueError(
                    f"{self.owner}: the saved state of parameter {key!r} was made for shape {saved}, but the "
                    f"parameter now has shape {tuple(shape)}: the state comes from another model. Load it "
                    "into the model it was saved with, or start from a new hook state."
                )
        self._unseen.difference_update(keys)

    def end_iteration(self) -> None:
        """After a whole iteration: refuse saved entries for parameters that no bucket held."""
        if self._sample is None:
            return
        unseen, self._unseen = sorted(self._unseen, key=str), set()
        self._sample = None
        if unseen:
            shown = ", ".join(repr(key) for key in unseen[:6]) + (", ..." if len(unseen) > 6 else "")
            raise ValueError(
                f"{self.owner}: the saved state holds parameter(s) {shown} ({len(unseen)} in all), which this "
                "model's buckets do not hold: the state comes from another model (or those parameters are "
                "now frozen). Load it into the model it was saved with, or start from a new hook state."
            )
