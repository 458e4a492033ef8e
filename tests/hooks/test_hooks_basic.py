"""The stateless hooks (default, debugging, all-gather, quantization) registered on a real DDP, 2 and 3 ranks.

One spawned group per world size trains the same small MLP for a few SGD steps once per hook and DDP kind,
records every bucket each hook receives and returns, measures errors against the exact mean of the ranks'
buckets, and reports them; the tests below, parametrized over the DDP kind, assert on those measurements.
Both kinds share a group because spawning one costs more than everything it then runs; torch's DDP runs
first, and a failure under one kind is reported by that kind's tests only. The quantization hooks' in-place
mean is checked in the same groups, before the DDPs.

Error bounds, per element of a bucket, with ``W`` ranks, local buckets ``g_r`` and ``m = mean_r |g_r|``:

* float hooks (allreduce, all-gather, fp16/bf16 compression and wrappers): every rank's term is rounded at
  most twice (the scaling by ``1/W`` and the cast) and each of the ``W - 1`` partial sums once, each rounding
  relative to at most ``m``, so ``|out - exact| <= (W + 1) u m`` to first order, with ``u`` the unit
  roundoff of the communicated dtype (2**-24, 2**-11, 2**-8). We allow ``(W + 2) u m`` for second-order
  terms, plus ``W`` subnormal spacings for values that underflow (fp16's subnormals are 2**-24 apart).
* quantization: half a quantization step, see :func:`_quantization_bound`.
"""

import copy
import functools
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks as torch_debugging
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default

from gradcomm import comm
from gradcomm.hooks import allgather_hooks, debugging_hooks, default_hooks, quantization_hooks
from gradcomm.hooks.grad_bucket import GradBucket
from gradcomm.testing import run_on_ranks
from tests.support.models import mlp
from tests.support.ranks import DDP_KINDS, make_ddp
from tests.support.training import random_batch

STEPS = 3
BUCKET_CAP_MB = 0.004  # about 1000 float32: after DDP's first-iteration rebuild the MLP spans several buckets
WORLD_SIZES = (2, 3)
QUANT_LEVELS = 255
# torch's quantization hooks fail on gloo in torch 2.13 (their callbacks index the all-gather future's value
# as if it were nested once more), so ours are compared with torch's quantization ops instead.
TORCH_QUANTIZATION_OPS = "torch.quantize_per_tensor / torch.quantize_per_channel"


@dataclass(frozen=True)
class Case:
    """A hook to register, how close to the exact mean its result must be, and its torch counterpart."""

    hook: Callable[..., Any] | None
    bound: str  # "float32", "float16", "bfloat16", "quantization" or "local"
    state: str = "default"  # "default" (None), "world" (dist.group.WORLD) or "group" (a new group of all ranks)
    channel: int | None = None  # quantization channel length, None for one scale per bucket
    counterpart: str | None = None  # the torch hook's case (or TORCH_QUANTIZATION_OPS) giving the same result
    gradcomm: bool = True  # a gradcomm hook (torch's own are registered only to compare against)
    torch_ddp_only: bool = False  # its result has another dtype than the bucket, which only torch's DDP accepts


