"""Instruction counts of marked stretches of a Python command, under valgrind's callgrind.

Timings on a shared machine are noisy; instructions executed by the same code repeat exactly, so they resolve
changes that timings cannot (they do not see memory stalls or page faults: report them beside timings, not
instead). The counted command marks its stretches with two cheap system calls that nothing else in the
process makes: :func:`start` (``os.getppid``) zeroes the counters, :func:`stop` (``os.getpgrp``) dumps what
was counted since the last mark and starts afresh. Callgrind miscounts the first stretch of a process (39M
instead of 9.4M instructions for one of ``bench_codecs.py``'s, whatever comes before it, ``LD_BIND_NOW``
included), so the command calls :func:`prime` once before its first stretch, and :func:`count_instructions`
drops that one.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path


def start() -> None:
    """In the counted process: zero the counters."""
    os.getppid()


def stop() -> None:
    """In the counted process: end the stretch (callgrind dumps its count)."""
    os.getpgrp()


def prime() -> None:
    """In the counted process, once before the first counted stretch: an empty stretch, which callgrind
    miscounts and :func:`count_instructions` drops."""
    start()
    stop()


def count_instructions(command: list[str], env: dict[str, str] | None = None) -> list[int]:
    """Run ``command`` under callgrind; the instructions of each stretch it ended with :func:`stop` after
    :func:`prime`, in order."""
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
        # Each stop dumps twice, at libc's getpgrp and at its alias (the second holds a few instructions); the
        # first pair is the primed stretch.
        return counts[2::2]
