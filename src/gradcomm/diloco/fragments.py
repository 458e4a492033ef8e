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


def _boundaries(sizes: Sequence[int], fragments: int) -> list[int]:
    """Start positions of ``fragments`` contiguous runs of ``sizes``: run ``f`` starts where the total before
    it comes nearest ``f / fragments`` of the whole, every run holding at least one item."""
    before = [0]
    for size in sizes:
        before.append(before[-1] + size)
    starts = [0]
    for f in range(1, fragments):
        target = before[-1] * f / fragments
        position = starts[-1] + 1
        while position < len(sizes) - (fragments - f) and before[position] < target:
            position += 1
        if position > starts[-1] + 1 and target - before[position - 1] < before[position] - target:
            position -= 1
        starts.append(position)
    return starts


def split_into_fragments(
    named_params: Sequence[tuple[str, torch.nn.Parameter]], fragments: int, sync_every: int
) -> list[Fragment]:
    """Split ``named_params`` into ``fragments`` contiguous groups balanced by element count, with the
    staggered offsets ``f * sync_every // fragments``.

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
