#!/usr/bin/env bash
# The QAD recipe sweep and Model Optimizer's PTQ / QAD beside it (benchmarks/accuracy/{qad_recipe,peer_modelopt}.py,
# and on request the llm-compressor / AutoRound PTQ peers)
# in one device call: SmolLM2-135M-Instruct, several processes at once on one GPU (a 135M model leaves most of it
# idle), each with a time budget, then one merged table and KL-vs-tokens plot.
#
# Here, once:   bash tools/gpu/stage.sh pack && bash benchmarks/gpu/papers.sh pack     # .whl, .gpu/
# There, three back-to-back calls (the machine keeps /tmp between warm calls):
#   1 carry [.whl, .gpu/assets, .gpu/smollm2.gguf.parts.json]   bash benchmarks/gpu/accuracy.sh stash
#   2 carry [.gpu/smollm2.gguf.part-aa]                         bash benchmarks/gpu/accuracy.sh stash
#   3 carry [.gpu/smollm2.gguf.part-ab]                         bash benchmarks/gpu/accuracy.sh run   (timeout_s=600)
# Later calls on the same warm machine need no carry: `run` again with other JOBS.
# Here, the same path end to end on a CPU (tiny random model):  DEVICE=cpu SMOKE=1 bash benchmarks/gpu/accuracy.sh
#
# JOBS: ';'-separated entries "script args...", script = a file of benchmarks/accuracy without .py; each entry is
# one process, all started at once; give each its own --tag. STEPS (per arm), T_TOTAL (seconds for `run`, 560),
# OUT ($PWD/gpu_out), WORK (/tmp/qf-accuracy), THREADS (CPU threads per process, 2).
# Post-training peers, PTQ rows scored from the export each writes with its own exporter (and checked by
# benchmarks/accuracy/peer_export_check.py); they need the peers' wheels: here `bash tools/gpu/stage.sh
# pack-peers`, there carry [.whl-peers/arrow] (pyarrow, 55 MB) in one `stash` call and [.whl-peers/common,
# .whl-peers/llmc] (25.5 MB) in another; `run` installs them (stage.sh install-peers) when a JOBS entry names a peer:
#   peer_llmcompressor --tag llmc        llm-compressor 0.14.0.1: NVFP4A16 oneshot + GPTQ W4A16 (--format nvfp4_w4a4 /
#                                        mxfp4_w4a4: its NVFP4 / MXFP4 recipes); runs on its own compressed-tensors 0.19
#   peer_autoround --tag autoround       auto-round 0.16.1: NVFP4 with act_bits=16, its defaults (200 iters, 128 x
#                                        2,048 tokens); --format nvfp4_w4a4 / mxfp4_w4a4: its NVFP4 / MXFP4 presets
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
WORK=${WORK:-/tmp/qf-accuracy}
DEVICE=${DEVICE:-cuda}
SMOKE=${SMOKE:-}
STEPS=${STEPS:-600}
DEFAULT_JOBS="qad_recipe --lrs 5e-6 --schedule constant --ptq --tag r-lr5e-6-const;\
qad_recipe --lrs 2e-5 --tag r-lr2e-5;\
qad_recipe --lrs 1e-4 --tag r-lr1e-4;\
qad_recipe --lrs 4e-4 --tag r-lr4e-4;\
qad_recipe --methods qat --lrs 1e-4 --tag r-qat-lr1e-4;\
peer_modelopt --lrs 1e-5 --tag modelopt"
JOBS=${JOBS:-$DEFAULT_JOBS}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
# DeepSpeed's JIT ops parse each arch as numbers: the GPU image's "9.0a" stops FusedAdam's build
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST//a/}
if [ -n "$SMOKE" ] && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python; T_TOTAL=${T_TOTAL:-1800}; THREADS=${THREADS:-1}; STEPS=${SMOKE_STEPS:-3}
else
    PY=python3; T_TOTAL=${T_TOTAL:-560}; THREADS=${THREADS:-2}
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
T0=$(date +%s)
cmd=${1:-run}

