"""Turning the ranks' measurements into the bench's table, results.json, results.csv and plot.png.

Per hook: final loss and metric, MB handed to collectives per step per rank, two compression ratios (see
:mod:`gradcomm.comm.telemetry`: *handed*, dense bucket bytes over bytes handed to collectives, and *wire*, what
a plain allreduce of the buckets puts on the link over what the hook put there), compute time (no network),
measured step time, and the step time projected at 1, 10 and 100 Gbit/s as ``compute + wire bytes / rate``,
where wire bytes are what ring collectives put on each rank's link for the measured inputs (see
:func:`gradcomm.comm.group_wire_bytes`). With a shaped link, the *physical floor* is the same at the link's
rate, and ``measured / floor`` says how close the run came to it. On emulated hosts (``--nodes``) the floor
is instead ``compute + host-link bytes / rate``, from the bytes measured on the most loaded host link in its
busier direction (:func:`host_link_bytes_per_step`): what crossed between hosts.

*Time to target loss* answers the bench's question in time: the wall-clock seconds (rank 0's measured step
times, summed from the first step: warm-up steps are real time too) until the training loss, smoothed by the
same exponential moving average for every hook (:func:`smoothed`, decay 0.9, as plotted), first reaches the
target. The target is given, or allreduce's final smoothed loss plus :data:`TARGET_MARGIN` of it (the best
final smoothed loss among the hooks when allreduce is not run): see :func:`choose_target`. A hook that never
reaches it has ``None`` (``null`` in results.json, an empty cell in results.csv, "not reached" in the table).
With a projection rate (``--project``, else a shaped link's rate), the same is computed with each step's
time projected as ``compute + that step's wire bytes / rate``.

A training method such as DiLoCo (:mod:`gradcomm.bench.methods`) sends only on its sync steps: its bytes per
step and step time are means, not medians (:func:`summarize`), and its projections take each step's own bytes
(0 between syncs). Its time to target follows the mean over ranks of the inner training losses, as for hooks.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gradcomm.comm.telemetry import byte_ratio

__all__ = [
    "HookSummary",
    "PROJECTION_RATES",
    "TARGET_MARGIN",
    "Projection",
    "Target",
    "choose_target",
    "host_link_bytes_per_step",
    "print_table",
    "projected_step_seconds",
    "smoothed",
    "summarize",
    "time_to_loss",
    "write_outputs",
]

PROJECTION_RATES = {"1gbit": 1e9, "10gbit": 10e9, "100gbit": 100e9}

TARGET_MARGIN = 0.02
"""The default target loss is the reference's final smoothed loss plus this fraction of its magnitude: close
enough to mean "trained as well", loose enough that noise in the last steps does not decide it."""

EMA_DECAY = 0.9
"""Decay of the moving average that smooths every hook's training loss (plots and time to target)."""


@dataclass(frozen=True)
class Target:
    """The loss the time-to-target column counts to, and how it was chosen (for the title and results.json)."""

    loss: float
    rule: str


@dataclass(frozen=True)
class Projection:
    """A link rate to project step times at: its name as given (``100mbit``) and bits per second."""

    name: str
    bps: float


@dataclass
class HookSummary:
    label: str
    final_loss: float
    final_metric: float
    metric_name: str
    mb_per_step: float
    handed_ratio: float
    wire_ratio: float
    compute_ms: float
    measured_ms: float
    projected_ms: dict[str, float]
    floor_ms: float | None = None
    measured_over_floor: float | None = None
    time_to_target_s: float | None = None
    projected_time_to_target_s: float | None = None
    host_link_mb_per_step: float | None = None


def smoothed(losses: Sequence[float], decay: float = EMA_DECAY) -> list[float]:
    """The exponential moving average of ``losses``, started at the first loss (no bias towards 0)."""
    averaged, current = [], losses[0] if losses else 0.0
    for value in losses:
        current = decay * current + (1 - decay) * value
        averaged.append(current)
    return averaged


