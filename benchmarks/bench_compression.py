"""Compute cost of every compression method's hook against allreduce, on the ``gradcomm bench`` workloads.

"Compute ms" is what ``gradcomm bench`` reports in its column of that name
(:func:`gradcomm.bench.runner._compute_seconds`): the median step time of the workload's model with the hook
on a process group of one rank, so forward, backward, optimizer and the hook's encoding and decoding are
counted and the network is not. Here that measurement is repeated ``--reps`` times per hook, the hooks
interleaved (their order rotated every repetition, so drift on a shared machine hits all alike), and the
median over repetitions is reported with its ratio to allreduce's; a second table gives the same less the
optimizer's step (timed by torch's global optimizer step hooks), whose cost can depend on the values the hook
returns (AdamW's ``sqrt`` of a sparse method's zeros). Optionally (``--profile N``) the hooks
are profiled with ``torch.profiler`` for a few steps; ``--hook-only`` times the hook alone instead (one call
on all the model's gradients of one batch as one bucket), the encoding and decoding cost without the noise of
forward and backward (with ``--profile N``: the top ``N`` operators by self CPU time over 10 hook calls).
With ``--clock thread`` the hook alone is timed in CPU seconds of the calling thread (``time.thread_time``;
the hook's torch operators run on it with one torch thread) instead of wall-clock seconds: far less disturbed
by other processes on a shared machine, though not by their use of shared caches and memory bandwidth. It
misses the work of a future's callbacks where the backend's thread runs them (decoding after a collective
that completed before the callback was attached runs on the calling thread, else on gloo's): ``--clock
process`` (``time.process_time``, every thread of the rank's process: the calling thread, gloo's, which are
otherwise idle) counts that too.

``--fuse`` times each compression method's hook alone both eager and with ``compile=True`` (its encoding and
decoding through ``torch.compile``: :mod:`gradcomm.compression.fusion`), one state of each kept for all
repetitions and called in lockstep, alternating; the table gives medians (quartiles) of wall-clock ms, their
ratio, the seconds of the first five compiled calls (where compiling happens), dynamo's graphs and graph
breaks, aten operators, and (on CUDA) kernel launches and the GPU's work items (kernels, copies) of one call,
each eager / compiled, and whether the results were equal
(else how many elements differed, and by how much).

On a machine with a GPU, ``--device cuda`` puts the workload, its gradients and the hooks on the GPU (each
timing ends with ``torch.cuda.synchronize()``), and ``--backend nccl`` makes the one-rank group an NCCL one
(``--profile`` without ``--hook-only`` still profiles on the CPU).

    python benchmarks/bench_compression.py [--workloads cnn transformer] [--hooks allreduce topk ...]
        [--reps 5] [--steps 8] [--warmup 5] [--threads 1] [--hook-only [--clock process]]
        [--profile 12 --profile-hooks onebit terngrad] [--device cuda --backend nccl]
    python benchmarks/bench_compression.py --fuse --workloads transformer --hooks signsgd qsgd onebit topk

Hooks default to allreduce and every registered method (:func:`gradcomm.compression.registry.methods`), each
with its defaults; ``name:key=value`` sets options as in ``gradcomm bench --hooks``.
"""

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from gradcomm.bench.runner import (
    BenchConfig,
    HookChoice,
    _compute_seconds,
    _synchronize,
    _train_step,
    _wrapped,
)
from gradcomm.bench.workloads import WORKLOADS
from gradcomm.compression.registry import methods
from gradcomm.hooks.grad_bucket import GradBucket
from gradcomm.hooks.registry import make_comm_hook
from gradcomm.testing import run_on_ranks
from gradcomm.testing.op_count import workload_bucket

BASELINE = "allreduce"


