"""What installing gradcomm promises: the torch releases it supports (declared and checked at import), and
a library that needs nothing of the ``bench`` extra outside ``gradcomm bench``."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import gradcomm
from gradcomm.__main__ import main
from gradcomm._torch_version import SKIP_ENV, SUPPORTED_TORCH, check_torch_version

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter that imports this checkout's gradcomm."""
    environ = {k: v for k, v in os.environ.items() if k != SKIP_ENV}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**environ, **env}
    )


def test_the_checked_range_is_the_declared_one() -> None:
    project = _pyproject()["project"]
    torch_requirements = [d for d in project["dependencies"] if d.startswith("torch")]
    assert torch_requirements == [f"torch{SUPPORTED_TORCH}"]


def test_bench_dependencies_are_an_extra_the_set_up_installs() -> None:
    project = _pyproject()["project"]
    assert not [d for d in project["dependencies"] if d.startswith(("rich", "matplotlib"))]
    assert sorted(d.split(">")[0] for d in project["optional-dependencies"]["bench"]) == ["matplotlib", "rich"]
    assert '".[dev,bench]"' in (ROOT / "scripts" / "setup.sh").read_text()


@pytest.mark.parametrize("version", ["2.13.0", "2.13.1+cpu", "2.13.0+cu128"])
def test_supported_releases_pass(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SKIP_ENV, raising=False)
    check_torch_version(version)


@pytest.mark.parametrize("version", ["2.4.1", "2.12.1+cpu", "2.14.0", "2.14.0.dev20260101+cpu", "3.0.0", "git"])
def test_other_releases_are_refused_with_the_fix(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SKIP_ENV, raising=False)
    with pytest.raises(ImportError) as raised:
        check_torch_version(version)
    message = str(raised.value)
    assert f"torch {version} is installed" in message
    assert f"pip install 'torch{SUPPORTED_TORCH}'" in message
    assert f"{SKIP_ENV}=1" in message


def test_the_skip_variable_allows_any_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SKIP_ENV, "1")
    check_torch_version("2.4.1")
    monkeypatch.setenv(SKIP_ENV, "0")
    with pytest.raises(ImportError):
        check_torch_version("2.4.1")


_IMPORT_UNDER_TORCH_2_4 = "import torch; torch.__version__ = '2.4.1'; import gradcomm.hooks; print('imported')"


@pytest.mark.timeout(240)
def test_import_refuses_an_unsupported_torch() -> None:
    refused = _python(_IMPORT_UNDER_TORCH_2_4)
    assert refused.returncode != 0 and "imported" not in refused.stdout
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: gradcomm supports torch>=2.13,<2.14, but torch 2.4.1 is installed"), last


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_import_under_an_unsupported_torch_when_told_to_skip() -> None:
    skipped = _python(_IMPORT_UNDER_TORCH_2_4, **{SKIP_ENV: "1"})
    assert skipped.returncode == 0 and skipped.stdout.strip() == "imported", skipped.stderr


def _modules_outside_extras() -> list[str]:
    """Every gradcomm module but the framework integrations, which need their own extras."""
    found = pkgutil.walk_packages(gradcomm.__path__, "gradcomm.")
    return sorted(m.name for m in found if not m.name.startswith("gradcomm.integrations."))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_module_imports_without_the_bench_extra() -> None:
    modules = _modules_outside_extras()
    assert "gradcomm.bench.cli" in modules and "gradcomm.hooks.powerSGD_hook" in modules
    code = (
        "import importlib, sys\n"
        "sys.modules['rich'] = sys.modules['matplotlib'] = None  # as if not installed\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print('imported')\n"
    )
    result = _python(code)
    assert result.returncode == 0 and result.stdout.strip() == "imported", result.stderr


@pytest.mark.parametrize("missing", [("rich",), ("matplotlib",), ("rich", "matplotlib")])
def test_bench_without_its_extra_stops_in_one_line_before_training(
    missing: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)
    output = tmp_path / "out"
    assert main(["bench", "--steps", "2", "--output", str(output)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"gradcomm bench: error: {' and '.join(missing)} ")
    assert err.rstrip().endswith("pip install 'gradcomm[bench]'"), err
    assert not output.exists()
