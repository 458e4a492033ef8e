"""The registry's entries: one :class:`HookSpec` per hook selectable by name, and how each builds its state.

An entry names the module and function of its hook, the factory of its state and the options it takes. The
options of gradcomm's stateful hooks are derived from their options dataclasses (:mod:`gradcomm.hooks.options`,
by :func:`options_of`), so an option added there is accepted by name, converted from a string by its annotation
and checked by the state's constructor without any edit here. A compression method's entry takes the options
of its constructor (:func:`compressed`). Lookup, checking and building are in :mod:`gradcomm.hooks.registry`,
which re-exports these names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from torch.distributed import ProcessGroup

from gradcomm.compression.base import Compressor
from gradcomm.compression.registry import method_options
from gradcomm.hooks.options import (
    AutoOptions,
    HierarchicalOptions,
    PostLocalSGDOptions,
    PowerSGDOptions,
    conversion_type,
)

__all__ = ["TORCH_HOOKS", "HookSpec", "Option", "compressed", "constructed", "options_of", "process_group_state"]

StateFactory = Callable[[ModuleType, ProcessGroup | None, dict[str, Any]], Any]
StateCheck = Callable[[ModuleType, dict[str, Any]], Any]


_UNSET: Any = object()
"""An :class:`Option`'s ``default`` when it has none (the constructor's own default applies)."""


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


def options_of(options_class: type, *extra: Option) -> tuple[Option, ...]:
    """The registry options of a state whose options are the dataclass ``options_class``: one per field, typed
    by its annotation, required where it has no default (whose defaults are then the constructor's), followed
    by ``extra`` (arguments of the constructor that are not options, such as post-local SGD's ``subgroup``)."""
    derived = tuple(
        Option(
            f.name,
            conversion_type(options_class, f.name),
            required=f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(options_class)
    )
    return (*derived, *extra)


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
        options_class: the dataclass ``options`` were derived from (:func:`options_of`), where they were.
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
    options_class: type | None = field(default=None, repr=False, compare=False)
    option_names: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "option_names", tuple(o.name for o in self.options))


_POWERSGD = dict(
    module="powerSGD_hook",
    state=constructed("PowerSGDState"),
    options=options_of(PowerSGDOptions),
    options_class=PowerSGDOptions,
)


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
    *options_of(HierarchicalOptions),
    Option("inner_wrapper", str),
)


def _hierarchical_state(module: ModuleType, process_group: ProcessGroup | None, options: dict[str, Any]) -> Any:
    """HierarchicalState around the hook named ``inner``, built by its own entry from the other options
    (``inner_wrapper`` is its ``wrapper``) without a process group: the state attaches it to the
    inter-node group at its first call, when that group exists."""
    from gradcomm.hooks.registry import make_comm_hook, resolve_hook_name

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
    Option("compile", bool),
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


TORCH_HOOKS = (
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
        options=options_of(PostLocalSGDOptions, Option("subgroup", default=None)),
        options_class=PostLocalSGDOptions,
        check=_post_localsgd_offline,
        summary="global all-reduce, then local SGD (pair with PeriodicModelAverager)",
    ),
    HookSpec(
        "hierarchical",
        "hierarchical_hook",
        "hierarchical_hook",
        state=_hierarchical_state,
        options=_HIERARCHICAL_OPTIONS,
        options_class=HierarchicalOptions,
        passes_options=True,
        summary="exact average within each node, the inner hook (inner=NAME, its options) among nodes",
    ),
    HookSpec(
        "auto",
        "auto_hook",
        "auto_hook",
        state=constructed("AutoHookState"),
        options=options_of(AutoOptions),
        options_class=AutoOptions,
        summary="measure the link and each candidate hook, then use the fastest accurate enough",
    ),
)
