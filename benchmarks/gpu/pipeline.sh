#!/usr/bin/env bash
# The GPU pipeline (benchmarks/gpu/pipeline.py): part 1 = 2-GPU ZeRO-3 QAD of a ~1.1B random Llama with a
# checkpoint, a resumed launch, exports and `qatfactory verify`; part 2 = SmolLM2-135M from its packaged
# GGUF -> QAD on Wikipedia -> teacher / PTQ / QAD held-out KL and perplexity -> exports -> verify.
#
#   bash benchmarks/gpu/pipeline.sh pack [MiB]   # here: fill the git-ignored .gpu/ with the GGUF in parts
#                                                # (default 2 parts) + manifest, provenance records, wiki, GSM8K
#   bash benchmarks/gpu/pipeline.sh smoke [ARGS] # here: the CPU smoke run (tiny model, 2 gloo ranks)
#   bash benchmarks/gpu/pipeline.sh stash        # GPU machine: copy .gpu/ parts and assets to /tmp/qf-parts
#   bash benchmarks/gpu/pipeline.sh run [ARGS]   # GPU machine (tools/gpu/run.sh's stage `pipeline` calls this)
#
# On the GPU machine the parts are looked for in .gpu/ and /tmp/qf-parts/ (a part carried in an earlier
# call and stashed there counts); `run` stashes whatever .gpu/ holds first. ARGS go to pipeline.py
# (--help lists the knobs: --budget, --parts 1,2, --p1-steps, --p2-formats, --gsm8k ...).
#
# Carrying (64 MiB per call; .whl is ~29 MiB, .gpu/assets 7 MiB, each of the 2 default parts 47 MiB), e.g.:
#   call 1: carry [.whl, .gpu/assets, .gpu/smollm2.gguf.parts.json]   command: bash benchmarks/gpu/pipeline.sh stash
#   call 2: carry [.gpu/smollm2.gguf.part-aa]                         command: bash benchmarks/gpu/pipeline.sh stash
#   call 3: carry [.gpu/smollm2.gguf.part-ab]   command: NO_INSTALL=1 STAGES=pipeline bash tools/gpu/run.sh
# (call 1 may be any earlier tools/gpu/run.sh call with `&& bash benchmarks/gpu/pipeline.sh stash` appended; the wheels
# stay installed in /tmp/site while the machine is warm). `pack 20` makes 20 MiB parts instead.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -x .venv/bin/python ] && [ -z "${PY:-}" ]; then PY=.venv/bin/python; else PY=${PY:-python3}; fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cmd=${1:-run}; shift || true

case $cmd in
    pack)
        # .gpu/ holds only carried copies: keep it out of git whatever .gitignore says
        mkdir -p .gpu && [ -f .gpu/.gitignore ] || echo '*' > .gpu/.gitignore
        CACHE=${QATFACTORY_CACHE:-$HOME/.cache/qatfactory}
        $PY -c "import qatfactory.assets as a; [a.fetch(n) for n in ('smollm2', 'wiki', 'gsm8k')]" || exit 1
        for n in smollm2 wiki gsm8k; do
            mkdir -p ".gpu/assets/$n"
            cp "$CACHE/assets/$n/provenance.json" ".gpu/assets/$n/"
        done
        cp "$CACHE/assets/wiki/summaries_en-us.json" .gpu/assets/wiki/
        cp "$CACHE/assets/gsm8k/test.jsonl" .gpu/assets/gsm8k/
        rm -f .gpu/smollm2.gguf.part-* .gpu/smollm2.gguf.parts.json
        $PY - "${1:-}" <<'EOF'
import math, sys
from pathlib import Path
sys.path.insert(0, "tools/gpu")
import staging
src = staging.user_cache() / "assets" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
mib = float(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] else None
n = math.ceil(src.stat().st_size / (mib * 2**20)) if mib else 2
for name, p in staging.split_file(src, Path(".gpu"), n).items():
    print(f"{p}  {p.stat().st_size / 2**20:.1f} MiB")
EOF
        du -sh .gpu/assets .gpu/smollm2.gguf.part-* ;;
    stash)
        $PY -c "import sys; sys.path.insert(0, 'tools/gpu'); import staging; from pathlib import Path; \
print('stashed:', staging.stash(Path('.gpu'), staging.STASH_DIR))"
        ls -la /tmp/qf-parts 2>/dev/null ;;
    smoke)
        exec $PY benchmarks/gpu/pipeline.py --smoke "$@" ;;
    run)
        # as tools/gpu/run.sh does for an uninstalled copy: exporters/ importable as qatfactory.exporters
        bash tools/gpu/stage.sh link
        export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
        export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST//a/}   # DeepSpeed's op builder cannot parse "9.0a"
        exec $PY benchmarks/gpu/pipeline.py "$@" ;;
    *) echo "usage: $0 pack [MiB] | smoke [ARGS] | stash | run [ARGS]" >&2; exit 2 ;;
esac
