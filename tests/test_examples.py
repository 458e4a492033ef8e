"""The README's example is a real script, and it runs as the README says: under torchrun, on 2 ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "minimal.py"


def test_readme_shows_the_example_file() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## A minimal example") :]
    shown = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    script = EXAMPLE.read_text().split("\n", 2)[2]  # the file less its docstring line and the blank line after it
    assert shown == script, "README's minimal example and examples/minimal.py differ: copy the file into the README"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_example_runs_under_torchrun(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(EXAMPLE)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170,
    )
    if done.returncode != 0:
        # torch 2.13's gloo can abort a rank at interpreter exit, after the script's last line, with
        # "terminate called without an active exception" (its worker threads still hold work objects when the
        # interpreter is torn down; pytorch/pytorch#179291 describes it). Measured here with torch's own DDP
        # and torch's fp16 hook in this script: 2 of 10 runs, the same rate as with gradcomm's. Accept exactly
        # that, and only once every rank has printed its result; any other failure fails the test.
        assert "terminate called without an active exception" in done.stderr, done.stderr[-3000:]
    # the ranks share torchrun's stdout, so their lines may interleave: find each rank's report in the text
    reports = sorted(re.findall(r"rank (\d): loss ([\d.]+), (\d+) bytes sent in (\d+) steps", done.stdout))
    assert [rank for rank, *_ in reports] == ["0", "1"], done.stdout
    for rank, loss, sent, steps in reports:
        assert float(loss) < 0.1, f"the example did not learn on rank {rank}: loss {loss}"
        # fp16 halves the traffic: 33 parameters x 2 bytes x 20 steps
        assert (int(sent), int(steps)) == (1320, 20), done.stdout
