"""The codec alone: CPU ms of every compression method's ``compress`` and ``decompress`` over a workload's gradients.

``bench_compression.py`` times whole steps, or the whole hook (its collectives, futures and gloo's threads
included); on a shared machine both move by more than a codec change of a few hundred microseconds. This
times only the two halves of the codec, in this thread, with no process group: each method compresses every
gradient the hook would compress (``min_numel`` and more elements, compressed at least twice smaller: the
hook's defaults) one after the other, as the hook does, then decompresses every payload. Methods alternate
(their order rotated every repetition), and the table gives each one's median over the repetitions of CPU
ms per pass over all the gradients (``time.process_time``; one torch thread, so nothing else runs in the
process). ``--instructions`` counts instead the instructions of one pass of each method under valgrind's
callgrind (after two untimed passes, in one process per workload): exact and repeatable, where the timings of
the same tree move by 30% or more between runs on a busy host, but blind to memory stalls and page faults.

    python benchmarks/bench_codecs.py [--workloads cnn transformer] [--methods signsgd terngrad ...] [--reps 30]
    python benchmarks/bench_codecs.py --instructions [--workloads ...] [--methods ...]
    python benchmarks/bench_codecs.py --count [--workloads ...] [--methods ...] [--tensors 28 800] [--world-size 1 2 3]

``--against REV`` times instead the whole hook (CPU seconds of the process: every thread) on each workload's
gradients as one bucket, this tree's against git revision ``REV``'s (its ``src/gradcomm`` copied and imported
as ``gradcomm_before``), alternating in one process, and prints medians and quartiles per method::

    python benchmarks/bench_codecs.py --against 326c082 --workloads transformer --reps 15

``--count`` counts instead the aten operators of one call of each method's whole hook (encoding, collectives
and decoding, every thread: :func:`gradcomm.testing.op_count.hook_calls`) on a one-rank gloo group (or, with
``--world-size``, on rank 0 of groups of that many local ranks, a table each), with each workload's gradients
as one bucket and with :func:`~gradcomm.testing.op_count.many_tensor_bucket` s of ``--tensors`` tensors,
beside a plain allreduce's; the table gives each method's count beyond allreduce's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import callgrind  # noqa: E402
from bench_compression import _one_bucket, _spread  # noqa: E402

from gradcomm.compression.base import Compressor  # noqa: E402
from gradcomm.compression.registry import methods  # noqa: E402
from gradcomm.hooks.compression_hook import CompressionState  # noqa: E402
from gradcomm.hooks.registry import make_comm_hook  # noqa: E402
from gradcomm.testing import run_on_ranks  # noqa: E402
from gradcomm.testing.op_count import calls_at_world_size, calls_per_bucket, many_tensor_bucket  # noqa: E402


def _compressed_gradients(workload: str, compressor: Compressor) -> list[torch.Tensor]:
    """The workload's gradients of one batch that the hook, at its defaults, would compress."""
    state = CompressionState(compressor)
    return [gradient for gradient in _one_bucket(workload).gradients() if state.compresses(gradient)]


def _pass_seconds(compressor: Compressor, gradients: list[torch.Tensor], marked: bool = False) -> tuple[float, float]:
    """CPU seconds of compressing every gradient, then of decompressing every payload; ``marked``: each half
    ends a callgrind stretch."""
    start = time.process_time()
    encoded = []
    for key, gradient in enumerate(gradients):
        with compressor.stream(key):
            encoded.append(compressor.compress(gradient))
    if marked:
        callgrind.stop()
    middle = time.process_time()
    for payload, ctx in encoded:
        compressor.decompress(payload, ctx)
    if marked:
        callgrind.stop()
    return middle - start, time.process_time() - middle


