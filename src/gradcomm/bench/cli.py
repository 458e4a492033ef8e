"""``gradcomm bench``: the command-line layer over :mod:`gradcomm.bench.runner` and :mod:`gradcomm.bench.report`.

Locally it spawns ``--world-size`` gloo ranks (optionally each in its own network namespace behind a link
shaped to ``--bandwidth``); launched by torchrun it joins the env:// rendezvous instead, using NCCL and the
LOCAL_RANK GPU where there is one. Every failure ends in one line on stderr and a non-zero exit.

A run loses nothing and leaves nothing: every argument, hook option and the output folder are checked before
a rank starts (exit 2); the ranks' own output goes to ``<output>/logs/rank<i>.log``
(:mod:`gradcomm.bench.launch`); Ctrl-C or a failed rank ends every rank and namespace at once, and a run
with ``--bandwidth`` first removes the namespaces a killed run left behind.

With ``--nodes N --procs-per-node P`` it emulates N machines of P ranks each, joined by a link shaped to
``--bandwidth``, and starts them as a real multi-node job, one torchrun per host
(:mod:`gradcomm.bench.multinode`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import logging
import math
import os
import queue
import sys
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gradcomm.bench.runner import BENCH_OPTION_DEFAULTS, BenchConfig, HookChoice, hook_options
from gradcomm.bench.workloads import WORKLOADS
from gradcomm.errors import GradcommError

__all__ = ["DEFAULT_HOOKS", "DESCRIPTION", "EPILOG", "add_arguments", "run"]

logger = logging.getLogger(__name__)

BENCH_EXTRA = ("rich", "matplotlib")
"""The modules of pyproject's ``bench`` extra: the table and progress bar (rich) and the plot (matplotlib)."""

DEFAULT_HOOKS = (
    "allreduce",
    "fp16_compress",
    "powersgd:matrix_approximation_rank=1",
    "powersgd:matrix_approximation_rank=4",
    "signsgd",  # the compression method with the best loss on both workloads (benchmarks/RESULTS.md)
)


# `gradcomm bench --help` prints these as written (plain text: the module docstring above is for developers).
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
    parser.add_argument("--timeout", type=float, default=1800.0, help="hard limit for the whole run, seconds")
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


