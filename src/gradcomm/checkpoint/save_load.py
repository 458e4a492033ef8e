"""All-or-nothing checkpoints of a data-parallel run: model, optimizer, hook state and extras, per rank.

Resuming a run with a stateful hook exactly requires more than the model: the optimizer state, the hook
state (PowerSGD's error feedback and warm-start matrices, post-local SGD's iteration counter), model
averagers and the step count. Under compression with error feedback or local SGD these differ from rank to
rank, so every rank writes its own file, and every rank must call :func:`save_checkpoint` and
:func:`load_checkpoint`. Each checkpoint records the world size; it is refused at another world size, since
per-rank state cannot be redistributed.

**All or nothing.** A checkpoint counts only once every rank's file is written. ``save_checkpoint(path, ...)``
makes ``path`` a directory holding, per checkpoint id (a random hex string the ranks agree on)::

    rank<r>-<id>.pt    each rank's state, written to a .partial name, fsynced and renamed into place
    manifest.json      written by rank 0 last, once every rank reported its file durable: the commit

The manifest (``{"format", "id", "step", "world_size", "files"}``) names the committed checkpoint; only after
it is replaced does each rank delete its files of older ids and leftover ``.partial`` files. A save that a
crash or a failed write interrupts therefore leaves the previous manifest, and the previous files it names,
in place: loading the folder gives the last complete checkpoint on every rank. A failed write or commit
raises ``OSError`` on every rank; a lost peer raises :class:`gradcomm.comm.faults.PeerLostError`.

:func:`load_checkpoint` reads the manifest on rank 0 and broadcasts it, so ranks on machines without a shared
filesystem need only their own files (rank 0's folder holds the manifest). Every rank then loads the file the
manifest names for it and the ranks compare, with one ``all_gather``, the checkpoint id and step each found:
unless all of them found the checkpoint of the manifest, every rank raises the same
:class:`CheckpointError` naming the ranks and what they found, and nothing is loaded on any rank. A folder
in the earlier layout (``rank<r>.pt`` without a manifest, format ``gradcomm.checkpoint/1``) cannot be told
complete from torn and is refused.

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
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from gradcomm.checkpoint.layout import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    commit_manifest,
    count_of_ranks,
    described,
    file_name,
    rank_file,
    read_manifest,
    remove_superseded,
    write_durably,
)
from gradcomm.comm.faults import reporting_lost_peers

__all__ = ["FORMAT", "MANIFEST", "CheckpointError", "from_every_rank", "load_checkpoint", "rank_file", "save_checkpoint"]

_RESERVED = ("format", "world_size", "rank", "checkpoint_id", "model", "optimizer", "hook_state", "bucket_layout")
_PLAIN_LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _rank_list(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _step(value: Any) -> int | None:
    """The step to record in the manifest and compare across ranks: an integer ``step`` extra, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _found(step: Any, checkpoint_id: Any) -> str:
    return f"step {step} (id {checkpoint_id})" if step is not None else f"id {checkpoint_id} (no step saved)"


# -- the manifest ------------------------------------------------------------------------------------------


# -- saving ------------------------------------------------------------------------------------------------


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


def _payload(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, hook_state: Any, extra: dict[str, Any]
) -> dict[str, Any]:
    """This rank's file contents, less its identity; raises on arguments that cannot be saved loadably."""
    clash = sorted(set(extra) & set(_RESERVED))
    if clash:
        raise ValueError(f"save_checkpoint: extra names {clash} are reserved; reserved names: {_RESERVED}")
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
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "hook_state": hook_state_dict,
        "bucket_layout": model.bucket_layout() if callable(getattr(model, "bucket_layout", None)) else None,
        **extra,
    }


def _try(action: Callable[[], Any]) -> str | None:
    """Run ``action``; the error it raised, as text for the other ranks, or None."""
    try:
        action()
    except Exception as exc:
        return described(exc)
    return None


