"""``auto``: a hook that measures the link and its candidate hooks on the real run, then uses the fastest one.

Which hook trains fastest depends on the link: at 100 Mbit/s PowerSGD's hundredfold compression wins, on an
unshaped loopback plain allreduce or fp16 does, because compression's own compute is no longer paid back.
:func:`auto_hook` decides on the run itself, in its first steps, and revisits the choice when the link changes::

    state = register_comm_hook_by_name(ddp, "auto")                           # the default candidates
    state = register_comm_hook_by_name(ddp, "auto", candidates="allreduce+powersgd:matrix_approximation_rank=4")
    gradcomm bench --hooks auto "auto:candidates=allreduce+fp16_compress,error_bound=0.3"

How it decides (steps are counted by the bucket for which ``is_last()`` holds; everything below happens at a
step boundary, before the step's first bucket is handed on, and identically on every rank):

1. *Link* (:mod:`gradcomm.hooks.link_model`). At the first step, and every ``remeasure_every`` steps, a
   few timed allreduces of 4 KiB, 64 KiB and 1 MiB, then one that takes about 30 ms at the bandwidth these
   suggest (1 to 16 MiB, so that a shaper's burst allowance does not pass for bandwidth), are fitted to
   ``latency + wire bytes / bandwidth`` (the fastest of two each, then the maximum over the ranks, so every
   rank has the same figures). On one rank there is no link: latency 0, bandwidth infinite.
2. *Trial.* Every training step of the trial is a real step with one candidate doing the averaging, in
   round-robin passes over the candidates (``trial_steps`` passes). Per candidate it records

   * the *step time*: the wall time from one step's first bucket to the next's, less auto's own measuring
     (the error pass; waiting for the step's collectives at its last bucket is the step's own time).
     This is everything the candidate costs (encoding, launching, decoding in callbacks, and contention with
     backward), which timing the hook call and callbacks alone would miss; its *compute* is the step time
     less the network time the link model predicts for it, so the model reproduces the measured time on the
     trial's link and extrapolates to another (where the network explains the whole step time, as for
     allreduce on a slow link, the least compute measured among the candidates is used);
   * *bytes on the wire* and *collective calls*: what it handed to :mod:`gradcomm.comm` during the step
     (wire bytes by :func:`gradcomm.comm.group_wire_bytes`, each collective at its group's size); hooks that
     bypass ``gradcomm.comm`` count 0;
   * its *error*: the relative error of its accumulated update, ``‖Σ(result − exact)‖ / ‖Σ exact‖`` over
     all its trial steps, where ``exact`` is the true average from a second, uncounted allreduce of a strided
     sample of each gradient (at most 1024 elements per parameter, so the pass costs little even on a slow
     link; an odd stride, so that every column of a matrix is visited). Each parameter's sums of squares are
     weighted by the number of its elements a sampled one stands for, so that the sample estimates the error
     of all elements (unweighted, a model's biases and norms, which compressed hooks send exactly, counted as
     much as its largest matrices: PowerSGD's per-step error on the transformer workload read 0.20 for 0.59).
     Summing over steps is what makes error-feedback methods (PowerSGD, EF top-k) comparable with the
     others: their per-step error is large, but what they leave out is sent in later steps, so the sum of
     their updates stays close to the sum of exact averages (the difference is the last residual). A biased
     method without error feedback keeps its error in the sum and is excluded.

   After the first pass, candidates whose network time alone exceeds 1.5 times the fastest candidate's
   measured step time get no further trial steps (at 100 Mbit/s allreduce costs one step, not three).
3. *Choice.* The figures are all-reduced (maximum over the ranks). Among candidates with ``error <=
   error_bound``, the lowest predicted step time ``compute + calls x latency + wire bytes / bandwidth`` wins;
   candidates within ``tie_tolerance`` of it count as tied, and the most accurate of the tied wins (a
   compressed hook must be clearly faster to be worth its slower convergence); at a re-measurement the
   current choice is kept while it is among the tied (a switch drops state, see below). If no candidate is
   within the bound, the most accurate one is used (logged as a warning). Every decision is logged through
   :mod:`logging` with the link and each candidate's figures, and shows in the DDP's ``comm_stats()``
   (``hook_details``).
4. *Re-measuring.* Every ``remeasure_every`` steps the link is measured again and the choice recomputed from
   the new link and the trial's compute, bytes and error, so a link that degrades or recovers changes it.

Consistency: all ranks decide from the same all-reduced figures with the same arithmetic, so they switch at
the same step to the same candidate; every candidate averages identically on every rank, so replicas stay
identical across switches. A candidate's state (PowerSGD's error feedback and warm start, a compression
method's residuals) is kept while the trial runs and while it stays chosen, and dropped when a different
candidate is chosen after the trial: a residual owed from a phase of training long past would be applied
out of context, and dropping one costs at most one step's compression error, as PowerSGD's own start does.
A candidate's step counter (PowerSGD's ``iter``) is set to the run's step on activation, so
``start_powerSGD_iter`` counts the run's steps. Candidates that do not average (``noop``, ``post_localsgd``)
and ``auto`` itself are refused.

Trade-offs: the trial steps run the slower candidates for real (mostly one step each on a slow link), the
error pass costs a sampled allreduce per trial step, and each link measurement about 2.2 MB of allreduces
(about 0.15 s at 100 Mbit/s). Compute and bytes are kept from the trial; a model whose cost changes later is
not re-tried. Bytes are read from this process's :data:`gradcomm.comm.traffic` during the trial steps, so a
second DDP training at the same moment in the same process would be mixed in. The link is measured with
allreduces only; hooks built on all-gather are predicted with the same latency and bandwidth.

Checkpoints: :meth:`AutoHookState.state_dict` holds the choice, the figures, the link and the chosen
candidate's own state (all plain values, ``weights_only``-loadable), so a resumed run continues with the
same candidate and no new trial. A checkpoint taken during the trial restarts the trial.
"""

