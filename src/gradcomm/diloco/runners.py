"""One :class:`~gradcomm.ddp.hook_runner.HookRunner` per fragment, sharing their statistics and failures.

Each fragment's exchange is one "iteration" for its hook: its buckets hold every parameter of the fragment
and the last is ``is_last()``. A stateful compressor (error feedback, PowerSGD's warm start) therefore gets
a state of its own per fragment, which sees all of its parameters at every call, as a hook's state expects
(per-iteration counters count that fragment's syncs; a loaded state is checked against that fragment).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed import ProcessGroup

from gradcomm.comm.telemetry import CommStats
from gradcomm.ddp.hook_runner import HookRunner
from gradcomm.diloco.state import compressor_hook
from gradcomm.hooks.contract import DEFAULT_HOOK_NAME

__all__ = ["FragmentRunners"]


class FragmentRunners:
    """The hook runners of ``fragments`` fragments on ``group``; constructing them is a collective of
    ``compared_on`` (every rank of the DiLoCo: ``group`` itself, or every rank where only the replicas' first
    ranks make up ``group``, and it is ``None`` on the others), in which the ranks compare ``setup`` and the
    compressor (one comparison per fragment)."""

    def __init__(
        self,
        who: str,
        fragments: int,
        compressor: str
        | tuple[Any, Callable[..., Any]]
        | Callable[[], tuple[Any, Callable[..., Any]]]
        | None,
        group: ProcessGroup | None,
        setup: dict[str, str],
        compared_on: ProcessGroup | None,
    ) -> None:
        self.stats = CommStats(hook_name=DEFAULT_HOOK_NAME, group=group)
        self.runners: list[HookRunner] = []
        for index in range(fragments):
            runner = HookRunner(who, compared_on, kind="DiLoCo")
            runner.stats = self.stats
            hook, state = compressor_hook(compressor, group if group is not None else compared_on)
            if (
                index > 0
                and state is not None
                and state is self.runners[0].state
                and hasattr(state, "state_dict")
            ):
                raise ValueError(
                    f"{who}: with fragments={fragments}, each fragment needs a hook state of its own (a state "
                    "sees a fragment's exchange as a whole iteration), but compressor= is one (state, hook) pair "
                    "with a stateful state; pass a callable returning a fresh (state, hook) pair, or a hook name"
                )
            fragment_setup = {**setup, "fragment": repr(index)}
            if hook is not None:
                runner.register(state, hook, None, fragment_setup)
            else:
                runner.check_same_setup(fragment_setup)
            runner.group = group
            self.runners.append(runner)

    def __getitem__(self, index: int) -> HookRunner:
        return self.runners[index]

    def states(self) -> list[Any]:
        return [runner.state for runner in self.runners]

    @property
    def failed(self) -> bool:
        return any(runner.failed for runner in self.runners)

    def fail(self, exc: BaseException) -> None:
        """Remember the failure in every runner: no fragment syncs again (the ranks may be out of step)."""
        for runner in self.runners:
            runner.fail(exc)

    def check_usable(self) -> None:
        self.runners[0].check_usable("outer exchange")
