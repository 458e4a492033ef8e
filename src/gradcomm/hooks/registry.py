"""Pick a communication hook by name, for command lines and config files.

Every hook is one :class:`HookSpec` entry of :class:`CommHookType`: its name, the module and function
implementing it, how to build its state from a process group and options, and which options it takes.
torch's hooks are the entries of ``_TORCH_HOOKS``; every compression method of :mod:`gradcomm.compression`
adds its own entry by registering itself (:mod:`gradcomm.compression.registry`), with the options of its
constructor. Hook modules are imported only when their hook is chosen, so a broken or absent hook module
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
from dataclasses import dataclass, field
from enum import Enum
from types import ModuleType
from typing import Any

from torch.distributed import ProcessGroup

from gradcomm.compression.base import Compressor
from gradcomm.compression.registry import method_options
from gradcomm.compression.registry import methods as compression_methods

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

StateFactory = Callable[[ModuleType, ProcessGroup | None, dict[str, Any]], Any]
StateCheck = Callable[[ModuleType, dict[str, Any]], Any]


_UNSET: Any = object()


@dataclass(frozen=True)
class Option:
    """An option of a hook's state constructor.

    ``type`` is what a string value is converted to (``None``: passed as given); ``default`` is passed when
    the option is not given (unset: the constructor's own default applies).
    """

    name: str
    type: type | None = None
    required: bool = False
    default: Any = _UNSET


def process_group_state(
    module: ModuleType, process_group: ProcessGroup | None, options: dict[str, Any]
) -> Any:
    """State factory of stateless hooks: the state is the process group."""
    return process_group


def constructed(class_name: str) -> StateFactory:
    """State factory calling ``module.<class_name>(process_group=..., **options)``."""

    def make(module: ModuleType, process_group: ProcessGroup | None, options: dict[str, Any]) -> Any:
        return getattr(module, class_name)(process_group=process_group, **options)

    make.__qualname__ = f"constructed({class_name!r})"
    make.class_name = class_name  # type: ignore[attr-defined]
    return make


@dataclass(frozen=True)
class HookSpec:
    """One registry entry.

    Attributes:
        name: the canonical, lower-case name.
        module: module under ``gradcomm.hooks`` holding ``hook`` and its state class.
        hook: the hook function's name in ``module``.
        state: builds the state from the imported module, the process group and the options.
        options: the options ``state`` accepts.
        presets: options fixed by this entry (``powersgd_rank2`` fixes ``matrix_approximation_rank=2``).
        summary: one line for help texts.
        check: builds the state without a process group, for :func:`check_options` to have its constructor
            check the option values; ``None``: ``state`` called with ``process_group=None`` (nothing for
            stateless hooks). Set it where that would communicate.
        passes_options: options not in ``options`` are accepted too and handed to ``state`` as given, which
            checks them (the ``hierarchical`` entry passes them on to its inner hook's entry).
    """

    name: str
    module: str
    hook: str
    state: StateFactory = process_group_state
    options: tuple[Option, ...] = ()
    presets: tuple[tuple[str, Any], ...] = ()
    summary: str = ""
    check: StateCheck | None = field(default=None, repr=False, compare=False)
    passes_options: bool = False
    option_names: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "option_names", tuple(o.name for o in self.options))


_POWERSGD_OPTIONS = (
    Option("matrix_approximation_rank", int),
    Option("start_powerSGD_iter", int),
    Option("min_compression_rate", float),
    Option("use_error_feedback", bool),
    Option("warm_start", bool),
    Option("orthogonalization_epsilon", float),
    Option("random_seed", int),
    Option("compression_stats_logging_frequency", int),
    Option("batch_tensors_with_same_shape", bool),
)
_POST_LOCALSGD_OPTIONS = (
    Option("start_localSGD_iter", int, required=True),
    Option("subgroup", default=None),
    Option("post_local_gradient_allreduce", bool),
)
_POWERSGD = dict(module="powerSGD_hook", state=constructed("PowerSGDState"), options=_POWERSGD_OPTIONS)


def _post_localsgd_offline(module: ModuleType, options: dict[str, Any]) -> Any:
    """PostLocalSGDState without a process group.

    With ``subgroup`` unset and ``post_local_gradient_allreduce`` on, the constructor creates the intra-node
    subgroups, a collective; the other values are checked the same with it off.
    """
    offline = dict(options)
    if offline.get("subgroup") is None and offline.get("post_local_gradient_allreduce", True) is True:
        offline["post_local_gradient_allreduce"] = False
    return module.PostLocalSGDState(process_group=None, **offline)


_HIERARCHICAL_OPTIONS = (
    Option("inner", str, default="allreduce"),
    Option("ranks_per_node", int),
    Option("inner_wrapper", str),
)


def _hierarchical_state(module: ModuleType, process_group: ProcessGroup | None, options: dict[str, Any]) -> Any:
    """HierarchicalState around the hook named ``inner``, built by its own entry from the other options
    (``inner_wrapper`` is its ``wrapper``) without a process group: the state attaches it to the
    inter-node group at its first call, when that group exists."""
    rest = dict(options)
    inner, ranks_per_node, inner_wrapper = rest.pop("inner"), rest.pop("ranks_per_node", None), rest.pop("inner_wrapper", None)
    if resolve_hook_name(inner).value.passes_options:
        raise ValueError(f"inner={inner!r}: the inner hook cannot be hierarchical itself; name the hook run among the node leaders")
    inner_hook, inner_state = make_comm_hook(inner, wrapper=inner_wrapper, **rest)
    return module.HierarchicalState(inner_hook, inner_state, ranks_per_node=ranks_per_node, process_group=process_group)


_COMPRESSION_OPTIONS = (
    Option("error_feedback", bool),
    Option("min_compression_rate", float),
    Option("min_numel", int),
)


def compressed(method: type[Compressor]) -> HookSpec:
    """The entry of a :mod:`gradcomm.compression` method, run by the generic compression hook.

    Its options are the method's constructor parameters (from its signature and type hints), then those of
    ``CompressionState``.
    """
    own = tuple(Option(o.name, o.type, required=o.required) for o in method_options(method))
    own_names = {option.name for option in own}

    def make(module: ModuleType, process_group: ProcessGroup | None, options: dict[str, Any]) -> Any:
        compressor = method(**{k: v for k, v in options.items() if k in own_names})
        rest = {k: v for k, v in options.items() if k not in own_names}
        return module.CompressionState(compressor, process_group=process_group, **rest)

    make.__qualname__ = f"compressed({method.__name__})"
    assert method.name is not None
    return HookSpec(
        method.name,
        module="compression_hook",
        hook="compressed_allreduce_hook",
        state=make,
        options=(*own, *_COMPRESSION_OPTIONS),
        summary=method.summary,
    )


_TORCH_HOOKS = (
    HookSpec("allreduce", "default_hooks", "allreduce_hook", summary="average gradients (DDP default)"),
    HookSpec("fp16_compress", "default_hooks", "fp16_compress_hook", summary="all-reduce in float16"),
    HookSpec("bf16_compress", "default_hooks", "bf16_compress_hook", summary="all-reduce in bfloat16"),
    HookSpec(
        "quantize_per_tensor",
        "quantization_hooks",
        "quantization_pertensor_hook",
        summary="all-gather 8-bit gradients quantized per tensor",
    ),
    HookSpec(
        "quantize_per_channel",
        "quantization_hooks",
        "quantization_perchannel_hook",
        summary="all-gather 8-bit gradients quantized per row",
    ),
    HookSpec("powersgd", hook="powerSGD_hook", summary="PowerSGD low-rank compression", **_POWERSGD),
    HookSpec(
        "powersgd_rank2",
        hook="powerSGD_hook",
        presets=(("matrix_approximation_rank", 2),),
        summary="PowerSGD, rank 2",
        **_POWERSGD,
    ),
    HookSpec(
        "batched_powersgd",
        hook="batched_powerSGD_hook",
        summary="PowerSGD on the whole bucket as one matrix",
        **_POWERSGD,
    ),
    HookSpec(
        "batched_powersgd_rank2",
        hook="batched_powerSGD_hook",
        presets=(("matrix_approximation_rank", 2),),
        summary="batched PowerSGD, rank 2",
        **_POWERSGD,
    ),
    HookSpec("noop", "debugging_hooks", "noop_hook", summary="no communication (for measurements)"),
    HookSpec(
        "allgather",
        "allgather_hooks",
        "allgather_then_aggregate_hook",
        summary="all-gather the buckets, then average",
    ),
    HookSpec(
        "post_localsgd",
        "post_localSGD_hook",
        "post_localSGD_hook",
        state=constructed("PostLocalSGDState"),
        options=_POST_LOCALSGD_OPTIONS,
        check=_post_localsgd_offline,
        summary="global all-reduce, then local SGD (pair with PeriodicModelAverager)",
    ),
    HookSpec(
        "hierarchical",
        "hierarchical_hook",
        "hierarchical_hook",
        state=_hierarchical_state,
        options=_HIERARCHICAL_OPTIONS,
        passes_options=True,
        summary="exact average within each node, the inner hook (inner=NAME, its options) among nodes",
    ),
    HookSpec(
        "auto",
        "auto_hook",
        "auto_hook",
        state=constructed("AutoHookState"),
        options=(
            Option("candidates"),
            Option("error_bound", float),
            Option("trial_steps", int),
            Option("remeasure_every", int),
            Option("tie_tolerance", float),
        ),
        summary="measure the link and each candidate hook, then use the fastest accurate enough",
    ),
)

CommHookType = Enum(  # type: ignore[misc]
    "CommHookType",
    [(spec.name.upper(), spec) for spec in _TORCH_HOOKS]
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
        given = resolved.get("candidates", _import(spec.name, spec.module).DEFAULT_CANDIDATES)
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
