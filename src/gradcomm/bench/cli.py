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
import dataclasses
import datetime
import json
import logging
import os
import queue
import sys
import threading
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gradcomm.bench.options import (
    DEFAULT_HOOKS,
    DESCRIPTION,
    EPILOG,
    BenchError,
    add_arguments,
    bench_config,
    check_bench_extra,
    create_output,
    host_layout,
    output_folder,
)
from gradcomm.bench.runner import BenchConfig
from gradcomm.bench.workloads import WORKLOADS

__all__ = ["DEFAULT_HOOKS", "DESCRIPTION", "EPILOG", "add_arguments", "run"]

logger = logging.getLogger(__name__)


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the bench; return the exit status. ``argv``: the bench's own arguments, passed on by ``--nodes``."""
    try:
        check_bench_extra()
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
    config = bench_config(args, world_size, "cpu")
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
    output = output_folder(args.output)
    if args.bandwidth is not None:
        try:
            remove_stale_networks()
        except NetworkSetupError as exc:
            raise BenchError(f"could not remove the namespaces of earlier runs: {exc}", status=1) from None
    create_output(output)
    (output / "finished").mkdir(exist_ok=True)
    import multiprocessing

    progress_queue = multiprocessing.get_context("spawn").Queue()
    try:
        with network as net, _progress(progress_queue, config) as _:
            placement = {} if net is None else {"namespaces": net.namespaces, "master_addr": net.master_addr}
            runs = run_ranks(
                bench_rank,
                world_size,
                args=(config, progress_queue, str(output / "finished")),
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
        _report_finished(args, config, output, world_size, rate)
        raise BenchError(f"{exc} (full report: {error_log})", status=1) from None
    finally:
        progress_queue.close()
    _report(args, config, runs, output, rate)
    return 0


def _report_finished(
    args: argparse.Namespace, config: BenchConfig, output: Path, world_size: int, rate: float | None
) -> None:
    """After a failed or stopped run: the table and results of the hooks every rank finished, if any."""
    from gradcomm.bench.runner import finished_runs

    finished = finished_runs(output / "finished", world_size)
    if finished:  # e.g. stopped by --timeout: the hooks every rank finished are still worth their table
        done = len(finished[0])
        print(f"the run stopped during hook {done + 1} of {len(config.hooks)}; the {done} finished:", flush=True)
        _report(args, dataclasses.replace(config, hooks=config.hooks[:done]), finished, output, rate)


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

    nodes, procs = host_layout(args)
    config = bench_config(args, nodes * procs, "cpu")  # the ranks check it again; refused here, nothing starts
    try:
        rate, latency = parse_rate(args.bandwidth), parse_duration(args.latency)
        check_network_privileges()
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    except NetworkSetupError as exc:
        raise BenchError(f"--nodes needs network namespaces: {exc}") from None
    output = output_folder(args.output)
    try:
        remove_stale_networks()
    except NetworkSetupError as exc:
        raise BenchError(f"could not remove the namespaces of earlier runs: {exc}", status=1) from None
    create_output(output)
    print(f"{nodes} emulated hosts x {procs} ranks, one torchrun each; their output in {output}/logs/", flush=True)
    try:
        run_hosts(
            argv, nodes=nodes, procs_per_node=procs, rate_bps=rate, latency_s=latency, output=output,
            timeout=args.timeout,
        )
    except NetworkSetupError as exc:
        raise BenchError(f"could not set up the hosts' network: {exc}", status=1) from None
    except HostsFailure as exc:
        _report_finished(args, config, output, nodes * procs, rate)
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

    from gradcomm.bench.multinode import FINISHED_DIR_ENV, HOST_LINK_ENV, redirect_rank_output
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
    config = bench_config(args, int(os.environ["WORLD_SIZE"]), device)
    rate = None
    if emulated:
        rate = parse_rate(args.bandwidth)
        if local_rank == 0:
            config.host_link = os.environ[HOST_LINK_ENV]
    output = output_folder(args.output) if os.environ["RANK"] == "0" else None
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        timeout=datetime.timedelta(seconds=args.collective_timeout),
        device_id=torch.device(device) if device.startswith("cuda") else None,  # NCCL's barrier then knows it
    )
    try:
        runs = bench_rank(config, finished_dir=os.environ.get(FINISHED_DIR_ENV))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, runs)
        if output is not None:
            create_output(output)
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
