"""gradcomm.DiLoCo on 2 and 3 gloo ranks: the outer update against a plain reference to the bit, replicas
identical right after each sync and different between, resume equal to the uninterrupted run, compressed
pseudo-gradients, the peak bytes of one exchange with fragments, and ranks that disagree.

One spawned group per world size runs every scenario and returns plain values; the assertions run here.
"""

from __future__ import annotations

import io
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradcomm.checkpoint import load_checkpoint, save_checkpoint
from gradcomm.diloco import DiLoCo
from gradcomm.hooks.registry import make_comm_hook
from gradcomm.testing import run_on_ranks
from tests.support.models import mlp
from tests.support.ranks import error_text

H = 4
STEPS = 13
# The model's trainable parameters, (8, 4), 8, (3, 8) and 3 elements (67 in all), laid end to end: where each
# fragment_unit cuts them, by element position. Whole parameters: the first weight, then the rest. Rows:
# 67 / 2 = 33 is in 0.bias (rows of 1 element); 67 / 3 = 22 rounds to the row boundary 20 of 0.weight (rows
# of 4) and 44 to 40 of 2.weight (rows of 8). Elements: exactly 67 * f // F.
CUTS = {
    (1, "row"): [],
    (2, "parameter"): [32],
    (2, "row"): [33],
    (3, "row"): [20, 40],
    (3, "element"): [22, 44],
}


def _model() -> torch.nn.Module:
    return mlp(4, 8, 3)


def _batch_norm_model() -> torch.nn.Module:
    """The same layers with a batch norm in between: running statistics and a counter as buffers."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    )


def _square_model() -> torch.nn.Module:
    """Four parameters of 64 elements: ``fragments`` of 1, 2 or 4 split it into equal parts."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(4)])


