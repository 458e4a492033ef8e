"""Step time and state memory of gradcomm's PowerSGD hooks against torch's, side by side in one run.

Two gloo ranks on this machine, one thread each, a ~4.2M-parameter MLP (four 1024 x 1024 weights). For each
DDP (torch's, gradcomm's) and each variant (PowerSGD rank 1, rank 4, batched PowerSGD rank 1), two copies of
the model train side by side, one with torch's hook and one with ours; steps alternate between them (the
order flips every repetition). Reported: the median step-time ratio ours/torch over the repetitions, the
medians themselves, and the bytes the PowerSGD state holds (error feedback plus P/Q memories).

All parameters are in one bucket (``bucket_cap_mb=100``): with several buckets torch's hooks can deadlock on
gloo (they wait inside gloo callbacks) or pair different collectives across ranks. torch 2.13's
``batched_powerSGD_hook`` fails outright (a 2-D Q reaches an orthogonalizer that asserts a 3-D batch): it runs
here with that check patched to accept one matrix.

    python benchmarks/bench_powersgd.py [--reps 7 --steps 6 --width 1024 --depth 4 --batch 32]
"""

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import gradcomm
from gradcomm.bench.timing import mlp, timed_step
from gradcomm.hooks import powerSGD_hook as ours

VARIANTS: dict[str, tuple[str, int]] = {
    "PowerSGD rank 1": ("powerSGD_hook", 1),
    "PowerSGD rank 4": ("powerSGD_hook", 4),
    "batched PowerSGD rank 1": ("batched_powerSGD_hook", 1),
}
DDPS: dict[str, Callable[..., nn.Module]] = {
    "torch": nn.parallel.DistributedDataParallel,
    "gradcomm": gradcomm.DistributedDataParallel,
}
BUCKET_CAP_MB = 100
START_POWERSGD_ITER = 2
WARMUP_STEPS = 4


def _patch_torch_orthogonalize() -> None:
    original = torch_powersgd._orthogonalize

    def orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
        original(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)

    torch_powersgd._orthogonalize = orthogonalize


def _state_bytes(state: Any) -> int:
    """Bytes of the tensors the state keeps between steps: error feedback and P/Q memories."""
    held = [
        *state.error_dict.values(),
        *state.q_memory_dict.values(),
        *getattr(state, "p_memory_dict", {}).values(),
    ]
    return sum(t.numel() * t.element_size() for t in held)


def _compare(
    ddp_kind: str, variant: str, reps: int, steps: int, width: int, depth: int, batch: int
) -> dict[str, Any]:
    hook_name, rank = VARIANTS[variant]
    contenders = {}
    for name, module in (("torch", torch_powersgd), ("ours", ours)):
        model = mlp(width, depth)
        ddp = DDPS[ddp_kind](model, bucket_cap_mb=BUCKET_CAP_MB)
        state = module.PowerSGDState(
            None, matrix_approximation_rank=rank, start_powerSGD_iter=START_POWERSGD_ITER
        )
        ddp.register_comm_hook(state, getattr(module, hook_name))
        contenders[name] = (ddp, torch.optim.SGD(model.parameters(), lr=1e-3), state)
    generator = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, width, generator=generator), torch.randint(0, 10, (batch,), generator=generator)
    state_bytes = dict.fromkeys(contenders, 0)
    for name, (ddp, optimizer, state) in contenders.items():
        for _ in range(WARMUP_STEPS):
            timed_step(ddp, optimizer, x, y)
            state_bytes[name] = max(state_bytes[name], _state_bytes(state))
    medians: dict[str, list[float]] = {name: [] for name in contenders}
    for rep in range(reps):
        times: dict[str, list[float]] = {name: [] for name in contenders}
        order = list(contenders) if rep % 2 == 0 else list(reversed(contenders))
        for _ in range(steps):
            for name in order:
                ddp, optimizer, state = contenders[name]
                times[name].append(timed_step(ddp, optimizer, x, y))
                state_bytes[name] = max(state_bytes[name], _state_bytes(state))
        for name in contenders:
            medians[name].append(statistics.median(times[name]))
    ratios = [o / t for o, t in zip(medians["ours"], medians["torch"], strict=True)]
    bucket_bytes = sum(p.numel() * p.element_size() for p in contenders["ours"][0].parameters())
    return {"medians": medians, "ratios": ratios, "state_bytes": state_bytes, "bucket_bytes": bucket_bytes}


