"""Where the rank groups run, the DDP kinds one test body checks, what a rank hands back to the parent, and several
tests' parts run in one spawned group."""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist

# Where the suites that compare numbers (hooks/test_properties, engine/test_ddp_vs_torch) run. By default
# on CPU tensors over gloo, as in CI. On a machine with a GPU, GRADCOMM_TEST_DEVICE=cuda runs them on CUDA
# tensors (gloo's CUDA path, every rank on the current device); GRADCOMM_TEST_BACKEND=nccl with
# GRADCOMM_TEST_WORLD_SIZES=1 runs them on a one-rank NCCL group (NCCL needs a GPU per rank).
TEST_DEVICE = torch.device(os.environ.get("GRADCOMM_TEST_DEVICE", "cpu"))
TEST_BACKEND = os.environ.get("GRADCOMM_TEST_BACKEND", "gloo")

DDP_KINDS = ("torch", "gradcomm")
# what gloo says when a collective outlives the group's timeout: "Timed out ..." on the side that waited, or
# "Application timeout caused pair closure" when its peer's timeout closed the connection first
GLOO_TIMEOUT = r"(Timed out|Application timeout caused pair closure)"


def make_ddp(kind: str, module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """torch's DistributedDataParallel (``kind="torch"``) or gradcomm's (``"gradcomm"``), so one test body
    checks both."""
    if kind == "torch":
        return torch.nn.parallel.DistributedDataParallel(module, **kwargs)
    if kind == "gradcomm":
        import gradcomm

        return gradcomm.DistributedDataParallel(module, **kwargs)
    raise ValueError(f"unknown DDP kind {kind!r}; expected one of {DDP_KINDS}")


def world_sizes_to_test(default: tuple[int, ...] = (2, 3)) -> tuple[int, ...]:
    """The world sizes to spawn: ``GRADCOMM_TEST_WORLD_SIZES`` (comma-separated) or ``default``."""
    chosen = os.environ.get("GRADCOMM_TEST_WORLD_SIZES")
    return tuple(int(n) for n in chosen.split(",")) if chosen else default


@contextlib.contextmanager
def counting_point_to_point() -> Iterator[list[tuple[str, int, int]]]:
    """While inside, every ``dist.isend``/``dist.irecv`` is recorded as ``(kind, group peer, elements)``, in the
    order posted (gradcomm's all-gathers and all-to-alls on gloo)."""
    posted: list[tuple[str, int, int]] = []
    originals = {"isend": dist.isend, "irecv": dist.irecv}

    def counting(kind: str, post: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            posted.append((kind, int(kwargs.get("group_dst", kwargs.get("group_src"))), tensor.numel()))
            return post(tensor, *args, **kwargs)

        return counted

    for kind, post in originals.items():
        setattr(dist, kind, counting(kind, post))
    try:
        yield posted
    finally:
        for kind, post in originals.items():
            setattr(dist, kind, post)


def error_text(fn: Callable[[], Any]) -> str:
    """``"Type: message"`` of what ``fn()`` raises, or ``"no error"``; messages are asserted in the parent."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


class Raised(str):
    """The traceback of a part that raised on a rank (:func:`each_part`)."""


def each_part(parts: Sequence[tuple[str, Callable[..., Any], Sequence[Any]]]) -> dict[str, Any]:
    """Runs on a rank: each ``(name, fn, args)`` in turn, ``name -> fn(*args)``, a part that raises giving its
    traceback (a :class:`Raised`) instead. Several tests then share one spawned group, whose start costs more
    than most parts, and each still fails on its own part only (:func:`part_results`). Put the parts that may
    leave a collective unmatched last."""
    out: dict[str, Any] = {}
    for name, fn, args in parts:
        try:
            out[name] = fn(*args)
        except Exception:
            out[name] = Raised(traceback.format_exc())
    return out


def part_results(by_rank: list[dict[str, Any]], name: str) -> list[Any]:
    """Every rank's result of part ``name`` of :func:`each_part`; fails the test with the traceback of a rank
    where the part raised."""
    for rank, results in enumerate(by_rank):
        if isinstance(results[name], Raised):
            pytest.fail(f"{name} raised on rank {rank}:\n{results[name]}")
    return [results[name] for results in by_rank]
