#!/usr/bin/env bash
# What the GPU machine lacks, packed here and carried over in calls of at most 64 MiB; the one place
# that pins the wheels. The GPU image has torch 2.11.0+cu130, transformers 5.17, CuPy, Triton and no
# registry access (tools/gpu/run.sh and engines.sh use what this stages).
#
# Here (a machine with PyPI):
#   bash tools/gpu/stage.sh pack            # .whl/ (our stack), .vllm/ (vLLM 0.24.0 in parts + its deps),
#                                           # and .gpu/ (SmolLM2 GGUF parts + assets incl. Austen, via papers.sh pack)
#   bash tools/gpu/stage.sh plan            # the carry list of every call, sizes checked against 64 MiB
# There (each call carries one group and starts with this; carried folders are replaced by the next call,
# so everything is copied to /tmp/qf-parts first and found there later):
#   bash tools/gpu/stage.sh link            # qatfactory/{exporters,readers} -> ../exporters, ../readers (a tree
#                                           # run without pip install, as setup.py's package_dir maps them)
#   bash tools/gpu/stage.sh stash           # copy whatever this call carried into /tmp/qf-parts
#   bash tools/gpu/stage.sh install-ours    # /tmp/site  <- .whl (our stack; PYTHONPATH=/tmp/site)
#   bash tools/gpu/stage.sh install-peers   # /tmp/site-peers, /tmp/site-llmc <- .whl-peers (accuracy peers;
#                                           # here: `pack-peers`)
#   bash tools/gpu/stage.sh install-vllm    # /tmp/vsite <- the reassembled vLLM (sha256 checked) + deps
#   bash tools/gpu/stage.sh install-sglang  # /tmp/sgsite <- SGLang's reassembled bundle (sha256 checked)
#                                           # + the shared pins from .vllm/deps, then an import check
# SGLang (here, after `pack`): bash tools/gpu/stage.sh pack-sglang  (.sglang/: one tar of slimmed
# wheels cut into parts that ride in the room the six vLLM calls leave, the rest in a stash call before the
# vLLM call; carry_plan.py decides)
#   bash tools/gpu/stage.sh stage-jit X.tgz...  # JIT caches an earlier GPU run built and sent back
#                                           # ($OUT/jit-*.tgz) -> .sglang/jit, carried before the warm-up,
#                                           # used there only if built by the same torch/nvcc/GPU/versions
#   bash tools/gpu/stage.sh slim-wheel WHL  # apply the SGLANG_SLIM rules below to one wheel, in place
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
PART_MIB=${PART_MIB:-56}   # + the working tree (5.5 MiB on 2026-12-06) under a call's 64 MiB, with room to grow

