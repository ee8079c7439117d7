#!/usr/bin/env bash
# The general run on the GPU machine: CUDA tests and benchmarks (repo root, wheels carried in .whl):
#
#   run(command="bash tools/gpu/run.sh", carry=[".whl"], timeout_s=600)
#
# 1. installs the carried wheels (.whl/, git-ignored; see benchmarks/RESULTS.md for the list)
# 2. pytest -m cuda over tests/            -> $OUT/pytest_cuda.log
# 3. benchmarks/kernel_speed.py             -> $OUT/kernels.md, kernels.json, bench_kernels.log
# 4. benchmarks/step.py, benchmarks/export.py when they exist -> $OUT/bench_<name>.log
# 5. stage `pipeline` (not in the default STAGES): benchmarks/gpu/pipeline.sh run, both GPUs, ~6 min
#    -> $OUT/pipeline.json, pipeline.md, pipeline_launches.log, pipeline_curves.png, pipeline.log
#    (carry .gpu/ with the SmolLM2 GGUF parts made by `bash benchmarks/gpu/pipeline.sh pack`)
#
# Knobs (environment): STAGES="tests kernels step export" (default: all four),
# TEST_PATHS (default "tests"), PYTEST_ARGS (extra pytest arguments, e.g. "-k nvfp4 -x"), BENCH_ARGS (for kernel_speed.py,
# e.g. "--quick"), NO_INSTALL=1 (wheels already in /tmp/site, e.g. a second run.sh in parallel), STEP_ARGS (for step.py, e.g. "--variants SFT,W4A16 --op-table W4A16"; the whole step table: benchmarks/gpu/step.sh), T_TESTS / T_BENCH (per-stage timeouts in seconds; the device call itself
# is limited to 600 s, so the defaults leave room for the machine's start), T_PIPE (stage pipeline's timeout,
# default 360; the script's own budget is T_PIPE - 20 so it reports before the kill), PIPE_ARGS (for pipeline.py,
# e.g. "--parts 1 --p1-steps 8 --p1-ckpt 4").
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
STAGES=${STAGES:-"tests kernels step export"}
TEST_PATHS=${TEST_PATHS:-tests}
T_TESTS=${T_TESTS:-240}
T_BENCH=${T_BENCH:-300}
T_PIPE=${T_PIPE:-360}

if [ -z "${NO_INSTALL:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed" | tee "$OUT/env.txt"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
# the package is not pip-installed there: make exporters/ importable as qatfactory.exporters,
# as setup.py's package_dir does on an installed copy (a device-local link, never committed)
bash tools/gpu/stage.sh link
export TORCH_CUDA_ARCH_LIST=9.0          # DeepSpeed builds its ops for the H200 only
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    python3 -c "import cupy; print('cupy', cupy.__version__)" 2>&1
    python3 -c "import triton; print('triton', triton.__version__)" 2>&1
    nvcc --version 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

rc=0
for stage in $STAGES; do
    t0=$(date +%s)
    case $stage in
        tests)
            timeout "$T_TESTS" python3 -m pytest -q -m cuda -p no:cacheprovider $TEST_PATHS ${PYTEST_ARGS:-} \
                2>&1 | tee "$OUT/pytest_cuda.log"
            r=${PIPESTATUS[0]}; [ "$r" -ne 0 ] && rc=$r ;;
        kernels)
            timeout "$T_BENCH" python3 benchmarks/kernel_speed.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_kernels.log" ;;
        step|export)
            if [ -f "benchmarks/$stage.py" ]; then
                args=""; [ "$stage" = step ] && args="--budget $(( T_BENCH - 30 )) ${STEP_ARGS:-}"
                timeout "$T_BENCH" python3 "benchmarks/$stage.py" --out "$OUT" $args 2>&1 | tee "$OUT/bench_$stage.log"
            else
                echo "benchmarks/$stage.py not present: skipped"
            fi ;;
        pipeline)
            timeout -k 15 "$T_PIPE" bash benchmarks/gpu/pipeline.sh run --out "$OUT" --budget $(( T_PIPE - 20 )) \
                ${PIPE_ARGS:-} 2>&1 | tee "$OUT/pipeline.log"
            r=${PIPESTATUS[0]}; [ "$r" -ne 0 ] && rc=$r ;;
        *) echo "unknown stage $stage (allowed: tests kernels step export pipeline)"; rc=2 ;;
    esac
    echo "== stage $stage: $(( $(date +%s) - t0 )) s"
done
exit $rc
