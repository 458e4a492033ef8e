"""The parts of :mod:`gradcomm.hooks.auto_hook` that do not keep its state: its candidates, what the trial
measures of them (the error pass's arithmetic included) and the choice among them.

:class:`Candidate` is how ``auto`` runs a candidate hook: through its public methods only, so that the state
never reaches into a candidate's hook or state. The algorithm is described in :mod:`gradcomm.hooks.auto_hook`.
"""

# No ``from __future__ import annotations``: the dataclasses' annotations stay real types.

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm.hooks import registry
from gradcomm.hooks.link_model import Link

__all__ = ["Candidate", "CandidateFigures", "Choice", "ErrorSums", "PendingBucket", "choose", "error_of", "parse_candidates"]

_SAMPLE_PER_PARAMETER = 1024
_REFUSED = {"auto": "auto cannot be its own candidate", "noop": "noop does not average gradients",
            "post_localsgd": "post_localsgd leaves the replicas different on purpose"}


@dataclass
class ErrorSums:
    """One parameter's sampled ``Σ(result − exact)`` and ``Σ exact`` over a candidate's trial steps; each
    sampled element stands for ``weight`` elements of the parameter."""

    difference: torch.Tensor
    exact: torch.Tensor
    weight: float


@dataclass
class CandidateFigures:
    """What the trial measured for one candidate (agreed over the ranks once its pass is done)."""

    step_seconds: list[float] = field(default_factory=list)
    calls: float = 0.0
    wire_bytes: float = 0.0
    error: float | None = None
    compute: float | None = None
    cut: bool = False

    def predicted(self, link: Link) -> float:
        """Predicted step time on ``link``: compute plus the network time of its collectives."""
        return (self.compute or 0.0) + link.seconds(self.calls, self.wire_bytes)