class _OptimizerClock:
    """Seconds of every ``optimizer.step()`` while installed (torch's global optimizer step hooks): the bench's
    step includes the optimizer, whose cost can depend on the gradient's values (on some CPUs torch's ``sqrt``
    of zeros, which AdamW takes of a sparse method's mostly zero second moments, is several times slower than
    of other values), so the hook's own share is read from the step without it."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0
        self._handles = [
            register_optimizer_step_pre_hook(self._begin),
            register_optimizer_step_post_hook(self._end),
        ]

    def _begin(self, *_: object) -> None:
        self._start = time.perf_counter()

    def _end(self, *_: object) -> None:
        self.seconds.append(time.perf_counter() - self._start)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _measure(
    workload_name: str, hooks: list[str], reps: int, steps: int, warmup: int, threads: int, device: str = "cpu"
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per hook, its compute seconds of each repetition (this process is the only rank of its group), and
    the same less each repetition's median seconds of ``optimizer.step()``."""
    torch.set_num_threads(threads)
    workload = WORKLOADS[workload_name](device=device)
    choices = [HookChoice.parse(hook) for hook in hooks]
    config = BenchConfig(workload=workload_name, warmup=warmup, calibration_steps=steps, device=device)
    torch.manual_seed(config.seed)
    model = workload.build_model()
    seconds: dict[str, list[float]] = {hook: [] for hook in hooks}
    without_optimizer: dict[str, list[float]] = {hook: [] for hook in hooks}
    clock = _OptimizerClock()
    for rep in range(reps):
        shift = rep % len(choices)
        for hook, choice in list(zip(hooks, choices, strict=True))[shift:] + list(zip(hooks, choices, strict=True))[:shift]:
            clock.seconds.clear()
            step = _compute_seconds(workload, model, choice, config, dist.group.WORLD)
            seconds[hook].append(step)
            without_optimizer[hook].append(step - statistics.median(clock.seconds[-steps:]))
    clock.remove()
    return seconds, without_optimizer


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time, "process": time.process_time}


def _one_bucket(workload_name: str, device: str = "cpu") -> GradBucket:
    """All the workload's gradients of one training batch, as one bucket (:func:`workload_bucket`)."""
    return workload_bucket(workload_name, device)


def _refill(bucket: GradBucket, gradients: torch.Tensor) -> None:
    """Put the gradients back into the bucket before a hook call: a hook may write its result into the bucket
    (as torch's do), and the next call would then compress the last one's average."""
    bucket.buffer().copy_(gradients)


def _hook_seconds(
    workload_name: str, hooks: list[str], reps: int, threads: int, clock: str = "wall", device: str = "cpu"
) -> dict[str, list[float]]:
    """Per hook, seconds of one call of the hook on all the workload's gradients of one batch as one bucket
    (a fresh hook state per repetition after two untimed calls): encoding and decoding alone, on the
    ``clock`` of :data:`CLOCKS` (on a GPU, after the device has finished the hook's work)."""
    now = CLOCKS[clock]
    torch.set_num_threads(threads)
    bucket = _one_bucket(workload_name, device)
    gradients = bucket.buffer().clone()
    seconds: dict[str, list[float]] = {hook: [] for hook in hooks}
    for rep in range(reps):
        shift = rep % len(hooks)
        for hook in hooks[shift:] + hooks[:shift]:
            choice = HookChoice.parse(hook)
            fn, state = make_comm_hook(choice.name, process_group=dist.group.WORLD, **dict(choice.options))
            for _ in range(2):
                _refill(bucket, gradients)
                fn(state, bucket).wait()
            _refill(bucket, gradients)
            _synchronize(device)
            start = now()
            fn(state, bucket).wait()
            _synchronize(device)
            seconds[hook].append(now() - start)
    return seconds


def _kernel_launches(call: Callable[[], object], device: str) -> tuple[int, int] | None:
    """While ``call()`` runs: the host's kernel launch calls (runtime and driver API: aten's and Triton's),
    and the work items the GPU ran (kernels, copies, fills); ``None`` off CUDA."""
    if not device.startswith("cuda"):
        return None
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        call()
        _synchronize(device)
    events = profiler.events()
    launches = sum(1 for event in events if "LaunchKernel" in event.name)
    kernels = sum(1 for event in events if event.device_type == torch.autograd.DeviceType.CUDA)
    return launches, kernels


