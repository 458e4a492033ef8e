"""Instruction counts of marked stretches of a Python command, under valgrind's callgrind.

Timings on a shared machine are noisy; instructions executed by the same code repeat exactly, so they resolve
changes that timings cannot (they do not see memory stalls or page faults: report them beside timings, not
instead). The command marks what to count with two cheap system calls that nothing else in the process makes
between them: ``os.getppid()`` zeroes the counters, and every ``os.getpgrp()`` dumps what was counted since the
last mark and starts counting afresh.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path


def count_instructions(command: list[str], env: dict[str, str] | None = None) -> list[int]:
    """Run ``command`` under callgrind; the instructions of each stretch that ended at an ``os.getpgrp()``."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "callgrind.out")
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                "--zero-before=*getppid",
                "--dump-before=*getpgrp",
                *command,
            ],
            check=True,
            env={**os.environ, "PYTHONHASHSEED": "0", **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        dumps = sorted(Path(folder).glob("callgrind.out.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
        if not dumps:
            raise SystemExit("callgrind wrote no dump at getpgrp: was the marker call renamed in this libc?")
        counts = []
        for dump in dumps:
            totals = [line for line in dump.read_text().splitlines() if line.startswith(("summary:", "totals:"))]
            counts.append(int(totals[0].split()[1]))
        return counts
