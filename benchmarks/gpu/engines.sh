#!/usr/bin/env bash
# vLLM and SGLang themselves load and serve our exports (driver: benchmarks/gpu/engines.py).
#
# Here, once:  bash tools/gpu/stage.sh pack          (wheels, vLLM 0.24.0 in 4 parts, SmolLM2 GGUF parts)
#              bash tools/gpu/stage.sh pack-sglang   (SGLang 0.5.17's 44.7 MiB bundle, cut to ride along)
#              bash tools/gpu/stage.sh stage-jit X.tgz...   (optional: JIT caches an earlier GPU run sent
#                                                          back, $OUT/jit-*.tgz; used only if the stamp matches)
# Then eight back-to-back device calls (each within the 30 s the machine stays warm). `tools/gpu/stage.sh plan` prints
# each call's carry list and size, all under the 64 MiB a call carries; as re-packed on 2026-12-06 (vLLM's zip
# in 56 MiB parts by `tools/gpu/stage.sh resplit-vllm`, then `pack-sglang` with SGLANG_MARGIN_KIB=1536: 5.5 MiB of working
# tree in every call, 1.5 MiB kept for its growth; re-run both when `plan` says TOO BIG):
#   1 carry [.whl, .vllm/deps, .vllm/vllm.manifest, .gpu/assets, .gpu/smollm2.gguf.parts.json,
#            .sglang/sglang.manifest.json, .sglang/sglang.tar.part-00]            62.5 MiB
#                                                 bash benchmarks/gpu/engines.sh preflight  (installs both
#                                                 stacks' wheels and imports every vLLM dependency)   ~0.5 min
#   2 carry [.gpu/smollm2.gguf.part-aa, .sglang/sglang.tar.part-01]               62.5 MiB
#                                                 bash benchmarks/gpu/engines.sh stash                 seconds
#   3 carry [.gpu/smollm2.gguf.part-ab, .vllm/vllm.zip.part-ad, .sglang/sglang.tar.part-02]
#                                                 bash benchmarks/gpu/engines.sh students   (~3 min: PTQ + QAD
#                                                 students of 4 formats, QAD runs in parallel, the tiny MoE student, 6 exports)
#   4 carry [.vllm/vllm.zip.part-aa, .sglang/sglang.tar.part-03]                  62.5 MiB
#                                                 bash benchmarks/gpu/engines.sh stash                 seconds
#   5 carry [.vllm/vllm.zip.part-ab, .sglang/sglang.tar.part-04]                  62.5 MiB
#                                                 bash benchmarks/gpu/engines.sh stash                 seconds
#   6 carry [.sglang/sglang.tar.part-06, .sglang/jit]                             40.7 MiB
#                                                 bash benchmarks/gpu/engines.sh stash                 seconds
#   7 carry [.vllm/vllm.zip.part-ac, .sglang/sglang.tar.part-05]                  62.5 MiB
#                                                 bash benchmarks/gpu/engines.sh vllm       (~8 min: install vLLM,
#                                                 one vllm.LLM per export + bf16, then the report; SGLang's
#                                                 parts are all there now, so in the background it is installed,
#                                                 the carried JIT caches whose stamp matches this machine are put
#                                                 in place, and the JIT modules of its Llama path are built:
#                                                 FlashInfer's norm, SGLang's Marlin, activation, RoPE, KV store,
#                                                 positions; seconds per module in $WORK/sglang-warm.json)
#   8 carry []                                     5.5 MiB
#                                                 bash benchmarks/gpu/engines.sh sglang     (~3-5 min: waits for
#                                                 that warm-up, one sglang.Engine for bf16 and one per SGLang cell,
#                                                 then the report with both engines)
# Once the vLLM cells are measured (they were on 2026-12-01), call 7 may run `engines.sh kv` instead of `vllm`
# (the FP8-attention check of the KV cache; it installs vLLM and starts SGLang's warm-up the same way; ~6 min on
# 2026-12-03, ~2 min more since each backend is also served with a bf16 cache as the control), and call 3
# `engines.sh students --cells nvfp4-w4a4-modelopt,llama768-nvfp4-w4a4-modelopt` builds only SGLang's cells
# (~1.5 min instead of ~3: SmolLM2's, which SGLang's Hopper Marlin cannot run, and the random Llama-768 that it
# can). The stash calls 4-5 have room for a job of their own (2026-12-03: step.sh in call 4, 254 s; Scale-QLoRA
# in call 5, `methods.sh run`, 251 s), the machine stays warm while one runs.
# About 20-22 GPU-machine minutes in all, machine starts included (calls 1-7 ~15.5 min; call 8 ~5 min). Measured
# 2026-12-06 on an H100, with `kv` in call 7, `students --cells llama768-nvfp4-w4a4-modelopt` in call 3 and
# `sglang --sglang-cells llama768-nvfp4-w4a4-modelopt` in call 8: 832 s of machine time for all eight (wall:
# preflight 20 s, students 70 s, a pytest in call 4 40 s, kv 446 s, sglang 193 s; no JIT cache carried then).
# If call 8 stops at its limit (an unexpectedly long JIT build), call it again: models already done are kept,
# the JIT caches in /tmp/qf-tvmffi and /tmp/qf-flashinfer too. Results: $OUT/engines.md, engines.json (+ each
# model's vllm.json / sglang.json and logs under $WORK, $OUT/sglang_logs.tgz), and the built JIT modules with
# the stamp of what built them ($OUT/jit-tvmffi.tgz, $OUT/jit-flashinfer.tgz: stage them here with
# `tools/gpu/stage.sh stage-jit` for the next GPU run). `bash benchmarks/gpu/engines.sh report` re-makes the report
# from $WORK alone.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
WORK=${WORK:-/tmp/qf-engines}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_CUDA_ARCH_LIST=9.0
# the package is not pip-installed there: exporters/ importable as qatfactory.exporters (device-local link)
bash tools/gpu/stage.sh link
OURS="/tmp/site:$PWD"
# SGLang's JIT kernels: one cache each for the background warm-up and the runs, SGLang's own (tvm-ffi + nvcc)
# and FlashInfer's (its norm module; FlashInfer puts it in $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer)
export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/qf-tvmffi}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/qf-flashinfer}

