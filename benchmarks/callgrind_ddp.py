"""Per-step cost of a DDP on one rank, counted exactly: valgrind's instructions, or cProfile's top functions.

Timings on a shared machine are noisy; instruction counts of the same steps repeat exactly, so they show small
per-step Python costs (a few microseconds per parameter tensor) that a timing cannot resolve. One gloo rank,
one thread, the model of ``benchmarks/bench_ddp.py``'s ``--shape``; after warm-up (which includes the bucket
rebuild) ``--steps`` training steps are counted:

    python benchmarks/callgrind_ddp.py --shape narrow --ddp gradcomm            # instructions per step
    python benchmarks/callgrind_ddp.py --shape narrow --ddp torch --steps 3
    python benchmarks/callgrind_ddp.py --shape narrow --ddp gradcomm --cprofile  # top functions by own time

Under valgrind (``--tool=callgrind``, ``benchmarks/callgrind.py``) only the counted steps are counted, not
start-up, import or warm-up. Figures from before that file (``docs/notes/2026-11-24-ddp-per-tensor-cost.md``)
took the first marked stretch, which callgrind miscounts, so they are comparable with each other but not
with later ones.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import callgrind  # noqa: E402
from bench_ddp import SHAPES  # noqa: E402

import gradcomm  # noqa: E402
from gradcomm.bench.timing import timed_step  # noqa: E402

_UNDER_VALGRIND = "GRADCOMM_CALLGRIND_CHILD"


def _steps(shape: str, kind: str, steps: int, profile: bool, copies: bool) -> None:
    """Build the model and the DDP on a one-rank group, warm up, then run ``steps`` counted steps."""
    torch.set_num_threads(1)
    builder, width, depth = SHAPES[shape]
    with tempfile.TemporaryDirectory() as folder:
        store = dist.FileStore(os.path.join(folder, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            module = copy.deepcopy(builder(width, depth))
            ddp_class = gradcomm.DistributedDataParallel if kind == "gradcomm" else nn.parallel.DistributedDataParallel
            ddp = ddp_class(module, gradient_as_bucket_view=False) if copies else ddp_class(module)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(0)
            x, y = torch.randn(32, width, generator=g), torch.randint(0, 10, (32,), generator=g)
            for _ in range(3):
                timed_step(ddp, optimizer, x, y)
            profiler = cProfile.Profile() if profile else None
            callgrind.prime()
            callgrind.start()
            if profiler is not None:
                profiler.enable()
            for _ in range(steps):
                timed_step(ddp, optimizer, x, y)
            if profiler is not None:
                profiler.disable()
            callgrind.stop()
            if profiler is not None:
                stats = pstats.Stats(profiler).sort_stats("tottime")
                print(f"cProfile of {steps} steps, {kind} DDP, shape {shape}; top functions by own time:")
                stats.print_stats(25)
        finally:
            dist.destroy_process_group()


def _callgrind(args: argparse.Namespace) -> int:
    """Run this script under callgrind and print the instructions counted per step."""
    command = [sys.executable, __file__, "--shape", args.shape, "--ddp", args.ddp, "--steps", str(args.steps)]
    (instructions,) = callgrind.count_instructions(
        [*command, *(["--copies"] if args.copies else [])], {_UNDER_VALGRIND: "1"}
    )
    setting = ", gradient_as_bucket_view=False" if args.copies else ""
    print(
        f"{args.ddp} DDP{setting}, shape {args.shape}, {args.steps} steps: {instructions / args.steps / 1e6:.2f}M "
        "instructions per step"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="narrow")
    parser.add_argument("--ddp", choices=["gradcomm", "torch"], default="gradcomm")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cprofile", action="store_true", help="print cProfile's top functions instead")
    parser.add_argument(
        "--copies", action="store_true", help="gradient_as_bucket_view=False (gradcomm's default makes views)"
    )
    args = parser.parse_args(argv)
    if args.cprofile or os.environ.get(_UNDER_VALGRIND):
        _steps(args.shape, args.ddp, args.steps, args.cprofile, args.copies)
        return 0
    return _callgrind(args)


if __name__ == "__main__":
    sys.exit(main())
