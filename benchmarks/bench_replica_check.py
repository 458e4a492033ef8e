"""Cost of the default replica check (``check_parameters_every``) against the step time of the bench workloads.

On 2 gloo ranks, one thread each, per workload: the median time of a training step with the check off, and the
median time of one check (``ddp.check_parameters()``: a checksum pass over the parameters and one
``all_gather`` of three integers). The check's share of step time at interval N is check / (N * step).

    python benchmarks/bench_replica_check.py [--steps 30] [--checks 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradcomm
from gradcomm.bench.workloads import WORKLOADS
from gradcomm.ddp.distributed import CHECK_PARAMETERS_EVERY
from gradcomm.testing import run_on_ranks


def measure(workload_name: str, steps: int, checks: int) -> dict[str, float]:
    workload = WORKLOADS[workload_name]()
    ddp = gradcomm.DistributedDataParallel(workload.build_model(), check_parameters_every=0)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    rank = torch.distributed.get_rank()
    step_times = []
    for step in range(steps):
        x, y = workload.batch(rank, step)
        start = time.perf_counter()
        optimizer.zero_grad()
        workload.loss(ddp(x), y).backward()
        optimizer.step()
        step_times.append(time.perf_counter() - start)
    check_times = []
    for _ in range(checks):
        torch.distributed.barrier()
        start = time.perf_counter()
        ddp.check_parameters()
        check_times.append(time.perf_counter() - start)
    return {
        "parameters": sum(p.numel() for p in ddp.parameters()),
        "tensors": len(list(ddp.parameters())),
        "step_ms": 1e3 * statistics.median(step_times[steps // 5 :]),
        "check_ms": 1e3 * statistics.median(check_times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checks", type=int, default=30)
    args = parser.parse_args()
    print(f"| workload | parameters (tensors) | step ms | one check ms | share at every {CHECK_PARAMETERS_EVERY} | "
          "share at every 10 |")
    print("|---|---|---|---|---|---|")
    for name in WORKLOADS:
        result = run_on_ranks(measure, 2, args=(name, args.steps, args.checks), timeout=600)[0]
        share = result["check_ms"] / result["step_ms"]
        print(
            f"| {name} | {result['parameters']:,} ({result['tensors']}) | {result['step_ms']:.1f} | "
            f"{result['check_ms']:.2f} | {100 * share / CHECK_PARAMETERS_EVERY:.3f}% | {100 * share / 10:.2f}% |"
        )


if __name__ == "__main__":
    main()
