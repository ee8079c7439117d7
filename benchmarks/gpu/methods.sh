#!/usr/bin/env bash
# The method and paper benchmarks on the H200, as few device calls as the carrying allows.
#
# Here, once: bash tools/gpu/stage.sh pack   (wheels in .whl, SmolLM2 GGUF parts + assets in .gpu)
# Device calls, back to back (the machine stays warm ~30 s between calls):
#   1 carry [.whl, .gpu/assets, .gpu/smollm2.gguf.parts.json]  bash benchmarks/gpu/methods.sh preflight [JOB...]
#   2 carry [.gpu/smollm2.gguf.part-aa]                         bash benchmarks/gpu/methods.sh stash [JOB...]
#   3 carry [.gpu/smollm2.gguf.part-ab]                         bash benchmarks/gpu/methods.sh run JOB...
#   4...                                                        bash benchmarks/gpu/methods.sh run JOB...
# JOBs that need no model (step) can ride on calls 1 and 2. PRESET=probe runs every job for a few steps
# only (errors and per-step times, cheap); PRESET=run (default) the sizes below, chosen to fit one call.
# A call brings back at most 8 files from $OUT, two folders down: tar what must come back into one file.
# Each job runs under its own timeout (T_<JOB>, seconds), so one failure never costs the others; its
# tables, plots and log are copied into $OUT/<job>/ (students and exports stay under $WORK).
#
# ParetoQ: one bit width, arm or (width, seed) per job, each inside one 600 s call; a job writes
# only its rows (<job>/paretoq_*.json + its log: 2 of the call's 8 files) and the tables are merged here.
# Minutes are ESTIMATES (2026-12-01, before the low-bit step's host-work fix ran on a GPU): steps x 0.09-0.27 s
# per SmolLM2 step (host-bound: benchmarks/lowbit_step.py counts ~9,100 launches and ~12 host reads per step after the fix,
# ~24,000 and 1,331 before, when the H200 took ~0.72 s) + ~1.5 min of load, evaluations and diagnostics per
# arm; the split's byte model 0.02-0.08 s per step, ~25 s per run besides. Each job's rows record step_ms.
# Since 2026-12-06 the ParetoQ and paper arms train with FusedAdam at ZeRO-0 (the lean step) instead of torch's
# AdamW at ZeRO-1: ~2,200 launches per step instead of ~5,100 by the CPU count (RESULTS.md), so expect the low
# end of these ranges or below; the first job of a fresh machine JIT-builds FusedAdam (~1 min, once).
# The sequence on a fresh machine (carry lists as above; every call well under 600 s):
#   1  PRESET=probe bash benchmarks/gpu/methods.sh preflight paretoq_split4s0
#        the CUDA tests (incl. tests/nn/test_lowbit_batch_cuda.py: batched == per-linear bits on CUDA) and a
#        30-step probe of the split (PARETOQ_PROBE_STEPS): its step_ms rescales the split estimates below
#   2  bash benchmarks/gpu/methods.sh stash paretoq_split4s0          (6 runs x 1,200 steps: ~4.5-8.5 min;
#        above 0.05 s/step in the probe, run it as two calls: PARETOQ_FRACTIONS=0,0.05,0.1 then =0.2,0.4,1)
#   3  PRESET=probe bash benchmarks/gpu/methods.sh run paretoq4 paretoq2      (~4 min: step_ms of the C1 arms)
#   4  bash benchmarks/gpu/methods.sh run paretoq_pilot      (2 x 300 steps, ~3-5 min); its JSON says "chosen":
#        every later job below 3 bits takes PARETOQ_LR_LO=<chosen> (default 1e-4: the H100 pilot of 2026-12-06 chose
#        it over 2e-5, CE 5.43 vs 6.79 after 300 steps; results/paretoq_runs_h100_20261206_07/20261206_lr_pilot/paretoq_pilot.json; no need to rerun it)
#   5  bash benchmarks/gpu/methods.sh run paretoq4 paretoq3  (the unquantized row + 500 + 500 steps, ~5-8 min)
#   6  PARETOQ_LR_LO=.. bash benchmarks/gpu/methods.sh run paretoq2     (1,500 steps, ~4-8.5 min)
#   7  ... run paretoq158;  8  ... run paretoq1                          (the same)
#   9-12  ... run paretoq_seqlsq_seq0 / _lsq0 / _seq1 / _lsq1           (1,500 steps each, ~4-8.5 min)
#   13-15 ... run paretoq_split2s0 / paretoq_split4s1 / paretoq_split2s1 (as call 2)
# Measured on an H100, 2026-12-06 (results/paretoq_runs_h100_20261206_07/20261206_bits_4_3_1): sharing the GPU does NOT pay for
# these jobs. One 1,500-step SmolLM2 arm alone trains in 215 s (135-143 ms a step) and its whole job takes
# 228 s. Three at once (`par`): 450-457 s of training each (~304 ms a step, 1.4x the throughput of one) and
# then their diagnostics (CPU) did not end in 85 s, so all three were cut at 540 s (16 threads per job on 16
# cores: `par` now gives each job its share, untimed since). Six at once (4 SmolLM2 + 2 splits): ~500 ms a
# SmolLM2 step and ~240-290 ms a split step; the two 1,500-step jobs were cut, the 500-step ones took ~500 s.
# A job's row is now saved as soon as its training ends (diagnostics added after, 'nan' if cut there), and
# a job run again in the same $WORK reuses an arm that finished with the same overrides (paretoq_common.run_arm)
# and restarts one cut in training (resume=auto), so a cut job can be finished by the next call of a warm
# machine. The split's byte model alone: 47-69 ms a step, ~90-100 s an arm (1,200 steps + evaluations).
# Results on an H100, 2026-12-06 (results/paretoq_runs_h100_20261206_07/20261206_*): the CE sweep at 4, 3, 2, 1.58, 1 bits and
# paretoq3lo; SEQ vs LSQ, both seeds; the split at 0, 0.4, 1 (both seeds) and 0.05, 0.1, 0.2 (seed 0, but 2-bit 0.2);
# the KV readback with the bf16-exact scales. Each job alone on that H100: a 1,500-step CE job 179-199 s
# (101-103 ms a step with FusedAdam), a split arm 70-78 s (38-41 ms a step), the kv job 388 s.
# Profiled there (PARETOQ_PROFILE=1): a 2-bit SmolLM2 step is 115 ms, the GPU busy 72 ms of it (4,345
# launches a step): ~40% host-bound.
# Results on an H100, 2026-12-07 (results/paretoq_runs_h100_20261206_07/20261207_kl_4_3_2_split): the KL (QAD) sweep at
# 4, 3, 2 bits and the split's 2-bit f = 0.2 (seed 0). Each job alone: machine start ~85 s; preflight 36 s; a split arm
# ~90 s (39 ms a step); the 500-step KL jobs 131 s (with the unquantized row) and 94 s; the 1,500-step KL job 268 s
# (153 ms a step).
# The rest of the design on an H100, 2026-12-07 (results/paretoq_runs_h100_20261206_07/20261207_kl_158_1_split_seed1),
# four calls back to back on one machine:
#   1 carry [.whl, .gpu/assets, .gpu/smollm2.gguf.parts.json]
#     PACK=1 T_PARETOQ=150 CUDA_TESTS=tests/nn/test_lowbit_batch_cuda.py PARETOQ_FRACTIONS=0.1 \
#       bash benchmarks/gpu/methods.sh preflight paretoq_split4s1 paretoq_split2s1                    (188 s)
#   2 carry [.gpu/smollm2.gguf.part-aa]
#     PACK=1 PARETOQ_FRACTIONS=0.05,0.2 bash benchmarks/gpu/methods.sh stash paretoq_split4s1 paretoq_split2s1  (226 s)
#   3 carry [.gpu/smollm2.gguf.part-ab]
#     PARETOQ_LOSS=kl PACK=1 bash benchmarks/gpu/methods.sh run paretoq158                          (262 s)
#   4 PARETOQ_LOSS=kl PACK=1 bash benchmarks/gpu/methods.sh run paretoq1                            (229 s)
# The same shape serves any rerun: staging on calls 1-3, one 1,500-step job per call.
# Optional, not in the design: PARETOQ_LOSS=kl ... run paretoq3lo (the 3-bit arm at the sub-3-bit setting, as QAD).
# A call cut short (its time limit, or the machine taken back) loses a PACKed call's every file; without PACK each
# job's folder (2 files) is copied to $OUT as it ends and comes back even if a later job is cut (at most 8 files a call).
# The KV readback runs as vLLM's five parts on four quick `stash` calls after `engines.sh preflight`, then
# `NO_SGLANG_WARM=1 T_KV=510 engines.sh kv`.
# paretoq2's row is also the SEQ seed-0 arm of SEQ vs LSQ
# (same overrides, LR 1e-4 both; paretoq_seq_vs_lsq.py --merge takes it from a paretoq_bits.json folder).
# PACK=1: the call's files come back as one methods.tgz (a call brings back at most 8 files).
# A machine lasts 30 minutes at most: calls 1-3 (staging) start each fresh one again. PARETOQ_LOSS=kl
# reruns the C1 jobs as QAD. Then here, no GPU: each call's methods.tgz into one results folder (device paths
# replaced by names, progress bars thinned, nothing overwritten; it prints the job folders D to merge):
#   python tools/gpu/unpack_results.py --dest benchmarks/results/<what>_<gpu>_<date> call_a=<files_at>/methods.tgz ...
#   python benchmarks/papers/paretoq_bits.py --merge D... --out benchmarks/results/paretoq_bits_h100_20261207
#   python benchmarks/papers/paretoq_seq_vs_lsq.py --merge D... --out benchmarks/results/paretoq_seq_vs_lsq_h100_20261206
#   python benchmarks/papers/paretoq_split.py --merge D... --out benchmarks/results/paretoq_split_h100_20261207
# Each table names the widths / arms / seeds still missing. The GPU machine has no llama.cpp runtime, so the
# arms train without an export there (gate column "not run"); every grid's export is gated on CPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
WORK=${WORK:-/tmp/qf-methods}
PRESET=${PRESET:-run}
PY=${PY:-python3}
# PACK=1: everything this call writes goes to a folder of its own and comes back as ONE file, $OUT/methods.tgz
# (a call brings back at most 8 files: `par` with 3-4 jobs writes more); nothing already in $OUT is touched
PACK_TO=""
if [ -n "${PACK:-}" ]; then
    PACK_TO=$OUT; OUT=$WORK/pack-$(date +%s)-$$
