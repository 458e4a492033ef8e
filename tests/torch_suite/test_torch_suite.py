"""CI subset of torch's own DDP test cases, run with gradcomm's DDP in torch's DDP's place (2 gloo ranks).

The cases run once, in one fresh interpreter (:func:`tests.torch_suite.runner.run_cases`), and each test
checks its case's outcome. Cases known to fail with gradcomm's DDP are strict xfails carrying the failing
assertion, so a fix turns them into loud XPASS failures; the full selection is
``benchmarks/torch_suite_report.py``.
"""

from __future__ import annotations

import functools

import pytest

from tests.torch_suite.cases import CI_PASSING, EXCLUDED, GRADCOMM_FAILURES, selected_cases
from tests.torch_suite.runner import PASS, CaseResult, run_cases

pytestmark = pytest.mark.slow  # runs torch's own distributed_test.py cases

pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest (pip install expecttest)")

RUN_TIMEOUT = 240


@functools.lru_cache(maxsize=1)
def _outcomes() -> dict[str, CaseResult]:
    return run_cases([*CI_PASSING, *GRADCOMM_FAILURES], "gradcomm", case_timeout=90, timeout=RUN_TIMEOUT)


def _check(name: str) -> None:
    result = _outcomes()[name]
    assert result.status == PASS, f"{name}: {result.status}: {result.message}\n{result.detail}"


@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.parametrize("name", CI_PASSING)
def test_torch_case_passes_with_gradcomm(name: str) -> None:
    _check(name)


if GRADCOMM_FAILURES:  # known failures run as strict xfails, so a fix flips them loudly (none at present)

    @pytest.mark.timeout(RUN_TIMEOUT + 60)
    @pytest.mark.parametrize(
        "name",
        [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=why)) for name, why in GRADCOMM_FAILURES.items()],
    )
    def test_torch_case_known_gradcomm_failure(name: str) -> None:
        _check(name)


def test_tables_name_selected_cases_only() -> None:
    """A stale name in a table (torch renamed or dropped a case) fails here instead of silently counting."""
    selected = set(selected_cases())
    for table in (EXCLUDED, GRADCOMM_FAILURES, CI_PASSING):
        assert not set(table) - selected, f"not among the selected cases: {sorted(set(table) - selected)}"
    assert not set(EXCLUDED) & (set(GRADCOMM_FAILURES) | set(CI_PASSING))
