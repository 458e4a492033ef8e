"""Training methods the bench runs beside the communication hooks: ``--hooks diloco:sync_every=50,...``.

A hook changes how a DDP averages gradients; a *method* changes the training loop itself (DiLoCo steps an
inner optimizer without communicating and synchronises the parameters every ``sync_every`` steps). The bench
accepts both in ``--hooks``: a name in :data:`METHODS` is a method, any other a registry hook. Each method is
one object that checks its options before the ranks start and builds a :class:`Trainer` on the ranks, so the
runner trains and measures every choice through the same few calls.

On several hosts of several ranks each (``gradcomm bench --nodes N --procs-per-node P``, or torchrun with
``1 < LOCAL_WORLD_SIZE < WORLD_SIZE``), DiLoCo runs as :class:`gradcomm.DiLoCo` documents it for a cluster:
each host's ranks train one replica through gradcomm's DDP (plain allreduce every step, on the host's fast
link), and DiLoCo averages pseudo-gradients across the hosts only, each host's first rank exchanging for
it (one copy per host crosses). On one host (the bench's local ranks) or one rank per host, DiLoCo runs
over every rank, each rank a replica.

What a method's row reports (:class:`DiLoCoMethod`): bytes per step are the outer exchanges' bytes (and, on
hosts, the DDP's every step inside the host, as a hierarchical hook's row counts its stages inside the host)
averaged over *all* steps of the run (0 on a step without a sync, the sync's bytes on its step), the measured step time
the mean over the steps from warm-up on (a median would hide the syncs); the loss curve (and so time to
target) is the mean over ranks of the inner training losses; the final loss and metric are those of the
synchronised parameters and buffers (:meth:`gradcomm.DiLoCo.synced_parameters`, ``synced_buffers``),
evaluated as every hook's model is.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradcomm import comm
from gradcomm.bench.workloads import Workload
from gradcomm.comm.faults import derived_group_timeout
from gradcomm.hooks.registry import apply_option_defaults, check_options, parse_hook_choice, resolve_hook_name

__all__ = [
    "METHODS",
    "DiLoCoMethod",
    "DiLoCoTrainer",
    "MethodOption",
    "Trainer",
    "TrainingMethod",
    "compressor_choice",
    "method_named",
    "ranks_per_host",
]

logger = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _boolean(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


@dataclass(frozen=True)
class MethodOption:
    """One option of a method: its name, how its text converts, its default, and the range it must be in."""

    name: str
    convert: Callable[[str], Any]
    default: Any
    check: Callable[[Any], str | None] = lambda value: None
    """Returns what is wrong with a converted value (the rest of "must be ..."), or None."""
    kind: str = ""
    """What the value must be, for the error message (default: the converter's name)."""

    @property
    def type_name(self) -> str:
        return self.kind or getattr(self.convert, "__name__", "value")


class Trainer:
    """A method's model and optimizer on one group of ranks, stepped and measured by the runner."""

    steady_statistic = "median"
    """How the report averages the steady steps' bytes and times: ``median`` or ``mean`` (periodic syncs)."""

    def step(self, batch: Any) -> torch.Tensor:
        """One training step on ``batch``; the loss, detached."""
        raise NotImplementedError

    def step_bytes(self) -> tuple[int, float]:
        """Bytes handed to collectives and put on the wire by the step just taken."""
        raise NotImplementedError

    def dense_bytes(self) -> tuple[int, float]:
        """Bytes a plain allreduce of every gradient hands over and puts on the wire in one step."""
        raise NotImplementedError

    def finished_model(self) -> nn.Module:
        """The model to evaluate, once every exchange in flight is done."""
        raise NotImplementedError


class TrainingMethod:
    """A training method: its name, its options, and how it builds a :class:`Trainer`."""

    name: str = ""
    options: tuple[MethodOption, ...] = ()

    def option_names(self) -> tuple[str, ...]:
        return tuple(option.name for option in self.options)

    def with_defaults(self, options: Mapping[str, str], defaults: Mapping[str, Any]) -> dict[str, str]:
        """``options`` with each of the bench's ``defaults`` (``--hook-option``) that is an option of the
        method and not given; options given in the choice win."""
        names = self.option_names()
        return {**options, **{k: str(v) for k, v in defaults.items() if k in names and k not in options}}

    def check(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` (strings from the command line) converted and checked, the defaults filled in.

        Raises:
            ValueError: an unknown option (the valid ones are listed) or a value of the wrong type or range.
        """
        by_name = {option.name: option for option in self.options}
        unknown = [name for name in options if name not in by_name]
        if unknown:
            raise ValueError(
                f"training method {self.name!r} got unknown option(s) {', '.join(map(repr, unknown))}; "
                f"valid options: {', '.join(by_name)}"
            )
        checked = {option.name: option.default for option in self.options}
        for name, value in options.items():
            option = by_name[name]
            try:
                converted = option.convert(value.strip()) if isinstance(value, str) else value
            except ValueError as exc:
                detail = f" expects {option.type_name}, got {value!r}"
                if option.convert not in (int, float, _boolean):
                    detail = f": {exc}"
                raise ValueError(f"training method {self.name!r}: option {name!r}{detail}") from None
            problem = option.check(converted)
            if problem is not None:
                raise ValueError(f"training method {self.name!r}: {name} must be {problem}, got {value}")
            checked[name] = converted
        return checked

    def check_model(self, options: Mapping[str, Any], model: nn.Module) -> None:
        """Refuse ``options`` (checked) that the workload's ``model`` cannot train with, before ranks start.

        Raises:
            ValueError: says which option and why.
        """

    def trainer(
        self, workload: Workload, model: nn.Module, options: Mapping[str, Any], lr: float, group: Any
    ) -> Trainer:
        """The method's :class:`Trainer` of ``model`` on ``group`` (``None``: every rank); a collective."""
        raise NotImplementedError


def _at_least(low: float) -> Callable[[Any], str | None]:
    return lambda value: None if value >= low else f"at least {low:g}"


def _finite_at_least_zero(value: float) -> str | None:
    return None if 0 <= value < math.inf else "a finite number >= 0"


def _fragment_unit(value: str) -> str | None:
    from gradcomm.diloco.fragments import UNITS

    return None if value in UNITS else f"one of {', '.join(UNITS)}"


def _mixing(value: float) -> str | None:
    return None if 0 <= value < 1 else "in [0, 1)"


def compressor_choice(text: str) -> tuple[str, dict[str, str]]:
    """A compressor written ``name``, ``name:key=value;key=value`` or ``name;key=value`` (';' between its
    options, since ',' separates the method's own), split into the hook name and its options.

    Raises:
        ValueError: an unknown hook name or an option that is not ``key=value``.
    """
    name, sep, rest = text.partition(":")
    if not sep:
        name, _, rest = text.partition(";")
    name, options = parse_hook_choice(f"{name}:{rest.replace(';', ',')}")
    return resolve_hook_name(name).value.name, options


def _compressor(text: str) -> str:
    """The compressor as the method's label and DiLoCo show it: ``none`` or ``name[:key=value;...]``."""
    if text.lower() in ("", "none"):
        return "none"
    name, options = compressor_choice(text)
    return name + (":" + ";".join(f"{k}={v}" for k, v in options.items()) if options else "")


def _diloco_default(option: str) -> Any:
    """The default of :class:`gradcomm.DiLoCo`'s argument ``option``: the bench runs the library's defaults."""
    from gradcomm.diloco import DiLoCo

    return inspect.signature(DiLoCo).parameters[option].default


def ranks_per_host(group: Any) -> int | None:
    """The ranks of each host when a method trains one replica per host (a DDP inside it), else ``None``.

    ``None`` unless ``group`` is every rank (``None``; the compute-time runs on a group of one rank alone
    are not split) and torchrun's ``LOCAL_WORLD_SIZE`` puts several ranks on each of several hosts: with one
    host there is no slow link to spare, with one rank per host nothing to nest.
    """
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    if group is not None or not text.isdigit():
        return None
    per_host = int(text)
    return per_host if 1 < per_host < dist.get_world_size() else None


class DiLoCoMethod(TrainingMethod):
    """:class:`gradcomm.DiLoCo` with AdamW as inner optimizer: over every rank, the plain model on each; on
    several hosts of several ranks, across the hosts, each host's replica a DDP (see the module)."""

    name = "diloco"
    options = (
        MethodOption("sync_every", int, _diloco_default("sync_every"), _at_least(1)),
        MethodOption("fragments", int, _diloco_default("fragments"), _at_least(1)),
        MethodOption(
            "fragment_unit", str, _diloco_default("fragment_unit"), _fragment_unit, kind="row, element or parameter"
        ),
        MethodOption("overlap", int, _diloco_default("overlap"), _at_least(0)),
        MethodOption("outer_lr", float, _diloco_default("outer_lr"), _finite_at_least_zero),
        MethodOption("outer_momentum", float, _diloco_default("outer_momentum"), _finite_at_least_zero),
        MethodOption("nesterov", _boolean, _diloco_default("nesterov"), kind="on or off"),
        MethodOption("mixing", float, _diloco_default("mixing"), _mixing),
        MethodOption("compressor", _compressor, "none", kind="none or a hook name such as qsgd or topk:ratio=0.02"),
    )

    def with_defaults(self, options: Mapping[str, str], defaults: Mapping[str, Any]) -> dict[str, str]:
        """The bench's hook defaults (``start_powerSGD_iter``, ``--hook-option``) reach the compressor, as they
        reach any hook that takes them."""
        resolved = super().with_defaults(options, defaults)
        text = resolved.get("compressor", "")
        if _compressor(text) == "none":
            return resolved
        name, own = compressor_choice(text)
        given = apply_option_defaults(name, own, defaults)
        if given != own:
            resolved["compressor"] = _compressor(f"{name}:{';'.join(f'{k}={v}' for k, v in given.items())}")
        return resolved

    def check(self, options: Mapping[str, Any]) -> dict[str, Any]:
        checked = super().check(options)
        if checked["overlap"] >= checked["sync_every"]:
            raise ValueError(
                f"training method 'diloco': overlap must be less than sync_every = {checked['sync_every']} (an "
                f"exchange must end before the fragment's next one starts), got {checked['overlap']}"
            )
        if checked["compressor"] != "none":
            name, own = compressor_choice(checked["compressor"])
            try:
                check_options(name, **own)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"training method 'diloco': compressor {checked['compressor']!r}: {exc}") from None
        return checked

    def check_model(self, options: Mapping[str, Any], model: nn.Module) -> None:
        """Refuse fragments the model cannot fill (before ranks start): as :class:`gradcomm.DiLoCo` splits it."""
        from gradcomm.diloco.fragments import split_into_fragments

        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        try:
            split_into_fragments(named, options["fragments"], options["sync_every"], options["fragment_unit"])
        except ValueError as exc:
            raise ValueError(f"training method 'diloco': {str(exc).removeprefix('gradcomm.DiLoCo: ')}") from None

    def trainer(
        self, workload: Workload, model: nn.Module, options: Mapping[str, Any], lr: float, group: Any
    ) -> Trainer:
        return DiLoCoTrainer(workload, model, self.check(options), lr, group)


class DiLoCoTrainer(Trainer):
    steady_statistic = "mean"

    def __init__(
        self, workload: Workload, model: nn.Module, options: Mapping[str, Any], lr: float, group: Any
    ) -> None:
        from gradcomm.diloco import DiLoCo

        self.workload, self.model, self.group = workload, model, group
        self.ddp = self._host_ddp(model, group)
        self.forward = model if self.ddp is None else self.ddp
        inner = torch.optim.AdamW(model.parameters(), lr=lr)
        compressor = options["compressor"]
        if compressor != "none":
            name, own = compressor_choice(compressor)
            compressor = f"{name}:{','.join(f'{k}={v}' for k, v in own.items())}"
        self.diloco = DiLoCo(
            self.forward,
            inner,
            sync_every=options["sync_every"],
            fragments=options["fragments"],
            fragment_unit=options["fragment_unit"],
            overlap=options["overlap"],
            outer_lr=options["outer_lr"],
            outer_momentum=options["outer_momentum"],
            nesterov=options["nesterov"],
            mixing=options["mixing"],
            compressor=None if compressor == "none" else compressor,
            process_group=group,
        )
        self._totals = (0, 0.0)
        self._step = (0, 0.0)

    @staticmethod
    def _host_ddp(model: nn.Module, group: Any) -> Any:
        """On several hosts of several ranks, gradcomm's DDP of ``model`` over the host's ranks (plain
        allreduce), which DiLoCo then works across (from ``LOCAL_WORLD_SIZE``, as the host's ranks here);
        else None (each rank is a replica). A collective when it builds one."""
        per_host = ranks_per_host(group)
        if per_host is None:
            return None
        from gradcomm.ddp.distributed import DistributedDataParallel
        from gradcomm.hooks.registry import make_comm_hook

        host, _ = dist.new_subgroups(group_size=per_host, timeout=derived_group_timeout())
        ddp = DistributedDataParallel(model, process_group=host)
        hook, state = make_comm_hook("allreduce", process_group=host)
        ddp.register_comm_hook(state, hook)
        hosts = dist.get_world_size() // per_host
        logger.info("diloco: one replica per host (%d hosts of %d ranks, a DDP in each)", hosts, per_host)
        return ddp

    def step(self, batch: Any) -> torch.Tensor:
        inputs, target = batch
        loss = self.workload.loss(self.forward(inputs), target)
        loss.backward()
        self.diloco.step()
        self.diloco.zero_grad()
        total = self.diloco.comm_stats().total
        sent, wire = total.bytes_sent - self._totals[0], total.wire_bytes - self._totals[1]
        self._totals = (total.bytes_sent, total.wire_bytes)
        if self.ddp is not None:
            inside = self.ddp.comm_stats().last
            sent, wire = sent + inside.bytes_sent, wire + inside.wire_bytes
        self._step = (sent, wire)
        return loss.detach()

    def step_bytes(self) -> tuple[int, float]:
        return self._step

    def dense_bytes(self) -> tuple[int, float]:
        dense = sum(p.numel() * p.element_size() for p in self.diloco.parameters())
        world = dist.get_world_size(self.group)
        return dense, comm.wire_bytes({"all_reduce": dense}, world)

    def finished_model(self) -> nn.Module:
        """A copy of the model holding the synchronised parameters and buffers (the anchors and the buffers
        averaged at the last sync, after the exchanges in flight are applied): the same on every rank,
        whatever the inner steps since the last sync did. A collective (exchanges in flight)."""
        self.diloco.wait_pending()
        synced = {**self.diloco.synced_parameters(), **self.diloco.synced_buffers()}
        evaluated = copy.deepcopy(self.model)
        with torch.no_grad():
            for name, tensor in [*evaluated.named_parameters(), *evaluated.named_buffers()]:
                if name in synced:
                    tensor.copy_(synced[name])
        return evaluated


METHODS: dict[str, TrainingMethod] = {method.name: method for method in (DiLoCoMethod(),)}
"""The training methods ``--hooks`` accepts beside the registry hooks, by name."""


def method_named(name: str) -> TrainingMethod | None:
    """The method called ``name`` (case, '_' and '-' ignored, as for hook names), or None for a hook."""
    key = name.strip().lower().replace("_", "").replace("-", "")
    return next((method for known, method in METHODS.items() if known.replace("_", "") == key), None)
