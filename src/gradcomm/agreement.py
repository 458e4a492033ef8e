"""Checking that all ranks set up the same communication: hook, hook options, bucket layout.

Ranks that register different hooks or options, or bucket differently, would pair unrelated collectives and
hang or silently corrupt. A fingerprint of the setup (plain strings) is exchanged once with one small
collective, and every rank raises the same :class:`RanksDisagreeError` naming what differs on which ranks.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .hook_contract import DEFAULT_HOOK_NAME, hook_name

__all__ = ["RanksDisagreeError", "check_same_on_all_ranks", "describe_hook", "describe_state", "hook_fingerprint"]


class RanksDisagreeError(ValueError):
    """Ranks registered different hooks, hook options or bucket layouts; raised on every rank alike."""



_SCALARS = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)
_MAX_SEQUENCE = 16


def describe_hook(hook: Callable[..., Any] | None, depth: int = 3) -> str:
    """``module.qualname`` of ``hook``, with ``functools.partial`` arguments and the plain values and
    callables a closure holds (so ``fp16_compress_wrapper(powerSGD_hook)`` names ``powerSGD_hook``), down to
    ``depth`` levels of wrapping."""
    if hook is None:
        return DEFAULT_HOOK_NAME
    bound: list[str] = []
    while isinstance(hook, functools.partial):
        bound += [_plain(a) or "?" for a in hook.args] + [f"{k}={_plain(v) or '?'}" for k, v in hook.keywords.items()]
        hook = hook.func
    module = getattr(hook, "__module__", None) or type(hook).__module__
    name = f"{module}.{hook_name(hook)}"
    closure = (getattr(hook, "__closure__", None) or ()) if depth > 0 else ()
    freevars = getattr(getattr(hook, "__code__", None), "co_freevars", ())
    for var, cell in zip(freevars, closure, strict=False):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if callable(value) and not isinstance(value, type):
            bound.append(f"{var}={describe_hook(value, depth - 1)}")
        elif _plain(value) is not None:
            bound.append(f"{var}={_plain(value)}")
    return f"{name}({', '.join(bound)})" if bound else name


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


def check_same_on_all_ranks(fingerprint: Mapping[str, str], group: Any, who: str) -> None:
    """Compare ``fingerprint`` (what must agree, as text) across the ranks of ``group``; a collective.

    Every rank of ``group`` must call it. One ``all_gather_object`` of the fingerprints; if they differ,
    every rank raises the same :class:`RanksDisagreeError`, naming each differing item and which ranks
    have which value.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, dict(fingerprint), group=group)
    global_ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    keys = list(dict.fromkeys(key for described in everyone for key in described))
    differences = []
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for rank, described in zip(global_ranks, everyone, strict=True):
            by_value.setdefault(described.get(key, "<not set>"), []).append(rank)
        if len(by_value) > 1:
            parts = "; ".join(f"{_ranks(ranks)}: {value}" for value, ranks in by_value.items())
            differences.append(f"  {key} differs: {parts}")
    if differences:
        raise RanksDisagreeError(
            f"{who}: the ranks disagree on how gradients are communicated, so their collectives would not "
            "match (a hang or silently wrong gradients):\n" + "\n".join(differences) + "\n"
            "Every rank must wrap the same model with the same DDP options and register the same hook with "
            "the same options."
        )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