# No ``from __future__ import annotations``: torch's DDP compares the hook's annotations with real types.

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm import comm
from gradcomm.hooks import registry
from gradcomm.hooks.hook_state import HookState
from gradcomm.hooks.link_model import Link, agree_max, measure_link

__all__ = ["DEFAULT_CANDIDATES", "AutoHookState", "CandidateFigures", "Link", "auto_hook"]

logger = logging.getLogger(__name__)

DEFAULT_CANDIDATES = "fp16_compress+allreduce+powersgd:matrix_approximation_rank=4,start_powerSGD_iter=2"
"""Exact or nearly exact averaging in the run's first steps, which are the most sensitive to compression;
PowerSGD compresses from the run's third step (``start_powerSGD_iter=2``), its first trial step."""

_SAMPLE_PER_PARAMETER = 1024
_CUT_FACTOR = 1.5
_REFUSED = {"auto": "auto cannot be its own candidate", "noop": "noop does not average gradients",
            "post_localsgd": "post_localsgd leaves the replicas different on purpose"}
_KEPT_DECISIONS = 20
_FORMAT = 1


@dataclass
class _ErrorSums:
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
class _Candidate:
    text: str
    name: str
    options: dict[str, Any]


def _refusal(message: str) -> ValueError:
    return ValueError(f"AutoHookState: option 'candidates': {message}")


def _parse_candidates(candidates: str | Sequence[str]) -> list[_Candidate]:
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
    parsed: list[_Candidate] = []
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
        parsed.append(_Candidate(text, canonical, checked))
    return parsed


