"""Every exception class gradcomm defines derives from ``gradcomm.GradcommError`` and from the type torch
raises in its place (``except RuntimeError`` written for torch's DDP catches it), keeping the builtin types it
had before (``except ValueError`` still catches what it caught)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch.distributed as dist

import gradcomm
from gradcomm import GradcommError

SRC = Path(gradcomm.__file__).parent

# class name -> the types it must also be: torch's type in its place first, then the ones it had before
EXPECTED: dict[str, tuple[type[BaseException], ...]] = {
    "CommHookError": (RuntimeError,),
    "CommHookTypeError": (RuntimeError, TypeError),
    "CommHookResultError": (RuntimeError, ValueError),
    "RanksDisagreeError": (RuntimeError, ValueError),
    "ParameterMismatchError": (RuntimeError, ValueError),
    "CheckpointError": (RuntimeError, ValueError),
    "UnsupportedArgumentError": (NotImplementedError, ValueError),
    "UnsupportedTorchMethodError": (NotImplementedError,),
    "PeerLostError": (dist.DistBackendError,),
    "NonFiniteGradientError": (RuntimeError, FloatingPointError),
    "ParameterDriftError": (RuntimeError,),
    "RankError": (RuntimeError,),
    "NetworkSetupError": (RuntimeError,),
    "RankFailure": (RuntimeError,),
    "HostsFailure": (RuntimeError,),
    "BenchError": (Exception,),  # the `gradcomm bench` command's one-line report: no torch counterpart
}


def _defined_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class defined in gradcomm's source, found by reading each module's class statements
    (so a new one is covered without an edit here) and importing the modules that define one."""
    found: dict[str, type[BaseException]] = {}
    for path in sorted(SRC.rglob("*.py")):
        classes = [node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)]
        candidates = [name for name in classes if name.endswith(("Error", "Exception", "Failure"))]
        if not candidates:
            continue
        module = importlib.import_module(".".join(("gradcomm", *path.relative_to(SRC).with_suffix("").parts)))
        for name in candidates:
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                found[name] = value
    return found


DEFINED = _defined_exceptions()


def test_every_defined_exception_is_listed() -> None:
    assert DEFINED["GradcommError"] is GradcommError
    defined = set(DEFINED) - {"GradcommError"}
    assert defined == set(EXPECTED), f"unlisted: {defined - set(EXPECTED)}; gone: {set(EXPECTED) - defined}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_exception_has_the_common_base_and_torchs_type(name: str) -> None:
    error = DEFINED[name]
    assert issubclass(error, GradcommError), f"{name} is not a gradcomm.GradcommError"
    for kind in EXPECTED[name]:
        assert issubclass(error, kind), f"{name} is not a {kind.__name__}"


def test_the_base_is_exported_with_every_public_error() -> None:
    assert "GradcommError" in gradcomm.__all__
    public = [getattr(gradcomm, name) for name in gradcomm.__all__]
    errors = [value for value in public if isinstance(value, type) and issubclass(value, BaseException)]
    assert len(errors) >= 10 and all(issubclass(error, GradcommError) for error in errors), errors
