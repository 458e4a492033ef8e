"""Step time of gradcomm's DistributedDataParallel against torch's, side by side in one run.

Two gloo ranks on this machine, one thread each, the same ~6M-parameter model wrapped by torch's DDP and by
gradcomm's, each at its defaults, and by gradcomm's with ``gradient_as_bucket_view=False`` (torch's copies
into ``.grad``: the like-for-like reducer comparison; gradcomm's default makes ``.grad`` bucket views where
no user can tell). Steps alternate between the three (the order reverses every repetition), and the report
is the median step-time ratio to torch over several repetitions, plus the medians themselves.

    python benchmarks/bench_ddp.py [--reps 5 --steps 20 --world-size 2 --bucket-cap-mb 25]
    python benchmarks/bench_ddp.py --shape narrow   # the same size in 1602 parameter tensors

Shapes (``--width``/``--depth`` override their defaults): ``mlp``, 6 square layers of 1000 and a head (14
parameter tensors); ``narrow``, 400 blocks of a square layer of 128 with a LayerNorm, and a head (1602
tensors), where the DDP's per-tensor cost dominates.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch
import torch.distributed as dist
from torch import nn

import gradcomm
from gradcomm.bench.timing import mlp, narrow_mlp, timed_step
from gradcomm.testing import run_on_ranks

SHAPES = {"mlp": (mlp, 1000, 6), "narrow": (narrow_mlp, 128, 400)}
"""Each shape's model builder and its default width and depth."""


def measure(
    reps: int, steps: int, shape: str, width: int, depth: int, bucket_cap_mb: float | None
) -> dict[str, object]:
    module = SHAPES[shape][0](width, depth)
    kinds = {
        "torch": nn.parallel.DistributedDataParallel(copy.deepcopy(module), bucket_cap_mb=bucket_cap_mb),
        "gradcomm": gradcomm.DistributedDataParallel(copy.deepcopy(module), bucket_cap_mb=bucket_cap_mb),
        "copies": gradcomm.DistributedDataParallel(
            copy.deepcopy(module), bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=False
        ),
    }
    optimizers = {name: torch.optim.SGD(ddp.parameters(), lr=1e-3) for name, ddp in kinds.items()}
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(32, width, generator=g), torch.randint(0, 10, (32,), generator=g)
    for name in kinds:  # warm-up, including the bucket rebuild after the first iteration
        for _ in range(3):
            timed_step(kinds[name], optimizers[name], x, y)
    medians: dict[str, list[float]] = {name: [] for name in kinds}
    for rep in range(reps):
        times: dict[str, list[float]] = {name: [] for name in kinds}
        order = list(kinds) if rep % 2 == 0 else list(reversed(kinds))
        for _ in range(steps):
            for name in order:
                times[name].append(timed_step(kinds[name], optimizers[name], x, y))
        for name in kinds:
            medians[name].append(statistics.median(times[name]))
    ratios = {
        name: [ours / theirs for ours, theirs in zip(medians[name], medians["torch"], strict=True)]
        for name in ("gradcomm", "copies")
    }
    params = sum(p.numel() for p in module.parameters())
    return {"params": params, "tensors": len(list(module.parameters())), "medians": medians, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mlp")
    parser.add_argument("--width", type=int, default=None, help="default: the shape's (mlp 1000, narrow 128)")
    parser.add_argument("--depth", type=int, default=None, help="default: the shape's (mlp 6, narrow 400)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None)
    args = parser.parse_args(argv)
    _, default_width, default_depth = SHAPES[args.shape]
    width = default_width if args.width is None else args.width
    depth = default_depth if args.depth is None else args.depth
    result = run_on_ranks(
        measure,
        args.world_size,
        args=(args.reps, args.steps, args.shape, width, depth, args.bucket_cap_mb),
        timeout=1800,
    )[0]
    medians, ratios = result["medians"], result["ratios"]
    print(f"command: python benchmarks/bench_ddp.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print(
        f"model: {args.shape} {width}x{depth}, {result['params'] / 1e6:.2f}M parameters in {result['tensors']} "
        f"tensors, {args.world_size} gloo ranks, 1 thread each"
    )
    print(
        "| rep | torch median step (ms) | gradcomm (ms) | gradcomm, view=False (ms) | ratio gradcomm/torch | "
        "ratio view=False/torch |"
    )
    print("|---|---|---|---|---|---|")
    rows = zip(medians["torch"], medians["gradcomm"], medians["copies"], ratios["gradcomm"], ratios["copies"], strict=True)
    for rep, (t, g, c, r, rc) in enumerate(rows):
        print(f"| {rep} | {1e3 * t:.1f} | {1e3 * g:.1f} | {1e3 * c:.1f} | {r:.3f} | {rc:.3f} |")
    reps = len(ratios["gradcomm"])
    print(f"median ratio gradcomm/torch over {reps} repetitions: {statistics.median(ratios['gradcomm']):.3f}")
    print(f"median ratio gradcomm (gradient_as_bucket_view=False)/torch: {statistics.median(ratios['copies']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
