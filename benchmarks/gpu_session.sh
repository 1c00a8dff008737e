#!/usr/bin/env bash
# One GPU session of the torch engine on a Llama-3.2-1B-shaped random model, in one run of at
# most 9.5 minutes (BUDGET_S, default 560 s), every row printed as soon as it exists:
#   1. preflight: the engine built once, per-phase load times and the path; the session stops
#      here (after the GPU tests, which say why) unless the fast path is on;
#   2. replay GPU time per bucket (CUDA events) beside the step's wall time at batch 1 and 256;
#   3. 256 concurrent requests (with transformers as the baseline; the same asking for logprobs 5
#      beside them: tokens/s, step and CPU per step with and without), then the shared-prefix rows;
#      then the same 256 requests on a Qwen3-1.7B-shaped model (head norms on q and k) and on
#      Qwen3-30B-A3B's shape cut to 2 of its 48 layers (128 experts, 8 per token, grouped);
#   4. end to end through nats-server, a coordinator and one engine process;
#   5. a GPU test subset (every model family included), each test limited to 60 s.
# Every benchmark runs with --require-fast-path: a fallback stops it instead of giving figures.
# Each step has its own limit, cut to the time left; a failed step is recorded and the next one
# still runs. No 8B checkpoint (16 GB to write): benchmarks/engine_throughput.py --shape llama-8b
# runs it on its own. Results go to $OUT (default ./gpu-results).
#
# On a machine that reaches the package registries, once:   bash ../shared/gpu/prepare.sh
# On the GPU machine, from the project root:                 bash .gpu/run.sh bash benchmarks/gpu_session.sh
# (docs/performance.md, "GPU session", says what each file holds.)
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-560}
SECONDS=0
summary="$OUT/summary.txt"
: > "$summary"
export PYTHONUNBUFFERED=1

step() {  # step NAME LIMIT_S COMMAND...: run within min(LIMIT_S, time left), rows shown live and kept in $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - SECONDS))
  if (( left < 20 )); then
    echo "=== $name skipped: ${left}s left" | tee -a "$summary"
    return 124
  fi
  (( limit > left )) && limit=$left
  local started=$SECONDS
  echo "=== $name (limit ${limit}s, at ${started}s)" | tee -a "$summary"
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v -E "^(WARNING|INFO|DEBUG)|^\s*$"
  local rc=${PIPESTATUS[0]}
  echo "    rc=$rc after $((SECONDS - started))s" | tee -a "$summary"
  return "$rc"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  python3 -c "import triton; print('triton', triton.__version__)" || echo "triton: not importable"
  command -v gcc cc || echo "no C compiler on PATH: Triton and torch.compile need one"
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

gpu_tests() {
  step gpu-tests 150 python3 -m pytest -p no:cacheprovider -q -rs --timeout 60 \
    tests/torch/test_torch_gpu_fast_paths.py tests/torch/test_torch_kernels.py tests/torch/test_torch_gpu.py
}

# 1-2. The engine once: load phases, path, replay GPU time per bucket, step wall at batch 1 and 256.
if ! step preflight 120 python3 benchmarks/gpu_preflight.py --shape llama-1b --max-batch 256 --prompt-len 128; then
  echo "=== preflight failed: no benchmark rows; the GPU tests say why" | tee -a "$summary"
  gpu_tests
  echo "=== done in ${SECONDS}s" | tee -a "$summary"
  exit 1
fi

# 3. 256 concurrent requests against transformers at batch 1 and as a static batch of 256, the
# bandwidth floor, and the logprobs row (the 256 requests asking for logprobs 5: the engine's
# step and CPU per step against without); then the shared 1,024-token prefix with caching on and off.
step bench-256 100 python3 benchmarks/engine_throughput.py --device cuda --shape llama-1b --full --require-fast-path \
  --concurrency 256 --prompt-len 128 --max-tokens 128 --baseline-requests 1 --repeats 1 --no-shared-prefix --logprobs 5
step shared-prefix 70 python3 benchmarks/engine_throughput.py --device cuda --shape llama-1b --require-fast-path \
  --shared-prefix-only --max-tokens 128 --prefix-requests 256 --prefix-tokens 1024 --own-tokens 32

# 3b. The other families beside Llama: Qwen3 (all 28 layers of 1.7B) and Qwen3-MoE (2 layers of
# 30B-A3B, 3.7 GB in bf16), 256 concurrent requests each against transformers at batch 1.
step bench-qwen3 80 python3 benchmarks/engine_throughput.py --device cuda --shape qwen3-1.7b --require-fast-path \
  --concurrency 256 --prompt-len 128 --max-tokens 128 --baseline-requests 1 --repeats 1
step bench-qwen3-moe 80 python3 benchmarks/engine_throughput.py --device cuda --shape qwen3-30b-a3b --layers 2 \
  --require-fast-path --concurrency 256 --prompt-len 128 --max-tokens 128 --baseline-requests 1 --repeats 1

# 4. End to end: 256 streams through nats-server, a coordinator and one engine, against the
# same engine in process.
step e2e-1-engine 100 python3 benchmarks/engine_e2e.py --device cuda --shape llama-1b --requests 256 \
  --prompt-len 128 --max-tokens 128 --kv-cache-gb 16 --require-fast-path --no-shared-prefix

# 5. The GPU tests last: the figures above are what this session is for.
gpu_tests

echo "=== done in ${SECONDS}s" | tee -a "$summary"
