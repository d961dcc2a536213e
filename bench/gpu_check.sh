#!/usr/bin/env bash
# The CUDA checks, as one script for a machine with GPUs (run from the repository root):
#
#   bash bench/gpu_check.sh            # every step, each bounded in time; prints one summary at the end
#
# 1. the conformance suite on the simulator with CUDA tensors (python -m conformance --device cuda)
# 2. the differential suite (simulator vs gloo processes) with CUDA tensors
# 3. the simulator on CUDA: a small all_reduce at W=4 and a 16 MiB all_reduce at W=8, timed side by side
#    with the same collectives on CPU tensors
# 4. nccl: the conformance suite on real nccl processes, one GPU per rank, at W = 1..min(#GPUs, 4)
#
# Each step has its own time limit (STEP_TIMEOUT seconds, default 150) so the whole script ends within
# about 10 minutes; a step that fails or runs out of time is reported and the others still run.
# Exit status: 0 when every step passed (or was skipped for a stated reason), else 1.
set -u
cd "$(dirname "$0")/.."
STEP_TIMEOUT="${STEP_TIMEOUT:-150}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if ! python -c "import torch, tensorplay, hypothesis, pytest" >/dev/null 2>&1; then
    # the machine's own torch (a CUDA build) is kept; only the project and its test extras are added
    pip install -q -e ".[test]" >/dev/null 2>&1 || pip install -q -e ".[test]"
fi

ngpu=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
summary=()
status=0
log_dir=$(mktemp -d)

step() {  # step NAME COMMAND...
    local name=$1; shift
    local t0=$(date +%s)
    timeout "$STEP_TIMEOUT" "$@" >"$log_dir/$name.log" 2>&1
    local rc=$? dt=$(( $(date +%s) - t0 ))
    local tail_line
    tail_line=$(grep -E "passed|failed|cases|error|Error|ratio|us|GiB" "$log_dir/$name.log" | tail -3 | tr '\n' ' ')
    if [ $rc -eq 0 ]; then
        summary+=("PASS  $name (${dt}s): $tail_line")
    elif [ $rc -eq 124 ]; then
        summary+=("TIME  $name (over ${STEP_TIMEOUT}s): $tail_line"); status=1
    else
        summary+=("FAIL  $name (rc=$rc, ${dt}s): $tail_line"); status=1
    fi
    echo "----- $name (rc=$rc, ${dt}s) -----"; tail -20 "$log_dir/$name.log"
}

echo "GPUs: $ngpu; $(python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)')"
if [ "$ngpu" -lt 1 ]; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check"
    exit 0
fi

step conformance-sim-cuda python -m conformance --device cuda --world-sizes 1,2,4 --examples 3 --quiet
step differential-cuda env TENSORPLAY_DIFF_DEVICE=cuda python -m pytest tests/differential -q -x -p no:cacheprovider \
    -m "not slow" -k "c10d or p2p or functional or runtime"
step sim-bench-cuda python - <<'EOF'
import statistics, time
import torch
import simulator
import tensorplay.distributed as dist

def timed(device, w, numel, reps):
    def body():
        x = torch.ones(numel, device=device)
        dist.all_reduce(x)  # warm-up
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        if device != "cpu":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps
    return max(simulator.run(body, w, device=device if device == "cpu" else "cuda"))

for w, numel, reps in ((4, 1000, 300), (8, 4 << 20, 5)):
    cpu = timed("cpu", w, numel, reps)
    gpu = timed("cuda", w, numel, reps)
    print(f"sim all_reduce W={w} {numel * 4 / 2**20:.3f} MiB: cpu {cpu * 1e6:.0f} us, cuda {gpu * 1e6:.0f} us, "
          f"ratio cuda/cpu {gpu / cpu:.2f}")
EOF
if python -c "import torch.distributed as d; raise SystemExit(0 if d.is_nccl_available() else 1)"; then
    ws=$(python -c "print(','.join(str(w) for w in range(1, min($ngpu, 4) + 1)))")
    step conformance-nccl python -m conformance --backend nccl --device cuda --world-sizes "$ws" --examples 3 --quiet
else
    summary+=("SKIP  conformance-nccl: torch.distributed.is_nccl_available() is False")
fi

echo
echo "===== gpu_check summary ($ngpu GPUs, logs in $log_dir) ====="
for line in "${summary[@]}"; do echo "$line"; done
exit $status