sglang_env() {    # FlashInfer's extra nvcc/ld flags where this CUDA lacks cuBLAS/cuRAND headers or libcuda.so
    local lines
    lines=$(python3 benchmarks/gpu/sglang_jit.py cuda-env 2>&1) || { echo "sglang_jit cuda-env: $lines" >&2; return 0; }
    echo "$lines" | grep '^#' || true
    eval "$(echo "$lines" | grep '^export ')"
}

sglang_warm() {   # install SGLang, its carried JIT caches, and build its JIT kernels in the background, once
    [ -f /tmp/qf-parts/sglang.manifest.json ] || return 0
    [ -f "$WORK/sglang-warm.pid" ] && return 0
    python3 tools/gpu/carry_plan.py ready --parts /tmp/qf-parts >/dev/null 2>&1 || return 0
    sglang_env
    # from a copy: the next call replaces this working tree while the warm-up still runs
    # (the same layout below /tmp/qf-sgwarm: tools/gpu/stage.sh and sglang_jit.py find carry_plan.py from the root)
    rm -rf /tmp/qf-sgwarm && mkdir -p /tmp/qf-sgwarm/benchmarks/gpu /tmp/qf-sgwarm/tools/gpu
    cp tools/gpu/{stage.sh,carry_plan.py} /tmp/qf-sgwarm/tools/gpu/
    cp benchmarks/gpu/{engines.py,engines_sglang.py,sglang_jit.py} /tmp/qf-sgwarm/benchmarks/gpu/
    setsid bash -c "bash /tmp/qf-sgwarm/tools/gpu/stage.sh install-sglang && \
        PYTHONPATH=/tmp/sgsite timeout 1500 python3 /tmp/qf-sgwarm/benchmarks/gpu/engines.py sglang-warm --work '$WORK' \
        --jit-dir /tmp/qf-parts/jit" > "$WORK/sglang-warm.log" 2>&1 < /dev/null &
    echo $! > "$WORK/sglang-warm.pid"
    echo "SGLang install + JIT warm-up started in the background (pid $!, log $WORK/sglang-warm.log)"
}
cmd=${1:-all}; shift || true

