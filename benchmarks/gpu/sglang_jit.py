"""SGLang's JIT kernels on the H200: what the carried FlashInfer keeps, what the warm-up builds, and the built
caches carried from one GPU machine to the next (tools/gpu/stage.sh pack-sglang / stage-jit, engines.sh).

An offline ``sglang.Engine`` (0.5.17, attention_backend="triton", sampling_backend="pytorch",
grammar_backend="none", CUDA graphs on) compiles two kinds of kernels at first use, read from the wheels'
source on 2026-12-01:

* FlashInfer's own JIT modules (``flashinfer.jit.*.gen_*_module().build_and_load()``: nvcc + ninja on the
  sources under ``flashinfer/data``), one per row of ``FLASHINFER_MODULES``. For Llama (bf16 and ModelOpt
  NVFP4 W4A4 -> FP4 Marlin) that is ``norm`` alone: every RMSNorm goes through sgl_kernel's ``rmsnorm`` /
  ``fused_add_rmsnorm``, which call ``flashinfer.norm`` for fp16/bf16 inputs. Nothing else of FlashInfer
  runs there: the sampler samples greedily with torch (temperature 0; sampling_backend="pytorch" never calls
  FlashInfer's top-k/top-p), the Triton backend's kv-indices kernel is SGLang's own Triton code, NVFP4 below
  SM100 is Marlin (SGLang's JIT), bf16 linears are F.linear, no FlashInfer autotune (no flashinfer_* GEMM/MoE
  backend). ``pack-sglang`` keeps exactly those modules' sources and headers (``keep_names``).
* SGLang's own tvm-ffi JIT modules (``sglang.kernels.jit.utils.load_jit``), cached by TVM_FFI_CACHE_DIR:
  engines_sglang.py ``warm`` builds the ones the Llama path reaches (Marlin for NVFP4, SiLU-and-mul, RoPE,
  the KV-cache store, decode positions) with the template arguments the model's config gives them.

Caches built on the H200 come back as tarballs (engines.sh call 8) holding only the built ``.so`` files and a
stamp of what built them; a later GPU run carries them (``.sglang/jit``) and ``unpack`` installs them before
the warm-up only when the stamp equals the machine's own: neither cache key says which torch or nvcc built
a module (tvm-ffi's build folder names the source hash, GPU arch and tvm-ffi version; FlashInfer's names
its version and arch, and its ninja check covers command line and file times, not the compiler's
version), so a cache built on another image could otherwise be loaded.

    python benchmarks/gpu/sglang_jit.py drop-list WHEEL PATTERN... --keep-flashinfer norm   # names to remove
    python benchmarks/gpu/sglang_jit.py cuda-env              # GPU machine: FlashInfer's extra nvcc/ld flags
    python benchmarks/gpu/sglang_jit.py pack --kind tvmffi|flashinfer --out X.tgz          # GPU machine
    python benchmarks/gpu/sglang_jit.py unpack X.tgz...       # GPU machine, SGLang's Python path
    python benchmarks/gpu/sglang_jit.py stage X.tgz... --dest .sglang/jit                   # here
    python benchmarks/gpu/sglang_jit.py repack-legacy OLD.tgz --kind tvmffi --stamp JSON --out X.tgz
"""
from __future__ import annotations

import argparse
import fnmatch
import glob
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set

# carry_plan.py lives in tools/gpu, found from the repository root: a device call carries the whole working tree
# (tools/ with it), and engines.sh's background copy in /tmp/qf-sgwarm keeps the same layout
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu"))
from carry_plan import sha256  # noqa: E402  (the staging's one file digest)

