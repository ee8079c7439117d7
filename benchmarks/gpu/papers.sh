#!/usr/bin/env bash
# The four paper reproductions (benchmarks/papers/{qad_vs_qat,format_modes,seqlen,lora_memory}.py) in one
# device call on one H200, SmolLM2-135M-Instruct, 2 seeds, all four at once (each alone leaves the GPU mostly
# idle: a 135M model is launch-bound), each with a time budget so that every table is written in time.
#
# Here, once:    bash benchmarks/gpu/papers.sh pack   # .gpu/ (SmolLM2 GGUF in 2 parts, wiki, GSM8K: pipeline.sh
#                                                     # pack) + .gpu/assets/austen; the wheels in .whl come from
#                                                     # `bash tools/gpu/stage.sh pack` (or an earlier one)
# There, three back-to-back calls (the machine keeps /tmp between warm calls):
#   1 carry [.whl, .gpu/assets, .gpu/smollm2.gguf.parts.json]   bash benchmarks/gpu/papers.sh stash
#   2 carry [.gpu/smollm2.gguf.part-aa]                         bash benchmarks/gpu/papers.sh stash
#   3 carry [.gpu/smollm2.gguf.part-ab]                         bash benchmarks/gpu/papers.sh run   (timeout_s=600)
# Here, the same path end to end on a CPU (tiny random model; SMOKE_MODEL=real runs the smoke sizes on SmolLM2):
#   DEVICE=cpu SMOKE=1 bash benchmarks/gpu/papers.sh
#
# `run`: installs the wheels if call 1 did not, stashes what this call carried, reassembles and checks the GGUF,
# turns it into the local model directory (papers_common.py prepare), then starts the four scripts with
# --budget-s so each stops starting arms in time, and a hard `timeout` behind it. Each script rewrites its
# table after every arm, so a cut run still reports what it measured (the rest: "not run").
# Results: $OUT/papers/{qad_vs_qat,format_modes,seqlen,lora_memory}.{md,json,png}, their logs, papers.md (all four).
#
# Knobs: T_TOTAL (seconds for the whole `run`, default 560 on a GPU: the device call may run 600), ONLY (which
# scripts, default all four), SEEDS (2), THREADS (CPU threads per script, 4), ARGS (extra arguments for every
# script, e.g. "--steps 100"), WORK (/tmp/qf-papers), OUT ($PWD/gpu_out), DEVICE (cuda), SMOKE, SMOKE_MODEL,
# PRIOR (a folder of an earlier call's <script>.json, e.g. benchmarks/results/papers_h100_20261206/first_call: each script
# with a JSON there keeps its finished rows and runs only the rest -- `--prior`, which refuses other settings).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
WORK=${WORK:-/tmp/qf-papers}
DEVICE=${DEVICE:-cuda}
SMOKE=${SMOKE:-}
SMOKE_MODEL=${SMOKE_MODEL:-tiny}
SEEDS=${SEEDS:-2}
ONLY=${ONLY:-"qad_vs_qat format_modes seqlen lora_memory"}
ARGS=${ARGS:-}
PRIOR=${PRIOR:-}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
# DeepSpeed's JIT ops parse each arch as numbers: the GPU image's "9.0a" stops FusedAdam's build
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST//a/}
if [ -n "$SMOKE" ] && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python; T_TOTAL=${T_TOTAL:-1800}; THREADS=${THREADS:-1}
else
    PY=python3; T_TOTAL=${T_TOTAL:-560}; THREADS=${THREADS:-4}
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
T0=$(date +%s)
cmd=${1:-run}

