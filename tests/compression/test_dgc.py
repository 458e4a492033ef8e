"""Deep Gradient Compression (``gradcomm.compression.methods.dgc``): the algorithm against a reference written
from the paper, its per-tensor state (keys, masking, checkpoints, the hook's meta probe), its options, and
training on 2 gloo ranks through the hook registry."""

import io
import math
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradcomm
from gradcomm.compression import DGC, NoMemory, ResidualMemory, TopK
from gradcomm.compression.communicators import compensated_compress
from gradcomm.hooks.compression_hook import CompressionState
from gradcomm.hooks.registry import check_options, register_comm_hook_by_name
from gradcomm.testing import run_on_ranks
from tests.support.models import mlp
from tests.support.training import flat_parameters, linear_target_batch


def _gradients(shape: tuple[int, ...], steps: int, seed: int = 0, dtype=torch.float64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=dtype) for _ in range(steps)]


def _sent(compressor: DGC, gradient: torch.Tensor, key=None) -> torch.Tensor:
    """The dense tensor ``compressor`` sends for ``gradient`` (under ``key``'s stream)."""
    with compressor.stream(key):
        payload, ctx = compressor.compress(gradient)
    return compressor.decompress(payload, ctx)


def _reference(gradients: list[torch.Tensor], ratio: float, m: float) -> tuple[list[torch.Tensor], dict]:
    """DGC as written in the paper (Algorithm 1, momentum correction and factor masking), dense and slow."""
    u = torch.zeros_like(gradients[0])
    v = torch.zeros_like(gradients[0])
    sent = []
    for g in gradients:
        u = m * u + g
        v = v + u
        k = max(1, math.ceil(ratio * g.numel()))
        threshold = v.abs().reshape(-1).kthvalue(g.numel() - k + 1).values
        mask = v.abs() >= threshold
        assert int(mask.sum()) == k, "ties: choose other inputs"
        sent.append(torch.where(mask, v, torch.zeros_like(v)))
        v = torch.where(mask, torch.zeros_like(v), v)
        u = torch.where(mask, torch.zeros_like(u), u)
    return sent, {"momentum": u, "accumulation": v}


