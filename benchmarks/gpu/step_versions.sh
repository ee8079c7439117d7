#!/usr/bin/env bash
# The training step of two versions of the trainer, interleaved on one GPU: does a change make a step
# slower? Each round runs benchmarks/step.py (our rows only, no peers) from the old tree, then from this
# one, so drift of the machine hits both alike; the table puts each variant's median step of the two
# side by side. The old tree is a plain export of another commit, made here and carried:
#
#   bash benchmarks/gpu/step_versions.sh pack REV        # here: .oldtree/ <- `git archive REV` (its code and step.py)
#   run(command="bash benchmarks/gpu/step_versions.sh run", carry=[".whl", ".oldtree"], timeout_s=600)
#
# Knobs: VARIANTS (step.py --variants; default QAT W4A4 and live-teacher QAD W4A16 on the Llama shape),
# SKIPV (step.py --skip), ROUNDS (2), STEPS (8), WARMUP (3), TOTAL (seconds for the whole call, default 540).
# On a CPU, to check the script end to end (measures nothing): DEVICE=cpu TINY=1 PY=.venv/bin/python ... run
set -uo pipefail
cd "$(dirname "$0")/../.."
cmd=${1:-run}
case $cmd in
    pack)
        rev=${2:?usage: $0 pack REV}
        rm -rf .oldtree && mkdir -p .oldtree && echo '*' > .oldtree/.gitignore
        git archive "$rev" qatfactory exporters recipes csrc benchmarks/step.py benchmarks/step_peers.py \
            benchmarks/step_profile.py benchmarks/step_workers.py benchmarks/fused_adam_cpu.py | tar -x -C .oldtree
        git rev-parse "$rev" > .oldtree/REV
        # the carried copy of this tree has no history of its own: what "new" is gets recorded here
        echo "$(git rev-parse HEAD)$(git diff --quiet HEAD -- qatfactory exporters recipes csrc benchmarks || echo ' + uncommitted changes')" \
            > .oldtree/NEW
        du -sh .oldtree ;;
    run)
        OUT=${OUT:-$PWD/gpu_out}
        mkdir -p "$OUT/step_versions"
        T0=$(date +%s)
        DEVICE=${DEVICE:-cuda}
        ROUNDS=${ROUNDS:-2}; TOTAL=${TOTAL:-540}
        VARIANTS=${VARIANTS:-"QAT W4A4 (CE)|QAD W4A16 live teacher"}
        SKIPV=${SKIPV:-"grad ckpt|lean activations|LoRA|ZeRO-1"}
        PY=${PY:-python3}
        export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
        # the GPU image's 9.0a is not an arch DeepSpeed's FusedAdam JIT accepts
        [ -n "${TORCH_CUDA_ARCH_LIST:-}" ] && export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST//a/}"
        [ -f .oldtree/REV ] || { echo "no .oldtree: run '$0 pack REV' here first and carry .oldtree"; exit 2; }
        SITE=""
        if [ "$DEVICE" = cuda ]; then
            [ -d /tmp/site/deepspeed ] || bash tools/gpu/stage.sh install-ours > "$OUT/step_versions/install.log" 2>&1 \
                || { tail -20 "$OUT/step_versions/install.log"; exit 1; }
            SITE=/tmp/site
            nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/step_versions/gpu.txt" 2>&1
        fi
        for t in "$PWD" "$PWD/.oldtree"; do bash tools/gpu/stage.sh link "$t"; done
        echo "old: $(cat .oldtree/REV)  new: $(cat .oldtree/NEW 2>/dev/null || echo 'this working tree')" \
            > "$OUT/step_versions/versions.txt"
        extra=(); [ -n "${TINY:-}" ] && extra=(--model smoke --device cpu --seq 64 --batch 1)
        for r in $(seq 1 "$ROUNDS"); do
            for side in old new; do
                tree=$PWD; [ $side = old ] && tree=$PWD/.oldtree
                left=$(( TOTAL - ($(date +%s) - T0) ))
                [ "$left" -gt 60 ] || { echo "round $r $side: ${left}s left, stopping"; break 2; }
                (cd "$tree" && PYTHONPATH="$tree${SITE:+:$SITE}" timeout -k 5 "$left" "$PY" benchmarks/step.py \
                    --no-peers --variants "$VARIANTS" --skip "$SKIPV" --steps "${STEPS:-8}" --warmup "${WARMUP:-3}" --repeat 1 \
                    --profile-steps 0 --out "$OUT/step_versions/$side-r$r" "${extra[@]}") \
                    > "$OUT/step_versions/$side-r$r.log" 2>&1
                echo "round $r $side: rc $? at $(( $(date +%s) - T0 ))s"
            done
        done
        python3 - "$OUT/step_versions" <<'PY'
import json, statistics, sys
from pathlib import Path
d = Path(sys.argv[1])
rows = {}
for f in sorted(d.glob("*-r*/step.json")):
    side = f.parent.name.split("-r")[0]
    for r in json.loads(f.read_text()).get("rows", []):
        ms = r.get("ms_per_step")
        if ms is not None and r.get("kind", "ours") == "ours":
            rows.setdefault(r["variant"], {}).setdefault(side, []).append(float(ms))
lines = ["| variant | old step (ms, median of rounds) | new step (ms) | new / old |", "|---|---|---|---|"]
for name, s in rows.items():
    o, n = (statistics.median(s[k]) if s.get(k) else None for k in ("old", "new"))
    ratio = f"{n / o:.3f}" if o and n else "-"
    lines.append(f"| {name} | {o if o is None else f'{o:.1f}'} | {n if n is None else f'{n:.1f}'} | {ratio} |")
(d / "step_versions.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
        ;;
    *) echo "usage: $0 pack REV | run" >&2; exit 2 ;;
esac
