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


@pytest.mark.timeout(180)
def test_example_runs_under_torchrun(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(EXAMPLE)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"], done.stdout
    for line in lines:
        loss = float(re.search(r"loss (\S+),", line).group(1))
        assert loss < 0.1, f"the example did not learn: {line}"
        # fp16 halves the traffic: 33 parameters x 2 bytes x 20 steps
        assert "1320 bytes sent in 20 steps" in line, line
