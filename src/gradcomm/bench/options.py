"""The arguments of ``gradcomm bench``: declared for argparse, then checked before any rank starts.

Every argument, hook option and the output folder is checked here, so that a bad one ends the run at once in
one line (:class:`BenchError`, exit 2) instead of in a rank minutes later; :mod:`gradcomm.bench.cli` runs
what passed. :data:`DESCRIPTION` and :data:`EPILOG` are the text of ``gradcomm bench --help``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import time
from pathlib import Path
from typing import Any

from gradcomm.bench.runner import BENCH_OPTION_DEFAULTS, BenchConfig, HookChoice, hook_options
from gradcomm.bench.workloads import WORKLOADS
from gradcomm.errors import GradcommError

__all__ = [
    "BENCH_EXTRA",
    "DEFAULT_HOOKS",
    "DESCRIPTION",
    "EPILOG",
    "BenchError",
    "add_arguments",
    "bench_config",
    "check_bench_extra",
    "create_output",
    "host_layout",
    "output_folder",
]

BENCH_EXTRA = ("rich", "matplotlib")
"""The modules of pyproject's ``bench`` extra: the table and progress bar (rich) and the plot (matplotlib)."""

DEFAULT_HOOKS = (
    "allreduce",
    "fp16_compress",
    "powersgd:matrix_approximation_rank=1",
    "powersgd:matrix_approximation_rank=4",
    "signsgd",  # the compression method with the best loss on both workloads (benchmarks/RESULTS.md)
)


# `gradcomm bench --help` prints these as written (plain text: the modules' docstrings are for developers).
DESCRIPTION = """\
Which hook gets my model to a given loss fastest, on my bandwidth? gradcomm
bench answers by training: it trains the workload once per hook on local ranks
(2 by default) with the same seeds and data, and prints a table with one row
per hook: final loss, MB sent per step, compression ratios, compute and
measured ms per step, the step time projected at 1, 10 and 100 Gbit/s, and the
time to reach a target loss. It writes results.json, results.csv and plot.png
to an output folder named at the end.

With --bandwidth each rank sits behind a link shaped to that rate (needs root
or CAP_NET_ADMIN); with --nodes N --procs-per-node P it emulates N hosts joined
by such a link. Started by torchrun it joins that job instead (NCCL and the
local GPU where there is one). Bad input and a failed rank end in one line on
stderr and a non-zero exit."""

EPILOG = """\
A hook is NAME or NAME:key=value,key=value (powersgd:matrix_approximation_rank=4).
So is the training method diloco; its compressor's own options are joined by ';'
(diloco:compressor=topk:ratio=0.02;min_numel=0).

examples:
  gradcomm bench
      transformer; allreduce, fp16, PowerSGD rank 1 and 4, signSGD
  gradcomm bench --workload cnn --steps 300 --hooks allreduce topk:ratio=0.01 qsgd
      the CNN, 300 steps, three hooks
  gradcomm bench --hooks allreduce diloco:sync_every=50,fragments=4,compressor=qsgd
      allreduce beside DiLoCo (outer sync every 50 steps, 4 fragments, 4-bit)
  gradcomm bench --bandwidth 100mbit --latency 1ms
      each rank behind a 100 Mbit/s link with 1 ms delay (root)
  gradcomm bench --project 100mbit --target-loss 2
      time to loss 2, measured and projected at 100 Mbit/s
  gradcomm bench --nodes 2 --procs-per-node 2 --bandwidth 1gbit \\
      --hooks allreduce hierarchical:inner=allreduce,ranks_per_node=2
      two emulated hosts of two ranks each (root)
  torchrun --nproc-per-node 2 -m gradcomm bench
      under torchrun (env:// rendezvous)

Figures measured with these commands: benchmarks/RESULTS.md in the repository."""


