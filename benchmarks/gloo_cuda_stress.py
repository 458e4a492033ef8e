"""Replicas that disagree on gloo's CUDA path: many small hook calls on ranks sharing one GPU, counted.

    python benchmarks/gloo_cuda_stress.py --world-size 3 --iterations 400 --modes eager synchronized

A GPU session (docs/notes/2026-11-28-gpu-h200-checks.md) saw, once per property-suite run, one rank of three
end a step with a different averaged gradient under ``quantize_per_tensor``, ``quantize_per_channel`` or
``randomk`` on CUDA tensors over gloo; never on CPU tensors. This script repeats what those hooks do, alone,
many times: each iteration hands one small bucket (1-3 tensors of 1-24 elements, float64 or float32, values
that differ by rank) to a hook, waits for its future and compares the result across ranks (as CPU tensors,
gathered over the same group). It also checks ``gradcomm.comm.all_gather_into_tensor`` alone against the
inputs gathered as CPU tensors. Modes: ``overlapped`` (four buckets handed over before the first is waited for, as a DDP's backward
does), ``eager`` (one bucket at a time); ``synchronized``
(``torch.cuda.synchronize()`` before each hook call and before reading its result), which tells a race
between streams from a fault in the exchange itself. It prints, per mode and hook, the iterations whose
results differed between ranks. Needs a GPU; every rank uses GPU 0.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from gradcomm.comm import collectives
from gradcomm.hooks.grad_bucket import GradBucket
from gradcomm.hooks.registry import make_comm_hook
from gradcomm.testing import run_on_ranks

_IN_FLIGHT = 4
"""Buckets handed to a hook before the first is waited for, in the ``overlapped`` mode (as a DDP's backward
launches several buckets' hooks while earlier ones are still in flight)."""


def _bucket(generator: torch.Generator, rank: int, device: torch.device) -> GradBucket:
    count = int(torch.randint(1, 4, (1,), generator=generator))
    dtype = torch.float64 if int(torch.randint(0, 2, (1,), generator=generator)) else torch.float32
    shapes = [torch.Size([int(torch.randint(1, 25, (1,), generator=generator))]) for _ in range(count)]
    lengths = [shape.numel() for shape in shapes]
    values = torch.randn(sum(lengths), dtype=dtype, generator=generator) * (rank + 1)
    parameters = [torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device)) for shape in shapes]
    offsets = [sum(lengths[:i]) for i in range(count)]
    return GradBucket(0, values.to(device), offsets, lengths, shapes, parameters, is_last=True)


def _same_on_every_rank(result: torch.Tensor) -> bool:
    mine = result.detach().reshape(-1).to("cpu", torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def _stress(
    hooks: list[str], iterations: int, modes: list[str], device_type: str
) -> dict[str, dict[str, list[int]]]:
    rank, device = dist.get_rank(), torch.device(device_type, 0)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    found: dict[str, dict[str, list[int]]] = {}
    for mode in modes:
        found[mode] = {}
        for name in hooks:
            generator = torch.Generator().manual_seed(1234)  # the same shapes on every rank
            bad: list[int] = []
            if name == "all_gather_into_tensor":
                for i in range(iterations):
                    bucket = _bucket(generator, rank, device)
                    if mode == "synchronized":
                        synchronize()
                    out = collectives.all_gather_into_tensor(bucket.buffer()).wait()
                    if mode == "synchronized":
                        synchronize()
                    expected = [torch.empty_like(bucket.buffer().cpu()) for _ in range(dist.get_world_size())]
                    dist.all_gather(expected, bucket.buffer().cpu())
                    if not torch.equal(out.cpu(), torch.cat(expected)):
                        bad.append(i)
            elif mode == "overlapped":
                hook, state = make_comm_hook(name, process_group=dist.group.WORLD)
                for i in range(0, iterations, _IN_FLIGHT):
                    buckets = [_bucket(generator, rank, device) for _ in range(_IN_FLIGHT)]
                    futures = [hook(state, bucket) for bucket in buckets]
                    for offset, future in enumerate(futures):
                        if not _same_on_every_rank(future.wait()):
                            bad.append(i + offset)
            else:
                hook, state = make_comm_hook(name, process_group=dist.group.WORLD)
                for i in range(iterations):
                    bucket = _bucket(generator, rank, device)
                    if mode == "synchronized":
                        synchronize()
                    result = hook(state, bucket).wait()
                    if mode == "synchronized":
                        synchronize()
                    if not _same_on_every_rank(result):
                        bad.append(i)
            found[mode][name] = bad
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--hooks", nargs="+",
                        default=["all_gather_into_tensor", "quantize_per_tensor", "quantize_per_channel", "randomk",
                                 "allreduce"])
    parser.add_argument("--modes", nargs="+", default=["overlapped", "eager", "synchronized"])
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no GPU: nothing to stress")
        return 0
    print("torch", torch.__version__, torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", flush=True)
    results = run_on_ranks(_stress, world_size=args.world_size,
                           args=(args.hooks, args.iterations, args.modes, args.device),
                           timeout=args.timeout, collective_timeout=60.0)
    for mode, by_hook in results[0].items():
        for name, bad in by_hook.items():
            print(f"{mode:>12} {name:>24}: {len(bad)} of {args.iterations} iterations differed between ranks"
                  + (f" (first: {bad[:8]})" if bad else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