case $cmd in
    pack)
        bash benchmarks/gpu/pipeline.sh pack || exit 1
        .venv/bin/python -c "import qatfactory.assets as a; a.fetch('austen')" || exit 1
        CACHE=${QATFACTORY_CACHE:-$HOME/.cache/qatfactory}
        mkdir -p .gpu/assets/austen
        cp "$CACHE/assets/austen/austen.json" "$CACHE/assets/austen/provenance.json" .gpu/assets/austen/
        ls .whl/*.whl >/dev/null 2>&1 || echo "no .whl/: run \`bash tools/gpu/stage.sh pack\` for the wheels"
        du -sh .whl .gpu/assets .gpu/smollm2.gguf.part-* 2>/dev/null ;;
    stash)
        bash tools/gpu/stage.sh stash >/dev/null
        if [ -z "$SMOKE" ] && [ ! -d /tmp/site/deepspeed ]; then bash tools/gpu/stage.sh install-ours; fi
        ls -la /tmp/qf-parts /tmp/qf-parts/assets 2>/dev/null ;;
    run)
        mkdir -p "$OUT/papers" "$WORK"
        if [ -z "$SMOKE" ]; then
            # not pip-installed there: exporters/ importable as qatfactory.exporters (a device-local link, as tools/gpu/run.sh)
            bash tools/gpu/stage.sh link
            bash tools/gpu/stage.sh stash >/dev/null
            [ -d /tmp/site/deepspeed ] || bash tools/gpu/stage.sh install-ours || exit 1
            nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/papers/gpu.txt" 2>&1
        fi
        prep=()
        [ -n "$SMOKE" ] && prep=(--smoke)
        echo "== prepare (assets, GGUF -> model directory)"
        line=$($PY benchmarks/papers/papers_common.py prepare --cache "$WORK/cache" --work "$WORK" \
            --out "$OUT/papers/prepare.json" "${prep[@]}" 2> "$OUT/papers/prepare.log" | tail -1)
        [ -n "$line" ] || { echo "prepare failed:"; tail -20 "$OUT/papers/prepare.log"; exit 1; }
        MD=$($PY -c "import json, sys; print(json.loads(sys.argv[1])['model_dir'])" "$line") || exit 1
        export QATFACTORY_CACHE=$WORK/cache
        echo "   model: $MD ($(( $(date +%s) - T0 )) s so far)"
        model=(--model-path "$MD")
        if [ -n "$SMOKE" ]; then
            [ "$SMOKE_MODEL" = real ] && model=(--smoke --model-path "$MD") || model=(--smoke)
        fi
        left=$(( T_TOTAL - ($(date +%s) - T0) - 15 ))
        budget=$(( left - 40 ))
        [ "$budget" -gt 30 ] || { echo "only $left s left after preparing: nothing started"; exit 1; }
        echo "== $ONLY in parallel: hard limit $left s, budget $budget s each"
        pids=()
        port=29611
        for s in $ONLY; do
            # one process group per script: a port each, so four starts at once never pick the same free port
            port=$((port + 1))
            prior=()
            if [ -n "$PRIOR" ]; then
                [ -f "$PRIOR/$s.json" ] && prior=(--prior "$PRIOR/$s.json") || echo "== $s: no $PRIOR/$s.json, every arm runs"
            fi
            MASTER_PORT=$port OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS timeout -k 10 "$left" $PY "benchmarks/papers/$s.py" \
                --out "$OUT/papers" --work "$WORK/$s" --device "$DEVICE" --seeds "$SEEDS" --budget-s "$budget" \
                "${model[@]}" "${prior[@]}" $ARGS > "$OUT/papers/$s.log" 2>&1 &
            pids+=($!)
        done
        rc=0
        i=0
        summary="$OUT/papers/papers.md"
        : > "$summary"
        for s in $ONLY; do
            wait "${pids[$i]}"; r=$?
            i=$((i + 1))
            status="exit $r"
            { [ "$r" -eq 124 ] || [ "$r" -eq 137 ]; } && status="cut by the time limit (exit $r; the table holds what finished)"
            echo "== $s: $status ($(( $(date +%s) - T0 )) s)"
            [ "$r" -ne 0 ] && { rc=1; tail -5 "$OUT/papers/$s.log"; }
            { echo "<!-- $s: $status -->"; cat "$OUT/papers/$s.md" 2>/dev/null || echo "# $s: no table ($status)"; echo; } \
                >> "$summary"
        done
        echo "== done in $(( $(date +%s) - T0 )) s: $summary"
        exit $rc ;;
    *) echo "usage: $0 pack | stash | run" >&2; exit 2 ;;
esac
