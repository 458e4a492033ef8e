"""Running the communication hook on buckets: the part both DDPs share.

A :class:`HookRunner` holds the registered hook and its state (or none: the default averaging allreduce),
registers it once and checks that every rank registered the same, launches it on a bucket with the failure,
timing and traffic accounting every DDP needs, checks the future's result, and remembers a failed step so
that no later step runs out of step with the other ranks. The overlapping :class:`~gradcomm.ddp.reducer.Reducer`
and the explicit :class:`~gradcomm.ddp.legacy.LegacyDistributedDataParallel` differ only in *when* they hand
buckets to it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from gradcomm import comm
from gradcomm.comm.agreement import check_same_on_all_ranks
from gradcomm.comm.faults import reporting_lost_peers
from gradcomm.comm.telemetry import CommStats
from gradcomm.hooks.contract import (
    DEFAULT_HOOK_NAME,
    CommHook,
    call_hook,
    check_hook,
    hook_name,
    hook_result,
    replicas_may_differ,
)
from gradcomm.hooks.fingerprint import hook_fingerprint
from gradcomm.hooks.grad_bucket import GradBucket

__all__ = ["HookRunner"]

_REGISTERED_TWICE = "register_comm_hook or register_builtin_comm_hook can only be called once."
"""torch's DDP's sentence for a second registration, which code written for torch matches."""


class HookRunner:
    """The registered hook of one DDP (``owner`` names that DDP in errors, ``kind`` what it is: ``"DDP"``, or
    ``"DiLoCo"`` for DiLoCo's outer exchanges) on ``group``."""

    def __init__(self, owner: str, group: ProcessGroup | None, kind: str = "DDP") -> None:
        self.owner = owner
        self.kind = kind
        self.group = group
        self.hook: CommHook | None = None
        self.state: Any = None
        self.name = DEFAULT_HOOK_NAME
        self.stats = CommStats(hook_name=DEFAULT_HOOK_NAME, group=group)
        self.setup_checked = False  # whether the ranks have compared their setup
        self._failure: str | None = None  # set when a step failed: no further steps

    @property
    def averages_itself(self) -> bool:
        """Whether the default reduction runs (the caller then divides the gradients itself)."""
        return self.hook is None

    def register(self, state: Any, hook: CommHook, too_late: str | None, setup: dict[str, str]) -> None:
        """Register ``hook`` with ``state``; a collective in which the ranks compare hook and ``setup``.

        ``too_late``: why registering is no longer allowed (steps already ran), or ``None``.
        """
        check_hook(hook)
        if self.hook is not None:
            raise RuntimeError(
                f"{_REGISTERED_TWICE} Hook {self.name} is already registered on this {self.owner}, so "
                f"{hook_name(hook)} cannot be: combine them into one hook, or build a new {self.kind}."
            )
        if too_late is not None:
            raise RuntimeError(f"register_comm_hook({hook_name(hook)}) must be called {too_late}")
        self.check_same_setup(setup, hook, state)
        self.hook, self.state, self.name = hook, state, hook_name(hook)
        self.stats.hook_name = self.name
        self.stats.details_source = getattr(state, "comm_stats_details", None)

    def check_same_setup(self, setup: dict[str, str], hook: CommHook | None = None, state: Any = None) -> None:
        """Compare the hook (the registered one unless given), its options and ``setup`` across the ranks, all
        raising :class:`~gradcomm.comm.agreement.RanksDisagreeError` if they differ (a collective)."""
        if hook is None:
            hook, state = self.hook, self.state
        fingerprint = {**hook_fingerprint(hook, state), **setup}
        with reporting_lost_peers(None, "comparing the ranks' hooks and bucket layouts", self.group):
            check_same_on_all_ranks(fingerprint, self.group, self.owner)
        self.setup_checked = True

    def replicas_may_differ(self) -> bool:
        """Whether the registered hook leaves the replicas different on purpose at this point."""
        return replicas_may_differ(self.hook, self.state)

    # -- one bucket ----------------------------------------------------------------------------------------
    def launch(self, bucket: GradBucket, step: int) -> torch.futures.Future[Any]:
        """Start the hook (or the default allreduce) on ``bucket``, counting its time and traffic; a failure
        names the step and the bucket."""
        buffer = bucket.buffer()
        self.stats.add_bucket(buffer.numel() * buffer.element_size())
        self.stats.remember_input(bucket.index(), buffer, averaged=self.hook is None)
        with self.stats.timing_hook(), comm.counting_into(self.stats.traffic):
            if self.hook is not None:
                return call_hook(self.hook, self.state, bucket, step, self.group)
            with reporting_lost_peers(step, f"bucket {bucket.index()} (hook: {self.name})", self.group):
                return comm.all_reduce(buffer, self.group)

    def result(
        self, future: torch.futures.Future[Any], index: int, buffer: torch.Tensor, step: int
    ) -> torch.Tensor:
        """Wait for bucket ``index``'s ``future`` and check that its value can replace ``buffer``."""
        return hook_result(self.name, future, index, buffer, step, self.group)

    # -- failures ------------------------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """Remember that a step failed with ``exc``: :meth:`check_usable` refuses every later step."""
        text = str(exc).strip().splitlines()
        self._failure = f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def check_usable(self, what: str = "synchronised step") -> None:
        """Raise if an earlier ``what`` failed on this rank: the ranks may be out of step."""
        if self._failure is not None:
            raise RuntimeError(
                f"{self.owner}: an earlier {what} failed on this rank ({self._failure}). Its collectives may "
                f"no longer match the other ranks', so this {self.kind} does not continue (that could mix gradients "
                f"of different steps). Restart the job, or build a new process group and {self.kind}, and resume "
                "from the last checkpoint."
            )
