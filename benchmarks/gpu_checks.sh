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
# Each step's output is in OUTPUT_DIR/<step>.log; a failing step does not stop the later ones, and the
# script's exit status is the number of failed steps. Steps: tests_cuda_gloo tests_cuda_nccl bench_cuda_nccl
# bench_cpu_gloo bench_hook_only_cuda bench_cli_torchrun_cuda profile_hook_only_cuda.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_checks.sh OUTPUT_DIR [STEP ...]}
shift
wanted=" ${*:-tests_cuda_gloo tests_cuda_nccl bench_cuda_nccl bench_cpu_gloo bench_hook_only_cuda bench_cli_torchrun_cuda profile_hook_only_cuda} "
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
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

"$python" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1
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
step profile_hook_only_cuda 120 "$python" benchmarks/bench_compression.py --workloads transformer --device cuda \
    --backend nccl --hook-only --reps 1 --hooks allreduce --profile 15 --profile-hooks onebit bytegrad efsign topk
exit "$failed"