def _from_rank_0(value: Any, world_size: int, during: tuple[int | None, str]) -> Any:
    """Rank 0's ``value`` on every rank; ``during`` (step, what) names the work if a peer is lost."""
    if world_size == 1:
        return value
    box = [value]
    with reporting_lost_peers(*during):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def from_every_rank(value: Any, world_size: int, during: tuple[int | None, str]) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank; ``during`` (step, what) names the work if a peer
    is lost."""
    if world_size == 1:
        return [value]
    values: list[Any] = [None] * world_size
    with reporting_lost_peers(*during):
        dist.all_gather_object(values, value)
    return values


def _not_saved(folder: str, step: Any, what: str) -> OSError:
    checkpoint = f"the checkpoint of step {step}" if step is not None else "the checkpoint"
    return OSError(
        f"save_checkpoint: {what}, so {checkpoint} was not saved; {folder!r} still holds the last complete "
        "checkpoint, if there was one. Fix the cause (disk space, permissions) and save again."
    )


def save_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    hook_state: Any = None,
    **extra: Any,
) -> str:
    """Write this rank's part of a checkpoint into directory ``path`` (created if needed); return its file.

    Every rank must call it. It returns once the checkpoint is committed: every rank's file is durable and
    rank 0 has replaced the manifest. If any rank fails to write, or rank 0 to commit, every rank raises
    ``OSError`` and ``path`` still holds the previous checkpoint; a lost peer raises
    :class:`gradcomm.comm.faults.PeerLostError`.

    Args:
        model: saved with ``model.state_dict()``, and for gradcomm's DDP its bucket layout, which
            :func:`load_checkpoint` restores so that per-bucket hook state fits the buckets it was made for.
        optimizer: saved with ``optimizer.state_dict()``, if given.
        hook_state: the communication hook's state, saved with its ``state_dict()``; ``None`` for hooks
            whose state is a process group.
        extra: further entries (a step count, ``averager=averager.state_dict()``); tensors and plain values
            only. They come back as keys of :func:`load_checkpoint`'s result; an integer ``step`` is also
            recorded in the manifest, and named in errors.
    """
    payload = _payload(model, optimizer, hook_state, extra)
    rank, world_size = _world()
    folder = os.fspath(path)
    step = extra.get("step")
    manifest_step = _step(step)
    during = (manifest_step, f"saving checkpoint {folder!r}")
    checkpoint_id = _from_rank_0(uuid.uuid4().hex, world_size, during)
    payload.update(format=FORMAT, world_size=world_size, rank=rank, checkpoint_id=checkpoint_id)
    target = os.path.join(folder, file_name(rank, checkpoint_id))
    errors = from_every_rank(_try(lambda: _write_rank_file(folder, target, payload)), world_size, during)
    failed = [f"rank {r} could not write its file in {folder!r} ({e})" for r, e in enumerate(errors) if e]
    if failed:
        raise _not_saved(folder, step, "; ".join(failed))
    manifest = {
        "format": FORMAT,
        "id": checkpoint_id,
        "step": manifest_step,
        "world_size": world_size,
        "files": [file_name(r, checkpoint_id) for r in range(world_size)],
    }
    error = _from_rank_0(_try(lambda: commit_manifest(folder, manifest)) if rank == 0 else None, world_size, during)
    if error is not None:
        raise _not_saved(folder, step, f"rank 0 could not commit {os.path.join(folder, MANIFEST)!r} ({error})")
    remove_superseded(folder, rank, world_size, checkpoint_id)
    return target


def _write_rank_file(folder: str, target: str, payload: dict[str, Any]) -> None:
    os.makedirs(folder, exist_ok=True)
    write_durably(target, lambda file: torch.save(payload, file))


# -- loading -----------------------------------------------------------------------------------------------


def _refuse(path: str, saved_world_size: Any, world_size: int) -> CheckpointError:
    return CheckpointError(
        f"load_checkpoint: {path!r} was written by {count_of_ranks(saved_world_size)}, but this run has "
        f"{world_size}; per-rank model, optimizer and hook state cannot be redistributed. Resume with "
        f"{saved_world_size} ranks, or start a fresh run."
    )


_AGREED_ERRORS: dict[str, type[Exception]] = {
    "FileNotFoundError": FileNotFoundError,
    "CheckpointError": CheckpointError,
}


def _rank_0_manifest(folder: str, rank: int, world_size: int) -> tuple[dict[str, Any], str]:
    """Rank 0's manifest and folder, on every rank.

    Rank 0 alone reads the manifest, so that the ranks cannot disagree on it, and broadcasts what it found or
    the error it met, which every rank then raises alike.
    """
    verdict = None
    if rank == 0:
        try:
            manifest = read_manifest(folder)
            if manifest["world_size"] != world_size:
                raise _refuse(folder, manifest["world_size"], world_size)
            verdict = ("manifest", (manifest, folder))
        except (FileNotFoundError, CheckpointError) as exc:
            verdict = (type(exc).__name__, str(exc))
        except Exception as exc:
            verdict = ("CheckpointError", f"load_checkpoint: rank 0 could not read {folder!r} ({described(exc)})")
    kind, content = _from_rank_0(verdict, world_size, (None, f"loading checkpoint {folder!r}"))
    if kind != "manifest":
        raise _AGREED_ERRORS[kind](content)
    return content


def _own_file(
    folder: str, manifest: dict[str, Any], rank: int, parts: dict[str, Any], map_location: Any
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """This rank's checkpoint and its report for the cross-check: the id and step found, and any problem."""
    target = os.path.join(folder, manifest["files"][rank])
    report: dict[str, Any] = {"id": None, "step": None, "problem": None}
    if not os.path.exists(target):
        report["problem"] = f"{target!r} is missing (this rank's file of checkpoint {manifest['id']})"
        return None, report
    try:
        checkpoint = torch.load(target, map_location=map_location, weights_only=True)
    except Exception as exc:
        report["problem"] = f"{target!r} could not be read ({described(exc)}); is it truncated?"
        return None, report
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        report["problem"] = f"{target!r} is not a {FORMAT} file"
        return None, report
    report.update(id=checkpoint.get("checkpoint_id"), step=_step(checkpoint.get("step")))
    problems = []
    if report["id"] != manifest["id"]:
        problems.append(f"{target!r} holds {_found(report['step'], report['id'])}, not the checkpoint {MANIFEST} names")
    if (checkpoint.get("rank"), checkpoint.get("world_size")) != (rank, manifest["world_size"]):
        saved_by = f"rank {checkpoint.get('rank')} of {count_of_ranks(checkpoint.get('world_size'))}"
        problems.append(f"{target!r} was written by {saved_by}, not by rank {rank} of {manifest['world_size']}")
    problems += [
        f"{target!r} has no {part} saved, but one was given to load into"
        for part, obj in parts.items()
        if obj is not None and checkpoint.get(part) is None
    ]
    report["problem"] = "; ".join(problems) or None
    return checkpoint, report


