"""What each rank does in ``gradcomm bench``: train the workload once per hook and measure it.

A choice of ``--hooks`` is a registry hook (gradcomm's DDP with that hook) or a training method of
:mod:`gradcomm.bench.methods` (DiLoCo); both are built and stepped through a :class:`~gradcomm.bench.methods.Trainer`.
For every choice, with the same seed and data:

1. *Compute time*: a few steps of the same model and hook on a process group of this rank alone, so
   every cost but the network (forward, backward, optimizer, the hook's encoding and decoding) is counted.
2. *Training*: ``steps`` steps on all ranks with gradcomm's DDP and the hook, recording per step the loss,
   the wall time, and the bytes the hook handed to collectives and put on the wire (from the DDP's telemetry,
   each collective at its own group's size).
3. *Evaluation*: loss and metric of the trained model on held-out data.

Steady-state figures (median step time, bytes per step) skip the first ``warmup`` steps, which include the
bucket rebuild and, for PowerSGD, its allreduce warm-up iterations. A method that syncs every few steps
(DiLoCo) is summarised by means instead (``HookRun.steady_statistic``, :func:`gradcomm.bench.report.summarize`).

On emulated hosts (``gradcomm bench --nodes``) the rank that reads its host's link (``BenchConfig.host_link``,
one per host) also records after every training step the bytes the link has sent and received since the
hook's training began: what actually crossed between hosts.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradcomm.bench.methods import METHODS, Trainer, TrainingMethod, method_named
from gradcomm.bench.workloads import WORKLOADS, Workload
from gradcomm.comm.faults import derived_group_timeout
from gradcomm.ddp.distributed import DistributedDataParallel
from gradcomm.hooks.registry import apply_option_defaults, check_options, make_comm_hook, resolve_hook_name
from gradcomm.testing.network import link_byte_counters

__all__ = ["BenchConfig", "HookChoice", "HookRun", "bench_rank", "hook_options"]

logger = logging.getLogger(__name__)

# Options the bench sets for every hook that accepts them, unless the hook choice sets them itself.
BENCH_OPTION_DEFAULTS = {"start_powerSGD_iter": 10}


@dataclass(frozen=True)
class HookChoice:
    """A registry hook name or a training method (:data:`gradcomm.bench.methods.METHODS`) with options,
    written ``name`` or ``name:key=value,key=value``."""

    name: str
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> HookChoice:
        """Raises ValueError for a malformed option, an unknown name (listing the valid ones) and, for a
        method, an unknown option or a bad value (hooks' values are checked by :meth:`checked_options`)."""
        name, _, rest = text.strip().partition(":")
        options = []
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"hook option {item!r} in {text!r} is not key=value")
            options.append((key.strip(), value.strip()))
        method = method_named(name)
        if method is not None:
            method.check(dict(options))
            return cls(method.name, tuple(options))
        try:
            resolve_hook_name(name)
        except ValueError as exc:
            raise ValueError(f"{exc}; training methods: {', '.join(METHODS)}") from None
        return cls(name.strip(), tuple(options))

    @property
    def method(self) -> TrainingMethod | None:
        """The training method this choice names, or None for a registry hook."""
        return method_named(self.name)

    @property
    def label(self) -> str:
        shown = {"matrix_approximation_rank": "rank"}
        if not self.options:
            return self.name
        return f"{self.name}({', '.join(f'{shown.get(k, k)}={v}' for k, v in self.options)})"

    def with_defaults(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """This choice's options with the bench ``defaults`` added wherever a hook of the choice takes them and
        the choice does not set them: the hook, ``hierarchical``'s inner hook, ``auto``'s candidates
        (:func:`gradcomm.hooks.registry.apply_option_defaults`); for a method, its hook options (DiLoCo's
        compressor)."""
        if self.method is not None:
            return self.method.with_defaults(dict(self.options), defaults)
        return apply_option_defaults(self.name, dict(self.options), defaults)

    def resolved(self, defaults: dict[str, Any]) -> HookChoice:
        """This choice with the options it runs with (:meth:`with_defaults`), so that its label shows them all."""
        return HookChoice(self.name, tuple((key, str(value)) for key, value in self.with_defaults(defaults).items()))

    def takes(self, key: str, value: Any) -> bool:
        """Whether a bench default ``key=value`` would reach a hook of this choice that does not set it."""
        options = {k: v for k, v in self.options if k != key}
        return HookChoice(self.name, tuple(options.items())).with_defaults({key: value}) != options

    def checked_options(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """:meth:`with_defaults`, converted and checked as the ranks' ``make_comm_hook`` will.

        Raises:
            ValueError, TypeError, ImportError: as :func:`gradcomm.hooks.registry.check_options`.
        """
        if self.method is not None:
            return self.method.check(self.with_defaults(defaults))
        return check_options(self.name, **self.with_defaults(defaults))


def hook_options(name: str) -> tuple[str, ...]:
    """The options the hook or method called ``name`` accepts, less those a hook's registry entry fixes."""
    method = method_named(name)
    if method is not None:
        return method.option_names()
    spec = resolve_hook_name(name).value
    fixed = dict(spec.presets)
    return tuple(option for option in spec.option_names if option not in fixed)


@dataclass
class BenchConfig:
    workload: str = "transformer"
    hooks: list[HookChoice] = field(default_factory=list)
    steps: int = 150
    warmup: int = 10
    calibration_steps: int = 8
    seed: int = 0
    lr: float = 1e-3
    bucket_cap_mb: float | None = None
    option_defaults: dict[str, Any] = field(default_factory=lambda: dict(BENCH_OPTION_DEFAULTS))
    device: str = "cpu"
    project: str | None = None
    """A link rate to project times to the target loss at (``--project``), as given; checked by the CLI."""
    target_loss: float | None = None
    """The target loss given by the user (``--target-loss``); ``None``: chosen from the runs."""
    host_link: str | None = None  # interface of this rank's emulated host link, whose counters it records


@dataclass
class HookRun:
    """One hook's measurements on one rank (losses are averaged over ranks)."""

    label: str
    hook: str
    options: dict[str, Any]
    """A hook's options as it ran them (given, and the bench's defaults); a method's every option, converted,
    its defaults included (they are the method's, not the library's)."""
    rank: int
    world_size: int
    losses: list[float]
    step_seconds: list[float]
    bytes_per_step: list[int]
    wire_bytes_per_step: list[float]
    dense_bytes_per_step: int
    dense_wire_bytes_per_step: float
    compute_seconds: float
    final_loss: float
    final_metric: float
    metric_name: str
    host_link_bytes: list[tuple[int, int]] | None = None  # (sent, received) since training began, per step
    steady_statistic: str = "median"
    """How the report summarises bytes and step times (:func:`gradcomm.bench.report.summarize`): ``median``
    of the steady steps, or ``mean`` (a method whose syncs are periodic: bytes over every step)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _train_step(ddp: nn.Module, optimizer: torch.optim.Optimizer, workload: Workload, batch: Any) -> torch.Tensor:
    inputs, target = batch
    loss = workload.loss(ddp(inputs), target)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _wrapped(workload: Workload, model: nn.Module, choice: HookChoice, config: BenchConfig, group: Any) -> Any:
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=config.bucket_cap_mb)
    hook, state = make_comm_hook(choice.name, process_group=group, **choice.with_defaults(config.option_defaults))
    ddp.register_comm_hook(state, hook)
    return ddp


class HookTrainer(Trainer):
    """gradcomm's DDP with the choice's hook and AdamW; bytes from the DDP's telemetry of each step."""

    def __init__(self, workload: Workload, model: nn.Module, choice: HookChoice, config: BenchConfig, group: Any):
        self.workload = workload
        self.ddp = _wrapped(workload, model, choice, config, group)
        self.optimizer = torch.optim.AdamW(self.ddp.parameters(), lr=config.lr)
        self.stats = self.ddp.comm_stats()

    def step(self, batch: Any) -> torch.Tensor:
        return _train_step(self.ddp, self.optimizer, self.workload, batch)

    def step_bytes(self) -> tuple[int, float]:
        return self.stats.last.bytes_sent, self.stats.last.wire_bytes

    def dense_bytes(self) -> tuple[int, float]:
        return self.stats.last.dense_bytes, self.stats.last.dense_wire_bytes

    def finished_model(self) -> nn.Module:
        return self.ddp.module


def _trainer(workload: Workload, model: nn.Module, choice: HookChoice, config: BenchConfig, group: Any) -> Trainer:
    """The choice's trainer of ``model`` on ``group`` (``None``: every rank): its method's, or a hooked DDP."""
    if choice.method is not None:
        return choice.method.trainer(workload, model, choice.with_defaults(config.option_defaults), config.lr, group)
    return HookTrainer(workload, model, choice, config, group)


def _compute_seconds(
    workload: Workload, model: nn.Module, choice: HookChoice, config: BenchConfig, solo_group: Any
) -> float:
    """Median step time of the same model and hook (or method) on a group of this rank alone: all but the
    network."""
    trainer = _trainer(workload, copy.deepcopy(model), choice, config, solo_group)
    rank = dist.get_rank()
    times = []
    for step in range(config.warmup + config.calibration_steps):
        batch = workload.batch(rank, step)
        start = time.perf_counter()
        trainer.step(batch)
        _synchronize(config.device)
        if step >= config.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hook(
    workload: Workload, choice: HookChoice, config: BenchConfig, solo_group: Any, progress: Any = None
) -> HookRun:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.seed)
    model = workload.build_model()
    logger.info("%s: measuring the compute time on this rank alone", choice.label)
    compute = _compute_seconds(workload, model, choice, config, solo_group)
    logger.info("%s: training %d steps on %d ranks", choice.label, config.steps, world_size)
    trainer = _trainer(workload, model, choice, config, None)
    # Building the trainer broadcasts rank 0's parameters; a shaped link may still be sending them when the
    # constructor returns on rank 0. Once every rank has passed the barrier, they have all arrived, so the link's
    # counters below start from training alone.
    dist.barrier()
    losses, seconds, sent, wire = [], [], [], []
    link: list[tuple[int, int]] | None = None
    if config.host_link is not None:
        link, link_start = [], link_byte_counters(config.host_link)
    for step in range(config.steps):
        batch = workload.batch(rank, step)
        start = time.perf_counter()
        loss = trainer.step(batch)
        _synchronize(config.device)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
        step_sent, step_wire = trainer.step_bytes()
        sent.append(step_sent)
        wire.append(step_wire)
        if link is not None:
            tx, rx = link_byte_counters(config.host_link)
            link.append((tx - link_start[0], rx - link_start[1]))
        if progress is not None:
            progress(choice.label, step + 1)
    averaged = torch.tensor(losses, dtype=torch.float64, device=config.device)
    dist.all_reduce(averaged)
    final_loss, final_metric = workload.evaluate(trainer.finished_model())
    logger.info("%s: done; final loss %.4f, %s %.4f", choice.label, final_loss, workload.metric_name, final_metric)
    dense, dense_wire = trainer.dense_bytes()
    return HookRun(
        label=choice.label,
        hook=choice.name,
        options=choice.checked_options(config.option_defaults) if choice.method else choice.with_defaults(
            config.option_defaults
        ),
        rank=rank,
        world_size=world_size,
        losses=(averaged / world_size).tolist(),
        step_seconds=seconds,
        bytes_per_step=sent,
        wire_bytes_per_step=wire,
        dense_bytes_per_step=dense,
        dense_wire_bytes_per_step=dense_wire,
        compute_seconds=compute,
        final_loss=final_loss,
        final_metric=final_metric,
        metric_name=workload.metric_name,
        host_link_bytes=link,
        steady_statistic=trainer.steady_statistic,
    )


def solo_groups() -> list[Any]:
    """A group of each rank alone, for measuring compute without the network; a collective: every rank creates
    every group, in the same order. Each takes the default group's timeout, as every group gradcomm makes."""
    timeout = derived_group_timeout()
    return [dist.new_group([r], timeout=timeout) for r in range(dist.get_world_size())]


def bench_rank(config: BenchConfig, progress_queue: Any = None, finished_dir: str | None = None) -> list[dict[str, Any]]:
    """Run every hook of ``config`` on this rank; return one :class:`HookRun` dict per hook. With
    ``finished_dir``, the runs finished so far are also written there after each hook (``rank<r>.json``), so
    that a run stopped by ``--timeout`` still reports the hooks every rank finished."""
    workload = WORKLOADS[config.workload](device=config.device)
    rank = dist.get_rank()
    solo = solo_groups()
    report = None
    if progress_queue is not None and rank == 0:
        def report(label: str, step: int) -> None:
            progress_queue.put((label, step))

    runs = []
    for choice in config.hooks:
        runs.append(run_hook(workload, choice, config, solo[rank], report).as_dict())
        if finished_dir is not None:
            _write_finished(Path(finished_dir) / f"rank{rank}.json", runs)
    dist.barrier()
    return runs


def _write_finished(path: Path, runs: list[dict[str, Any]]) -> None:
    staged = path.with_suffix(".tmp")
    staged.write_text(json.dumps(runs))
    os.replace(staged, path)


def finished_runs(finished_dir: Path, world_size: int) -> list[list[dict[str, Any]]]:
    """The hooks every rank finished before a run was stopped, per rank, as :func:`bench_rank` returns them
    (empty when some rank finished none)."""
    try:
        per_rank = [json.loads((finished_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
    except (OSError, ValueError):
        return []
    done = min(len(runs) for runs in per_rank)
    return [runs[:done] for runs in per_rank] if done else []
