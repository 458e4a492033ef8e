"""DiLoCo against data-parallel training on the bench's workloads, simulated in one process (tuning only).

Every worker is a copy of the model trained in turn on its own batches (``workload.batch(rank, step)``, as
``gradcomm bench`` draws them); ``--mode ddp`` instead averages the workers' gradients every step (what an
allreduce DDP computes, up to rounding). No process group and no traffic: it answers which ``sync_every`` and
outer optimizer reach data-parallel's loss, cheaply, before a real run with ``gradcomm.DiLoCo``.
The figures it gave are in docs/notes/2026-11-27-diloco-first-simulations.md.

    python benchmarks/diloco_sim.py --mode ddp --steps 1000
    python benchmarks/diloco_sim.py --sync-every 25 --outer-lr 1.0 --outer-momentum 0 --steps 1000
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch

from gradcomm.bench.workloads import WORKLOADS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("diloco", "ddp"), default="diloco")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="transformer")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=100)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="Nesterov; 0: plain SGD")
    parser.add_argument("--lr", type=float, default=1e-3, help="the inner AdamW's (the bench's) learning rate")
    parser.add_argument("--cosine", action="store_true", help="cosine decay of the inner learning rate to 0")
    parser.add_argument("--eval-batches", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    workload = WORKLOADS[args.workload]()
    torch.manual_seed(0)
    model = workload.build_model()

    def learning_rate(step: int) -> float:
        return args.lr * (0.5 * (1 + math.cos(math.pi * step / args.steps)) if args.cosine else 1.0)

    start = time.perf_counter()
    if args.mode == "ddp":
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        for step in range(args.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step)
            optimizer.zero_grad()
            for rank in range(args.workers):
                inputs, target = workload.batch(rank, step)
                (workload.loss(model(inputs), target) / args.workers).backward()
            optimizer.step()
        evaluated = model
    else:
        workers = [copy.deepcopy(model) for _ in range(args.workers)]
        inner = [torch.optim.AdamW(worker.parameters(), lr=args.lr) for worker in workers]
        anchor = copy.deepcopy(model)
        momentum = args.outer_momentum
        outer = torch.optim.SGD(anchor.parameters(), lr=args.outer_lr, momentum=momentum, nesterov=momentum > 0)
        for step in range(args.steps):
            for rank, (worker, optimizer) in enumerate(zip(workers, inner, strict=True)):
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(step)
                inputs, target = workload.batch(rank, step)
                optimizer.zero_grad()
                workload.loss(worker(inputs), target).backward()
                optimizer.step()
            if (step + 1) % args.sync_every == 0:
                with torch.no_grad():
                    replicas = [dict(worker.named_parameters()) for worker in workers]
                    for name, shared in anchor.named_parameters():
                        shared.grad = sum(shared - replica[name] for replica in replicas) / len(replicas)
                    outer.step()
                    outer.zero_grad()
                    for worker in workers:
                        for shared, param in zip(anchor.parameters(), worker.parameters(), strict=True):
                            param.copy_(shared)
        evaluated = anchor
    loss = workload.evaluate(evaluated, batches=args.eval_batches)[0]
    print(f"{args.mode} {vars(args)}: held-out loss {loss:.4f} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
