"""llama.cpp's own runtime (llama-cpp-python) on a GGUF export, against a reference that rounds
activations the way llama.cpp's CPU matmul does.

llama.cpp's CPU backend converts a matmul's activations to the weight type's ``vec_dot_type``
before the dot products (ggml-cpu.c ``type_traits_cpu``): Q8_K for k-quants (Q4_K, Q6_K), Q8_0 for
Q5_0 / Q8_0 / MXFP4 / NVFP4, BF16 for BF16 weights, F16 for F16, nothing for F32. The reference
forward here is the student's model (weights = its fake-quant values) with exactly that rounding
applied to each linear's input, and with llama.cpp's RMSNorm arithmetic (sum of squares in double,
``1.0f/sqrtf(mean + eps)``, then ``x*scale*w``), so that the embedding rows, which are bf16 values
and so often exact rounding ties, reach the first Q8 rounding bit for bit. The rounding rules are
those of the x86 SIMD quantizers llama.cpp runs (``quantize_row_q8_0``: d = fp16(amax/127),
q = round-to-nearest-even(x * (127/amax)); ``quantize_row_q8_K`` = the reference:
iscale = -127/max, q = nearest_int(iscale*x), d = 1/iscale), not ggml's *_ref Q8_0 (which uses
1/d and roundf, and measurably differs); tests/test_llama_cpp_emulation.py compares them with
libggml and with llama.cpp's own ``from_float``.

The run uses an F32 KV cache and no flash attention, so attention adds no rounding of its own,
and the CPU's plain backend (``use_extra_bufts=False``: no AMX/repacked weight layouts; on an AMX
machine llama.cpp 0c1e570's AMX matmul crashed on these tiny files).

Tolerance, from first principles: what remains after the emulation is float summation order, and
the rare activation that lands on the other side of a Q8 rounding boundary because an earlier
result differs from ours in its last bit. Such an event moves one element by a whole Q8 step,
where the rounding itself moves each of the K elements of that input by up to half a step
(variance step^2/12): one event adds about 12/K of that matmul's rounding variance to the
positions it reaches (5 % at K = 256; one event measured 13 % of the KL on a tiny model here). The
check measures the Q8 effect on the same prompt (KL between the emulated and the plain student)
and requires KL(reference || llama.cpp) <= 0.25 x it, i.e. room for about two such events on the
worst position; an export error (a wrong block, scale, permutation or hyperparameter) moves the
logits by many times the Q8 effect. Plus: finite logits, and the same argmax at every position
whose reference top-2 margin exceeds the whole Q8 effect on that position's logits.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types as _types
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from qatfactory.formats import ConvertedModel

from .common import model_from_state_dict, nonfinite, student_weights, tied
from .result import FAIL, INCOMPLETE, OK, Missing, VerifyResult

KL_RATIO = 0.25     # KL(reference || llama.cpp) allowed, as a fraction of the Q8 activation effect's KL
KL_FLOOR = 1e-10    # nats: float-summation noise when the Q8 effect itself is ~0
SOURCE = "llama-cpp-python (llama.cpp 0c1e570)"

# ggml-cpu.c type_traits_cpu[type].vec_dot_type for the weight types the exporters write
VEC_DOT = {"Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K", "Q2_K": "Q8_K", "Q3_K": "Q8_K",
           "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "MXFP4": "Q8_0", "NVFP4": "Q8_0", "IQ4_NL": "Q8_0",
           "BF16": "BF16", "F16": "F16", "F32": "F32"}


# ============================================================================ activation rounding
def q8_0(x: torch.Tensor) -> torch.Tensor:
    """The values llama.cpp's x86 quantize_row_q8_0 gives an fp32 row (blocks of 32)."""
    sh = x.shape
    b = x.float().reshape(-1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    d = (amax / 127.0).half().float()
    inv = torch.where(amax > 0, torch.tensor(127.0) / torch.where(amax > 0, amax, torch.ones_like(amax)),
                      torch.zeros_like(amax))
    q = torch.round(b * inv)  # round half to even, as _mm256_round_ps(_MM_ROUND_NEAREST)
    return (q * d).reshape(sh)


def q8_0_ref(x: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_q8_0_ref (id = 1/d, roundf = half away from zero): NOT what the x86
    runtime uses; kept to measure the difference."""
    sh = x.shape
    b = x.float().reshape(-1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    v = b * inv
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return (q * d.half().float()).reshape(sh)


def q8_k(x: torch.Tensor) -> torch.Tensor:
    """The values quantize_row_q8_K(_ref) gives (blocks of 256; d kept in fp32)."""
    sh = x.shape
    b = x.float().reshape(-1, 256)
    idx = b.abs().argmax(-1, keepdim=True)  # the first element of largest magnitude, signed
    mx = torch.gather(b, -1, idx)
    nz = mx != 0
    one = torch.ones_like(mx)
    iscale = torch.where(nz, torch.tensor(-127.0) / torch.where(nz, mx, one), torch.zeros_like(mx))
    q = torch.round(iscale * b).clamp(max=127)
    d = torch.where(nz, 1.0 / torch.where(nz, iscale, one), torch.zeros_like(mx))
    return (q * d).reshape(sh)


ROUND = {"Q8_0": q8_0, "Q8_K": q8_k, "BF16": lambda x: x.to(torch.bfloat16).float(),
         "F16": lambda x: x.half().float(), "F32": lambda x: x}


def _rms_norm_llama_cpp(self, x: torch.Tensor) -> torch.Tensor:
    """ggml_compute_forward_rms_norm_f32 + the norm weight: sum of x*x in double, mean and
    1.0f/sqrtf(mean + eps) in float, then (x * scale) * w."""
    xf = x.float()
    s = (xf * xf).double().sum(-1, keepdim=True)
    mean = (s / xf.shape[-1]).float()
    eps = torch.tensor(float(getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))), dtype=torch.float32)
    return (xf * (1.0 / torch.sqrt(mean + eps))) * self.weight.float()


def _param_gguf_name(pname: str, names, is_tied: bool) -> List[str]:
    """GGUF tensor names a model parameter (transformers' in-memory name) is stored as."""
    stem = pname[: -len(".weight")] if pname.endswith(".weight") else pname
    if stem.endswith(".experts.gate_up_proj"):
        layer = stem.split(".")[2]
        return [f"blk.{layer}.ffn_gate_exps.weight", f"blk.{layer}.ffn_up_exps.weight"]
    if stem.endswith(".experts.down_proj"):
        return [f"blk.{stem.split('.')[2]}.ffn_down_exps.weight"]
    if pname == "lm_head.weight" and is_tied:
        return ["token_embd.weight"]
    g, _ = names(pname)
    return [] if g is None else [g]


@torch.no_grad()
def emulated_logits(student: ConvertedModel, prompt: List[int], types: Dict[str, str], names) -> Dict[str, Any]:
    """(plain logits, emulated logits, what was rounded how) for the student's model."""
    import torch.nn.functional as F

    model = model_from_state_dict(student.config, student_weights(student), eager_experts=True)
    ids = torch.tensor([prompt])
    plain = model(ids).logits[0].float()
    rule: Dict[int, str] = {}
    unknown = []
    for pname, prm in model.named_parameters():
        if prm.ndim < 2 or "embed_tokens" in pname:
            continue
        gnames = _param_gguf_name(pname, names, bool(tied(student)))
        kinds = {VEC_DOT.get(types.get(g, "?")) for g in gnames}
        if len(kinds) != 1 or None in kinds:
            unknown.append(f"{pname} ({[types.get(g) for g in gnames]})")
            continue
        rule[prm.untyped_storage().data_ptr()] = kinds.pop()
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = _types.MethodType(_rms_norm_llama_cpp, mod)
    used: Dict[str, int] = {}
    lin = F.linear

    def rounded(x, w, b=None):
        r = rule.get(w.untyped_storage().data_ptr())
        if r is not None:
            used[r] = used.get(r, 0) + 1
            x = ROUND[r](x)
        return lin(x, w, b)

    F.linear = rounded
    try:
        emu = model(ids).logits[0].float()
    finally:
        F.linear = lin
    return {"plain": plain, "emulated": emu, "used": used, "unknown": unknown}


def _kl_rows(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    lp, lq = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


# ============================================================================ the run
_RUNNER = r"""
import json, os, sys
try:
    import numpy as np
    import llama_cpp.llama_cpp as C
    from llama_cpp import Llama
except ImportError as e:
    print(f"ImportError: {e}", file=sys.stderr)
    sys.exit(3)
path, prompt, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
_defaults = C.llama_model_default_params
def _params():
    p = _defaults()
    p.use_extra_bufts = False   # the plain CPU backend: no AMX / repacked weight layouts
    return p
C.llama_model_default_params = _params
llm = Llama(model_path=path, logits_all=True, n_ctx=0, n_batch=max(32, len(prompt)), n_ubatch=max(32, len(prompt)),
            n_threads=max(1, min(4, os.cpu_count() or 1)), type_k=0, type_v=0, flash_attn=False, verbose=False)
llm.eval(prompt)
np.save(out, np.array(llm.scores[: len(prompt)], dtype=np.float32))
"""


def run_llama_cpp(path: Path, prompt: List[int], timeout: float = 600.0) -> torch.Tensor:
    """Logits of llama.cpp itself, in a separate process: llama.cpp's libggml must not meet
    libggml-python's (same soname, different ABI) loaded by the dequantizer check."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise Missing("llama_cpp")
    with tempfile.TemporaryDirectory(prefix="qf-llama-") as td:
        out = os.path.join(td, "scores.npy")
        r = subprocess.run([sys.executable, "-c", _RUNNER, str(path), json.dumps([int(i) for i in prompt]), out],
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode == 3:
            raise Missing("llama_cpp", (r.stderr.strip().splitlines() or [""])[-1])
        if r.returncode != 0:
            tail = [ln for ln in r.stderr.strip().splitlines() if ln.strip()][-2:]
            how = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
            raise RuntimeError(f"llama.cpp failed to load/run the file ({how}): " + " | ".join(tail)[-400:])
        return torch.from_numpy(np.load(out))


def runtime_check(res: VerifyResult, path: Path, student: ConvertedModel, prompt: List[int], types: Dict[str, str],
                  names, cache: Dict[str, Any]) -> None:
    name = "llama.cpp runtime"
    try:
        got = run_llama_cpp(path, prompt)
    except Missing as e:
        res.missing("logits", name, e)
        return
    except Exception as e:
        res.add("logits", name, FAIL, f"{type(e).__name__}: {e}", source=SOURCE)
        return
    try:
        ref = emulated_logits(student, prompt, types, names)
    except Missing as e:
        res.missing("logits", name, e)
        return
    emu, plain = ref["emulated"], ref["plain"]
    if tuple(got.shape) != tuple(emu.shape) or nonfinite(got):
        res.add("logits", name, FAIL, f"llama.cpp returned {tuple(got.shape)} logits with {nonfinite(got)} "
                                      f"NaN/Inf (reference {tuple(emu.shape)})", source=SOURCE)
        return
    kl = _kl_rows(emu, got)
    kl_q8 = _kl_rows(emu, plain)
    kl_max, q8_max = float(kl.max()), float(kl_q8.max())
    bound = max(KL_RATIO * q8_max, KL_FLOOR)
    diff = float((got - emu).abs().max())
    rel = diff / max(float(emu.abs().max()), 1e-30)
    q8_logit = (plain - emu).abs().max(-1).values                   # the Q8 effect per position
    top2 = emu.topk(2, -1).values
    decisive = (top2[:, 0] - top2[:, 1]) > q8_logit
    am_eq = got.argmax(-1) == emu.argmax(-1)
    argmax_ok = bool(am_eq[decisive].all())
    res.logits["llama.cpp"] = {
        "max_abs_diff": diff, "max_rel": rel, "kl_max": kl_max, "kl_q8_effect_max": q8_max, "kl_bound": bound,
        "argmax_agreement": float(am_eq.float().mean()), "decisive_positions": int(decisive.sum()),
        "plain_max_rel": float((got - plain).abs().max()) / max(float(plain.abs().max()), 1e-30),
        "plain_kl_max": float(_kl_rows(plain, got).max()), "rounded": ref["used"], "not_emulated": ref["unknown"]}
    good = kl_max <= bound and argmax_ok and not ref["unknown"]
    detail = (f"KL {kl_max:.2g} <= {bound:.2g} ({KL_RATIO:g} x the Q8 activation effect {q8_max:.2g}); max rel diff {rel:.2g}; "
              f"argmax equal at {int(am_eq.sum())}/{len(am_eq)} positions ({int(decisive.sum())} decisive)"
              if good else
              f"KL {kl_max:.3g} vs bound {bound:.3g} (Q8 effect {q8_max:.3g}); argmax equal where decisive: "
              f"{argmax_ok}; max rel diff {rel:.3g}" + (f"; no rounding rule for {ref['unknown'][:3]}"
                                                         if ref["unknown"] else ""))
    res.ok_or_fail("logits", name, good, detail + "; reference rounds activations as llama.cpp's CPU matmul",
                   diff, SOURCE)


__all__ = ["runtime_check", "run_llama_cpp", "emulated_logits", "q8_0", "q8_0_ref", "q8_k", "VEC_DOT",
           "KL_RATIO", "INCOMPLETE", "OK"]
