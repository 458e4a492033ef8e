"""Checkpoints are all-or-nothing: a save torn by a crash or a failed write never loads as a mix of saves.

Every rank's model holds values that depend only on the step (``_replica``), so the replicas of one step are
identical and a mix of steps shows as differing replicas. The rank functions return what they found and
the assertions run here, in the parent process.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gradcomm.checkpoint import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    load_checkpoint,
    rank_file,
    save_checkpoint,
)
from gradcomm.comm.faults import PeerLostError
from gradcomm.testing import RankError, run_on_ranks
from tests.support.ranks import each_part, error_text, part_results
from tests.support.training import flat_parameters


def _replica(step: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer every rank holds after ``step`` steps (identical replicas, as under DDP)."""
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _save(path: str, step: int) -> str:
    model, optimizer = _replica(step)
    return save_checkpoint(path, model, optimizer, step=step)


def _load(path: str) -> dict[str, Any]:
    """Load ``path`` into fresh objects: the step, id and parameters found, or the error raised."""
    model, optimizer = _fresh()
    try:
        checkpoint = load_checkpoint(path, model, optimizer)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"step": checkpoint["step"], "id": checkpoint.get("checkpoint_id"), "params": flat_parameters(model)}


def _kill_inside_torch_save() -> None:
    """Make this process's next ``torch.save`` write half of its bytes, then die by SIGKILL."""
    real_save = torch.save

    def half_then_die(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as out:
                out.write(data[: len(data) // 2])
        else:
            f.write(data[: len(data) // 2])
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = half_then_die


def _save_then_die_during_next_save(path: str, victim: int) -> None:
    rank = dist.get_rank()
    _save(path, 2)
    if rank == victim:
        _kill_inside_torch_save()
    try:
        _save(path, 4)
    except PeerLostError as exc:
        with open(os.path.join(os.path.dirname(path), f"lost{rank}.txt"), "w") as out:
            out.write(str(exc))
        raise


def _load_then_save_again(path: str) -> dict[str, Any]:
    found = _load(path)
    _save(path, 6)
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_killed_inside_torch_save_leaves_the_previous_checkpoint_loadable_on_every_rank(tmp_path):
    path = str(tmp_path / "checkpoint")
    with pytest.raises(RankError, match=r"rank 1 of 3 exited with code -9"):
        run_on_ranks(_save_then_die_during_next_save, 3, args=(path, 1), timeout=120)
    # The survivors were told that a peer was lost, in gradcomm's words rather than gloo's.
    for rank in (0, 2):
        with open(tmp_path / f"lost{rank}.txt") as lost:
            message = lost.read()
        assert f"rank {rank} lost contact with its peers during step 4, saving checkpoint" in message, message

    found = run_on_ranks(_load_then_save_again, 3, args=(path,), timeout=120)
    expected = flat_parameters(_replica(2)[0])
    for rank in range(3):
        assert "error" not in found[rank], found[rank]
        assert found[rank]["step"] == 2, f"rank {rank} loaded step {found[rank]['step']}, not the complete step 2"
        assert np.array_equal(found[rank]["params"], expected), f"rank {rank}: the replicas differ after loading"
    assert len({found[rank]["id"] for rank in range(3)}) == 1

    # The next successful save removes the torn save's files and its .partial, and the step-2 files.
    with open(os.path.join(path, MANIFEST)) as manifest_file:
        manifest = json.load(manifest_file)
    assert manifest["step"] == 6 and manifest["world_size"] == 3
    assert sorted(os.listdir(path)) == sorted([MANIFEST, *manifest["files"]])


def _failing_saves(path: str) -> dict[str, Any]:
    """Save step 2, then fail step 4 in rank 1's write and step 6 in rank 0's commit; each time load."""
    rank = dist.get_rank()
    _save(path, 2)
    results: dict[str, Any] = {}

    real_save, real_replace = torch.save, os.replace

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    def replace_but_not_manifest(src: Any, dst: Any) -> None:
        if os.fspath(dst).endswith(MANIFEST):
            raise PermissionError(13, "Permission denied", os.fspath(dst))
        real_replace(src, dst)

    torch.save = disk_full if rank == 1 else real_save
    results["write"] = error_text(lambda: _save(path, 4))
    torch.save = real_save
    results["after_write"] = _load(path)

    os.replace = replace_but_not_manifest if rank == 0 else real_replace
    results["commit"] = error_text(lambda: _save(path, 6))
    os.replace = real_replace
    results["after_commit"] = _load(path)

    _save(path, 8)
    results["after_good_save"] = _load(path)
    dist.barrier()
    results["files"] = sorted(os.listdir(path))
    return results


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_failed_write_or_commit_raises_on_every_rank_and_keeps_the_previous_checkpoint(three_ranks):
    folders, by_rank = three_ranks
    path = folders["failing saves"]
    results = part_results(by_rank, "failing saves")
    for rank in range(3):
        got = results[rank]
        assert got["write"] == results[0]["write"] and got["commit"] == results[0]["commit"]
        assert got["write"].startswith("OSError: save_checkpoint: rank 1 could not write its file"), got["write"]
        assert "No space left on device" in got["write"] and "step 4 was not saved" in got["write"]
        assert "still holds the last complete checkpoint" in got["write"]
        assert got["commit"].startswith("OSError: save_checkpoint: rank 0 could not commit"), got["commit"]
        assert "Permission denied" in got["commit"] and "step 6 was not saved" in got["commit"]
        assert got["after_write"]["step"] == 2 and got["after_commit"]["step"] == 2, got
        assert got["after_good_save"]["step"] == 8
        assert np.array_equal(got["after_good_save"]["params"], flat_parameters(_replica(8)[0]))
    with open(os.path.join(path, MANIFEST)) as manifest_file:
        manifest = json.load(manifest_file)
    assert results[0]["files"] == sorted([MANIFEST, *manifest["files"]]), "stale or .partial files remain"


def _copy(source: str, target: str) -> str:
    shutil.copytree(source, target)
    return target


def _craft_broken_folders(base: str, older: str, newer: str) -> dict[str, str]:
    """Folders that hold no complete checkpoint, made from two complete ones (``older`` at step 2)."""
    with open(os.path.join(newer, MANIFEST)) as manifest_file:
        files = json.load(manifest_file)["files"]
    mixed = _copy(newer, os.path.join(base, "mixed"))
    shutil.copyfile(rank_file(older, 1), os.path.join(mixed, files[1]))
    missing = _copy(newer, os.path.join(base, "missing"))
    os.remove(os.path.join(missing, files[2]))
    truncated = _copy(newer, os.path.join(base, "truncated"))
    with open(os.path.join(truncated, files[0]), "r+b") as file:
        file.truncate(100)
    no_manifest = _copy(newer, os.path.join(base, "no_manifest"))
    os.remove(os.path.join(no_manifest, MANIFEST))
    old_format = os.path.join(base, "old_format")
    os.makedirs(old_format)
    for rank in range(3):
        torch.save({"format": "gradcomm.checkpoint/1", "world_size": 3}, os.path.join(old_format, f"rank{rank}.pt"))
    return {"mixed": mixed, "missing": missing, "truncated": truncated, "no_manifest": no_manifest,
            "old_format": old_format}


def _load_broken_folders(base: str) -> dict[str, Any]:
    older, newer = os.path.join(base, "older"), os.path.join(base, "newer")
    _save(older, 2)
    _save(newer, 4)
    dist.barrier()
    if dist.get_rank() == 0:
        _craft_broken_folders(base, older, newer)
    dist.barrier()
    names = ("mixed", "missing", "truncated", "no_manifest", "old_format")
    found = {name: _load(os.path.join(base, name)) for name in names}
    found["newer"] = _load(newer)
    found["ids"] = {"older": _load(older)["id"], "newer": found["newer"]["id"]}
    return found


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """(folder per part, per rank its results): the failing saves and the broken folders, one 3-rank group."""
    folders = {
        "failing saves": str(tmp_path_factory.mktemp("failing_saves") / "checkpoint"),
        "broken folders": str(tmp_path_factory.mktemp("broken_folders")),
    }
    parts = [("failing saves", _failing_saves, (folders["failing saves"],)),
             ("broken folders", _load_broken_folders, (folders["broken folders"],))]
    return folders, run_on_ranks(each_part, 3, args=(parts,), timeout=200)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_folders_without_one_complete_checkpoint_raise_on_every_rank_naming_ranks_and_steps(three_ranks):
    folders, by_rank = three_ranks
    base = folders["broken folders"]
    found = part_results(by_rank, "broken folders")
    older, newer = found[0]["ids"]["older"], found[0]["ids"]["newer"]
    errors = {name: found[0][name]["error"] for name in ("mixed", "missing", "truncated", "no_manifest", "old_format")}
    for rank in range(3):
        for name, error in errors.items():
            assert found[rank][name] == {"error": error}, f"rank {rank} differs from rank 0 on {name}"
        assert found[rank]["newer"]["step"] == 4, "the intact folder must still load"

    assert errors["mixed"].startswith("CheckpointError: load_checkpoint: ")
    assert f"rank 1 found step 2 (id {older}), ranks 0, 2 found step 4 (id {newer})" in errors["mixed"]
    stale = os.path.join(base, "mixed", f"rank1-{newer}.pt")
    assert f"rank 1: {stale!r} holds step 2 (id {older}), not the checkpoint {MANIFEST} names" in errors["mixed"]
    assert "nothing was loaded on any rank" in errors["mixed"]
    assert f"rank 2: {os.path.join(base, 'missing', f'rank2-{newer}.pt')!r} is missing" in errors["missing"]
    assert "rank 0: " in errors["truncated"] and "could not be read" in errors["truncated"]
    assert "rank 1" not in errors["truncated"] and "rank 2" not in errors["truncated"]
    assert errors["no_manifest"].startswith("FileNotFoundError: load_checkpoint: no complete checkpoint in")
    assert errors["old_format"].startswith("CheckpointError: load_checkpoint: ")
    assert "gradcomm.checkpoint/1" in errors["old_format"] and FORMAT in errors["old_format"]


def _local_folders(base: str) -> dict[str, Any]:
    """Each rank saves to and loads from its own folder, as on machines without a shared filesystem."""
    rank = dist.get_rank()
    path = os.path.join(base, f"machine{rank}", "checkpoint")
    older = _save(path, 2)
    stash = os.path.join(base, f"machine{rank}", "stash.pt")
    shutil.copyfile(older, stash)
    newer = _save(path, 4)
    result = {"files": sorted(os.listdir(path)), "loaded": _load(path)}
    if rank == 1:
        shutil.copyfile(stash, newer)  # this machine's folder now holds its step-2 file under the step-4 name
    result["stale"] = _load(path)
    return result


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ranks_without_a_shared_filesystem_load_through_rank_0s_manifest_and_are_cross_checked(tmp_path):
    found = run_on_ranks(_local_folders, 2, args=(str(tmp_path),), timeout=120)
    checkpoint_id = found[0]["loaded"]["id"]
    assert found[0]["files"] == sorted([MANIFEST, f"rank0-{checkpoint_id}.pt"])
    assert found[1]["files"] == [f"rank1-{checkpoint_id}.pt"]
    for rank in range(2):
        assert found[rank]["loaded"]["step"] == 4 and found[rank]["loaded"]["id"] == checkpoint_id
        assert found[rank]["stale"] == found[0]["stale"]
    assert "rank 1 found step 2 (id " in found[0]["stale"]["error"], found[0]["stale"]
    assert f"rank 0 found step 4 (id {checkpoint_id})" in found[0]["stale"]["error"]


def _rank_1_exits_before_loading(path: str) -> None:
    _save(path, 2)
    if dist.get_rank() == 1:
        os._exit(0)
    try:
        load_checkpoint(path, *_fresh())
    except PeerLostError as exc:
        with open(os.path.join(os.path.dirname(path), "lost0.txt"), "w") as out:
            out.write(str(exc))
        raise


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_peer_lost_while_loading_raises_peer_lost_error(tmp_path):
    path = str(tmp_path / "checkpoint")
    with pytest.raises(RankError, match="rank 1 of 2 exited with code 0"):
        run_on_ranks(_rank_1_exits_before_loading, 2, args=(path,), timeout=120)
    with open(tmp_path / "lost0.txt") as lost:
        message = lost.read()
    assert message.startswith(f"rank 0 lost contact with its peers while loading checkpoint {path!r}"), message


def test_a_successful_save_leaves_only_the_manifest_and_the_current_files(tmp_path):
    model, optimizer = _replica(1)
    junk = ["rank0-0123456789abcdef0123456789abcdef.pt.partial", "rank0.pt", "rank2-0123456789abcdef0123456789abcdef.pt",
            f"{MANIFEST}.partial", "notes.txt"]
    for name in junk:
        (tmp_path / name).write_bytes(b"junk")
    first = save_checkpoint(tmp_path, model, optimizer, step=1)
    assert sorted(os.listdir(tmp_path)) == sorted([MANIFEST, os.path.basename(first), "notes.txt"])
    second = save_checkpoint(tmp_path, model, optimizer, step=2)
    assert first != second and not os.path.exists(first)
    assert sorted(os.listdir(tmp_path)) == sorted([MANIFEST, os.path.basename(second), "notes.txt"])
    assert rank_file(tmp_path, 0) == second
    with open(tmp_path / MANIFEST) as manifest_file:
        manifest = json.load(manifest_file)
    assert manifest == {"format": FORMAT, "id": manifest["id"], "step": 2, "world_size": 1,
                        "files": [os.path.basename(second)]}
    assert os.path.basename(second) == f"rank0-{manifest['id']}.pt"
    assert torch.load(second, weights_only=True)["checkpoint_id"] == manifest["id"]

    with pytest.raises(ValueError, match=r"rank 1 is not in .* written by 1 rank"):
        rank_file(tmp_path, 1)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in"):
        rank_file(tmp_path / "missing", 0)
    os.remove(second)
    with pytest.raises(CheckpointError, match=r"rank 0: .* is missing"):
        load_checkpoint(tmp_path, *_fresh())