# -- the algorithm --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1,), (7,), (40, 25), (3, 4, 5)])
@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5, 1.0])
def test_first_step_sends_the_top_k_of_the_gradient(shape, ratio):
    (g,) = _gradients(shape, 1, seed=len(shape))
    dgc_payload, _ = DGC(ratio=ratio).compress(g)
    topk_payload, _ = TopK(ratio=ratio).compress(g)
    for ours, theirs in zip(dgc_payload, topk_payload, strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    assert dgc_payload[0].numel() == max(1, math.ceil(ratio * g.numel()))


def test_hand_computed_example():
    """k = 1 of 2, m = 0.5; every value is exact in binary."""
    compressor = DGC(ratio=0.5, momentum=0.5)
    g = torch.tensor([1.0, 0.5])
    # u = [1, .5], v = [1, .5]: send v[0] = 1; then u = v = [0, .5]
    assert torch.equal(_sent(compressor, g), torch.tensor([1.0, 0.0]))
    # u = [1, .75], v = [1, 1.25]: send v[1] = 1.25; then u = v = [1, 0]
    assert torch.equal(_sent(compressor, g), torch.tensor([0.0, 1.25]))
    assert torch.equal(compressor.state_dict()["momentum"][None], torch.tensor([1.0, 0.0]))
    # u = [.5, 0], v = [1.5, 0]: send v[0] = 1.5
    assert torch.equal(_sent(compressor, torch.zeros(2)), torch.tensor([1.5, 0.0]))


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("shape, ratio", [((50,), 0.1), ((12, 9), 0.05), ((5,), 0.2), ((33,), 1.0)])
def test_momentum_correction_matches_the_reference(shape, ratio, momentum):
    gradients = _gradients(shape, 8, seed=3)
    expected, state = _reference(gradients, ratio, momentum)
    compressor = DGC(ratio=ratio, momentum=momentum)
    for g, want in zip(gradients, expected, strict=True):
        assert torch.equal(_sent(compressor, g, key="w"), want)
    for name, buffer in compressor.state_dict().items():
        assert torch.equal(buffer["w"], state[name]), name


def test_masking_zeroes_momentum_and_accumulation_exactly_at_the_sent_coordinates():
    compressor = DGC(ratio=0.1, momentum=0.9)
    for g in _gradients((200,), 5, seed=4):
        (values, indices), _ = compressor.compress(g)
        sent = torch.zeros(200, dtype=torch.bool)
        sent[indices.long()] = True
        state = compressor.state_dict()
        for name in ("momentum", "accumulation"):
            assert not state[name][None][sent].any(), name
            assert state[name][None][~sent].all(), f"{name} is zero where nothing was sent"
        assert values.abs().min() >= state["accumulation"][None].abs().max()


def test_sent_plus_accumulation_is_the_sum_of_the_momentum_corrected_gradients():
    """v_t = v_{t-1} + u_t - sent_t, with u_t the velocity before masking."""
    m, gradients = 0.9, _gradients((64,), 10, seed=5)
    compressor = DGC(ratio=0.05, momentum=m)
    total_sent, total_velocity = torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    for g in gradients:
        previous = compressor.state_dict()["momentum"].get(None, torch.zeros(64, dtype=torch.float64))
        total_velocity += m * previous + g
        total_sent += _sent(compressor, g)
    accumulation = compressor.state_dict()["accumulation"][None]
    torch.testing.assert_close(total_sent + accumulation, total_velocity, rtol=0, atol=1e-12)


def test_zero_momentum_is_top_k_with_error_feedback():
    dgc, topk, memory = DGC(ratio=0.1, momentum=0.0), TopK(ratio=0.1), ResidualMemory()
    for g in _gradients((30, 4), 6, seed=6, dtype=torch.float32):
        payload, ctx = compensated_compress(topk, memory, "w", g)
        assert torch.equal(_sent(dgc, g, key="w"), topk.decompress(payload, ctx))
        assert torch.equal(dgc.state_dict()["accumulation"]["w"], memory.residuals["w"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(), (1,), (6, 5)])
def test_keeps_shape_and_dtype(dtype, shape):
    compressor = DGC(ratio=0.2)
    for g in _gradients(shape, 3, seed=7, dtype=dtype):
        out = _sent(compressor, g)
        assert out.shape == g.shape and out.dtype == g.dtype and torch.isfinite(out).all()
        assert compressor.state_dict()["momentum"][None].dtype == dtype


def test_aggregate_is_the_mean_of_the_ranks_messages():
    ranks = [DGC(ratio=0.25), DGC(ratio=0.25), DGC(ratio=0.25)]
    gradients = _gradients((16,), 3, seed=8)
    payloads = [compressor.compress(g) for compressor, g in zip(ranks, gradients, strict=True)]
    stacked = [torch.stack(parts) for parts in zip(*(payload for payload, _ in payloads), strict=True)]
    mean = ranks[0].aggregate(stacked, payloads[0][1])
    expected = sum(
        compressor.decompress(*payload) / 3 for compressor, payload in zip(ranks, payloads, strict=True)
    )
    torch.testing.assert_close(mean, expected, rtol=0, atol=1e-15)


# -- state: keys, checkpoints, the meta probe -------------------------------------------------------------------


def test_state_follows_the_key_not_the_call_order():
    """DDP reorders buckets after its first step: a tensor's buffers must follow its parameter's key."""
    tensors = {key: _gradients((40,), 4, seed=10 + key) for key in range(3)}
    forward, backward = DGC(ratio=0.1), DGC(ratio=0.1)
    results = {}
    for step in range(4):
        for key in (0, 1, 2):
            results[step, key] = _sent(forward, tensors[key][step], key)
        for key in (2, 1, 0):
            assert torch.equal(_sent(backward, tensors[key][step], key), results[step, key])
    assert sorted(forward.state_dict()["momentum"]) == [0, 1, 2]


def test_state_dict_round_trip_resumes_bit_for_bit():
    gradients = {key: _gradients((300,), 6, seed=20 + i, dtype=torch.float32) for i, key in enumerate("ab")}
    original = DGC(ratio=0.02, momentum=0.9)
    for step in range(3):
        for key in ("a", "b"):
            _sent(original, gradients[key][step], key)
    saved = original.state_dict()
    snapshot = {name: {key: t.clone() for key, t in buffers.items()} for name, buffers in saved.items()}
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    restored = DGC(ratio=0.02, momentum=0.9)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    unpickled = pickle.loads(pickle.dumps(original))
    for step in range(3, 6):
        for key in ("a", "b"):
            expected = _sent(original, gradients[key][step], key)
            assert torch.equal(_sent(restored, gradients[key][step], key), expected)
            assert torch.equal(_sent(unpickled, gradients[key][step], key), expected)
    for name, buffers in saved.items():  # a state_dict taken earlier is not changed by later steps
        for key, tensor in buffers.items():
            assert torch.equal(tensor, snapshot[name][key])
    for name in ("momentum", "accumulation"):
        for key in ("a", "b"):
            assert torch.equal(restored.state_dict()[name][key], original.state_dict()[name][key])


def test_a_failed_step_drops_the_buffers_rather_than_half_update_them(monkeypatch):
    """The buffers are updated in place: a step failing after the update (here in the selection) forgets them
    (the next step starts afresh, as error feedback does), so a stale half-step is never sent later."""
    from gradcomm.compression.methods import dgc as dgc_module

    compressor = DGC(ratio=0.1, momentum=0.9)
    gradients = _gradients((200,), 2, seed=8)
    _sent(compressor, gradients[0], key="w")

    def failing(*args, **kwargs):
        raise RuntimeError("selection failed")

    monkeypatch.setattr(dgc_module, "segment_topk", failing)
    with pytest.raises(RuntimeError, match="selection failed"):
        _sent(compressor, gradients[1], key="w")
    assert compressor.state_dict() == {"momentum": {}, "accumulation": {}}
    monkeypatch.undo()
    fresh = DGC(ratio=0.1, momentum=0.9)
    assert torch.equal(_sent(compressor, gradients[1], key="w"), _sent(fresh, gradients[1], key="w"))


def test_loading_a_bad_state_is_refused():
    compressor = DGC()
    with pytest.raises(ValueError, match=r"DGC: state must have the entries \['momentum', 'accumulation'\]"):
        compressor.load_state_dict({"draws": {}})
    with pytest.raises(ValueError, match="DGC: state has momentum for keys"):
        compressor.load_state_dict({"momentum": {0: torch.zeros(3)}, "accumulation": {}})
    with pytest.raises(ValueError, match="DGC: the state of 0 must be two tensors of one shape"):
        compressor.load_state_dict({"momentum": {0: torch.zeros(3)}, "accumulation": {0: torch.zeros(4)}})
    compressor.load_state_dict({"momentum": {0: torch.zeros(3)}, "accumulation": {0: torch.zeros(3)}})
    with pytest.raises(
        ValueError, match=r"DGC: the buffers kept for 0 have shape \(3,\), but the tensor now"
    ):
        _sent(compressor, torch.ones(4), key=0)


def test_payload_layout_is_stated_and_the_hook_touches_no_state():
    """The hook learns payload sizes from payload_layout, never by compressing (a meta tensor, as before,
    which DGC had to special-case)."""
    compressor = DGC(ratio=0.05)
    state = CompressionState(compressor, min_numel=16)
    assert state.compresses(torch.randn(40, 50)) and not state.compresses(torch.randn(3))
    assert compressor.state_dict() == {"momentum": {}, "accumulation": {}}
    with compressor.stream(0):
        payload, _ = compressor.compress(torch.randn(20, 30))
    assert compressor.payload_layout((600,), torch.float32) == [(p.numel(), p.dtype) for p in payload]
    assert list(compressor.state_dict()["momentum"]) == [0]


def test_hook_applies_no_second_residual():
    state = CompressionState(DGC())
    assert state.error_feedback is False and isinstance(state.memory, NoMemory)
    with pytest.raises(ValueError, match="DGC does not support error feedback"):
        CompressionState(DGC(), error_feedback=True)
    assert CompressionState(DGC(), error_feedback=False).error_feedback is False


# -- options ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"ratio": 0}, r"DGC: ratio must be a number in \(0, 1\], got 0"),
        ({"ratio": -0.1}, r"DGC: ratio must be a number in \(0, 1\], got -0.1"),
        ({"ratio": 1.5}, r"DGC: ratio must be a number in \(0, 1\], got 1.5"),
        ({"ratio": float("nan")}, r"DGC: ratio must be a number in \(0, 1\], got nan"),
        ({"ratio": "0.1"}, r"DGC: ratio must be a number in \(0, 1\], got '0.1'"),
        ({"momentum": -0.1}, r"DGC: momentum must be a number in \[0, 1\), got -0.1"),
        ({"momentum": 1.0}, r"DGC: momentum must be a number in \[0, 1\), got 1.0"),
        ({"momentum": float("inf")}, r"DGC: momentum must be a number in \[0, 1\), got inf"),
        ({"momentum": True}, r"DGC: momentum must be a number in \[0, 1\), got True"),
    ],
)
def test_bad_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        DGC(**options)