def measure(workload: str, names: list[str], reps: int) -> dict[str, tuple[list[float], list[float]]]:
    """Per method, its encode and decode seconds of each repetition (after two untimed passes)."""
    compressors = {name: methods()[name]() for name in names}
    gradients = {name: _compressed_gradients(workload, compressor) for name, compressor in compressors.items()}
    for name in names:
        for _ in range(2):
            _pass_seconds(compressors[name], gradients[name])
    seconds: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            encode, decode = _pass_seconds(compressors[name], gradients[name])
            seconds[name][0].append(encode)
            seconds[name][1].append(decode)
    return seconds


_UNDER_VALGRIND = "GRADCOMM_CALLGRIND_CHILD"


def _marked_passes(workload: str, names: list[str]) -> None:
    """Under callgrind: each method's encoding, then its decoding, as one counted stretch each."""
    callgrind.prime()
    for name in names:
        compressor = methods()[name]()
        gradients = _compressed_gradients(workload, compressor)
        for _ in range(2):
            _pass_seconds(compressor, gradients)
        callgrind.start()
        _pass_seconds(compressor, gradients, marked=True)


def instructions(workload: str, names: list[str]) -> dict[str, tuple[int, int]]:
    """Per method, the instructions of one pass of encoding and of decoding."""
    command = [sys.executable, __file__, "--workloads", workload, "--methods", *names]
    counts = callgrind.count_instructions(command, {_UNDER_VALGRIND: "1"})
    return {name: (counts[2 * i], counts[2 * i + 1]) for i, name in enumerate(names)}


BASELINE = "allreduce"


def op_counts(buckets: list[str], hooks: list[str], device: str = "cpu") -> dict[str, dict[str, int]]:
    """Per bucket (a workload's name, or ``"N tensors"``), per hook, the aten operators of one hook call on
    this rank (:func:`~gradcomm.testing.op_count.calls_per_bucket`), the bucket on ``device``."""
    return calls_per_bucket(buckets, hooks, device)


def count_table(counts: dict[str, dict[str, int]]) -> str:
    """Markdown: one row per hook, one column per bucket, each count beyond allreduce's (allreduce's own)."""
    names = list(counts)
    lines = ["| hook | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for hook in next(iter(counts.values())):
        cells = [
            str(counts[name][hook]) if hook == BASELINE else f"{counts[name][hook] - counts[name][BASELINE]:+d}"
            for name in names
        ]
        lines.append(f"| {hook} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _package_at(revision: str) -> Path:
    """``src/gradcomm`` at ``revision``, copied into a temporary folder as the package ``gradcomm_before``."""
    import re
    import subprocess
    import tarfile
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="gradcomm_before_"))
    archive = subprocess.run(
        ["git", "archive", revision, "src/gradcomm"], check=True, capture_output=True, cwd=Path(__file__).parent.parent
    ).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    (root / "src" / "gradcomm").rename(root / "gradcomm_before")
    for path in (root / "gradcomm_before").rglob("*.py"):
        path.write_text(re.sub(r"\bgradcomm\b", "gradcomm_before", path.read_text()))
    return root


