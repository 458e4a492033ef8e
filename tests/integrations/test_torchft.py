"""gradcomm.DiLoCo equals torchft's DiLoCo bit for bit (issue 35's peer comparison), where torchft is installed.

``benchmarks/torchft_compare.py`` trains the bench's transformer on 2 replicas from the same weights and
batches with each library (torchft with its lighthouse, managers and gloo groups on localhost); with the same
inner AdamW, ``H`` and outer Nesterov SGD, the held-out loss after every outer sync and the final parameters
must be identical: both average the same fp32 pseudo-gradients (torchft sums then divides by 2, gradcomm divides
by 2 then sums, exact either way for 2 replicas) and step the same ``torch.optim.SGD``. torchft is an optional
peer, not a dependency (CI does not install it), so this test skips without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is an optional peer (pip install torchft torch==<this torch>)")

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "benchmarks" / "torchft_compare.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gradcomm_diloco_equals_torchft_bit_for_bit(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "20", "--sync-every", "10", "--outer", "nesterov",
         "--timeout", "120", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())["nesterov"]
    curves, figures = result["curves"], result["figures"]
    assert len(curves["gradcomm"]) == 2, curves
    assert curves["torchft"] == curves["gradcomm"], curves
    assert figures["final parameters, max abs difference"] == 0.0, figures
    assert figures["bit for bit"], figures
