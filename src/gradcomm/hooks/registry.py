"""Pick a communication hook by name, for command lines and config files.

Every hook is one :class:`HookSpec` entry of :class:`CommHookType`: its name, the module and function
implementing it, how to build its state from a process group and options, and which options it takes
(:mod:`gradcomm.hooks.hook_specs`). torch's hooks are the entries of ``TORCH_HOOKS`` there, their states'
options derived from their options dataclasses (:mod:`gradcomm.hooks.options`); every compression method of
:mod:`gradcomm.compression` adds its own entry by registering itself (:mod:`gradcomm.compression.registry`),
with the options of its constructor. Hook modules are imported only when their hook is chosen, so a broken or absent hook module
affects only its own names.

Names are lower case (``powersgd``, ``quantize_per_tensor``, ``post_localsgd``); lookup ignores case,
``_`` and ``-``, so torch's :class:`~torch.distributed.algorithms.ddp_comm_hooks.DDPCommHookType` names
(``POWER_SGD``, ``BATCHED_POWER_SGD_RANK2``, ...) and its members select the same hooks.

::

    state = register_comm_hook_by_name(ddp_model, "powersgd", matrix_approximation_rank=4)
    state = register_comm_hook_by_name(ddp_model, "powersgd", wrapper="fp16", start_powerSGD_iter="10")
    state = register_comm_hook_by_name(ddp_model, "hierarchical", inner="powersgd", matrix_approximation_rank=4)

Option values given as strings (from a command line) are converted to the option's type. The returned
state is what was registered: the process group (``None`` for the default) for stateless hooks, the
hook's state object otherwise; keep it to checkpoint it.

Option *values* are checked by the state's constructor (``PowerSGDState``, ``CompressionState`` and the
compressors, ``PostLocalSGDState``), the one place that knows their valid ranges. :func:`check_options`
builds the state without a process group to get the same errors before any process group exists, so a
launcher can refuse ``matrix_approximation_rank=-1`` before it starts ranks that would each fail on it.
Either way the message is prefixed with the hook's name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from types import ModuleType
from typing import Any

from torch.distributed import ProcessGroup

from gradcomm.compression.registry import methods as compression_methods
from gradcomm.hooks.hook_specs import (  # noqa: F401  (constructed, options_of: importable from here as before)
    _UNSET,
    TORCH_HOOKS,
    HookSpec,
    Option,
    compressed,
    constructed,
    options_of,
    process_group_state,
)
from gradcomm.hooks.options import DEFAULT_CANDIDATES

__all__ = [
    "CommHookType",
    "HookSpec",
    "Option",
    "apply_option_defaults",
    "check_options",
    "get_hook",
    "hook_names",
    "make_comm_hook",
    "parse_hook_choice",
    "register_comm_hook_by_name",
    "resolve_hook_name",
    "wrapper_names",
]

_PACKAGE = "gradcomm.hooks"

CommHookType = Enum(  # type: ignore[misc]
    "CommHookType",
    [(spec.name.upper(), spec) for spec in TORCH_HOOKS]
    + [(name.upper(), compressed(method)) for name, method in compression_methods().items()],
    module=__name__,
)
CommHookType.__doc__ = """The hooks selectable by name; ``CommHookType.POWERSGD.value`` is its :class:`HookSpec`.

torch's hooks come first, then every registered compression method (:mod:`gradcomm.compression.registry`).
"""


@dataclass(frozen=True)
class _Wrapper:
    module: str
    function: str


_WRAPPERS: Mapping[str, _Wrapper] = {
    "fp16": _Wrapper("default_hooks", "fp16_compress_wrapper"),
    "bf16": _Wrapper("default_hooks", "bf16_compress_wrapper"),
}


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "").replace("-", "")


_BY_KEY: dict[str, CommHookType] = {_key(member.value.name): member for member in CommHookType}


def parse_hook_choice(text: str) -> tuple[str, dict[str, str]]:
    """Split ``"name"`` or ``"name:key=value,key=value"`` into the name and its (string) options.

    The name is not resolved here (see :func:`resolve_hook_name`); option values stay strings, converted
    by :func:`check_options` or :func:`make_comm_hook`.

    Raises:
        ValueError: an option that is not ``key=value``, or no name.
    """
    name, _, rest = text.strip().partition(":")
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"hook option {item!r} in {text!r} is not key=value")
        options[key.strip()] = value.strip()
    if not name.strip():
        raise ValueError(f"hook choice {text!r} names no hook; write NAME or NAME:key=value,...")
    return name.strip(), options


def hook_names() -> list[str]:
    """The canonical names, in registry order."""
    return [member.value.name for member in CommHookType]


def wrapper_names() -> list[str]:
    """The names accepted by ``wrapper=``."""
    return list(_WRAPPERS)


def resolve_hook_name(name: str | Enum) -> CommHookType:
    """The registry entry for ``name``: a name, a :class:`CommHookType` or a torch ``DDPCommHookType``.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    if isinstance(name, CommHookType):
        return name
    if isinstance(name, Enum):
        name = name.name
    if not isinstance(name, str):
        raise TypeError(f"communication hook name must be a string, got {type(name).__name__}")
    member = _BY_KEY.get(_key(name))
    if member is None:
        raise ValueError(
            f"unknown communication hook {name!r}; valid names: {', '.join(hook_names())} "
            "(case, '_' and '-' are ignored, so torch's DDPCommHookType names such as POWER_SGD work too)"
        )
    return member


