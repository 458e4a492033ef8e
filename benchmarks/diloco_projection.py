"""DiLoCo's rows of ``gradcomm bench`` runs projected onto a slow link, with and without overlap (issue 35).

Reads the ``results.json`` of one or more bench output folders (rank 0's runs, the same workload, steps and
seed; a label seen twice keeps its first run) and prints, at ``--rate``:

1. Time to target: the target is allreduce's final smoothed training loss + 2% (the bench's rule,
   :func:`gradcomm.bench.report.choose_target`), each run's time to reach it with every step costing its
   measured compute time plus its own wire bytes over the rate (the bench's ``--project``:
   :func:`~gradcomm.bench.report.projected_step_seconds`), and how many times shorter DiLoCo's is than
   allreduce's and the best per-step hook's.
2. Overlap: the bench's projection charges an exchange to the step that launches it. A DiLoCo run with
   ``overlap=k`` only waits for it ``k`` steps later, so here the link is modelled as one queue: an exchange
   starts when launched and the link is free, lasts its wire bytes over the rate, and the step that applies
   it (``k`` steps after the launch) waits for its end. The mean step time is set against the compute step
   (no network): Streaming DiLoCo's promise is that it stays within a few percent of it.

On emulated hosts (``gradcomm bench --nodes``), a run's bytes are those that crossed the link between hosts
(its ``host_link_mb_per_step`` in the summaries, every step charged the same, as the bench's projection
does), not the ranks' own, which include their traffic inside a host; the overlap table is then left out.

Deterministic given the runs (the measured compute time is the only timing in it; the load on the machine
moves it, not the bytes).

    python benchmarks/diloco_projection.py OUT_4000_STEPS OUT_FRAGMENTS --rate 100mbit [--target-loss 1.9]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from gradcomm.bench.methods import method_named
from gradcomm.bench.report import choose_target, projected_step_seconds, time_to_loss
from gradcomm.testing.network.parsing import parse_rate

_WARMUP = 10  # the bench's default --warmup: the steps a hook's median leaves out


def load_runs(folders: list[Path]) -> list[dict[str, Any]]:
    """Rank 0's runs of every folder, first occurrence of each label kept; on emulated hosts each with
    ``host_link_bytes_per_step``, the bytes per step that crossed the host link (from the summaries)."""
    runs: dict[str, dict[str, Any]] = {}
    for folder in folders:
        document = json.loads((folder / "results.json").read_text())
        crossed = {s["label"]: s.get("host_link_mb_per_step") for s in document["summaries"]}
        for run in document["runs_by_rank"][0]:
            if crossed.get(run["label"]) is not None:
                run = {**run, "host_link_bytes_per_step": 1e6 * crossed[run["label"]]}
            runs.setdefault(run["label"], run)
    return list(runs.values())


def _link_bytes(run: dict[str, Any]) -> list[float] | None:
    """Each step's bytes over the link to project: the host link's on emulated hosts, else None (the run's
    own wire bytes)."""
    if "host_link_bytes_per_step" not in run:
        return None
    return [run["host_link_bytes_per_step"]] * len(run["losses"])


def overlapped_step_seconds(
    run: dict[str, Any], rate_bps: float, overlap: int, compute: float
) -> list[float]:
    """Each step's time (``compute`` seconds of it without the network) when the exchange launched after step
    ``s`` is waited for after step ``s + overlap`` (``overlap`` 0: at once, the bench's projection), the link
    carrying one exchange at a time."""
    now, link_free = 0.0, 0.0
    due: dict[int, float] = {}
    times = []
    for step, wire in enumerate(run["wire_bytes_per_step"], start=1):
        start = now
        now += compute
        if step in due:
            now = max(now, due.pop(step))
        if wire > 0:
            link_free = max(now, link_free) + 8 * wire / rate_bps
            if overlap == 0:
                now = link_free
            else:
                due[step + overlap] = link_free
        times.append(now - start)
    return times


def _bytes_per_step(run: dict[str, Any]) -> float:
    """As the bench reports them: a method's mean over every step, a hook's median over its steady steps."""
    if run.get("steady_statistic", "median") == "mean":
        return statistics.fmean(run["bytes_per_step"])
    return statistics.median(run["bytes_per_step"][_WARMUP:])


def _link_mb(run: dict[str, Any]) -> float:
    """MB per step the projection moves over the link: the host link's on emulated hosts, else the mean
    of the run's own wire bytes."""
    if "host_link_bytes_per_step" in run:
        return run["host_link_bytes_per_step"] / 1e6
    return statistics.fmean(run["wire_bytes_per_step"]) / 1e6


def _is_diloco(run: dict[str, Any]) -> bool:
    return method_named(run["hook"]) is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="gradcomm bench output folders")
    parser.add_argument("--rate", default="100mbit", help="link rate, e.g. 100mbit")
    parser.add_argument(
        "--target-loss", type=float, help="the smoothed training loss to reach (default: the bench's)"
    )
    parser.add_argument(
        "--compute-ms", type=float, help="every run's compute step (default: each run's measured one)"
    )
    args = parser.parse_args()
    rate = float(parse_rate(args.rate))
    runs = load_runs(args.folders)
    if args.compute_ms is not None:  # one compute step for every run: only losses and bytes differ
        runs = [{**run, "compute_seconds": args.compute_ms / 1e3} for run in runs]
    same_length = [run for run in runs if len(run["losses"]) == len(runs[0]["losses"])]
    target = choose_target(same_length, args.target_loss)
    print(
        f"Target: {target.loss:.4f} ({target.rule}); at {args.rate}, each step its compute + wire bytes / rate."
    )
    print()
    print(
        "| run | steps | final loss | MB/step on the link | fewer bytes than allreduce | projected s to target "
        "| allreduce / it | best per-step hook / it |"
    )
    print("|---|---|---|---|---|---|---|---|")
    reference = next((r for r in same_length if r["hook"] == "allreduce"), None)
    to_target = {
        run["label"]: time_to_loss(projected_step_seconds(run, rate, _link_bytes(run)), run["losses"], target.loss)
        for run in same_length
    }
    hooks = [r["label"] for r in same_length if not _is_diloco(r) and r["hook"] != "allreduce"]
    reached_hooks = [to_target[h] for h in hooks if to_target[h] is not None]
    best_hook = min(reached_hooks) if reached_hooks else None
    for run in same_length:
        seconds = to_target[run["label"]]
        loss = run["final_loss"]
        relative = f" ({100 * (loss / reference['final_loss'] - 1):+.1f}%)" if reference else ""
        if "host_link_bytes_per_step" in run and reference is not None and "host_link_bytes_per_step" in reference:
            fewer = reference["host_link_bytes_per_step"] / max(run["host_link_bytes_per_step"], 1e-12)
        else:
            fewer = run["dense_bytes_per_step"] / max(_bytes_per_step(run), 1e-12)
        allreduce = to_target.get(reference["label"]) if reference else None
        ratio = f"{allreduce / seconds:.1f}x" if seconds and allreduce else "-"
        against_hook = f"{best_hook / seconds:.1f}x" if seconds and best_hook else "-"
        shown = "not reached" if seconds is None else f"{seconds:.1f}"
        print(
            f"| {run['label']} | {len(run['losses'])} | {loss:.4f}{relative} | {_link_mb(run):.4f} | {fewer:.1f}x | "
            f"{shown} | {ratio} | {against_hook} |"
        )
    missed = [label for label, seconds in to_target.items() if seconds is None]
    if missed:
        print(f"\nNot reaching the target within the run: {', '.join(missed)}.")
    print()
    print(f"Overlap at {args.rate}: mean step time against the compute step (no network).")
    print()
    print(
        "| run | compute ms | peak MB of one exchange | mean ms/step, exchange blocking | mean ms/step, with its overlap | over compute | overlap that hides one exchange |"
    )
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        if not _is_diloco(run) or "host_link_bytes_per_step" in run:
            continue
        overlap = int(run["options"].get("overlap", 0))
        compute = run["compute_seconds"]
        blocking = 1e3 * statistics.fmean(overlapped_step_seconds(run, rate, 0, compute))
        overlapped = 1e3 * statistics.fmean(overlapped_step_seconds(run, rate, overlap, compute))
        peak = max(run["bytes_per_step"]) / 1e6
        hiding = math.ceil(8 * max(run["wire_bytes_per_step"]) / rate / compute)
        print(
            f"| {run['label']} | {1e3 * compute:.1f} | {peak:.3f} | {blocking:.1f} | {overlapped:.1f} | "
            f"{100 * (overlapped / (1e3 * compute) - 1):+.1f}% | {hiding} |"
        )


if __name__ == "__main__":
    main()