def _verdict(folder: str, manifest: dict[str, Any], reports: list[dict[str, Any]]) -> CheckpointError | None:
    """The error every rank raises unless every rank found the manifest's checkpoint, without problems."""
    groups: dict[tuple[Any, Any], list[int]] = {}
    for rank, report in enumerate(reports):
        if report["id"] is not None:
            groups.setdefault((report["id"], report["step"]), []).append(rank)
    problems = [f"rank {rank}: {report['problem']}" for rank, report in enumerate(reports) if report["problem"]]
    committed = (manifest["id"], manifest["step"])
    mixed = len(groups) > 1 or any(found != committed for found in groups)
    if not mixed and not problems:
        return None
    lines = []
    if mixed:
        found = sorted(groups.items(), key=lambda item: (item[0] == committed, len(item[1]), item[1]))
        lines.append(
            ", ".join(f"{_rank_list(ranks)} found {_found(step, cid)}" for (cid, step), ranks in found)
            + f"; {MANIFEST} names {_found(manifest['step'], manifest['id'])}"
        )
    advice = (
        f"Every rank needs its file of the checkpoint that {MANIFEST} names; the files were likely mixed from "
        "different saves (copied or restored by hand, or a machine's folder holds an older save). Restore "
        "them from one save, or resume from another checkpoint."
        if mixed
        else "Fix the file(s) named, or resume from another checkpoint."
    )
    return CheckpointError(
        f"load_checkpoint: {folder!r} does not hold one complete checkpoint for this run; nothing was loaded "
        "on any rank:\n  " + "\n  ".join(lines + problems) + f"\n{advice}"
    )


def load_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    hook_state: Any = None,
    *,
    map_location: Any = "cpu",
) -> dict[str, Any]:
    """Load this rank's part of the checkpoint committed in directory ``path``; return its whole dict.

    Every rank must call it. Rank 0's manifest names the checkpoint; every rank loads its file of it and the
    ranks check that they all found it before anything is restored. The model, optimizer and hook state are
    then restored in place (each keeps its process group); the extras saved with :func:`save_checkpoint` are
    keys of the returned dict, as is the ``checkpoint_id``.

    Raises:
        FileNotFoundError: ``path`` holds no committed checkpoint (on every rank).
        CheckpointError: (a ``ValueError``, on every rank, with the same message) the checkpoint was written
            at another world size or in the older layout; or some rank's file is missing, unreadable, of
            another checkpoint than the manifest's, or lacks a part that was asked for (an optimizer or hook
            state given here but not saved).
        gradcomm.comm.faults.PeerLostError: a peer was lost during the checks.
    """
    rank, world_size = _world()
    folder = os.fspath(path)
    parts = {"optimizer": optimizer, "hook_state": hook_state}
    manifest, rank_0_folder = _rank_0_manifest(folder, rank, world_size)
    checkpoint, report = _own_file(folder, manifest, rank, parts, map_location)
    reports = from_every_rank(report, world_size, (None, f"loading checkpoint {folder!r}"))
    error = _verdict(rank_0_folder, manifest, reports)
    if error is not None:
        raise error
    assert checkpoint is not None
    model.load_state_dict(checkpoint["model"])
    if optimizer is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
    if checkpoint.get("bucket_layout") is not None and callable(getattr(model, "load_bucket_layout", None)):
        model.load_bucket_layout(checkpoint["bucket_layout"])
    if hook_state is not None:
        hook_state.load_state_dict(checkpoint["hook_state"])
    return checkpoint
