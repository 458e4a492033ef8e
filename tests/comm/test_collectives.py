"""gradcomm.comm's all-gather and all-to-all on gloo: exchanged point to point, every receive posted first, and
what a hook receives does not show it.

On gloo (CPU tensors), :func:`gradcomm.comm.all_gather_into_tensor` and :func:`gradcomm.comm.all_to_all_single`
send to and receive from each peer by ``isend``/``irecv`` rather than gloo's collectives (see
:func:`gradcomm.comm.collectives.all_gather_into_tensor` for why). The result must be torch's collective's bit
for bit, on 2 ranks and on 3, counted as one collective of the whole input; a receive that finds no partner
must fail the future, and leave the group failing rather than pairing later messages with it.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradcomm
from gradcomm import comm
from gradcomm.comm import collectives
from gradcomm.hooks.registry import make_comm_hook
from gradcomm.testing import run_on_ranks
from tests.support.ranks import GLOO_TIMEOUT, counting_point_to_point

pytestmark = pytest.mark.slow  # a 2-rank group that waits for gloo's timeout, and a 3-rank one

# (elements, dtype): empty, one element, odd lengths of 1-, 2- and 8-byte elements, and 1.6 MB
SIZES = [
    (0, torch.float32),
    (1, torch.float32),
    (7, torch.uint8),
    (1001, torch.float16),
    (333, torch.float64),
    (400_003, torch.float32),
]


def _record(
    kind: str, posted: list[tuple[str, int, int]], run: Callable[[], bool], sent: torch.Tensor, per_peer: int
) -> dict[str, object]:
    """Run one collective through gradcomm (``run`` says whether its result is torch's); what it posted and
    counted, and what was expected: every receive before any send, one of each per peer of ``per_peer``
    elements, counted once with all of ``sent``'s bytes."""
    posted.clear()
    calls, counted = comm.traffic.calls.get(kind, 0), comm.traffic.bytes_sent.get(kind, 0)
    equal = run()
    peers = [peer for peer in range(dist.get_world_size()) if peer != dist.get_rank()]
    return {
        "equal": equal,
        "posted": sorted(posted[: len(peers)]) + sorted(posted[len(peers) :]),
        "expected": [("irecv", peer, per_peer) for peer in peers] + [("isend", peer, per_peer) for peer in peers],
        "counted": (comm.traffic.calls[kind] - calls, comm.traffic.bytes_sent[kind] - counted),
        "expected_counted": (1, sent.numel() * sent.element_size()),
    }


def _collectives() -> dict[str, dict[str, object]]:
    rank, world_size, results = dist.get_rank(), dist.get_world_size(), {}
    for numel, dtype in SIZES:
        generator = torch.Generator().manual_seed(1000 * rank + numel)
        tensor = torch.randint(0, 100, (numel,), generator=generator).to(dtype)
        expected = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(expected, tensor)
        with counting_point_to_point() as posted:
            results[f"all-gather of {numel} x {dtype}"] = _record(
                "all_gather", posted,
                lambda tensor=tensor, expected=expected: torch.equal(
                    comm.all_gather_into_tensor(tensor).wait(), torch.cat(expected)
                ),
                tensor, numel,
            )
        for shape in ((world_size * numel,), (world_size, numel, 2)):
            rows = torch.randint(0, 100, shape, generator=generator).to(dtype)
            exchanged = torch.empty_like(rows)
            dist.all_to_all_single(exchanged, rows)
            with counting_point_to_point() as posted:
                results[f"all-to-all of {shape} x {dtype}"] = _record(
                    "all_to_all", posted,
                    lambda rows=rows, exchanged=exchanged: torch.equal(comm.all_to_all_single(rows).wait(), exchanged),
                    rows, rows.numel() // world_size,
                )
    # several in flight at once, of different sizes, and one launched and waited for from another's callback
    # (the thread that completes a future must not be the only one that could complete the next)
    tensors = [torch.full((1000 + 7 * i,), float(100 * rank + i)) for i in range(5)]
    futures = [comm.all_gather_into_tensor(t) for t in tensors[:4]]
    futures.append(futures[0].then(lambda _: comm.all_gather_into_tensor(tensors[4]).wait()))
    gathered = [future.wait().view(world_size, -1) for future in futures]
    results["in flight"] = {
        "equal": all(
            torch.equal(rows, torch.stack([torch.full_like(t, 100.0 * r + i) for r in range(world_size)]))
            for i, (rows, t) in enumerate(zip(gathered, tensors, strict=True))
        )
    }
    return results


UNMATCHED_TIMEOUT = 2.0  # seconds: the timeout of the group on which rank 0 alone launches a collective


def _unmatched_on_rank_zero() -> dict[str, str]:
    """Rank 0 alone launches an all-gather and an all-to-all; how each of its futures ended, and then how an
    all-gather that both ranks launch on the same group ends on each: the receive that timed out must not
    pair with the next message."""
    outcomes = {}
    launches = {
        "all-gather": lambda group: comm.all_gather_into_tensor(torch.ones(1000), group),
        "all-to-all": lambda group: comm.all_to_all_single(torch.ones(2, 1000), group),
    }
    for kind, launch in launches.items():
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=UNMATCHED_TIMEOUT))
        if dist.get_rank() == 0:
            outcomes[kind] = _outcome(lambda launch=launch, group=group: launch(group).wait())
        dist.barrier()
        outcomes[f"{kind}, then both"] = _outcome(
            lambda group=group: comm.all_gather_into_tensor(torch.full((1000,), 2.0), group).wait()
        )
        dist.barrier()
    return outcomes


