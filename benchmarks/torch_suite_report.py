"""Compatibility report: torch's own DDP test cases run with gradcomm's DDP, against torch's DDP as control.

Runs every case :func:`tests.torch_suite.cases.selected_cases` picks from the installed
``distributed_test.py`` twice on 2 gloo ranks, once with torch's DistributedDataParallel (the control) and
once with gradcomm's in its place, and classifies each: passes with gradcomm; fails with gradcomm (first
line of the failing assertion); fails with torch's DDP too (not ours); skipped by torch because it needs
CUDA; skipped by torch for another reason; excluded by us (``EXCLUDED``, run only as control). Prints a
markdown table of counts and one row per case that did not pass, and writes every result as JSON.

    .venv/bin/python benchmarks/torch_suite_report.py --json torch_suite.json   # a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.torch_suite.cases import EXCLUDED, selected_cases  # noqa: E402
from tests.torch_suite.runner import FAIL, PASS, SKIP, CaseResult, run_cases  # noqa: E402

CUDA_WORDS = ("CUDA", "GPU", "cuda", "gpu")


def classify(name: str, gradcomm: CaseResult | None, torch_result: CaseResult) -> tuple[str, str]:
    """(class, reason) of one case from its two results; ``gradcomm`` is None for an excluded case."""
    if torch_result.status == SKIP or (gradcomm is not None and gradcomm.status == SKIP):
        reason = torch_result.message if torch_result.status == SKIP else gradcomm.message  # type: ignore[union-attr]
        if any(word in reason for word in CUDA_WORDS):
            return "skipped by torch: needs CUDA", reason
        return "skipped by torch: other", reason
    if name in EXCLUDED:
        return "excluded by us", EXCLUDED[name]
    assert gradcomm is not None
    if torch_result.status == FAIL:
        return "fails with torch's DDP too", torch_result.message
    if gradcomm.status == PASS:
        return "passes with gradcomm", ""
    return "fails with gradcomm", gradcomm.message


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every case's results here")
    parser.add_argument("--case-timeout", type=int, default=180)
    parser.add_argument("--log-dir", default=None, help="keep the runners' output (rank logs) here")
    args = parser.parse_args()
    cases = selected_cases()
    logs = {kind: os.path.join(args.log_dir, f"{kind}.log") if args.log_dir else None for kind in ("torch", "gradcomm")}
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    walls = {}
    start = time.monotonic()
    control = run_cases(cases, "torch", case_timeout=args.case_timeout, log_path=logs["torch"])
    walls["torch"] = time.monotonic() - start
    start = time.monotonic()
    ours = run_cases([c for c in cases if c not in EXCLUDED], "gradcomm", case_timeout=args.case_timeout, log_path=logs["gradcomm"])
    walls["gradcomm"] = time.monotonic() - start

    rows = [(name, *classify(name, ours.get(name), control[name])) for name in cases]
    counts = Counter(kind for _, kind, _ in rows)
    print(f"torch's distributed_test.py, DDP-related cases, gloo, 2 ranks: {len(cases)} selected")
    print(f"wall time: torch's DDP {walls['torch']:.0f} s, gradcomm's DDP {walls['gradcomm']:.0f} s\n")
    print("| outcome | cases |\n|---|---|")
    for kind in (
        "passes with gradcomm",
        "fails with gradcomm",
        "fails with torch's DDP too",
        "excluded by us",
        "skipped by torch: needs CUDA",
        "skipped by torch: other",
    ):
        print(f"| {kind} | {counts.get(kind, 0)} |")
    print("\n| case | outcome | reason |\n|---|---|---|")
    for name, kind, reason in rows:
        if kind != "skipped by torch: needs CUDA":
            print(f"| `{name}` | {kind} | {reason.replace('|', '/')} |")
    cuda = Counter(reason for _, kind, reason in rows if kind == "skipped by torch: needs CUDA")
    print("\nneeds CUDA: " + "; ".join(f"{n} x {reason!r}" for reason, n in cuda.most_common()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "walls": walls,
                    "cases": [
                        {
                            "name": name,
                            "outcome": kind,
                            "reason": reason,
                            "torch": vars(control[name]),
                            "gradcomm": vars(ours[name]) if name in ours else None,
                        }
                        for name, kind, reason in rows
                    ],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
