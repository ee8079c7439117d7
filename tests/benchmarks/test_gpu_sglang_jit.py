"""SGLang's JIT kernels on the H200 (benchmarks/gpu/sglang_jit.py, stage.sh slim-wheel / stage-jit, the warm-up
in engines_sglang.py): what the carried FlashInfer keeps for the one FlashInfer JIT module SGLang
builds on our path (`norm`, whose missing norm.cu failed the first H200 run, 2026-12-01), and the built
caches carried from one GPU machine to the next, which must be refused when another torch/nvcc/GPU built them.

The staged-wheel checks use .sglang/ (stage.sh pack-sglang) and nvcc when they are here; the synthetic-wheel
checks need neither."""
import ast
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
sys.path.insert(0, str(REPO / "tools" / "gpu"))
import carry_plan as CP  # noqa: E402
import engines_sglang as ES  # noqa: E402
import sglang_jit as J  # noqa: E402

FI_WHEEL = "flashinfer_python-0.6.15.post1-py3-none-any.whl"


# ------------------------------------------------------------------ the slim rule, on a synthetic wheel
def _wheel(path: Path, files: dict) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n, data in files.items():
            z.writestr(n, data)
    return path


D = "flashinfer/data/"
SYNTH = {
    "flashinfer/__init__.py": "x = 1\n",
    "flashinfer/jit/norm.py": "# spec\n",
    D + "csrc/norm.cu": '#include "tvm_ffi_utils.h"\n#include <flashinfer/norm.cuh>\n#include <cuda_runtime.h>\n',
    D + "csrc/flashinfer_norm_binding.cu": '#include "tvm_ffi_utils.h"\n',
    D + "csrc/tvm_ffi_utils.h": "#include <tvm/ffi/function.h>\n",
    D + "csrc/batch_decode.cu": '#include <flashinfer/attention/decode.cuh>\n',
    D + "include/flashinfer/norm.cuh": '#include "utils.cuh"\n#if 0\n  #  include <flashinfer/trtllm/x.h>\n#endif\n'
                                      '#include <cub/cub.cuh>\n',
    D + "include/flashinfer/utils.cuh": "#pragma once\n",
    D + "include/flashinfer/trtllm/x.h": "#pragma once\n",
    D + "include/flashinfer/attention/decode.cuh": "#pragma once\n",
    D + "cccl/cub/cub/cub.cuh": "#include <cuda/std/type_traits>\n",
    D + "cccl/cub/cub/agent/unused_by_norm.cuh": "//\n",
    D + "cccl/libcudacxx/include/cuda/std/type_traits": "//\n",
    D + "cccl/thrust/thrust/pair.h": "//\n",
    D + "cccl/python/cuda_cccl/x.py": "#\n",
    D + "cccl/benchmarks/b.cu": "//\n",
    D + "cutlass/include/cutlass/cutlass.h": "//\n",
    D + "spdlog/include/spdlog/spdlog.h": "//\n",
    D + "build_backend.py": "#\n",
}
KEPT = {D + n for n in ("csrc/norm.cu", "csrc/flashinfer_norm_binding.cu", "csrc/tvm_ffi_utils.h",
                        "include/flashinfer/norm.cuh", "include/flashinfer/utils.cuh", "include/flashinfer/trtllm/x.h",
                        "cccl/cub/cub/cub.cuh", "cccl/cub/cub/agent/unused_by_norm.cuh",
                        "cccl/libcudacxx/include/cuda/std/type_traits", "cccl/thrust/thrust/pair.h")}


