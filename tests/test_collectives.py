"""gradcomm.comm's all-gather and all-to-all on 2 gloo ranks: large ones go as concurrent parts and come back
whole.

A gloo all-gather of more than ``GATHER_PART_BYTES`` per rank (an all-to-all: per peer) is sent as up to
``GATHER_PARTS`` concurrent ones (see :func:`gradcomm.comm.collectives.all_gather_into_tensor`); what a hook
receives must not show it: the same tensor as torch's collective gives, counted as one collective of the
whole input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from gradcomm import comm
from gradcomm.comm import collectives
from gradcomm.testing import run_on_ranks

PART = collectives.GATHER_PART_BYTES
# (elements, dtype): empty, one element, at the threshold, one element over it, several parts, more than the
# most parts of the threshold's size, and an odd length of 2-byte elements that does not split evenly
SIZES = [
    (0, torch.float32),
    (1, torch.float32),
    (PART // 4, torch.float32),
    (PART // 4 + 1, torch.float32),
    (3 * PART + 5, torch.uint8),
    (6 * PART // 4 + 3, torch.float32),
    (PART + 1, torch.float16),
]


@contextlib.contextmanager
def _counting_launches(module: object, name: str) -> Iterator[list[int]]:
    """While inside, ``module.name(output, input, ...)`` (a torch collective) records each input's numel."""
    launched: list[int] = []
    launch = getattr(module, name)

    def counting(output: torch.Tensor, tensor: torch.Tensor, **kwargs: object) -> object:
        launched.append(tensor.numel())
        return launch(output, tensor, **kwargs)

    setattr(module, name, counting)
    try:
        yield launched
    finally:
        setattr(module, name, launch)


def _expected_parts(nbytes: int) -> int:
    return 1 if nbytes <= PART else min(collectives.GATHER_PARTS, -(-nbytes // PART))


def _record(
    kind: str, launched: list[int], run: Callable[[], bool], sent: torch.Tensor, nbytes: int
) -> dict[str, object]:
    """Run one collective through gradcomm (``run`` says whether its result is torch's); what it launched and
    counted, and what was expected: ``sent`` in :func:`_expected_parts` parts of ``nbytes`` (per rank or per
    peer), counted once with all of ``sent``'s bytes."""
    launched.clear()
    calls, counted = comm.traffic.calls.get(kind, 0), comm.traffic.bytes_sent.get(kind, 0)
    equal = run()
    return {
        "equal": equal,
        "parts": list(launched),
        "expected": (_expected_parts(nbytes), sent.numel(), (1, sent.numel() * sent.element_size())),
        "counted": (comm.traffic.calls[kind] - calls, comm.traffic.bytes_sent[kind] - counted),
    }


def _collectives_on_two_ranks() -> dict[str, dict[str, object]]:
    rank, results = dist.get_rank(), {}
    single_all_to_all = dist.all_to_all_single
    for numel, dtype in SIZES:
        size = torch.empty((), dtype=dtype).element_size()
        generator = torch.Generator().manual_seed(1000 * rank + numel)
        tensor = torch.randint(0, 100, (numel,), generator=generator).to(dtype)
        expected = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(expected, tensor)
        with _counting_launches(collectives, "_all_gather_single") as launched:
            results[f"all-gather of {numel} x {dtype}"] = _record(
                "all_gather", launched,
                lambda tensor=tensor, expected=expected: torch.equal(
                    comm.all_gather_into_tensor(tensor).wait(), torch.cat(expected)
                ),
                tensor, numel * size,
            )
        for shape in ((2 * numel,), (2, numel)):
            rows = torch.randint(0, 100, shape, generator=generator).to(dtype)
            exchanged = torch.empty_like(rows)
            single_all_to_all(exchanged, rows)
            with _counting_launches(dist, "all_to_all_single") as launched:
                results[f"all-to-all of {shape} x {dtype}"] = _record(
                    "all_to_all", launched,
                    lambda rows=rows, exchanged=exchanged: torch.equal(comm.all_to_all_single(rows).wait(), exchanged),
                    rows, numel * size,
                )
    return results


@pytest.mark.timeout(120)
def test_large_collectives_go_in_parts_and_come_back_whole():
    """For each size: the result is torch's collective's, bit for bit (all-gather: rank-major); it went as the
    expected number of parts covering every element; it was counted once, with the whole input's bytes."""
    for results in run_on_ranks(_collectives_on_two_ranks, 2, timeout=100):
        for where, result in results.items():
            assert result["equal"], f"{where}: the result is not torch's collective's"
            parts, (expected_parts, elements, counted) = result["parts"], result["expected"]
            assert len(parts) == expected_parts and sum(parts) == elements, (
                f"{where}: sent as parts of {parts} elements, expected {expected_parts} parts"
            )
            assert result["counted"] == counted, f"{where}: counted (calls, bytes) {result['counted']}, not {counted}"