case $cmd in
    stash) bash benchmarks/gpu/papers.sh stash ;;
    run)
        mkdir -p "$OUT/accuracy" "$WORK"
        if [ -z "$SMOKE" ]; then
            bash tools/gpu/stage.sh link
            bash tools/gpu/stage.sh stash >/dev/null
            [ -d /tmp/site/deepspeed ] || bash tools/gpu/stage.sh install-ours || exit 1
            if [[ $JOBS == *peer_llmcompressor* || $JOBS == *peer_autoround* ]] && [ ! -d /tmp/site-llmc ]; then
                bash tools/gpu/stage.sh install-peers || exit 1
            fi
            nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/accuracy/gpu.txt" 2>&1
        fi
        prep=()
        [ -n "$SMOKE" ] && prep=(--smoke)
        echo "== prepare (assets, GGUF -> model directory)"
        line=$($PY benchmarks/papers/papers_common.py prepare --cache "$WORK/cache" --work "$WORK" \
            --out "$OUT/accuracy/prepare.json" "${prep[@]}" 2> "$OUT/accuracy/prepare.log" | tail -1)
        [ -n "$line" ] || { echo "prepare failed:"; tail -20 "$OUT/accuracy/prepare.log"; exit 1; }
        MD=$($PY -c "import json, sys; print(json.loads(sys.argv[1])['model_dir'])" "$line") || exit 1
        export QATFACTORY_CACHE=$WORK/cache
        model=(--model-path "$MD")
        [ -n "$SMOKE" ] && model=(--smoke)
        left=$(( T_TOTAL - ($(date +%s) - T0) - 25 ))
        budget=$(( left - 60 ))
        [ "$budget" -gt 30 ] || { echo "only $left s left after preparing: nothing started"; exit 1; }
        echo "== model $MD; jobs at once, hard limit $left s each ($(( $(date +%s) - T0 )) s so far)"
        pids=(); names=()
        port=29711
        IFS=';' read -ra entries <<< "$JOBS"
        for e in "${entries[@]}"; do
            read -ra w <<< "$e"
            [ ${#w[@]} -gt 0 ] || continue
            s=${w[0]}; args=("${w[@]:1}")
            tag=$s; for ((k = 0; k < ${#args[@]}; k++)); do [ "${args[$k]}" = --tag ] && tag=${args[$((k + 1))]}; done
            port=$((port + 1))
            # a peer's worker process finds its own site dir first (llm-compressor's compressed-tensors 0.19
            # ahead of ours); the smoke's peers run from the venvs their scripts name
            ppath=
            if [ -z "$SMOKE" ]; then
                case $s in
                    peer_llmcompressor) ppath=/tmp/site-llmc:/tmp/site-peers ;;
                    peer_autoround) ppath=/tmp/site-peers ;;
                esac
            fi
            QF_PEER_PYTHONPATH=$ppath MASTER_PORT=$port OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS timeout -k 10 "$left" \
                $PY "benchmarks/accuracy/$s.py" --out "$OUT/accuracy" --work "$WORK/$tag" --device "$DEVICE" \
                --steps "$STEPS" --budget-s "$budget" "${model[@]}" "${args[@]}" > "$OUT/accuracy/$tag.log" 2>&1 &
            pids+=($!); names+=("$tag")
            echo "   started $tag: $s ${args[*]}"
        done
        rc=0
        for i in "${!pids[@]}"; do
            wait "${pids[$i]}"; r=$?
            echo "== ${names[$i]}: exit $r ($(( $(date +%s) - T0 )) s)"
            [ "$r" -ne 0 ] && { rc=1; tail -4 "$OUT/accuracy/${names[$i]}.log"; }
        done
        jsons=()
        for n in "${names[@]}"; do [ -f "$OUT/accuracy/$n.json" ] && jsons+=("$OUT/accuracy/$n.json"); done
        if [ ${#jsons[@]} -gt 0 ]; then
            $PY benchmarks/accuracy/qad_recipe.py --merge "${jsons[@]}" --out "$OUT/accuracy" > "$OUT/accuracy/merge.log" 2>&1 \
                && cat "$OUT/accuracy/qad_recipe.md" || { rc=1; tail -5 "$OUT/accuracy/merge.log"; }
        fi
        echo "== done in $(( $(date +%s) - T0 )) s"
        exit $rc ;;
    *) echo "usage: $0 stash | run" >&2; exit 2 ;;
esac
