"""The options of gradcomm's stateful hooks, one frozen dataclass per hook state.

A hook state is split as Bagua splits an algorithm's configuration from its runtime: the *options* (what a
user chooses and every rank must agree on: PowerSGD's rank, post-local SGD's warm-up) are a frozen dataclass
declared here; the *runtime* (caches, groups, launchers) is rebuilt by the state's
:meth:`~gradcomm.hooks.hook_state.HookState.reset_runtime` and never saved. From each dataclass are derived

* the state's constructor (its keyword options, their order and defaults, checked in ``__post_init__``),
* the options the registry accepts by name (:mod:`gradcomm.hooks.registry`, types from the annotations),
* the fingerprint the ranks compare at registration (:meth:`HookState.comm_hook_fingerprint`),
* what ``state_dict()`` saves of the options (every field, unless marked :data:`NOT_SAVED`),

so adding an option to a hook state is one edit: a field here (with its check, if it has one).

This module imports nothing of the hooks, so the registry reads the options without importing a hook's module.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from collections.abc import Sequence
from typing import Any, Union

__all__ = [
    "NOT_SAVED",
    "AutoOptions",
    "HierarchicalOptions",
    "PostLocalSGDOptions",
    "PowerSGDOptions",
    "conversion_type",
    "saved_option_names",
]

NOT_SAVED = {"saved": False}
"""``field(metadata=NOT_SAVED)``: an option ``state_dict()`` leaves out, because what it set up is saved
instead (PowerSGD's ``random_seed``: the generator's state)."""


def saved_option_names(options_class: type) -> tuple[str, ...]:
    """The option fields ``state_dict()`` holds, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(options_class) if f.metadata.get("saved", True))


_CONVERTIBLE = (bool, int, float, str)


def conversion_type(options_class: type, name: str) -> type | None:
    """What a string value of option ``name`` is converted to: its annotation when that is ``bool``, ``int``,
    ``float`` or ``str`` (or one of them or ``None``); ``None`` (passed as given) for anything else."""
    hint = typing.get_type_hints(options_class)[name]
    if typing.get_origin(hint) in (Union, types.UnionType):
        others = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = others[0] if len(others) == 1 else None
    return hint if hint in _CONVERTIBLE else None


def _whole(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: {name} must be an integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class PowerSGDOptions:
    """Options of :class:`~gradcomm.hooks.powerSGD_hook.PowerSGDState`, in torch's order and with its defaults
    (described there). Checked here, before any rank trains: the registry and ``gradcomm bench`` build a state
    without a process group to refuse bad values up front."""

    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 1_000
    min_compression_rate: float = 2
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0
    random_seed: int = dataclasses.field(default=0, metadata=NOT_SAVED)
    compression_stats_logging_frequency: int = 10_000
    batch_tensors_with_same_shape: bool = False

    def __post_init__(self) -> None:
        owner = "PowerSGDState"
        for name in ("matrix_approximation_rank", "start_powerSGD_iter", "random_seed",
                     "compression_stats_logging_frequency"):
            _whole(owner, name, getattr(self, name))
        if self.matrix_approximation_rank < 1:
            raise ValueError(f"{owner}: matrix_approximation_rank must be at least 1, got {self.matrix_approximation_rank}")
        if self.start_powerSGD_iter < 0:
            raise ValueError(f"{owner}: start_powerSGD_iter must be at least 0, got {self.start_powerSGD_iter}")
        if not self.min_compression_rate >= 0:
            raise ValueError(
                f"{owner}: min_compression_rate must be a number >= 0 (0: compress every matrix), got "
                f"{self.min_compression_rate!r}"
            )
        if not 0 <= self.orthogonalization_epsilon < math.inf:
            raise ValueError(
                f"{owner}: orthogonalization_epsilon must be a finite number >= 0, got {self.orthogonalization_epsilon!r}"
            )
        if not 0 <= self.random_seed < 2**32:
            raise ValueError(f"{owner}: random_seed must be in 0..2**32-1 (NumPy's range), got {self.random_seed}")
        if self.compression_stats_logging_frequency < 0:
            raise ValueError(
                f"{owner}: compression_stats_logging_frequency must be >= 0 (0 and 1 both log every "
                f"iteration), got {self.compression_stats_logging_frequency}"
            )
        if (self.use_error_feedback or self.warm_start) and self.start_powerSGD_iter <= 1:
            raise ValueError(
                "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
                "because PowerSGD can only be applied after the first two iterations in DDP "
                f"(got start_powerSGD_iter={self.start_powerSGD_iter}): DDP rebuilds its buckets after the first "
                "iteration, which would invalidate per-bucket error-feedback and warm-start buffers."
            )


@dataclasses.dataclass(frozen=True)
class PostLocalSGDOptions:
    """Options of :class:`~gradcomm.hooks.post_localSGD_hook.PostLocalSGDState` (its groups are runtime)."""

    start_localSGD_iter: int
    post_local_gradient_allreduce: bool = True

    def __post_init__(self) -> None:
        _whole("PostLocalSGDState", "start_localSGD_iter", self.start_localSGD_iter)
        if self.start_localSGD_iter < 0:
            raise ValueError(f"PostLocalSGDState: start_localSGD_iter must be >= 0, got {self.start_localSGD_iter}")


@dataclasses.dataclass(frozen=True)
class HierarchicalOptions:
    """Options of :class:`~gradcomm.hooks.hierarchical_hook.HierarchicalState` (the inner hook and its state
    are objects, given beside them)."""

    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.ranks_per_node is not None:
            _whole("HierarchicalState", "ranks_per_node", self.ranks_per_node)
            if self.ranks_per_node < 1:
                raise ValueError(f"HierarchicalState: ranks_per_node must be at least 1, got {self.ranks_per_node}")


DEFAULT_CANDIDATES = "fp16_compress+allreduce+powersgd:matrix_approximation_rank=4,start_powerSGD_iter=2"
"""``auto``'s default candidates: exact or nearly exact averaging in the run's first steps, which are the most
sensitive to compression; PowerSGD compresses from the run's third step (``start_powerSGD_iter=2``), its first
trial step."""


@dataclasses.dataclass(frozen=True)
class AutoOptions:
    """Options of :class:`~gradcomm.hooks.auto_hook.AutoHookState` (described there). The candidates are
    parsed and checked by the state, through the registry."""

    candidates: str | Sequence[str] = DEFAULT_CANDIDATES
    error_bound: float = 0.1
    trial_steps: int = 3
    remeasure_every: int = 100
    tie_tolerance: float = 0.05

    def __post_init__(self) -> None:
        owner = "AutoHookState"
        if not (isinstance(self.error_bound, (int, float)) and 0 < self.error_bound < math.inf):
            raise ValueError(f"{owner}: option 'error_bound' must be a number > 0, got {self.error_bound!r}")
        for option, least in (("trial_steps", 1), ("remeasure_every", 0)):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{owner}: option {option!r} must be an integer >= {least}, got {value!r}")
        if not (isinstance(self.tie_tolerance, (int, float)) and 0 <= self.tie_tolerance < math.inf):
            raise ValueError(f"{owner}: option 'tie_tolerance' must be a number >= 0, got {self.tie_tolerance!r}")
