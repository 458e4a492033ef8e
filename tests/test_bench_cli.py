"""``gradcomm bench`` end to end: the table and files it writes, one-line errors, a rank killed mid-run."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradcomm.__main__ import main

GRADCOMM = [sys.executable, "-m", "gradcomm"]


def _children(pid: int) -> list[int]:
    """Live descendants of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [child for child, ppid in parents.items() if ppid == parent]
        found += kids
        frontier += kids
    return found


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.timeout(300)
def test_bench_writes_table_json_csv_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run(
        [*GRADCOMM, "bench", "--workload", "cnn", "--steps", "8", "--warmup", "2",
         "--hooks", "allreduce", "fp16_compress", "--output", str(out)],
        capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stderr
    for text in ("allreduce", "fp16_compress", "accuracy", "MB/step/rank", "@1gbit ms", "@100gbit ms"):
        assert text in done.stdout, f"{text!r} missing from the table:\n{done.stdout}"
    assert f"results written to {out}" in done.stdout
    document = json.loads((out / "results.json").read_text())
    summaries = {s["label"]: s for s in document["summaries"]}
    assert set(summaries) == {"allreduce", "fp16_compress"}
    assert document["config"]["data"] == "generated from fixed seeds"
    # the CNN has 283,978 float32 parameters (320 + 64 + 18,496 + 128 + 262,400 + 2,570): allreduce
    # hands over all of them, fp16 half
    assert summaries["allreduce"]["mb_per_step"] == pytest.approx(283_978 * 4 / 1e6)
    assert summaries["fp16_compress"]["compression_ratio"] == pytest.approx(2.0)
    assert all(0.0 <= s["final_metric"] <= 1.0 for s in summaries.values())
    assert len(document["runs_by_rank"]) == 2 and len(document["runs_by_rank"][0][0]["losses"]) == 8
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [row["label"] for row in rows] == ["allreduce", "fp16_compress"]
    assert float(rows[0]["projected_ms_1gbit"]) > float(rows[0]["projected_ms_100gbit"])
    png = (out / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hooks", "allreduce", "warp_drive"], r"unknown communication hook 'warp_drive'.*allreduce"),
        (["--workload", "resnet9000"], r"unknown workload 'resnet9000'; valid workloads: transformer, cnn"),
        (["--world-size", "0"], r"--world-size must be at least 1, got 0"),
        (["--bandwidth", "fast"], r"fast"),
        (["--hooks", "powersgd:rank"], r"hook option 'rank' in 'powersgd:rank' is not key=value"),
        (["--hooks", "powersgd:warp=9"], r"warp"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    import re

    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gradcomm bench: error: "), err
    assert re.search(message, err), err


@pytest.mark.timeout(300)
def test_dead_rank_ends_the_run_with_one_line_and_no_children(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [*GRADCOMM, "bench", "--workload", "cnn", "--steps", "100000", "--hooks", "allreduce",
         "--collective-timeout", "20", "--output", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        ranks: list[int] = []
        while time.monotonic() < deadline and len(ranks) < 2:
            time.sleep(1)
            ranks = [pid for pid in _children(bench.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(ranks) >= 2, "the two ranks never started"
        time.sleep(8)  # let them get into training
        descendants = _children(bench.pid)
        os.kill(ranks[-1], signal.SIGKILL)
        _, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "rank" in lines[0] and "exited with code -9" in lines[0], err
    time.sleep(1)
    survivors = [pid for pid in descendants if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)]
    assert survivors == [], f"processes left behind: {survivors}"
    assert "exited with code -9" in (tmp_path / "run" / "error.log").read_text()
