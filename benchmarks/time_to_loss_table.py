"""Time to target loss across several ``gradcomm bench`` runs: the table RESULTS.md records for the ``auto`` hook.

Each argument is the output folder of one ``gradcomm bench`` run (the same workload, seed and hooks, e.g. one
per link rate). For every run and every target loss (the run's own, allreduce's final smoothed loss + 2%, and
each ``--target``), it prints the seconds each hook took to reach it, with the report's own functions
(:func:`gradcomm.bench.report.time_to_loss`), each hook's time over the best fixed hook's, and the sum over the
runs: whether one hook is the best across all the links taken together.

    python benchmarks/time_to_loss_table.py OUT_LOOPBACK OUT_1GBIT OUT_100MBIT --target 2.7 [--auto auto]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from gradcomm.bench.report import time_to_loss


def _runs(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    document = json.loads((folder / "results.json").read_text())
    return document["config"], document["runs_by_rank"][0]


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.2f}"


def table(folders: list[Path], target: float, auto: str) -> str:
    names = [f"{c.get('bandwidth') or 'loopback'}" for c, _ in map(_runs, folders)]
    lines = [
        f"Target loss {target:.4f} (smoothed training loss). Seconds to reach it (ratio to the best fixed hook):",
        "",
        "| hook | " + " | ".join(names) + " | sum |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    times: dict[str, list[float | None]] = {}
    for folder in folders:
        _, runs = _runs(folder)
        for run in runs:
            times.setdefault(run["label"], []).append(time_to_loss(run["step_seconds"], run["losses"], target))
    best_fixed = [
        min((t[i] for label, t in times.items() if label != auto and t[i] is not None), default=None)
        for i in range(len(folders))
    ]
    for label, values in times.items():
        cells = []
        for value, best in zip(values, best_fixed, strict=True):
            ratio = f" ({value / best:.2f})" if value is not None and best else ""
            cells.append(_seconds(value) + ratio)
        total = math.inf if any(v is None for v in values) else sum(values)  # type: ignore[arg-type]
        cells.append("not reached" if math.isinf(total) else f"{total:.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="output folders of gradcomm bench runs")
    parser.add_argument("--target", type=float, action="append", default=[], help="another target loss")
    parser.add_argument("--auto", default="auto", help="the label of the hook compared with the fixed ones")
    args = parser.parse_args()
    config, _ = _runs(args.folders[0])
    for target in [config["target_loss"], *args.target]:
        print(table(args.folders, target, args.auto))
        print()


if __name__ == "__main__":
    main()