def test_registry_converts_and_checks_options():
    assert DGC(ratio=1, momentum=0).ratio == 1
    check_options("dgc", ratio="0.01", momentum="0.5", min_numel="16")
    with pytest.raises(ValueError, match=r"dgc.*DGC: momentum must be a number in \[0, 1\), got 2.0"):
        check_options("dgc", momentum="2")


# -- on 2 ranks ---------------------------------------------------------------------------------------------------

STEPS, CHECKPOINT_AT = 30, 15


def _model() -> torch.nn.Module:
    return mlp(20, 64, 5, activation=torch.nn.ReLU)


def _held_out_loss(model: torch.nn.Module) -> float:
    x, y = linear_target_batch(torch.Generator().manual_seed(7))
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def _ddp(model: torch.nn.Module) -> tuple[torch.nn.Module, CompressionState, torch.optim.Optimizer]:
    ddp = gradcomm.DistributedDataParallel(model, bucket_cap_mb=0.005)
    state = register_comm_hook_by_name(ddp, "dgc", ratio=0.05, min_numel=16)
    return ddp, state, torch.optim.SGD(model.parameters(), lr=0.05)  # no momentum: DGC has it


def _step(ddp, optimizer, batch) -> None:
    optimizer.zero_grad()
    F.mse_loss(ddp(batch[0]), batch[1]).backward()
    optimizer.step()


