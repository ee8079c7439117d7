#!/usr/bin/env bash
# Strong and weak scaling of live-teacher QAD (NVFP4 W4A16) on 2, 4 and 8 H200s under ZeRO-3 and ZeRO-2,
# an 8B Llama shape and a Qwen3-MoE shape, with the ZeRO-3 gather profile: one job per device
# call, each job a few `deepspeed --num_gpus N -m qatfactory.train` launches of benchmarks/gpu/scaling.py.
#
# Here, once: bash tools/gpu/stage.sh pack                    (our stack as wheels in .whl)
# Device calls (kind nvidia-h200-x8; on -x2 / -x4 set WORLDS="2" / "2 4"), carry [".whl"]:
#   bash benchmarks/gpu/scaling.sh llama8b-z3-strong     # N = 2 4 8 (1 does not fit: 8B x ~20 bytes/param)
#   bash benchmarks/gpu/scaling.sh llama8b-z3-weak
#   bash benchmarks/gpu/scaling.sh llama8b-z2-strong     # ZeRO-2 where it fits (params + teacher replicated)
#   bash benchmarks/gpu/scaling.sh llama8b-z3-profile    # torch.profiler: all-gather ms per step at N = 2 8
#   bash benchmarks/gpu/scaling.sh qwen3moe-z3           # Qwen3-30B-A3B's layer shape, MOE_LAYERS layers (24),
#                                                        # strong N = 4 8 and the profile at 8
#   bash benchmarks/gpu/scaling.sh llama8b-sp-32k        # Ulysses sequence parallelism: one 32K-token sequence
#                                                        # spread over all N = 2 4 8 GPUs (train.sequence_parallel=N)
#   bash benchmarks/gpu/scaling.sh llama1b-sp-128k       # the same for a 1B shape at 128K tokens per sequence
#   bash benchmarks/gpu/scaling.sh long-1gpu-llama1b     # one GPU (-x1 kinds too), SEQS="8192 32768 131072": live
#   bash benchmarks/gpu/scaling.sh long-1gpu-llama8b     # top-4096 QAD and a plain bf16 SFT step at each length
#                                                        # (step time, peak memory, or the out-of-memory)
# then here: python benchmarks/gpu/scaling.py report <the calls' scaling/ folders> >> benchmarks/RESULTS.md
# Results: $OUT/scaling/scaling.jsonl (one record per launch), *.log, *.profile.json, tables.md.
# Here, on CPU (gloo), a tiny shape of both models, so the script cannot rot (tests/benchmarks/test_bench_scaling.py):
#   LOCAL=1 bash benchmarks/gpu/scaling.sh smoke
# Knobs: WORLDS, SEQ (4096), GLOBAL (16 sequences per step, strong), GAS (2 per GPU, weak), STEPS (6),
# WARMUP (2), MOE_LAYERS (24; 48 is the real model), T_LAUNCH (seconds per launch, 270), PY.
# A launch of the 8B shape is expected to take 2-4 minutes (start-up, FusedAdam's JIT build on the first one,
# 6 steps, two 1-sample evaluations): give a 10-minute device call two GPU counts at most (WORLDS="2 4", then
# WORLDS=8); every finished launch is in scaling.jsonl even when a later one runs out of time.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
WORK=${WORK:-/tmp/qf-scaling}
PY=${PY:-python3}
mkdir -p "$OUT/scaling" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_CUDA_ARCH_LIST=9.0
if [ -z "${LOCAL:-}" ]; then
    # the GPU machine: our stack from the carried wheels, exporters/ importable as qatfactory.exporters
    bash tools/gpu/stage.sh link
    [ -d /tmp/site/deepspeed ] || bash tools/gpu/stage.sh install-ours
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
    nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/scaling/env.txt" 2>&1
fi
job=${1:-}
SEQ=${SEQ:-4096} GLOBAL=${GLOBAL:-16} GAS=${GAS:-2} STEPS=${STEPS:-6} WARMUP=${WARMUP:-2}
T=${T_LAUNCH:-270}
common=(--seq "$SEQ" --global-batch "$GLOBAL" --gas "$GAS" --steps "$STEPS" --warmup "$WARMUP" --timeout "$T"
        --out "$OUT/scaling" --work "$WORK")
