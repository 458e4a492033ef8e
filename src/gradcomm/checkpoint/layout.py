"""The on-disk layout of a checkpoint folder: rank files, the manifest that commits them, durable writes.

A folder holds ``rank<r>-<id>.pt`` per rank and ``manifest.json``, written last by rank 0: the commit (see
:mod:`gradcomm.checkpoint` for the protocol). This module knows the names, reads and writes the manifest,
writes files so that a crash leaves either the old or the new content, and removes superseded files.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import IO, Any

from gradcomm.errors import GradcommError

__all__ = [
    "FORMAT",
    "MANIFEST",
    "OLD_FORMAT",
    "PARTIAL",
    "RANK_FILE",
    "CheckpointError",
    "commit_manifest",
    "count_of_ranks",
    "described",
    "file_name",
    "rank_file",
    "read_manifest",
    "remove_superseded",
    "write_durably",
]

FORMAT = "gradcomm.checkpoint/2"


MANIFEST = "manifest.json"


OLD_FORMAT = "gradcomm.checkpoint/1"


PARTIAL = ".partial"


# rank<r>-<id>.pt of this format, rank<r>.pt of the old one, either possibly with .partial.
RANK_FILE = re.compile(r"rank(?P<rank>\d+)(?:-(?P<id>[0-9a-f]{32}))?\.pt(?P<partial>\.partial)?")


class CheckpointError(GradcommError, ValueError, RuntimeError):
    """A folder holds no complete checkpoint for this run, or a rank cannot load its part of it.

    :func:`load_checkpoint` raises it on every rank alike (same message), before loading anything. A
    ``RuntimeError``, as torch's ``load_state_dict`` raises for a state that does not fit, and a ``ValueError``,
    as it was before.
    """


def file_name(rank: int, checkpoint_id: str) -> str:
    return f"rank{rank}-{checkpoint_id}.pt"


def count_of_ranks(count: Any) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"


def read_manifest(path: str | os.PathLike[str], caller: str = "load_checkpoint") -> dict[str, Any]:
    """The committed manifest of ``path``; raises FileNotFoundError or CheckpointError saying what is wrong."""
    folder = os.fspath(path)
    manifest_path = os.path.join(folder, MANIFEST)
    try:
        with open(manifest_path, encoding="utf-8") as file:
            manifest = json.load(file)
    except FileNotFoundError:
        raise _no_manifest(folder, caller) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{caller}: the manifest {manifest_path!r} cannot be read ({described(exc)}); "
            "without it no checkpoint in the folder counts as complete. Restore the folder from a backup or "
            "resume from another checkpoint."
        ) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(
            f"{caller}: {manifest_path!r} is not a {FORMAT} manifest (format {found!r}); load it with the "
            "gradcomm version that wrote it."
        )
    if not _well_formed(manifest):
        raise CheckpointError(
            f"{caller}: {manifest_path!r} is malformed (it needs an id, a world size and one file per "
            "rank); it was edited or damaged. Restore the folder from a backup or resume from another checkpoint."
        )
    return manifest


def _well_formed(manifest: dict[str, Any]) -> bool:
    world_size, files = manifest.get("world_size"), manifest.get("files")
    return (
        isinstance(manifest.get("id"), str)
        and isinstance(world_size, int)
        and isinstance(files, list)
        and len(files) == world_size
        and all(isinstance(name, str) and os.path.basename(name) == name for name in files)
    )


def _no_manifest(folder: str, caller: str) -> Exception:
    matches = [RANK_FILE.fullmatch(name) for name in os.listdir(folder)] if os.path.isdir(folder) else []
    rank_files = [match for match in matches if match is not None and not match["partial"]]
    if any(match["id"] is None for match in rank_files):
        return CheckpointError(
            f"{caller}: {folder!r} holds rank<r>.pt files without {MANIFEST}: a checkpoint in the "
            f"{OLD_FORMAT} layout, which cannot tell a complete checkpoint from one torn by a crash during "
            f"its save, so this version ({FORMAT}) does not load it. Resume with the gradcomm version that "
            "wrote it and save again, or start a fresh run."
        )
    if rank_files:
        return FileNotFoundError(
            f"{caller}: no complete checkpoint in {folder!r}: it holds rank files but no {MANIFEST}, so "
            f"the save that wrote them never committed (save_checkpoint writes {MANIFEST} on rank 0 last, once "
            "every rank's file is written). Resume from another checkpoint, or start a fresh run."
        )
    return FileNotFoundError(
        f"{caller}: no complete checkpoint in {folder!r}: it has no {MANIFEST} (save_checkpoint writes it "
        "in rank 0's folder, once every rank's file is written). Check the path, or start a fresh run."
    )


def commit_manifest(folder: str, manifest: dict[str, Any]) -> None:
    write_durably(os.path.join(folder, MANIFEST), lambda file: file.write(json.dumps(manifest, indent=1).encode()))


def rank_file(path: str | os.PathLike[str], rank: int) -> str:
    """The file of ``rank`` in the checkpoint committed in directory ``path``, as its manifest names it.

    The manifest is in rank 0's folder: with ranks on machines without a shared filesystem, call it there.

    Raises:
        FileNotFoundError: ``path`` holds no committed checkpoint.
        ValueError: the checkpoint has no rank ``rank``.
    """
    manifest = read_manifest(path, "rank_file")
    if not 0 <= rank < manifest["world_size"]:
        raise ValueError(
            f"rank_file: rank {rank} is not in the checkpoint in {os.fspath(path)!r}, written by "
            f"{count_of_ranks(manifest['world_size'])}"
        )
    return os.path.join(os.fspath(path), manifest["files"][rank])


def _fsync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable; a no-op where directories cannot be opened (Windows)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_durably(target: str, write: Callable[[IO[bytes]], Any]) -> None:
    """Write ``target`` so that after a crash it holds either nothing new or the whole new content."""
    partial = target + PARTIAL
    try:
        with open(partial, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, target)
    except BaseException:
        try:
            os.remove(partial)
        except OSError:
            pass
        raise
    _fsync_folder(os.path.dirname(target) or ".")


def described(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def remove_superseded(folder: str, rank: int, world_size: int, checkpoint_id: str) -> None:
    """Remove this rank's files of other ids and leftover .partial files, now that ``checkpoint_id`` is committed.

    Rank 0 also removes the files of ranks beyond ``world_size``, left by a save at a larger world size, and
    a leftover partial manifest.
    """
    for name in os.listdir(folder):
        match = RANK_FILE.fullmatch(name)
        if match is None:
            superseded = rank == 0 and name == MANIFEST + PARTIAL
        else:
            owner = int(match["rank"])
            mine = owner == rank or (rank == 0 and owner >= world_size)
            superseded = mine and (match["id"] != checkpoint_id or match["partial"] is not None)
        if superseded:
            try:
                os.remove(os.path.join(folder, name))
            except FileNotFoundError:
                pass

