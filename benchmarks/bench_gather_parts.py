"""One gloo all-gather against the same bytes as several concurrent all-gathers, and against an allreduce.

Two gloo ranks, each in its own network namespace behind a link shaped to ``--bandwidth`` (root; see
:mod:`gradcomm.testing.network`). For each size (bytes per rank) it times, median of ``--reps`` after a
barrier: an allreduce of the tensor (a ring on two ranks puts the same bytes on each link as an all-gather),
``torch.distributed.all_gather_into_tensor`` of the tensor sent whole or as 2, 4 and 8 concurrent parts, and
gradcomm's all-gather; then an all-to-all sending a chunk of the same size to the peer, torch's and gradcomm's;
then the same exchange of one chunk with the peer by ``isend``/``irecv``, the receive posted first and, for
comparison, the send first. On gloo gradcomm's all-gather and all-to-all are that exchange, receives first.
The "% of link" column is the link's time for the bytes each rank sends (``bytes * 8 / rate``) over the
slower rank's time. What :func:`gradcomm.comm.all_gather_into_tensor` does on gloo rests on it.

``--late-ms D``: rank 1 starts each collective ``D`` ms after rank 0 (in training the ranks never reach a
collective together), and each rank's time is counted from rank 1's start. gloo's all-gather and all-to-all
post each send before the matching receive, and a send waits until the peer has posted its receive: the
later rank's "ready to receive" then leaves behind its own data, and its peer starts sending only after that.

    sudo python benchmarks/bench_gather_parts.py --bandwidth 100mbit --sizes 0.43 1.65
    sudo python benchmarks/bench_gather_parts.py --bandwidth 1gbit --sizes 0.23 1.65 6.6
    sudo python benchmarks/bench_gather_parts.py --bandwidth 100mbit --sizes 0.066 0.35 --late-ms 20
    python benchmarks/bench_gather_parts.py --bandwidth none --sizes 0.35 1.65
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist

from gradcomm import comm
from gradcomm.testing import run_on_ranks
from gradcomm.testing.network.parsing import parse_rate
from gradcomm.testing.network.shaped import ShapedNetwork

PARTS = (1, 2, 4, 8)


def _gather_in_parts(tensor: torch.Tensor, parts: int) -> None:
    chunks = tensor.tensor_split(parts)
    works = [
        dist.all_gather_into_tensor(chunk.new_empty(2 * chunk.numel()), chunk, async_op=True) for chunk in chunks
    ]
    for work in works:
        work.wait()


def _exchange_with_peer(rows: torch.Tensor, receive_first: bool) -> None:
    """Send this rank's row to the other rank and receive the other's, with ``torch.distributed`` directly."""
    peer = 1 - dist.get_rank()
    received = torch.empty_like(rows[peer])
    posts = [lambda: dist.irecv(received, peer), lambda: dist.isend(rows[dist.get_rank()], peer)]
    for work in [post() for post in (posts if receive_first else posts[::-1])]:
        work.wait()


def _time_on_rank(numels: list[int], reps: int, late_s: float) -> dict[tuple[int, str], float]:
    torch.set_num_threads(1)
    seconds: dict[tuple[int, str], float] = {}
    for numel in numels:
        tensor = torch.randn(numel)
        ways = {"allreduce": lambda tensor=tensor: dist.all_reduce(tensor)}
        for parts in PARTS:
            label = f"all-gather, {parts} part{'s' * (parts > 1)}"
            ways[label] = lambda tensor=tensor, parts=parts: _gather_in_parts(tensor, parts)
        ways["gradcomm.comm.all_gather_into_tensor"] = lambda tensor=tensor: comm.all_gather_into_tensor(tensor).wait()
        rows = torch.randn(2, numel)  # a chunk of the tensor's size for each rank
        ways["all_to_all_single, whole"] = lambda rows=rows: dist.all_to_all_single(torch.empty_like(rows), rows)
        ways["gradcomm.comm.all_to_all_single"] = lambda rows=rows: comm.all_to_all_single(rows).wait()
        ways["isend/irecv, receive first"] = lambda rows=rows: _exchange_with_peer(rows, receive_first=True)
        ways["isend/irecv, send first"] = lambda rows=rows: _exchange_with_peer(rows, receive_first=False)
        for name, way in ways.items():
            times = []
            for _ in range(reps):
                dist.barrier()
                start = time.perf_counter()
                if dist.get_rank() == 1:
                    time.sleep(late_s)
                start += late_s
                way()
                times.append(time.perf_counter() - start)
            seconds[(numel, name)] = statistics.median(times)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--bandwidth", default="100mbit", help="each rank's link rate, e.g. 100mbit, 1gbit; 'none': the loopback"
    )
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.43, 1.65, 6.6], help="MB per rank")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--late-ms", type=float, default=0.0, help="rank 1 starts each collective this much later")
    args = parser.parse_args(argv)
    numels = [int(size * 1e6) // 4 for size in args.sizes]
    timing = (numels, args.reps, args.late_ms / 1e3)
    if args.bandwidth == "none":
        rate = None
        results = run_on_ranks(_time_on_rank, 2, args=timing, timeout=1800)
    else:
        rate = parse_rate(args.bandwidth)
        with ShapedNetwork(2, rate) as network:
            results = run_on_ranks(
                _time_on_rank, 2, args=timing, namespaces=network.namespaces, master_addr=network.master_addr,
                timeout=1800,
            )
    print("$ python benchmarks/bench_gather_parts.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    late = f", rank 1 {args.late_ms:g} ms late (times from its start)" if args.late_ms else ""
    where = "on the loopback" if rate is None else f"behind {args.bandwidth} links"
    print(f"\n2 gloo ranks {where}{late}; median of {args.reps}, rank 0 (rank 1 in brackets)\n")
    print("| MB per rank | collective | ms | % of link |")
    print("|---|---|---|---|")
    for (numel, name), seconds in results[0].items():
        other = results[1][(numel, name)]
        share = "" if rate is None else f"{100 * (numel * 4 * 8 / rate) / max(seconds, other):.0f}"
        print(f"| {numel * 4 / 1e6:.2f} | {name} | {seconds * 1e3:.1f} ({other * 1e3:.1f}) | {share} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
