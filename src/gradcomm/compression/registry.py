"""The compression methods by name: every :class:`~gradcomm.compression.base.Compressor` subclass declared
with ``name=`` registers itself here when its module is imported, and every module of
:mod:`gradcomm.compression.methods` is imported on first use. So a new method is one new file in that folder:
the hook registry (:mod:`gradcomm.hooks.registry`), ``gradcomm bench`` and the test suites that parametrise
over :func:`methods` pick it up, and its options come from its constructor's signature and type hints.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradcomm.compression.base import Compressor

__all__ = ["MethodOption", "get_method", "method_options", "methods", "register"]

_METHODS: dict[str, type[Compressor]] = {}
_discovered = False


def register(cls: type[Compressor]) -> None:
    """Register ``cls`` under ``cls.name`` (called by ``Compressor.__init_subclass__``)."""
    assert cls.name is not None
    existing = _METHODS.get(cls.name)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        raise ValueError(
            f"compression method name {cls.name!r} of {cls.__module__}.{cls.__qualname__} is already taken by "
            f"{existing.__module__}.{existing.__qualname__}; choose another name="
        )
    if not cls.summary:
        raise ValueError(f"compression method {cls.name!r} ({cls.__qualname__}) needs a summary= for help texts")
    _METHODS[cls.name] = cls


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    package = importlib.import_module("gradcomm.compression.methods")
    for module in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{module.name}")


def methods() -> dict[str, type[Compressor]]:
    """Every registered method by name, in the order the modules were imported (alphabetical)."""
    _discover()
    return dict(_METHODS)


def get_method(name: str) -> type[Compressor]:
    """The method registered as ``name``; raises ``ValueError`` listing the valid names."""
    found = methods().get(name)
    if found is None:
        raise ValueError(f"unknown compression method {name!r}; registered: {', '.join(methods())}")
    return found


@dataclass(frozen=True)
class MethodOption:
    """A constructor parameter of a method: its name, the type a string value converts to (``None``: passed
    as given), and whether it must be given."""

    name: str
    type: type | None
    required: bool


def _plain_type(hint: Any) -> type | None:
    """``float`` for ``float`` and ``float | None``; ``None`` for anything a string cannot be converted to."""
    if isinstance(hint, type):
        return hint if hint in (bool, int, float, str) else None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        concrete = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return _plain_type(concrete[0]) if len(concrete) == 1 else None
    return None


def method_options(cls: type[Compressor]) -> tuple[MethodOption, ...]:
    """The options of method ``cls``, from its constructor's signature and type hints."""
    signature = inspect.signature(cls.__init__)
    hints = typing.get_type_hints(cls.__init__)
    return tuple(
        MethodOption(name, _plain_type(hints.get(name)), parameter.default is inspect.Parameter.empty)
        for name, parameter in list(signature.parameters.items())[1:]
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )
