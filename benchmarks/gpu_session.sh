#!/usr/bin/env bash
# One GPU session of the torch engine, in one go (about 5-8 minutes on an H100/H200):
# the GPU tests, then the engine benchmark on a Llama-3.2-1B-shaped random model, then, while
# time is left, end to end through the coordinator, the engine without its fast paths, and a
# Llama-3.1-8B shape. ROUTING_POLICY picks the coordinator's policy for the two-engine run. Every step has its own time limit; a failed step is
# recorded and the next one still runs. Results go to $OUT (default ./gpu-results).
#
# On a machine that reaches the package registries, once:   bash ../shared/gpu/prepare.sh
# On the GPU machine, from the project root:                 bash .gpu/run.sh bash benchmarks/gpu_session.sh
# (docs/performance.md, "GPU session", says what each file holds.)
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-450}  # stop starting optional steps past this many seconds
SECONDS=0
summary="$OUT/summary.txt"
: > "$summary"

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log, note the outcome
  local name=$1 limit=$2
  shift 2
  local started=$SECONDS
  echo "=== $name (limit ${limit}s, at ${started}s)" | tee -a "$summary"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "    rc=$rc after $((SECONDS - started))s" | tee -a "$summary"
  tail -n 40 "$OUT/$name.log"
}

{
  nvidia-smi
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  python3 -c "import triton; print('triton', triton.__version__)" || echo "triton: not importable"
  python3 -c "import transformers; print('transformers', transformers.__version__)"
  command -v gcc cc || echo "no C compiler on PATH: Triton and torch.compile need one"
  nproc
  free -g
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

# The CUDA tests: fast paths, transformers on the GPU, suspend, the paged kernel on the device.
step gpu-tests 240 python3 -m pytest -p no:cacheprovider -q -rs \
  tests/torch/test_torch_gpu.py tests/torch/test_torch_gpu_fast_paths.py tests/torch/test_torch_kernels.py

# The rows on the 1B shape: batch 1 and 256 concurrent, transformers at batch 1 and as a
# static batch of 256, the bandwidth floor, the shared-prefix workload with the cache on and off.
step bench-llama-1b 300 python3 benchmarks/engine_throughput.py --device cuda --shape llama-1b --full \
  --concurrency 1 256 --prompt-len 128 --max-tokens 128 --baseline-requests 2 --repeats 2 \
  --prefix-requests 256 --prefix-tokens 1024 --own-tokens 32

# End to end through nats-server, a coordinator and engine processes: 256 streams against the
# engine in process, then the shared-prefix workload through one engine and through two.
if (( SECONDS < BUDGET_S - 180 )); then
  step e2e-llama-1b 240 python3 benchmarks/engine_e2e.py --device cuda --shape llama-1b --requests 256 \
    --prompt-len 128 --max-tokens 128 --prefix-tokens 1024 --own-tokens 32 --kv-cache-gb 16 \
    --routing-policy "${ROUTING_POLICY:-least_loaded}"
fi

# The same engine with CUDA graphs and torch.compile off: what the fast paths are worth.
if (( SECONDS < BUDGET_S - 120 )); then
  step bench-llama-1b-eager 150 python3 benchmarks/engine_throughput.py --device cuda --shape llama-1b \
    --concurrency 1 256 --prompt-len 128 --max-tokens 128 --baseline-requests 1 --repeats 1 \
    --no-cuda-graphs --no-torch-compile
fi

if (( SECONDS < BUDGET_S - 150 )); then
  step bench-llama-8b $((BUDGET_S - SECONDS)) python3 benchmarks/engine_throughput.py --device cuda --shape llama-8b \
    --concurrency 1 64 --prompt-len 128 --max-tokens 128 --baseline-requests 1 --repeats 1
fi

echo "=== done in ${SECONDS}s" | tee -a "$summary"