sc() { $PY benchmarks/gpu/scaling.py run "$@"; }
case $job in
    llama8b-z3-strong)  sc --model llama8b --zero 3 --worlds ${WORLDS:-2 4 8} --modes strong "${common[@]}" ;;
    llama8b-z3-weak)    sc --model llama8b --zero 3 --worlds ${WORLDS:-2 4 8} --modes weak "${common[@]}" ;;
    llama8b-z2-strong)  sc --model llama8b --zero 2 --worlds ${WORLDS:-2 4 8} --modes strong "${common[@]}" ;;
    llama8b-z2-weak)    sc --model llama8b --zero 2 --worlds ${WORLDS:-2 4 8} --modes weak "${common[@]}" ;;
    llama8b-z3-profile) sc --model llama8b --zero 3 --worlds ${WORLDS:-2 8} --modes strong --profile only "${common[@]}" ;;
    qwen3moe-z3)
        sc --model qwen3moe --moe-layers "${MOE_LAYERS:-24}" --zero 3 --worlds ${WORLDS:-4 8} --modes strong "${common[@]}"
        sc --model qwen3moe --moe-layers "${MOE_LAYERS:-24}" --zero 3 --worlds 8 --modes strong --profile only "${common[@]}" ;;
    llama8b-sp-32k)     # one sequence per step in flight, spread over every GPU; GLOBAL sequences per step
        sc --model llama8b --zero 3 --worlds ${WORLDS:-2 4 8} --sp all --modes strong --seq "${SP_SEQ:-32768}" \
           --global-batch "${SP_GLOBAL:-2}" --gas 1 --steps "${SP_STEPS:-4}" --warmup 1 --timeout "$T" \
           --out "$OUT/scaling" --work "$WORK" ;;
    llama1b-sp-128k)
        sc --model llama1b --zero 3 --worlds ${WORLDS:-2 4 8} --sp all --modes strong --seq "${SP_SEQ:-131072}" \
           --global-batch "${SP_GLOBAL:-1}" --gas 1 --steps "${SP_STEPS:-4}" --warmup 1 --timeout "$T" \
           --out "$OUT/scaling" --work "$WORK" ;;
    long-1gpu-llama1b|long-1gpu-llama8b)
        m=${job#long-1gpu-}
        for seq in ${SEQS:-8192 32768 131072}; do
            one=(--model "$m" --zero 2 --worlds 1 --modes strong --seq "$seq" --global-batch 1 --gas 1
                 --steps "${SP_STEPS:-4}" --warmup 1 --timeout "$T" --out "$OUT/scaling" --work "$WORK")
            sc "${one[@]}" --label qad-top4096 --set method.loss.kind=topk_kl --set method.loss.top_k=4096
            sc "${one[@]}" --label sft-bf16 --method qat --format bf16
        done ;;
    smoke)      # CPU gloo, fp32, 32-token sequences: both architectures, ZeRO-2 and -3, 1 and 2 ranks, the profile,
                # and one sequence over 2 ranks (Ulysses sequence parallelism)
        tiny=(--cpu --seq 32 --global-batch 2 --gas 1 --steps 3 --warmup 1 --timeout "$T" --out "$OUT/scaling" --work "$WORK")
        sc --model tiny --zero 2 --worlds 1 --modes strong "${tiny[@]}"
        sc --model tiny_moe --zero 3 --worlds 2 --modes strong --profile only "${tiny[@]}"
        sc --model tiny --zero 3 --worlds 2 --sp all --modes strong "${tiny[@]}" ;;
    *) echo "usage: $0 llama8b-z3-strong|llama8b-z3-weak|llama8b-z2-strong|llama8b-z2-weak|llama8b-z3-profile|qwen3moe-z3|llama8b-sp-32k|llama1b-sp-128k|long-1gpu-llama1b|long-1gpu-llama8b|smoke" >&2
       exit 2 ;;
esac
rc=$?
$PY benchmarks/gpu/scaling.py report "$OUT/scaling" | tee "$OUT/scaling/tables.md"
exit $rc
