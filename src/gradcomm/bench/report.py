"""Turning the ranks' measurements into the bench's table, results.json, results.csv and plot.png.

Per hook: final loss and metric, MB handed to collectives per step per rank, compression ratio against the
dense buckets, compute time (no network), measured step time, and the step time projected at 1, 10 and
100 Gbit/s as ``compute + wire bytes / rate``, where wire bytes are what ring collectives put on each rank's
link for the measured inputs (see :func:`gradcomm.comm.wire_bytes`). With a shaped link, the *physical floor*
is the same at the link's rate, and ``measured / floor`` says how close the run came to it. On emulated hosts
(``--nodes``) the floor is instead ``compute + host-link bytes / rate``, from the bytes measured on the most
loaded host link in its busier direction (:func:`host_link_bytes_per_step`): what crossed between hosts.
"""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "HookSummary", "PROJECTION_RATES", "host_link_bytes_per_step", "print_table", "summarize", "write_outputs"
]

PROJECTION_RATES = {"1gbit": 1e9, "10gbit": 10e9, "100gbit": 100e9}


@dataclass
class HookSummary:
    label: str
    final_loss: float
    final_metric: float
    metric_name: str
    mb_per_step: float
    compression_ratio: float
    compute_ms: float
    measured_ms: float
    projected_ms: dict[str, float]
    floor_ms: float | None = None
    measured_over_floor: float | None = None
    host_link_mb_per_step: float | None = None


def host_link_bytes_per_step(rank_runs: list[dict[str, Any]], warmup: int) -> float | None:
    """Bytes per steady step over the busiest emulated host link, in its busier direction; None without.

    ``rank_runs`` holds one hook's run from every rank; those that read their host's link carry
    ``host_link_bytes``, the link's (sent, received) bytes after each step. The mean over the steps from
    ``warmup`` on is taken from the counters' totals, so that traffic a host saw late or early in one step is
    counted in the next or previous one.
    """
    per_step = []
    for run in rank_runs:
        counters = run.get("host_link_bytes")
        if not counters:
            continue
        first = min(warmup, len(counters) - 1)
        before = counters[first - 1] if first > 0 else (0, 0)
        steps = len(counters) - first
        per_step += [(counters[-1][way] - before[way]) / steps for way in (0, 1)]
    return max(per_step) if per_step else None


def summarize(
    run: dict[str, Any], warmup: int, bandwidth_bps: float | None = None, host_link_bytes: float | None = None
) -> HookSummary:
    """Steady-state figures of one hook's run (steps from ``warmup`` on).

    With ``host_link_bytes`` (per step, :func:`host_link_bytes_per_step`) the floor is the time to move them at
    ``bandwidth_bps`` rather than the ranks' own wire bytes.
    """
    steady = slice(min(warmup, len(run["step_seconds"]) - 1), None)
    sent = statistics.median(run["bytes_per_step"][steady])
    wire = statistics.median(run["wire_bytes_per_step"][steady])
    compute = run["compute_seconds"]
    measured = statistics.median(run["step_seconds"][steady])

    def projected(rate: float) -> float:
        return 1e3 * (compute + 8 * wire / rate)

    floor = projected(bandwidth_bps) if bandwidth_bps else None
    if bandwidth_bps and host_link_bytes is not None:
        floor = 1e3 * (compute + 8 * host_link_bytes / bandwidth_bps)
    return HookSummary(
        label=run["label"],
        final_loss=run["final_loss"],
        final_metric=run["final_metric"],
        metric_name=run["metric_name"],
        mb_per_step=sent / 1e6,
        compression_ratio=run["dense_bytes_per_step"] / sent if sent else float("inf"),
        compute_ms=1e3 * compute,
        measured_ms=1e3 * measured,
        projected_ms={name: projected(rate) for name, rate in PROJECTION_RATES.items()},
        floor_ms=floor,
        measured_over_floor=1e3 * measured / floor if floor else None,
        host_link_mb_per_step=host_link_bytes / 1e6 if host_link_bytes is not None else None,
    )


def print_table(summaries: list[HookSummary], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    metric = summaries[0].metric_name if summaries else "metric"
    table = Table(title=title)
    for column in ("hook", "final loss", metric, "MB/step/rank", "compression", "compute ms", "measured ms"):
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
    for s in summaries:
        row = [
            s.label,
            f"{s.final_loss:.3f}",
            f"{s.final_metric:.3f}",
            f"{s.mb_per_step:.3f}",
            f"{s.compression_ratio:.1f}x",
            f"{s.compute_ms:.1f}",
            f"{s.measured_ms:.1f}",
            *(f"{s.projected_ms[name]:.1f}" for name in PROJECTION_RATES),
        ]
        if with_host_link:
            row.append(f"{s.host_link_mb_per_step:.3f}" if s.host_link_mb_per_step is not None else "-")
        if with_floor:
            row += [f"{s.floor_ms:.1f}", f"{s.measured_over_floor:.2f}"]
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # a file or pipe: don't squeeze the table to 80 columns
    console.print(table)


def write_outputs(
    directory: Path, config: dict[str, Any], runs: list[list[dict[str, Any]]], summaries: list[HookSummary]
) -> dict[str, Path]:
    """Write results.json (config, summaries, every rank's per-step series), results.csv and plot.png."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {name: directory / name for name in ("results.json", "results.csv", "plot.png")}
    document = {"config": config, "summaries": [asdict(s) for s in summaries], "runs_by_rank": runs}
    paths["results.json"].write_text(json.dumps(document, indent=1, default=str))
    with paths["results.csv"].open("w", newline="") as stream:
        rows = [_flat(s) for s in summaries]
        writer = csv.DictWriter(stream, fieldnames=list(rows[0]) if rows else ["label"])
        writer.writeheader()
        writer.writerows(rows)
    _plot(paths["plot.png"], runs[0], config)
    return paths


def _flat(summary: HookSummary) -> dict[str, Any]:
    row = asdict(summary)
    for name, value in row.pop("projected_ms").items():
        row[f"projected_ms_{name}"] = value
    return row


def _plot(path: Path, rank_zero_runs: list[dict[str, Any]], config: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in rank_zero_runs:
        smoothed = _ema(run["losses"])
        cumulative_mb = [sum(run["bytes_per_step"][: i + 1]) / 1e6 for i in range(len(run["bytes_per_step"]))]
        (line,) = by_step.plot(smoothed, label=run["label"])
        by_bytes.plot(cumulative_mb, smoothed, label=run["label"], color=line.get_color())
    by_step.set(xlabel="step", ylabel="training loss (EMA 0.9)", title="loss against step")
    by_bytes.set(
        xlabel="cumulative MB handed to collectives (rank 0)", ylabel="training loss (EMA 0.9)", xscale="symlog",
        title="loss against bytes sent",
    )
    by_step.legend()
    figure.suptitle(f"gradcomm bench: {config.get('workload')} on {config.get('world_size')} ranks"
                    + (f" at {config['bandwidth']}" if config.get("bandwidth") else ""))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _ema(values: list[float], decay: float = 0.9) -> list[float]:
    smoothed, current = [], values[0] if values else 0.0
    for value in values:
        current = decay * current + (1 - decay) * value
        smoothed.append(current)
    return smoothed
