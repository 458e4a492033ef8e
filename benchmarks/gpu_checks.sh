#!/usr/bin/env bash
# The CUDA path of every hook, on a machine with one GPU (CI has none; nothing else needs one).
#
#   bash benchmarks/gpu_checks.sh OUTPUT_DIR [STEP ...]     (default: every step; PYTHON=python3)
#
# 1. tests/engine/test_ddp_vs_torch.py and tests/hooks/test_properties.py on CUDA tensors: 2 and 3 gloo ranks (gloo's
#    CUDA path, every rank on the one GPU; with tests/checkpoint/test_hook_state_resume.py, 2 ranks), then a one-rank NCCL
#    group (NCCL needs a GPU per rank).
# 2. benchmarks/bench_compression.py, compute ms per hook on a one-rank NCCL group with the workload on the
#    GPU, then the same on this machine's CPU (gloo) in the same run, for the ratio beside it; hook-only
#    ms on the GPU, and torch.profiler's top operators of the slowest compression hooks there.
# 3. `gradcomm bench` as a user starts it on a GPU machine: under torchrun (NCCL, LOCAL_RANK's GPU), one rank.
# 4. Segmented buckets (issue 36): aten calls per hook call on CUDA (benchmarks/bench_codecs.py --count: the
#    transformer, the CNN, buckets of 28 and 800 tensors; target at most 80 beyond allreduce's, the same at 28
#    and 800), and gradcomm's DDP step against torch's on the GPU (no
#    hook; bench_ddp.py's mlp and narrow (1,602 tensors) shapes, one NCCL rank, alternating, synchronized).
# 5. fuse_cuda: the compression hooks' compile=True (torch.compile of the encoding and decoding, issue 36)
#    against their eager form, the hook alone on the transformer's gradients as one bucket, one NCCL rank,
#    alternating (bench_compression.py --fuse): medians and quartiles, compile seconds, graphs and breaks,
#    aten operators and kernel launches per call. GPU_CHECKS_CPU=1 runs it on the CPU over gloo instead
#    (a dry run of its command line; inductor's C++ compiles slowly there: give it a longer limit).
# 6. gloo's CUDA path under load: benchmarks/gloo_cuda_stress.py, 3 ranks on the one GPU, small buckets, results
#    compared between ranks (the replicas that once disagreed there), eager and synchronized.
# Each step's output is in OUTPUT_DIR/<step>.log; a failing step does not stop the later ones, and the
# script's exit status is the number of failed steps. Steps: tests_cuda_gloo tests_cuda_nccl bench_cuda_nccl
# bench_cpu_gloo bench_hook_only_cuda bench_cli_torchrun_cuda profile_hook_only_cuda count_calls_cuda
# ddp_step_cuda fuse_cuda gloo_cuda_stress.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_checks.sh OUTPUT_DIR [STEP ...]}
shift
wanted=" ${*:-count_calls_cuda ddp_step_cuda fuse_cuda tests_cuda_gloo tests_cuda_nccl bench_cuda_nccl bench_cpu_gloo bench_hook_only_cuda bench_cli_torchrun_cuda gloo_cuda_stress profile_hook_only_cuda} "
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
# A lent GPU machine brings its own CUDA build of torch (2.11 so far), which gradcomm does not support: the
# checks run on it anyway, and each log names the torch that ran it.
export GRADCOMM_SKIP_TORCH_VERSION_CHECK=${GRADCOMM_SKIP_TORCH_VERSION_CHECK:-1}
failed=0

step() {  # step NAME SECONDS COMMAND...: run with a hard limit, log, count a failure
    local name=$1 seconds=$2
    shift 2
    [[ $wanted == *" $name "* ]] || return 0
    echo "== $name: $*"
    if ! timeout "$seconds" "$@" >"$out/$name.log" 2>&1; then
        failed=$((failed + 1))
        echo "   FAILED (exit status in the log's tail)"
    fi
    tail -n 4 "$out/$name.log"
}

fuse_device=(--device cuda --backend nccl)
if [[ ${GPU_CHECKS_CPU:-0} == 1 ]]; then  # the fuse step's dry run on a machine without a GPU
    fuse_device=(--device cpu --backend gloo)
    "$python" -c "import torch; print('torch', torch.__version__, 'on the CPU')" || exit 1
else
    "$python" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1
fi
step count_calls_cuda 150 "$python" benchmarks/bench_codecs.py --count --device cuda --backend nccl \
    --workloads transformer cnn --tensors 28 800