OURS=(
    "deepspeed==0.19.8:build"            # sdist only (the py3 wheel on PyPI is a 2020 one): built here
    "antlr4-python3-runtime==4.9.3:build"
    hydra-core==1.3.8 omegaconf==2.3.1 gguf==0.19.0 hjson==3.1.0 loguru==0.7.3
    pydantic==2.14.4 pydantic-core==2.50.5 typing-extensions==4.16.0 typing-inspection==0.4.5
    annotated-types==0.8.0 compressed-tensors==0.20.1 nvidia-modelopt==0.47.0 pulp==3.3.2 torchao==0.18.0
)
# The accuracy benchmark's post-training peers (benchmarks/accuracy/peer_{autoround,llmcompressor}.py), not part of
# our stack: their own folder here (.whl-peers, `pack-peers`) and their own site dirs there (`install-peers`).
# Both import `datasets` (AutoRound's calibration module, llm-compressor's entry points), which the image lacks,
# and with it pyarrow. cp312 wheel sizes (2026-12-07), 80.5 MB in all: pyarrow 55.04 (a call of its own),
# pandas 12.03, pillow 7.14, auto-round 0.16.1 1.51 and 0.15.1 1.35, datasets 0.61, xxhash 0.47,
# llmcompressor 0.39, compressed-tensors 0.19.0 0.24, python-dateutil 0.23, fsspec 0.22, multiprocess 0.15,
# dill 0.12, nvidia-ml-py 0.06, six 0.01. The image's transformers 5.17 / torch 2.11 / accelerate 1.15 serve both.
PEERS=(
    auto-round==0.16.1 datasets==5.2.0 pyarrow==26.0.1 pandas==3.1.1 python-dateutil==2.9.0.post0 six==1.17.0
    dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0
)
# llm-compressor 0.14.0.1 pins compressed-tensors ==0.19.0 (ours: 0.20.1), auto-round <=0.15.1 and
# transformers <=5.17 (the image's 5.17.0 fits): its own site dir, first on its worker's PYTHONPATH
PEERS_LLMC=(llmcompressor==0.14.0.1 compressed-tensors==0.19.0 auto-round==0.15.1 nvidia-ml-py==13.615.71 pillow==13.0.0)
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
# SGLang 0.5.17: the newest release whose torch pin (==2.11.0) matches the image; its kernels (sglang-kernel
# 0.4.5) link libcudart.so.13. Found by walking the import chain of an offline sglang.Engine with only the
# image's packages visible (CPU, CUDA faked, 2026-12-01): what it imports that the image lacks is below,
# the rest of its 70-odd requirements (flash-attn-4, cutlass-dsl, tilelang, quack, deep-gemm, torchao,
# outlines, mistral-common, ...) are optional imports it skips. Three are slimmed (files removed, nothing
# else changed, pip installs the rest):
#   sglang-kernel  sgl_kernel/flash_ops (FlashAttention 3, 326 of the 365 MB; loaded only by
#                  sgl_kernel.flash_attn, i.e. attention_backend="fa3"), sm100/ (Blackwell's common_ops),
#                  infllm_ops and flashmla_ops (lazily loaded, other models); Hopper loads sm90/common_ops
#   flashinfer     flashinfer/data/ (sources and headers for FlashInfer's own JIT) except what the FlashInfer
#                  JIT modules SGLang builds on this path need (SGLANG_KEEP_FLASHINFER, sglang_jit.py keeps:
#                  their sources, the headers those include, the vendored CCCL headers). One module is built:
#                  `norm`, by every RMSNorm (sgl_kernel's rmsnorm / fused_add_rmsnorm call flashinfer.norm for
#                  bf16; the first H200 run, 2026-12-01, failed there when its norm.cu had been removed). No
#                  other FlashInfer kernel runs with attention_backend="triton", sampling_backend="pytorch",
#                  temperature 0, NVFP4 on Marlin (sglang_jit.py says where each was ruled out)
#   sglang         multimodal_gen/ (diffusion), srt/server/_core, srt/grpc/_core (the HTTP/gRPC servers)
#                  and srt/multimodal/_core (one multimodal processor)
# transformers is pinned ==5.12.1 by SGLang and the image's 5.17 breaks its import (sglang.srt.configs
# registers "qwen3_asr", which 5.17 already has); 5.12.1 caps tokenizers at <=0.23.0 (the image: 0.23.2).
# xgrammar: 0.2.9 from .vllm/deps instead of the pinned 0.2.1 (42.6 MB): SGLang imports only StructuralTag
# and xgrammar.structural_tag at module level, and the engine runs with grammar_backend="none".
SGLANG_VERSION=0.5.17
SGLANG_WHEELS=(
    "sglang==$SGLANG_VERSION" sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1
    transformers==5.12.1 tokenizers==0.22.2 openai==2.6.1 orjson==3.13.0 uvicorn==0.54.0
    ipython==9.18.1 traitlets==5.16.1
)
# what it imports that VLLM_DEPS already pins (carried once, in call 1)
SGLANG_FROM_VLLM=(
    annotated-types apache-tvm-ffi compressed-tensors dill distro fastapi gguf loguru msgspec
    partial-json-parser pybase64 pydantic pydantic-core pyzmq setproctitle sniffio starlette
    typing-extensions typing-inspection xgrammar
)
SGLANG_SLIM=(   # wheel-name prefix : zip patterns removed
    "sglang-:sglang/multimodal_gen/* sglang/srt/server/_core* sglang/srt/grpc/_core* sglang/srt/multimodal/_core*"
    "sglang_kernel-:sgl_kernel/flash_ops.abi3.so sgl_kernel/sm100/* sgl_kernel/infllm_ops* sgl_kernel/flashmla_ops.abi3.so"
    "flashinfer_python-:flashinfer/data/*"
)
# of what SGLANG_SLIM removes from a wheel, what FlashInfer JIT modules keep (wheel prefix : modules)
SGLANG_KEEP_FLASHINFER=("flashinfer_python-:norm")
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