def choose_target(runs: Sequence[dict[str, Any]], given: float | None = None, margin: float = TARGET_MARGIN) -> Target:
    """The target loss: ``given``, else allreduce's final smoothed training loss plus ``margin`` of its
    magnitude; without an allreduce run (or if its loss diverged), the best (lowest) finite final smoothed loss
    among ``runs`` plus the margin; ``nan`` (reached by none) if every run diverged.

    Raises:
        ValueError: no runs.
    """
    if given is not None:
        return Target(given, "given (--target-loss)")
    if not runs:
        raise ValueError("choose_target: no runs to take the target loss from")
    from gradcomm.bench.methods import method_named
    from gradcomm.hooks.registry import resolve_hook_name

    allreduce = resolve_hook_name("allreduce")
    finals = {run["label"]: smoothed(run["losses"])[-1] for run in runs}
    finite = {label: loss for label, loss in finals.items() if math.isfinite(loss)}
    hooks = [run for run in runs if method_named(run["hook"]) is None]  # a method is no reference
    reference = next((run["label"] for run in hooks if resolve_hook_name(run["hook"]) is allreduce), None)
    if reference in finite:
        source = f"{reference}'s final smoothed loss"
    elif finite:
        reference = min(finite, key=finite.__getitem__)
        source = f"the best final smoothed loss ({reference}'s)"
    else:
        return Target(math.nan, "none: every run's training loss diverged; give --target-loss")
    final = finals[reference]
    return Target(final + margin * abs(final), f"{source} + {100 * margin:g}%")


