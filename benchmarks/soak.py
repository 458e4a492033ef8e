"""Soak test: thousands of steps per hook, watching for leaks, non-finite losses and replicas drifting apart.

Two gloo ranks on this machine (``gradcomm.testing.run_on_ranks``), one thread each, train the ``cnn``
workload of ``gradcomm bench`` (a small convolutional classifier, 284k parameters, BatchNorm buffers) for
``--steps`` steps with each hook in turn, on a fresh model. Per hook and rank it records:

* resident memory (``VmRSS`` from ``/proc/self/status``) after ``--warmup`` steps and at the end; the growth
  between the two must stay under ``--max-growth`` percent (a leak of a few KB per step shows);
* the number of non-finite losses (must be 0);
* a checksum of every parameter at the end, which must be identical on both ranks. The DDP's own drift
  check (``check_parameters_every=100``) runs throughout as well.

Batches cycle through a fixed pool, so the data itself allocates nothing new. Prints a markdown table and the
command; exits 1 if any check failed. Not part of the test suite (it takes minutes)::

    python benchmarks/soak.py [--steps 2000 --warmup 100 --hooks allreduce fp16_compress powersgd topk]
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import gradcomm
from gradcomm.bench.runner import HookChoice
from gradcomm.bench.workloads import WORKLOADS
from gradcomm.hooks.registry import make_comm_hook
from gradcomm.testing import run_on_ranks

DEFAULT_HOOKS = ("allreduce", "fp16_compress", "powersgd:start_powerSGD_iter=10", "topk")
BATCH_POOL = 32


def _rss_mb() -> float:
    """This process's resident set size in MB, from /proc/self/status."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def _checksum(module: torch.nn.Module) -> list[float]:
    """Per-parameter float64 sums. Buffers are left out: BatchNorm statistics are broadcast from rank 0 at the
    start of each forward and then updated with each rank's own batch, so they differ after it (as in torch)."""
    return [p.detach().double().sum().item() for p in module.parameters()]


def soak_hook(choice: HookChoice, workload_name: str, steps: int, warmup: int) -> dict[str, Any]:
    """Train ``steps`` steps with one hook on this rank; the measurements (the same keys on every rank)."""
    rank = dist.get_rank()
    workload = WORKLOADS[workload_name]()
    torch.manual_seed(0)
    ddp = gradcomm.DistributedDataParallel(workload.build_model(), check_parameters_every=100)
    hook, state = make_comm_hook(choice.name, **dict(choice.options))
    ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    batches = [workload.batch(rank, i) for i in range(BATCH_POOL)]
    non_finite, seconds, losses = 0, [], []
    rss_warm = 0.0
    for step in range(steps):
        inputs, target = batches[step % BATCH_POOL]
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss(ddp(inputs), target)
        loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
        value = loss.item()
        non_finite += not math.isfinite(value)
        losses.append(value)
        if step + 1 == warmup:
            gc.collect()
            rss_warm = _rss_mb()
    gc.collect()
    rss_end = _rss_mb()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, _checksum(ddp.module))
    return {
        "hook": choice.label,
        "rank": rank,
        "steps": ddp.synchronised_steps,
        "median_ms": 1000 * statistics.median(seconds),
        "rss_warm_mb": rss_warm,
        "rss_end_mb": rss_end,
        "growth_pct": 100 * (rss_end - rss_warm) / rss_warm,
        "non_finite": non_finite,
        "first_loss": statistics.fmean(losses[:20]),
        "last_loss": statistics.fmean(losses[-20:]),
        "identical": all(c == everyone[0] for c in everyone),
    }


def soak_rank(choices: list[HookChoice], workload: str, steps: int, warmup: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [soak_hook(choice, workload, steps, warmup) for choice in choices]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hooks", nargs="+", default=list(DEFAULT_HOOKS), metavar="HOOK")
    parser.add_argument("--workload", default="cnn", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100, help="the step after which memory is the baseline")
    parser.add_argument("--max-growth", type=float, default=5.0, help="allowed RSS growth, percent")
    parser.add_argument("--collective-timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    choices = [HookChoice.parse(text) for text in args.hooks]
    start = time.monotonic()
    per_rank = run_on_ranks(
        soak_rank,
        2,
        args=(choices, args.workload, args.steps, args.warmup),
        timeout=3600,
        collective_timeout=args.collective_timeout,
    )
    elapsed = time.monotonic() - start
    command = " ".join(["python", "benchmarks/soak.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"`{command}`")
    print(f"\n{args.workload}, 2 gloo ranks, {args.steps} steps per hook, RSS baseline after step {args.warmup}; "
          f"{elapsed:.0f} s in all\n")
    print("| hook | steps | median step (ms) | RSS after warm-up, rank 0 / 1 (MB) | RSS at end (MB) | growth (%) "
          "| non-finite losses | loss, first 20 -> last 20 steps (rank 0) | parameters identical | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    failed = False
    for runs in zip(*per_rank, strict=True):
        growth = max(run["growth_pct"] for run in runs)
        ok = (
            growth < args.max_growth
            and all(run["non_finite"] == 0 for run in runs)
            and all(run["identical"] for run in runs)
            and all(run["steps"] == args.steps for run in runs)
        )
        failed |= not ok
        first = runs[0]
        warm = " / ".join(f"{run['rss_warm_mb']:.1f}" for run in runs)
        end = " / ".join(f"{run['rss_end_mb']:.1f}" for run in runs)
        growths = " / ".join(f"{run['growth_pct']:+.2f}" for run in runs)
        median = statistics.fmean(run["median_ms"] for run in runs)
        identical = "yes" if all(run["identical"] for run in runs) else "NO"
        print(
            f"| {first['hook']} | {first['steps']} | {median:.1f} | {warm} | {end} | {growths} "
            f"| {sum(run['non_finite'] for run in runs)} | {first['first_loss']:.3f} -> {first['last_loss']:.3f} "
            f"| {identical} | {'yes' if ok else 'NO'} |"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