cat >"$out/ddp_step_cuda.py" <<'PY'
"""gradcomm's DDP step against torch's on one GPU (one NCCL rank, no hook), bench_ddp.py's shapes."""
import copy, statistics, sys, time
import torch, torch.distributed as dist
from torch import nn
sys.path.insert(0, "benchmarks")
import gradcomm
from bench_ddp import SHAPES
dist.init_process_group("nccl")
torch.cuda.set_device(0)
device = torch.device("cuda", 0)
for shape in ("mlp", "narrow"):
    build, width, depth = SHAPES[shape]
    module = build(width, depth).to(device)
    kinds = {
        "torch": nn.parallel.DistributedDataParallel(copy.deepcopy(module), device_ids=[0]),
        "gradcomm": gradcomm.DistributedDataParallel(copy.deepcopy(module)),
    }
    optimizers = {name: torch.optim.SGD(ddp.parameters(), lr=1e-3) for name, ddp in kinds.items()}
    x, y = torch.randn(32, width, device=device), torch.randint(0, 10, (32,), device=device)
    def step(name):
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizers[name].zero_grad()
        nn.functional.cross_entropy(kinds[name](x), y).backward()
        optimizers[name].step()
        torch.cuda.synchronize()
        return time.perf_counter() - start
    for name in kinds:
        for _ in range(5):
            step(name)
    medians = {name: [] for name in kinds}
    for rep in range(5):
        times = {name: [] for name in kinds}
        for _ in range(30):
            for name in (list(kinds) if rep % 2 == 0 else list(reversed(kinds))):
                times[name].append(step(name))
        for name in kinds:
            medians[name].append(statistics.median(times[name]))
    ratio = statistics.median(a / b for a, b in zip(medians["gradcomm"], medians["torch"]))
    print(f"{shape} ({len(list(module.parameters()))} tensors): step ms torch "
          f"{1e3 * statistics.median(medians['torch']):.2f}, gradcomm {1e3 * statistics.median(medians['gradcomm']):.2f}, "
          f"ratio {ratio:.2f} (medians of 5 repetitions of 30 steps)")
dist.destroy_process_group()
PY
step ddp_step_cuda 150 "$python" -m torch.distributed.run --standalone --nproc-per-node 1 "$out/ddp_step_cuda.py"
step fuse_cuda "${FUSE_SECONDS:-150}" "$python" benchmarks/bench_compression.py --fuse --workloads transformer \
    --hooks signsgd qsgd onebit topk --reps 9 "${fuse_device[@]}"
pytest=("$python" -m pytest -q -p no:cacheprovider --timeout 300 tests/engine/test_ddp_vs_torch.py tests/hooks/test_properties.py)
GRADCOMM_TEST_DEVICE=cuda step tests_cuda_gloo 300 "${pytest[@]}" tests/checkpoint/test_hook_state_resume.py
GRADCOMM_TEST_DEVICE=cuda GRADCOMM_TEST_BACKEND=nccl GRADCOMM_TEST_WORLD_SIZES=1 \
    step tests_cuda_nccl 120 "${pytest[@]}"

hooks=(
    allreduce fp16_compress bf16_compress quantize_per_tensor quantize_per_channel
    powersgd:start_powerSGD_iter=2 batched_powersgd:start_powerSGD_iter=2 allgather noop hierarchical
    bytegrad dgc efsign onebit qsgd randomk signsgd terngrad topk
)
bench=("$python" benchmarks/bench_compression.py --hooks "${hooks[@]}" --reps 5)
step bench_cuda_nccl 200 "${bench[@]}" --device cuda --backend nccl
step bench_cpu_gloo 300 "${bench[@]}"
step bench_hook_only_cuda 120 "${bench[@]}" --device cuda --backend nccl --hook-only
cli=(
    "$python" -m torch.distributed.run --standalone --nproc-per-node 1 -m gradcomm bench --steps 30 --warmup 5
    --hooks allreduce fp16_compress powersgd signsgd topk --output "$out/bench_cli"
)
step bench_cli_torchrun_cuda 200 "${cli[@]}"
step gloo_cuda_stress 150 "$python" benchmarks/gloo_cuda_stress.py --world-size 3 --iterations 300 --timeout 140
step profile_hook_only_cuda 120 "$python" benchmarks/bench_compression.py --workloads transformer --device cuda \
    --backend nccl --hook-only --reps 1 --hooks allreduce --profile 15 --profile-hooks onebit bytegrad efsign topk
exit "$failed"