def time_to_loss(step_seconds: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """Seconds (summed step times, the first step's included) until the smoothed ``losses`` first reach
    ``target``; ``None`` if they never do."""
    if len(step_seconds) != len(losses):
        raise ValueError(f"time_to_loss: {len(step_seconds)} step times for {len(losses)} losses")
    for elapsed, loss in zip(itertools.accumulate(step_seconds), smoothed(losses), strict=True):
        if loss <= target:
            return elapsed
    return None


def projected_step_seconds(
    run: dict[str, Any], rate_bps: float, wire_bytes_per_step: Sequence[float] | None = None
) -> list[float]:
    """Each step's time at ``rate_bps``: the run's compute time plus that step's wire bytes over the rate
    (``wire_bytes_per_step``, else the run's own)."""
    wire_bytes = run["wire_bytes_per_step"] if wire_bytes_per_step is None else wire_bytes_per_step
    return [run["compute_seconds"] + 8 * wire / rate_bps for wire in wire_bytes]


def host_link_bytes_per_step(rank_runs: list[dict[str, Any]], warmup: int) -> float | None:
    """Bytes per steady step over the busiest emulated host link, in its busier direction; None without.

    ``rank_runs`` holds one hook's run from every rank; those that read their host's link carry
    ``host_link_bytes``, the link's (sent, received) bytes after each step. The mean over the steps from
    ``warmup`` on (for a run summarised by means, such as DiLoCo's, over every step, as its own bytes are:
    see :func:`summarize`) is taken from the counters' totals, so that traffic a host saw late or early in one
    step is counted in the next or previous one.
    """
    per_step = []
    for run in rank_runs:
        counters = run.get("host_link_bytes")
        if not counters:
            continue
        first = 0 if run.get("steady_statistic", "median") == "mean" else min(warmup, len(counters) - 1)
        before = counters[first - 1] if first > 0 else (0, 0)
        steps = len(counters) - first
        per_step += [(counters[-1][way] - before[way]) / steps for way in (0, 1)]
    return max(per_step) if per_step else None


def summarize(
    run: dict[str, Any],
    warmup: int,
    bandwidth_bps: float | None = None,
    target: Target | None = None,
    projection: Projection | None = None,
    host_link_bytes: float | None = None,
) -> HookSummary:
    """Steady-state figures of one hook's run (steps from ``warmup`` on), and its times to ``target``
    (measured, and at ``projection``'s rate when given).

    Bytes and step times are the median of the steady steps, or, for a run whose ``steady_statistic`` is
    ``mean`` (a training method that syncs every few steps, such as DiLoCo, whose median step sends
    nothing), the mean bytes over every step of the run (its sync schedule starts at step 1) and the mean
    step time from ``warmup`` on.

    With ``host_link_bytes`` (per step, :func:`host_link_bytes_per_step`: emulated hosts) the floor and every
    projection move those bytes, what crossed between hosts, rather than the ranks' own wire bytes, which
    include their traffic inside a host.
    """
    steady = slice(min(warmup, len(run["step_seconds"]) - 1), None)
    if run.get("steady_statistic", "median") == "mean":
        sent = statistics.fmean(run["bytes_per_step"])
        wire = statistics.fmean(run["wire_bytes_per_step"]) if host_link_bytes is None else host_link_bytes
        measured = statistics.fmean(run["step_seconds"][steady])
    else:
        sent = statistics.median(run["bytes_per_step"][steady])
        wire = statistics.median(run["wire_bytes_per_step"][steady]) if host_link_bytes is None else host_link_bytes
        measured = statistics.median(run["step_seconds"][steady])
    compute = run["compute_seconds"]

    def projected(rate: float) -> float:
        return 1e3 * (compute + 8 * wire / rate)

    floor = projected(bandwidth_bps) if bandwidth_bps else None
    to_target = projected_to_target = None
    if target is not None:
        to_target = time_to_loss(run["step_seconds"], run["losses"], target.loss)
        if projection is not None:
            step_wire = None if host_link_bytes is None else [host_link_bytes] * len(run["losses"])
            projected_to_target = time_to_loss(
                projected_step_seconds(run, projection.bps, step_wire), run["losses"], target.loss
            )
    return HookSummary(
        label=run["label"],
        final_loss=run["final_loss"],
        final_metric=run["final_metric"],
        metric_name=run["metric_name"],
        mb_per_step=sent / 1e6,
        handed_ratio=byte_ratio(run["dense_bytes_per_step"], sent),
        wire_ratio=byte_ratio(run["dense_wire_bytes_per_step"], wire),
        compute_ms=1e3 * compute,
        measured_ms=1e3 * measured,
        projected_ms={name: projected(rate) for name, rate in PROJECTION_RATES.items()},
        floor_ms=floor,
        measured_over_floor=1e3 * measured / floor if floor else None,
        time_to_target_s=to_target,
        projected_time_to_target_s=projected_to_target,
        host_link_mb_per_step=host_link_bytes / 1e6 if host_link_bytes is not None else None,
    )


def print_table(summaries: list[HookSummary], title: str, projection: Projection | None = None) -> None:
    """Print the summaries as a table; ``projection``: the rate of the projected time-to-target column."""
    from rich.console import Console
    from rich.table import Table

    metric = summaries[0].metric_name if summaries else "metric"
    table = Table(title=title)
    columns = ("hook", "final loss", metric, "MB/step/rank", "handed ratio", "wire ratio", "compute ms", "measured ms")
    for column in columns:
        table.add_column(column, justify="left" if column == "hook" else "right")
    for name in PROJECTION_RATES:
        table.add_column(f"@{name} ms", justify="right")
    with_host_link = any(s.host_link_mb_per_step is not None for s in summaries)
    if with_host_link:
        table.add_column("host-link MB/step", justify="right")
    with_floor = any(s.floor_ms is not None for s in summaries)
    if with_floor:
        table.add_column("floor ms", justify="right")
        table.add_column("measured/floor", justify="right")
    table.add_column("s to target", justify="right")
    if projection is not None:
        table.add_column(f"@{projection.name} s to target", justify="right")
    for s in summaries:
        row = [
            s.label,
            f"{s.final_loss:.3f}",
            f"{s.final_metric:.3f}",
            f"{s.mb_per_step:.3f}",
            _times(s.handed_ratio),
            _times(s.wire_ratio),
            f"{s.compute_ms:.1f}",
            f"{s.measured_ms:.1f}",
            *(f"{s.projected_ms[name]:.1f}" for name in PROJECTION_RATES),
        ]
        if with_host_link:
            row.append(f"{s.host_link_mb_per_step:.3f}" if s.host_link_mb_per_step is not None else "-")
        if with_floor:
            row += [f"{s.floor_ms:.1f}", f"{s.measured_over_floor:.2f}"]
        row.append(_seconds(s.time_to_target_s))
        if projection is not None:
            row.append(_seconds(s.projected_time_to_target_s))
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:
        console = Console(width=260)  # a file or pipe: don't squeeze the table to 80 columns
    console.print(table)


def _times(ratio: float) -> str:
    return "n/a" if math.isnan(ratio) else f"{ratio:.1f}x"


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.2f}"