class _Dominant(torch.nn.Module):
    """One dominant tensor: ``big`` (96 x 64) holds 6144 of the 8192 elements, ``small``/``other`` (16 x 64)
    1024 each. Whole parameters cannot make two fragments of fewer than 6144 elements; rows of 64 elements make
    2 or 4 of exactly 8192 / F."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.big = torch.nn.Parameter(torch.randn(96, 64) / 8)
        self.small = torch.nn.Parameter(torch.randn(16, 64) / 8)
        self.other = torch.nn.Parameter(torch.randn(16, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x @ self.big.T, x @ self.small.T, x @ self.other.T], dim=1).tanh()


def _inner(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _backward(model: torch.nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    inputs, targets = torch.randn(6, 4, generator=generator), torch.randn(6, 3, generator=generator)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()


def _same_on_every_rank(params: Any) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(other, flat) for other in everyone)


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


class _Reference:
    """DiLoCo written plainly on the parameters laid end to end: fragment ``f`` is the element range
    ``[cuts[f], cuts[f + 1])``; the mean of its pseudo-gradients over the ranks, Nesterov SGD on that range of
    the anchor (torch's SGD formulas, with its ``add(..., alpha=)`` so that the roundings are the same; one
    momentum per element), the range replaced by the anchor's; launched at the fragment's step, applied
    ``overlap`` steps later."""

    def __init__(
        self, cuts: list[int], overlap: int, mixing: float, lr: float = 0.7, momentum: float = 0.9
    ) -> None:
        self.model = _model()
        self.inner = _inner(self.model)
        self.params = list(self.model.parameters())
        self.anchor = self._flat().clone()
        self.edges = [0, *cuts, self.anchor.numel()]
        self.momentum_buffers: dict[int, torch.Tensor] = {}
        self.overlap, self.lr, self.momentum, self.mixing = overlap, lr, momentum, mixing
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def step(self, t: int) -> None:
        _backward(self.model, t)
        self.inner.step()
        self.inner.zero_grad()
        for f in [f for f, (launched, _) in self.pending.items() if launched + self.overlap <= t]:
            self._outer(f, self.pending.pop(f)[1])
        fragments = len(self.edges) - 1
        for f in range(fragments):
            if (t + f * H // fragments) % H == 0:
                low, high = self.edges[f], self.edges[f + 1]
                flat = (self.anchor[low:high] - self._flat()[low:high]) / dist.get_world_size()
                dist.all_reduce(flat)
                self.pending[f] = (t, flat)
                if self.overlap == 0:
                    self._outer(f, self.pending.pop(f)[1])

    def finish(self) -> None:
        for f in list(self.pending):
            self._outer(f, self.pending.pop(f)[1])

    def _outer(self, f: int, mean: torch.Tensor) -> None:
        low, high = self.edges[f], self.edges[f + 1]
        with torch.no_grad():
            if f not in self.momentum_buffers:
                self.momentum_buffers[f] = mean.clone()
            else:
                self.momentum_buffers[f].mul_(self.momentum).add_(mean)
            grad = mean.add(self.momentum_buffers[f], alpha=self.momentum)
            self.anchor[low:high].add_(grad, alpha=-self.lr)
            flat = self._flat()
            flat[low:high].lerp_(self.anchor[low:high], 1 - self.mixing)  # mixing 0: the anchor, exactly
            offset = 0
            for p in self.params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


def _cuts(diloco: DiLoCo) -> list[int]:
    """Where each fragment after the first starts, by element position in the parameters laid end to end."""
    before, offset = {}, 0
    for name, p in diloco.module.named_parameters():
        before[name] = offset
        offset += p.numel()
    return [before[f.parts[0].name] + f.parts[0].start for f in diloco.fragments[1:]]


def _against_reference(fragments: int, overlap: int, mixing: float, unit: str) -> dict[str, Any]:
    """DiLoCo and the reference side by side; per step whether they agree to the bit, whether a fragment
    synced at that step and whether the replicas were identical after it."""
    model = _model()
    options = dict(sync_every=H, fragments=fragments, overlap=overlap, mixing=mixing, anchor_device="cpu")
    options.update(outer_lr=0.7, outer_momentum=0.9, fragment_unit=unit)  # the paper's Nesterov
    diloco = DiLoCo(model, _inner(model), **options)
    reference = _Reference(CUTS[(fragments, unit)], overlap, mixing)
    out: dict[str, Any] = {"equal": [], "synced": [], "replicas_same": [], "may_differ": []}
    out["cuts"] = _cuts(diloco)
    out["names"] = [list(f.names) for f in diloco.fragments]
    for t in range(1, STEPS + 1):
        before = diloco.synced_steps
        _backward(model, t)
        diloco.step()
        diloco.zero_grad()
        reference.step(t)
        out["equal"].append(_equal(model, reference.model))
        out["synced"].append(diloco.synced_steps > before)
        out["replicas_same"].append(_same_on_every_rank(model.parameters()))
        out["may_differ"].append(diloco.replicas_may_differ())
    before = diloco.synced_steps
    diloco.wait_pending()
    reference.finish()
    out["finished"] = (diloco.synced_steps - before, _equal(model, reference.model))
    return out


def _train(diloco: DiLoCo, model: torch.nn.Module, first: int, last: int) -> None:
    for t in range(first, last + 1):
        _backward(model, t)
        diloco.step()
        diloco.zero_grad()


def _resume(
    fragments: int,
    overlap: int,
    compressor: str | None,
    via_checkpoint: bool,
    build: Any = _model,
    unit: str = "parameter",
) -> dict[str, Any]:
    """Train STEPS steps straight, and again stopping after step 6 (mid-interval, an exchange in flight with
    ``overlap``) to resume from a ``weights_only`` state in a fresh model, inner optimizer and DiLoCo (through
    ``save_checkpoint``/``load_checkpoint`` with ``via_checkpoint``)."""
    options = dict(
        sync_every=H, fragments=fragments, overlap=overlap, compressor=compressor, fragment_unit=unit
    )
    model = build()
    straight = DiLoCo(model, _inner(model), **options)
    _train(straight, model, 1, STEPS)

    first = build()
    inner = _inner(first)
    interrupted = DiLoCo(first, inner, **options)
    _train(interrupted, first, 1, 6)
    second = build()
    second_inner = _inner(second)
    if via_checkpoint:
        folder = [tempfile.mkdtemp(prefix="diloco-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(folder)
        save_checkpoint(folder[0], first, inner, interrupted, step=6)
        resumed = DiLoCo(second, second_inner, **options)
        load_checkpoint(folder[0], second, second_inner, resumed)
    else:
        saved = io.BytesIO()
        torch.save(
            {"model": first.state_dict(), "inner": inner.state_dict(), "diloco": interrupted.state_dict()},
            saved,
        )
        saved.seek(0)
        loaded = torch.load(saved, weights_only=True)
        resumed = DiLoCo(second, second_inner, **options)
        second.load_state_dict(loaded["model"])
        second_inner.load_state_dict(loaded["inner"])
        resumed.load_state_dict(loaded["diloco"])
    _train(resumed, second, 7, STEPS)
    return {
        "equal": _equal(model, second)
        and all(torch.equal(a, b) for a, b in zip(model.buffers(), second.buffers(), strict=True))
        and all(torch.equal(straight.synced_buffers()[n], b) for n, b in resumed.synced_buffers().items()),
        "synced_steps": (straight.synced_steps, resumed.synced_steps),
        "moved": not _equal(model, build()),
        "cuts": _cuts(straight),
        "residual_keys": [
            sorted(state.memory.state_dict()) if hasattr(state, "memory") else None
            for state in resumed._runners.states()
        ],
    }


def _buffers_at_syncs(fragments: int, overlap: int) -> dict[str, Any]:
    """Per step: whether a sync of fragment 0 was applied, whether the buffers are then the same on every
    rank, and whether they equal the plain mean over the ranks of the buffers at fragment 0's launch
    (floating ones; the counter from rank 0), as do ``synced_buffers()``."""
    model = _batch_norm_model()
    diloco = DiLoCo(model, _inner(model), sync_every=H, fragments=fragments, overlap=overlap)
    out: dict[str, Any] = {"start_same": _same_on_every_rank(model.buffers()), "steps": []}
    expected: dict[str, torch.Tensor] = {}
    for t in range(1, STEPS + 1):
        _backward(model, t)
        if t % H == 0:  # fragment 0 launches: its buffers' mean, computed plainly
            floating = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
            flat = torch.cat([b.reshape(-1) for _, b in floating])
            dist.all_reduce(flat)
            flat.div_(dist.get_world_size())
            expected = dict(
                zip([n for n, _ in floating], flat.split([b.numel() for _, b in floating]), strict=True)
            )
            counter = model[1].num_batches_tracked.clone()
            dist.broadcast(counter, src=0)
            expected["1.num_batches_tracked"] = counter
        diloco.step()
        diloco.zero_grad()
        applied = t >= H + overlap and (t - overlap) % H == 0
        buffers = dict(model.named_buffers())
        out["steps"].append(
            {
                "applied": applied,
                "same": _same_on_every_rank(model.buffers()),
                "mean": applied
                and all(torch.equal(buffers[n], e.view_as(buffers[n])) for n, e in expected.items()),
                "synced": applied
                and all(torch.equal(buffers[n], b) for n, b in diloco.synced_buffers().items()),
            }
        )
    return out


def _peak_exchange_bytes(
    fragments: int, compressor: str | None, build: Any = _square_model, unit: str = "row"
) -> list[int]:
    """Bytes handed to collectives by each outer exchange over two rounds of syncs."""
    model = build()
    diloco = DiLoCo(
        model, _inner(model), sync_every=H, fragments=fragments, compressor=compressor, fragment_unit=unit
    )
    width = next(model.parameters()).shape[1]
    sent = []
    for t in range(1, 2 * H + 1):
        before = diloco.comm_stats().total.steps
        inputs = torch.randn(6, width, generator=torch.Generator().manual_seed(1000 * dist.get_rank() + t))
        model(inputs).square().mean().backward()
        diloco.step()
        diloco.zero_grad()
        if diloco.comm_stats().total.steps > before:
            sent.append(diloco.comm_stats().last.bytes_sent)
    return sent


def _bytes_per_sync(compressor: str | None) -> float:
    model = _model()
    diloco = DiLoCo(model, _inner(model), sync_every=H, compressor=compressor)
    _train(diloco, model, 1, 2 * H)
    total = diloco.comm_stats().total
    return total.bytes_sent / total.steps


def _disagreeing() -> str:
    model = _model()
    return error_text(lambda: DiLoCo(model, _inner(model), sync_every=H + dist.get_rank()))


def _shared_stateful_pair() -> str:
    hook, state = make_comm_hook("topk", ratio=0.25)
    model = _model()
    return error_text(
        lambda: DiLoCo(model, _inner(model), sync_every=H, fragments=2, compressor=(state, hook))
    )


def scenarios() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in REFERENCE_CASES:
        fragments, overlap, mixing, unit = case.split("-")
        out[f"reference-{case}"] = _against_reference(int(fragments), int(overlap), float(mixing), unit)
    for case in RESUME_CASES:
        fragments, overlap, compressor, unit = case.split("-")
        compressor = None if compressor == "None" else compressor
        out[f"resume-{case}"] = _resume(
            int(fragments), int(overlap), compressor, compressor is not None, unit=unit
        )
    out["resume-bn"] = _resume(2, 1, None, True, _batch_norm_model)
    for fragments, overlap in [(1, 0), (2, 1)]:
        out[f"buffers-{fragments}-{overlap}"] = _buffers_at_syncs(fragments, overlap)
    out["peak"] = {
        (f, c): _peak_exchange_bytes(f, c)
        for f in (1, 2, 4)
        for c in (None, "fp16_compress", "qsgd:bucket_size=64")
    }
    out["peak-dominant"] = {
        (f, c, unit): _peak_exchange_bytes(f, c, _Dominant, unit)
        for f in (1, 2, 4)
        for c in DOMINANT_COMPRESSORS
        for unit in ("row", "element", "parameter")
        if (unit == "row" or f > 1) and (unit != "parameter" or (c is None and f == 2))
    }
    out["powersgd"] = {unit: _peak_exchange_bytes(3, POWERSGD, _Dominant, unit) for unit in ("row", "element")}
    out["bytes"] = {name: _bytes_per_sync(name) for name in (None, "fp16_compress")}
    out["disagree"] = _disagreeing()
    out["shared_pair"] = _shared_stateful_pair()
    return out


REFERENCE_CASES = [
    "1-0-0.0-row",
    "2-0-0.0-parameter",
    "2-1-0.0-parameter",
    "1-2-0.5-row",
    "2-0-0.0-row",
    "3-1-0.0-row",
    "3-0-0.0-element",
]
"""``fragments-overlap-mixing-fragment_unit``: fragments=1 (the same with every unit), whole parameters, and
fragments that cut 0.bias (2, rows), 0.weight and 2.weight (3, rows or elements)."""
RESUME_CASES = [
    "1-0-None-row",
    "2-1-None-parameter",
    "2-0-topk:ratio=0.25,min_numel=0-parameter",
    "2-1-None-row",
    "3-2-topk:ratio=0.25,min_numel=0,min_compression_rate=0-element",
    "3-1-qsgd:bucket_size=4,min_numel=0-row",
]
"""``fragments-overlap-compressor-fragment_unit``: the last three cut parameters (see ``CUTS``); with an
overlap an exchange is in flight at the interruption; top-k keeps error-feedback residuals per part, QSGD a
random stream per part."""
DOMINANT_COMPRESSORS = (None, "fp16_compress", "qsgd:bucket_size=64", "topk:ratio=0.0625")
POWERSGD = "powersgd:matrix_approximation_rank=1,start_powerSGD_iter=1,use_error_feedback=off,warm_start=off"
"""Each fragment's first exchange plain (its state's first iteration), its second compressed."""


@pytest.fixture(
    scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=lambda n: f"{n}ranks"
)
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_on_ranks(scenarios, request.param, timeout=150, collective_timeout=30)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_outer_update_equals_plain_reference_to_the_bit(ranks: list[dict[str, Any]], case: str) -> None:
    fragments, overlap = map(int, case.split("-")[:2])
    unit = case.split("-")[3]
    for rank in ranks:
        run = rank[f"reference-{case}"]
        assert run["cuts"] == CUTS[(fragments, unit)], run["cuts"]
        if unit == "parameter":
            assert run["names"] == [["0.weight"], ["0.bias", "2.weight", "2.bias"]], run["names"]
        if (fragments, unit) == (2, "row"):
            assert run["names"] == [["0.weight", "0.bias[0:1]"], ["0.bias[1:8]", "2.weight", "2.bias"]]
        assert all(run["equal"]), run["equal"]
        finished = 1 if case == "1-2-0.5-row" else 0  # launched at step 12, due at 14
        assert run["finished"] == (finished, True), run["finished"]
        synced_at = [t for t, synced in enumerate(run["synced"], start=1) if synced]
        launched = [
            t for t in range(1, STEPS + 1) for f in range(fragments) if (t + f * H // fragments) % H == 0
        ]
        assert synced_at == sorted(t + overlap for t in launched if t + overlap <= STEPS), synced_at


@pytest.mark.timeout(200)
def test_replicas_identical_right_after_each_sync_and_differ_between(ranks: list[dict[str, Any]]) -> None:
    run = ranks[0]["reference-1-0-0.0-row"]
    for t, (synced, same, may_differ) in enumerate(
        zip(run["synced"], run["replicas_same"], run["may_differ"], strict=True), 1
    ):
        assert same == synced, f"step {t}: synced {synced}, replicas identical {same}"
        assert may_differ == (not synced), f"step {t}"
    # with fragments, right after a sync only the synced fragment agrees; the model as a whole differs
    assert not any(ranks[0]["reference-2-0-0.0-parameter"]["replicas_same"][H:])
    # mixed with the local values (Streaming DiLoCo's alpha), the replicas never agree again
    mixed = ranks[0]["reference-1-2-0.5-row"]
    assert any(mixed["synced"]) and not any(mixed["replicas_same"]) and all(mixed["may_differ"])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", RESUME_CASES)
def test_resume_equals_the_uninterrupted_run(ranks: list[dict[str, Any]], case: str) -> None:
    fragments, _, _, unit = case.split("-")
    for rank in ranks:
        run = rank[f"resume-{case}"]
        assert run["moved"] and run["equal"], run
        assert run["synced_steps"][0] == run["synced_steps"][1] > 0
        assert run["cuts"] == CUTS.get((int(fragments), unit), run["cuts"]), run["cuts"]


@pytest.mark.timeout(200)
def test_a_split_parameters_parts_keep_residuals_of_their_own(ranks: list[dict[str, Any]]) -> None:
    """Error feedback per part: a whole parameter keeps its name as key (as before fragments cut parameters),
    each part of a cut one is keyed by its element range, in the state of its own fragment."""
    for rank in ranks:
        keys = rank["resume-3-2-topk:ratio=0.25,min_numel=0,min_compression_rate=0-element"]["residual_keys"]
        assert keys == [
            ["0.weight[0:22]"],
            ["0.bias", "0.weight[22:32]", "2.weight[0:4]"],
            ["2.bias", "2.weight[4:24]"],
        ], keys


@pytest.mark.timeout(200)
def test_resume_with_buffers_in_flight_equals_the_uninterrupted_run(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        run = rank["resume-bn"]
        assert run["moved"] and run["equal"], run
        assert run["synced_steps"][0] == run["synced_steps"][1] > 0


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["1-0", "2-1"])
def test_buffers_are_averaged_at_each_sync_of_fragment_zero(ranks: list[dict[str, Any]], case: str) -> None:
    """Batch-norm statistics: the same on every rank at the start and right after each sync (the mean of the
    ranks' floating buffers, the first rank's counter), different between syncs."""
    for rank in ranks:
        run = rank[f"buffers-{case}"]
        assert run["start_same"]
        applied = [t for t, step in enumerate(run["steps"], 1) if step["applied"]]
        assert len(applied) >= 2, applied
        for t, step in enumerate(run["steps"], 1):
            assert step["same"] == step["applied"], (t, step)
            if step["applied"]:
                assert step["mean"] and step["synced"], (t, step)


@pytest.mark.timeout(200)
def test_peak_bytes_of_one_exchange_fall_by_the_number_of_fragments(ranks: list[dict[str, Any]]) -> None:
    """Streaming DiLoCo's promise, counted: with F equal fragments each exchange hands over 1/F of plain
    DiLoCo's bytes (the same number of syncs per fragment, F times as many exchanges)."""
    peak = ranks[0]["peak"]
    for compressor in (None, "fp16_compress", "qsgd:bucket_size=64"):
        plain = peak[(1, compressor)]
        assert len(plain) == 2 and plain[0] == plain[1] > 0, plain
        for fragments in (2, 4):
            exchanges = peak[(fragments, compressor)]
            assert len(exchanges) == 2 * fragments, exchanges
            assert max(exchanges) * fragments == plain[0], (compressor, fragments, exchanges, plain)
    assert peak[(1, None)][0] == 4 * 256