@dataclass
class PendingBucket:
    """A trial step's bucket awaiting the error pass: a strided sample of each of its gradients taken before
    the candidate ran (its parameter's key, size and stride beside it), and the candidate's future."""

    keys: list[int]
    numels: list[int]
    samples: list[torch.Tensor]
    strides: list[int]
    future: Any = None  # torch.futures.Future of the candidate's result

    @classmethod
    def sample(cls, bucket: dist.GradBucket) -> "PendingBucket":
        """Sample ``bucket`` (before the candidate runs: it may average the bucket in place)."""
        pending = cls([], [], [], [])
        for parameter, gradient in zip(bucket.parameters(), bucket.gradients(), strict=True):
            flat = gradient.reshape(-1)
            stride = max(1, -(-flat.numel() // _SAMPLE_PER_PARAMETER)) | 1  # odd: every column of a matrix
            pending.keys.append(id(parameter))
            pending.numels.append(flat.numel())
            pending.samples.append(flat[::stride].detach().clone())
            pending.strides.append(stride)
        return pending

    def add_errors(self, sums: dict[int, ErrorSums], result: torch.Tensor, exact: torch.Tensor) -> None:
        """Add this bucket's ``result − exact`` and ``exact`` (the sampled true averages, in this bucket's order)
        to each parameter's ``sums``."""
        flat, position, offset = result.reshape(-1), 0, 0
        for key, numel, sample, stride in zip(self.keys, self.numels, self.samples, self.strides, strict=True):
            expected = exact[offset : offset + sample.numel()]
            difference = flat[position : position + numel][::stride].double() - expected
            if key in sums:
                sums[key].difference += difference
                sums[key].exact += expected
            else:
                # an empty parameter's sample is empty too: weight 0, it has nothing to count
                sums[key] = ErrorSums(difference.clone(), expected.clone(), numel / max(sample.numel(), 1))
            offset += sample.numel()
            position += numel


def error_of(sums: dict[int, ErrorSums]) -> float:
    """The relative error ``‖Σ(result − exact)‖ / ‖Σ exact‖`` the sampled sums estimate."""
    if not sums:
        return 0.0
    difference = sum(s.weight * float(s.difference.pow(2).sum()) for s in sums.values())
    exact = sum(s.weight * float(s.exact.pow(2).sum()) for s in sums.values())
    return math.sqrt(difference / exact) if exact > 0 else math.sqrt(difference)


@dataclass
class Candidate:
    """One candidate hook: its choice as given, its registry name and checked options, and, while it is
    built, its hook and state."""

    text: str
    name: str
    options: dict[str, Any]
    hook: Callable[..., Any] | None = field(default=None, repr=False)
    state: Any = field(default=None, repr=False)

    def start(self, process_group: ProcessGroup | None, step: int, fresh: bool) -> None:
        """Build the hook and its state (again, if ``fresh``); a step counter (PowerSGD's ``iter``) is moved on
        to the run's ``step``, so that its warm-up counts the run's steps."""
        if fresh or self.hook is None:
            self.hook, self.state = registry.make_comm_hook(self.name, process_group=process_group, **self.options)
        if isinstance(getattr(self.state, "iter", None), int):
            self.state.iter = max(self.state.iter, step)

    def stop(self) -> None:
        """Drop the hook's state (its residuals would be applied out of context later)."""
        self.hook, self.state = None, None

    def average(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Run the candidate hook on ``bucket``."""
        assert self.hook is not None, f"candidate {self.text} is not started"
        return self.hook(self.state, bucket)

    def state_dict(self) -> dict[str, Any] | None:
        """Its state's ``state_dict()``; ``None`` for a hook without one."""
        saver = getattr(self.state, "state_dict", None)
        return saver() if callable(saver) else None

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.state.load_state_dict(saved)


def _refusal(message: str) -> ValueError:
    return ValueError(f"AutoHookState: option 'candidates': {message}")


def parse_candidates(candidates: str | Sequence[str]) -> list[Candidate]:
    """The candidates of a ``candidates`` option, each checked by the registry; refuses hooks that do not
    average (and ``auto`` itself)."""
    if isinstance(candidates, str):
        texts = [part.strip() for part in candidates.split("+")]
    elif isinstance(candidates, Sequence):
        texts = [part.strip() if isinstance(part, str) else part for part in candidates]
    else:
        raise TypeError(
            f"AutoHookState: option 'candidates' must be a string such as 'allreduce+fp16_compress' or a list "
            f"of hook choices, got {type(candidates).__name__}"
        )
    if not texts or texts == [""]:
        raise _refusal("names no hook; give at least one, e.g. 'allreduce+fp16_compress'")
    parsed: list[Candidate] = []
    for text in texts:
        if not isinstance(text, str) or not text:
            raise _refusal(f"each candidate must be a non-empty hook choice 'name[:key=value,...]', got {text!r}")
        text = text.replace(";", ",")
        try:
            name, options = registry.parse_hook_choice(text)
            canonical = registry.resolve_hook_name(name).value.name
        except ValueError as exc:
            raise _refusal(str(exc)) from None
        if canonical in _REFUSED:
            raise _refusal(f"{text!r} is not allowed: {_REFUSED[canonical]}")
        try:
            checked = registry.check_options(canonical, **options)
        except (ValueError, TypeError) as exc:
            raise _refusal(f"{text!r}: {exc}") from None
        if any(c.text == text for c in parsed):
            raise _refusal(f"{text!r} is given twice")
        parsed.append(Candidate(text, canonical, checked))
    return parsed


@dataclass(frozen=True)
class Choice:
    """A decision: the chosen candidate's index, each candidate's predicted step time, the eligible ones."""

    index: int
    predicted: list[float]
    eligible: list[int]


def choose(
    figures: list[CandidateFigures], link: Link, error_bound: float, tie_tolerance: float, keep: int | None
) -> Choice:
    """The candidate with the lowest predicted step time on ``link`` among those within ``error_bound``; of
    those tied within ``tie_tolerance``, the most accurate, or ``keep`` (the current choice, at a
    re-measurement) if it is among them. With none within the bound, the most accurate (``eligible`` empty)."""
    predicted = [f.predicted(link) for f in figures]
    eligible = [k for k, f in enumerate(figures) if f.error is not None and f.error <= error_bound]
    if eligible:
        fastest = min(predicted[k] for k in eligible)
        tied = [k for k in eligible if predicted[k] <= fastest * (1 + tie_tolerance)]
        if keep in tied:
            return Choice(keep, predicted, eligible)  # a switch drops state: not for a gain within the tolerance
        return Choice(min(tied, key=lambda k: (figures[k].error, predicted[k], k)), predicted, eligible)
    index = min(range(len(figures)), key=lambda k: (figures[k].error or 0.0, predicted[k], k))
    return Choice(index, predicted, eligible)
