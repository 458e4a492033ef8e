"""The :class:`DiLoCo` wrapper: inner steps without communication, outer steps on averaged pseudo-gradients.

See :mod:`gradcomm.diloco` for the algorithm, the papers and a usage example.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from gradcomm import comm
from gradcomm.comm.agreement import broadcast_coalesced, check_same_parameters
from gradcomm.comm.collectives import collective_device
from gradcomm.comm.faults import reporting_lost_peers
from gradcomm.comm.telemetry import CommStats
from gradcomm.diloco.buffers import average_buffers
from gradcomm.diloco.exchange import FragmentExchange, PendingExchange
from gradcomm.diloco.fragments import Fragment, split_into_fragments
from gradcomm.diloco.groups import replica_group, replica_leaders_group, unwrap_ddp
from gradcomm.diloco.runners import FragmentRunners
from gradcomm.diloco.state import FORMAT, Compressor, describe_outer, load_diloco_state
from gradcomm.hooks.contract import declares_replicas_may_differ
from gradcomm.hooks.parameter_keys import name_parameters

__all__ = ["DiLoCo"]

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
_WHO = "gradcomm.DiLoCo"


def _anchor(param: nn.Parameter, device: torch.device | str | None) -> torch.Tensor:
    return param.detach().clone() if device is None else param.detach().to(device, copy=True)


class DiLoCo:
    """DiLoCo, Streaming DiLoCo and SparseLoCo around ``model`` and its ``inner_optimizer``.

    Args:
        model: a plain module, or one wrapped in a DDP (the DDP then averages within its group every step and
            DiLoCo works across the groups: see ``process_group``). Its parameters are broadcast from the
            first rank at construction, so every replica starts from the same point.
        inner_optimizer: the optimizer of the model's parameters (AdamW in the papers); :meth:`step` runs it.
        sync_every: ``H``, the inner steps between two outer syncs of a fragment (default 50: see "Defaults"
            in :mod:`gradcomm.diloco` for how it and the outer optimizer's defaults were measured).
        fragments: Streaming DiLoCo's fragments (1: plain DiLoCo). 4 ended closer to allreduce's loss than 1
            at the same bytes in 8 of 9 pairs measured, with a quarter of the peak bytes per exchange
            (docs/notes/2026-11-28-diloco-unrepeated-corpus.md).
        fragment_unit: how the parameters, laid end to end, are cut into fragments: ``"row"`` (the default)
            at the row boundary nearest each ``1/F`` of the elements, so each exchange carries ``1/F`` of the
            model to within a row; ``"element"`` exactly there; ``"parameter"`` between whole parameters only
            (as before fragments could cut a parameter; needed to resume a checkpoint written then with
            ``fragments > 1``). See :mod:`gradcomm.diloco.fragments`.
        overlap: inner steps an outer exchange runs behind (0: the sync blocks); less than ``sync_every``.
        outer_lr, outer_momentum, nesterov: the outer optimizer, SGD; the defaults (lr 1, no momentum) make
            the outer step plain averaging of the replicas. The paper's is ``outer_lr=0.7, outer_momentum=0.9``
            (with ``nesterov``, used whenever the momentum is above 0).
        outer_optimizer: instead, a factory ``anchors -> Optimizer`` (the anchors are plain tensors).
        compressor: how pseudo-gradients are reduced: ``None`` (averaging allreduce), a hook name with options
            (``"fp16_compress"``, ``"qsgd"``, ``"topk:ratio=0.01"``, see :mod:`gradcomm.hooks.registry`), a
            callable returning a fresh ``(state, hook)`` pair, or a ``(state, hook)`` pair. Every fragment gets a
            state of its own (see :mod:`gradcomm.diloco.runners`): a pair's state is shared by the fragments,
            so with ``fragments > 1`` give a stateful hook by name or by callable.
        mixing: with ``overlap``, Streaming DiLoCo's ``alpha``: a synced fragment becomes ``alpha * local +
            (1 - alpha) * global``; 0 (the default) replaces it with the global value, keeping replicas identical.
        anchor_device: where the anchors and the outer optimizer's state live (``"cpu"`` saves accelerator
            memory, as torchft does); ``None``: the parameters' device.
        process_group: the group averaged across; ``None``: the default group, or for a DDP-wrapped model the
            first ranks of the DDPs' groups, each of which broadcasts the result inside its DDP's group (one
            copy of each replica's pseudo-gradients crosses between hosts). Given with a DDP-wrapped model,
            every rank exchanges over the group it gives and takes its DDP group's first rank's result.
        check_replicas: compare the synced parameters across the ranks bit for bit right after each sync.

    Attributes:
        group: the group of the outer exchange; ``None`` on a DDP's other ranks where only the DDPs' first
            ranks exchange (``exchanging`` is then false: they receive the result from their first rank).

    Constructing it is a collective: the ranks compare their setup and all raise
    :class:`~gradcomm.RanksDisagreeError` if it differs.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int = 50,
        fragments: int = 1,
        overlap: int = 0,
        *,
        fragment_unit: str = "row",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        nesterov: bool = True,
        outer_optimizer: OuterFactory | None = None,
        compressor: Compressor = None,
        mixing: float = 0.0,
        anchor_device: torch.device | str | None = None,
        process_group: ProcessGroup | None = None,
        check_replicas: bool = True,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"{_WHO}: sync_every must be at least 1, got {sync_every}")
        if not 0 <= overlap < sync_every:
            raise ValueError(
                f"{_WHO}: overlap must be between 0 and sync_every - 1 = {sync_every - 1} (an exchange must end "
                f"before the fragment's next one starts), got {overlap}"
            )
        if not 0.0 <= mixing < 1.0:
            raise ValueError(f"{_WHO}: mixing (Streaming DiLoCo's alpha) must be in [0, 1), got {mixing}")
        module, wrapped = unwrap_ddp(model)
        self._replica_group = replica_group(model) if wrapped else None
        self._everyone, self.exchanging = process_group, True
        self._first_ranks_exchange = process_group is None and wrapped
        if self._first_ranks_exchange:
            self._everyone = dist.group.WORLD
            process_group = replica_leaders_group(model)
            self.exchanging = process_group is not None
        self.module, self.inner_optimizer, self.group = module, inner_optimizer, process_group
        self.sync_every, self.overlap, self.mixing, self.check_replicas = (
            sync_every,
            overlap,
            mixing,
            check_replicas,
        )
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        name_parameters(module)  # keys of per-parameter compressor state (error feedback)
        self.fragment_unit, self._named = fragment_unit, named
        self.fragments: list[Fragment] = split_into_fragments(named, fragments, sync_every, fragment_unit)
        self._runners = FragmentRunners(
            _WHO, fragments, compressor, process_group, self._setup(outer_optimizer), self._everyone
        )
        self._buffers = list(module.named_buffers())
        broadcast_coalesced(
            [p for _, p in named] + [b for _, b in self._buffers],
            self._everyone if self._everyone is not None else dist.group.WORLD,
        )
        self._synced_buffers = {name: b.detach().clone() for name, b in self._buffers}
        self._full_anchors = {name: _anchor(p, anchor_device) for name, p in named}
        self.anchors: list[list[torch.Tensor]] = [
            [part.of(self._full_anchors[part.name]) for part in fragment.parts] for fragment in self.fragments
        ]
        everything = [anchor for anchors in self.anchors for anchor in anchors]
        if outer_optimizer is not None:
            self.outer_optimizer = outer_optimizer(everything)
        else:
            self.outer_optimizer = torch.optim.SGD(
                everything, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov and outer_momentum > 0
            )
        self._exchanges: list[FragmentExchange] = []
        for fragment, anchors in zip(self.fragments, self.anchors, strict=True):
            self._exchanges.append(FragmentExchange(fragment, anchors))
        self._pending: dict[int, PendingExchange] = {}
        self._synced_at = [0] * len(self.fragments)
        self.inner_steps = 0
        self.synced_steps = 0

    def _setup(self, outer_optimizer: OuterFactory | None) -> dict[str, str]:
        """What every rank must agree on, as text (compared at construction)."""
        layout = [[f"{part.key}{tuple(part.shape)}:{part.param.dtype}" for part in f.parts] for f in self.fragments]
        return {
            "sync_every": repr(self.sync_every),
            "fragments": repr(len(self.fragments)),
            "fragment unit": repr(self.fragment_unit),
            "overlap": repr(self.overlap),
            "mixing": repr(self.mixing),
            "outer optimizer": describe_outer(outer_optimizer),
            "fragment layout": repr(layout),
        }

    # -- the training loop ---------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner optimizer step; then apply the outer updates that are due and launch the exchanges of
        the fragments whose turn it is (with ``overlap == 0`` they are applied at once)."""
        self._runners.check_usable()
        loss = self.inner_optimizer.step(closure) if closure is not None else self.inner_optimizer.step()
        self.inner_steps += 1
        try:
            for index in [
                f for f, p in self._pending.items() if p.launched_at + self.overlap <= self.inner_steps
            ]:
                self._apply(index)
            for fragment in self.fragments:
                if fragment.syncs_at(self.inner_steps):
                    self._launch(fragment.index)
                    if self.overlap == 0:
                        self._apply(fragment.index)
        except BaseException as exc:
            self._runners.fail(exc)
            raise
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def _settle(self) -> None:
        """Wait for the exchanges in flight that a hook runs. A hook's later stages are launched from its
        callbacks, ordered only among that fragment's own calls (one launcher per hook state), so no other
        collective may start on the group while they run. Only exchanges that overlap in time wait: with
        ``fragments * overlap < sync_every``, none does."""
        for index, pending in self._pending.items():
            if self.exchanging and self._runners[index].hook is not None:
                self._exchanges[index].collect(self._runners[index], pending)

    def _launch(self, index: int) -> None:
        self._settle()
        stats = self._runners.stats
        stats.begin_step()
        if self.exchanging:
            buffers = None
            if index == 0 and self._buffers:
                with comm.counting_into(stats.traffic):
                    buffers = average_buffers(self._buffers, self.group, self.inner_steps)
            world = dist.get_world_size(self.group)
            pending = self._exchanges[index].launch(self._runners[index], self.inner_steps, world)
            pending.buffers = buffers
        else:  # the replica's first rank exchanges; _apply receives its result
            pending = PendingExchange(index, self.inner_steps)
            if index == 0 and self._buffers:
                pending.buffers = {name: buffer.detach().clone() for name, buffer in self._buffers}
        self._pending[index] = pending
        stats.end_step()

    def _averaged(self, index: int, pending: PendingExchange) -> list[torch.Tensor]:
        """Fragment ``index``'s averaged pseudo-gradients: waited for where this rank exchanges, else room for
        its replica's first rank's, which :meth:`_apply` broadcasts."""
        if self.exchanging:
            return self._exchanges[index].collect(self._runners[index], pending)
        if pending.averaged is None:
            pending.averaged = [
                torch.empty(part.shape, dtype=part.param.dtype, device=part.param.device)
                for part in self.fragments[index].parts
            ]
        return pending.averaged

    def _apply(self, index: int) -> None:
        """Wait for fragment ``index``'s exchange, step the outer optimizer on its anchors, and set the
        fragment's parameters from them (mixed with the local ones where ``mixing`` > 0)."""
        pending = self._pending[index]
        averaged = self._averaged(index, pending)
        if self._replica_group is not None:
            synced = list(averaged)
            if pending.buffers is not None:
                synced += [pending.buffers[name] for name, _ in self._buffers]
            where = "broadcasting the averaged pseudo-gradients inside the DDP's group"
            with reporting_lost_peers(self.inner_steps, where, self._replica_group):
                broadcast_coalesced(synced, self._replica_group)
        anchors, fragment = self.anchors[index], self.fragments[index]
        for anchor, grad in zip(anchors, averaged, strict=True):
            anchor.grad = grad.to(anchor.device)
        self.outer_optimizer.step()
        with torch.no_grad():
            for anchor, part in zip(anchors, fragment.parts, strict=True):
                anchor.grad = None
                param = part.of(part.param.detach())
                if self.mixing == 0.0:
                    param.copy_(anchor)
                else:
                    param.lerp_(anchor.to(param.device), 1.0 - self.mixing)
            if pending.buffers is not None:
                for name, buffer in self._buffers:
                    buffer.copy_(pending.buffers[name])
                self._synced_buffers = pending.buffers
        del self._pending[index]
        self._synced_at[index] = self.inner_steps
        self.synced_steps += 1
        if self.check_replicas and self.mixing == 0.0 and not self._replicas_may_differ_after(index):
            self._settle()
            when = f"right after outer sync {self.synced_steps} (fragment {index}, inner step {self.inner_steps}),"
            named = [(part.key, part.of(part.param.detach())) for part in fragment.parts]
            if pending.buffers is not None:
                named += self._buffers
            check_same_parameters(named, self._everyone, _WHO, when)

    def _replicas_may_differ_after(self, index: int) -> bool:
        """Whether fragment ``index``'s hook leaves the replicas different on purpose after this sync (a
        post-local SGD or no-op compressor). Where only the replicas' first ranks exchange, the other ranks'
        hook states never advance, so they take their first rank's answer (one more broadcast in the DDP's
        group, for such a hook only): every rank then runs the replica check, or none."""
        runner = self._runners[index]
        if runner.hook is None or not declares_replicas_may_differ(runner.hook):
            return False
        flag = torch.tensor([int(runner.replicas_may_differ())], device=collective_device(self._replica_group))
        if self._replica_group is not None and self._first_ranks_exchange:
            with reporting_lost_peers(self.inner_steps, "broadcasting the hook's answer", self._replica_group):
                broadcast_coalesced([flag], self._replica_group)
        return bool(flag.item())

    def wait_pending(self) -> None:
        """Apply every outer update still in flight now (at the end of training, with ``overlap``)."""
        self._runners.check_usable()
        try:
            for index in list(self._pending):
                self._apply(index)
        except BaseException as exc:
            self._runners.fail(exc)
            raise

    # -- what the ranks hold -------------------------------------------------------------------------------
    def replicas_may_differ(self) -> bool:
        """Whether the replicas may differ now: always between syncs (local steps diverge on purpose); false
        at the start (the parameters were broadcast) and right after every fragment synced at this inner step,
        without mixing."""
        return self.mixing != 0.0 or any(at != self.inner_steps for at in self._synced_at)

    def synced_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters as of each fragment's last outer sync (the anchors), by name, on this rank: the same
        on every rank, and intact after a failed exchange, so they can be loaded to resume."""
        return {name: anchor.detach().clone() for name, anchor in self._full_anchors.items()}

    def synced_buffers(self) -> dict[str, torch.Tensor]:
        """The model's buffers as of the last sync of fragment 0 (floating ones averaged over the ranks, the
        others the first rank's), by name: the same on every rank; at the start, the first rank's."""
        return {name: buffer.clone() for name, buffer in self._synced_buffers.items()}

    def comm_stats(self) -> CommStats:
        """The outer exchanges' communication statistics on this rank (one ``step`` per fragment sync)."""
        return self._runners.stats

    def state_dict(self) -> dict[str, Any]:
        """Counters, anchors, the outer optimizer, the compressor's state and the exchanges in flight (waited
        for: their averaged pseudo-gradients are saved); tensors and plain values (``weights_only`` loads it).
        Save the model and the inner optimizer with it (``gradcomm.save_checkpoint(path, model, inner,
        diloco)`` does)."""
        if self._runners.failed:
            raise RuntimeError(
                f"{_WHO}.state_dict: an outer exchange failed on this rank, so its counters, outer optimizer and "
                "exchanges in flight no longer fit one point of the run; resume from the last checkpoint, or take "
                "the parameters of the last sync with synced_parameters()"
            )
        try:
            pending = [
                {
                    "fragment": f,
                    "launched_at": p.launched_at,
                    "averaged": self._exchanges[f].collect(self._runners[f], p) if self.exchanging else None,
                    "buffers": p.buffers,
                }
                for f, p in sorted(self._pending.items())
            ]
        except BaseException as exc:
            self._runners.fail(exc)
            raise
        return {
            "format": FORMAT,
            "setup": {
                "sync_every": self.sync_every,
                "fragments": len(self.fragments),
                "overlap": self.overlap,
            },
            "layout": [fragment.layout() for fragment in self.fragments],
            "inner_steps": self.inner_steps,
            "synced_steps": self.synced_steps,
            "synced_at": list(self._synced_at),
            "anchors": self.synced_parameters(),
            "buffers": self.synced_buffers(),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "compressor": [
                s.state_dict() if callable(getattr(s, "state_dict", None)) else None
                for s in self._runners.states()
            ],
            "pending": pending,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (load the model's parameters separately)."""
        load_diloco_state(self, state_dict)

    def parameters(self) -> Iterable[nn.Parameter]:
        """The trainable parameters, each once (a split one is in several fragments), in registration order."""
        return iter(dict.fromkeys(p for fragment in self.fragments for p in fragment.params))