def _import(spec_name: str, module: str) -> ModuleType:
    qualified = f"{_PACKAGE}.{module}"
    try:
        return importlib.import_module(qualified)
    except ImportError as exc:
        raise ImportError(
            f"communication hook {spec_name!r} is implemented in {qualified}, which could not be imported: {exc}"
        ) from exc


def _attribute(spec_name: str, module: ModuleType, attribute: str) -> Any:
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ImportError(
            f"communication hook {spec_name!r}: {module.__name__} has no {attribute!r}"
        ) from None


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(spec: HookSpec, option: Option, value: Any) -> Any:
    if not isinstance(value, str) or option.type is None or option.type is str:
        return value
    text = value.strip()
    try:
        if option.type is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(text)
        return option.type(text)
    except ValueError:
        raise ValueError(
            f"communication hook {spec.name!r}: option {option.name!r} expects {option.type.__name__}, "
            f"got {value!r}"
        ) from None


def _check_options(spec: HookSpec, options: Mapping[str, Any]) -> dict[str, Any]:
    valid = spec.option_names
    unknown = [name for name in options if name not in valid]
    if unknown and not spec.passes_options:
        listed = ", ".join(repr(name) for name in unknown)
        accepted = f"valid options: {', '.join(valid)}" if valid else "it takes no options"
        raise ValueError(f"communication hook {spec.name!r} got unknown option(s) {listed}; {accepted}")
    presets = dict(spec.presets)
    fixed = [name for name in options if name in presets]
    if fixed:
        raise ValueError(
            f"communication hook {spec.name!r} fixes {', '.join(f'{n}={presets[n]!r}' for n in fixed)}; "
            "choose the hook without the preset to set it"
        )
    by_name = {option.name: option for option in spec.options}
    converted = {
        **presets,
        **{name: _convert(spec, by_name[name], value) if name in by_name else value for name, value in options.items()},
    }
    for option in spec.options:
        if option.default is not _UNSET and option.name not in converted:
            converted[option.name] = option.default
    missing = [option.name for option in spec.options if option.required and option.name not in converted]
    if missing:
        raise ValueError(f"communication hook {spec.name!r} requires option(s) {', '.join(missing)}")
    return converted


@contextmanager
def _named(spec: HookSpec) -> Iterator[None]:
    """Prefix the hook's name to a constructor's complaint about an option value."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        kind = ValueError if isinstance(exc, ValueError) else TypeError
        raise kind(f"communication hook {spec.name!r}: {exc}") from exc


def check_options(name: str | Enum, **options: Any) -> dict[str, Any]:
    """Validate and convert ``options`` for the hook called ``name``; return them converted.

    Names, types and required options are checked from the registry entry; values by building the hook's
    state without a process group (importing its module), so that its constructor refuses them as it would
    on a rank. Nothing communicates: call it before starting ranks.

    Raises:
        ValueError: unknown name or option, a value of the wrong type or out of range, or a missing
            required option.
        TypeError: a value of a type the state's constructor refuses (only where not given as a string).
        ImportError: the hook's module cannot be imported.
    """
    spec = resolve_hook_name(name).value
    checked = _check_options(spec, options)
    if spec.state is not process_group_state or spec.check is not None:
        module = _import(spec.name, spec.module)
        with _named(spec):
            if spec.check is not None:
                spec.check(module, dict(checked))
            else:
                spec.state(module, None, dict(checked))
    return checked


def apply_option_defaults(name: str | Enum, options: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` of the hook called ``name`` with each of ``defaults`` added wherever a hook of the choice
    takes it and is not given it: the hook itself, ``hierarchical``'s inner hook (its options are the
    hierarchical choice's), each of ``auto``'s candidates (``candidates`` is then written out, a candidate's
    options joined by ``;``). Options given explicitly always win; values stay as given (strings from a
    command line), and nothing is checked but the names that decide where an option goes.

    A launcher's defaults (``gradcomm bench``'s ``start_powerSGD_iter=10``) must reach PowerSGD wherever it
    runs: otherwise a hierarchical PowerSGD row keeps torch's 1,000 warm-up steps beside a flat one's 10. The
    result is what the launcher passes to :func:`make_comm_hook` and shows as the options the hook ran with.

    Raises:
        ValueError: an unknown hook name (of the choice, its inner hook or a candidate), or malformed candidates.
    """
    spec = resolve_hook_name(name).value
    presets = dict(spec.presets)
    resolved = dict(options)
    for key, value in defaults.items():
        if key in spec.option_names and key not in presets and key not in resolved:
            resolved[key] = value
    if spec.passes_options:
        own = {key: value for key, value in resolved.items() if key in spec.option_names}
        passed = {key: value for key, value in resolved.items() if key not in spec.option_names}
        inner = own.get("inner", next(o.default for o in spec.options if o.name == "inner"))
        resolved = {**own, **apply_option_defaults(inner, passed, defaults)}
    elif spec.name == "auto":
        given = resolved.get("candidates", DEFAULT_CANDIDATES)
        candidates = _candidates_with_defaults(given, defaults)
        if candidates != given:
            resolved["candidates"] = candidates
    return resolved


