"""The llama.cpp runtime check rounds the reference's activations as llama.cpp's CPU matmul does
(exporters/verify/llama_cpp_runtime.py). Proven here against the C code itself: llama.cpp's own
``from_float`` (ggml_get_type_traits_cpu, from the libggml-cpu that llama-cpp-python built) and
libggml-python's ``quantize_row_q8_0`` / ``quantize_row_q8_K``, decoded by their ``dequantize_row_*``;
and the weight type -> activation type table against llama.cpp's ``vec_dot_type``. Each library runs
in its own process (the two libggml builds share a soname, not an ABI)."""
from __future__ import annotations

import glob
import importlib
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

rt = importlib.import_module("qatfactory.exporters.verify.llama_cpp_runtime")

_C = r"""
import ctypes, json, sys
import numpy as np
libdir, mode, inp, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
G = ctypes.RTLD_GLOBAL
base = ctypes.CDLL(libdir + "/libggml-base.so", mode=G)
cpu = ctypes.CDLL(libdir + "/libggml-cpu.so", mode=G)
cpu.ggml_cpu_init()
x = np.ascontiguousarray(np.load(inp), dtype=np.float32)
n = x.size
F = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
class TraitsCPU(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]
class Traits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]
cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TraitsCPU)
base.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
res = {}
for name, t in (("Q8_0", 8), ("Q8_K", 15)):
    tr, tc = base.ggml_get_type_traits(t).contents, cpu.ggml_get_type_traits_cpu(t).contents
    nbytes = n // tr.blck_size * tr.type_size
    for which in ("simd", "ref"):
        buf = (ctypes.c_uint8 * nbytes)()
        sym = f"quantize_row_{name.lower().replace('_k', '_K')}"
        if mode == "traits" and which == "simd":   # what llama.cpp's matmul calls: the CPU traits' from_float
            fn = F(tc.from_float)
        elif which == "ref":                       # ggml's reference quantizer (libggml-base)
            fn = F(ctypes.cast(getattr(base, sym + "_ref"), ctypes.c_void_p).value)
        else:                                      # libggml-python: its exported SIMD quantizer
            fn = F(ctypes.cast(getattr(cpu, sym), ctypes.c_void_p).value)
        fn(x.ctypes.data, ctypes.addressof(buf), n)
        y = np.zeros(n, np.float32)
        F(ctypes.cast(getattr(base, "de" + sym), ctypes.c_void_p).value)(ctypes.addressof(buf), y.ctypes.data, n)
        res[f"{name}_{which}"] = y
if mode == "traits":  # the activation type of each weight type, by name
    base.ggml_type_name.restype = ctypes.c_char_p
    vdt = {}
    for nm, t in json.loads(sys.argv[5]).items():
        assert base.ggml_type_name(t).decode().upper() == nm, (nm, t)
        vdt[nm] = base.ggml_type_name(cpu.ggml_get_type_traits_cpu(t).contents.vec_dot_type).decode().upper()
    json.dump(vdt, open(out + ".json", "w"))
np.savez(out, **res)
"""

pytestmark = pytest.mark.llama_cpp  # runs llama.cpp's own runtime (in make test)


def _llama_cpp_lib() -> str:
    spec = importlib.util.find_spec("llama_cpp")
    assert spec is not None, ("llama.cpp's runtime is required in make test: pip install llama-cpp-python "
                              "(or: python scripts/llama_cpp_runtime.py ensure)")
    return os.path.join(os.path.dirname(spec.origin), "lib")


def _libggml_python_lib() -> str:
    import libggml
    return sorted(glob.glob(os.path.join(os.path.dirname(libggml.__file__), "lib*")))[0]


