"""libggml (prebuilt `libggml-python` wheel, ggml 0.20.2) through ctypes: the C oracle for
every ggml type. Tests call `quantize(x, type_name, imatrix)` / `dequantize(b, type_name, k)`.
"""
from __future__ import annotations

import ctypes
import glob
import os

import numpy as np
import pytest

GGML_TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q2_k": 10, "q3_k": 11,
              "q4_k": 12, "q5_k": 13, "q6_k": 14, "tq1_0": 34, "tq2_0": 35, "mxfp4": 39, "nvfp4": 40}
# (block elements, bytes per block)
GGML_SIZES = {"q4_0": (32, 18), "q5_0": (32, 22), "q8_0": (32, 34), "q4_k": (256, 144), "q6_k": (256, 210),
              "mxfp4": (32, 17), "nvfp4": (64, 36)}

_lib = None


def _cname(type_name: str) -> str:
    """C symbol spelling: q4_k -> q4_K (k-quants are upper-case K in ggml)."""
    return type_name[:-1] + "K" if type_name.endswith("_k") else type_name


def _find_lib():
    import libggml  # the wheel's package
    base = os.path.dirname(libggml.__file__)
    cands = sorted(glob.glob(os.path.join(base, "lib*", "libggml-base.so*")))
    if not cands:
        raise RuntimeError(f"libggml-base.so not found under {base}")
    return cands[0]


def lib():
    """The loaded libggml-base, or pytest.skip when the wheel is missing (it is a test dep)."""
    global _lib
    if _lib is None:
        try:
            path = _find_lib()
        except ImportError:
            pytest.skip("libggml-python is not installed (pip install libggml-python)")
        _lib = ctypes.CDLL(path)
        _lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        _lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                             ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        _lib.ggml_row_size.restype = ctypes.c_size_t
        _lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        _lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        _lib.ggml_quantize_init.restype = None
    return _lib


def version() -> str:
    from importlib.metadata import version as v
    return f"libggml-python {v('libggml-python')}"


def quantize(x: np.ndarray, type_name: str, imatrix: np.ndarray | None = None) -> np.ndarray:
    """ggml_quantize_chunk over rows of x [nrows, k] -> uint8 [nrows, row_bytes]."""
    L = lib()
    t = GGML_TYPES[type_name]
    x = np.ascontiguousarray(x, dtype=np.float32)
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    L.ggml_quantize_init(t)
    rb = L.ggml_row_size(t, k)
    out = np.zeros((rows.shape[0], rb), dtype=np.uint8)
    im = None
    if imatrix is not None:
        im = np.ascontiguousarray(imatrix, dtype=np.float32)
        assert im.shape == (k,)
    n = L.ggml_quantize_chunk(t, rows.ctypes.data, out.ctypes.data, 0, rows.shape[0], k,
                              None if im is None else im.ctypes.data)
    assert n == out.size, (n, out.size)
    return out.reshape(*x.shape[:-1], rb)


def quantize_row_ref(x: np.ndarray, type_name: str) -> np.ndarray:
    """quantize_row_<type>_ref(x, y, k) on one flat row."""
    L = lib()
    fn = getattr(L, f"quantize_row_{_cname(type_name)}_ref")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    rb = L.ggml_row_size(GGML_TYPES[type_name], x.size)
    out = np.zeros(rb, dtype=np.uint8)
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out


def dequantize(b: np.ndarray, type_name: str, k: int) -> np.ndarray:
    """dequantize_row_<type>(bytes, float*, k) row by row -> float32 [..., k]."""
    L = lib()
    fn = getattr(L, f"dequantize_row_{_cname(type_name)}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    b = np.ascontiguousarray(b, dtype=np.uint8)
    rows = b.reshape(-1, b.shape[-1])
    out = np.zeros((rows.shape[0], k), dtype=np.float32)
    for i in range(rows.shape[0]):
        fn(rows[i].ctypes.data, out[i].ctypes.data, k)
    return out.reshape(*b.shape[:-1], k)


_cpu = None


def cpu_lib():
    """libggml-python's CPU backend (libggml-cpu.so, loaded after libggml-base): the SIMD
    ``from_float`` quantizers llama.cpp's CPU backend writes with (e.g. its KV cache's set_rows)."""
    global _cpu
    if _cpu is None:
        lib()
        path = _find_lib().replace("libggml-base.so", "libggml-cpu.so")
        ctypes.CDLL(_find_lib(), mode=ctypes.RTLD_GLOBAL)   # libggml-cpu resolves its symbols from here
        _cpu = ctypes.CDLL(path)
        for f in ("ggml_cpu_has_avx", "ggml_cpu_has_avx2"):
            getattr(_cpu, f).restype = ctypes.c_int
    return _cpu


def cpu_features() -> dict:
    L = cpu_lib()
    return {"avx": bool(L.ggml_cpu_has_avx()), "avx2": bool(L.ggml_cpu_has_avx2())}


def quantize_row_cpu(x: np.ndarray, type_name: str) -> np.ndarray:
    """The CPU backend's quantize_row_<type>(x, y, k) (its from_float) over rows of x [..., k]."""
    L = cpu_lib()
    fn = getattr(L, f"quantize_row_{_cname(type_name)}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    x = np.ascontiguousarray(x, dtype=np.float32)
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    rb = lib().ggml_row_size(GGML_TYPES[type_name], k)
    out = np.zeros((rows.shape[0], rb), dtype=np.uint8)
    for i in range(rows.shape[0]):
        fn(rows[i].ctypes.data, out[i].ctypes.data, k)
    return out.reshape(*x.shape[:-1], rb)