def _config(args: argparse.Namespace, world_size: int, device: str) -> BenchConfig:
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


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the bench; return the exit status. ``argv``: the bench's own arguments, passed on by ``--nodes``."""
    try:
        _check_bench_extra()
        if {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= os.environ.keys():
            return _run_under_torchrun(args)
        if args.nodes is not None or args.procs_per_node is not None:
            return _run_hosts(args, sys.argv[2:] if argv is None else argv)
        return _run_locally(args)
    except BenchError as exc:
        print(f"gradcomm bench: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        print("gradcomm bench: interrupted; all ranks and network namespaces were removed", file=sys.stderr)
        return 130


def _check_bench_extra() -> None:
    """The bench's own dependencies, checked before any rank trains: a run must not end, minutes later,
    unable to print its table or draw its plot. They are the ``bench`` extra, not gradcomm's dependencies."""
    missing = [name for name in BENCH_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise BenchError(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; "
            "install the bench's dependencies with: pip install 'gradcomm[bench]'",
            status=1,
        )


def _output_folder(path: Path | None) -> Path:
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


def _create(output: Path) -> None:
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"--output {output} cannot be created: {exc.strerror or exc}") from None


def _run_locally(args: argparse.Namespace) -> int:
    from gradcomm.bench.launch import RankFailure, run_ranks
    from gradcomm.bench.runner import bench_rank
    from gradcomm.testing.network import (
        NetworkSetupError,
        ShapedNetwork,
        check_network_privileges,
        parse_duration,
        parse_rate,
        remove_stale_networks,
    )

    world_size = 2 if args.world_size is None else args.world_size
    config = _config(args, world_size, "cpu")
    rate = latency = None
    network: AbstractContextManager[Any] = nullcontext()
    try:
        if args.bandwidth is not None:
            rate, latency = parse_rate(args.bandwidth), parse_duration(args.latency)
            check_network_privileges()
            network = ShapedNetwork(world_size, rate, latency)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    except NetworkSetupError as exc:
        raise BenchError(f"--bandwidth needs network namespaces: {exc}") from None
    output = _output_folder(args.output)
    if args.bandwidth is not None:
        try:
            remove_stale_networks()
        except NetworkSetupError as exc:
            raise BenchError(f"could not remove the namespaces of earlier runs: {exc}", status=1) from None
    _create(output)
    import multiprocessing

    progress_queue = multiprocessing.get_context("spawn").Queue()
    try:
        with network as net, _progress(progress_queue, config) as _:
            placement = {} if net is None else {"namespaces": net.namespaces, "master_addr": net.master_addr}
            runs = run_ranks(
                bench_rank,
                world_size,
                args=(config, progress_queue),
                log_dir=output / "logs",
                timeout=args.timeout,
                collective_timeout=args.collective_timeout,
                **placement,
            )
    except NetworkSetupError as exc:
        raise BenchError(f"could not set up the shaped network: {exc}", status=1) from None
    except RankFailure as exc:
        error_log = output / "error.log"
        try:
            error_log.write_text(exc.report)
        except OSError as write_error:
            raise BenchError(f"{exc} (the full report could not be written: {write_error})", status=1) from None
        raise BenchError(f"{exc} (full report: {error_log})", status=1) from None
    finally:
        progress_queue.close()
    _report(args, config, runs, output, rate)
    return 0


def _hosts(args: argparse.Namespace) -> tuple[int, int]:
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


def _run_hosts(args: argparse.Namespace, argv: list[str]) -> int:
    from gradcomm.bench.multinode import HostsFailure, run_hosts
    from gradcomm.bench.report import HookSummary, Projection, print_table
    from gradcomm.testing.network import (
        NetworkSetupError,
        check_network_privileges,
        parse_duration,
        parse_rate,
        remove_stale_networks,
    )

    nodes, procs = _hosts(args)
    config = _config(args, nodes * procs, "cpu")  # the ranks check it again; refused here, nothing starts
    try:
        rate, latency = parse_rate(args.bandwidth), parse_duration(args.latency)
        check_network_privileges()
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    except NetworkSetupError as exc:
        raise BenchError(f"--nodes needs network namespaces: {exc}") from None
    output = _output_folder(args.output)
    try:
        remove_stale_networks()
    except NetworkSetupError as exc:
        raise BenchError(f"could not remove the namespaces of earlier runs: {exc}", status=1) from None
    _create(output)
    print(f"{nodes} emulated hosts x {procs} ranks, one torchrun each; their output in {output}/logs/", flush=True)
    try:
        run_hosts(
            argv, nodes=nodes, procs_per_node=procs, rate_bps=rate, latency_s=latency, output=output,
            timeout=args.timeout,
        )
    except NetworkSetupError as exc:
        raise BenchError(f"could not set up the hosts' network: {exc}", status=1) from None
    except HostsFailure as exc:
        raise BenchError(str(exc), status=1) from None
    try:
        document = json.loads((output / "results.json").read_text())
        summaries = [HookSummary(**s) for s in document["summaries"]]
        described = document["config"]
        projection = Projection(**described["projection"]) if described["projection"] else None
        title = (
            f"{_title(args, config, nodes * procs)}; target loss {described['target_loss']:.4f} "
            f"({described['target_loss_rule']})"
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"the ranks ended without writing {output / 'results.json'}: {exc}", status=1) from None
    print_table(summaries, title, projection)
    print(f"results written to {output}/ (results.json, results.csv, plot.png; the ranks' output in logs/)")
    return 0


def _run_under_torchrun(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from gradcomm.bench.multinode import HOST_LINK_ENV, redirect_rank_output
    from gradcomm.bench.runner import bench_rank
    from gradcomm.testing.network import parse_rate

    emulated = HOST_LINK_ENV in os.environ  # started by --nodes, which shaped the link to --bandwidth
    if emulated:
        redirect_rank_output(int(os.environ["RANK"]))
    elif args.bandwidth is not None:
        raise BenchError("--bandwidth shapes local namespaced ranks; under torchrun the real network is measured")
    elif args.nodes is not None or args.procs_per_node is not None:
        raise BenchError(
            "--nodes and --procs-per-node start torchrun on emulated hosts; under torchrun leave them out "
            "(torchrun's --nnodes and --nproc-per-node place the ranks)"
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    # Checked on every rank before the rendezvous: a refusal ends them all, and torchrun ends the job.
    config = _config(args, int(os.environ["WORLD_SIZE"]), device)
    rate = None
    if emulated:
        rate = parse_rate(args.bandwidth)
        if local_rank == 0:
            config.host_link = os.environ[HOST_LINK_ENV]
    output = _output_folder(args.output) if os.environ["RANK"] == "0" else None
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        timeout=datetime.timedelta(seconds=args.collective_timeout),
        device_id=torch.device(device) if device.startswith("cuda") else None,  # NCCL's barrier then knows it
    )
    try:
        runs = bench_rank(config)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, runs)
        if output is not None:
            _create(output)
            _report(args, config, gathered, output, rate)
    finally:
        dist.destroy_process_group()
    if emulated:  # as local ranks do: no C++ destructor can abort a finished rank (gradcomm.testing.processes)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _report(
    args: argparse.Namespace, config: BenchConfig, runs: list[list[dict[str, Any]]], output: Path, rate: float | None
) -> None:
    from gradcomm.bench.report import (
        Projection,
        choose_target,
        host_link_bytes_per_step,
        print_table,
        summarize,
        write_outputs,
    )
    from gradcomm.testing.network import parse_rate

    projection = None
    if config.project is not None:
        projection = Projection(config.project, parse_rate(config.project))
    elif rate is not None:
        projection = Projection(args.bandwidth, rate)
    target = choose_target(runs[0], config.target_loss)
    summaries = [
        summarize(
            run, config.warmup, rate, target, projection,
            host_link_bytes_per_step([ranks[h] for ranks in runs], config.warmup),
        )
        for h, run in enumerate(runs[0])
    ]
    described = {
        **asdict(config),
        "hooks": [choice.label for choice in config.hooks],
        "world_size": len(runs),
        "data": WORKLOADS[config.workload]().data_description(),
        "bandwidth": args.bandwidth,
        "latency": args.latency if args.bandwidth else None,
        "target_loss": target.loss,
        "target_loss_rule": target.rule,
        "projection": None if projection is None else asdict(projection),
        "nodes": args.nodes,
        "procs_per_node": args.procs_per_node,
        "command": " ".join(["gradcomm", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else None,
    }
    title = f"{_title(args, config, len(runs))}; target loss {target.loss:.4f} ({target.rule})"
    print_table(summaries, title, projection)
    try:
        paths = write_outputs(output, described, runs, summaries, target, projection)
    except OSError as exc:
        raise BenchError(f"could not write the results to {output}: {exc}", status=1) from None
    print(f"results written to {output}/ ({', '.join(p.name for p in paths.values())})")


def _title(args: argparse.Namespace, config: BenchConfig, world_size: int) -> str:
    if args.nodes is not None:
        ranks = f"{args.nodes} hosts x {world_size // args.nodes} ranks behind {args.bandwidth} host links"
    else:
        ranks = f"{world_size} ranks" + (f" behind {args.bandwidth} links" if args.bandwidth else "")
    return f"{config.workload}, {ranks}, {config.steps} steps per hook"


class _progress:
    """A rich progress bar fed by rank 0 through a queue, on a background thread."""

    def __init__(self, updates: Any, config: BenchConfig) -> None:
        self.updates = updates
        self.config = config
        self.stop = threading.Event()

    def __enter__(self) -> _progress:
        from rich.progress import Progress

        self.bar = Progress(transient=False)
        self.task = self.bar.add_task("training", total=self.config.steps * len(self.config.hooks))
        self.bar.start()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()
        return self

    def _follow(self) -> None:
        done: dict[str, int] = {}
        while not self.stop.is_set():
            try:
                label, step = self.updates.get(timeout=0.2)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            done[label] = step
            self.bar.update(self.task, completed=sum(done.values()), description=f"training {label}")

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=2)
        self.bar.stop()