@pytest.mark.timeout(200)
def test_peak_bytes_are_one_fth_with_a_dominant_tensor(ranks: list[dict[str, Any]]) -> None:
    """Issue 35's target 3 where a tensor holds 3/4 of the model: fragments that cut parameters (rows, the
    default, or elements) make each exchange exactly 1/F of plain DiLoCo's bytes, fp32 and compressed; whole
    parameters cannot (the dominant tensor alone is 3/4 of the model)."""
    peak = ranks[0]["peak-dominant"]
    for compressor in DOMINANT_COMPRESSORS:
        for unit in ("row", "element"):
            plain = peak[(1, compressor, "row")]  # fragments=1: one fragment, whatever the unit
            assert len(plain) == 2 and plain[0] == plain[1] > 0, plain
            for fragments in (2, 4):
                exchanges = peak[(fragments, compressor, unit)]
                assert len(exchanges) == 2 * fragments, exchanges
                assert max(exchanges) * fragments == plain[0], (compressor, unit, fragments, exchanges, plain)
    assert peak[(1, None, "row")][0] == 4 * 8192
    assert max(peak[(2, None, "parameter")]) == 4 * 6144  # 3/4 of plain DiLoCo's, where rows give 1/2


@pytest.mark.timeout(200)
def test_powersgd_compresses_the_parts_of_a_cut_matrix_where_cuts_fall_on_rows(ranks: list[dict[str, Any]]) -> None:
    """Why rows are the default unit: 3 fragments of the dominant model cut ``big`` inside it. Cut at rows, each
    part is a matrix of whole rows and PowerSGD sends it as rank-1 factors; cut at 8192 * f // 3 elements, a part
    that is not whole rows is flat, and PowerSGD sends a flat tensor uncompressed."""
    ratios = {}
    for unit, exchanges in ranks[0]["powersgd"].items():
        assert len(exchanges) == 6, exchanges  # fragments 2, 1, 0 plain, then the same compressed
        ratios[unit] = [c / p for c, p in zip(exchanges[3:], exchanges[:3], strict=True)]
    assert max(ratios["row"]) < 1 / 8, ratios
    assert max(ratios["element"]) > 0.9, ratios


@pytest.mark.timeout(200)
def test_compressed_pseudo_gradients_send_fewer_bytes(ranks: list[dict[str, Any]]) -> None:
    sent = ranks[0]["bytes"]
    assert sent[None] == 4 * (32 + 8 + 24 + 3)
    assert sent["fp16_compress"] == sent[None] / 2


@pytest.mark.timeout(200)
def test_ranks_with_different_sync_every_all_refuse(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["disagree"].startswith("RanksDisagreeError: gradcomm.DiLoCo: the ranks disagree"), rank[
            "disagree"
        ]
        assert "sync_every differs: rank 0: 4; rank 1: 5" in rank["disagree"], rank["disagree"]


@pytest.mark.timeout(200)
def test_one_stateful_pair_for_several_fragments_is_refused(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["shared_pair"].startswith(
            "ValueError: gradcomm.DiLoCo: with fragments=2, each fragment needs a hook state of its own"
        ), rank["shared_pair"]