FI_DATA = "flashinfer/data/"
# the include roots FlashInfer's JIT hands nvcc, relative to flashinfer/data, in its order
# (flashinfer/jit/env.py CCCL_INCLUDE_DIRS, FLASHINFER_INCLUDE_DIR, FLASHINFER_CSRC_DIR, CUTLASS_INCLUDE_DIRS,
# SPDLOG_INCLUDE_DIR; cpp_ext.py build_common_cflags: the CCCL ones as -I, the rest as -isystem)
FI_INCLUDE_DIRS = ("cccl/cub", "cccl/libcudacxx/include", "cccl/thrust", "include", "csrc", "cutlass/include",
                   "cutlass/tools/util/include", "spdlog/include")
# FlashInfer's vendored CCCL is kept whole (2.8 MB compressed): it is put ahead of the CUDA toolkit's copy
# (-I), and the toolkit's own headers include it too (cooperative_groups/reduce.h -> <cuda/std/type_traits>),
# so which of its files a build reads depends on the toolkit's version, not only on FlashInfer's sources.
FI_KEEP_TREES = ("cccl/cub/cub/", "cccl/libcudacxx/include/", "cccl/thrust/thrust/")


@dataclass(frozen=True)
class FiModule:
    name: str          # the JIT module's name (its build folder under .../cached_ops/)
    gen: str           # "module:function" returning its JitSpec
    sources: tuple     # the spec's source files, relative to flashinfer/data
    reached_by: str    # the SGLang code path that builds it


FLASHINFER_MODULES: Dict[str, FiModule] = {
    "norm": FiModule(
        "norm", "flashinfer.jit.norm:gen_norm_module", ("csrc/norm.cu", "csrc/flashinfer_norm_binding.cu"),
        "sglang/srt/layers/layernorm.py:484,486 RMSNorm.forward_cuda -> sgl_kernel/elementwise.py:120,160 "
        "rmsnorm/fused_add_rmsnorm (fp16/bf16) -> flashinfer/norm/__init__.py:161 get_norm_module() -> "
        "flashinfer/jit/norm.py:21 gen_norm_module (CUDA path: nvidia-cutlass-dsl absent, norm/__init__.py:60-71)"),
}

_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.M)


def include_closure(names: Set[str], read: Callable[[str], bytes], sources: Iterable[str],
                    unresolved: Optional[Set[str]] = None) -> Set[str]:
    """The files of flashinfer/data that `sources` include, transitively: every #include whose target is one of
    `names` (relative to the including file for "...", then each include root), preprocessor conditions
    ignored, so it is a superset of what one compiler's build reads. Includes found nowhere in `names` (the
    CUDA toolkit's, the C++ library's, tvm-ffi's, or a removed file) are added to `unresolved`."""
    seen: Set[str] = set()
    stack = [FI_DATA + s for s in sources]
    for s in stack:
        if s not in names:
            raise FileNotFoundError(f"{s}: named by a FlashInfer JIT spec but not in the wheel")
    while stack:
        f = stack.pop()
        if f in seen:
            continue
        seen.add(f)
        for kind, inc in _INCLUDE.findall(read(f)):
            inc = inc.decode().strip()
            cands = [os.path.normpath(os.path.join(os.path.dirname(f), inc))] if kind == b'"' else []
            cands += [os.path.normpath(f"{FI_DATA}{d}/{inc}") for d in FI_INCLUDE_DIRS]
            found = [c for c in cands if c in names]
            if not found and unresolved is not None:
                unresolved.add(inc)
            stack += [c for c in found if c not in seen]
    return seen


def keep_names(names: Iterable[str], read: Callable[[str], bytes], modules: Sequence[str]) -> Set[str]:
    """What of flashinfer/data the FlashInfer JIT `modules` need: their sources, the headers those include
    from FlashInfer's own trees, and the CCCL include trees whole."""
    names = set(names)
    keep = {n for n in names if any(n.startswith(FI_DATA + t) for t in FI_KEEP_TREES)}
    for m in modules:
        if m not in FLASHINFER_MODULES:
            raise KeyError(f"unknown FlashInfer JIT module {m!r}; known: {sorted(FLASHINFER_MODULES)}")
        keep |= include_closure(names, read, FLASHINFER_MODULES[m].sources)
    return keep