def hook_seconds_against(root: str, workloads: list[str], names: list[str], reps: int) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """Per workload and method, CPU seconds of one hook call (after two untimed ones, a fresh state per
    repetition): this tree's and ``gradcomm_before``'s, alternating; run on a one-rank group."""
    import importlib

    import torch.distributed as dist

    sys.path.insert(0, root)
    before = importlib.import_module("gradcomm_before.hooks.registry")
    before_bucket = importlib.import_module("gradcomm_before.hooks.grad_bucket")
    torch.set_num_threads(1)
    out: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for workload in workloads:
        bucket = many_tensor_bucket(int(workload.split()[0])) if workload.endswith("tensors") else _one_bucket(workload)
        old_bucket = before_bucket.GradBucket(
            0, bucket.buffer(), bucket._offsets, bucket._lengths, bucket._shapes, bucket.parameters(), True
        )
        values = bucket.buffer().clone()
        out[workload] = {name: ([], []) for name in names}
        for rep in range(reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                pairs = [(make_comm_hook, bucket, 0), (before.make_comm_hook, old_bucket, 1)]
                for make, its_bucket, slot in pairs if rep % 2 == 0 else pairs[::-1]:
                    hook, state = make(name, process_group=dist.group.WORLD)
                    for _ in range(2):
                        its_bucket.buffer().copy_(values)
                        hook(state, its_bucket).wait()
                    its_bucket.buffer().copy_(values)
                    start = time.process_time()
                    hook(state, its_bucket).wait()
                    out[workload][name][slot].append(time.process_time() - start)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="*", choices=["cnn", "transformer"], default=["cnn", "transformer"])
    parser.add_argument("--methods", nargs="+", default=sorted(methods()))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--instructions", action="store_true", help="count instructions under callgrind instead")
    parser.add_argument("--device", default="cpu", help="with --count: cpu, or cuda")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="with --count: the group's")
    parser.add_argument("--against", help="time the hook against this git revision's, alternating")
    parser.add_argument("--count", action="store_true", help="count the aten operators of one hook call instead")
    parser.add_argument(
        "--tensors", nargs="*", type=int, default=[28, 800], help="with --count or --against: bucket sizes"
    )
    parser.add_argument(
        "--world-size", nargs="+", type=int, default=[1], help="with --count: ranks of the group (a table each)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if os.environ.get(_UNDER_VALGRIND):
        for workload in args.workloads:
            _marked_passes(workload, args.methods)
        return
    print("$ python benchmarks/bench_codecs.py " + shlex.join(argv if argv is not None else sys.argv[1:]))
    if args.against:
        root = _package_at(args.against)
        [seconds] = run_on_ranks(
            hook_seconds_against,
            world_size=1,
            args=(str(root), [*args.workloads, *(f"{n} tensors" for n in args.tensors)], args.methods, args.reps),
            timeout=3600.0,
        )
        for workload, by_method in seconds.items():
            print(f"\n### {workload}: hook CPU ms, median (quartiles) of {args.reps}, this tree vs {args.against}\n")
            print("| method | now | before | ratio of medians |\n|---|---|---|---|")
            for name, (now, then) in by_method.items():
                ratio = statistics.median(now) / statistics.median(then)
                print(f"| {name} | {_spread(now)} | {_spread(then)} | {ratio:.2f} |")
        return
    if args.count:
        buckets = [*args.workloads, *(f"{n} tensors" for n in args.tensors)]
        for world_size in args.world_size:
            counts = calls_at_world_size(
                buckets, [BASELINE, *args.methods], world_size, device=args.device, backend=args.backend, timeout=3600.0
            )
            print(
                f"\n### aten operators per hook call on rank 0 of {world_size}, one bucket (allreduce: its own; "
                "methods: beyond it)\n"
            )
            print(count_table(counts))
        return
    if args.instructions:
        for workload in args.workloads:
            counts = instructions(workload, args.methods)
            print(f"\n### {workload}: millions of instructions per pass over the compressed gradients\n")
            print("| method | encode | decode | both |\n|---|---|---|---|")
            for name, (encode, decode) in counts.items():
                print(f"| {name} | {encode / 1e6:.2f} | {decode / 1e6:.2f} | {(encode + decode) / 1e6:.2f} |")
        return
    for workload in args.workloads:
        seconds = measure(workload, args.methods, args.reps)
        print(f"\n### {workload}: CPU ms per pass over the compressed gradients (median of {args.reps})\n")
        print("| method | encode | decode | both |\n|---|---|---|---|")
        for name, (encode, decode) in seconds.items():
            both = [e + d for e, d in zip(encode, decode, strict=True)]
            print(
                f"| {name} | {1e3 * statistics.median(encode):.2f} | {1e3 * statistics.median(decode):.2f} "
                f"| {1e3 * statistics.median(both):.2f} |"
            )


if __name__ == "__main__":
    main()