bash tools/gpu/stage.sh stash >/dev/null
case $cmd in
    stash) ls /tmp/qf-parts ;;
    preflight)   # first call: our stack and vLLM's deps installed and imported while the rest is carried
        [ -d /tmp/site/deepspeed ] || bash tools/gpu/stage.sh install-ours
        bash tools/gpu/stage.sh install-vllm-deps ;;
    students)
        [ -d /tmp/site/deepspeed ] || bash tools/gpu/stage.sh install-ours
        PATH=/tmp/site/bin:$PATH PYTHONPATH=$OURS python3 benchmarks/gpu/engines.py students --work "$WORK" "$@" \
            2>&1 | tee "$OUT/engines_students.log" ;;
    vllm)
        [ -d /tmp/vsite/vllm ] || bash tools/gpu/stage.sh install-vllm || exit 2
        [ -n "${NO_SGLANG_WARM:-}" ] || sglang_warm
        # the vLLM phase stops in time for the report to fit the 600 s a device call may run
        PYTHONPATH=/tmp/vsite timeout -k 10 "${T_VLLM:-450}" python3 benchmarks/gpu/engines.py vllm --work "$WORK" "$@" \
            2>&1 | tee "$OUT/engines_vllm.log"
        PYTHONPATH=$OURS python3 benchmarks/gpu/engines.py report --work "$WORK" --out "$OUT" 2>&1 \
            | tee "$OUT/engines_report.log"
        (cd "$WORK" && tar czf "$OUT/vllm_logs.tgz" */vllm.log */vllm.json qad-*.log 2>/dev/null) ;;
    kv)   # the KV cache's FP8-attention check in place of the vLLM cells (once they are measured): vLLM installed and
          # SGLang's warm-up started as in `vllm`, then benchmarks/kv_cache.py trains the 2K fp8 arm with the fa3
          # emulation and vLLM serves its export with FLASH_ATTN and TRITON_ATTN (~5 min); all of it in $OUT/kv.tgz
        [ -d /tmp/vsite/vllm ] || bash tools/gpu/stage.sh install-vllm || exit 2
        [ -n "${NO_SGLANG_WARM:-}" ] || sglang_warm
        rm -rf /tmp/qf-kv-out
        PATH=/tmp/site/bin:$PATH PYTHONPATH=$OURS:/tmp/vsite timeout -k 10 "${T_KV:-480}" python3 benchmarks/kv_cache.py \
            --out /tmp/qf-kv-out --work /tmp/qf-kv --vllm-site /tmp/vsite ${KV_ARGS:---seqs 2048 --kv fp8_e4m3 --steps 30} "$@" \
            2>&1 | tee "$OUT/kv.log"
        [ -d /tmp/qf-kv-out ] && tar czf "$OUT/kv.tgz" -C /tmp/qf-kv-out . ;;
    sglang)
        # the background install (call 6) may still be running: wait for its marker, else install here
        warm_alive() { pid=$(cat "$WORK/sglang-warm.pid" 2>/dev/null) && kill -0 "$pid" 2>/dev/null; }
        for _ in $(seq 1 150); do
            [ -f /tmp/sgsite/.qf-installed ] && break
            warm_alive || break
            sleep 2
        done
        if [ ! -f /tmp/sgsite/.qf-installed ]; then
            warm_alive && { echo "the background SGLang install is still running after 300 s: see $WORK/sglang-warm.log" >&2; exit 2; }
            bash tools/gpu/stage.sh install-sglang || exit 2
        fi
        sglang_env
        PYTHONPATH=/tmp/sgsite timeout -k 10 "${T_SGLANG:-450}" python3 benchmarks/gpu/engines.py sglang --work "$WORK" "$@" \
            2>&1 | tee "$OUT/engines_sglang.log"
        PYTHONPATH=$OURS python3 benchmarks/gpu/engines.py report --work "$WORK" --out "$OUT" 2>&1 \
            | tee "$OUT/engines_report.log"
        (cd "$WORK" && tar czf "$OUT/sglang_logs.tgz" */sglang.log */sglang.json sglang-warm.* 2>/dev/null)
        # the built JIT modules (.so files + the stamp of what built them) come back, to be carried by a later GPU run
        # (here: bash tools/gpu/stage.sh stage-jit jit-tvmffi.tgz jit-flashinfer.tgz)
        for kind in tvmffi flashinfer; do
            PYTHONPATH=/tmp/sgsite python3 benchmarks/gpu/sglang_jit.py pack --kind $kind --out "/tmp/jit-$kind.tgz" \
                && [ "$(stat -c %s "/tmp/jit-$kind.tgz")" -lt $((15 * 1024 * 1024)) ] && cp "/tmp/jit-$kind.tgz" "$OUT/"
        done ;;
    report)
        PYTHONPATH=$OURS python3 benchmarks/gpu/engines.py report --work "$WORK" --out "$OUT" "$@" ;;
    *) echo "usage: $0 stash|preflight|students|vllm|kv|sglang|report" >&2; exit 2 ;;
esac