class AutoHookState(HookState):
    """State of :func:`auto_hook`: the candidates, what the trial measured, the link and the current choice.

    Args:
        process_group: the group to average over (``None``: the default group).
        candidates: the hooks to choose from, as registry hook choices: a string joining them with ``+``
            (``"allreduce+powersgd:matrix_approximation_rank=4,start_powerSGD_iter=2"``; option values
            therefore cannot contain ``+``: write ``1e3``, not ``1e+3``) or a list of such choices. On a
            command line, where ``,`` separates auto's own options, separate a candidate's options with ``;``
            (``auto:candidates=allreduce+powersgd:matrix_approximation_rank=4;start_powerSGD_iter=2``). A
            candidate's warm-up (``start_powerSGD_iter``, counted in the run's steps) should end before its
            first trial step (at step ``position in the list``), or the trial measures the warm-up.
        error_bound: largest accepted relative error of a candidate's accumulated update over its trial
            steps (module docstring). Measured on ``gradcomm bench``'s transformer: fp16 3e-4, PowerSGD rank
            4 0.03-0.05 (it ends 0.07 above allreduce's loss after 150 steps), rank 1 0.12 (0.17 above),
            top-k 1% with error feedback 0.28, QSGD 0.38, majority-vote signSGD 68 (its magnitude is not
            the gradient's). The default 0.1 admits the first two and excludes the others.
        trial_steps: round-robin passes of the trial; a candidate gets at most this many trial steps.
        remeasure_every: steps between link measurements (and re-decisions); 0 measures the link only once.
        tie_tolerance: predicted step times within this fraction of the fastest count as tied; the most
            accurate of the tied candidates wins.
    """

    def __init__(
        self,
        process_group: ProcessGroup | None = None,
        candidates: str | Sequence[str] = DEFAULT_CANDIDATES,
        error_bound: float = 0.1,
        trial_steps: int = 3,
        remeasure_every: int = 100,
        tie_tolerance: float = 0.05,
    ) -> None:
        if not (isinstance(error_bound, (int, float)) and 0 < error_bound < math.inf):
            raise ValueError(f"AutoHookState: option 'error_bound' must be a number > 0, got {error_bound!r}")
        for option, value, least in (("trial_steps", trial_steps, 1), ("remeasure_every", remeasure_every, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"AutoHookState: option {option!r} must be an integer >= {least}, got {value!r}")
        if not (isinstance(tie_tolerance, (int, float)) and 0 <= tie_tolerance < math.inf):
            raise ValueError(f"AutoHookState: option 'tie_tolerance' must be a number >= 0, got {tie_tolerance!r}")
        self._candidates = _parse_candidates(candidates)
        self.process_group = process_group
        self.candidates = "+".join(c.text for c in self._candidates)
        self.error_bound = float(error_bound)
        self.trial_steps = trial_steps
        self.remeasure_every = remeasure_every
        self.tie_tolerance = float(tie_tolerance)
        self._restart_trial()
        self.step = 0
        self.link: Link | None = None
        self.decisions: list[dict[str, Any]] = []

    def _restart_trial(self) -> None:
        self.trialing = True
        self.active = 0
        self._figures = [CandidateFigures() for _ in self._candidates]
        self._schedule = list(range(len(self._candidates)))
        self._passes = 0
        self._hooks: list[Callable[..., Any] | None] = [None] * len(self._candidates)
        self._states: list[Any] = [None] * len(self._candidates)
        self._errors: list[dict[int, _ErrorSums]] = [{} for _ in self._candidates]
        self._link_at_trial: Link | None = None
        self._open = False
        self._window: tuple[int, float] | None = None
        self._overhead = 0.0
        self._traffic_before: tuple[dict[tuple[str, int], int], int] = ({}, 0)
        self._pending: list[tuple[list[int], list[int], list[torch.Tensor], list[int], torch.futures.Future]] = []

    def measure_link(self) -> Link:
        """Measure the link (a collective); replaceable on an instance (``state.measure_link = ...``), e.g. by
        a test that simulates a slower link. A method, not a closure over the state: the state then holds no
        reference to itself, and is freed (with its process group) as soon as it is dropped."""
        return measure_link(self.process_group)

    def comm_hook_fingerprint(self) -> str:
        """What must agree across ranks: the options (the measurements differ by rank until agreed)."""
        return (
            f"candidates={self.candidates}, error_bound={self.error_bound}, trial_steps={self.trial_steps}, "
            f"remeasure_every={self.remeasure_every}, tie_tolerance={self.tie_tolerance}"
        )

    @property
    def choice(self) -> str:
        """The candidate averaging now (during the trial, the one on trial)."""
        return self._candidates[self.active].text

    # -- the candidates --------------------------------------------------------------------------------------
    def _activate(self, index: int, fresh: bool) -> None:
        if fresh or self._hooks[index] is None:
            candidate = self._candidates[index]
            self._hooks[index], self._states[index] = registry.make_comm_hook(
                candidate.name, process_group=self.process_group, **candidate.options
            )
        state = self._states[index]
        if isinstance(getattr(state, "iter", None), int):
            state.iter = max(state.iter, self.step)
        self.active = index

    # -- step boundaries -------------------------------------------------------------------------------------
    def _begin_step(self) -> None:
        """At the first bucket of a step: close the last step's window, then measure, decide, switch."""
        now = time.perf_counter()
        if self.trialing and self._window is not None:
            index, start = self._window
            self._figures[index].step_seconds.append(now - start - self._overhead)
        self._window, self._overhead, self._open = None, 0.0, True
        if self.link is None:
            self.link = self.measure_link()
        elif not self.trialing and self.remeasure_every and self.step % self.remeasure_every == 0:
            self.link = self.measure_link()
            self._decide(f"link re-measured at step {self.step}", ending_trial=False)
        if self.trialing:
            self._advance_trial()
        if self.trialing:
            self._window = (self.active, time.perf_counter())
            self._traffic_before = (comm.traffic.snapshot_by_group(), comm.traffic.total_calls)

    def _advance_trial(self) -> None:
        if not self._schedule:
            self._end_pass()
        if self._schedule:
            index = self._schedule.pop(0)
            self._activate(index, fresh=False)
            return
        self.trialing = False
        self._decide(f"trial ended at step {self.step}", ending_trial=True)

    def _end_pass(self) -> None:
        """Agree on the figures measured so far; after the first pass, stop trying hopeless candidates."""
        self._passes += 1
        if self._link_at_trial is None:
            self._link_at_trial = self.link
        link = self._link_at_trial
        assert link is not None
        count = len(self._figures)
        local: list[float] = []
        for index, figures in enumerate(self._figures):
            times = figures.step_seconds[1:] or figures.step_seconds
            local += [min(times) if times else 0.0, figures.calls, figures.wire_bytes, self._error_of(index)]
        agreed = agree_max(local, self.process_group)
        unexplained = []
        for k, figures in enumerate(self._figures):
            seconds, figures.calls, figures.wire_bytes, figures.error = agreed[4 * k : 4 * k + 4]
            unexplained.append(seconds - link.seconds(figures.calls, figures.wire_bytes))
        # where the network explains a whole step (a slow link, overlapping backward), compute cannot be read
        # off: forward, backward and optimizer are the same for every candidate, so the least measured is used
        floor = min((u for u in unexplained if u > 0), default=0.0)
        for figures, compute in zip(self._figures, unexplained, strict=True):
            figures.compute = max(compute, floor)
        if self._passes == 1 and count > 1:
            fastest = min(agreed[4 * k] for k in range(count))
            for figures in self._figures:
                figures.cut = link.seconds(figures.calls, figures.wire_bytes) > _CUT_FACTOR * fastest
        if self._passes < self.trial_steps:
            self._schedule = [k for k, figures in enumerate(self._figures) if not figures.cut]

    def _error_of(self, index: int) -> float:
        sums = self._errors[index]
        if not sums:
            return 0.0
        difference = sum(s.weight * float(s.difference.pow(2).sum()) for s in sums.values())
        exact = sum(s.weight * float(s.exact.pow(2).sum()) for s in sums.values())
        return math.sqrt(difference / exact) if exact > 0 else math.sqrt(difference)

    def _decide(self, reason: str, ending_trial: bool) -> None:
        """Choose the candidate with the lowest predicted step time within the error bound; switch to it.

        At the end of the trial the chosen candidate keeps its state from the trial; a later switch starts
        the newly chosen one afresh.
        """
        assert self.link is not None
        link = self.link
        figures = self._figures
        predicted = [f.predicted(link) for f in figures]
        eligible = [k for k, f in enumerate(figures) if f.error is not None and f.error <= self.error_bound]
        if eligible:
            fastest = min(predicted[k] for k in eligible)
            tied = [k for k in eligible if predicted[k] <= fastest * (1 + self.tie_tolerance)]
            if not ending_trial and self.active in tied:
                choice = self.active  # a switch drops state: not for a gain within the tolerance
            else:
                choice = min(tied, key=lambda k: (figures[k].error, predicted[k], k))
        else:
            choice = min(range(len(figures)), key=lambda k: (figures[k].error or 0.0, predicted[k], k))
            logger.warning(
                "auto hook: no candidate within error_bound %g; using the most accurate, %s",
                self.error_bound,
                self._candidates[choice].text,
            )
        switched = choice != self.active
        if switched or ending_trial:
            for k in range(len(self._states)):
                if k != choice:
                    self._hooks[k], self._states[k] = None, None
            self._errors = [{} for _ in self._candidates]
            self._activate(choice, fresh=not ending_trial)
        decision = {
            "step": self.step,
            "reason": reason,
            "choice": self._candidates[choice].text,
            "switched": switched,
            "link": {"latency_ms": 1e3 * link.latency, "bandwidth_mbit": 8 * link.bandwidth / 1e6},
            "candidates": [
                {
                    "candidate": c.text,
                    "compute_ms": 1e3 * (f.compute or 0.0),
                    "calls": f.calls,
                    "wire_bytes": f.wire_bytes,
                    "error": f.error,
                    "predicted_ms": 1e3 * predicted[k],
                    "eligible": k in eligible,
                }
                for k, (c, f) in enumerate(zip(self._candidates, figures, strict=True))
            ],
        }
        self.decisions = [*self.decisions, decision][-_KEPT_DECISIONS:]
        logger.info(
            "auto hook, %s: %s; %s -> %s",
            reason,
            link.describe(),
            "; ".join(
                f"{row['candidate']}: compute {row['compute_ms']:.1f} ms, {row['calls']:.0f} calls, "
                f"{row['wire_bytes'] / 1e6:.3f} MB on the wire, error {row['error']:.3g}, "
                f"predicted {row['predicted_ms']:.1f} ms{'' if row['eligible'] else ' (over the error bound)'}"
                for row in decision["candidates"]
            ),
            decision["choice"],
        )

    # -- the error pass ---------------------------------------------------------------------------------------
    def _sample(self, bucket: dist.GradBucket) -> tuple[list[int], list[int], list[torch.Tensor], list[int]]:
        """A strided sample of each gradient of ``bucket``, with its parameter's key, size and stride."""
        keys, numels, samples, strides = [], [], [], []
        for parameter, gradient in zip(bucket.parameters(), bucket.gradients(), strict=True):
            flat = gradient.reshape(-1)
            stride = max(1, -(-flat.numel() // _SAMPLE_PER_PARAMETER)) | 1  # odd: every column of a matrix
            keys.append(id(parameter))
            numels.append(flat.numel())
            samples.append(flat[::stride].detach().clone())
            strides.append(stride)
        return keys, numels, samples, strides

    def _end_step(self) -> None:
        """At the last bucket of a trial step: wait for the step's futures, count its traffic, measure error.

        The wait is the step's own (the DDP waits for every bucket at the end of backward anyway) and stays in
        its measured time; only the error pass after it is auto's overhead.
        """
        pending, self._pending = self._pending, []
        results = []
        for *_, future in pending:
            value = future.wait()
            results.append(value[0] if isinstance(value, list) else value)
        start = time.perf_counter()
        before, calls_before = self._traffic_before
        after = comm.traffic.snapshot_by_group()
        sent = {key: n - before.get(key, 0) for key, n in after.items()}
        figures = self._figures[self.active]
        figures.calls = comm.traffic.total_calls - calls_before
        figures.wire_bytes = comm.group_wire_bytes(sent)
        if pending:
            inputs = torch.cat([s.reshape(-1).float() for _, _, samples, _, _ in pending for s in samples])
            dist.all_reduce(inputs, group=self.process_group)  # not through gradcomm.comm: not hook traffic
            inputs = inputs.double() / comm.group_size(self.process_group)
            sums = self._errors[self.active]
            offset = 0
            for (keys, numels, samples, strides, _), result in zip(pending, results, strict=True):
                flat = result.reshape(-1)
                position = 0
                for key, numel, sample, stride in zip(keys, numels, samples, strides, strict=True):
                    exact = inputs[offset : offset + sample.numel()]
                    got = flat[position : position + numel][::stride].double()
                    difference = got - exact
                    if key in sums:
                        sums[key].difference += difference
                        sums[key].exact += exact
                    else:
                        # an empty parameter's sample is empty too: weight 0, it has nothing to count
                        sums[key] = _ErrorSums(difference.clone(), exact.clone(), numel / max(sample.numel(), 1))
                    offset += sample.numel()
                    position += numel
        self._overhead += time.perf_counter() - start

    # -- reporting ----------------------------------------------------------------------------------------------
    def comm_stats_details(self) -> dict[str, Any]:
        """What ``comm_stats().hook_details`` shows: the phase, the choice, the link and the last decision."""
        return {
            "phase": "trial" if self.trialing else "chosen",
            "choice": self.choice,
            "step": self.step,
            "link": None if self.link is None else asdict(self.link),
            "decisions": len(self.decisions),
            "last_decision": self.decisions[-1] if self.decisions else None,
        }

    # -- checkpointing ------------------------------------------------------------------------------------------
    def _plain_state(self) -> dict[str, Any]:
        state = self._states[self.active]
        own = state.state_dict() if not self.trialing and callable(getattr(state, "state_dict", None)) else None
        return {
            "format": _FORMAT,
            "candidates": self.candidates,
            "step": self.step,
            "trialing": self.trialing,
            "active": self.active,
            "figures": [asdict(f) for f in self._figures],
            "link": None if self.link is None else [self.link.latency, self.link.bandwidth],
            "decisions": list(self.decisions),
            "active_state": own,
        }

    def _restore_plain_state(self, state: dict[str, Any]) -> None:
        if state.get("format") != _FORMAT or state.get("candidates") != self.candidates:
            raise ValueError(
                f"AutoHookState: this checkpoint was written with candidates {state.get('candidates')!r}, but "
                f"this state has {self.candidates!r}; build the state with the same 'candidates' option"
            )
        self._restart_trial()
        self.step = state["step"]
        self.link = None if state["link"] is None else Link(*state["link"])
        self.decisions = list(state["decisions"])
        if state["trialing"]:
            return  # the error sums are not saved: the trial starts again
        self.trialing = False
        self._figures = [CandidateFigures(**f) for f in state["figures"]]
        self._activate(state["active"], fresh=True)
        if state["active_state"] is not None:
            self._states[self.active].load_state_dict(state["active_state"])

    def __getstate__(self) -> dict[str, Any]:
        options = {k: getattr(self, k) for k in ("candidates", "error_bound", "trial_steps", "remeasure_every",
                                                 "tie_tolerance")}
        return {"options": options, "state": self.state_dict()}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self.__init__(None, **saved["options"])  # type: ignore[misc]
        self.load_state_dict(saved["state"])


def auto_hook(state: AutoHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` with the candidate hook ``state`` has chosen, measuring and choosing as it goes.

    At the first bucket of a step it may measure the link (blocking collectives on ``state.process_group``,
    which is idle then) and decide or switch; during the trial it also samples the bucket for the error pass,
    and at the last bucket waits for the step's futures and runs that pass. See the module docstring for the
    algorithm and :class:`AutoHookState` for the options.

    Example::

        >>> state = AutoHookState(candidates="allreduce+powersgd:matrix_approximation_rank=4,start_powerSGD_iter=2")
        >>> ddp_model.register_comm_hook(state, auto_hook)
    """
    if not state._open:
        state._begin_step()
    hook, candidate_state = state._hooks[state.active], state._states[state.active]
    assert hook is not None
    if state.trialing:
        sample = state._sample(bucket)  # before the candidate runs: it may average the bucket in place
        future = hook(candidate_state, bucket)
        state._pending.append((*sample, future))
    else:
        future = hook(candidate_state, bucket)
    if bucket.is_last():
        if state.trialing:
            state._end_step()
        state.step += 1
        state._open = False
    return future
