"""Several ``gradcomm bench`` runs at once, each pinned to its own CPU cores: a sweep on a many-core machine.

    python benchmarks/bench_sweep.py OUT --cores-per-run 2 --limit 420 \\
        --run "ar=--steps 4000 --hooks allreduce" --run "h100=--steps 4000 --hooks diloco:sync_every=100"

Each ``--run NAME=ARGS`` is one ``gradcomm bench ARGS --output OUT/NAME`` (its log in ``OUT/NAME.log``), on
cores of its own (``taskset``), so that runs do not share a core and their losses are those of separate
machines. Losses are deterministic for a given machine, torch and seed; compare rows of one machine only.
At the end, or at ``--limit`` seconds (unfinished runs are killed), it prints each run's held-out final loss
and the mean training loss of its last 200 steps, and writes them to ``OUT/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _summary(folder: Path) -> dict[str, dict[str, float]]:
    """Each row's final held-out loss and last-200-steps training loss (rank 0), from results.json."""
    results = json.loads((folder / "results.json").read_text())
    rows = {}
    for run in results["runs_by_rank"][0]:
        losses = run["losses"]
        rows[run["label"]] = {"final_loss": run["final_loss"], "train_last200": statistics.fmean(losses[-200:])}
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--run", action="append", required=True, help="NAME=ARGS of gradcomm bench")
    parser.add_argument("--cores-per-run", type=int, default=2)
    parser.add_argument("--first-core", type=int, default=0)
    parser.add_argument("--limit", type=float, default=540.0, help="seconds before unfinished runs are killed")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    jobs = {}
    for i, spec in enumerate(args.run):
        name, _, bench_args = spec.partition("=")
        first = args.first_core + i * args.cores_per_run
        cores = ",".join(str(c) for c in range(first, first + args.cores_per_run))
        command = ["taskset", "-c", cores, sys.executable, "-m", "gradcomm", "bench", *shlex.split(bench_args),
                   "--output", str(args.out / name)]
        log = open(args.out / f"{name}.log", "w")  # noqa: SIM115 - closed when the run ends
        print(f"{name}: cores {cores}: {shlex.join(command[3:])}", flush=True)
        jobs[name] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True), log, time.monotonic())
    deadline = time.monotonic() + args.limit
    seconds = {}
    while any(p.poll() is None for p, _, _ in jobs.values()) and time.monotonic() < deadline:
        time.sleep(1.0)
        for name, (process, _, start) in jobs.items():
            if process.poll() is not None and name not in seconds:
                seconds[name] = time.monotonic() - start
    summary = {}
    for name, (process, log, _start) in jobs.items():
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
        log.close()
        try:
            rows = _summary(args.out / name)
        except (OSError, KeyError, ValueError):
            rows = {}
        summary[name] = {"returncode": process.returncode, "seconds": round(seconds.get(name, -1.0), 1),
                         "rows": rows}
        for label, row in rows.items() or [("(no results)", {})]:
            figures = " ".join(f"{k}={v:.4f}" for k, v in row.items())
            print(f"{name:>12} rc={process.returncode} {summary[name]['seconds']:>7}s {label}: {figures}")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
