"""gradcomm.comm's all-gather and all-to-all on 2 gloo ranks: large ones go as concurrent parts and come back
whole.

A gloo all-gather of at least twice ``GATHER_PART_BYTES`` per rank (an all-to-all: per peer) is sent as up to
``GATHER_PARTS`` concurrent ones, each at least ``GATHER_PART_BYTES`` (see
:func:`gradcomm.comm.collectives.all_gather_into_tensor`); what a hook receives must not show it: the same
tensor as torch's collective gives, counted as one collective of the whole input.
"""

from __future__ import annotations

import datetime
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
from tests.helpers import counting_launches

PART = collectives.GATHER_PART_BYTES
# (elements, dtype, parts expected): empty, one element, one element short of two parts, two parts, three
# parts of odd length, an odd length of 2-byte elements in four parts, and more than the most parts
SIZES = [
    (0, torch.float32, 1),
    (1, torch.float32, 1),
    (2 * PART // 4 - 1, torch.float32, 1),
    (2 * PART // 4, torch.float32, 2),
    (3 * PART + 5, torch.uint8, 3),
    (2 * PART + 1, torch.float16, 4),
    (9 * PART // 4 + 3, torch.float32, collectives.GATHER_PARTS),
]


def _record(
    kind: str, launched: list[int], run: Callable[[], bool], sent: torch.Tensor, parts: int
) -> dict[str, object]:
    """Run one collective through gradcomm (``run`` says whether its result is torch's); what it launched and
    counted, and what was expected: ``sent`` in ``parts`` parts, counted once with all of ``sent``'s bytes."""
    launched.clear()
    calls, counted = comm.traffic.calls.get(kind, 0), comm.traffic.bytes_sent.get(kind, 0)
    equal = run()
    return {
        "equal": equal,
        "parts": list(launched),
        "expected": (parts, sent.numel(), (1, sent.numel() * sent.element_size())),
        "counted": (comm.traffic.calls[kind] - calls, comm.traffic.bytes_sent[kind] - counted),
    }


def _collectives_on_two_ranks() -> dict[str, dict[str, object]]:
    rank, results = dist.get_rank(), {}
    single_all_to_all = dist.all_to_all_single
    for numel, dtype, parts in SIZES:
        generator = torch.Generator().manual_seed(1000 * rank + numel)
        tensor = torch.randint(0, 100, (numel,), generator=generator).to(dtype)
        expected = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(expected, tensor)
        with counting_launches((collectives, "_all_gather_single"), (dist, "all_gather")) as launched:
            results[f"all-gather of {numel} x {dtype}"] = _record(
                "all_gather", launched,
                lambda tensor=tensor, expected=expected: torch.equal(
                    comm.all_gather_into_tensor(tensor).wait(), torch.cat(expected)
                ),
                tensor, parts,
            )
        for shape in ((2 * numel,), (2, numel)):
            rows = torch.randint(0, 100, shape, generator=generator).to(dtype)
            exchanged = torch.empty_like(rows)
            single_all_to_all(exchanged, rows)
            with counting_launches((dist, "all_to_all_single"), (dist, "all_to_all")) as launched:
                results[f"all-to-all of {shape} x {dtype}"] = _record(
                    "all_to_all", launched,
                    lambda rows=rows, exchanged=exchanged: torch.equal(comm.all_to_all_single(rows).wait(), exchanged),
                    rows, parts,
                )
    return results


UNMATCHED_TIMEOUT = 2.0  # seconds: the timeout of the group on which rank 0 alone launches a collective


def _unmatched_on_rank_zero() -> dict[str, str]:
    """Rank 0 alone launches an all-gather and an all-to-all sent in parts; how each of its futures ended."""
    outcomes = {}
    launches = {
        "all-gather": lambda group: comm.all_gather_into_tensor(torch.ones(4 * PART // 4), group),
        "all-to-all": lambda group: comm.all_to_all_single(torch.ones(2, 4 * PART // 4), group),
    }
    for kind, launch in launches.items():
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=UNMATCHED_TIMEOUT))
        if dist.get_rank() == 0:
            try:
                value = launch(group).wait()
                outcomes[kind] = f"completed: {value.numel()} elements"
            except RuntimeError as exc:
                outcomes[kind] = f"failed: {exc}"
        dist.barrier()
    return outcomes


TRAINED_HOOKS = ["allgather", "quantize_per_tensor", "quantize_per_channel", "bytegrad"]


def _training_through_parts() -> dict[str, dict[str, object]]:
    """Each hook whose buckets travel by all-gather or all-to-all, on a model with a 4 MiB weight: three steps
    of gradcomm's DDP, in parts, and of torch's DDP with parts turned off, each with its own state of the hook.
    Whether the parameters are the same bit for bit, whether they are the same on every rank, and how many
    collectives gradcomm's launched."""
    out = {}
    for name in TRAINED_HOOKS:
        replicas = []
        for ddp_class, part_bytes in (
            (gradcomm.DistributedDataParallel, PART),
            (torch.nn.parallel.DistributedDataParallel, 1 << 62),
        ):
            collectives.GATHER_PART_BYTES = part_bytes
            torch.manual_seed(0)
            model = nn.Sequential(
                nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4)
            )
            ddp = ddp_class(model)
            ddp.register_comm_hook(*reversed(make_comm_hook(name)))
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
            generator = torch.Generator().manual_seed(dist.get_rank())
            with counting_launches(
                (collectives, "_all_gather_single"), (dist, "all_gather"), (dist, "all_to_all_single"),
                (dist, "all_to_all"),
            ) as launched:
                for _ in range(3):
                    optimizer.zero_grad()
                    ddp(torch.randn(8, 16, generator=generator)).square().mean().backward()
                    optimizer.step()
            replicas.append((torch.cat([p.detach().reshape(-1) for p in model.parameters()]), len(launched)))
        collectives.GATHER_PART_BYTES = PART
        (ours, launches), (torchs, torch_launches) = replicas
        everyone = [torch.empty_like(ours) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, ours)
        out[name] = {
            "as_torch": torch.equal(ours, torchs),
            "same_on_every_rank": all(torch.equal(other, ours) for other in everyone),
            "launched": (launches, torch_launches),
        }
    return out


def _on_two_ranks() -> dict[str, object]:
    return {
        "sizes": _collectives_on_two_ranks(),
        "unmatched": _unmatched_on_rank_zero(),
        "training": _training_through_parts(),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, object]]:
    return run_on_ranks(_on_two_ranks, 2, timeout=100)


@pytest.mark.timeout(120)
def test_large_collectives_go_in_parts_and_come_back_whole(ranks: list[dict[str, object]]) -> None:
    """For each size: the result is torch's collective's, bit for bit (all-gather: rank-major); it went as the
    expected number of parts covering every element; it was counted once, with the whole input's bytes."""
    for rank in ranks:
        for where, result in rank["sizes"].items():
            assert result["equal"], f"{where}: the result is not torch's collective's"
            parts, (expected_parts, elements, counted) = result["parts"], result["expected"]
            assert len(parts) == expected_parts and sum(parts) == elements, (
                f"{where}: sent as parts of {parts} elements, expected {expected_parts} parts"
            )
            assert result["counted"] == counted, f"{where}: counted (calls, bytes) {result['counted']}, not {counted}"


@pytest.mark.timeout(120)
def test_a_part_that_times_out_fails_the_whole_collective(ranks: list[dict[str, object]]) -> None:
    """Rank 0's parts find no partner: the future fails with gloo's timeout (a part still waiting when the
    first timed out reports "Application timeout caused pair closure"), rather than completing with a result
    nothing was written into."""
    outcomes = ranks[0]["unmatched"]
    assert set(outcomes) == {"all-gather", "all-to-all"}, outcomes
    for kind, outcome in outcomes.items():
        assert outcome.startswith("failed: "), f"{kind}: {outcome}"
        assert "Timed out" in outcome or "Application timeout caused pair closure" in outcome, f"{kind}: {outcome}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hook", TRAINED_HOOKS)
def test_training_through_parts_matches_torch_ddp_on_every_rank(ranks: list[dict[str, object]], hook: str) -> None:
    """A DDP whose 4 MiB bucket goes in parts (ByteGrad: its 0.5 MB per peer): parameters bit for bit those of
    torch's DDP with the same hook sending each collective whole, identical on both ranks, and more
    collectives launched (the parts)."""
    for rank in ranks:
        result = rank["training"][hook]
        assert result["as_torch"], f"{hook}: parameters differ from torch's DDP with the same hook, not in parts"
        assert result["same_on_every_rank"], f"{hook}: the replicas differ"
        in_parts, whole = result["launched"]
        assert in_parts > whole, f"{hook}: {in_parts} collectives in parts, {whole} whole: no parts were sent"