def _rank_train_and_resume() -> dict:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    batches = [linear_target_batch(generator) for _ in range(STEPS)]
    model = _model()
    ddp, state, optimizer = _ddp(model)
    held_out = [_held_out_loss(model)]
    saved = io.BytesIO()
    for step, batch in enumerate(batches):
        if step == CHECKPOINT_AT:
            torch.save({"model": model.state_dict(), "hook": state.state_dict()}, saved)
        _step(ddp, optimizer, batch)
        held_out.append(_held_out_loss(model))

    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    resumed = _model()
    resumed.load_state_dict(checkpoint["model"])
    resumed_ddp, resumed_state, resumed_optimizer = _ddp(resumed)
    resumed_state.load_state_dict(checkpoint["hook"])
    for batch in batches[CHECKPOINT_AT:]:
        _step(resumed_ddp, resumed_optimizer, batch)

    flat = flat_parameters(model)
    resumed_flat = flat_parameters(resumed)
    return {
        "params": flat,
        "held_out": held_out,
        "resume_gap": float(np.abs(flat - resumed_flat).max()),
        "state": (type(state).__name__, type(state.compressor).__name__, state.error_feedback),
        "keys": sorted(state.compressor.state_dict()["momentum"]),
    }


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_trains_on_two_ranks_by_name_with_identical_replicas_and_exact_resume():
    ranks = run_on_ranks(_rank_train_and_resume, 2, timeout=120, collective_timeout=30)
    assert np.array_equal(ranks[0]["params"], ranks[1]["params"]), "replicas differ"
    for rank in ranks:
        assert rank["state"] == ("CompressionState", "DGC", False)
        assert len(rank["keys"]) == 3  # the two weights and the 64-element bias; the 5-element bias is dense
        held_out = rank["held_out"]
        assert np.isfinite(held_out).all() and held_out[-1] < 0.5 * held_out[0], held_out
        assert rank["resume_gap"] == 0.0
