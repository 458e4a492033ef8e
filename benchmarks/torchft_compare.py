"""gradcomm.DiLoCo against torchft's DiLoCo (issue 35's peer comparison): same model, data, H, optimizers.

Both train the bench's transformer from the same initial weights on ``--replicas`` replicas (CPU, gloo,
localhost), each on its own batches (``workload.batch(rank, step)``, as ``gradcomm bench`` draws them), with an
inner AdamW and the same outer SGD; after every outer sync the synced parameters' loss on the bench's held-out
batches is recorded. gradcomm runs one process per replica (``gradcomm.testing.run_on_ranks``); torchft runs as
its own integration tests do: a ``LighthouseServer`` and one replica group of 1 rank per replica, in threads,
each with its own ``TCPStore``, a ``Manager`` (synchronous quorum) and a ``ProcessGroupGloo``. A second gradcomm
run on other batches (``--noise-seed``) gives the run-to-run noise to judge the gap by.

torchft is an optional comparison, not a dependency of gradcomm: ``pip install torchft torch==<yours>``.

    python benchmarks/torchft_compare.py --steps 200 --sync-every 20 --out torchft_compare.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradcomm.bench.workloads import TransformerLMWorkload

OUTER = {
    "nesterov": {"lr": 0.7, "momentum": 0.9},
    "averaging": {"lr": 1.0, "momentum": 0.0},
}
SEED_STRIDE = 500_000
"""Steps between two data seeds' batches: the bench's generator seeds (``1_000_003 * (rank + 2) + step``)
stay distinct across ranks and seeds for runs shorter than this."""


def _setup(state: dict[str, torch.Tensor], lr: float) -> tuple[TransformerLMWorkload, torch.nn.Module, Any]:
    torch.set_num_threads(1)
    workload = TransformerLMWorkload()
    model = workload.build_model()
    model.load_state_dict(state)
    return workload, model, torch.optim.AdamW(model.parameters(), lr=lr)


def _train_step(workload: TransformerLMWorkload, model: torch.nn.Module, inner: Any, rank: int, step: int) -> None:
    inputs, target = workload.batch(rank, step)
    inner.zero_grad()
    workload.loss(model(inputs), target).backward()
    inner.step()


Curve = tuple[list[float], dict[str, torch.Tensor]]
"""The synced parameters' held-out loss after every outer sync, and the final parameters."""


