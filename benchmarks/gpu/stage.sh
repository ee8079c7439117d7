#!/usr/bin/env bash
# What the GPU machine lacks, packed here and carried over in calls of at most 64 MiB; the one place
# that pins the wheels. The GPU image has torch 2.11.0+cu130, transformers 5.17, CuPy, Triton and no
# registry access (benchmarks/gpu/run.sh and engines.sh use what this stages).
#
# Here (a machine with PyPI):
#   bash benchmarks/gpu/stage.sh pack            # .whl/ (our stack), .vllm/ (vLLM 0.24.0 in parts + its deps),
#                                                # and .gpu/ (SmolLM2 GGUF parts + assets, via pipeline.sh pack)
#   bash benchmarks/gpu/stage.sh plan            # the carry list of every call, sizes checked against 64 MiB
# There (each call carries one group and starts with this; carried folders are replaced by the next call,
# so everything is copied to /tmp/qf-parts first and found there later):
#   bash benchmarks/gpu/stage.sh stash           # copy whatever this call carried into /tmp/qf-parts
#   bash benchmarks/gpu/stage.sh install-ours    # /tmp/site  <- .whl (our stack; PYTHONPATH=/tmp/site)
#   bash benchmarks/gpu/stage.sh install-vllm    # /tmp/vsite <- the reassembled vLLM (sha256 checked) + deps
#
# vLLM 0.24.0 is the newest release whose torch pin (==2.11.0) and CUDA 13 extensions match the image.
# Its wheel is 279 MB; two files are left out of the carried copy, both unused by offline `vllm.LLM` on an
# H200: vllm_flash_attn/_vllm_fa2_C.abi3.so (FlashAttention 2; Hopper runs FA3, which is kept) and the
# vllm-rs binary (the Rust API-server frontend). The rest is repacked unchanged (zip, same paths) and
# split in parts. Its deps: only those `import vllm.entrypoints.llm` and an offline LLM() need that the
# image does not have (found by importing with the image's package set), pinned below. vLLM pins
# compressed-tensors 0.17.0 while our stack uses 0.20.1: the two live in separate site dirs.
set -euo pipefail
cd "$(dirname "$0")/../.."
PARTS=${PARTS_DIR:-/tmp/qf-parts}
MIB=$((1024 * 1024))
PART_MIB=${PART_MIB:-60}

OURS=(
    "deepspeed==0.19.8:build"            # sdist only (the py3 wheel on PyPI is a 2020 one): built here
    "antlr4-python3-runtime==4.9.3:build"
    hydra-core==1.3.8 omegaconf==2.3.1 gguf==0.19.0 hjson==3.1.0 loguru==0.7.3
    pydantic==2.14.4 pydantic-core==2.50.5 typing-extensions==4.16.0 typing-inspection==0.4.5
    annotated-types==0.8.0 compressed-tensors==0.20.1 nvidia-modelopt==0.47.0 pulp==3.3.2 torchao==0.18.0
)
VLLM_VERSION=0.24.0
VLLM_DEPS=(
    annotated-types==0.8.0 apache-tvm-ffi==0.1.11 cachetools==8.0.2 cbor2==6.3.0 fastapi==0.136.3
    llguidance==1.7.3 msgspec==0.23.0 openai==2.54.0 openai-harmony==0.0.8 opentelemetry-api==1.45.2
    partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5 pyzmq==27.3.0
    sniffio==1.3.1 starlette==1.10.0 typing-inspection==0.4.5 xgrammar==0.2.9 astor==0.8.1 blake3==1.0.11
    compressed-tensors==0.17.0 depyf==0.20.0 dill==0.4.1 diskcache==5.6.3 gguf==0.19.0 ijson==3.6.0
    lark==1.2.2 loguru==0.7.3 python-json-logger==4.2.0 setproctitle==1.3.8 typing-extensions==4.16.0
    watchfiles==1.3.0 jiter==0.19.0 distro==1.9.0 importlib-metadata==10.2.0
)
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 1 5 17 24 26 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

fetch() {   # fetch DIR SPEC...: wheels for the GPU machine's Python 3.12
    local dir=$1; shift
    mkdir -p "$dir"
    for spec in "$@"; do
        local name=${spec%%:*}
        if [[ $spec == *:build ]]; then
            python3 -m pip wheel -q --no-deps --no-cache-dir -w "$dir" "$name"
        else
            python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$dir" "$name"
        fi
    done
}