CASES: dict[str, Case] = {
    "no hook": Case(None, "float32"),
    "allreduce": Case(default_hooks.allreduce_hook, "float32", counterpart="torch allreduce"),
    "allreduce (new group)": Case(default_hooks.allreduce_hook, "float32", state="group"),
    "fp16": Case(default_hooks.fp16_compress_hook, "float16", state="world", counterpart="torch fp16"),
    "bf16": Case(default_hooks.bf16_compress_hook, "bfloat16", counterpart="torch bf16"),
    "fp16 wrapper": Case(
        default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook), "float16", counterpart="torch fp16 wrapper"
    ),
    "bf16 wrapper": Case(
        default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook),
        "bfloat16",
        state="group",
        counterpart="torch bf16 wrapper",
    ),
    "noop": Case(debugging_hooks.noop_hook, "local", counterpart="torch noop"),
    "allgather": Case(allgather_hooks.allgather_then_aggregate_hook, "float32", state="group"),
    "quantization per tensor": Case(
        quantization_hooks.quantization_pertensor_hook, "quantization", counterpart=TORCH_QUANTIZATION_OPS
    ),
    "quantization per channel": Case(
        quantization_hooks.quantization_perchannel_hook,
        "quantization",
        channel=512,
        counterpart=TORCH_QUANTIZATION_OPS,
    ),
    "quantization per channel of 128": Case(
        functools.partial(quantization_hooks.quantization_perchannel_hook, bucket_size=128),
        "quantization",
        state="group",
        channel=128,
    ),
    "torch allreduce": Case(torch_default.allreduce_hook, "float32", gradcomm=False),
    "torch fp16": Case(torch_default.fp16_compress_hook, "float16", gradcomm=False),
    "torch bf16": Case(torch_default.bf16_compress_hook, "bfloat16", gradcomm=False),
    "torch fp16 wrapper": Case(
        torch_default.fp16_compress_wrapper(torch_default.allreduce_hook), "float16", gradcomm=False, torch_ddp_only=True
    ),
    "torch bf16 wrapper": Case(
        torch_default.bf16_compress_wrapper(torch_default.allreduce_hook),
        "bfloat16",
        gradcomm=False,
        torch_ddp_only=True,
    ),
    "torch noop": Case(torch_debugging.noop_hook, "local", gradcomm=False),
}
OURS = [name for name, case in CASES.items() if case.gradcomm and case.hook is not None]
ALLREDUCE_LIKE = ["allreduce", "allreduce (new group)"]
COMPRESSED = ["fp16", "bf16", "fp16 wrapper", "bf16 wrapper"]
QUANTIZED = ["quantization per tensor", "quantization per channel", "quantization per channel of 128"]


# ---------------------------------------------------------------------------------------------------------
# On every rank
# ---------------------------------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    return mlp(16, 64, 32, 4)  # 3300


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@dataclass
class Run:
    grads: list[torch.Tensor] = field(default_factory=list)  # per step, after backward, parameter order
    local_grads: list[torch.Tensor] = field(default_factory=list)  # the same step without DDP
    params: list[torch.Tensor] = field(default_factory=list)  # per step, after the optimizer step
    buckets: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = field(default_factory=list)  # (index, in, out)
    traffic: int = 0  # bytes the hook handed to gradcomm.comm collectives


