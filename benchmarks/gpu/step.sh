#!/usr/bin/env bash
# The step-time benchmark in one device call: our training step (before / after the step levers) beside the peers
# (plain PyTorch loops, NVIDIA Model Optimizer QAT W4A16 / W4A4 and QAD), interleaved rounds, with a
# GPU-busy-vs-wall profile per variant. About 6 minutes:
#
#   run(command="bash benchmarks/gpu/step.sh", carry=[".whl"], timeout_s=600)
#
# 1. installs our stack from the carried wheels (tools/gpu/stage.sh install-ours -> /tmp/site), unless already there
# 2. builds DeepSpeed's FusedAdam in the background while the GPU checks of the weight cache run:
#    pytest -m cuda tests/nn/test_weight_cache_cuda.py (kept fq(W) == per-forward fq(W), bit for bit, on the
#    kernels with batched fills)                            -> $OUT/step_pytest_cuda.log
# 3. benchmarks/step.py with --before and the peers on the benchmark's Llama shape (hidden 2048, 16 layers,
#    16/8 heads, MLP 5632, vocab 32000, batch 4 x 2048, bf16), rounds until TOTAL seconds from the start
#    are spent                                              -> $OUT/step.md, step.json, step_bench.log,
#                                                              step_worker_{ours,peer}.log
#    Rows (11 ours + 7 peers a round, 2-4 s a job once warm: ~60 s a round): SFT, QAT W4A16, W4A4, live
#    and cached QAD; "[before: stock DeepSpeed step]" of SFT, W4A4 and live QAD (train.lean_step=false
#    train.ds_timers=true: DeepSpeed's per-parameter step, one-rank all-reduce and timer syncs); the
#    DeepSpeed paths "bf16 SFT, ZeRO-1" and "... BF16_Optimizer (fp32 grads, immediate update)"; the memory
#    lever "QAD W4A16 live teacher, lean activations". The weight-cache / fused-loss before rows (measured
#    2026-12-01) are skipped: SKIP='grad ckpt|LoRA' brings them back (4 more jobs).
# The MoE table (Qwen3-MoE-like, 64 experts, top-8; the shape and why: benchmarks/step.py) is a
# second call of its own, about 8 minutes (TOTAL 480 s; one call stays under 600 s):
#
#   run(command="MODEL=moe bash benchmarks/gpu/step.sh", carry=[".whl"], timeout_s=600)
#
# the same steps 1-2, then step.py --model moe: our SFT / QAT W4A16 / W4A4 / live and cached QAD beside the
# plain loops (fp32 masters, bf16 params, and fp32 masters on the eager experts Model Optimizer forces) and
# Model Optimizer's QAT / QAD, without the before rows (BEFORE=1 adds them; fewer rounds then) and without
# the ZeRO-1 / lean-activation rows (SKIP replaces the default; lean activations patch Llama MLPs only). Its jobs
# should take 5-20 s each once warm (2.70B parameters, a few hundred ms per step expected; Model
# Optimizer's eager expert loop the slowest): estimates, not yet measured on a GPU; rounds stop at TOTAL.
# On a CPU, to check the script end to end before a GPU run (measures nothing):
#   DEVICE=cpu TINY=1 bash benchmarks/gpu/step.sh          # MODEL=moe: the CPU-sized MoE (moe_smoke)
# Knobs: MODEL (llama1b | moe), TOTAL (default 345 s, MODEL=moe 480 s: the whole call), STEPS (8), WARMUP (3),
# REPEAT (3), PROFILE_STEPS (2), FORMAT (nvfp4), BEFORE (1 for llama1b, 0 for moe), SKIP (our rows left out;
# default "grad ckpt|LoRA|weight cache off", MODEL=moe adds "ZeRO-1|lean activations"), STEP_EXTRA (more
# step.py arguments, e.g. "--op-table 'QAT W4A16 (CE)'").
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
T0=$(date +%s)
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-llama1b}
case "$MODEL" in
    llama1b) SMOKE=smoke; TOTAL=${TOTAL:-345}; BEFORE=${BEFORE:-1}; SKIP_DEFAULT="grad ckpt|LoRA|weight cache off" ;;
    moe) SMOKE=moe_smoke; TOTAL=${TOTAL:-480}; BEFORE=${BEFORE:-0}; SKIP_DEFAULT="grad ckpt|LoRA|weight cache off|ZeRO-1|lean activations" ;;
    *) echo "MODEL=$MODEL; allowed: llama1b, moe"; exit 2 ;;