fi
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_CUDA_ARCH_LIST=9.0
if [ -z "${LOCAL:-}" ]; then
    # the GPU machine: our stack from the carried wheels, exporters/ importable as qatfactory.exporters
    bash tools/gpu/stage.sh link
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
cmd=${1:-run}; shift || true

stash() { [ -n "${LOCAL:-}" ] || bash tools/gpu/stage.sh stash >/dev/null; }
assets() {   # the GGUF reassembled from its parts and the data files, where qatfactory.assets reads them
    # (DATA_ONLY=1: the data files alone, for jobs on calls 1-2 whose GGUF parts have not all arrived)
    DATA_ONLY=${DATA_ONLY:-} $PY - <<'EOF'
import os
import sys
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, "tools/gpu")
import staging
if os.environ.get("DATA_ONLY"):
    staging.ASSET_NAMES = [n for n in staging.ASSET_NAMES if n != "smollm2"]
info = staging.setup_assets(SimpleNamespace(asset_dirs=[Path(".gpu"), staging.STASH_DIR], smoke=False,
                                            work="/tmp/qf-methods"), staging.user_cache())
print({k: v.get("sha256_ok", v.get("status")) for k, v in info.items()})
EOF
}

# job -> "timeout-seconds|command" (PRESET=probe: a few steps of the same command)
args_for() {
    local j=$1 d=$WORK/$1 p=$PRESET
    case $j in
        step)       # ours vs plain loops vs Model Optimizer, one model, interleaved (no model files)
            echo "${T_STEP:-330}|bash benchmarks/gpu/step.sh" ;;
        scale_qlora)  # Scale-QLoRA: scale-only adapters vs LoRA on NVFP4 / MXFP4 bases
            [ $p = probe ] && echo "120|$PY benchmarks/papers/scale_qlora.py --out $d --steps 3 --n-train 96 --n-eval 16 --gen-tokens 32" \
                           || echo "${T_SCALE_QLORA:-240}|$PY benchmarks/papers/scale_qlora.py --out $d ${SCALE_ARGS:---n-eval 128 --gen-tokens 160}" ;;
        qerl)       # QeRL. QERL_ARMS splits the four arms over calls (two per 600-s call, RESULTS.md): each call
                    # adds its arms to $WORK/qerl/qerl.json (warm-up and calibration reused on a warm machine, rebuilt
                    # and digest-checked on a fresh one), so the last call's qerl.md has every arm that ran
            [ $p = probe ] && echo "150|$PY benchmarks/papers/qerl.py --out $d-probe --steps 2 --max-new-tokens 48 --warmup-steps 4 --calib-prompts 32 --n-eval 32 --gsm8k-items 8 --arms bf16_lora,nvfp4_lora_aqn; cp $d-probe/qerl.* \$OUT/" \
                           || echo "${T_QERL:-540}|$PY benchmarks/papers/qerl.py --out $d --steps ${QERL_STEPS:-25} --max-new-tokens ${QERL_TOKENS:-64} --arms ${QERL_ARMS:-bf16_lora,nvfp4_lora,nvfp4_lora_aqn,bf16_lora_aqn} --seeds ${QERL_SEEDS:-0} ${QERL_ARGS:-}" ;;
        qerl_merge) # one table and plot from the parts' qerl.json (QERL_PARTS: more of them, e.g. from an earlier machine)
            echo "60|$PY benchmarks/papers/qerl.py --merge $WORK/qerl/qerl.json ${QERL_PARTS:-} --out $d" ;;
        kv)         # the FP8 KV cache (2K only in one call; 8K is --seqs 8192)
            [ $p = probe ] && echo "120|$PY benchmarks/kv_cache.py --out $d --work $d/work --seqs 2048 --steps 2 --eval-seqs 2" \
                           || echo "${T_KV:-240}|$PY benchmarks/kv_cache.py --out $d --work $d/work --seqs ${KV_SEQS:-2048}" ;;
        paretoq)    # ParetoQ: the whole C1 bit sweep (CE) in one job: does NOT fit a call, use the jobs below
            [ $p = probe ] && echo "120|$PY benchmarks/papers/paretoq_bits.py --out $d --bits 4 --no-pilot --device cuda" \
                           || echo "${T_PARETOQ:-330}|$PY benchmarks/papers/paretoq_bits.py --out $d --device cuda" ;;
        paretoq_pilot|paretoq4|paretoq3|paretoq3lo|paretoq2|paretoq158|paretoq1)   # ParetoQ C1: one bit width per job
            # PARETOQ_PROFILE=1: three steps of each arm profiled (GPU busy vs wall: GPU- or host-bound?)
            local a="--out $d --device cuda --rows-only --loss ${PARETOQ_LOSS:-ce}${PARETOQ_PROFILE:+ --step-profile}" pr=""
            [ $p = probe ] && pr="--steps ${PARETOQ_PROBE_STEPS:-30}"
            case $j in
                paretoq_pilot) a="$a --pilot-only --no-teacher" ;;
                paretoq4)      a="$a --bits 4" ;;                   # + the unquantized row (teacher)
                paretoq3)      a="$a --bits 3 --no-teacher" ;;
                paretoq3lo)    # the ablation the 3-bit row asks for: 3 bits at the setting below 3 bits
                               a="$a --bits 3 --no-teacher --low-setting --lr-lo ${PARETOQ_LR_LO:-1e-4}" ;;
                paretoq2)      a="$a --bits 2 --no-teacher --lr-lo ${PARETOQ_LR_LO:-1e-4}" ;;
                paretoq158)    a="$a --bits 1.58 --no-teacher --lr-lo ${PARETOQ_LR_LO:-1e-4}" ;;
                paretoq1)      a="$a --bits 1 --no-teacher --lr-lo ${PARETOQ_LR_LO:-1e-4}" ;;
            esac
            echo "${T_PARETOQ:-560}|$PY benchmarks/papers/paretoq_bits.py $a $pr" ;;
        paretoq_seqlsq_seq0|paretoq_seqlsq_lsq0|paretoq_seqlsq_seq1|paretoq_seqlsq_lsq1)   # ParetoQ, 2-bit SEQ vs LSQ
            # at the bit sweep's LR below 3 bits, so that paretoq2's row IS the SEQ seed-0 arm (--merge takes it)
            local arm=${j#paretoq_seqlsq_} pr=""
            [ $p = probe ] && pr="--steps ${PARETOQ_PROBE_STEPS:-30}"
            echo "${T_PARETOQ:-560}|$PY benchmarks/papers/paretoq_seq_vs_lsq.py --out $d --device cuda --rows-only --arms ${arm%?} --seed-list ${arm: -1} --lr ${PARETOQ_LR_LO:-1e-4} $pr" ;;
        paretoq_split4s0|paretoq_split2s0|paretoq_split4s1|paretoq_split2s1)   # ParetoQ C2 (no model files)
            local sb=${j#paretoq_split} pr=""
            [ $p = probe ] && pr="--budget ${PARETOQ_PROBE_STEPS:-30}"
            echo "${T_PARETOQ:-560}|$PY benchmarks/papers/paretoq_split.py --out $d --device cuda --rows-only --bits ${sb%s*} --seed-list ${sb#*s} ${PARETOQ_FRACTIONS:+--fractions $PARETOQ_FRACTIONS} $pr" ;;
        papers)     # the four paper reproductions (papers.sh)
            # papers.sh stops its own scripts at T_TOTAL (from its start) and then writes the summary: the job's
            # hard limit sits 30 s behind it, and both inside a 600 s call with methods.sh's own ~15 s of staging
            echo "${T_PAPERS:-580}|env PRESET=$p T_TOTAL=${T_TOTAL:-550} bash benchmarks/gpu/papers.sh" ;;
        *) echo "unknown|"; return 1 ;;
    esac
}