class BenchError(GradcommError):
    """A problem to report in one line (exit status 2 for bad input, 1 for a failed run)."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the bench's arguments on ``parser`` (the ``gradcomm bench`` subcommand's)."""
    from gradcomm.bench.methods import METHODS
    from gradcomm.hooks.registry import hook_names

    parser.add_argument("--workload", default="transformer", help=f"one of: {', '.join(WORKLOADS)}")
    parser.add_argument(
        "--hooks",
        nargs="+",
        default=list(DEFAULT_HOOKS),
        metavar="HOOK",
        help=f"hooks to compare, each NAME or NAME:key=value,key=value. Names: {', '.join(hook_names())}; "
        f"training methods: {', '.join(METHODS)} (diloco:sync_every=50,compressor=qsgd)",
    )
    parser.add_argument("--steps", type=int, default=150, help="training steps per hook")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the steady-state figures")
    parser.add_argument("--world-size", type=int, default=None, help="local ranks (default 2)")
    parser.add_argument("--nodes", type=int, default=None, help="emulated hosts, each a network namespace "
                        "shared by its ranks, joined by a link shaped to --bandwidth, one torchrun each (root)")
    parser.add_argument("--procs-per-node", type=int, default=None, help="ranks per --nodes host (default 1)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--powersgd-rank", type=int, default=None, help="matrix_approximation_rank for hooks "
                        "that take it and do not set it")
    parser.add_argument("--hook-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option for every hook that accepts it (repeatable)")
    parser.add_argument("--bandwidth", default=None, help="shape each rank's link, e.g. 100mbit, 1gbit (root)")
    parser.add_argument("--latency", default="0", help="one-way delay added to each link, e.g. 1ms")
    parser.add_argument("--project", default=None, metavar="RATE",
                        help="also project the times to the target loss at this link rate, e.g. 100mbit "
                        "(default: the --bandwidth rate when shaped)")
    parser.add_argument("--target-loss", type=float, default=None, metavar="LOSS",
                        help="the smoothed training loss the time-to-target column counts to (default: "
                        "allreduce's final smoothed loss + 2%%, or the best hook's without allreduce)")
    parser.add_argument("--output", type=Path, default=None, help="output folder (default: a new timestamped one)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="hard limit for the whole run, seconds; the hooks every rank finished are still reported")
    parser.add_argument("--collective-timeout", type=float, default=120.0,
                        help="process-group timeout: a collective waiting longer fails its rank")


def _check_numbers(args: argparse.Namespace, world_size: int) -> None:
    """Refuse numeric arguments that would fail, or mean nothing, only once the ranks run."""
    if world_size < 1:
        raise BenchError(f"--world-size must be at least 1, got {world_size}")
    if args.steps < 1:
        raise BenchError(f"--steps must be at least 1, got {args.steps}")
    if args.warmup < 0:
        raise BenchError(f"--warmup must be at least 0, got {args.warmup}")
    positive = {"--timeout": args.timeout, "--collective-timeout": args.collective_timeout}
    if args.bucket_cap_mb is not None:
        positive["--bucket-cap-mb"] = args.bucket_cap_mb
    for flag, value in positive.items():
        if not 0 < value < math.inf:
            raise BenchError(f"{flag} must be a number > 0, got {value:g}")
    if not 0 <= args.lr < math.inf:
        raise BenchError(f"--lr must be a number >= 0, got {args.lr:g}")
    import torch

    try:
        torch.Generator().manual_seed(args.seed)
    except (RuntimeError, ValueError):
        raise BenchError(f"--seed must be in -2**63..2**64-1 (torch's range), got {args.seed}") from None


def bench_config(args: argparse.Namespace, world_size: int, device: str) -> BenchConfig:
    from gradcomm.hooks.registry import check_options

    if args.workload not in WORKLOADS:
        raise BenchError(f"unknown workload {args.workload!r}; valid workloads: {', '.join(WORKLOADS)}")
    _check_numbers(args, world_size)
    try:
        hooks = [HookChoice.parse(text) for text in args.hooks]
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    if not hooks:
        raise BenchError("--hooks names no hook")
    defaults: dict[str, Any] = dict(BENCH_OPTION_DEFAULTS)
    if args.powersgd_rank is not None:
        try:
            check_options("powersgd", matrix_approximation_rank=args.powersgd_rank)
        except ValueError as exc:
            raise BenchError(f"--powersgd-rank: {exc}") from None
        defaults["matrix_approximation_rank"] = str(args.powersgd_rank)
    given = []
    for item in args.hook_option:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise BenchError(f"--hook-option {item!r} is not KEY=VALUE")
        defaults[key.strip()] = value.strip()
        given.append(key.strip())
    try:
        unused = [key for key in given if not any(choice.takes(key, defaults[key]) for choice in hooks)]
        model = None
        for choice in hooks:
            checked = choice.checked_options(defaults)
            if choice.method is not None:
                model = model if model is not None else WORKLOADS[args.workload]().build_model()
                choice.method.check_model(checked, model)
    except (ValueError, TypeError, ImportError) as exc:
        raise BenchError(str(exc)) from None
    if unused:
        accepted = {name for choice in hooks for name in hook_options(choice.name)}
        raise BenchError(
            f"--hook-option {unused[0]!r} is an option of none of the chosen hooks "
            f"({', '.join(choice.label for choice in hooks)}), nor of an inner hook or candidate they run; "
            f"they take: {', '.join(sorted(accepted)) or 'none'}"
        )
    hooks = [choice.resolved(defaults) for choice in hooks]  # each labelled with the options it runs with
    _check_target(args)
    return BenchConfig(
        workload=args.workload,
        hooks=hooks,
        steps=args.steps,
        warmup=min(args.warmup, args.steps // 2),
        seed=args.seed,
        lr=args.lr,
        bucket_cap_mb=args.bucket_cap_mb,
        option_defaults=defaults,
        device=device,
        project=args.project,
        target_loss=args.target_loss,
    )


def _check_target(args: argparse.Namespace) -> None:
    """Refuse a ``--project`` rate or ``--target-loss`` that the report could not use."""
    from gradcomm.testing.network import parse_rate

    if args.project is not None:
        try:
            parse_rate(args.project)
        except ValueError as exc:
            raise BenchError(f"--project: {exc}") from None
    if args.target_loss is not None and not math.isfinite(args.target_loss):
        raise BenchError(f"--target-loss must be a finite number, got {args.target_loss:g}")


def check_bench_extra() -> None:
    """The bench's own dependencies, checked before any rank trains: a run must not end, minutes later,
    unable to print its table or draw its plot. They are the ``bench`` extra, not gradcomm's dependencies."""
    missing = [name for name in BENCH_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise BenchError(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; "
            "install the bench's dependencies with: pip install 'gradcomm[bench]'",
            status=1,
        )


def output_folder(path: Path | None) -> Path:
    """The output folder, checked to be creatable and writable: a finished run must be able to save itself.

    It is not created here, so that a run refused for another reason leaves nothing behind. A folder that
    already holds results is refused: they would be overwritten.
    """
    output = path if path is not None else Path(f"gradcomm-bench-{time.strftime('%Y%m%d-%H%M%S')}")
    existing = output
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is not a folder" if existing == output else f"cannot be created: {existing} is not a folder"
        raise BenchError(f"--output {output} {what}; give a folder path (it is created if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BenchError(f"--output {output}: {existing} is not writable; choose a folder you can write to")
    if (output / "results.json").exists():
        raise BenchError(
            f"--output {output} already holds the results of a run (results.json); choose another folder"
        )
    return output


def create_output(output: Path) -> None:
    """Create the folder :func:`output_folder` checked, only once the run is about to start."""
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"--output {output} cannot be created: {exc.strerror or exc}") from None


def host_layout(args: argparse.Namespace) -> tuple[int, int]:
    """``(--nodes, --procs-per-node)``, checked against each other and --world-size."""
    if args.nodes is None:
        raise BenchError("--procs-per-node is the number of ranks on each of --nodes hosts: give --nodes too")
    procs = 1 if args.procs_per_node is None else args.procs_per_node
    if args.nodes < 1:
        raise BenchError(f"--nodes must be at least 1, got {args.nodes}")
    if procs < 1:
        raise BenchError(f"--procs-per-node must be at least 1, got {procs}")
    if args.world_size is not None and args.world_size != args.nodes * procs:
        raise BenchError(
            f"--world-size {args.world_size} differs from --nodes {args.nodes} x --procs-per-node {procs} = "
            f"{args.nodes * procs} ranks; leave --world-size out with --nodes"
        )
    if args.bandwidth is None:
        raise BenchError("--nodes emulates hosts joined by a shaped link: give its rate, e.g. --bandwidth 1gbit")
    return args.nodes, procs
