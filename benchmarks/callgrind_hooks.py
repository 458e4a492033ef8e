"""Instructions of one call of each compression hook, this tree's against another revision's, under callgrind.

The CPU-time question of issue 36 ("the hook alone at most 0.5x of the per-tensor code's time") is asked on a
host whose timings move by 30-50% between runs; instructions executed repeat exactly. This counts, under
valgrind's callgrind (``benchmarks/callgrind.py``), the instructions of one call of each method's whole hook
(encoding, the one-rank gloo collective, decoding and writing back; every thread), on a workload's gradients
of one batch as one bucket (:func:`gradcomm.testing.op_count.workload_bucket`) or on a bucket of N tensors
(:func:`~gradcomm.testing.op_count.many_tensor_bucket`), after three untimed calls. The other revision's
``src/gradcomm`` is imported as ``gradcomm_before`` (as ``bench_codecs.py --against`` does), and both trees
run in one process, hook after hook::

    python benchmarks/callgrind_hooks.py --against 326c082 --buckets transformer cnn 800 --methods topk signsgd

Instructions do not see memory stalls or page faults, which the bandwidth-bound hooks on large buckets pay:
report them beside timings, not instead. A few minutes per method and bucket.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import callgrind  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_codecs import _package_at  # noqa: E402

from gradcomm.compression.registry import methods  # noqa: E402
from gradcomm.hooks.registry import make_comm_hook  # noqa: E402
from gradcomm.testing.op_count import many_tensor_bucket, workload_bucket  # noqa: E402

_CHILD = "GRADCOMM_CALLGRIND_HOOKS_CHILD"


def _bucket(name: str):  # noqa: ANN202 (a GradBucket)
    return many_tensor_bucket(int(name)) if name.isdigit() else workload_bucket(name)


def _marked_calls(root: str, bucket_name: str, names: list[str]) -> None:
    """Under callgrind: for each method, one call of this tree's hook, then one of ``gradcomm_before``'s, each
    a counted stretch."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    sys.path.insert(0, root)
    before = importlib.import_module("gradcomm_before.hooks.registry")
    before_bucket = importlib.import_module("gradcomm_before.hooks.grad_bucket")
    bucket = _bucket(bucket_name)
    old_bucket = before_bucket.GradBucket(
        0, bucket.buffer(), bucket._offsets, bucket._lengths, bucket._shapes, bucket.parameters(), True
    )
    values = bucket.buffer().clone()
    callgrind.prime()
    for name in names:
        for make, its_bucket in ((make_comm_hook, bucket), (before.make_comm_hook, old_bucket)):
            hook, state = make(name, process_group=dist.group.WORLD)
            for _ in range(3):
                its_bucket.buffer().copy_(values)
                hook(state, its_bucket).wait()
            its_bucket.buffer().copy_(values)
            callgrind.start()
            hook(state, its_bucket).wait()
            callgrind.stop()
    dist.destroy_process_group()


def _known_at(root: str, names: list[str]) -> list[str]:
    """Those of ``names`` that the tree in ``root`` (as ``gradcomm_before``) registers."""
    sys.path.insert(0, root)
    try:
        registry = importlib.import_module("gradcomm_before.hooks.registry")
        return [name for name in names if _registers(registry, name)]
    finally:
        sys.path.remove(root)


def _registers(registry: object, name: str) -> bool:
    try:
        registry.resolve_hook_name(name)  # type: ignore[attr-defined]
    except ValueError:
        return False
    return True


def instructions(revision: str, bucket_name: str, names: list[str]) -> dict[str, tuple[int, int]]:
    """Per method that both trees have, the instructions of one hook call: this tree's, and ``revision``'s."""
    root = str(_package_at(revision))
    names = _known_at(root, names)
    counts = callgrind.count_instructions([sys.executable, __file__, root, bucket_name, *names], {_CHILD: "1"})
    return {name: (counts[2 * i], counts[2 * i + 1]) for i, name in enumerate(names)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the git revision to compare with")
    parser.add_argument("--buckets", nargs="+", default=["transformer"], help="cnn, transformer, or a tensor count")
    parser.add_argument("--methods", nargs="+", default=["allreduce", *sorted(methods())])
    args = parser.parse_args(argv)
    print(f"$ python benchmarks/callgrind_hooks.py --against {args.against} --buckets {' '.join(args.buckets)}")
    for bucket_name in args.buckets:
        counts = instructions(args.against, bucket_name, args.methods)
        print(f"\n### {bucket_name}: millions of instructions of one hook call, this tree against {args.against}\n")
        print("| hook | now | before | ratio |\n|---|---|---|---|")
        for name, (now, old) in counts.items():
            print(f"| {name} | {now / 1e6:.1f} | {old / 1e6:.1f} | {now / old:.2f} |")


if __name__ == "__main__":
    if os.environ.get(_CHILD):
        _marked_calls(sys.argv[1], sys.argv[2], sys.argv[3:])
    else:
        main()