def _outcome(run: Callable[[], torch.Tensor]) -> str:
    try:
        value = run()
    except RuntimeError as exc:
        return f"failed: {exc}"
    return f"completed: {value.numel()} elements, sum {value.sum().item():g}"


TRAINED_HOOKS = ["allgather", "quantize_per_tensor", "quantize_per_channel", "bytegrad"]


def _training_exchanged() -> dict[str, dict[str, object]]:
    """Each hook whose buckets travel by all-gather or all-to-all, on a model with a 4 MiB weight (several
    buckets): three steps of gradcomm's DDP, exchanging point to point, and of torch's DDP with gloo's
    collectives instead, each with its own state of the hook. Whether the parameters are the same bit for bit,
    whether they are the same on every rank, and how many sends gradcomm's posted."""
    out = {}
    exchanges = collectives._exchanges
    for name in TRAINED_HOOKS:
        replicas = []
        for ddp_class, exchanging in (
            (gradcomm.DistributedDataParallel, exchanges),
            (torch.nn.parallel.DistributedDataParallel, lambda tensor, group: False),
        ):
            collectives._exchanges = exchanging
            torch.manual_seed(0)
            model = nn.Sequential(
                nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4)
            )
            ddp = ddp_class(model)
            ddp.register_comm_hook(*reversed(make_comm_hook(name)))
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
            generator = torch.Generator().manual_seed(dist.get_rank())
            with counting_point_to_point() as posted:
                for _ in range(3):
                    optimizer.zero_grad()
                    ddp(torch.randn(8, 16, generator=generator)).square().mean().backward()
                    optimizer.step()
            replicas.append((torch.cat([p.detach().reshape(-1) for p in model.parameters()]), len(posted)))
        collectives._exchanges = exchanges
        (ours, sends), (torchs, torch_sends) = replicas
        everyone = [torch.empty_like(ours) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, ours)
        out[name] = {
            "as_torch": torch.equal(ours, torchs),
            "same_on_every_rank": all(torch.equal(other, ours) for other in everyone),
            "posted": (sends, torch_sends),
        }
    return out


def _on_two_ranks() -> dict[str, object]:
    return {"sizes": _collectives(), "unmatched": _unmatched_on_rank_zero(), "training": _training_exchanged()}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, object]]:
    return run_on_ranks(_on_two_ranks, 2, timeout=100)


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, dict[str, object]]]:
    return run_on_ranks(_collectives, 3, timeout=100)


def _check_sizes(ranks: list[dict[str, dict[str, object]]]) -> None:
    for rank, results in enumerate(ranks):
        for where, result in results.items():
            assert result["equal"], f"rank {rank}, {where}: the result is not torch's collective's"
            if where == "in flight":
                continue
            assert result["posted"] == result["expected"], (
                f"rank {rank}, {where}: posted {result['posted']}, expected every receive first: {result['expected']}"
            )
            assert result["counted"] == result["expected_counted"], (
                f"rank {rank}, {where}: counted (calls, bytes) {result['counted']}, not {result['expected_counted']}"
            )


@pytest.mark.timeout(120)
def test_exchanges_are_torchs_collectives_on_two_ranks(ranks: list[dict[str, object]]) -> None:
    """For each size: the result is torch's collective's, bit for bit (all-gather: rank-major); every receive
    was posted before any send, one of each per peer; it was counted once, with the whole input's bytes.
    Several in flight, and one waited for inside another's callback, complete with their own rows."""
    _check_sizes([rank["sizes"] for rank in ranks])


@pytest.mark.timeout(120)
def test_exchanges_are_torchs_collectives_on_three_ranks(three_ranks: list[dict[str, dict[str, object]]]) -> None:
    _check_sizes(three_ranks)


@pytest.mark.timeout(120)
def test_an_unmatched_exchange_fails_and_so_does_the_next(ranks: list[dict[str, object]]) -> None:
    """Rank 0's receive finds no partner: the future fails with gloo's timeout rather than completing with a
    result nothing was written into. gloo then closes the group's connections, so the next all-gather that
    both ranks launch fails on both, instead of pairing rank 1's message with rank 0's stale receive."""
    zero, one = ranks[0]["unmatched"], ranks[1]["unmatched"]
    for kind in ("all-gather", "all-to-all"):
        assert zero[kind].startswith("failed: ") and re.search(GLOO_TIMEOUT, zero[kind]), f"{kind}: {zero[kind]}"
        for rank, outcome in enumerate((zero[f"{kind}, then both"], one[f"{kind}, then both"])):
            assert outcome.startswith("failed: "), f"rank {rank}, {kind} then both: {outcome}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hook", TRAINED_HOOKS)
def test_training_exchanged_matches_torch_ddp_on_every_rank(ranks: list[dict[str, object]], hook: str) -> None:
    """A DDP whose buckets are exchanged point to point: parameters bit for bit those of torch's DDP with the
    same hook on gloo's collectives, identical on both ranks, and sends posted only by gradcomm's."""
    for rank in ranks:
        result = rank["training"][hook]
        assert result["as_torch"], f"{hook}: parameters differ from torch's DDP with the same hook on gloo's collectives"
        assert result["same_on_every_rank"], f"{hook}: the replicas differ"
        sends, torch_sends = result["posted"]
        assert sends > 0 and torch_sends == 0, f"{hook}: {sends} sends and receives posted, {torch_sends} by torch's"
