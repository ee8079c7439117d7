#!/usr/bin/env bash
# vLLM itself loads and serves our exports (driver: benchmarks/gpu/engines.py; issue 16).
#
# Here, once:  bash benchmarks/gpu/stage.sh pack      (wheels, vLLM 0.24.0 in 3 parts, SmolLM2 GGUF parts)
# Then six back-to-back device calls (each within the 30 s the machine stays warm; `stage.sh plan` prints
# the sizes, all under the 64 MiB a call carries):
#   1 carry [.whl, .vllm/deps, .vllm/vllm.manifest, .gpu/assets, .gpu/smollm2.gguf.parts.json]
#                                                 bash benchmarks/gpu/engines.sh preflight  (installs both
#                                                 stacks' wheels and imports every vLLM dependency)
#   2 carry [.gpu/smollm2.gguf.part-aa]           bash benchmarks/gpu/engines.sh stash
#   3 carry [.gpu/smollm2.gguf.part-ab]           bash benchmarks/gpu/engines.sh students   (~3 min: PTQ + QAD
#                                                 students of 4 formats, QAD runs in parallel, the tiny MoE student, 6 exports)
#   4 carry [.vllm/vllm.zip.part-aa]              bash benchmarks/gpu/engines.sh stash
#   5 carry [.vllm/vllm.zip.part-ab]              bash benchmarks/gpu/engines.sh stash
#   6 carry [.vllm/vllm.zip.part-ac]              bash benchmarks/gpu/engines.sh vllm       (~8 min: install vLLM,
#                                                 one vllm.LLM per export + bf16, then the report)
# Results: $OUT/engines.md, engines.json (+ each model's vllm.json / vllm.log under $WORK).
# `bash benchmarks/gpu/engines.sh report` re-makes the report from $WORK alone.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
WORK=${WORK:-/tmp/qf-engines}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_CUDA_ARCH_LIST=9.0
# the package is not pip-installed there: exporters/ importable as qatfactory.exporters (device-local link)
[ -e qatfactory/exporters ] || ln -s ../exporters qatfactory/exporters
OURS="/tmp/site:$PWD"
cmd=${1:-all}; shift || true

bash benchmarks/gpu/stage.sh stash >/dev/null
case $cmd in
    stash) ls /tmp/qf-parts ;;
    preflight)   # first call: our stack and vLLM's deps installed and imported while the rest is carried
        [ -d /tmp/site/deepspeed ] || bash benchmarks/gpu/stage.sh install-ours
        bash benchmarks/gpu/stage.sh install-vllm-deps ;;
    students)
        [ -d /tmp/site/deepspeed ] || bash benchmarks/gpu/stage.sh install-ours
        PATH=/tmp/site/bin:$PATH PYTHONPATH=$OURS python3 benchmarks/gpu/engines.py students --work "$WORK" "$@" \
            2>&1 | tee "$OUT/engines_students.log" ;;
    vllm)
        [ -d /tmp/vsite/vllm ] || bash benchmarks/gpu/stage.sh install-vllm || exit 2
        # the vLLM phase stops in time for the report to fit the 600 s a device call may run
        PYTHONPATH=/tmp/vsite timeout -k 10 "${T_VLLM:-450}" python3 benchmarks/gpu/engines.py vllm --work "$WORK" "$@" \
            2>&1 | tee "$OUT/engines_vllm.log"
        PYTHONPATH=$OURS python3 benchmarks/gpu/engines.py report --work "$WORK" --out "$OUT" 2>&1 \
            | tee "$OUT/engines_report.log"
        (cd "$WORK" && tar czf "$OUT/vllm_logs.tgz" */vllm.log */vllm.json qad-*.log 2>/dev/null) ;;
    report)
        PYTHONPATH=$OURS python3 benchmarks/gpu/engines.py report --work "$WORK" --out "$OUT" "$@" ;;
    *) echo "usage: $0 stash|students|vllm|report" >&2; exit 2 ;;
esac