slim_wheel() {   # slim_wheel WHL: remove SGLANG_SLIM's patterns from it, keeping SGLANG_KEEP_FLASHINFER's files
    local whl=$1 base spec pre pats keep k
    base=$(basename "$whl")
    for spec in "${SGLANG_SLIM[@]}"; do
        pre=${spec%%:*}; pats=${spec#*:}
        [[ $base == "$pre"* ]] || continue
        keep=""
        for k in "${SGLANG_KEEP_FLASHINFER[@]}"; do [[ $base == "${k%%:*}"* ]] && keep=${k#*:}; done
        if [ -n "$keep" ]; then
            # shellcheck disable=SC2086  # the patterns are zip's own wildcards
            (set -f; python3 benchmarks/gpu/sglang_jit.py drop-list "$whl" $pats --keep-flashinfer "$keep") \
                > "$whl.drop" || return 2
            [ -s "$whl.drop" ] && zip -q -d -nw "$whl" -@ < "$whl.drop"
            rm -f "$whl.drop"
        else
            # shellcheck disable=SC2086
            (set -f; zip -q -d "$whl" $pats)
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
        # pipeline.sh pack (GGUF parts, wiki, GSM8K) + the Austen novels: the paper runs and GPU tests read them
        bash benchmarks/gpu/papers.sh pack
        bash "$0" plan ;;
    pack-peers)
        # .whl-peers/{arrow,common,llmc}: carried in two calls (arrow: pyarrow alone; then common + llmc),
        # stashed like .whl
        mkdir -p .whl-peers; [ -f .whl-peers/.gitignore ] || echo '*' > .whl-peers/.gitignore
        rm -rf .whl-peers/arrow .whl-peers/common .whl-peers/llmc
        fetch .whl-peers/common "${PEERS[@]}"
        mkdir -p .whl-peers/arrow && mv .whl-peers/common/pyarrow-*.whl .whl-peers/arrow/
        fetch .whl-peers/llmc "${PEERS_LLMC[@]}"
        du -sh .whl-peers/arrow .whl-peers/common .whl-peers/llmc ;;
    install-peers)
        # /tmp/site-peers <- AutoRound + datasets; /tmp/site-llmc <- llm-compressor and the pins it differs in
        # (accuracy.sh puts the first, or both, on a peer worker's PYTHONPATH via QF_PEER_PYTHONPATH)
        for d in arrow common llmc; do
            src=.whl-peers/$d; ls "$src"/*.whl >/dev/null 2>&1 || src="$PARTS/.whl-peers/$d"
            dest=/tmp/site-peers; [ $d = llmc ] && dest=/tmp/site-llmc
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dest" \
                "$src"/*.whl || exit 2
        done
        PYTHONPATH=/tmp/site-peers:/tmp/site python3 -c "import auto_round, datasets; print('auto-round', auto_round.__version__)" || exit 2
        PYTHONPATH=/tmp/site-llmc:/tmp/site-peers:/tmp/site python3 -c "
import llmcompressor, compressed_tensors
print('llm-compressor', llmcompressor.__version__, '| compressed-tensors', compressed_tensors.__version__)" || exit 2 ;;
    resplit-vllm)
        # the staged vLLM zip cut again in PART_MIB parts, no download (the working tree grows with each
        # committed result; 58 MiB parts left 0.6 MiB of room on 2026-12-06, so 56 since): the parts are joined,
        # checked against the manifest's sha256, cut, and the manifest rewritten; then run pack-sglang again
        tmp=$(mktemp -d)
        cat .vllm/vllm.zip.part-* > "$tmp/vllm.zip"
        want=$(awk '$1 == "zip" {print $3}' .vllm/vllm.manifest)
        [ "$(sha256sum "$tmp/vllm.zip" | cut -d' ' -f1)" = "$want" ] \
            || { echo "resplit-vllm: the joined parts do not match the manifest's zip sha256" >&2; rm -rf "$tmp"; exit 2; }
        (cd "$tmp" && split -b "${PART_MIB}m" vllm.zip vllm.zip.part-)
        {
            grep '^wheel ' .vllm/vllm.manifest
            echo "zip vllm.zip $want $(stat -c %s "$tmp/vllm.zip")"
            for q in "$tmp"/vllm.zip.part-*; do echo "part $(basename "$q") $(sha256sum "$q" | cut -d' ' -f1)"; done
        } > "$tmp/vllm.manifest"
        rm -f .vllm/vllm.zip.part-* && mv "$tmp"/vllm.zip.part-* "$tmp/vllm.manifest" .vllm/
        rm -rf "$tmp"
        ls -l .vllm/vllm.zip.part-* ;;
    plan)
        # every call's carry list, sizes (tree included) checked against 64 MiB; SGLang's parts folded in
        python3 tools/gpu/carry_plan.py plan ;;
    pack-sglang)
        # SGLang's wheels, slimmed, in one tar cut into parts that fill the room of the calls above
        # (run after `pack`: the room is measured on what is staged then)
        mkdir -p .sglang; [ -f .sglang/.gitignore ] || echo '*' > .sglang/.gitignore
        rm -f .sglang/sglang.tar.part-* .sglang/sglang.manifest.json
        tmp=$(mktemp -d)
        fetch "$tmp/w" "${SGLANG_WHEELS[@]}"
        for spec in "${SGLANG_SLIM[@]}"; do
            whl=$(ls "$tmp/w/${spec%%:*}"*.whl)
            sha256sum "$whl" | cut -d' ' -f1 > "$whl.orig-sha256"
            slim_wheel "$whl" || { echo "pack-sglang: slimming $whl failed" >&2; exit 2; }
        done
        (cd "$tmp/w" && tar --sort=name --mtime=@0 --owner=0 --group=0 -cf "$tmp/sglang.tar" -- *.whl)
        python3 tools/gpu/carry_plan.py split "$tmp/sglang.tar" --out .sglang \
            --margin-kib "${SGLANG_MARGIN_KIB:-512}" > "$tmp/parts.json"
        python3 tools/gpu/carry_plan.py manifest --bundle "$tmp/sglang.tar" --wheels "$tmp/w" \
            --parts-json "$tmp/parts.json" --version "$SGLANG_VERSION" --shared "${SGLANG_FROM_VLLM[*]}" \
            --slim "${SGLANG_SLIM[@]}" --keep "${SGLANG_KEEP_FLASHINFER[@]}"
        rm -rf "$tmp"
        bash "$0" plan ;;
    slim-wheel)
        [ -f "${2:-}" ] || { echo "usage: $0 slim-wheel WHEEL" >&2; exit 2; }
        slim_wheel "$2" ;;
    stage-jit)
        # caches an earlier GPU run sent back ($OUT/jit-tvmffi.tgz, jit-flashinfer.tgz): checked, copied to
        # .sglang/jit with their sha256 and stamp, then the plan (they ride before the warm-up)
        shift
        mkdir -p .sglang; [ -f .sglang/.gitignore ] || echo '*' > .sglang/.gitignore
        python3 benchmarks/gpu/sglang_jit.py stage "$@" --dest .sglang/jit || exit 2
        bash "$0" plan ;;
    link)
        # a source tree run without pip install: the folders setup.py maps into the package (package_dir)
        # become links inside it, so qatfactory.exporters / qatfactory.readers import as on an installed copy
        t=${2:-$PWD}
        for d in exporters readers; do
            [ -e "$t/qatfactory/$d" ] || [ ! -d "$t/$d" ] || ln -s "../$d" "$t/qatfactory/$d"
        done ;;
    stash)
        mkdir -p "$PARTS"
        for src in .whl .vllm/deps .whl-peers/arrow .whl-peers/common .whl-peers/llmc; do
            [ -d "$src" ] || continue
            mkdir -p "$PARTS/$src"; cp -n "$src"/*.whl "$PARTS/$src/" 2>/dev/null || true
        done
        for f in .vllm/vllm.manifest .vllm/vllm.zip.part-* .sglang/sglang.manifest.json .sglang/sglang.tar.part-*; do
            [ -f "$f" ] && cp "$f" "$PARTS/"
        done
        if [ -d .sglang/jit ]; then mkdir -p "$PARTS/jit"; cp .sglang/jit/*.tgz .sglang/jit/*.json "$PARTS/jit/" 2>/dev/null || true; fi
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
    install-sglang)
        # /tmp/sgsite: SGLang's bundle (parts and wheels sha256-checked) + the pins it shares with vLLM
        [ -f "$PARTS/sglang.manifest.json" ] || { echo "no $PARTS/sglang.manifest.json: carry .sglang/ and stash it" >&2; exit 2; }
        rm -rf /tmp/sgwheels /tmp/sgsite/.qf-installed
        python3 tools/gpu/carry_plan.py assemble --parts "$PARTS" --dest /tmp/sgwheels >/dev/null || exit 2
        shared=()
        for n in "${SGLANG_FROM_VLLM[@]}"; do
            f=$(ls "$PARTS/.vllm/deps/" 2>/dev/null | grep -i "^${n//-/_}-[0-9]" | head -1 || true)
            [ -n "$f" ] || { echo "install-sglang: $n not in $PARTS/.vllm/deps (carry .vllm/deps first)" >&2; exit 2; }
            shared+=("$PARTS/.vllm/deps/$f")
        done
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sgsite \
            /tmp/sgwheels/*.whl "${shared[@]}" || exit 2
        rm -rf /tmp/sgwheels
        # the modules an offline Engine imports; sgl_kernel loads its Hopper ops against the image's torch
        PYTHONPATH=/tmp/sgsite python3 -c "
import sgl_kernel, flashinfer, transformers
from sglang.srt.entrypoints.engine import Engine
import sglang.srt.managers.scheduler, sglang.srt.model_executor.model_runner, sglang.srt.models.llama
import sglang.srt.layers.attention.triton_backend, sglang.srt.layers.quantization.modelopt_quant
import sglang.srt.layers.sampler, sglang.srt.model_loader.loader, sglang.srt.managers.detokenizer_manager
print('SGLang import OK: sglang-kernel', sgl_kernel.__version__, '| flashinfer', flashinfer.__version__,
      '| transformers', transformers.__version__, '|', sgl_kernel.common_ops.__file__)" || exit 2
        touch /tmp/sgsite/.qf-installed    # engines.sh sglang waits for this marker
        echo "SGLang $SGLANG_VERSION in /tmp/sgsite ($(du -sh /tmp/sgsite | cut -f1))" ;;
    *) echo "usage: $0 pack|pack-peers|install-peers|pack-sglang|resplit-vllm|plan|stage-jit|slim-wheel|stash|install-ours|install-vllm-deps|install-vllm|install-sglang" >&2; exit 2 ;;
esac