def _sum_then_divide(state: None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averaging as torchft's ``Manager.allreduce`` does it (sum, then divide by the replicas); gradcomm's
    default divides each replica's pseudo-gradient first, as torch's DDP does."""
    world = dist.get_world_size()
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda done: done.value()[0].div_(world))


def _gradcomm_rank(state: dict[str, torch.Tensor], args: dict[str, Any], seed: int) -> Curve:
    from gradcomm import DiLoCo

    rank = dist.get_rank()
    workload, model, inner = _setup(state, args["lr"])
    outer = OUTER[args["outer"]]
    diloco = DiLoCo(
        model,
        inner,
        sync_every=args["sync_every"],
        outer_lr=outer["lr"],
        outer_momentum=outer["momentum"],
        compressor=(None, _sum_then_divide) if args["sum_then_divide"] else None,
    )
    losses = []
    for step in range(args["steps"]):
        synced = diloco.synced_steps
        inputs, target = workload.batch(rank, step + seed * SEED_STRIDE)
        diloco.zero_grad()
        workload.loss(model(inputs), target).backward()
        diloco.step()
        if diloco.synced_steps != synced and rank == 0:
            losses.append(workload.evaluate(model, batches=args["eval_batches"])[0])
    return losses, model.state_dict()


def run_gradcomm(state: dict[str, torch.Tensor], args: dict[str, Any], seed: int) -> Curve:
    from gradcomm.testing import run_on_ranks

    return run_on_ranks(_gradcomm_rank, args["replicas"], (state, args, seed), timeout=args["timeout"])[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _torchft_replica(replica: int, lighthouse: str, state: dict[str, torch.Tensor], args: dict[str, Any]) -> Curve:
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    wait = timedelta(seconds=args["timeout"])
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False, timeout=wait)
    workload, model, inner = _setup(state, args["lr"])
    outer = OUTER[args["outer"]]
    outer_optimizer = torch.optim.SGD(
        model.parameters(), lr=outer["lr"], momentum=outer["momentum"], nesterov=outer["momentum"] > 0
    )
    manager = Manager(
        pg=ProcessGroupGloo(timeout=wait),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=args["replicas"],
        use_async_quorum=False,
        init_sync=False,  # both replicas load the same initial weights
        timeout=wait,
        quorum_timeout=wait,
        connect_timeout=wait,
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"replica{replica}",
        port=_free_port(),
        max_retries=0,
    )
    losses = []
    try:
        bucket = {"use_bucketization": True, "bucket_cap_mb": 1024} if args["one_bucket"] else {}
        with DiLoCo(manager, [model], inner, outer_optimizer, sync_every=args["sync_every"], **bucket):
            for step in range(args["steps"]):
                committed = manager.current_step()
                _train_step(workload, model, inner, replica, step)
                if manager.current_step() != committed and replica == 0:
                    losses.append(workload.evaluate(model, batches=args["eval_batches"])[0])
    finally:
        manager.shutdown(wait=False)
    return losses, model.state_dict()


def run_torchft(state: dict[str, torch.Tensor], args: dict[str, Any]) -> Curve:
    from torchft.coordination import LighthouseServer

    replicas = args["replicas"]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=replicas)
    pool = ThreadPoolExecutor(max_workers=replicas)
    try:
        futures = [pool.submit(_torchft_replica, r, lighthouse.address(), state, args) for r in range(replicas)]
        return [f.result(timeout=args["timeout"]) for f in futures][0]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a replica stuck past the timeout ends on its own
        lighthouse.shutdown()


def max_relative_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise ValueError(f"the curves have {len(a)} and {len(b)} points: the runs synced a different number of times")
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def compare(state: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, Any]:
    """gradcomm, torchft and gradcomm on other data, with the outer optimizer ``args["outer"]``."""
    outer, seed = args["outer"], args["noise_seed"]
    curves, finals = {}, {}
    for name, run in (
        ("gradcomm", lambda: run_gradcomm(state, args, 0)),
        ("torchft", lambda: run_torchft(state, args)),
        (f"gradcomm, data seed {seed}", lambda: run_gradcomm(state, args, seed)),
    ):
        start = time.perf_counter()
        curves[name], finals[name] = run()
        print(f"[{outer}] {name}: {len(curves[name])} syncs in {time.perf_counter() - start:.0f} s: "
              + " ".join(f"{x:.4f}" for x in curves[name]), flush=True)
    gradcomm, torchft_curve, noise = curves.values()
    ours, theirs = finals["gradcomm"], finals["torchft"]
    figures = {
        "gradcomm vs torchft": max_relative_difference(torchft_curve, gradcomm),
        "final parameters, max abs difference": max((ours[k] - theirs[k]).abs().max().item() for k in ours),
        "bit for bit": torchft_curve == gradcomm and all(torch.equal(ours[k], theirs[k]) for k in ours),
        f"run-to-run noise (gradcomm, data seeds 0 and {seed})": max_relative_difference(noise, gradcomm),
    }
    print(f"[{outer}] {figures}", flush=True)
    return {"curves": curves, "figures": figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--outer", choices=sorted(OUTER), nargs="+", default=["nesterov", "averaging"],
                        help="nesterov: SGD lr 0.7 momentum 0.9 Nesterov (the paper's); averaging: lr 1 (gradcomm's)")
    parser.add_argument("--lr", type=float, default=1e-3, help="the inner AdamW's (the bench's) learning rate")
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--noise-seed", type=int, default=1, help="data seed of the second gradcomm run")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one run or wait may take")
    parser.add_argument("--sum-then-divide", action="store_true",
                        help="gradcomm averages as torchft does (a hook) instead of dividing before the sum")
    parser.add_argument("--one-bucket", action="store_true",
                        help="torchft allreduces all pseudo-gradients in one flat buffer (as gradcomm does) instead "
                        "of one allreduce per parameter")
    parser.add_argument("--out", help="write the curves and figures here as JSON")
    options = parser.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and manager log every quorum at info
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in TransformerLMWorkload().build_model().state_dict().items()}
    report: dict[str, Any] = {"args": vars(options), "torch": torch.__version__}
    try:
        from importlib.metadata import version

        import torchft  # noqa: F401

        report["torchft"] = version("torchft")
    except ImportError:
        parser.error("torchft is not installed: pip install torchft torch==" + torch.__version__.split("+")[0])
    for outer in options.outer:
        report[outer] = compare(state, {**vars(options), "outer": outer})
    if options.out:
        with open(options.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