def write_outputs(
    directory: Path,
    config: dict[str, Any],
    runs: list[list[dict[str, Any]]],
    summaries: list[HookSummary],
    target: Target | None = None,
    projection: Projection | None = None,
) -> dict[str, Path]:
    """Write results.json (config, summaries, every rank's per-step series), results.csv and plot.png (loss
    against step, bytes and seconds, with the ``target`` line and the curves projected at ``projection``)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {name: directory / name for name in ("results.json", "results.csv", "plot.png")}
    document = {"config": config, "summaries": [asdict(s) for s in summaries], "runs_by_rank": runs}
    paths["results.json"].write_text(json.dumps(document, indent=1, default=str))
    with paths["results.csv"].open("w", newline="") as stream:
        rows = [_flat(s) for s in summaries]
        writer = csv.DictWriter(stream, fieldnames=list(rows[0]) if rows else ["label"])
        writer.writeheader()
        writer.writerows(rows)
    host_link = [None if s.host_link_mb_per_step is None else 1e6 * s.host_link_mb_per_step for s in summaries]
    _plot(paths["plot.png"], runs[0], config, target, projection, host_link)
    return paths


def _flat(summary: HookSummary) -> dict[str, Any]:
    row = asdict(summary)
    for name, value in row.pop("projected_ms").items():
        row[f"projected_ms_{name}"] = value
    return row


def _plot(
    path: Path,
    rank_zero_runs: list[dict[str, Any]],
    config: dict[str, Any],
    target: Target | None = None,
    projection: Projection | None = None,
    host_link_bytes: Sequence[float | None] | None = None,
) -> None:
    """``host_link_bytes``: per hook, the bytes per step that crossed the emulated hosts' link, which the
    projection then moves (as the table's), or ``None``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_bytes, by_time) = plt.subplots(1, 3, figsize=(18, 4.5))
    ylabel = f"training loss (EMA {EMA_DECAY:g})"
    for index, run in enumerate(rank_zero_runs):
        losses = smoothed(run["losses"])
        cumulative_mb = [total / 1e6 for total in itertools.accumulate(run["bytes_per_step"])]
        (line,) = by_step.plot(losses, label=run["label"])
        color = line.get_color()
        by_bytes.plot(cumulative_mb, losses, label=run["label"], color=color)
        by_time.plot(list(itertools.accumulate(run["step_seconds"])), losses, label=run["label"], color=color)
        if projection is not None:
            crossing = host_link_bytes[index] if host_link_bytes else None
            step_wire = None if crossing is None else [crossing] * len(losses)
            seconds = list(itertools.accumulate(projected_step_seconds(run, projection.bps, step_wire)))
            by_time.plot(seconds, losses, color=color, linestyle="--")
    by_step.set(xlabel="step", ylabel=ylabel, title="loss against step")
    by_bytes.set(
        xlabel="cumulative MB handed to collectives (rank 0)", ylabel=ylabel, xscale="symlog",
        title="loss against bytes sent",
    )
    time_title = "loss against time (measured"
    time_title += f"; dashed: projected at {projection.name})" if projection is not None else ")"
    by_time.set(xlabel="wall-clock seconds (rank 0, warm-up included)", ylabel=ylabel, title=time_title)
    if target is not None and math.isfinite(target.loss):
        by_time.axhline(target.loss, color="grey", linestyle=":", linewidth=1, label=f"target {target.loss:.4g}")
    # one legend under the panels: hook labels with options are too long to sit inside a panel
    handles, labels = by_time.get_legend_handles_labels()
    rows = math.ceil(len(labels) / 3)
    figure.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize="small", frameon=False)
    figure.suptitle(f"gradcomm bench: {config.get('workload')} on {config.get('world_size')} ranks"
                    + (f" at {config['bandwidth']}" if config.get("bandwidth") else ""))
    figure.tight_layout(rect=(0, min(0.4, 0.06 * rows), 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
