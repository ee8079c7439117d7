"""Compile csrc/*.cu at first use with NVRTC through CuPy, and launch on torch's stream.

Why this path: NVRTC compiles one kernel instantiation in about a second, nothing is built
at install time, and importing qatfactory needs neither CuPy nor a GPU. The compiled object
is cached on disk ($QATFACTORY_KERNEL_CACHE, default ~/.cache/qatfactory/kernels).

We call CuPy's ``cupy.cuda.compiler.compile_using_nvrtc`` and load the result with
``cupy.cuda.function.Module`` instead of ``cupy.RawModule``: RawModule appends
``-ftz=true`` after the caller's options (cupy/cuda/compiler.py, _compile_with_cache_cuda),
and flushing subnormals changed codes on the H200 (a block scale below 2^-126 became 0, so
the kernel's zero-block rule fired where the reference's did not). Options: ``--fmad=false`` (no FMA contraction:
the references round every product and sum), IEEE division and sqrt, and subnormals kept
(``--ftz=false``: a flushed subnormal block scale turned into 1.0 and changed codes; all
stated explicitly, never ``--use_fast_math``), ``-I csrc`` for ``qf_common.cuh``. CuPy adds ``-arch`` for the
current device.

Every launch goes on ``torch.cuda.current_stream()``, so the ops order correctly with torch
work, run under CUDA graph capture, and need no synchronisation.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch

_LOCK = threading.Lock()
_FUNCS: Dict[Tuple[str, str], object] = {}
_MODULES: list = []
_STREAMS: Dict[int, object] = {}
_STATE: Dict[str, object] = {"checked": False, "ok": False, "reason": ""}

NVRTC_OPTIONS = ("--std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")


def csrc_dir() -> Optional[Path]:
    """$QATFACTORY_CSRC, the package's own csrc/ (an installed copy: setup.py maps it in), or the source
    checkout's top-level csrc/: the kernels are compiled from source."""
    env = os.environ.get("QATFACTORY_CSRC")
    cands = [Path(env)] if env else []
    here = Path(__file__).resolve()
    cands += [here.parents[1] / "csrc", here.parents[2] / "csrc"]
    for c in cands:
        if (c / "qf_common.cuh").is_file():
            return c
    return None


def probe() -> Tuple[bool, str]:
    """(usable, reason). Checked once: a CUDA device, CuPy, the sources."""
    if _STATE["checked"]:
        return bool(_STATE["ok"]), str(_STATE["reason"])
    ok, reason = False, ""
    if os.environ.get("QATFACTORY_NO_CUDA_KERNELS"):
        reason = "QATFACTORY_NO_CUDA_KERNELS is set"
    elif not torch.cuda.is_available():
        reason = "no CUDA device"
    elif csrc_dir() is None:
        reason = "CUDA sources (csrc/qf_common.cuh) not found; set QATFACTORY_CSRC"
    else:
        try:
            import cupy  # noqa: F401,PLC0415 (optional: cupy)
            from cupy.cuda import compiler, function  # noqa: PLC0415 (optional: cupy)
            if not (hasattr(compiler, "compile_using_nvrtc") and hasattr(function, "Module")):
                reason = (f"CuPy {cupy.__version__} lacks cupy.cuda.compiler.compile_using_nvrtc / "
                          f"cupy.cuda.function.Module (needed to compile without CuPy's forced -ftz=true)")
            else:
                ok = True
        except Exception as e:  # ImportError, or a CuPy built for another CUDA
            reason = f"CuPy is not importable ({type(e).__name__}: {e}); pip install cupy-cuda12x or cupy-cuda13x"
    _STATE.update(checked=True, ok=ok, reason=reason)
    return ok, reason


def cache_dir() -> Path:
    return Path(os.environ.get("QATFACTORY_KERNEL_CACHE", Path.home() / ".cache" / "qatfactory" / "kernels"))


def _compile(code: str, name_expr: str, include: Path):
    """(compiled object bytes, mangled name), from the disk cache or NVRTC."""
    import cupy  # noqa: PLC0415 (optional: cupy)
    from cupy.cuda import compiler  # noqa: PLC0415 (optional: cupy)
    options = NVRTC_OPTIONS + (f"-I{include}",)
    headers = "".join((include / h).read_text() for h in sorted(os.listdir(include)) if h.endswith(".cuh"))
    cc = cupy.cuda.Device().compute_capability
    ver = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
    key = hashlib.sha256("\0".join([code, headers, name_expr, " ".join(options), cc, ver,
                                     cupy.__version__]).encode()).hexdigest()
    path = cache_dir() / f"{key}.bin"
    try:
        blob = path.read_bytes()
        n = int.from_bytes(blob[:4], "little")
        return blob[4 + n:], blob[4:4 + n].decode()
    except (OSError, ValueError):
        pass
    arch = compiler._get_arch() if hasattr(compiler, "_get_arch") else None
    obj, mapping = compiler.compile_using_nvrtc(code, options, arch, name_expressions=[name_expr],
                                                cache_in_memory=True)
    mangled = mapping[name_expr]
    mangled = mangled.decode() if isinstance(mangled, bytes) else mangled
    data = (obj + "\0").encode() if isinstance(obj, str) else bytes(obj)   # PTX text must end in NUL
    try:   # atomic: temp file then rename, so a concurrent reader never sees half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            m = mangled.encode()
            f.write(len(m).to_bytes(4, "little") + m + data)
        os.replace(tmp, path)
    except OSError:
        pass
    return data, mangled


def get_function(source: str, name_expr: str):
    """The compiled kernel `name_expr` (a template instantiation) of csrc/<source>."""
    key = (source, name_expr)
    fn = _FUNCS.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _FUNCS.get(key)
        if fn is None:
            from cupy.cuda import function  # noqa: PLC0415 (optional: cupy)
            d = csrc_dir()
            data, mangled = _compile((d / source).read_text(), name_expr, d)
            mod = function.Module()
            mod.load(data)
            fn = mod.get_function(mangled)
            _FUNCS[key] = (mod, fn)[1]
            _MODULES.append(mod)     # the module must outlive its functions
    return fn


def _stream(device: torch.device):
    import cupy  # noqa: PLC0415 (optional: cupy)
    s = torch.cuda.current_stream(device)
    ptr = s.cuda_stream
    st = _STREAMS.get(ptr)
    if st is None:
        st = cupy.cuda.ExternalStream(ptr, device.index if device.index is not None else torch.cuda.current_device())
        _STREAMS[ptr] = st
    return st


def ptr(t: Optional[torch.Tensor]) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def launch(source: str, name_expr: str, device: torch.device, grid, block: int, args: tuple) -> None:
    """grid: an int or a tuple (x, y)."""
    import cupy  # noqa: PLC0415 (optional: cupy)
    fn = get_function(source, name_expr)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    g = tuple(int(v) for v in grid) if isinstance(grid, (tuple, list)) else (int(grid),)
    if cupy.cuda.runtime.getDevice() == idx:      # the common case; skips a context switch
        fn(g, (int(block),), args, stream=_stream(device))
        return
    with cupy.cuda.Device(idx):
        fn(g, (int(block),), args, stream=_stream(device))
