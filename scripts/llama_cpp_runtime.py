#!/usr/bin/env python3
"""llama.cpp's own runtime and tools, built once from the llama-cpp-python sdist on PyPI.

    python scripts/llama_cpp_runtime.py ensure [--site-packages DIR]   # build if missing, link into a venv
    python scripts/llama_cpp_runtime.py path                           # the cache directory (or exit 1)
    python scripts/llama_cpp_runtime.py tool llama-quantize            # absolute path of a built tool

What it builds (CMake, from the sdist's vendored llama.cpp; PyPI ships no binary wheel):

    <cache>/llama-cpp-<version>-<cpu>/
        site/llama_cpp/            the llama-cpp-python package (ctypes bindings), lib/ = the libraries below
        bin/                       llama-quantize, llama-perplexity, llama-imatrix, llama-tokenize + their .so
        src/                       convert_hf_to_gguf.py, conversion/, gguf-py/ (llama.cpp's own converter)
        build.json                 version, compiler, CPU flags hash, seconds

``<cache>`` is ``$QATFACTORY_CACHE/llama.cpp`` (default ``~/.cache/qatfactory/llama.cpp``). The build is
native (-march=native), so the directory name carries a hash of the CPU's instruction-set flags: a
cache copied to a machine with another CPU is not used there. ``ensure`` writes a ``.pth`` file into
the venv's site-packages so ``import llama_cpp`` works there, with no environment variable.

stdlib only: it runs before anything is installed. The build happens in a temporary directory that
is renamed into place when complete, so an interrupted build leaves nothing that looks finished.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"   # llama-cpp-python; vendors llama.cpp commit 0c1e570
TOOLS = ("llama-quantize", "llama-perplexity", "llama-imatrix", "llama-tokenize")
PTH = "qatfactory_llama_cpp.pth"
LAYOUT = 2           # bumped when the cached directory's contents change


def cache_root() -> Path:
    base = os.environ.get("QATFACTORY_CACHE") or str(Path.home() / ".cache" / "qatfactory")
    return Path(base) / "llama.cpp"


def cpu_key() -> str:
    """Hash of what -march=native depends on: the machine, its ISA flags and the compiler."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    except OSError:
        pass
    cc = shutil.which("cc") or shutil.which("gcc") or ""
    ver = ""
    if cc:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
        ver = ver[0] if ver else ""
    return hashlib.sha256(f"{platform.machine()}|{flags}|{ver}".encode()).hexdigest()[:12]


def target_dir() -> Path:
    return cache_root() / f"llama-cpp-{VERSION}-{cpu_key()}"


def is_built(d: Path) -> bool:
    return (d / "build.json").is_file() and json.loads((d / "build.json").read_text()).get("layout") == LAYOUT \
        and all((d / "bin" / t).is_file() for t in TOOLS) and \
        (d / "site" / "llama_cpp" / "lib" / "libllama.so").exists()


def _say(msg: str) -> None:
    print(f"[llama.cpp] {msg}", flush=True)


def _sdist(work: Path) -> Path:
    """The sdist from PyPI (pip's own cache makes a second download free)."""
    dl = work / "dl"
    dl.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={VERSION}", "-d", str(dl)], check=True)
    tgz = next(dl.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(tgz) as tf:
        tf.extractall(work, filter="data")
    return work / f"llama_cpp_python-{VERSION}"


def build() -> Path:
    d = target_dir()
    if is_built(d):
        return d
    for tool in ("cmake", "cc", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"[llama.cpp] {tool} not found: install cmake and a C/C++ compiler "
                             f"(Debian: apt-get install cmake build-essential)")
    d.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix=f".{d.name}.tmp-", dir=d.parent))
    try:
        _say(f"building llama.cpp from llama-cpp-python {VERSION} (once; cached in {d})")
        src = _sdist(work)
        vend = src / "vendor" / "llama.cpp"
        bdir = work / "build"
        jobs = str(max(1, os.cpu_count() or 1))
        cfg = ["cmake", "-S", str(vend), "-B", str(bdir), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
               "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
               "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON",
               # libraries and tools find each other beside themselves, wherever the cache is
               "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN"]
        log = work / "build.log"
        with open(log, "w") as lf:
            for cmd in (cfg, ["cmake", "--build", str(bdir), "-j", jobs, "--target", "llama", *TOOLS]):
                _say(" ".join(cmd[:3]) + " ...")
                r = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT)
                if r.returncode != 0:
                    tail = log.read_text().splitlines()[-30:]
                    raise SystemExit("[llama.cpp] build failed:\n" + "\n".join(tail))
        stage = work / "out"
        (stage / "bin").mkdir(parents=True)
        shutil.copytree(src / "llama_cpp", stage / "site" / "llama_cpp")
        lib = stage / "site" / "llama_cpp" / "lib"
        lib.mkdir(exist_ok=True)
        for f in (bdir / "bin").iterdir():
            if f.name.endswith(".so") or ".so." in f.name:
                shutil.copy2(f, lib / f.name, follow_symlinks=True)
                shutil.copy2(f, stage / "bin" / f.name, follow_symlinks=True)
            elif f.name in TOOLS:
                shutil.copy2(f, stage / "bin" / f.name)
        (stage / "src").mkdir()
        shutil.copy2(vend / "convert_hf_to_gguf.py", stage / "src" / "convert_hf_to_gguf.py")
        for sub in ("conversion", "gguf-py"):
            if (vend / sub).is_dir():
                shutil.copytree(vend / sub, stage / "src" / sub)
        rec = {"layout": LAYOUT, "llama_cpp_python": VERSION, "cpu_key": cpu_key(), "machine": platform.machine(),
               "seconds": round(time.time() - t0, 1), "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "cmake": cfg[1:]}
        (stage / "build.json").write_text(json.dumps(rec, indent=1) + "\n")
        if d.exists():           # a half-built leftover of ours (is_built said no): replace it
            shutil.rmtree(d)
        os.replace(stage, d)
        _say(f"built in {rec['seconds']:.0f} s -> {d}")
        return d
    finally:
        shutil.rmtree(work, ignore_errors=True)


def link_into(site_packages: Path, d: Path) -> Path:
    """A .pth line so that the venv imports the cached llama_cpp package."""
    p = Path(site_packages) / PTH
    want = str(d / "site") + "\n"
    if not p.exists() or p.read_text() != want:
        tmp = p.with_suffix(".tmp")
        tmp.write_text(want)
        os.replace(tmp, p)
    return p


def tool(name: str) -> Path:
    d = target_dir()
    p = d / "bin" / name
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found; build it with `python scripts/llama_cpp_runtime.py ensure`")
    return p


def tool_env() -> dict:
    """Environment for running a built tool (its shared libraries sit beside it)."""
    env = dict(os.environ)
    b = str(target_dir() / "bin")
    env["LD_LIBRARY_PATH"] = b + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("ensure", help="build once (cached) and link into this interpreter's site-packages")
    e.add_argument("--site-packages", default=sysconfig.get_paths()["purelib"])
    sub.add_parser("path")
    t = sub.add_parser("tool")
    t.add_argument("name", choices=TOOLS)
    a = ap.parse_args(argv)
    if a.cmd == "ensure":
        d = build()
        link_into(Path(a.site_packages), d)
        print(d)
        return 0
    if a.cmd == "path":
        d = target_dir()
        if not is_built(d):
            print(f"not built: {d}", file=sys.stderr)
            return 1
        print(d)
        return 0
    print(tool(a.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
