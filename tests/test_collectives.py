"""gradcomm.comm's all-gather and all-to-all on 2 gloo ranks: large ones go as concurrent parts and come back
whole.

A gloo all-gather of more than ``GATHER_PART_BYTES`` per rank (an all-to-all: per peer) is sent as up to
``GATHER_PARTS`` concurrent ones (see :func:`gradcomm.comm.collectives.all_gather_into_tensor`); what a hook
receives must not show it: the same tensor as torch's collective gives, counted as one collective of the
whole input.
"""

from __future__ import annotations

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


def _gathers_on_two_ranks() -> list[dict[str, object]]:
    launched: list[int] = []
    single = collectives._all_gather_single

    def counting(output: torch.Tensor, tensor: torch.Tensor, **kwargs: object) -> object:
        launched.append(tensor.numel())
        return single(output, tensor, **kwargs)

    collectives._all_gather_single = counting
    rank = dist.get_rank()
    results = []
    try:
        for numel, dtype in SIZES:
            generator = torch.Generator().manual_seed(1000 * rank + numel)
            tensor = torch.randint(0, 100, (numel,), generator=generator).to(dtype)
            expected = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
            dist.all_gather(expected, tensor)
            launched.clear()
            calls, nbytes = comm.traffic.calls.get("all_gather", 0), comm.traffic.bytes_sent.get("all_gather", 0)
            gathered = comm.all_gather_into_tensor(tensor).wait()
            results.append({
                "size": (numel, str(dtype)),
                "equal": gathered.dtype == dtype and torch.equal(gathered, torch.cat(expected)),
                "parts": list(launched),
                "calls": comm.traffic.calls["all_gather"] - calls,
                "bytes": comm.traffic.bytes_sent["all_gather"] - nbytes,
            })
    finally:
        collectives._all_gather_single = single
    return results


@pytest.mark.timeout(120)
def test_a_large_all_gather_goes_in_parts_and_comes_back_whole():
    for rank_results in run_on_ranks(_gathers_on_two_ranks, 2, timeout=100):
        for (numel, dtype), result in zip(SIZES, rank_results, strict=True):
            where = f"{numel} x {dtype}"
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            parts = 1 if nbytes <= PART else min(collectives.GATHER_PARTS, -(-nbytes // PART))
            assert result["equal"], f"{where}: the gathered tensor is not torch's all-gather, rank-major"
            assert len(result["parts"]) == parts and sum(result["parts"]) == numel, (
                f"{where}: sent as parts of {result['parts']} elements, expected {parts} parts"
            )
            assert result["calls"] == 1 and result["bytes"] == nbytes, f"{where}: counted {result}"


def _exchanges_on_two_ranks() -> list[dict[str, object]]:
    launched: list[int] = []
    single = dist.all_to_all_single

    def counting(output: torch.Tensor, tensor: torch.Tensor, **kwargs: object) -> object:
        launched.append(tensor.numel())
        return single(output, tensor, **kwargs)

    dist.all_to_all_single = counting
    rank = dist.get_rank()
    results = []
    try:
        for numel, dtype in SIZES:
            for shape in ((2 * numel,), (2, numel)):
                generator = torch.Generator().manual_seed(1000 * rank + numel)
                tensor = torch.randint(0, 100, shape, generator=generator).to(dtype)
                expected = torch.empty_like(tensor)
                single(expected, tensor)
                launched.clear()
                calls, nbytes = comm.traffic.calls.get("all_to_all", 0), comm.traffic.bytes_sent.get("all_to_all", 0)
                exchanged = comm.all_to_all_single(tensor).wait()
                results.append({
                    "equal": exchanged.shape == shape and torch.equal(exchanged, expected),
                    "parts": list(launched),
                    "calls": comm.traffic.calls["all_to_all"] - calls,
                    "bytes": comm.traffic.bytes_sent["all_to_all"] - nbytes,
                })
    finally:
        dist.all_to_all_single = single
    return results


@pytest.mark.timeout(120)
def test_a_large_all_to_all_goes_in_parts_and_comes_back_whole():
    for rank_results in run_on_ranks(_exchanges_on_two_ranks, 2, timeout=100):
        cases = [(numel, dtype, shape) for numel, dtype in SIZES for shape in ((2 * numel,), (2, numel))]
        for (numel, dtype, shape), result in zip(cases, rank_results, strict=True):
            where = f"{shape} x {dtype}"
            per_peer = numel * torch.empty((), dtype=dtype).element_size()
            parts = 1 if per_peer <= PART else min(collectives.GATHER_PARTS, -(-per_peer // PART))
            assert result["equal"], f"{where}: the exchanged tensor is not torch's all_to_all_single's"
            assert len(result["parts"]) == parts and sum(result["parts"]) == 2 * numel, (
                f"{where}: sent as parts of {result['parts']} elements, expected {parts} parts"
            )
            assert result["calls"] == 1 and result["bytes"] == 2 * per_peer, f"{where}: counted {result}"