run_job() {
    local j=$1 spec; spec=$(args_for "$j") || { echo "[methods] unknown job $j" | tee -a "$OUT/methods.log"; return 2; }
    local t=${spec%%|*} c=${spec#*|} o=$OUT/$j
    mkdir -p "$o"
    echo "[methods] $(date -u +%H:%M:%S) $j (timeout ${t}s, $PRESET): $c" | tee -a "$OUT/methods.log"
    local t0; t0=$(date +%s)
    OUT=$o timeout -k 10 "$t" bash -c "$c" > "$o/$j.log" 2>&1
    local rc=$?
    echo "[methods] $(date -u +%H:%M:%S) $j rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/methods.log"
    tail -n 25 "$o/$j.log"
    # the reports (tables, plots, records), never students or exports
    if [ -d "$WORK/$j" ]; then
        (cd "$WORK/$j" && find . -maxdepth 2 -type f \( -name '*.md' -o -name '*.json' -o -name '*.png' -o -name '*.jsonl' \) \
            -size -2M -print0 | xargs -0 -r cp --parents -t "$o" 2>/dev/null)
    fi
    return 0
}

case $cmd in
    preflight)
        stash
        [ -n "${LOCAL:-}" ] || [ -d /tmp/site/deepspeed ] || bash tools/gpu/stage.sh install-ours
        { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
          $PY -c "import torch, transformers, deepspeed, gguf, hydra, compressed_tensors; import modelopt.torch.quantization
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'transformers', transformers.__version__,
      'deepspeed', deepspeed.__version__, 'gguf', gguf.__version__ if hasattr(gguf, '__version__') else '?')" 2>&1; } \
            | tee "$OUT/env.txt"
        # the data files first: some GPU tests read them from the cache (the machine has no PyPI)
        DATA_ONLY=1 assets 2>&1 | tee -a "$OUT/methods.log"
        # every GPU-only test (pytest -m cuda): they never run in CI, so they run here first. A module whose
        # CPU-only dependency the image lacks (lm_eval: tests/faces/test_harness.py holds no cuda test) is left out
        # by name, so that the count below has no collection error to explain. CUDA_TESTS="tests/x.py ..." runs
        # only those files (a re-check of one fix on a machine staged for something else)
        ign=(); $PY -c "import lm_eval" 2>/dev/null || ign=(--ignore=tests/faces/test_harness.py)
        timeout -k 5 "${T_CUDA_TESTS:-240}" $PY -m pytest -q -m cuda -p no:cacheprovider "${ign[@]}" ${CUDA_TESTS:-tests} > "$OUT/pytest_cuda.log" 2>&1
        echo "[methods] pytest -m cuda: $(tail -1 "$OUT/pytest_cuda.log")" | tee -a "$OUT/methods.log"
        for j in "$@"; do run_job "$j"; done ;;
    stash)
        stash; [ $# -eq 0 ] || DATA_ONLY=1 assets 2>&1 | tee -a "$OUT/methods.log"
        for j in "$@"; do run_job "$j"; done ;;
    run)
        stash; assets 2>&1 | tee -a "$OUT/methods.log"
        for j in "$@"; do run_job "$j"; done ;;
    par)    # the same jobs at once on the one GPU; each keeps its own timeout; quality tables only: never
            # time anything this way. Each job gets its share of the cores for its CPU threads (torch's
            # intra-op pool, OpenMP, MKL): 16 threads per job on 16 cores left the CPU-side work of three jobs
            # (the ParetoQ diagnostics rebuild and pack a 135M model on the CPU) >10x slower (an H100, 2026-12-06)
        stash; assets 2>&1 | tee -a "$OUT/methods.log"
        thr=$(( $(nproc) / ($# > 0 ? $# : 1) )); [ "$thr" -ge 1 ] || thr=1
        echo "[methods] par: $# jobs, ${PAR_THREADS:-$thr} CPU threads each" | tee -a "$OUT/methods.log"
        for j in "$@"; do
            ( export OMP_NUM_THREADS=${PAR_THREADS:-$thr} MKL_NUM_THREADS=${PAR_THREADS:-$thr}; run_job "$j" ) \
                > "$OUT/methods-$j.tail" 2>&1 &
        done
        wait; cat "$OUT"/methods-*.tail ;;
    *) echo "usage: $0 preflight|stash|run|par [JOB...]  (jobs: step scale_qlora qerl qerl_merge kv papers; paretoq_pilot" \
            "paretoq4 paretoq3 paretoq3lo paretoq2 paretoq158 paretoq1 paretoq_seqlsq_{seq,lsq}{0,1} paretoq_split{4,2}s{0,1})" >&2; exit 2 ;;
esac
if [ -n "$PACK_TO" ]; then
    mkdir -p "$PACK_TO" && tar czf "$PACK_TO/methods.tgz.part" -C "$OUT" . && mv "$PACK_TO/methods.tgz.part" "$PACK_TO/methods.tgz" \
        && echo "[methods] packed $(find "$OUT" -type f | wc -l) files into $PACK_TO/methods.tgz"
fi