cmd=${1:-plan}
case $cmd in
    pack)
        for d in .whl .vllm; do mkdir -p $d; [ -f $d/.gitignore ] || echo '*' > $d/.gitignore; done
        rm -f .whl/*.whl
        fetch .whl "${OURS[@]}"
        rm -rf .vllm/deps .vllm/vllm.zip.part-* .vllm/vllm.manifest
        fetch .vllm/deps "${VLLM_DEPS[@]}"
        tmp=$(mktemp -d)
        python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$tmp" "vllm==$VLLM_VERSION"
        whl=$(ls "$tmp"/vllm-*.whl)
        cp "$whl" "$tmp/vllm.zip"
        zip -q -d "$tmp/vllm.zip" 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs'
        (cd "$tmp" && split -b "${PART_MIB}m" vllm.zip vllm.zip.part-)
        {
            echo "wheel $(basename "$whl") $(sha256sum "$whl" | cut -d' ' -f1)"
            echo "zip vllm.zip $(sha256sum "$tmp/vllm.zip" | cut -d' ' -f1) $(stat -c %s "$tmp/vllm.zip")"
            for p in "$tmp"/vllm.zip.part-*; do echo "part $(basename "$p") $(sha256sum "$p" | cut -d' ' -f1)"; done
        } > .vllm/vllm.manifest
        mv "$tmp"/vllm.zip.part-* .vllm/
        rm -rf "$tmp"
        bash benchmarks/gpu/pipeline.sh pack
        bash "$0" plan ;;
    plan)
        # group the carried files into calls under 64 MiB (minus the working tree)
        tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
        python3 - "$tree" <<'EOF'
import os, sys
from pathlib import Path
tree, cap = int(sys.argv[1]), 64 * 2**20
groups = [[".whl", ".vllm/deps", ".vllm/vllm.manifest", ".gpu/assets", ".gpu/smollm2.gguf.parts.json"]]
groups += [[str(p)] for p in sorted(Path(".gpu").glob("smollm2.gguf.part-*"))]
groups += [[str(p)] for p in sorted(Path(".vllm").glob("vllm.zip.part-*"))]
def size(p):
    p = Path(p)
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else (p.stat().st_size if p.exists() else 0)
for i, g in enumerate(groups, 1):
    s = tree + sum(size(p) for p in g)
    print(f"call {i}: {s / 2**20:5.1f} MiB {'OK ' if s < cap else 'TOO BIG'} carry={g}")
EOF
        ;;
    stash)
        mkdir -p "$PARTS"
        for src in .whl .vllm/deps; do
            [ -d "$src" ] || continue
            mkdir -p "$PARTS/$src"; cp -n "$src"/*.whl "$PARTS/$src/" 2>/dev/null || true
        done
        for f in .vllm/vllm.manifest .vllm/vllm.zip.part-*; do [ -f "$f" ] && cp "$f" "$PARTS/"; done
        [ -d .gpu ] && bash benchmarks/gpu/pipeline.sh stash >/dev/null
        ls "$PARTS" ;;
    install-ours)
        src=.whl; [ -d "$src" ] && ls $src/*.whl >/dev/null 2>&1 || src="$PARTS/.whl"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$src"/*.whl
        echo "our stack in /tmp/site (from $src)" ;;
    install-vllm-deps)
        # vLLM's deps alone (they arrive in the first call): every module imported once, so a missing or
        # wrong dependency shows up before the 180 MB of vLLM itself is carried
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/vsite \
            "$PARTS/.vllm/deps"/*.whl
        PYTHONPATH=/tmp/vsite python3 -c "
import importlib
mods = 'openai fastapi starlette xgrammar llguidance msgspec zmq cbor2 pybase64 compressed_tensors depyf \
partial_json_parser openai_harmony opentelemetry blake3 setproctitle ijson lark diskcache watchfiles gguf pydantic \
cachetools tvm_ffi jiter distro loguru pythonjsonlogger'.split()
bad = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(f'{m}: {type(e).__name__}: {e}')
print('vLLM deps import:', 'OK' if not bad else bad)
raise SystemExit(1 if bad else 0)" ;;
    install-vllm)
        man="$PARTS/vllm.manifest"
        [ -f "$man" ] || { echo "no $man: carry .vllm/vllm.manifest and stash it" >&2; exit 2; }
        missing=$(awk '$1 == "part" {print $2}' "$man" | while read -r p; do [ -f "$PARTS/$p" ] || echo "$p"; done)
        [ -z "$missing" ] || { echo "vLLM parts missing in $PARTS: $missing" >&2; exit 2; }
        read -r _ _ want size < <(grep '^zip ' "$man")
        cat $(awk '$1 == "part" {print "'"$PARTS"'/" $2}' "$man") > /tmp/vllm.zip
        got=$(sha256sum /tmp/vllm.zip | cut -d' ' -f1)
        [ "$got" = "$want" ] || { echo "vllm.zip sha256 $got != manifest $want" >&2; exit 2; }
        [ -d /tmp/vsite/openai ] || bash "$0" install-vllm-deps
        rm -rf /tmp/vsite/vllm /tmp/vsite/vllm-*.dist-info
        python3 -c "import zipfile; zipfile.ZipFile('/tmp/vllm.zip').extractall('/tmp/vsite')"
        rm -f /tmp/vllm.zip
        PYTHONPATH=/tmp/vsite python3 -c "import vllm.entrypoints.llm" || { echo "import vllm.entrypoints.llm failed" >&2; exit 2; }
        echo "vLLM $(grep '^wheel ' "$man" | cut -d' ' -f2) in /tmp/vsite ($(du -sh /tmp/vsite | cut -f1))" ;;
    *) echo "usage: $0 pack|plan|stash|install-ours|install-vllm-deps|install-vllm" >&2; exit 2 ;;
esac