def peak_rss(hook_impl: str, variant: str, steps: int, width: int, depth: int, batch: int) -> dict[str, int]:
    """Peak resident memory of a fresh rank training with one hook (``"none"``: no hook) on torch's DDP.

    Tensors this large are allocated with mmap and given back when freed, so the high-water mark of the
    process counts the temporaries a hook allocates during a step as well as what its state holds.
    """
    import resource

    _patch_torch_orthogonalize()
    hook_name, rank = VARIANTS[variant]
    model = mlp(width, depth)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    state = None
    if hook_impl != "none":
        module = torch_powersgd if hook_impl == "torch" else ours
        state = module.PowerSGDState(
            None, matrix_approximation_rank=rank, start_powerSGD_iter=START_POWERSGD_ITER
        )
        ddp.register_comm_hook(state, getattr(module, hook_name))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, width, generator=generator), torch.randint(0, 10, (batch,), generator=generator)
    for _ in range(steps):
        timed_step(ddp, optimizer, x, y)
    return {
        "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "held": 0 if state is None else _state_bytes(state),
    }


def measure(reps: int, steps: int, width: int, depth: int, batch: int) -> dict[str, Any]:
    _patch_torch_orthogonalize()
    torch_powersgd.logger.setLevel("WARNING")
    results: dict[str, Any] = {}
    for ddp_kind in DDPS:
        for variant in VARIANTS:
            try:
                results[f"{ddp_kind}|{variant}"] = _compare(
                    ddp_kind, variant, reps, steps, width, depth, batch
                )
            except Exception as exc:  # report the failing combination, measure the others
                results[f"{ddp_kind}|{variant}"] = {"failed": f"{type(exc).__name__}: {exc}"}
    results["params"] = sum(p.numel() for p in mlp(width, depth).parameters())
    return results


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f}"


def main(argv: list[str] | None = None) -> int:
    from gradcomm.testing import run_on_ranks

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    sizes = (args.width, args.depth, args.batch)
    results = run_on_ranks(measure, 2, args=(args.reps, args.steps, *sizes), timeout=3600)[0]
    memory: dict[tuple[str, str], dict[str, int]] = {}
    for variant in VARIANTS:
        for impl in ("none", "torch", "ours"):
            per_rank = run_on_ranks(peak_rss, 2, args=(impl, variant, WARMUP_STEPS + 4, *sizes), timeout=600)
            memory[impl, variant] = max(per_rank, key=lambda m: m["max_rss"])
    print(
        f"command: python benchmarks/bench_powersgd.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()
    )
    print(
        f"model: MLP, {results.pop('params') / 1e6:.2f}M parameters in one bucket; 2 gloo ranks, 1 thread each; "
        f"median of {args.reps} repetitions of {args.steps} alternating steps"
    )
    print()
    print("| DDP | hook | torch step (ms) | ours step (ms) | ratio ours/torch |")
    print("|---|---|---|---|---|")
    for key, result in results.items():
        ddp_kind, variant = key.split("|")
        if "failed" in result:
            print(f"| {ddp_kind} | {variant} | failed: {result['failed']} | | |")
            continue
        medians = result["medians"]
        print(
            f"| {ddp_kind} | {variant} | {1e3 * statistics.median(medians['torch']):.1f} | "
            f"{1e3 * statistics.median(medians['ours']):.1f} | {statistics.median(result['ratios']):.3f} |"
        )
    print()
    print(
        "| hook | state held, torch (MiB) | state held, ours (MiB) | "
        "peak RSS over no hook, torch (MiB) | peak RSS over no hook, ours (MiB) |"
    )
    print("|---|---|---|---|---|")
    for variant in VARIANTS:
        baseline = memory["none", variant]["max_rss"]
        torch_mem, ours_mem = memory["torch", variant], memory["ours", variant]
        print(
            f"| {variant} | {_mb(torch_mem['held'])} | {_mb(ours_mem['held'])} | "
            f"{_mb(torch_mem['max_rss'] - baseline)} | {_mb(ours_mem['max_rss'] - baseline)} |"
        )
    print()
    print(
        "state held: error-feedback buffers + P/Q memories kept between steps (largest over the run); peak RSS: "
        "high-water mark of a fresh rank process (the larger of the two ranks) minus that of the same run "
        "without a hook, so it includes the temporaries each hook allocates within a step."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
