"""Run cases of torch's ``distributed_test.py`` on 2 gloo ranks, with torch's DDP or with gradcomm's in its place.

torch's harness (``TestDistBackend`` from ``torch.testing._internal.distributed.distributed_test``, a
``MultiProcessTestCase``) starts one process per rank for every case and judges the case in the parent from
the ranks' exit codes: a rank whose assertion fails exits with code 10 and pipes its traceback to the parent,
a rank that skips exits with one of ``TEST_SKIPS``' codes. Here the ranks are *forked* from the parent
(torch's ``test_distributed_spawn.py`` spawns them), so they inherit the substitution made in the parent and
start without importing torch again.

The substitution (``--ddp gradcomm``): ``torch.nn.parallel.DistributedDataParallel``,
``torch.nn.parallel.distributed.DistributedDataParallel`` and the ``DistributedDataParallel`` name that
``distributed_test`` imported become :class:`gradcomm.DistributedDataParallel`, before any case runs and so
in every rank. ``--ddp torch`` leaves torch's own DDP: the control.

Everything happens in a fresh interpreter (:func:`run_cases` starts one): the environment torch's module
needs (``BACKEND``, ``WORLD_SIZE``) and the patched names must not leak into the process that asks.

    python -m tests.torch_suite.runner --ddp gradcomm --json out.json test_ddp_inference test_ddp_namedtuple
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import unittest
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DDP_KINDS = ("gradcomm", "torch")

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass
class CaseResult:
    """How one case ended: ``status`` is ``pass``, ``fail`` or ``skip``; ``message`` the first line of the
    failing assertion or the skip reason; ``detail`` the rank's traceback (failures only)."""

    name: str
    status: str
    message: str
    seconds: float
    detail: str = ""


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b")


def _rank_exception_line(text: str) -> str:
    """The line naming the exception in the first failing rank's traceback, as torch's harness forwards it
    (``Process i exited with error code 10 and exception: ...``), else the last exception line of ``text``."""
    block = text.split("exited with error code", 1)[-1].split("exited with error code", 1)[0]
    for candidate in (block, text):
        lines = [line.rstrip() for line in candidate.splitlines() if _EXCEPTION_LINE.match(line)]
        if lines:
            return lines[-1]
    return text.strip().splitlines()[-1] if text.strip() else "no message"


def _prepare(ddp: str, case_timeout: int) -> type:
    """Set torch's test environment, install the substitution and return the TestCase class to run cases of."""
    if ddp not in DDP_KINDS:
        raise ValueError(f"--ddp must be one of {DDP_KINDS}; got {ddp!r}")
    os.environ["BACKEND"] = "gloo"
    os.environ["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    os.environ["WORLD_SIZE"] = "2"
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(case_timeout)
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="torch_suite_"))
    import torch
    import torch.nn.parallel
    import torch.nn.parallel.distributed
    from torch.testing._internal import common_distributed
    from torch.testing._internal.distributed import distributed_test

    import gradcomm

    common_distributed.TIMEOUT_OVERRIDE.clear()
    common_distributed.TIMEOUT_DEFAULT = case_timeout
    if ddp == "gradcomm":
        torch.nn.parallel.DistributedDataParallel = gradcomm.DistributedDataParallel
        torch.nn.parallel.distributed.DistributedDataParallel = gradcomm.DistributedDataParallel
        distributed_test.DistributedDataParallel = gradcomm.DistributedDataParallel

    class TorchDDPCases(distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase):
        """torch's ``TestDistBackendWithSpawn`` with forked ranks, each limited to one intra-op thread."""

        def setUp(self) -> None:
            super().setUp()
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

        @classmethod
        def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
            torch.set_num_threads(1)
            expected = gradcomm.DistributedDataParallel if ddp == "gradcomm" else torch.nn.parallel.distributed.DistributedDataParallel
            if torch.nn.parallel.DistributedDataParallel is not expected:
                raise AssertionError(f"rank {rank}: the DDP substitution did not reach the rank process")
            super()._run(rank, test_name, file_name, pipe, **kwargs)

    TorchDDPCases.__qualname__ = TorchDDPCases.__name__ = f"TorchDDPCases_{ddp}"
    return TorchDDPCases


def _run_one(case_class: type, name: str) -> CaseResult:
    start = time.monotonic()
    result = unittest.TestResult()
    try:
        unittest.TestSuite([case_class(name)]).run(result)
    except Exception:  # a harness error is this case's failure, not the end of the run
        text = traceback.format_exc()
        return CaseResult(name, FAIL, _rank_exception_line(text), time.monotonic() - start, text)
    seconds = time.monotonic() - start
    if result.skipped:
        return CaseResult(name, SKIP, str(result.skipped[0][1]).splitlines()[0], seconds)
    problems = result.errors + result.failures
    if problems:
        text = problems[0][1]
        return CaseResult(name, FAIL, _rank_exception_line(text), seconds, text[-6000:])
    if result.unexpectedSuccesses or result.expectedFailures:
        return CaseResult(name, FAIL, "torch marks this case expected-failure", seconds)
    return CaseResult(name, PASS, "", seconds)


def main(argv: list[str] | None = None) -> int:
    """Run the named cases with the chosen DDP and write their results as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ddp", choices=DDP_KINDS, required=True)
    parser.add_argument("--json", required=True, help="file to write the results to")
    parser.add_argument("--case-timeout", type=int, default=120, help="seconds before a case's ranks are killed")
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    case_class = _prepare(args.ddp, args.case_timeout)
    results = []
    for name in args.cases:
        res = _run_one(case_class, name)
        logger.info("[torch_suite %s] %s %s %.1fs %s", args.ddp, name, res.status, res.seconds, res.message)
        results.append(asdict(res))
        with open(args.json, "w") as f:  # rewritten after each case: a killed run keeps what it measured
            json.dump(results, f, indent=1)
    return 0


def run_cases(
    names: list[str], ddp: str, *, case_timeout: int = 120, timeout: float | None = None, log_path: str | None = None
) -> dict[str, CaseResult]:
    """Run ``names`` in a fresh interpreter with the ``ddp`` kind; a case missing from its output (the run was
    killed at ``timeout`` seconds) is a failure saying so. The ranks' output goes to ``log_path``."""
    with tempfile.TemporaryDirectory(prefix="torch_suite_") as tmp:
        out = os.path.join(tmp, "results.json")
        cmd = [sys.executable, "-m", "tests.torch_suite.runner", "--ddp", ddp, "--json", out]
        cmd += ["--case-timeout", str(case_timeout), *names]
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "TEMP_DIR": tmp}
        with open(log_path or os.devnull, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
                killed = ""
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the runner and the ranks it forked
                proc.wait()
                killed = f"the run was killed after {timeout} s before this case ended"
        done: dict[str, CaseResult] = {}
        if os.path.exists(out):
            with open(out) as f:
                done = {r["name"]: CaseResult(**r) for r in json.load(f)}
    missing = killed or "the runner ended before this case ended (see its log)"
    return {name: done.get(name, CaseResult(name, FAIL, missing, 0.0)) for name in names}


if __name__ == "__main__":
    sys.exit(main())
