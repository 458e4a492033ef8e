"""gradcomm.DiLoCo on 2 and 3 gloo ranks: the outer update against a plain reference to the bit, replicas
identical right after each sync and different between, resume equal to the uninterrupted run, compressed
pseudo-gradients, and ranks that disagree.

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
# The model's trainable parameters have 32, 8, 24 and 3 elements: two fragments balanced by element count
# are the first weight and the rest.
FRAGMENT_NAMES = {
    1: [["0.weight", "0.bias", "2.weight", "2.bias"]],
    2: [["0.weight"], ["0.bias", "2.weight", "2.bias"]],
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
    """DiLoCo written plainly: mean of the pseudo-gradients of a fragment over the ranks, Nesterov SGD on the
    anchor (torch's SGD formulas, with its ``add(..., alpha=)`` so that the roundings are the same), the
    fragment replaced by the anchor; launched at the fragment's step, applied ``overlap`` steps later."""

    def __init__(
        self, fragments: int, overlap: int, mixing: float, lr: float = 0.7, momentum: float = 0.9
    ) -> None:
        self.model = _model()
        self.inner = _inner(self.model)
        self.params = dict(self.model.named_parameters())
        self.anchors = {name: p.detach().clone() for name, p in self.params.items()}
        self.buffers: dict[str, torch.Tensor] = {}
        self.names, self.overlap, self.lr, self.momentum = FRAGMENT_NAMES[fragments], overlap, lr, momentum
        self.mixing = mixing
        self.pending: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}

    def step(self, t: int) -> None:
        _backward(self.model, t)
        self.inner.step()
        self.inner.zero_grad()
        for f in [f for f, (launched, _) in self.pending.items() if launched + self.overlap <= t]:
            self._outer(self.pending.pop(f)[1])
        for f, names in enumerate(self.names):
            if (t + f * H // len(self.names)) % H == 0:
                flat = torch.cat([(self.anchors[n] - self.params[n].detach()).reshape(-1) for n in names])
                flat = flat / dist.get_world_size()
                dist.all_reduce(flat)
                mean = dict(zip(names, flat.split([self.params[n].numel() for n in names]), strict=True))
                self.pending[f] = (t, {n: g.view_as(self.params[n]) for n, g in mean.items()})
                if self.overlap == 0:
                    self._outer(self.pending.pop(f)[1])

    def finish(self) -> None:
        for f in list(self.pending):
            self._outer(self.pending.pop(f)[1])

    def _outer(self, mean: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, grad in mean.items():
                if name not in self.buffers:
                    self.buffers[name] = grad.clone()
                else:
                    self.buffers[name].mul_(self.momentum).add_(grad)
                self.anchors[name].add_(grad.add(self.buffers[name], alpha=self.momentum), alpha=-self.lr)
                self.params[name].lerp_(self.anchors[name], 1 - self.mixing)  # mixing 0: the anchor, exactly


def _against_reference(fragments: int, overlap: int, mixing: float) -> dict[str, Any]:
    """DiLoCo and the reference side by side; per step whether they agree to the bit, whether a fragment
    synced at that step and whether the replicas were identical after it."""
    model = _model()
    options = dict(sync_every=H, fragments=fragments, overlap=overlap, mixing=mixing, anchor_device="cpu")
    options.update(outer_lr=0.7, outer_momentum=0.9)  # the paper's Nesterov, as the reference computes
    diloco = DiLoCo(model, _inner(model), **options)
    reference = _Reference(fragments, overlap, mixing)
    out: dict[str, Any] = {"equal": [], "synced": [], "replicas_same": [], "may_differ": []}
    out["fragments"] = [list(f.names) for f in diloco.fragments]
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
    fragments: int, overlap: int, compressor: str | None, via_checkpoint: bool, build: Any = _model
) -> dict[str, Any]:
    """Train STEPS steps straight, and again stopping after step 6 (mid-interval, an exchange in flight with
    ``overlap``) to resume from a ``weights_only`` state in a fresh model, inner optimizer and DiLoCo (through
    ``save_checkpoint``/``load_checkpoint`` with ``via_checkpoint``)."""
    options = dict(sync_every=H, fragments=fragments, overlap=overlap, compressor=compressor)
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


def _peak_exchange_bytes(fragments: int, compressor: str | None) -> list[int]:
    """Bytes handed to collectives by each outer exchange over two rounds of syncs, on the square model."""
    model = _square_model()
    diloco = DiLoCo(model, _inner(model), sync_every=H, fragments=fragments, compressor=compressor)
    sent = []
    for t in range(1, 2 * H + 1):
        before = diloco.comm_stats().total.steps
        inputs = torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * dist.get_rank() + t))
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
    for fragments, overlap, mixing in [(1, 0, 0.0), (2, 0, 0.0), (2, 1, 0.0), (1, 2, 0.5)]:
        out[f"reference-{fragments}-{overlap}-{mixing}"] = _against_reference(fragments, overlap, mixing)
    for fragments, overlap, compressor in [(1, 0, None), (2, 1, None), (2, 0, "topk:ratio=0.25,min_numel=0")]:
        out[f"resume-{fragments}-{overlap}-{compressor}"] = _resume(
            fragments, overlap, compressor, compressor is not None
        )
    out["resume-bn"] = _resume(2, 1, None, True, _batch_norm_model)
    for fragments, overlap in [(1, 0), (2, 1)]:
        out[f"buffers-{fragments}-{overlap}"] = _buffers_at_syncs(fragments, overlap)
    out["peak"] = {
        (f, c): _peak_exchange_bytes(f, c)
        for f in (1, 2, 4)
        for c in (None, "fp16_compress", "qsgd:bucket_size=64")
    }
    out["bytes"] = {name: _bytes_per_sync(name) for name in (None, "fp16_compress")}
    out["disagree"] = _disagreeing()
    out["shared_pair"] = _shared_stateful_pair()
    return out


