"""Streaming DiLoCo's fragments: contiguous ranges of the parameters synchronised at staggered inner steps.

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) splits the model into ``F`` fragments and syncs
fragment ``f`` every ``H`` inner steps, shifted by ``f * H // F`` steps, so that at any step at most about
``1/F`` of the model is exchanged: the peak bandwidth falls by ``F`` while each fragment still syncs every
``H`` steps. With ``F = 1`` this is plain DiLoCo (arXiv 2311.08105).

The parameters are laid end to end in registration order, each flattened, and cut in ``F`` ranges
(:data:`UNITS`):

* ``"row"`` (the default): at the row boundary nearest ``f * N / F`` (a row of a parameter is its
  ``numel / shape[0]`` elements; one element of a vector) that leaves every fragment at least one row, so
  every fragment holds ``N / F`` elements to within a row, and every part of a cut parameter is a tensor of
  whole rows, which any compressor (per tensor, per row or low rank) takes as it takes a smaller layer.
* ``"element"``: at element ``f * N // F`` exactly (fragments differ by at most one element); a part that
  is not whole rows is flat.
* ``"parameter"``: whole parameters only (the split before fragments could cut a parameter, and what
  checkpoints written then hold): the largest fragment as small as such a split allows, which on a model
  with one dominant tensor is far from ``N / F``.

A non-contiguous parameter (a ``channels_last`` convolution) is never cut.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["UNITS", "Fragment", "Part", "split_into_fragments"]

UNITS = ("row", "element", "parameter")
"""The ways :func:`split_into_fragments` may cut the parameters (see the module's documentation)."""


def _row_length(param: torch.Tensor) -> int:
    """Elements per row: where a ``"row"`` cut inside ``param`` may fall (all of it if it cannot be cut)."""
    if not param.is_contiguous():
        return max(param.numel(), 1)
    if param.dim() >= 2 and param.shape[0] > 0:
        return max(param.numel() // param.shape[0], 1)
    return 1


@dataclass(frozen=True, eq=False)
class Part:
    """Elements ``[start, stop)`` of parameter ``name`` (flattened in its own order) as one fragment holds them;
    the whole parameter where ``start == 0`` and ``stop == param.numel()``."""

    name: str
    param: torch.nn.Parameter
    start: int
    stop: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.param.numel()

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def key(self) -> str:
        """The part's name: the parameter's for a whole one, else ``name[start:stop]``. Compressor state
        (error-feedback residuals, random streams) is keyed by it, so a whole parameter keeps today's key and
        the parts of a split one have state of their own."""
        return self.name if self.whole else f"{self.name}[{self.start}:{self.stop}]"

    @property
    def shape(self) -> torch.Size:
        """The parameter's shape for a whole one; ``(rows, *shape[1:])`` for whole rows of a matrix (so that a
        compressor sees a smaller matrix with the same rows, as PowerSGD needs); else flat."""
        if self.whole:
            return self.param.shape
        row = _row_length(self.param)
        if self.param.dim() >= 2 and self.start % row == 0 and self.stop % row == 0:
            return torch.Size(((self.stop - self.start) // row, *self.param.shape[1:]))
        return torch.Size((self.numel,))

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of ``tensor`` (shaped as the parameter): a view, so that writing to it writes to ``tensor``."""
        if self.whole:
            return tensor
        return tensor.view(-1)[self.start : self.stop].view(self.shape)


@dataclass(frozen=True, eq=False)
class Fragment:
    """Fragment ``index``: its parts of parameters (registration order) and the inner-step shift of its
    schedule."""

    index: int
    parts: tuple[Part, ...]
    offset: int
    sync_every: int

    @property
    def names(self) -> tuple[str, ...]:
        """The keys of the parts (a whole parameter's name, or ``name[start:stop]``)."""
        return tuple(part.key for part in self.parts)

    @property
    def params(self) -> tuple[torch.nn.Parameter, ...]:
        """The parameter of each part (a split parameter is in more than one fragment)."""
        return tuple(part.param for part in self.parts)

    def syncs_at(self, inner_step: int) -> bool:
        """Whether the outer exchange of this fragment is launched after inner step ``inner_step`` (1-based)."""
        return inner_step > 0 and (inner_step + self.offset) % self.sync_every == 0

    def numel(self) -> int:
        return sum(part.numel for part in self.parts)

    def layout(self) -> list[tuple[str, int, int]]:
        """``(parameter name, start, stop)`` of each part: what a checkpoint records of the schedule."""
        return [(part.name, part.start, part.stop) for part in self.parts]


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


def _whole_parameters(
    named_params: Sequence[tuple[str, torch.nn.Parameter]], fragments: int
) -> list[tuple[Part, ...]]:
    """The ``"parameter"`` split: each fragment's whole parameters."""
    if fragments > len(named_params):
        raise ValueError(
            f"gradcomm.DiLoCo: fragments={fragments}, but the model has only {len(named_params)} trainable "
            "parameters; with fragment_unit='parameter' a fragment holds whole parameters, so use at most that "
            "many fragments (or fragment_unit='row', which cuts parameters)"
        )
    starts = [*_boundaries([p.numel() for _, p in named_params], fragments), len(named_params)]
    return [
        tuple(Part(name, p, 0, p.numel()) for name, p in named_params[starts[f] : starts[f + 1]])
        for f in range(fragments)
    ]


class _Boundaries:
    """Where a cut may fall in the parameters laid end to end: every row boundary (``by_rows``) or every
    element of each parameter (never inside a non-contiguous one), found without listing them."""

    def __init__(self, params: Sequence[torch.Tensor], by_rows: bool) -> None:
        self.starts, self.ends, self.steps = [], [], []
        offset = 0
        for param in params:
            if param.numel():
                self.starts.append(offset)
                self.ends.append(offset + param.numel())
                contiguous = param.is_contiguous()
                self.steps.append(_row_length(param) if by_rows or not contiguous else 1)
            offset += param.numel()
        self.total = offset

    def at_or_before(self, x: int) -> int:
        if x >= self.total:
            return self.total
        i = bisect.bisect_right(self.ends, x)
        return self.starts[i] + (x - self.starts[i]) // self.steps[i] * self.steps[i]

    def before(self, x: int) -> int:
        """The last boundary strictly before ``x`` (> 0)."""
        return self.at_or_before(x - 1)

    def after(self, x: int) -> int:
        """The first boundary strictly after ``x`` (< total)."""
        i = bisect.bisect_right(self.ends, x)
        return min(self.starts[i] + ((x - self.starts[i]) // self.steps[i] + 1) * self.steps[i], self.ends[i])


def _element_cuts(params: Sequence[torch.Tensor], fragments: int, by_rows: bool) -> list[int]:
    """Element positions of the cuts of the ``"row"`` (``by_rows``) or ``"element"`` split: each the boundary
    nearest ``f * N // F`` that leaves every fragment at least one row (or element)."""
    places = _Boundaries(params, by_rows)
    cuts: list[int] = []
    for f in range(1, fragments):
        low = places.after(cuts[-1] if cuts else 0) if places.total else 0
        high = places.total
        for _ in range(fragments - f):
            high = places.before(high) if high > 0 else 0
        if low > high or low >= places.total or high <= 0:
            unit = "row" if by_rows else "element"
            raise ValueError(
                f"gradcomm.DiLoCo: fragments={fragments} cannot each hold at least one {unit} of a model of "
                f"{places.total} trainable elements; use fewer fragments"
                + (" or fragment_unit='element'" if by_rows else "")
            )
        target = f * places.total // fragments
        down = places.at_or_before(target)
        up = places.after(down) if down < target else down
        nearest = up if target - down > up - target else down
        cuts.append(min(max(nearest, low), high))
    return cuts


def _parts(named_params: Sequence[tuple[str, torch.nn.Parameter]], low: int, high: int, last: bool) -> tuple[Part, ...]:
    """The parts of the parameters that lie in elements ``[low, high)`` (an empty parameter goes with the
    fragment where it starts; the ``last`` fragment also takes those at the very end)."""
    parts = []
    start = 0
    for name, param in named_params:
        stop = start + param.numel()
        if param.numel() == 0:
            if low <= start < high or (last and start == high):
                parts.append(Part(name, param, 0, 0))
        elif start < high and stop > low:
            parts.append(Part(name, param, max(low, start) - start, min(high, stop) - start))
        start = stop
    return tuple(parts)


def split_into_fragments(
    named_params: Sequence[tuple[str, torch.nn.Parameter]],
    fragments: int,
    sync_every: int,
    unit: str = "parameter",
) -> list[Fragment]:
    """Split ``named_params`` (laid end to end in their order) into ``fragments`` contiguous ranges, cut as
    ``unit`` says (:data:`UNITS`, see the module's documentation), with the staggered offsets
    ``f * sync_every // fragments``.

    Raises:
        ValueError: a fragment would be empty (more fragments than parameters for ``"parameter"``, than rows
            or elements otherwise), ``unit`` unknown, or ``fragments``/``sync_every`` below 1.
    """
    if sync_every < 1:
        raise ValueError(f"gradcomm.DiLoCo: sync_every must be at least 1, got {sync_every}")
    if fragments < 1:
        raise ValueError(f"gradcomm.DiLoCo: fragments must be at least 1, got {fragments}")
    if unit not in UNITS:
        raise ValueError(f"gradcomm.DiLoCo: fragment_unit must be one of {', '.join(map(repr, UNITS))}, got {unit!r}")
    if not named_params:
        raise ValueError("gradcomm.DiLoCo: the model has no trainable parameters")
    if unit == "parameter":
        parts = _whole_parameters(named_params, fragments)
    else:
        params = [p for _, p in named_params]
        edges = [0, *_element_cuts(params, fragments, by_rows=unit == "row"), sum(p.numel() for p in params)]
        parts = [_parts(named_params, edges[f], edges[f + 1], f == fragments - 1) for f in range(fragments)]
    return [
        Fragment(index=f, parts=parts[f], offset=f * sync_every // fragments, sync_every=sync_every)
        for f in range(fragments)
    ]