esac
[ "$TOTAL" -le 570 ] 2>/dev/null || { echo "TOTAL=$TOTAL; allowed: seconds <= 570 (one device call ends at 600 s)"; exit 2; }
BEFORE_ARG=(); [ "$BEFORE" = 1 ] && BEFORE_ARG=(--before)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
VARIANTS="SFT|QAT W4A16 (CE)|QAT W4A4 (CE)|QAD W4A16 live teacher|cached teacher"
PEERS="plain loop|ModelOpt W4A16 QAT|ModelOpt W4A4 QAT, fp32|ModelOpt QAD"
if [ "$DEVICE" = cuda ]; then
    if [ ! -d /tmp/site/deepspeed ]; then
        bash tools/gpu/stage.sh install-ours > "$OUT/step_install.log" 2>&1 \
            || { echo "install-ours failed:"; tail -20 "$OUT/step_install.log"; exit 1; }
    fi
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/site/bin:$PATH
    export TORCH_CUDA_ARCH_LIST=9.0          # DeepSpeed builds its ops for the H200 only
    bash tools/gpu/stage.sh link
    PY=python3
    ARGS=(--model "$MODEL" --device cuda --seq 2048 --batch 4 --steps "${STEPS:-8}" --warmup "${WARMUP:-3}"
          --repeat "${REPEAT:-3}" --job-timeout 200)
    {
        date -u
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
        python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
                                             'cuda', torch.version.cuda)"
    } > "$OUT/step_env.txt" 2>&1
    # FusedAdam's JIT build (about a minute, once per machine) beside the GPU checks; waited for below
    timeout 300 python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder
FusedAdamBuilder().load(); print('FusedAdam built')" > "$OUT/step_fusedadam.log" 2>&1 &
    BUILD=$!
    timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/nn/test_weight_cache_cuda.py \
        > "$OUT/step_pytest_cuda.log" 2>&1
    echo "weight cache on the kernels: $(tail -1 "$OUT/step_pytest_cuda.log")"
    wait "$BUILD"; echo "FusedAdam: $(tail -1 "$OUT/step_fusedadam.log")"
else
    PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python
    [ -n "${TINY:-}" ] || { echo "DEVICE=cpu needs TINY=1 (the $MODEL shape does not fit a CPU run)"; exit 2; }
    ARGS=(--model "$SMOKE" --device cpu --seq 64 --batch 2 --steps "${STEPS:-4}" --warmup "${WARMUP:-1}"
          --repeat "${REPEAT:-2}" --job-timeout 120)
    echo "CPU smoke: checks the script, measures nothing" > "$OUT/step_env.txt"
fi
BUDGET=$(( TOTAL - ($(date +%s) - T0) - 15 ))
echo "== benchmark ($MODEL): $BUDGET s left for the rounds"
# shellcheck disable=SC2086
$PY benchmarks/step.py "${ARGS[@]}" --format "${FORMAT:-nvfp4}" "${BEFORE_ARG[@]}" --variants "$VARIANTS" \
    --skip "${SKIP:-$SKIP_DEFAULT}" --peers "$PEERS" --profile-steps "${PROFILE_STEPS:-2}" --budget "$BUDGET" \
    --out "$OUT" ${STEP_EXTRA:-} 2> "$OUT/step_bench.log"
rc=$?
[ -f "$OUT/step.md" ] || { echo "no step.md; the log's tail:"; tail -40 "$OUT/step_bench.log"; }
echo "== step.sh: $(( $(date +%s) - T0 )) s, rc $rc; results in $OUT/step.md, step.json"
exit $rc