@pytest.fixture(
    scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=lambda n: f"{n}ranks"
)
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_on_ranks(scenarios, request.param, timeout=150, collective_timeout=30)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["1-0-0.0", "2-0-0.0", "2-1-0.0", "1-2-0.5"])
def test_outer_update_equals_plain_reference_to_the_bit(ranks: list[dict[str, Any]], case: str) -> None:
    fragments, overlap = map(int, case.split("-")[:2])
    for rank in ranks:
        run = rank[f"reference-{case}"]
        assert run["fragments"] == FRAGMENT_NAMES[fragments]
        assert all(run["equal"]), run["equal"]
        finished = 1 if case == "1-2-0.5" else 0  # launched at step 12, due at 14
        assert run["finished"] == (finished, True), run["finished"]
        synced_at = [t for t, synced in enumerate(run["synced"], start=1) if synced]
        launched = [
            t for t in range(1, STEPS + 1) for f in range(fragments) if (t + f * H // fragments) % H == 0
        ]
        assert synced_at == sorted(t + overlap for t in launched if t + overlap <= STEPS), synced_at


@pytest.mark.timeout(200)
def test_replicas_identical_right_after_each_sync_and_differ_between(ranks: list[dict[str, Any]]) -> None:
    run = ranks[0]["reference-1-0-0.0"]
    for t, (synced, same, may_differ) in enumerate(
        zip(run["synced"], run["replicas_same"], run["may_differ"], strict=True), 1
    ):
        assert same == synced, f"step {t}: synced {synced}, replicas identical {same}"
        assert may_differ == (not synced), f"step {t}"
    # with fragments, right after a sync only the synced fragment agrees; the model as a whole differs
    assert not any(ranks[0]["reference-2-0-0.0"]["replicas_same"][H:])
    # mixed with the local values (Streaming DiLoCo's alpha), the replicas never agree again
    mixed = ranks[0]["reference-1-2-0.5"]
    assert any(mixed["synced"]) and not any(mixed["replicas_same"]) and all(mixed["may_differ"])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["1-0-None", "2-1-None", "2-0-topk:ratio=0.25,min_numel=0"])
def test_resume_equals_the_uninterrupted_run(ranks: list[dict[str, Any]], case: str) -> None:
    for rank in ranks:
        run = rank[f"resume-{case}"]
        assert run["moved"] and run["equal"], run
        assert run["synced_steps"][0] == run["synced_steps"][1] > 0


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
