"""Streaming DiLoCo's fragments: contiguous groups of parameters synchronised at staggered inner steps.

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) splits the model into ``F`` fragments and syncs
fragment ``f`` every ``H`` inner steps, shifted by ``f * H // F`` steps, so that at any step at most about
``1/F`` of the model is exchanged: the peak bandwidth falls by ``F`` while each fragment still syncs every
``H`` steps. With ``F = 1`` this is plain DiLoCo (arXiv 2311.08105).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Fragment", "split_into_fragments"]


@dataclass(frozen=True)
class Fragment:
    """Fragment ``index``: its parameters (registration order) and the inner-step shift of its schedule."""

    index: int
    names: tuple[str, ...]
    params: tuple[torch.nn.Parameter, ...]
    offset: int
    sync_every: int

    def syncs_at(self, inner_step: int) -> bool:
        """Whether the outer exchange of this fragment is launched after inner step ``inner_step`` (1-based)."""
        return inner_step > 0 and (inner_step + self.offset) % self.sync_every == 0

    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def _runs_needed(sizes: Sequence[int], bound: int) -> int:
    """How many contiguous runs of at most ``bound`` (each item fitting) ``sizes`` needs, filled in order."""
    runs, total = 1, 0
    for size in sizes:
        if total + size > bound:
            runs, total = runs + 1, 0
        total += size
    return runs


def _smallest_peak(sizes: Sequence[int], fragments: int) -> int:
    """The least possible size of the largest of ``fragments`` contiguous runs of ``sizes`` (a bisection)."""
    low, high = max(sizes), sum(sizes)
    while low < high:
        middle = (low + high) // 2
        if _runs_needed(sizes, middle) <= fragments:
            high = middle
        else:
            low = middle + 1
    return low


def _boundaries(sizes: Sequence[int], fragments: int) -> list[int]:
    """Start positions of ``fragments`` contiguous runs of ``sizes``, each holding at least one item, whose
    largest total is the least possible (the peak bytes of one exchange); within that bound, run ``f`` ends
    where the total before the next comes nearest ``(f + 1) / fragments`` of the whole."""
    before = [0]
    for size in sizes:
        before.append(before[-1] + size)
    bound = _smallest_peak(sizes, fragments)
    starts = [0]
    for f in range(1, fragments):
        later = fragments - f  # runs after this cut
        last = starts[-1] + 1
        while last + 1 <= len(sizes) - later and before[last + 1] - before[starts[-1]] <= bound:
            last += 1
        low, high = starts[-1] + 1, last  # the rest must still fit in ``later`` runs: true from some cut on
        while low < high:
            middle = (low + high) // 2
            if _runs_needed(sizes[middle:], bound) <= later:
                high = middle
            else:
                low = middle + 1
        target = before[-1] * f / fragments
        starts.append(min(range(low, last + 1), key=lambda cut: abs(before[cut] - target)))
    return starts


def split_into_fragments(
    named_params: Sequence[tuple[str, torch.nn.Parameter]], fragments: int, sync_every: int
) -> list[Fragment]:
    """Split ``named_params`` into ``fragments`` contiguous groups whose largest has the fewest elements any
    split into whole parameters allows (Streaming DiLoCo's peak bandwidth), with the staggered offsets
    ``f * sync_every // fragments``.

    Raises:
        ValueError: fewer parameters than fragments, or ``fragments``/``sync_every`` below 1.
    """
    if sync_every < 1:
        raise ValueError(f"gradcomm.DiLoCo: sync_every must be at least 1, got {sync_every}")
    if fragments < 1:
        raise ValueError(f"gradcomm.DiLoCo: fragments must be at least 1, got {fragments}")
    if fragments > len(named_params):
        raise ValueError(
            f"gradcomm.DiLoCo: fragments={fragments}, but the model has only {len(named_params)} trainable "
            "parameters; a fragment holds whole parameters, so use at most that many fragments"
        )
    starts = [*_boundaries([p.numel() for _, p in named_params], fragments), len(named_params)]
    return [
        Fragment(
            index=f,
            names=tuple(name for name, _ in named_params[starts[f] : starts[f + 1]]),
            params=tuple(p for _, p in named_params[starts[f] : starts[f + 1]]),
            offset=f * sync_every // fragments,
            sync_every=sync_every,
        )
        for f in range(fragments)
    ]
