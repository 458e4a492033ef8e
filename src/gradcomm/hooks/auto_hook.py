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
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm import comm
from gradcomm.hooks.auto_trial import (
    Candidate,
    CandidateFigures,
    ErrorSums,
    PendingBucket,
    choose,
    error_of,
    parse_candidates,
)
from gradcomm.hooks.hook_state import HookState, options_text, takes_options
from gradcomm.hooks.link_model import Link, agree_max, measure_link
from gradcomm.hooks.options import DEFAULT_CANDIDATES, AutoOptions

__all__ = ["DEFAULT_CANDIDATES", "AutoHookState", "CandidateFigures", "Link", "auto_hook"]

logger = logging.getLogger(__name__)

_CUT_FACTOR = 1.5
_KEPT_DECISIONS = 20
_FORMAT = 1


@dataclass
class _StepRuntime:
    """What :class:`AutoHookState` keeps within a step, for this process only (rebuilt by ``reset_runtime``)."""

    open: bool = False  # a step has begun (its first bucket was seen) and not ended
    window: tuple[int, float] | None = None  # the candidate on trial this step, and when the step began
    overhead: float = 0.0  # auto's own measuring within the step, not counted in its time
    traffic_before: tuple[dict[tuple[str, int], int], int] = ({}, 0)
    pending: list[PendingBucket] = field(default_factory=list)  # the trial step's buckets, for the error pass


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

    The options are :class:`~gradcomm.hooks.options.AutoOptions`.
    """

    options_class = AutoOptions

    @takes_options(AutoOptions)
    def __init__(self, process_group: ProcessGroup | None = None, *options: Any, **named: Any) -> None:
        self._set_options(options, named)
        self._candidates: list[Candidate] = parse_candidates(self.candidates)
        self.process_group = process_group
        self.candidates = "+".join(c.text for c in self._candidates)
        self.error_bound = float(self.error_bound)
        self.tie_tolerance = float(self.tie_tolerance)
        self._restart_trial()
        self.step = 0
        self.link: Link | None = None
        self.decisions: list[dict[str, Any]] = []
        self.reset_runtime()

    def reset_runtime(self, loaded: bool = False) -> None:
        """Forget the step in progress (its window, traffic count and buckets awaiting the error pass)."""
        self._runtime = _StepRuntime()

    def _restart_trial(self) -> None:
        self.trialing = True
        self.active = 0
        self._figures = [CandidateFigures() for _ in self._candidates]
        self._schedule = list(range(len(self._candidates)))
        self._passes = 0
        for candidate in self._candidates:
            candidate.stop()
        self._errors: list[dict[int, ErrorSums]] = [{} for _ in self._candidates]
        self._link_at_trial: Link | None = None

    def measure_link(self) -> Link:
        """Measure the link (a collective); replaceable on an instance (``state.measure_link = ...``), e.g. by
        a test that simulates a slower link. A method, not a closure over the state: the state then holds no
        reference to itself, and is freed (with its process group) as soon as it is dropped."""
        return measure_link(self.process_group)

    def comm_hook_fingerprint(self) -> str:
        """What must agree across ranks: the options (the measurements differ by rank until agreed); see
        :class:`gradcomm.hooks.protocols.Fingerprinted`."""
        return f"AutoHookState({options_text(self.options())})"

    @property
    def choice(self) -> str:
        """The candidate averaging now (during the trial, the one on trial)."""
        return self._candidates[self.active].text

    def average(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Average ``bucket`` with the current candidate (what :func:`auto_hook` does): at a step's first
        bucket, measure, decide and switch; during the trial, sample the bucket for the error pass, and at the
        step's last bucket run that pass."""
        runtime = self._runtime
        if not runtime.open:
            self._begin_step()
        candidate = self._candidates[self.active]
        if self.trialing:
            pending = PendingBucket.sample(bucket)  # before the candidate runs: it may average the bucket in place
            pending.future = future = candidate.average(bucket)
            runtime.pending.append(pending)
        else:
            future = candidate.average(bucket)
        if bucket.is_last():
            if self.trialing:
                self._end_step()
            self.step += 1
            runtime.open = False
        return future

    def _activate(self, index: int, fresh: bool) -> None:
        self._candidates[index].start(self.process_group, self.step, fresh)
        self.active = index

    # -- step boundaries -------------------------------------------------------------------------------------
    def _begin_step(self) -> None:
        """At the first bucket of a step: close the last step's window, then measure, decide, switch."""
        now, runtime = time.perf_counter(), self._runtime
        if self.trialing and runtime.window is not None:
            index, start = runtime.window
            self._figures[index].step_seconds.append(now - start - runtime.overhead)
        runtime.window, runtime.overhead, runtime.open = None, 0.0, True
        if self.link is None:
            self.link = self.measure_link()
        elif not self.trialing and self.remeasure_every and self.step % self.remeasure_every == 0:
            self.link = self.measure_link()
            self._decide(f"link re-measured at step {self.step}", ending_trial=False)
        if self.trialing:
            self._advance_trial()
        if self.trialing:
            runtime.window = (self.active, time.perf_counter())
            runtime.traffic_before = (comm.traffic.snapshot_by_group(), comm.traffic.total_calls)

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
            local += [min(times) if times else 0.0, figures.calls, figures.wire_bytes, error_of(self._errors[index])]
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

    def _decide(self, reason: str, ending_trial: bool) -> None:
        """Choose the candidate with the lowest predicted step time within the error bound; switch to it.

        At the end of the trial the chosen candidate keeps its state from the trial; a later switch starts
        the newly chosen one afresh.
        """
        assert self.link is not None
        link, figures = self.link, self._figures
        decided = choose(figures, link, self.error_bound, self.tie_tolerance, None if ending_trial else self.active)
        choice, predicted, eligible = decided.index, decided.predicted, decided.eligible
        if not eligible:
            logger.warning(
                "auto hook: no candidate within error_bound %g; using the most accurate, %s",
                self.error_bound,
                self._candidates[choice].text,
            )
        switched = choice != self.active
        if switched or ending_trial:
            for k, candidate in enumerate(self._candidates):
                if k != choice:
                    candidate.stop()
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
    def _end_step(self) -> None:
        """At the last bucket of a trial step: wait for the step's futures, count its traffic, measure error.

        The wait is the step's own (the DDP waits for every bucket at the end of backward anyway) and stays in
        its measured time; only the error pass after it is auto's overhead.
        """
        runtime = self._runtime
        pending, runtime.pending = runtime.pending, []
        results = []
        for bucket in pending:
            value = bucket.future.wait()
            results.append(value[0] if isinstance(value, list) else value)
        start = time.perf_counter()
        before, calls_before = runtime.traffic_before
        after = comm.traffic.snapshot_by_group()
        sent = {key: n - before.get(key, 0) for key, n in after.items()}
        figures = self._figures[self.active]
        figures.calls = comm.traffic.total_calls - calls_before
        figures.wire_bytes = comm.group_wire_bytes(sent)
        if pending:
            exact = torch.cat([s.reshape(-1).float() for bucket in pending for s in bucket.samples])
            dist.all_reduce(exact, group=self.process_group)  # not through gradcomm.comm: not hook traffic
            exact = exact.double() / comm.group_size(self.process_group)
            offset = 0
            for bucket, result in zip(pending, results, strict=True):
                length = sum(sample.numel() for sample in bucket.samples)
                bucket.add_errors(self._errors[self.active], result, exact[offset : offset + length])
                offset += length
        runtime.overhead += time.perf_counter() - start

    # -- reporting ----------------------------------------------------------------------------------------------
    def comm_stats_details(self) -> dict[str, Any]:
        """What ``comm_stats().hook_details`` shows: the phase, the choice, the link and the last decision
        (:class:`gradcomm.hooks.protocols.ReportsCommStats`)."""
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
        own = None if self.trialing else self._candidates[self.active].state_dict()
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
            self._candidates[self.active].load_state_dict(state["active_state"])

    def __getstate__(self) -> dict[str, Any]:
        return {"options": asdict(self.options()), "state": self.state_dict()}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self.__init__(None, **saved["options"])  # type: ignore[misc]
        self.load_state_dict(saved["state"])


def auto_hook(state: AutoHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` with the candidate hook ``state`` has chosen, measuring and choosing as it goes.

    At the first bucket of a step it may measure the link (blocking collectives on ``state.process_group``,
    which is idle then) and decide or switch; during the trial it also samples the bucket for the error pass,
    and at the last bucket waits for the step's futures and runs that pass (:meth:`AutoHookState.average`).
    See the module docstring for the algorithm and :class:`AutoHookState` for the options.

    Example::

        >>> state = AutoHookState(candidates="allreduce+powersgd:matrix_approximation_rank=4,start_powerSGD_iter=2")
        >>> ddp_model.register_comm_hook(state, auto_hook)
    """
    return state.average(bucket)
