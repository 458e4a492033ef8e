"""What must agree across ranks about a communication hook: the code it runs and its state's options, as text.

Ranks that register different hooks or options would pair unrelated collectives and hang or silently corrupt.
:func:`hook_fingerprint` describes a hook and its state as plain strings; the DDPs add their bucket layout and
compare the whole with :func:`gradcomm.comm.agreement.check_same_on_all_ranks` (one small collective, the same
:class:`~gradcomm.comm.agreement.RanksDisagreeError` on every rank).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from gradcomm.hooks.contract import DEFAULT_HOOK_NAME, hook_name

__all__ = ["describe_hook", "describe_state", "hook_fingerprint"]

_SCALARS = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)
_MAX_SEQUENCE = 16
_LIBRARIES = ("torch", "gradcomm")
"""Packages whose code is named without a hash (as the standard library's): every rank runs the same
installed library."""
_HASH_CHARS = 8


def describe_hook(hook: Callable[..., Any] | None, depth: int = 16) -> str:
    """What must agree across ranks about ``hook``: the code it runs, not the data it holds.

    Ranks launch different collectives only if they run different code, so the fingerprint names every
    callable reachable from ``hook`` as ``module.qualname(what it holds)``, followed, for code outside torch,
    gradcomm and the standard library, by ``@`` and a short hash of its code (a function's code object,
    nested functions included; a callable object's class, all its methods). It goes through ``functools.partial`` arguments, closure cells,
    default arguments, the attributes of callable objects (``Wrapper(powerSGD_hook)``), the function of a
    bound method and the callable attributes of its ``self``, and short lists or tuples of callables, down
    to ``depth`` levels. Data (ints, strings, tensors, a rank, a process group) is left out, so a closure
    over per-rank values is accepted, as torch's DDP accepts it. A ``torch.dtype`` is kept: it decides what
    a collective sends (``fp16_compress_wrapper`` and ``bf16_compress_wrapper`` share their code). A cycle
    is cut where it closes, and past :data:`_MAX_NODES` callables only names are given.
    """
    if hook is None:
        return DEFAULT_HOOK_NAME
    return _Walk().describe(hook, depth) or _qualified(hook)


_MAX_NODES = 256


class _Walk:
    """One description: the callables on the current path (to cut cycles) and how many were described."""

    def __init__(self) -> None:
        self.path: set[int] = set()
        self.nodes = 0

    def describe(self, value: Any, depth: int) -> str | None:
        """The code (and dtypes) reachable from ``value`` as text; ``None`` where there is only data."""
        if isinstance(value, torch.dtype):
            return repr(value)
        if isinstance(value, (list, tuple)):
            described = [text for text in (self.describe(item, depth) for item in value[:_MAX_SEQUENCE]) if text]
            return f"[{', '.join(described)}]" if described else None
        if not callable(value) or isinstance(value, (dist.ProcessGroup, torch.Tensor)):
            return None
        if isinstance(value, type):
            return _named(value)
        if id(value) in self.path or depth <= 0 or self.nodes >= _MAX_NODES:
            return _named(value)
        self.nodes += 1
        self.path.add(id(value))
        try:
            return self._node(value, depth)
        finally:
            self.path.discard(id(value))

    def _node(self, value: Any, depth: int) -> str:
        if isinstance(value, functools.partial):
            held = [(str(i), arg) for i, arg in enumerate(value.args)] + sorted(value.keywords.items())
            return self._held(f"functools.partial({self.describe(value.func, depth - 1)})", held, depth)
        if isinstance(value, types.MethodType):  # the function and the class of self, not self's data
            function, owner = value.__func__, value.__self__
            held = _function_held(function) + _callable_attributes(owner, "self.")
            return self._held(_qualified(function), held, depth, _hash(_code_texts(function) + _code_texts(owner)))
        if isinstance(getattr(value, "__code__", None), types.CodeType):
            return self._held(_qualified(value), _function_held(value), depth, _hash(_code_texts(value)))
        if inspect.isroutine(value):  # a builtin or C function: its name is all there is
            return _qualified(value)
        return self._held(_qualified(value), _callable_attributes(value, ""), depth, _hash(_code_texts(value)))

    def _held(self, name: str, held: list[tuple[str, Any]], depth: int, code: str = "") -> str:
        """``name(key=description, ...)@code``, the items that hold only data left out."""
        shown = [(key, self.describe(item, depth - 1)) for key, item in held]
        items = [f"{key}={text}" for key, text in shown if text is not None]
        return (f"{name}({', '.join(items)})" if items else name) + (f"@{code}" if code else "")


def _function_held(function: Any) -> list[tuple[str, Any]]:
    """A function's closure cells and default arguments, by name."""
    code = function.__code__
    held: list[tuple[str, Any]] = []
    for var, cell in zip(code.co_freevars, getattr(function, "__closure__", None) or (), strict=False):
        try:
            held.append((var, cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    defaults = getattr(function, "__defaults__", None) or ()
    positional = code.co_varnames[: code.co_argcount]
    held += list(zip(positional[len(positional) - len(defaults) :], defaults, strict=True))
    held += sorted((getattr(function, "__kwdefaults__", None) or {}).items())
    return held


def _callable_attributes(obj: Any, prefix: str) -> list[tuple[str, Any]]:
    """The instance attributes of ``obj`` that may hold code (callables, lists, tuples) or a dtype, by name."""
    attributes = getattr(obj, "__dict__", None)
    if not isinstance(attributes, Mapping):
        return []
    return [
        (prefix + key, value)
        for key, value in sorted(attributes.items(), key=lambda item: str(item[0]))
        if not str(key).startswith("__") and (callable(value) or isinstance(value, (list, tuple, torch.dtype)))
    ]


def _owner(value: Any) -> Any:
    """The function or class that ``value`` is, or the class of an instance."""
    return value if isinstance(value, type) or inspect.isroutine(value) else type(value)


def _qualified(value: Any) -> str:
    """``module.qualname`` of a function or class, or of an instance's class."""
    owner = _owner(value)
    module = getattr(owner, "__module__", None) or type(owner).__module__
    if module == "__mp_main__":  # the main script as multiprocessing's spawned ranks import it
        module = "__main__"
    return f"{module}.{hook_name(owner)}"


def _named(value: Any) -> str:
    """:func:`_qualified`, then ``@`` and the hash of its code where there is one."""
    code = _hash(_code_texts(value))
    return f"{_qualified(value)}@{code}" if code else _qualified(value)


def _code_texts(value: Any) -> list[str]:
    """The code of a function or class (or an instance's class) outside torch, gradcomm and the standard
    library, which every rank runs alike: none there and for builtins. A class's code is all the methods it
    and its bases outside those libraries define."""
    owner = _owner(value)
    if _in_library(owner):
        return []
    if isinstance(owner, type):
        return _class_code_texts(owner)
    code = getattr(owner, "__code__", None)
    return [_code_text(code)] if isinstance(code, types.CodeType) else []


def _hash(texts: list[str]) -> str:
    return hashlib.sha256("|".join(texts).encode()).hexdigest()[:_HASH_CHARS] if texts else ""


def _in_library(owner: Any) -> bool:
    module = getattr(owner, "__module__", None) or ""
    top = module.split(".", 1)[0]
    return top in _LIBRARIES or top in sys.stdlib_module_names


def _class_code_texts(cls: type) -> list[str]:
    """The code of every function a class and its bases outside torch, gradcomm and builtins define."""
    texts = []
    for klass in cls.__mro__:
        if _in_library(klass):
            continue
        for key, member in sorted(vars(klass).items()):
            function = getattr(member, "__func__", member)  # staticmethod, classmethod
            code = getattr(function, "__code__", None)
            if isinstance(code, types.CodeType):
                texts.append(f"{klass.__qualname__}.{key}:{_code_text(code)}")
    return texts


def _code_text(code: types.CodeType) -> str:
    """What ``code`` does as text, the same in every process: its bytecode, the names and constants it uses
    and the code nested in it; not its file, line numbers or local variable names."""
    consts = ",".join(_const_text(const) for const in code.co_consts)
    shape = (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)
    return f"{code.co_code.hex()}|{code.co_names}|{shape}|{consts}"


def _const_text(const: Any) -> str:
    """A constant as text independent of the process: a frozenset's order follows string hashing, which
    differs between processes, so its elements are sorted."""
    if isinstance(const, types.CodeType):
        return f"<{_code_text(const)}>"
    if isinstance(const, frozenset):
        return "{" + ",".join(sorted(_const_text(item) for item in const)) + "}"
    if isinstance(const, tuple):
        return "(" + ",".join(_const_text(item) for item in const) + ")"
    return f"{type(const).__name__}:{const!r}"


def _plain(value: Any) -> str | None:
    """``repr`` of a scalar or a short sequence of scalars; ``None`` for anything else."""
    if isinstance(value, _SCALARS):
        return repr(value)
    if isinstance(value, (list, tuple)) and len(value) <= _MAX_SEQUENCE and all(isinstance(v, _SCALARS) for v in value):
        return repr(value)
    return None


def describe_state(state: Any, depth: int = 1) -> str:
    """A hook state's options as text: its public attributes holding plain values (numbers, strings, short
    tuples of them), one level into attribute objects (a compressor). Tensors, buffers and process groups
    are left out; a process group is described by its size.

    A state class may define ``comm_hook_fingerprint() -> str`` to say itself what must agree across ranks
    (for states that keep rank-specific plain values).
    """
    if state is None:
        return "None"
    custom = getattr(state, "comm_hook_fingerprint", None)
    if callable(custom):
        return str(custom())
    if isinstance(state, dist.ProcessGroup):
        return f"a process group of {state.size()} ranks"
    plain = _plain(state)
    if plain is not None:
        return plain
    attributes = getattr(state, "__dict__", None)
    if not isinstance(attributes, Mapping):
        return type(state).__qualname__
    fields = []
    for key in sorted(attributes):
        if key.startswith("_"):
            continue
        value = attributes[key]
        text = _plain(value)
        if text is None and depth > 0 and hasattr(value, "__dict__") and not isinstance(value, torch.Tensor):
            if isinstance(value, dist.ProcessGroup) or callable(value):
                continue
            text = describe_state(value, depth - 1)
        if text is not None:
            fields.append(f"{key}={text}")
    return f"{type(state).__qualname__}({', '.join(fields)})"


def hook_fingerprint(hook: Callable[..., Any] | None, state: Any) -> dict[str, str]:
    """The hook's part of a setup fingerprint: its qualified name and its state's plain options."""
    return {"hook": describe_hook(hook), "hook options": describe_state(state) if hook is not None else "-"}
