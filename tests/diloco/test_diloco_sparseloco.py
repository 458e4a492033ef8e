"""gradcomm.DiLoCo with SparseLoCo's compressor (``compressor="sparseloco"``) on 2 gloo ranks: the replicas are
bit-identical right after every sync and differ between, each rank's accumulator differs from the other's,
and a resume from a ``weights_only`` state (accumulators included) equals the uninterrupted run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradcomm.diloco import DiLoCo
from gradcomm.testing import run_on_ranks
from tests.diloco.test_diloco import STEPS, H, _backward, _inner, _model, _resume, _same_on_every_rank

# every parameter compressed (min_numel=0), in chunks of 8 with a quarter of each sent
COMPRESSOR = "sparseloco:ratio=0.25,chunk=8,min_numel=0"


def _replicas() -> dict[str, Any]:
    model = _model()
    diloco = DiLoCo(model, _inner(model), sync_every=H, compressor=COMPRESSOR)
    out: dict[str, Any] = {"synced": [], "same": []}
    for t in range(1, STEPS + 1):
        before = diloco.synced_steps
        _backward(model, t)
        diloco.step()
        diloco.zero_grad()
        out["synced"].append(diloco.synced_steps > before)
        out["same"].append(_same_on_every_rank(model.parameters()))
    accumulation = diloco.state_dict()["compressor"][0]["compressor"]["accumulation"]
    out["accumulators"] = len(accumulation)
    out["accumulators_same"] = _same_on_every_rank(accumulation[key] for key in sorted(accumulation))
    out["moved"] = not all(
        torch.equal(p, q) for p, q in zip(model.parameters(), _model().parameters(), strict=True)
    )
    return out


def scenarios() -> dict[str, Any]:
    return {"replicas": _replicas(), "resume": _resume(1, 0, COMPRESSOR, via_checkpoint=False)}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_on_ranks(scenarios, 2, timeout=150, collective_timeout=30)


@pytest.mark.timeout(200)
def test_replicas_identical_right_after_each_sync_and_differ_between(ranks: list[dict[str, Any]]) -> None:
    run = ranks[0]["replicas"]
    assert run["moved"]
    assert any(run["synced"])
    for t, (synced, same) in enumerate(zip(run["synced"], run["same"], strict=True), 1):
        assert same == synced, f"step {t}: synced {synced}, replicas identical {same}"


@pytest.mark.timeout(200)
def test_each_rank_keeps_its_own_accumulator(ranks: list[dict[str, Any]]) -> None:
    run = ranks[0]["replicas"]
    # every parameter but the 3-element bias, which the hook sends dense: 12 bytes, compressed to 9 (one value
    # of 2 + 2 bits and its chunk's two float32 magnitudes), less than min_compression_rate=2 times smaller
    assert run["accumulators"] == 3
    assert not run["accumulators_same"]


@pytest.mark.timeout(200)
def test_resume_equals_the_uninterrupted_run(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        run = rank["resume"]
        assert run["moved"] and run["equal"], run
        assert run["synced_steps"][0] == run["synced_steps"][1] > 0