def _candidates_with_defaults(candidates: Any, defaults: Mapping[str, Any]) -> Any:
    """``auto``'s candidates (a ``+``-joined string or a list) with ``defaults`` applied to each; a candidate
    that gains nothing keeps its text."""
    texts = candidates.split("+") if isinstance(candidates, str) else list(candidates)
    written = []
    for text in texts:
        if not isinstance(text, str):
            written.append(text)
            continue
        name, options = parse_hook_choice(text.replace(";", ","))
        resolved = apply_option_defaults(name, options, defaults)
        changed = resolved != options
        written.append(f"{name}:{';'.join(f'{k}={v}' for k, v in resolved.items())}" if changed else text)
    return "+".join(written) if isinstance(candidates, str) else written


def get_hook(name: str | Enum, wrapper: str | None = None) -> Callable[..., Any]:
    """The hook function for ``name`` (importing its module), wrapped by ``wrapper`` if given.

    Raises:
        ValueError: unknown name or wrapper.
        ImportError: the hook's module (or the wrapper's) cannot be imported, or lacks the function.
    """
    spec = resolve_hook_name(name).value
    wrap: _Wrapper | None = None
    if wrapper is not None:
        wrap = _WRAPPERS.get(_key(wrapper).removesuffix("compresswrapper").removesuffix("compress"))
        if wrap is None:
            raise ValueError(f"unknown hook wrapper {wrapper!r}; valid wrappers: {', '.join(_WRAPPERS)}")
    hook = _attribute(spec.name, _import(spec.name, spec.module), spec.hook)
    if wrap is not None:
        hook = _attribute(spec.name, _import(spec.name, wrap.module), wrap.function)(hook)
    return hook


def make_comm_hook(
    name: str | Enum,
    *,
    process_group: ProcessGroup | None = None,
    wrapper: str | None = None,
    **options: Any,
) -> tuple[Callable[..., Any], Any]:
    """Build ``(hook, state)`` for ``name`` without registering it.

    Args:
        name: a hook name (see :func:`hook_names`) or enum member.
        process_group: the group the hook communicates over; ``None`` for the default group.
        wrapper: ``"fp16"`` or ``"bf16"`` to run the hook on a half-precision copy of each bucket
            (``fp16_compress_wrapper(hook)``); ``None`` for none.
        options: the hook's state options, e.g. ``matrix_approximation_rank=4``; strings are converted.

    Raises:
        ValueError: unknown name, wrapper or option, a value of the wrong type, or a missing required
            option (checked before the hook's module is imported); a value out of range (refused by the
            state's constructor, with the same message as from :func:`check_options`).
        TypeError: a value of a type the state's constructor refuses.
        ImportError: the hook's module (or the wrapper's) cannot be imported.
    """
    spec = resolve_hook_name(name).value
    checked = _check_options(spec, options)
    hook = get_hook(spec.name, wrapper=wrapper)
    module = _import(spec.name, spec.module)
    with _named(spec):
        state = spec.state(module, process_group, checked)
    return hook, state


def register_comm_hook_by_name(
    model: Any,
    name: str | Enum,
    *,
    process_group: ProcessGroup | None = None,
    wrapper: str | None = None,
    **options: Any,
) -> Any:
    """Register the hook called ``name`` on ``model`` and return its state.

    ``model`` is anything with ``register_comm_hook(state, hook)``: gradcomm's or torch's
    DistributedDataParallel. The other arguments are those of :func:`make_comm_hook`.
    """
    register = getattr(model, "register_comm_hook", None)
    if not callable(register):
        raise TypeError(
            f"register_comm_hook_by_name: {type(model).__name__} has no register_comm_hook(state, hook); "
            "wrap the module in a DistributedDataParallel first"
        )
    hook, state = make_comm_hook(name, process_group=process_group, wrapper=wrapper, **options)
    register(state, hook)
    return state
