"""Soak: make and drop a process group, a DDP and its hook 100 times per hook; nothing may abort or stay.

The loop of ``tests/engine/test_group_lifecycle.py`` (a new group, a DDP of a two-layer MLP with
``bucket_cap_mb=0.001``, the hook, 3 backward passes, ``destroy_process_group``, everything dropped), at full
length: ``--rounds`` rounds per hook and DDP kind, each hook in its own pair of rank processes, so that one
that aborts a rank shows as such without hiding the others. On gradcomm's DDP the cyclic collector is off
(a dropped DDP must free its group at once); on torch's DDP it runs before each count (torch's DDP frees its
groups only through it). torch's own ``allreduce_hook`` and ``powerSGD_hook`` on torch's DDP are the
reference rows: torch's PowerSGD aborts a rank (its callbacks hold its state, which a gloo worker thread then
releases last; ``Resource deadlock avoided``), as gradcomm's did before its launcher released what it holds
in time.

Prints a markdown table (per hook and kind: exit codes, threads before and after the rounds, seconds) and
the command; exits 1 if a rank aborted or a thread count grew. Not part of the test suite (minutes)::

    python benchmarks/soak_groups.py [--rounds 100] [--kinds torch gradcomm] [--hooks powersgd topk ...]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.engine.test_group_lifecycle

from gradcomm.hooks.registry import hook_names
from gradcomm.testing import run_on_ranks
from gradcomm.testing.ranks import RankError
from tests.engine.test_group_lifecycle import TORCH_ALLREDUCE, TORCH_POWERSGD, _at_most, soak


def _row(kind: str, hook: str, rounds: int) -> tuple[list[str], bool]:
    start = time.monotonic()
    try:
        results = run_on_ranks(soak, 2, args=(kind, [(hook, rounds)], kind == "torch"), timeout=60 + 2 * rounds)
    except RankError as exc:
        return [kind, hook, str(exc).splitlines()[0], "", "", f"{time.monotonic() - start:.0f}"], False
    counts = [result[hook] for result in results]
    grown = any(not _at_most(after, before) for before, after, _ in counts)
    threads = " / ".join(f"{before} -> {after}" for before, after, _ in counts)
    return [kind, hook, "ok", threads, "GREW" if grown else "same", f"{time.monotonic() - start:.0f}"], not grown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--kinds", nargs="+", default=["torch", "gradcomm"], choices=["torch", "gradcomm"])
    parser.add_argument("--hooks", nargs="+", default=None, help="registry names (default: every hook)")
    args = parser.parse_args()
    hooks = args.hooks or hook_names()
    rows, ok = [], True
    for kind in args.kinds:
        plan = [TORCH_ALLREDUCE, TORCH_POWERSGD, *hooks] if kind == "torch" and args.hooks is None else hooks
        for hook in plan:
            row, row_ok = _row(kind, hook, args.rounds)
            print(" | ".join(row), file=sys.stderr, flush=True)
            rows.append(row)
            ok = ok and (row_ok or hook == TORCH_POWERSGD)  # torch's own bug, not gradcomm's
    print("| DDP | hook | ranks | threads (Python, OS) before -> after, rank 0 / rank 1 | | seconds |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n`{shlex.join(['python', *sys.argv])}`")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