def _fused_hook_seconds(workload_name: str, hooks: list[str], reps: int, threads: int, device: str = "cpu") -> list[str]:
    """Per hook, one call of its eager form and of ``compile=True`` (:mod:`gradcomm.compression.fusion`) on
    the workload's gradients as one bucket, in seconds (wall clock, synchronized), ``reps`` times each,
    alternating; with what compiling cost (the first five calls: eager, compiling, recompiling what varies),
    dynamo's graphs and graph breaks, aten operators and kernel launches of one call, and whether the two
    forms' results were equal (else the largest fraction of elements that differed in a call, and the
    largest difference relative to the call's largest magnitude). The two states are called in lockstep,
    so their error feedback and random streams match. Each hook's row is printed when it is measured (a run
    cut short keeps the rows done); returns the graph breaks' reasons."""
    from torch._dynamo.utils import counters

    from gradcomm.testing.op_count import count_aten_calls

    torch.set_num_threads(threads)
    bucket = _one_bucket(workload_name, device)
    gradients = bucket.buffer().clone()
    print(
        f"### {workload_name}: hook ms, eager against compile=True ({device})\n\n"
        "| hook | eager ms | compiled ms | ratio | first 5 calls s | graphs | breaks | aten ops | launches | GPU items | result |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    reasons = []
    for hook in hooks:
        choice = HookChoice.parse(hook)
        options = dict(choice.options)
        forms = [
            make_comm_hook(choice.name, process_group=dist.group.WORLD, **{**options, "compile": compiled})
            for compiled in (False, True)
        ]

        def call(form: int, forms: list = forms) -> tuple[float, torch.Tensor]:
            fn, state = forms[form]
            _refill(bucket, gradients)
            _synchronize(device)
            start = time.perf_counter()
            fn(state, bucket).wait()
            _synchronize(device)
            return time.perf_counter() - start, bucket.buffer().clone()

        for _ in range(5):
            call(0)
        counters.clear()
        try:
            warm = sum(call(1)[0] for _ in range(5))
        except RuntimeError as exc:  # the fusion's one-line error: this method does not compile here
            print(f"| {hook} | - | - | - | - | - | - | - | - | - | compile failed: {str(exc).splitlines()[0]} |",
                  flush=True)
            continue
        graphs, breaks = counters["stats"]["unique_graphs"], counters["graph_break"]
        reasons.extend(f"- {hook}: {reason}" for reason in sorted({r.strip().splitlines()[0] for r in breaks}))
        ops = [count_aten_calls(lambda form=form: call(form)) for form in (0, 1)]
        launches = [_kernel_launches(lambda form=form: call(form), device) for form in (0, 1)]
        seconds: tuple[list[float], list[float]] = ([], [])
        differing, deviation = 0.0, 0.0
        for rep in range(reps):
            outputs = {}
            for form in (0, 1) if rep % 2 == 0 else (1, 0):
                seconds[form].append((result := call(form))[0])
                outputs[form] = result[1]
            differing = max(differing, (outputs[0] != outputs[1]).double().mean().item())
            scale = outputs[0].abs().max().clamp_min(torch.finfo(outputs[0].dtype).tiny)
            deviation = max(deviation, ((outputs[1] - outputs[0]).abs().max() / scale).item())
        ratio = statistics.median(seconds[1]) / statistics.median(seconds[0])
        launched = (
            "- | -" if launches[0] is None or launches[1] is None
            else f"{launches[0][0]} / {launches[1][0]} | {launches[0][1]} / {launches[1][1]}"
        )
        print(
            f"| {hook} | {_spread(seconds[0])} | {_spread(seconds[1])} | {ratio:.2f} | {warm:.1f} | {graphs} | "
            f"{sum(breaks.values())} | {ops[0]} / {ops[1]} | {launched} | "
            f"{'bits equal' if differing == 0 else f'{differing:.1e} of elements differ, at most {deviation:.1e} (relative)'} |",
            flush=True,
        )
    return reasons


def _spread(values: list[float]) -> str:
    """Median (quartiles) in ms."""
    if len(values) < 2:
        return f"{1e3 * values[0]:.2f}"
    quartiles = statistics.quantiles(values, n=4)
    return f"{1e3 * statistics.median(values):.2f} ({1e3 * quartiles[0]:.2f}-{1e3 * quartiles[2]:.2f})"


def _hook_profile(workload_name: str, hook: str, calls: int, threads: int, rows: int, device: str = "cpu") -> str:
    """``torch.profiler``'s top ``rows`` operators by self CPU time over ``calls`` calls of ``hook`` on the
    workload's gradients as one bucket (after two untimed calls); on a GPU with its kernels too (the rows
    ``cudaStreamSynchronize`` and ``aten::_local_scalar_dense`` count the hook's waits for the device)."""
    torch.set_num_threads(threads)
    bucket = _one_bucket(workload_name, device)
    choice = HookChoice.parse(hook)
    fn, state = make_comm_hook(choice.name, process_group=dist.group.WORLD, **dict(choice.options))
    gradients = bucket.buffer().clone()
    for _ in range(2):
        _refill(bucket, gradients)
        fn(state, bucket).wait()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(calls):
            _refill(bucket, gradients)
            fn(state, bucket).wait()
        _synchronize(device)
    return profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def _profile(workload_name: str, hook: str, steps: int, warmup: int, threads: int, rows: int) -> str:
    """``torch.profiler``'s top ``rows`` operators by self CPU time over ``steps`` steps of ``hook``."""
    torch.set_num_threads(threads)
    workload = WORKLOADS[workload_name]()
    config = BenchConfig(workload=workload_name)
    torch.manual_seed(config.seed)
    ddp = _wrapped(workload, workload.build_model(), HookChoice.parse(hook), config, dist.group.WORLD)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=config.lr)
    for step in range(warmup):
        _train_step(ddp, optimizer, workload, workload.batch(0, step))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for step in range(warmup, warmup + steps):
            _train_step(ddp, optimizer, workload, workload.batch(0, step))
    return profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def _table(workload: str, seconds: dict[str, list[float]], what: str = "compute ms") -> str:
    """Median and minimum per hook, each with its ratio to allreduce's (the minimum is the less disturbed by
    other processes on a shared machine)."""
    baseline = seconds.get(BASELINE)
    lines = [
        f"### {workload}: {what}",
        "",
        f"| hook | {what} median | ratio | {what} min | ratio of mins |",
        "|---|---|---|---|---|",
    ]
    for hook, values in seconds.items():
        median, least = statistics.median(values), min(values)
        ratios = (
            (f"{median / statistics.median(baseline):.2f}", f"{least / min(baseline):.2f}") if baseline else ("-", "-")
        )
        lines.append(f"| {hook} | {1e3 * median:.1f} | {ratios[0]} | {1e3 * least:.1f} | {ratios[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["cnn", "transformer"], choices=sorted(WORKLOADS))
    parser.add_argument("--hooks", nargs="+", default=[BASELINE, *methods()])
    parser.add_argument("--reps", type=int, default=5, help="repetitions per hook (median reported)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per repetition (their median)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    parser.add_argument(
        "--hook-only", action="store_true", help="time the hook alone on one bucket of all gradients instead"
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="with --hook-only: wall-clock seconds, CPU seconds of the hook's thread, or of its process",
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the workload and the hooks on the GPU")
    parser.add_argument(
        "--backend", default="gloo", choices=["gloo", "nccl"], help="the one-rank process group's backend"
    )
    parser.add_argument(
        "--fuse",
        action="store_true",
        help="time each hook alone, eager against compile=True, alternating (compression methods only)",
    )
    parser.add_argument("--profile", type=int, default=0, help="print this many profiler rows per hook")
    parser.add_argument("--profile-hooks", nargs="+", default=[], help="hooks to profile (default: all)")
    args = parser.parse_args(argv)
    print("$ python benchmarks/bench_compression.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    timeout = 3600.0
    for workload in args.workloads:
        if args.fuse:
            [reasons] = run_on_ranks(
                _fused_hook_seconds,
                world_size=1,
                args=(workload, args.hooks, args.reps, args.threads, args.device),
                backend=args.backend,
                timeout=timeout,
            )
            print("\nGraph breaks:\n" + "\n".join(reasons) + "\n", flush=True)
            continue
        if args.hook_only:
            [seconds] = run_on_ranks(
                _hook_seconds,
                world_size=1,
                args=(workload, args.hooks, args.reps, args.threads, args.clock, args.device),
                backend=args.backend,
                timeout=timeout,
            )
            print(_table(workload, seconds, "hook ms" if args.clock == "wall" else "hook CPU ms"), "\n", flush=True)
            for hook in args.profile_hooks or (args.hooks if args.profile else []):
                [table] = run_on_ranks(
                    _hook_profile,
                    world_size=1,
                    args=(workload, hook, 10, args.threads, args.profile or 12, args.device),
                    backend=args.backend,
                    timeout=timeout,
                )
                print(f"#### profile: {workload}, {hook}, 10 hook calls\n```\n{table}```\n", flush=True)
            continue
        [(seconds, without_optimizer)] = run_on_ranks(
            _measure,
            world_size=1,
            args=(workload, args.hooks, args.reps, args.steps, args.warmup, args.threads, args.device),
            backend=args.backend,
            timeout=timeout,
        )
        print(_table(workload, seconds), "\n", flush=True)
        print(_table(workload, without_optimizer, "ms without optimizer.step"), "\n", flush=True)
        if args.profile:
            for hook in args.profile_hooks or args.hooks:
                [table] = run_on_ranks(
                    _profile,
                    world_size=1,
                    args=(workload, hook, args.steps, args.warmup, args.threads, args.profile),
                    timeout=timeout,
                )
                print(f"#### profile: {workload}, {hook}\n```\n{table}```\n", flush=True)


if __name__ == "__main__":
    main()
