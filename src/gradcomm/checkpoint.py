"""Checkpoints of a data-parallel run: model, optimizer, communication-hook state and extras, per rank.

Resuming a run with a stateful hook exactly requires more than the model: the optimizer state, the hook
state (PowerSGD's error feedback and warm-start matrices, post-local SGD's iteration counter), model
averagers and the step count. Under compression with error feedback or local SGD these differ from rank to
rank, so every rank writes its own file: ``save_checkpoint(path, ...)`` makes ``path`` a directory holding
``rank<r>.pt`` for each rank ``r``, and every rank must call it. Each file records the world size; a
checkpoint is refused at another world size, since per-rank state cannot be redistributed.

Everything is stored as ``state_dict()`` output (tensors and plain values), so the files load with
``torch.load(..., weights_only=True)``: loading a checkpoint never runs code from it. Process groups are
not saved; the objects given to :func:`load_checkpoint` keep theirs. Build the model, optimizer and hook
state as for a fresh run, then load::

    save_checkpoint(path, ddp_model, optimizer, hook_state, averager=averager.state_dict(), step=step)
    ...
    checkpoint = load_checkpoint(path, ddp_model, optimizer, hook_state)
    averager.load_state_dict(checkpoint["averager"])
    step = checkpoint["step"]

Random number generators outside the hook state (data order, dropout) are the caller's: save their
state as an extra if the run depends on them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["FORMAT", "load_checkpoint", "rank_file", "save_checkpoint"]

FORMAT = "gradcomm.checkpoint/1"
_RESERVED = ("format", "world_size", "rank", "model", "optimizer", "hook_state", "bucket_layout")
_PLAIN_LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_file(path: str | os.PathLike[str], rank: int) -> str:
    """The file of ``rank`` in checkpoint directory ``path``."""
    return os.path.join(os.fspath(path), f"rank{rank}.pt")


def _check_plain(value: Any, where: str) -> None:
    if isinstance(value, _PLAIN_LEAVES):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            _check_plain(key, where)
            _check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple, set, frozenset)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    hint = "; save its state_dict() instead" if callable(getattr(value, "state_dict", None)) else ""
    raise TypeError(
        f"save_checkpoint: {where} is a {type(value).__name__}, which torch.load(weights_only=True) cannot "
        f"load{hint}"
    )


def save_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    hook_state: Any = None,
    **extra: Any,
) -> str:
    """Write this rank's checkpoint into directory ``path`` (created if needed); return the file written.

    Every rank must call it (it ends with a barrier, so the checkpoint is complete on return).

    Args:
        model: saved with ``model.state_dict()``, and for gradcomm's DDP its bucket layout, which
            :func:`load_checkpoint` restores so that per-bucket hook state fits the buckets it was made for.
        optimizer: saved with ``optimizer.state_dict()``, if given.
        hook_state: the communication hook's state, saved with its ``state_dict()``; ``None`` for hooks
            whose state is a process group.
        extra: further entries (a step count, ``averager=averager.state_dict()``); tensors and plain values
            only. They come back as keys of :func:`load_checkpoint`'s result.
    """
    clash = sorted(set(extra) & set(_RESERVED))
    if clash:
        raise ValueError(f"save_checkpoint: extra names {clash} are reserved; reserved names: {_RESERVED}")
    rank, world_size = _world()
    hook_state_dict = None
    if hook_state is not None:
        if not callable(getattr(hook_state, "state_dict", None)):
            raise TypeError(
                f"save_checkpoint: hook_state {type(hook_state).__name__} has no state_dict(); pass the hook's "
                "state object (a process group needs no saving: pass None)"
            )
        hook_state_dict = hook_state.state_dict()
        _check_plain(hook_state_dict, "hook_state.state_dict()")
    for key, value in extra.items():
        _check_plain(value, key)
    payload = {
        "format": FORMAT,
        "world_size": world_size,
        "rank": rank,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "hook_state": hook_state_dict,
        "bucket_layout": model.bucket_layout() if callable(getattr(model, "bucket_layout", None)) else None,
        **extra,
    }
    os.makedirs(path, exist_ok=True)
    target = rank_file(path, rank)
    partial = f"{target}.partial"
    torch.save(payload, partial)
    os.replace(partial, target)
    if rank == 0:
        _remove_stale_rank_files(path, world_size)
    if world_size > 1:
        dist.barrier()
    return target


def _remove_stale_rank_files(path: str | os.PathLike[str], world_size: int) -> None:
    """Remove files of ranks beyond ``world_size`` left by an earlier checkpoint at a larger world size."""
    for name in os.listdir(path):
        stem = name.removeprefix("rank").removesuffix(".pt")
        if name.startswith("rank") and name.endswith(".pt") and stem.isdigit() and int(stem) >= world_size:
            os.remove(os.path.join(path, name))


def _ranks(count: Any) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"


def _refuse(path: str | os.PathLike[str], saved_world_size: Any, world_size: int) -> ValueError:
    return ValueError(
        f"load_checkpoint: {os.fspath(path)!r} was written by {_ranks(saved_world_size)}, but this run has "
        f"{world_size}; per-rank model, optimizer and hook state cannot be redistributed. Resume with "
        f"{saved_world_size} ranks, or start a fresh run."
    )


def load_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    hook_state: Any = None,
    *,
    map_location: Any = "cpu",
) -> dict[str, Any]:
    """Load this rank's checkpoint from directory ``path`` into the given objects; return the whole dict.

    The model, optimizer and hook state are restored in place (each keeps its process group); the extras
    saved with :func:`save_checkpoint` are keys of the returned dict.

    Raises:
        ValueError: the checkpoint was written at another world size, or it lacks a part that was asked
            for (an optimizer or hook state given here but not saved).
    """
    rank, world_size = _world()
    target = rank_file(path, rank)
    if not os.path.exists(target):
        first = rank_file(path, 0)
        if rank > 0 and os.path.exists(first):
            saved = torch.load(first, map_location="cpu", weights_only=True)
            raise _refuse(path, saved.get("world_size"), world_size)
        raise FileNotFoundError(f"load_checkpoint: no checkpoint for rank {rank} in {os.fspath(path)!r} ({target})")
    checkpoint = torch.load(target, map_location=map_location, weights_only=True)
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise ValueError(f"load_checkpoint: {target!r} is not a {FORMAT} checkpoint")
    if checkpoint["world_size"] != world_size:
        raise _refuse(path, checkpoint["world_size"], world_size)
    for part, obj in (("optimizer", optimizer), ("hook_state", hook_state)):
        if obj is not None and checkpoint.get(part) is None:
            raise ValueError(f"load_checkpoint: {target!r} has no {part} saved, but one was given to load into")
    model.load_state_dict(checkpoint["model"])
    if optimizer is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
    if checkpoint.get("bucket_layout") is not None and callable(getattr(model, "load_bucket_layout", None)):
        model.load_bucket_layout(checkpoint["bucket_layout"])
    if hook_state is not None:
        hook_state.load_state_dict(checkpoint["hook_state"])
    return checkpoint
