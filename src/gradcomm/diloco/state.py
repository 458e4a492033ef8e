"""DiLoCo's compressor choice, the description of its outer optimizer, and restoring a saved state."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ProcessGroup

from gradcomm.diloco.exchange import PendingExchange
from gradcomm.diloco.fragments import split_into_fragments
from gradcomm.hooks.registry import make_comm_hook, parse_hook_choice

if TYPE_CHECKING:
    from gradcomm.diloco.core import DiLoCo

__all__ = ["FORMAT", "WHOLE_PARAMETER_FORMAT", "Compressor", "compressor_hook", "describe_outer", "load_diloco_state"]

FORMAT = "gradcomm.diloco/2"
"""Since fragments may cut parameters: the state records each fragment's parts (``"layout"``)."""
WHOLE_PARAMETER_FORMAT = "gradcomm.diloco/1"
"""Written before fragments could cut parameters: every fragment held whole parameters, split as
``fragment_unit="parameter"`` splits them."""

Pair = tuple[Any, Callable[..., Any]]
Compressor = str | Pair | Callable[[], Pair] | None


def compressor_hook(
    compressor: Compressor, group: ProcessGroup | None
) -> tuple[Callable[..., Any] | None, Any]:
    """``(hook, state)`` for DiLoCo's ``compressor=``: none, a registry name with options
    (``"topk:ratio=0.01"``, built on ``group``), a callable returning a ``(state, hook)`` pair, or a pair."""
    if compressor is None:
        return None, None
    if isinstance(compressor, str):
        name, options = parse_hook_choice(compressor)
        return make_comm_hook(name, process_group=group, **options)
    if callable(compressor):
        compressor = compressor()
    if isinstance(compressor, tuple) and len(compressor) == 2 and callable(compressor[1]):
        state, hook = compressor
        return hook, state
    raise TypeError(
        "gradcomm.DiLoCo: compressor must be None, a hook name such as 'topk:ratio=0.01', a (state, hook) pair "
        f"or a callable returning one; got {type(compressor).__name__}"
    )


def describe_outer(outer_optimizer: Callable[..., Any] | None) -> str:
    """The outer optimizer factory as text the ranks compare (``default SGD`` when none is given)."""
    if outer_optimizer is None:
        return "default SGD"
    return f"{getattr(outer_optimizer, '__module__', '?')}.{getattr(outer_optimizer, '__qualname__', type(outer_optimizer).__name__)}"


def _refuse(what: str) -> ValueError:
    return ValueError(
        f"gradcomm.DiLoCo.load_state_dict: {what}; build the DiLoCo as in the run that saved it"
    )


def _check_layout(diloco: DiLoCo, saved: dict[str, Any]) -> None:
    """Refuse a state whose fragments hold other parts of the parameters than ``diloco``'s. A state of
    :data:`WHOLE_PARAMETER_FORMAT` holds none: its fragments were the ``"parameter"`` split of the model."""
    mine = [fragment.layout() for fragment in diloco.fragments]
    if saved["format"] == WHOLE_PARAMETER_FORMAT:
        whole = split_into_fragments(diloco._named, len(diloco.fragments), diloco.sync_every, "parameter")
        if [fragment.layout() for fragment in whole] != mine:
            raise _refuse(
                f"it was written before fragments could cut parameters (format {WHOLE_PARAMETER_FORMAT!r}): its "
                "fragments hold whole parameters, as fragment_unit='parameter' splits them, and this DiLoCo's "
                f"fragment_unit={diloco.fragment_unit!r} splits the model otherwise"
            )
        return
    theirs = [[tuple(part) for part in fragment] for fragment in saved["layout"]]
    for index, (a, b) in enumerate(zip(theirs, mine, strict=True)):
        if a != b:
            raise _refuse(
                f"its fragment {index} holds {_describe(a)}, this DiLoCo's (fragment_unit="
                f"{diloco.fragment_unit!r}) holds {_describe(b)}"
            )


def _describe(layout: list[tuple[str, int, int]], limit: int = 4) -> str:
    shown = ", ".join(f"{name}[{start}:{stop}]" for name, start, stop in layout[:limit])
    return f"[{shown}{', ...' if len(layout) > limit else ''}]"


def load_diloco_state(diloco: DiLoCo, saved: dict[str, Any]) -> None:
    """Restore ``saved`` (from :meth:`DiLoCo.state_dict`) into ``diloco``, refusing another setup or model."""
    if saved.get("format") not in (FORMAT, WHOLE_PARAMETER_FORMAT):
        raise _refuse(
            f"the state's format is {saved.get('format')!r}, expected {FORMAT!r} (or {WHOLE_PARAMETER_FORMAT!r})"
        )
    mine = {"sync_every": diloco.sync_every, "fragments": len(diloco.fragments), "overlap": diloco.overlap}
    if saved["setup"] != mine:
        raise _refuse(f"it was saved with {saved['setup']}, this DiLoCo has {mine}")
    anchors = diloco._full_anchors
    if set(saved["anchors"]) != set(anchors):
        raise _refuse(f"its parameters {sorted(saved['anchors'])} are not this model's {sorted(anchors)}")
    for name, anchor in anchors.items():
        if saved["anchors"][name].shape != anchor.shape:
            raise _refuse(
                f"parameter {name!r} has shape {tuple(saved['anchors'][name].shape)}, here {tuple(anchor.shape)}"
            )
    _check_layout(diloco, saved)
    states = diloco._runners.states()
    saved_states = saved["compressor"]
    for index, (state, entry) in enumerate(zip(states, saved_states, strict=True)):
        if (entry is not None) != callable(getattr(state, "load_state_dict", None)):
            raise _refuse(
                f"fragment {index}'s compressor state was saved {'with' if entry is not None else 'without'} a state, here it has {'none' if entry is not None else 'one'}"
            )
    with torch.no_grad():
        for name, anchor in anchors.items():
            anchor.copy_(saved["anchors"][name])
    if "buffers" in saved:
        diloco._synced_buffers = {name: b.clone() for name, b in saved["buffers"].items()}
    diloco.outer_optimizer.load_state_dict(saved["outer_optimizer"])
    for state, entry in zip(states, saved_states, strict=True):
        if entry is not None:
            state.load_state_dict(entry)
    diloco.inner_steps, diloco.synced_steps = int(saved["inner_steps"]), int(saved["synced_steps"])
    diloco._synced_at = [int(step) for step in saved["synced_at"]]
    diloco._pending = {}
    for entry in saved["pending"]:
        params = diloco.fragments[entry["fragment"]].params
        averaged = None  # saved by a rank that receives the average from its replica's first rank
        if entry["averaged"] is not None:
            averaged = [t.to(p.device) for t, p in zip(entry["averaged"], params, strict=True)]
        diloco._pending[entry["fragment"]] = PendingExchange(
            entry["fragment"], int(entry["launched_at"]), averaged=averaged, buffers=entry.get("buffers")
        )
