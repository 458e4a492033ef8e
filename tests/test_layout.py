"""The package's layout: the layers import only the ones below them, and old import paths still work.

Checkpoints, model averagers, telemetry and the ranks' agreement checks moved out of the engine's folder
(``gradcomm/ddp/``); their old paths stay importable, warn, and give the very objects of the new ones.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

import gradcomm

_SRC = Path(gradcomm.__file__).parent

# old path -> (the module it gives, a name to compare, what the warning advises)
_MOVED = {
    "gradcomm.ddp.checkpoint": ("gradcomm.checkpoint.save_load", "save_checkpoint", "gradcomm.checkpoint"),
    "gradcomm.ddp.checkpoint_layout": (
        "gradcomm.checkpoint.layout",
        "write_durably",
        "gradcomm.checkpoint.layout",
    ),
    "gradcomm.ddp.averagers": (
        "gradcomm.hooks.averagers",
        "PeriodicModelAverager",
        "gradcomm.hooks.averagers",
    ),
    "gradcomm.ddp.telemetry": ("gradcomm.comm.telemetry", "CommStats", "gradcomm.comm.telemetry"),
}


@pytest.mark.parametrize("old", sorted(_MOVED))
def test_moved_module_old_path_warns_and_is_the_new_module(old: str, monkeypatch: pytest.MonkeyPatch) -> None:
    new, name, advised = _MOVED[old]
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} has moved: import from {advised} instead"):
        module = importlib.import_module(old)
    moved = importlib.import_module(new)
    assert module is moved
    assert getattr(module, name) is getattr(moved, name)


@pytest.mark.parametrize(
    ("name", "new"),
    [
        ("RanksDisagreeError", "gradcomm.comm.agreement"),
        ("check_same_on_all_ranks", "gradcomm.comm.agreement"),
        ("check_same_parameters", "gradcomm.comm.agreement"),
        ("broadcast_coalesced", "gradcomm.comm.agreement"),
        ("_bit_sums", "gradcomm.comm.agreement"),
        ("describe_hook", "gradcomm.hooks.fingerprint"),
        ("describe_state", "gradcomm.hooks.fingerprint"),
        ("hook_fingerprint", "gradcomm.hooks.fingerprint"),
        ("_Walk", "gradcomm.hooks.fingerprint"),
    ],
)
def test_agreement_old_path_warns_and_gives_both_halves(
    name: str, new: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "gradcomm.ddp.agreement", raising=False)
    with pytest.warns(
        DeprecationWarning, match="gradcomm.ddp.agreement has moved: import from gradcomm.comm.agreement"
    ):
        old = importlib.import_module("gradcomm.ddp.agreement")
    assert getattr(old, name) is getattr(importlib.import_module(new), name)


def test_moved_path_warning_points_at_the_importing_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warning is attributed to the user's import, so Python's default filters show it in ``__main__``."""
    monkeypatch.delitem(sys.modules, "gradcomm.ddp.telemetry", raising=False)
    with pytest.warns(DeprecationWarning) as record:
        import gradcomm.ddp.telemetry  # noqa: F401
    assert [warning.filename for warning in record] == [__file__]


def test_facade_exports_are_the_moved_objects() -> None:
    from gradcomm.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from gradcomm.comm.agreement import RanksDisagreeError
    from gradcomm.hooks.averagers import PeriodicModelAverager

    assert gradcomm.CheckpointError is CheckpointError
    assert gradcomm.load_checkpoint is load_checkpoint and gradcomm.save_checkpoint is save_checkpoint
    assert gradcomm.RanksDisagreeError is RanksDisagreeError
    assert gradcomm.PeriodicModelAverager is PeriodicModelAverager


def _imported_gradcomm_modules(path: Path) -> set[str]:
    """Every ``gradcomm`` module ``path`` imports, at its top or inside functions (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("gradcomm.")}


# package -> the gradcomm packages it may import (besides itself and gradcomm.errors)
_BELOW = {
    "comm": set(),
    "checkpoint": {"comm"},
    "hooks": {"comm", "compression"},
}


@pytest.mark.parametrize("package", sorted(_BELOW))
def test_layer_imports_only_the_layers_below(package: str) -> None:
    allowed = {"gradcomm." + name for name in _BELOW[package] | {package, "errors", "_torch_version"}}
    wrong = {
        f"{path.relative_to(_SRC)} imports {name}"
        for path in sorted((_SRC / package).rglob("*.py"))
        for name in _imported_gradcomm_modules(path)
        if ".".join(name.split(".")[:2]) not in allowed
    }
    assert not wrong, sorted(wrong)


def test_no_module_is_longer_than_500_lines():
    """A module past 500 lines holds more than one subject: split it (a moved name keeps its old import path)."""
    long = {str(path.relative_to(_SRC)): n for path in _SRC.rglob("*.py") if (n := len(path.read_text().splitlines())) > 500}
    assert not long, f"modules over 500 lines: {long}"


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("gradcomm.compression.segments", "pack_segments", "gradcomm.compression.segment_bits"),
        ("gradcomm.compression.segments", "segment_std", "gradcomm.compression.segment_stats"),
        ("gradcomm.compression.communicators", "TwoStageAllreduce", "gradcomm.compression.two_stage"),
    ],
)
def test_moved_name_old_path_warns_and_is_the_new_object(old: str, name: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"{old}.{name} has moved: import from {new} instead"):
        moved = getattr(importlib.import_module(old), name)
    assert moved is getattr(importlib.import_module(new), name)