def _recording(hook: Callable[..., Any], log: list) -> Callable[..., Any]:
    """``hook``, logging each bucket's index, local input and result (the recorder is transparent)."""

    def recorded_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        index, local = bucket.index(), bucket.buffer().clone()

        def record(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            log.append((index, local, fut.value().clone()))
            return fut.value()

        return hook(state, bucket).then(record)

    return recorded_hook


def _train(kind: str, case: Case, states: dict[str, Any], record: bool = True) -> Run:
    model = _mlp()
    reference = _mlp()
    ddp = make_ddp(kind, model, bucket_cap_mb=BUCKET_CAP_MB)
    log: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    if case.hook is not None:
        ddp.register_comm_hook(states[case.state], _recording(case.hook, log) if record else case.hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    run = Run()
    comm.traffic.reset()
    for step in range(STEPS):
        x, y = random_batch(1000 * dist.get_rank() + step, 8, 16, 4)
        reference.load_state_dict(copy.deepcopy(model.state_dict()))
        reference.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        run.local_grads.append(_flat(p.grad for p in reference.parameters()))

        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        run.grads.append(_flat(p.grad for p in model.parameters()))
        optimizer.step()
        run.params.append(_flat(model.parameters()))
        run.buckets.append(sorted(log, key=lambda entry: entry[0]))
        log.clear()
    run.traffic = comm.traffic.total_bytes
    return run


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` from every rank, stacked (rank-major)."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return torch.stack(gathered)


def _quantization_bound(local: torch.Tensor, channel: int | None) -> torch.Tensor:
    """Per element, how far the mean of the ranks' quantized buckets may be from the exact mean.

    ``local`` is (ranks, n). A rank quantizes each bucket (or channel) with step
    ``scale = (max(max(x), 0) - min(min(x), 0)) / 255``: its levels are ``scale`` apart and cover all of its
    values, so rounding to the nearest level moves each value by at most ``scale / 2`` (at the ends of the
    range too: a value that the rounded zero point pushes past level 0 or 255 is clamped to the level it is
    nearest), and the mean of the ranks' values by at most the mean of their ``scale / 2``: half a step,
    tighter than the one step asked for. The extra ``2**-10`` of a step covers float32 rounding (of the scale, of ``x / scale``
    next to a midpoint, of the mean over ranks), all below ``1e-4`` of a step for 255 levels and 3 ranks.
    """
    ranks, n = local.shape
    length = n if channel is None else channel
    padded = nn.functional.pad(local, (0, -n % length)).view(ranks, -1, length)
    span = padded.amax(dim=2).clamp(min=0) - padded.amin(dim=2).clamp(max=0)
    scale = (span / QUANT_LEVELS).clamp(min=torch.finfo(torch.float32).eps)
    return (0.5 + 2**-10) * scale.mean(dim=0).repeat_interleave(length)[:n]


def _error_bound(case: Case, local: torch.Tensor) -> torch.Tensor:
    """Per element, how far the hook's result may be from the exact mean of ``local`` (ranks, n)."""
    ranks = local.shape[0]
    if case.bound == "quantization":
        return _quantization_bound(local, case.channel)
    info = torch.finfo(getattr(torch, case.bound))
    unit_roundoff, subnormal_spacing = info.eps / 2, info.tiny * info.eps
    return (ranks + 2) * unit_roundoff * local.abs().mean(dim=0) + ranks * subnormal_spacing


def _bucket_errors(case: Case, run: Run) -> dict[str, Any]:
    """Compare every recorded bucket result with the exact mean of the ranks' inputs."""
    worst_ratio, worst_error, dtype_ok = 0.0, 0.0, True
    for buckets in run.buckets:
        for _, local, out in buckets:
            dtype_ok &= out.dtype == local.dtype and out.shape == local.shape
            if case.bound == "local":
                worst_ratio = max(worst_ratio, 0.0 if torch.equal(out, local) else float("inf"))
                continue
            inputs = _gather(local).double()
            error = (out.double() - inputs.mean(dim=0)).abs()
            worst_ratio = max(worst_ratio, (error / _error_bound(case, inputs)).max().item())
            worst_error = max(worst_error, error.max().item())
    return {"bound_ratio": worst_ratio, "max_error": worst_error, "result_dtype_ok": dtype_ok}


def _torch_quantized_mean(local: torch.Tensor, channel: int | None) -> torch.Tensor:
    """The mean of the ranks' buckets (``local``: ranks x n) each quantized and dequantized by torch's ops,
    with qparams from torch's min/max observers (quint8, affine: the defaults torch's hooks use)."""
    n = local.shape[1]
    dequantized = []
    for x in local.float():
        if channel is None:
            observer = MinMaxObserver()
            observer(x)
            scale, zero_point = observer.calculate_qparams()
            quantized = torch.quantize_per_tensor(x, scale.item(), int(zero_point.item()), torch.quint8)
        else:
            x = nn.functional.pad(x, (0, -n % channel)).view(-1, channel)
            observer = PerChannelMinMaxObserver()
            observer(x)
            scale, zero_point = observer.calculate_qparams()
            quantized = torch.quantize_per_channel(x, scale, zero_point, axis=0, dtype=torch.quint8)
        dequantized.append(quantized.dequantize().reshape(-1)[:n])
    return torch.stack(dequantized).mean(dim=0)


def _counterpart_ratio(case: Case, run: Run, runs: dict[str, Run]) -> float:
    """Distance between our and torch's results on the first step's buckets (identical inputs), relative to
    twice the error bound (each result is within one bound of the exact mean); bitwise for the noop hook."""
    if case.counterpart == TORCH_QUANTIZATION_OPS:
        reference = [
            (local, _torch_quantized_mean(_gather(local), case.channel)) for _, local, _ in run.buckets[0]
        ]
    else:
        reference = [(local, out) for _, local, out in runs[case.counterpart].buckets[0]]
    worst = 0.0
    for (_, local, ours), (torch_local, theirs) in zip(run.buckets[0], reference, strict=True):
        assert torch.equal(local, torch_local), "first-step inputs differ: the runs are not comparable"
        if case.bound == "local":
            worst = max(worst, 0.0 if torch.equal(ours, theirs) else float("inf"))
            continue
        difference = (ours.double() - theirs.double()).abs()
        worst = max(worst, (difference / (2 * _error_bound(case, _gather(local).double()))).max().item())
    return worst


def _all_ranks_equal(tensor: torch.Tensor) -> bool:
    gathered = _gather(tensor)
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def _check_all_hooks(kind: str) -> dict[str, dict[str, Any]]:
    """Train under every case; return, per case, the measurements the tests assert on."""
    states = {"default": None, "world": dist.group.WORLD, "group": dist.new_group(list(range(dist.get_world_size())))}
    cases = {name: case for name, case in CASES.items() if kind == "torch" or not case.torch_ddp_only}
    runs = {name: _train(kind, case, states) for name, case in cases.items()}
    bare = {  # the hooks registered directly, without the recorder (torch's DDP checks hook names)
        name: _train(kind, CASES[name], states, record=False) for name in ("bf16", "bf16 wrapper", "noop")
    }
    baseline = runs["no hook"]
    report: dict[str, dict[str, Any]] = {}
    for name, case in cases.items():
        run = runs[name]
        report[name] = {
            **_bucket_errors(case, run),
            "params_identical_across_ranks": all(_all_ranks_equal(p) for p in run.params),
            "grads_equal_baseline": all(torch.equal(g, b) for g, b in zip(run.grads, baseline.grads, strict=True)),
            "grad_diff_baseline": max(
                (g - b).abs().max().item() for g, b in zip(run.grads, baseline.grads, strict=True)
            ),
            "grads_equal_local": all(torch.equal(g, lg) for g, lg in zip(run.grads, run.local_grads, strict=True)),
            "bucket_sizes": [[local.numel() for _, local, _ in buckets] for buckets in run.buckets],
            "traffic": run.traffic,
        }
        if case.counterpart == TORCH_QUANTIZATION_OPS or case.counterpart in runs:
            report[name]["counterpart_ratio"] = _counterpart_ratio(case, run, runs)
        if name in bare:
            report[name]["bare_equals_recorded"] = all(
                torch.equal(g, r) for g, r in zip(bare[name].grads, run.grads, strict=True)
            )
    return report


def _check_all_hooks_per_kind(kinds: tuple[str, ...]) -> dict[str, dict[str, dict[str, Any]] | str]:
    """:func:`_check_all_hooks` for each DDP kind in turn; a kind that raises reports its traceback instead."""
    reports: dict[str, dict[str, dict[str, Any]] | str] = {}
    for kind in kinds:
        try:
            reports[kind] = _check_all_hooks(kind)
        except Exception:
            reports[kind] = f"rank {dist.get_rank()}: {traceback.format_exc()}"
    return reports


# ---------------------------------------------------------------------------------------------------------
# In the test process
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=pytest.mark.slow) if n > 2 else n for n in WORLD_SIZES],
    ids=lambda world_size: f"{world_size}ranks",
)
def reports_per_kind(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    """(world size, per rank: the hooks' measurements per DDP kind (rank 0's are asserted on) and the failures of
    :func:`_quantization_hooks_against_plain_mean`)."""
    world_size = request.param
    return world_size, run_on_ranks(_rank_reports, world_size, args=(DDP_KINDS,), timeout=100)


def _rank_reports(kinds: tuple[str, ...]) -> dict[str, Any]:
    """Everything this module checks on ranks, in the one group per world size."""
    try:
        quantization = _quantization_hooks_against_plain_mean()
    except Exception:
        quantization = [f"rank {dist.get_rank()}: {traceback.format_exc()}"]
    return {"kinds": _check_all_hooks_per_kind(kinds), "quantization": quantization}


@pytest.fixture(params=DDP_KINDS)
def report(request: pytest.FixtureRequest, reports_per_kind) -> tuple[str, dict[str, dict[str, Any]]]:
    """(where, measurements per hook) for one DDP kind and world size."""
    kind = request.param
    world_size, by_rank = reports_per_kind
    reports = by_rank[0]["kinds"]
    where = f"{kind} DDP, {world_size} ranks"
    if isinstance(reports[kind], str):
        pytest.fail(f"{where}: the rank function failed:\n{reports[kind]}", pytrace=False)
    return where, reports[kind]


@pytest.mark.timeout(120)
def test_allreduce_hook_is_bitwise_ddp_without_hook(report):
    where, results = report
    for name in ALLREDUCE_LIKE:
        assert results[name]["grads_equal_baseline"], (
            f"{where}: {name} differs from DDP without a hook by up to {results[name]['grad_diff_baseline']:.3g}"
        )


@pytest.mark.timeout(120)
def test_results_within_error_bound_of_exact_mean(report):
    where, results = report
    for name in ALLREDUCE_LIKE + COMPRESSED + ["allgather"] + QUANTIZED:
        r = results[name]
        assert r["bound_ratio"] <= 1.0, (
            f"{where}: {name} is {r['bound_ratio']:.3g}x its {CASES[name].bound} error bound from the exact mean "
            f"(max abs error {r['max_error']:.3g})"
        )


@pytest.mark.timeout(120)
def test_reference_hooks_meet_the_same_bounds(report):
    """The bounds are not too tight: torch's own hooks meet them as well."""
    where, results = report
    for name, r in results.items():
        if not CASES[name].gradcomm:
            assert r["bound_ratio"] <= 1.0, f"{where}: {name}: {results[name]['bound_ratio']:.3g}"


@pytest.mark.timeout(120)
def test_allgather_equals_allreduce(report):
    where, results = report
    assert results["allgather"]["grad_diff_baseline"] <= 1e-6, (
        f"{where}: allgather gradients differ from allreduce's by {results['allgather']['grad_diff_baseline']:.3g}"
    )


@pytest.mark.timeout(120)
def test_noop_returns_local_gradients(report):
    where, results = report
    for name in ("noop", "torch noop"):
        r = results[name]
        assert r["bound_ratio"] == 0.0, f"{where}: {name} changed a bucket"
        assert r["grads_equal_local"], f"{where}: {name}: DDP gradients are not the local gradients"
        assert not r["params_identical_across_ranks"], f"{where}: {name}: ranks agree, so something communicated"


@pytest.mark.timeout(120)
def test_every_rank_ends_every_step_with_identical_parameters(report):
    where, results = report
    for name, r in results.items():
        if CASES[name].bound != "local":
            assert r["params_identical_across_ranks"], f"{where}: {name}: ranks' parameters diverged"


@pytest.mark.timeout(120)
def test_same_results_as_counterparts(report):
    """On the first step (identical inputs) our hooks and torch's agree to within twice the error bound.

    Each is within one bound of the exact mean. They need not be bitwise equal: ours scale by ``1/W`` where
    torch divides, and our compress hooks scale before the cast where torch's cast first. Our quantization
    hooks are compared with torch's quantization ops (torch's hooks fail on gloo), where a value on a rounding
    midpoint may land one level apart (``scale / W`` in the mean, within the tolerance). The noop hooks must
    agree bitwise. (Measured: the wrappers and the quantization hooks agree bitwise too.)
    """
    where, results = report
    for name, r in results.items():
        if "counterpart_ratio" in r:
            ratio = r["counterpart_ratio"]
            assert ratio <= 1.0, f"{where}: {name} vs {CASES[name].counterpart}: {ratio:.3g}x the tolerance"


@pytest.mark.timeout(120)
def test_results_have_bucket_shape_and_dtype(report):
    where, results = report
    for name in OURS:
        assert results[name]["result_dtype_ok"], f"{where}: {name} returned another shape or dtype than the bucket"


@pytest.mark.timeout(120)
def test_bf16_and_noop_register_without_recorder(report):
    """torch's DDP rejects hooks named ``bf16_compress_hook`` without NCCL; ours are accepted on gloo."""
    where, results = report
    for name in ("bf16", "bf16 wrapper", "noop"):
        assert results[name]["bare_equals_recorded"], f"{where}: {name} registered directly gives other gradients"


@pytest.mark.timeout(120)
def test_traffic(report):
    """Bytes handed to collectives: 16-bit hooks half of allreduce's, quantized ones a byte per element plus
    8 bytes (scale and zero point) per channel, noop none."""
    where, results = report
    bytes_per_bucket: dict[str, Callable[[int], int]] = {
        "allreduce": lambda n: 4 * n,
        "allgather": lambda n: 4 * n,
        **{name: (lambda n: 2 * n) for name in COMPRESSED},
        "noop": lambda n: 0,
        "quantization per tensor": lambda n: n + 8,
        "quantization per channel": lambda n: -(-n // 512) * (512 + 8),
        "quantization per channel of 128": lambda n: -(-n // 128) * (128 + 8),
    }
    for name, nbytes in bytes_per_bucket.items():
        expected = sum(nbytes(n) for step in results[name]["bucket_sizes"] for n in step)
        assert results[name]["traffic"] == expected, f"{where}: {name} sent {results[name]['traffic']}, expected {expected}"


def _quantization_inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    gaussian = torch.randn(6000, generator=generator)
    return [
        gaussian * 1e-3,
        gaussian.abs() + 0.5,  # all positive: the range is stretched down to zero
        -(gaussian.abs() + 0.5),  # all negative
        gaussian * torch.logspace(-6, 0, 6000),  # magnitudes spanning six decades, where channels help
        torch.zeros(1000),
    ]


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor, torch.quantize_per_channel:UserWarning")
@pytest.mark.parametrize("channel", [None, 7, 512], ids=["per-tensor", "channels-of-7", "channels-of-512"])
def test_quantization_matches_torch_quantization_ops(channel):
    """In-process: our scales and zero points are torch's min/max observers' (quint8, affine) exactly; our
    levels are ``torch.quantize_per_tensor`` / ``torch.quantize_per_channel``'s, except that torch's
    vectorized kernel multiplies by ``1 / scale`` where we divide, which may move a value lying on a rounding
    midpoint by one level (rare: we allow 0.1 % of the values); every dequantized value is within half a step.
    """
    for x in _quantization_inputs():
        n = x.numel()
        channels = x.view(1, -1) if channel is None else nn.functional.pad(x, (0, -n % channel)).view(-1, channel)
        scale, zero_point = quantization_hooks._qparams(channels)
        if channel is None:
            observer = MinMaxObserver()
            observer(x)
            torch_scale, torch_zero_point = observer.calculate_qparams()
            torch_levels = torch.quantize_per_tensor(
                x, torch_scale.item(), int(torch_zero_point.item()), torch.quint8
            ).int_repr()
        else:
            observer = PerChannelMinMaxObserver()
            observer(channels)
            torch_scale, torch_zero_point = observer.calculate_qparams()
            torch_levels = torch.quantize_per_channel(
                channels, torch_scale, torch_zero_point, axis=0, dtype=torch.quint8
            ).int_repr()
        assert torch.equal(scale, torch_scale.float().reshape(-1)), "scales differ from torch's observer"
        assert torch.equal(zero_point, torch_zero_point.float().reshape(-1)), "zero points differ"

        levels = quantization_hooks._quantize_(channels.clone(), scale, zero_point)
        level_diff = (levels.int() - torch_levels.reshape(levels.shape).int()).abs()
        assert level_diff.max() <= 1 and (level_diff > 0).float().mean() <= 1e-3, (
            f"{int((level_diff > 0).sum())} of {levels.numel()} levels differ from torch's, by up to {level_diff.max()}"
        )
        error = (quantization_hooks._dequantize(levels, scale, zero_point) - channels).abs()
        assert (error <= (0.5 + 2**-10) * scale[:, None]).all(), "a value moved by more than half a step"


def _plain_quantized_mean(buckets: torch.Tensor, channel: int | None) -> torch.Tensor:
    """The quantization hooks' mean written out plainly (every step a new tensor), from all ranks' buckets
    (ranks x n): what the hooks compute in place must be these floats, bit for bit."""
    ranks, n = buckets.shape
    total = None
    for flat in buckets.to(torch.float32):
        channels = flat.view(1, -1) if channel is None else nn.functional.pad(flat, (0, -n % channel)).view(-1, channel)
        lo, hi = channels.amin(dim=1).clamp(max=0), channels.amax(dim=1).clamp(min=0)
        scale = ((hi - lo) / QUANT_LEVELS).clamp(min=torch.finfo(torch.float32).eps)
        zero_point = (-torch.round(lo / scale)).clamp(0, QUANT_LEVELS)
        levels = (torch.round(channels / scale[:, None]) + zero_point[:, None]).clamp(0, QUANT_LEVELS)
        term = scale[:, None] * (levels.to(torch.uint8).to(torch.float32) - zero_point[:, None])
        total = term if total is None else total + term
    return (total.view(-1)[:n] / ranks).to(buckets.dtype)


QUANTIZATION_SHAPES = [(1, torch.float32), (7, torch.float32), (1024, torch.float32), (1000, torch.float32),
                       (1000, torch.float16), (1024, torch.bfloat16), (777, torch.float64)]


def _quantization_hooks_against_plain_mean() -> list[str]:
    """On every rank: each quantization hook on buckets of :data:`QUANTIZATION_SHAPES` (those that divide into
    channels are quantized in the bucket's own memory); the failures, as messages."""
    failures = []
    hooks = {
        "per tensor": (quantization_hooks.quantization_pertensor_hook, None),
        "per channel": (quantization_hooks.quantization_perchannel_hook, 512),
        "per channel of 7": (functools.partial(quantization_hooks.quantization_perchannel_hook, bucket_size=7), 7),
    }
    generator = torch.Generator().manual_seed(dist.get_rank())
    for n, dtype in QUANTIZATION_SHAPES:
        local = (torch.randn(n, generator=generator) * torch.logspace(-4, 1, n)).to(dtype)
        expected = {channel: _plain_quantized_mean(_gather(local), channel) for _, channel in hooks.values()}
        for name, (hook, channel) in hooks.items():
            buffer = local.clone()
            bucket = GradBucket(0, buffer, [0], [n], [torch.Size([n])], [nn.Parameter(torch.zeros(n))], True)
            result = hook(None, bucket).wait()
            where = f"rank {dist.get_rank()}, {name}, {n} x {dtype}"
            if result.data_ptr() != buffer.data_ptr() or result.dtype != dtype:
                failures.append(f"{where}: the mean is not in the bucket's buffer, in its dtype")
            if not torch.equal(result, expected[channel]):
                worst = (result.double() - expected[channel].double()).abs().max().item()
                failures.append(f"{where}: differs from the plain computation by up to {worst:.3g}")
    return failures


@pytest.mark.timeout(150)
def test_quantization_hooks_compute_the_plain_mean_in_place(reports_per_kind):
    """The quantization hooks quantize in the bucket's memory (where it is float32 and needs no padding) and
    sum into it; the mean must still be the plain computation's, bit for bit, on 2 and 3 ranks, for the dtypes
    and sizes that take each path (one element, channels that divide the bucket or not, 16- and 64-bit
    buckets). Runs in the hooks' groups, before them."""
    _, by_rank = reports_per_kind
    failures = [failure for reports in by_rank for failure in reports["quantization"]]
    assert not failures, "\n".join(failures)