def test_stage_sh_slims_flashinfer_to_what_its_norm_module_builds_from(tmp_path):
    """The packing code itself (stage.sh's slim rules, as pack-sglang applies them) on a wheel shaped like
    FlashInfer's: norm.cu, what it includes (conditions ignored) and CCCL stay; the rest of flashinfer/data
    goes; nothing outside it is touched."""
    whl = _wheel(tmp_path / FI_WHEEL, SYNTH)
    r = subprocess.run(["bash", "tools/gpu/stage.sh", "slim-wheel", str(whl)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    names = set(zipfile.ZipFile(whl).namelist())
    assert {n for n in names if n.startswith(D)} == KEPT
    assert {"flashinfer/__init__.py", "flashinfer/jit/norm.py"} <= names
    assert zipfile.ZipFile(whl).read(D + "csrc/norm.cu") == SYNTH[D + "csrc/norm.cu"].encode()


def test_stage_sh_still_slims_the_other_wheels_by_pattern(tmp_path):
    whl = _wheel(tmp_path / "sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl",
                 {"sgl_kernel/flash_ops.abi3.so": "x", "sgl_kernel/sm100/common_ops.abi3.so": "x",
                  "sgl_kernel/sm90/common_ops.abi3.so": "x", "sgl_kernel/elementwise.py": "x"})
    r = subprocess.run(["bash", "tools/gpu/stage.sh", "slim-wheel", str(whl)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert set(zipfile.ZipFile(whl).namelist()) == {"sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/elementwise.py"}


def test_stage_sh_keeps_every_flashinfer_module_it_names_and_only_known_ones():
    text = (REPO / "tools/gpu/stage.sh").read_text()
    m = re.search(r"^SGLANG_KEEP_FLASHINFER=\(([^)]*)\)", text, re.M)
    assert m, "stage.sh has no SGLANG_KEEP_FLASHINFER: FlashInfer would be carried without its JIT sources"
    keep = dict(x.strip('"').split(":", 1) for x in m.group(1).split())
    mods = keep["flashinfer_python-"].split(",")
    assert "norm" in mods and set(mods) <= set(J.FLASHINFER_MODULES)
    assert '"flashinfer_python-:flashinfer/data/*"' in text       # the rest of flashinfer/data still removed


def test_include_closure_follows_includes_and_says_what_it_could_not_find():
    names = set(SYNTH)
    read = lambda n: SYNTH[n].encode()  # noqa: E731
    un = set()
    got = J.include_closure(names, read, ["csrc/norm.cu", "csrc/flashinfer_norm_binding.cu"], un)
    assert got == {n for n in KEPT if "/cccl/" not in n} | {D + "cccl/cub/cub/cub.cuh",
                                                            D + "cccl/libcudacxx/include/cuda/std/type_traits"}
    assert un == {"cuda_runtime.h", "tvm/ffi/function.h"}
    with pytest.raises(FileNotFoundError, match="csrc/gone.cu"):
        J.include_closure(names, read, ["csrc/gone.cu"])
    with pytest.raises(KeyError, match="sampling"):
        J.keep_names(names, read, ["sampling"])


# ------------------------------------------------------------------ the staged wheels (pack-sglang), if here
def _staged_wheels(tmp_path: Path) -> Path:
    if not (REPO / CP.SGLANG_DIR / CP.MANIFEST).exists():
        pytest.skip("no .sglang/ staged here (bash tools/gpu/stage.sh pack-sglang): the synthetic-wheel "
                    "tests above check the slim rule without it")
    man = json.loads((REPO / CP.SGLANG_DIR / CP.MANIFEST).read_text())
    out = tmp_path / "w"
    CP.assemble(REPO / CP.SGLANG_DIR, man, out)
    return out


def _gen_sources(py: str, fn: str):
    """The source files a gen_*_module function names: `<dir> / "file"` expressions, in order."""
    tree = ast.parse(py)
    f = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == fn)
    return [(ast.unparse(n.left), n.right.value) for n in ast.walk(f) if isinstance(n, ast.BinOp)
            and isinstance(n.op, ast.Div) and isinstance(n.right, ast.Constant) and isinstance(n.right.value, str)]


def test_staged_flashinfer_has_every_file_its_norm_spec_and_includes_name(tmp_path):
    w = _staged_wheels(tmp_path)
    z = zipfile.ZipFile(w / FI_WHEEL)
    names = {i.filename for i in z.infolist() if not i.is_dir()}
    # the wheel's own spec names the sources our table keeps (flashinfer/jit/norm.py)
    srcs = _gen_sources(z.read("flashinfer/jit/norm.py").decode(), "gen_norm_module")
    assert [(d, f) for d, f in srcs] == [("jit_env.FLASHINFER_CSRC_DIR", Path(s).name)
                                         for s in J.FLASHINFER_MODULES["norm"].sources]
    env = z.read("flashinfer/jit/env.py").decode()
    assert 'FLASHINFER_CSRC_DIR: pathlib.Path = _package_root / "data" / "csrc"' in env
    for d in J.FI_INCLUDE_DIRS:                                   # the include roots we resolve against
        assert " / ".join(f'"{p}"' for p in d.split("/")) in env, d
    # and SGLang still reaches it the way FLASHINFER_MODULES says
    k = zipfile.ZipFile(next(w.glob("sglang_kernel-*.whl"))).read("sgl_kernel/elementwise.py").decode()
    assert "_flashinfer_norm.rmsnorm(" in k and "_flashinfer_norm.fused_add_rmsnorm(" in k
    fi_norm = z.read("flashinfer/norm/__init__.py").decode()
    assert "return gen_norm_module().build_and_load()" in fi_norm
    un = set()
    for m in J.FLASHINFER_MODULES.values():
        J.include_closure(names, z.read, m.sources, un)           # raises if a source was removed
    lost = sorted(u for u in un if u.startswith("flashinfer/") or (D + "include/" + u) in SYNTH)
    assert not lost, f"headers of FlashInfer's own tree missing from the carried wheel: {lost}"


def test_nvcc_preprocesses_the_staged_norm_module(tmp_path):
    """An oracle apart from our include scan: nvcc's own preprocessor (-M, sm_90a, FlashInfer's include roots
    and defines: flashinfer/jit/core.py gen_jit_spec, jit/norm.py, cpp_ext.py build_common_cflags) finds every
    header of the carried norm module. cuBLAS/cuRAND headers, absent from the toolkit here, are empty stubs:
    they come from the GPU machine's CUDA (sglang_jit.cuda_env)."""
    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("no nvcc on this machine")
    w = _staged_wheels(tmp_path)
    site = tmp_path / "site"
    zipfile.ZipFile(w / FI_WHEEL).extractall(site)
    tvm = next((REPO / ".vllm/deps").glob("apache_tvm_ffi-*.whl"), None)
    if tvm is None:
        pytest.skip("no apache_tvm_ffi wheel in .vllm/deps (stage.sh pack)")
    with zipfile.ZipFile(tvm) as z:
        z.extractall(site, [n for n in z.namelist() if n.startswith("tvm_ffi/include/")])
    stub = tmp_path / "stub"
    stub.mkdir()
    for h in ("cublasLt.h", "cublas_v2.h", "curand_kernel.h"):
        (stub / h).write_text("#pragma once\n")
    data = site / "flashinfer" / "data"
    flags = [f"-I{data / d}" for d in J.FI_INCLUDE_DIRS[:3]]
    flags += [x for d in [site / "tvm_ffi" / "include"] + [data / d for d in J.FI_INCLUDE_DIRS[3:]] + [stub]
              for x in ("-isystem", str(d))]
    flags += ["-std=c++17", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a", "-DNDEBUG",
              "-DFLASHINFER_ENABLE_F16", "-DFLASHINFER_ENABLE_BF16", "-DFLASHINFER_ENABLE_FP8_E4M3",
              "-DFLASHINFER_ENABLE_FP8_E5M2", "-DFLASHINFER_ENABLE_FP8_E8M0", "-DFLASHINFER_ENABLE_FP4_E2M1",
              "-DENABLE_BF16", "-DENABLE_FP8", "-DPy_LIMITED_API=0x03090000"]
    for src in J.FLASHINFER_MODULES["norm"].sources:
        r = subprocess.run([nvcc, *flags, "-M", str(data / src), "-o", str(tmp_path / "dep.d")], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        deps = (tmp_path / "dep.d").read_text()
        assert str(data / "include" / "flashinfer" / "norm.cuh") in deps or src.endswith("binding.cu")


# ------------------------------------------------------------------ carried caches
STAMP = {"torch": "2.11.0+cu130", "torch_cuda": "13.0", "nvcc": "13.0", "capability": "9.0", "python": "3.12",
         "tvm_ffi": "0.1.11", "sglang": "0.5.17", "flashinfer": "0.6.15.post1", "flashinfer_extra_cudaflags": ""}


def _cache_dir(root: Path) -> Path:
    for d, f in (("mod_a__arch_9.0a__tvmffi_0.1.11", "mod_a.so"), ("norm", "norm.so")):
        (root / d).mkdir(parents=True)
        (root / d / f).write_bytes(os.urandom(64))
        (root / d / "cuda_0.o").write_bytes(b"obj")
        (root / d / ".ninja_log").write_text("log")
    (root / "tmp").mkdir()
    (root / "tmp" / "x.so").write_bytes(b"lock dir")
    return root


def test_pack_keeps_only_built_modules_and_the_stamp(tmp_path, monkeypatch):
    root = _cache_dir(tmp_path / "c")
    monkeypatch.setattr(J, "cache_roots", lambda kind: root)
    rec = J.pack("tvmffi", tmp_path / "jit-tvmffi.tgz", dict(STAMP))
    assert rec["modules"] == ["mod_a__arch_9.0a__tvmffi_0.1.11/mod_a.so", "norm/norm.so"]
    with tarfile.open(tmp_path / "jit-tvmffi.tgz") as tf:
        assert sorted(tf.getnames()) == sorted([J.STAMP] + rec["modules"])
    st, mods = J.read_cache(tmp_path / "jit-tvmffi.tgz")
    assert st["kind"] == "tvmffi" and st["torch"] == "2.11.0+cu130" and mods == rec["modules"]


def test_unpack_installs_only_for_the_same_builder_and_skips_what_is_there(tmp_path, monkeypatch):
    root = _cache_dir(tmp_path / "c")
    monkeypatch.setattr(J, "cache_roots", lambda kind: root)
    aot = tmp_path / "carried"                       # FlashInfer's AOT folder: a module carried earlier is packed too
    (aot / "rope").mkdir(parents=True)
    (aot / "rope" / "rope.so").write_bytes(b"carried")
    monkeypatch.setattr(J, "install_root", lambda kind: aot)
    tgz = tmp_path / "jit-flashinfer.tgz"
    assert J.pack("flashinfer", tgz, dict(STAMP))["modules"] == ["mod_a__arch_9.0a__tvmffi_0.1.11/mod_a.so",
                                                                  "norm/norm.so", "rope/rope.so"]
    dest = tmp_path / "aot"
    (dest / "norm").mkdir(parents=True)
    (dest / "norm" / "norm.so").write_bytes(b"already here")
    rec = J.unpack(tgz, dict(STAMP), dest)
    assert rec["used"] and rec["installed"] == ["mod_a__arch_9.0a__tvmffi_0.1.11/mod_a.so", "rope/rope.so"]
    assert rec["already_there"] == ["norm/norm.so"] and (dest / "norm" / "norm.so").read_bytes() == b"already here"
    assert (dest / "mod_a__arch_9.0a__tvmffi_0.1.11" / "mod_a.so").read_bytes() == \
        (root / "mod_a__arch_9.0a__tvmffi_0.1.11" / "mod_a.so").read_bytes()
    # built by another torch or nvcc, or with other FlashInfer flags: refused, nothing written
    for k, v in (("torch", "2.12.0+cu130"), ("nvcc", "12.8"), ("capability", "10.0"),
                 ("flashinfer_extra_cudaflags", "-isystem /x")):
        d2 = tmp_path / f"aot-{k}"
        rec = J.unpack(tgz, dict(STAMP, **{k: v}), d2)
        assert rec["used"] is False and k in rec["why"] and not d2.exists()
    # the tvm-ffi kind does not look at FlashInfer's version
    t2 = tmp_path / "jit-tvmffi.tgz"
    J.pack("tvmffi", t2, dict(STAMP))
    assert J.unpack(t2, dict(STAMP, flashinfer="0.7"), tmp_path / "t2")["used"]


def test_a_tampered_cache_is_refused_before_anything_is_written(tmp_path):
    evil = tmp_path / "evil.tgz"
    with tarfile.open(evil, "w:gz") as tf:
        for name, data in ((J.STAMP, json.dumps(dict(STAMP, kind="tvmffi")).encode()), ("../escape.so", b"x"),
                           ("a/a.so", b"y")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError, match="unexpected members"):
        J.unpack(evil, dict(STAMP), tmp_path / "dest")
    assert not (tmp_path / "dest").exists() and not (tmp_path / "escape.so").exists()
    nostamp = tmp_path / "nostamp.tgz"
    with tarfile.open(nostamp, "w:gz") as tf:
        info = tarfile.TarInfo("a/a.so")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"y"))
    with pytest.raises(ValueError, match="no qf-jit-stamp.json"):
        J.read_cache(nostamp)


def test_repack_legacy_and_stage_record_what_is_carried(tmp_path):
    """The tvm-ffi cache of the first H200 run predates stamps: its .so files are kept with a stated stamp."""
    old = tmp_path / "qf-tvmffi.tgz"
    src = _cache_dir(tmp_path / "old")
    with tarfile.open(old, "w:gz") as tf:
        tf.add(src, arcname=".")
    with pytest.raises(ValueError, match="lacks"):
        J.repack_legacy(old, "tvmffi", {"torch": "2.11.0+cu130"}, tmp_path / "x.tgz")
    rec = J.repack_legacy(old, "tvmffi", {k: STAMP[k] for k in J.STAMP_KEYS["tvmffi"]}, tmp_path / "jit.tgz")
    assert rec["modules"] == ["mod_a__arch_9.0a__tvmffi_0.1.11/mod_a.so", "norm/norm.so"]
    man = J.stage([tmp_path / "jit.tgz"], tmp_path / "stage", "from the first run")
    c = man["caches"]["tvmffi"]
    assert c["file"] == "tvmffi.tgz" and c["sha256"] == hashlib.sha256((tmp_path / "stage" / "tvmffi.tgz").read_bytes()).hexdigest()
    assert c["stamp"]["torch"] == "2.11.0+cu130" and c["note"] == "from the first run"
    assert json.loads((tmp_path / "stage" / J.JIT_MANIFEST).read_text()) == man


def test_the_staged_tvmffi_cache_is_the_first_runs_marlin(tmp_path):
    man_p = REPO / J.JIT_DIR / J.JIT_MANIFEST
    if not man_p.exists():
        pytest.skip("no .sglang/jit staged here (bash tools/gpu/stage.sh stage-jit)")
    man = json.loads(man_p.read_text())
    for kind, c in man["caches"].items():
        assert hashlib.sha256((REPO / J.JIT_DIR / c["file"]).read_bytes()).hexdigest() == c["sha256"]
        st, mods = J.read_cache(REPO / J.JIT_DIR / c["file"])
        assert st["kind"] == kind and mods == c["modules"] and all(k in st for k in J.STAMP_KEYS[kind])


def test_cuda_env_adds_the_cuda_wheels_headers_and_a_libcuda_link_only_when_missing(tmp_path):
    home = tmp_path / "cuda"
    (home / "include").mkdir(parents=True)
    sp = tmp_path / "site"
    inc = sp / "nvidia" / "cu13" / "include"
    inc.mkdir(parents=True)
    for h in ("cublasLt.h", "cublas_v2.h", "curand_kernel.h"):
        (inc / h).write_text("//\n")
    ld = "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
    lines = J.cuda_env(tmp_path / "link", str(home), [str(sp)], ld)
    assert f"export FLASHINFER_EXTRA_CUDAFLAGS='-isystem {inc}'" in lines
    assert f"export FLASHINFER_EXTRA_LDFLAGS='-L{tmp_path / 'link'}'" in lines
    assert os.readlink(tmp_path / "link" / "libcuda.so") == "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    # a full toolkit (headers and the driver stub): nothing exported
    for h in ("cublasLt.h", "cublas_v2.h", "curand_kernel.h"):
        (home / "include" / h).write_text("//\n")
    (home / "lib64" / "stubs").mkdir(parents=True)
    (home / "lib64" / "stubs" / "libcuda.so").write_text("")
    assert not [x for x in J.cuda_env(tmp_path / "link2", str(home), [str(sp)], "") if x.startswith("export")]
    assert not (tmp_path / "link2").exists()


# ------------------------------------------------------------------ the warm-up, without SGLang
def test_warm_up_records_its_failure_and_finishes(tmp_path):
    """Without SGLang (here) the warm-up records why and says done, so call 8 does not wait for it."""
    import argparse
    ES.warm(argparse.Namespace(work=str(tmp_path), jit_dir=str(tmp_path / "none")))
    rec = json.loads((tmp_path / "sglang-warm.json").read_text())
    assert rec["done"] and "ModuleNotFoundError" in rec["error"]


def test_model_shape_gives_the_jit_template_arguments(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"hidden_size": 576, "num_attention_heads": 9,
                                                             "num_key_value_heads": 3}))
    (tmp_path / "students.json").write_text(json.dumps({"prep": {"model_dir": str(tmp_path / "m")}}))
    assert ES._model_shape(tmp_path) == {"head_dim": 64, "kv_heads": 3, "rotary_dim": 64}


def test_describe_names_flashinfer_modules_and_where_they_came_from():
    v = {"jit_modules": {"present": [], "built_here": [], "flashinfer_present": ["aot:norm", "jit:sampling"],
                         "flashinfer_built_here": ["jit:sampling"]}}
    assert ES.describe(v) == ["FlashInfer JIT norm (carried from an earlier run)",
                              "FlashInfer JIT sampling (built in this run)"]