def _run(libdir, mode, x, tmp_path):
    inp, out = tmp_path / f"{mode}-x.npy", tmp_path / f"{mode}-y"
    np.save(inp, x)
    import gguf
    ids = {n: int(gguf.GGMLQuantizationType[n]) for n in rt.VEC_DOT}
    r = subprocess.run([sys.executable, "-c", _C, libdir, mode, str(inp), str(out), json.dumps(ids)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    vdt = json.loads((tmp_path / f"{mode}-y.json").read_text()) if mode == "traits" else None
    return dict(np.load(str(out) + ".npz")), vdt


def _activations() -> np.ndarray:
    """Rows of 256: normal, heavy-tailed, exact rounding ties (amax = 127 so x*127/amax lands on
    k + 1/2), bf16-valued (as the embedding rows reach the first matmul), tiny, all zero."""
    g = np.random.default_rng(0)
    rows = [g.standard_normal(256), g.standard_t(2, 256) * 0.1]
    tie = np.concatenate([[127.0], np.arange(-63, 64) + 0.5, -(np.arange(128) % 7) - 0.5])[:256]
    rows.append(tie)
    rows.append(-tie)
    bf = torch.from_numpy(g.standard_normal(256).astype(np.float32) * 0.06).to(torch.bfloat16).float().numpy()
    rows += [bf, bf * 1e-30, np.zeros(256)]
    return np.stack(rows).astype(np.float32)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    x = _activations()
    tmp = tmp_path_factory.mktemp("q8")
    return x, _run(_llama_cpp_lib(), "traits", x, tmp), _run(_libggml_python_lib(), "symbols", x, tmp)


def test_q8_0_emulation_is_llama_cpps_from_float(results):
    x, (lc, _), (lg, _) = results
    ours = rt.q8_0(torch.from_numpy(x)).numpy().reshape(-1)
    assert np.array_equal(ours, lc["Q8_0_simd"]), int((ours != lc["Q8_0_simd"]).sum())
    assert np.array_equal(ours, lg["Q8_0_simd"])  # libggml-python's SIMD quantizer: the same values
    # ggml's *_ref quantizer (1/d and roundf) is NOT what runs: it differs on the ties, and the
    # transcription of it matches it, so the difference is the rounding rule, not the transcription
    ref = rt.q8_0_ref(torch.from_numpy(x)).numpy().reshape(-1)
    assert np.array_equal(ref, lc["Q8_0_ref"]) and np.array_equal(ref, lg["Q8_0_ref"])
    n_diff = int((lc["Q8_0_ref"] != lc["Q8_0_simd"]).sum())
    assert n_diff > 0
    print(f"Q8_0: SIMD vs _ref differ in {n_diff} of {x.size} values")


def test_q8_k_emulation_is_llama_cpps_from_float(results):
    x, (lc, _), (lg, _) = results
    ours = rt.q8_k(torch.from_numpy(x)).numpy().reshape(-1)
    for got in (lc["Q8_K_simd"], lc["Q8_K_ref"], lg["Q8_K_simd"], lg["Q8_K_ref"]):
        assert np.array_equal(ours, got), int((ours != got).sum())


def test_activation_type_table_is_llama_cpps(results):
    _, (_, vdt), _ = results
    for wtype, act in rt.VEC_DOT.items():
        assert vdt[wtype] == act, (wtype, vdt[wtype], act)


def test_emulation_brings_llama_cpp_to_float_order(tmp_path):
    """Against the plain student llama.cpp's logits differ by percents (KL ~1e-4 on these tiny models);
    against the emulated one most prompts agree to float summation order (boundary events, which the
    gate's bound allows for, make the rest). Four models x four prompts: at least a quarter exact."""
    from test_exporters_helpers import student

    from qatfactory.exporters import export, verify
    exact, total = 0, 0
    for kind, fmt in (("qwen3", "q4_k"), ("llama", "q8_0"), ("qwen3", "nvfp4_ggml"), ("qwen2", "mxfp4_ggml")):
        cm = student(kind, fmt)
        out = tmp_path / f"{kind}-{fmt}"
        export(cm, out, engine="llama_cpp")
        v = verify(out, cm)
        assert v.verdict == "PASS", v.table()
        r = v.logits["llama.cpp"]
        print(kind, fmt, ["%.1e" % k for k in r["kl_per_prompt"]], "plain", "%.1e" % r["plain_kl_max"])
        assert r["plain_max_rel"] > 0.005 and max(r["kl_per_prompt"]) < r["plain_kl_max"]
        exact += sum(k < 1e-10 for k in r["kl_per_prompt"])
        total += len(r["kl_per_prompt"])
    assert exact >= total // 4, (exact, total)  # measured 10 of 16 here; a systematic error gives 0


def test_tipping_draws_are_seeded_halves_of_the_ambiguous_roundings():
    """The gate's tipping effect takes all ambiguous roundings and N_DRAWS random halves of them: each
    draw a subset, about half, different from draw to draw, the same on every run (a verdict repeats)."""
    N_DRAWS, _draw = rt.N_DRAWS, rt._draw
    amb = torch.rand(4096, generator=torch.Generator().manual_seed(1234)) < 0.5
    assert torch.equal(_draw(amb, None), amb)
    draws = [_draw(amb, torch.Generator().manual_seed(k)) for k in range(N_DRAWS)]
    again = [_draw(amb, torch.Generator().manual_seed(k)) for k in range(N_DRAWS)]
    assert all(torch.equal(a, b) for a, b in zip(draws, again))
    for d in draws:
        assert not (d & ~amb).any() and 0.4 < d.sum() / amb.sum() < 0.6
    assert not torch.equal(draws[0], draws[1])