def drop_list(wheel: Path, patterns: Sequence[str], keep_modules: Sequence[str]) -> List[str]:
    """Members of `wheel` that match a pattern (zip's wildcards, as zip -d reads them) and are not kept."""
    with zipfile.ZipFile(wheel) as z:
        names = [i.filename for i in z.infolist() if not i.is_dir()]
        keep = keep_names(names, z.read, keep_modules) if keep_modules else set()
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns) and n not in keep]


# ----------------------------------------------------------------------------------- GPU machine side
STAMP_KEYS = {"tvmffi": ("torch", "torch_cuda", "nvcc", "capability", "python", "tvm_ffi", "sglang"),
              "flashinfer": ("torch", "torch_cuda", "nvcc", "capability", "python", "tvm_ffi", "flashinfer",
                             "flashinfer_extra_cudaflags")}
STAMP = "qf-jit-stamp.json"


def nvcc_release() -> str:
    """`release X.Y` of the nvcc the JIT builds use (CUDA_HOME's, else the one on PATH), as both SGLang's and
    FlashInfer's JIT read it."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = str(Path(home) / "bin" / "nvcc") if home else "nvcc"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"none ({type(e).__name__})"
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def current_stamp() -> Dict[str, str]:
    """What builds a JIT module on this machine (run in SGLang's Python path, a GPU visible)."""
    import flashinfer
    import sglang
    import torch
    import tvm_ffi
    major, minor = torch.cuda.get_device_capability(0)
    return {"torch": torch.__version__, "torch_cuda": str(torch.version.cuda), "nvcc": nvcc_release(),
            "capability": f"{major}.{minor}", "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
            "tvm_ffi": str(tvm_ffi.__version__), "sglang": sglang.__version__, "flashinfer": flashinfer.__version__,
            "flashinfer_extra_cudaflags": os.environ.get("FLASHINFER_EXTRA_CUDAFLAGS", "")}


def stamp_mismatch(kind: str, theirs: Dict[str, str], ours: Dict[str, str]) -> List[str]:
    return [f"{k}: cache {theirs.get(k)!r} vs here {ours.get(k)!r}" for k in STAMP_KEYS[kind]
            if theirs.get(k) != ours.get(k)]


def cache_roots(kind: str) -> Path:
    """Where `kind`'s built modules live: tvm-ffi's cache folder, or FlashInfer's JIT folder."""
    if kind == "tvmffi":
        return Path(os.environ.get("TVM_FFI_CACHE_DIR", "~/.cache/tvm-ffi")).expanduser()
    from flashinfer.jit import env as jit_env
    return Path(jit_env.FLASHINFER_JIT_DIR)


def install_root(kind: str) -> Path:
    """Where a carried module is put: tvm-ffi's cache folder (load_jit loads a `<dir>/<module>.so` it finds
    there without building), FlashInfer's AOT folder (build_and_load loads `<name>/<name>.so` from it
    without building; the JIT folder's ninja would rebuild, the installed sources being newer)."""
    if kind == "tvmffi":
        return cache_roots("tvmffi")
    from flashinfer.jit import env as jit_env
    return Path(jit_env.FLASHINFER_AOT_DIR)


def _module_files(root: Path) -> List[str]:
    """`<dir>/<dir-or-module>.so` below root: one built module each (tmp/, objects and ninja files left out)."""
    if not root.is_dir():
        return []
    return sorted(f"{p.parent.name}/{p.name}" for p in root.glob("*/*.so") if p.is_file() and p.parent.name != "tmp")


def _member_ok(name: str) -> bool:
    """A built module's path: `<dir>/<x>.so`, one folder deep, no dot-files, not FlashInfer's tmp/ (its locks)."""
    parts = name.split("/")
    return (len(parts) == 2 and all(parts) and parts[1].endswith(".so") and not any(p.startswith(".") for p in parts)
            and parts[0] != "tmp" and "\\" not in name)


def pack(kind: str, out: Path, stamp: Optional[Dict[str, str]] = None) -> Dict[str, object]:
    """Tar `kind`'s built modules with the stamp of this machine (atomically); FlashInfer's from its JIT folder
    and the carried ones in its AOT folder. Returns the record."""
    roots = [cache_roots(kind)] + ([install_root(kind)] if kind == "flashinfer" else [])
    where: Dict[str, Path] = {}
    for r in roots:
        for f in _module_files(r):
            where.setdefault(f, r)
    files = sorted(where)
    st = dict(stamp if stamp is not None else current_stamp(), kind=kind, packed=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                                 time.gmtime()))
    tmp = out.with_name(f".{out.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tf:
        data = json.dumps(st, indent=1).encode()
        info = tarfile.TarInfo(STAMP)
        info.size, info.mtime = len(data), int(time.time())
        tf.addfile(info, io.BytesIO(data))
        for f in files:
            tf.add(where[f] / f, arcname=f)
    os.replace(tmp, out)
    return {"kind": kind, "modules": files, "bytes": out.stat().st_size}


def read_cache(tgz: Path) -> tuple:
    """(stamp, module member names) of a carried cache; ValueError on anything but a stamp and `<dir>/<x>.so`."""
    with tarfile.open(tgz, "r:gz") as tf:
        members = tf.getmembers()
        bad = [m.name for m in members if m.name != STAMP and not (m.isfile() and _member_ok(m.name))]
        if bad:
            raise ValueError(f"{tgz}: unexpected members {bad[:5]}")
        if STAMP not in [m.name for m in members]:
            raise ValueError(f"{tgz}: no {STAMP} (not a cache packed by sglang_jit.py)")
        st = json.loads(tf.extractfile(STAMP).read())
    if st.get("kind") not in STAMP_KEYS:
        raise ValueError(f"{tgz}: stamp kind {st.get('kind')!r}")
    return st, [m.name for m in members if m.name != STAMP]


def unpack(tgz: Path, ours: Dict[str, str], dest: Optional[Path] = None) -> Dict[str, object]:
    """Install a carried cache's modules, skipping those already there; none if its stamp is not `ours`."""
    st, mods = read_cache(tgz)
    kind = st["kind"]
    why = stamp_mismatch(kind, st, ours)
    rec: Dict[str, object] = {"file": tgz.name, "kind": kind, "built": st.get("packed")}
    if why:
        rec["used"] = False
        rec["why"] = "stamp differs: " + "; ".join(why)
        return rec
    dest = install_root(kind) if dest is None else dest
    put, had = [], []
    with tarfile.open(tgz, "r:gz") as tf:
        for name in mods:
            target = dest / name
            if target.exists():
                had.append(name)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp")
            with tf.extractfile(name) as src, open(tmp, "wb") as dst:
                dst.write(src.read())
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
            put.append(name)
    rec.update(used=True, installed=put, already_there=had, into=str(dest))
    return rec


def _cuda_home() -> str:
    """CUDA's root as FlashInfer's cpp_ext.get_cuda_path finds it: CUDA_HOME, CUDA_PATH, `which nvcc`/../.."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nv = subprocess.run(["which", "nvcc"], capture_output=True, text=True).stdout.strip()
    return os.path.dirname(os.path.dirname(nv)) if nv else "/usr/local/cuda"


def cuda_env(link_dir: Path = Path("/tmp/qf-cudalink"), home: Optional[str] = None,
             site_dirs: Optional[Sequence[str]] = None, ldconfig: Optional[str] = None) -> List[str]:
    """Shell lines (for engines.sh to eval) that let FlashInfer's norm module build with this CUDA:
    norm.cu includes cublasLt.h, cublas_v2.h and curand_kernel.h, which a minimal CUDA toolkit lacks (the one
    on the CPU machine does) and the CUDA wheels torch pulls in carry (site-packages/nvidia/*/include): those
    folders go into FLASHINFER_EXTRA_CUDAFLAGS, after every other include root, so the toolkit's own headers
    still come first. Its link line asks for -lcuda from $cuda_home/lib64/stubs; with no libcuda.so there nor
    on the linker's path, `link_dir` gets a libcuda.so naming the driver's libcuda.so.1 and goes into
    FLASHINFER_EXTRA_LDFLAGS. Nothing is exported where nothing is missing. (`home`, `site_dirs`,
    `ldconfig`: the CUDA root, site-packages folders and `ldconfig -p` output, found here when not given.)"""
    home = home or _cuda_home()
    lines = []
    need = ("cublasLt.h", "cublas_v2.h", "curand_kernel.h")
    inc = [Path(home) / "include"] + [Path(p) for p in glob.glob(f"{home}/targets/*/include")]
    missing = [h for h in need if not any((d / h).is_file() for d in inc)]
    if missing:
        if site_dirs is None:
            import site
            site_dirs = site.getsitepackages()
        extra = []
        for sp in site_dirs:
            for d in sorted(glob.glob(f"{sp}/nvidia/*/include")) + sorted(glob.glob(f"{sp}/nvidia/*/*/include")):
                if any((Path(d) / h).is_file() for h in missing) and d not in extra:
                    extra.append(d)
        found = [h for h in missing if any((Path(d) / h).is_file() for d in extra)]
        lines.append(f"# CUDA {home} lacks {', '.join(missing)}; found {found or 'none'} in {extra or 'no wheel'}")
        if extra:
            lines.append("export FLASHINFER_EXTRA_CUDAFLAGS='" + " ".join(f"-isystem {d}" for d in extra) + "'")
    else:
        lines.append(f"# CUDA {home} has {', '.join(need)}")
    stubs = [Path(home) / "lib64" / "stubs" / "libcuda.so", Path(home) / "lib64" / "libcuda.so"]
    if ldconfig is None:
        try:
            ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            ldconfig = ""
    so = re.findall(r"^\s*(libcuda\.so(?:\.1)?) \(([^)]*x86-64[^)]*)\) => (\S+)", ldconfig, re.M)
    if any(p.exists() for p in stubs) or any(n == "libcuda.so" for n, _, _ in so):
        lines.append("# libcuda.so found for FlashInfer's -lcuda")
    else:
        one = next((path for n, _, path in so if n == "libcuda.so.1"), None)
        if one:
            link_dir.mkdir(parents=True, exist_ok=True)
            ln = link_dir / "libcuda.so"
            if ln.is_symlink() or not ln.exists():
                if ln.is_symlink():
                    ln.unlink()
                ln.symlink_to(one)
            lines.append(f"# no libcuda.so to link: {ln} -> {one}")
            lines.append(f"export FLASHINFER_EXTRA_LDFLAGS='-L{link_dir}'")
        else:
            lines.append("# no libcuda.so nor libcuda.so.1 found: FlashInfer's link will fail")
    return lines


# ----------------------------------------------------------------------------------- here: staging
JIT_DIR = ".sglang/jit"
JIT_MANIFEST = "jit.manifest.json"


def stage(tgzs: Sequence[Path], dest: Path, note: str = "") -> Dict[str, object]:
    """Copy checked caches into `dest` as <kind>.tgz (one per kind, the newer replacing the older) and record
    each one's sha256, size, stamp and origin in dest/jit.manifest.json."""
    dest.mkdir(parents=True, exist_ok=True)
    mp = dest / JIT_MANIFEST
    man = json.loads(mp.read_text()) if mp.exists() else {"caches": {}}
    for t in tgzs:
        st, mods = read_cache(t)
        out = dest / f"{st['kind']}.tgz"
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_bytes(t.read_bytes())
        os.replace(tmp, out)
        man["caches"][st["kind"]] = {"file": out.name, "sha256": sha256(out), "bytes": out.stat().st_size,
                                     "modules": mods, "stamp": st, "from": str(t), "staged": time.strftime(
                                         "%Y-%m-%d %H:%M UTC", time.gmtime()), "note": note}
    tmp = mp.with_name(f".{mp.name}.tmp")
    tmp.write_text(json.dumps(man, indent=1))
    os.replace(tmp, mp)
    return man


def repack_legacy(src: Path, kind: str, stamp: Dict[str, str], out: Path) -> Dict[str, object]:
    """A cache tarball from before stamps (the whole build folder) -> its `.so` files plus the given stamp,
    which the caller states from what is known of the machine that built it."""
    missing = [k for k in STAMP_KEYS[kind] if k not in stamp]
    if missing:
        raise ValueError(f"the stamp lacks {missing}")
    tmp = out.with_name(f".{out.name}.tmp")
    mods = []
    with tarfile.open(src, "r:gz") as tin, tarfile.open(tmp, "w:gz") as tout:
        st = dict(stamp, kind=kind)
        data = json.dumps(st, indent=1).encode()
        info = tarfile.TarInfo(STAMP)
        info.size, info.mtime = len(data), int(time.time())
        tout.addfile(info, io.BytesIO(data))
        for m in tin.getmembers():
            name = m.name[2:] if m.name.startswith("./") else m.name
            if m.isfile() and _member_ok(name):
                m2 = tarfile.TarInfo(name)
                m2.size, m2.mtime, m2.mode = m.size, m.mtime, 0o755
                tout.addfile(m2, tin.extractfile(m))
                mods.append(name)
    if not mods:
        tmp.unlink()
        raise ValueError(f"{src}: no <dir>/<module>.so in it")
    os.replace(tmp, out)
    return {"modules": mods, "bytes": out.stat().st_size}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drop-list")
    d.add_argument("wheel"), d.add_argument("patterns", nargs="+")
    d.add_argument("--keep-flashinfer", default="", help="comma-separated FlashInfer JIT modules to keep")
    sub.add_parser("cuda-env")
    p = sub.add_parser("pack")
    p.add_argument("--kind", choices=sorted(STAMP_KEYS), required=True), p.add_argument("--out", required=True)
    u = sub.add_parser("unpack")
    u.add_argument("tgz", nargs="+")
    s = sub.add_parser("stage")
    s.add_argument("tgz", nargs="+"), s.add_argument("--dest", default=JIT_DIR), s.add_argument("--note", default="")
    r = sub.add_parser("repack-legacy")
    r.add_argument("src"), r.add_argument("--kind", choices=sorted(STAMP_KEYS), required=True)
    r.add_argument("--stamp", required=True, help="JSON of the building machine's facts"), r.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "drop-list":
            for n in drop_list(Path(a.wheel), a.patterns, [m for m in a.keep_flashinfer.split(",") if m]):
                print(n)
        elif a.cmd == "cuda-env":
            print("\n".join(cuda_env()))
        elif a.cmd == "pack":
            print(json.dumps(pack(a.kind, Path(a.out))))
        elif a.cmd == "unpack":
            ours = current_stamp()
            for t in a.tgz:
                print(json.dumps(unpack(Path(t), ours)))
        elif a.cmd == "stage":
            man = stage([Path(t) for t in a.tgz], Path(a.dest), a.note)
            for k, c in man["caches"].items():
                print(f"{c['file']}: {c['bytes'] / 2 ** 20:.1f} MiB, {len(c['modules'])} modules, sha256 {c['sha256']}, "
                      f"built with torch {c['stamp'].get('torch')} nvcc {c['stamp'].get('nvcc')} sm {c['stamp'].get('capability')}")
        else:
            print(json.dumps(repack_legacy(Path(a.src), a.kind, json.loads(a.stamp), Path(a.out))))
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"sglang_jit {a.cmd}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
