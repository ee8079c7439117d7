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
1/d and roundf, and measurably differs); tests/exporters/test_llama_cpp_emulation.py compares them with
libggml and with llama.cpp's own ``from_float``.

The run uses an F32 KV cache and no flash attention, so attention adds no rounding of its own,
and the CPU's plain backend (``use_extra_bufts=False``: no AMX/repacked weight layouts; on an AMX
machine llama.cpp 0c1e570's AMX matmul crashed on these tiny files).

Tolerance, from first principles. After the emulation the logits agree to float summation order
(tiny models of the matrix: KL ~1e-14 on most prompts) unless a rounding sits so close to its
boundary that llama.cpp's input, which differs from ours in its last bits, lands on the other side.
Such a boundary event moves the residual stream downstream by a fraction of a Q8 step, which
re-draws part of the later roundings: the Q8 rounding is chaotic in its input. On the tiny models an
event costs up to a third of the Q8 rounding's own KL; on a real model (SmolLM2-135M, 30 layers)
events happen on every prompt and the emulation halves the KL rather than removing it. The check
therefore measures both scales on the same prompts: (a) the Q8 effect, KL between the emulated and
the plain student, and (b) the tipping effect, KL between the emulated student and the same forward
with every rounding within float noise of its boundary (< 1e-4 of a Q8 step, 2.5x the largest input
difference measured against llama.cpp's own activations; fp16/bf16 roundings within 1e-6 relative)
taken the other way, i.e. the spread that boundary events produce. llama.cpp tips some of those
roundings, not all, so (b) is the largest KL over five tipped forwards: all of them, and four random
halves (seeded, so a verdict repeats). One forward alone is a noisy estimate: on a QAD-trained SmolLM2
Q4_K_M (2026-12-03) one prompt's draws spanned 0.015-0.041 and llama.cpp's KL on it was 0.039, which the
all-tipped forward alone (0.015) had failed as an export error. It runs four prompts and requires
KL(reference || llama.cpp) <= max(0.1 x (a), 2 x (b)) on each, and <= max(0.1 x (a), (b)) on at
least one. A gross error is systematic, shows on every prompt and is many times the Q8 effect (tiny
llama/qwen3: rope theta x2 gives 10-80 x (a) and fails); a small one such as rms eps 1e-6 -> 1e-5
(0.5-0.8 x (a)) is within what boundary events can do and is left to the metadata, bytes and
transformers checks, which compare exactly. Measured on SmolLM2-135M Q4_K_M: (a) 0.017-0.047,
(b) 0.010-0.048, KL to llama.cpp 0.008-0.016 (0.02-0.05 without the emulation) on one machine; on a
2-core AMD EPYC (AVX-512) KL to llama.cpp 0.015-0.074 with (a) 0.018-0.057. Plus: finite logits, and the same argmax at every position whose
reference top-2 margin exceeds the whole Q8 effect on that position's logits.
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
import torch.nn.functional as F

from qatfactory.formats import ConvertedModel

from .common import model_from_state_dict, nonfinite, student_weights, tied
from .result import FAIL, INCOMPLETE, Missing, VerifyResult

KL_RATIO = 0.1      # KL(reference || llama.cpp) allowed, as a fraction of the Q8 activation effect's KL ...
AMB_FACTOR = 2.0    # ... or as a multiple of the KL of tipping every rounding that sits within float noise
KL_FLOOR = 1e-10    # nats: float-summation noise when the Q8 effect itself is ~0
N_PROMPTS = 4       # the gate's prompt and three more of the same length
N_DRAWS = 4         # tipping effect: all ambiguous roundings tipped, and this many random halves of them
SOURCE = "llama-cpp-python (llama.cpp 0c1e570)"

# ggml-cpu.c type_traits_cpu[type].vec_dot_type for the weight types the exporters write
VEC_DOT = {"Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K", "Q2_K": "Q8_K", "Q3_K": "Q8_K", "TQ1_0": "Q8_K",
           "TQ2_0": "Q8_K",
           "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "MXFP4": "Q8_0", "NVFP4": "Q8_0", "IQ4_NL": "Q8_0",
           "BF16": "BF16", "F16": "F16", "F32": "F32"}


# ============================================================================ activation rounding
# Roundings within this distance of a rounding boundary can go either way in llama.cpp: its inputs
# differ from ours in the last bits (float summation order). Measured against llama.cpp's own matmul
# inputs (its eval callback) on the tiny models: <= 4e-5 of a Q8 step, a few fp32 ulp.
Q_EPS = 1e-4        # in units of one Q8 step
REL_EPS = 1e-6      # relative, for the fp16 Q8_0 block scale and bf16/f16 activations


def _draw(amb: torch.Tensor, gen: Optional[torch.Generator]) -> torch.Tensor:
    """All the ambiguous roundings (gen None), or each of them with probability 1/2 (one draw)."""
    if gen is None:
        return amb
    return amb & (torch.rand(amb.shape, generator=gen) < 0.5)


def _flip_ties(v: torch.Tensor, q: torch.Tensor, flip: bool, gen: Optional[torch.Generator] = None):
    """q = round(v) with the ambiguous ones (|v - k - 1/2| < Q_EPS) taken the other way when flip
    (with ``gen``: a random half of them)."""
    off = ((v - torch.floor(v)) - 0.5).abs()
    # an exact tie is no ambiguity: round-half-even decides it the same way on both sides when the
    # inputs are bit-equal (the first layer's, from bf16 embedding rows through the emulated norm)
    amb = (off < Q_EPS) & (off > 0)
    if flip:
        amb = _draw(amb, gen)
        fl = torch.floor(v)
        q = torch.where(amb, torch.where(q == fl, fl + 1, fl), q)
    return q, int(amb.sum())


def _other_neighbour(x: torch.Tensor, r: torch.Tensor, dtype) -> torch.Tensor:
    """The representable ``dtype`` value on the other side of x from its rounding r."""
    bits = torch.int16
    rb = r.to(dtype).view(bits).to(torch.int32)
    up = (x > r) == (r >= 0)  # moving away from zero in magnitude when x is beyond r
    ob = torch.where(up, rb + 1, rb - 1).to(torch.int16)
    return ob.view(dtype).float()


def _flip_fp(x: torch.Tensor, dtype, flip: bool, gen: Optional[torch.Generator] = None):
    r = x.to(dtype).float()
    other = _other_neighbour(x, r, dtype)
    mid = (r + other) / 2
    amb = ((x - mid).abs() <= REL_EPS * x.abs()) & (x != r) & torch.isfinite(other)
    if flip:
        amb = _draw(amb, gen)
        r = torch.where(amb, other, r)
    return r, int(amb.sum())


def q8_0(x: torch.Tensor, flip: bool = False, count: Optional[list] = None,
         gen: Optional[torch.Generator] = None) -> torch.Tensor:
    """The values llama.cpp's x86 quantize_row_q8_0 gives an fp32 row (blocks of 32)."""
    sh = x.shape
    b = x.float().reshape(-1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    d32 = amax / 127.0
    d, n_d = _flip_fp(d32, torch.float16, flip, gen)
    inv = torch.where(amax > 0, torch.tensor(127.0) / torch.where(amax > 0, amax, torch.ones_like(amax)),
                      torch.zeros_like(amax))
    v = b * inv
    q, n_q = _flip_ties(v, torch.round(v), flip, gen)  # round half to even, as _mm256_round_ps(_MM_ROUND_NEAREST)
    if count is not None:
        count.append(n_q + n_d)
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


def q8_k(x: torch.Tensor, flip: bool = False, count: Optional[list] = None,
         gen: Optional[torch.Generator] = None) -> torch.Tensor:
    """The values quantize_row_q8_K(_ref) gives (blocks of 256; d kept in fp32)."""
    sh = x.shape
    b = x.float().reshape(-1, 256)
    idx = b.abs().argmax(-1, keepdim=True)  # the first element of largest magnitude, signed
    mx = torch.gather(b, -1, idx)
    nz = mx != 0
    one = torch.ones_like(mx)
    iscale = torch.where(nz, torch.tensor(-127.0) / torch.where(nz, mx, one), torch.zeros_like(mx))
    v = iscale * b
    q, n_q = _flip_ties(v, torch.round(v), flip, gen)
    q = q.clamp(max=127)
    if count is not None:
        count.append(n_q)
    d = torch.where(nz, 1.0 / torch.where(nz, iscale, one), torch.zeros_like(mx))
    return (q * d).reshape(sh)


def _fp(dtype):
    def r(x, flip=False, count=None, gen=None):
        y, n = _flip_fp(x.float(), dtype, flip, gen)
        if count is not None:
            count.append(n)
        return y
    return r


ROUND = {"Q8_0": q8_0, "Q8_K": q8_k, "BF16": _fp(torch.bfloat16), "F16": _fp(torch.float16),
         "F32": lambda x, flip=False, count=None, gen=None: x}


def _rms_norm_llama_cpp(self, x: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
    """ggml_compute_forward_rms_norm_f32 + the norm weight: sum of x*x in double, mean and
    1.0f/sqrtf(mean + eps) in float, then (x * scale) * w; w = 1 + the parameter (in fp32) for Gemma,
    whose GGUF stores that sum."""
    xf = x.float()
    s = (xf * xf).double().sum(-1, keepdim=True)
    mean = (s / xf.shape[-1]).float()
    eps = torch.tensor(float(getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))), dtype=torch.float32)
    w = self.weight.float() + shift if shift else self.weight.float()
    return (xf * (1.0 / torch.sqrt(mean + eps))) * w


class GeluTable(torch.nn.Module):
    """ggml's CPU GELU (ggml_vec_gelu_f32 / ggml_vec_geglu_f32 with GGML_GELU_FP16): the input rounded to
    fp16, looked up in a table of fp16(tanh-GELU), x itself at or above 10 and 0 at or below -10."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = F.gelu(xf.half().float(), approximate="tanh").half().float()
        return torch.where(xf <= -10.0, torch.zeros_like(xf), torch.where(xf >= 10.0, xf, y))


# architectures whose RMSNorm multiplies by (1 + w) and whose FFN is tanh-GELU gated (llama.cpp: gemma*)
GEMMA_ARCHS = ("gemma3",)


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
def emulated_logits(student: ConvertedModel, prompts: List[List[int]], types: Dict[str, str], names
                    ) -> Dict[str, Any]:
    """Plain, emulated and tipped logits [prompts, positions, vocab] of the student's model, and
    what was rounded how."""
    model = model_from_state_dict(student.config, student_weights(student), eager_experts=True)
    ids = torch.tensor(prompts)
    plain = model(ids).logits.float()
    rule: Dict[int, str] = {}
    unknown = []
    # remove_duplicate=False: a tied lm_head IS the embedding parameter, and its matmul needs a rule
    for pname, prm in model.named_parameters(remove_duplicate=False):
        if prm.ndim < 2 or "embed_tokens" in pname:
            continue
        gnames = _param_gguf_name(pname, names, bool(tied(student)))
        kinds = {VEC_DOT.get(types.get(g, "?")) for g in gnames}
        if len(kinds) != 1 or None in kinds:
            unknown.append(f"{pname} ({[types.get(g) for g in gnames]})")
            continue
        rule[prm.untyped_storage().data_ptr()] = kinds.pop()
    gemma = getattr(names, "arch_name", None) in GEMMA_ARCHS
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            fwd = _rms_norm_llama_cpp if not gemma else (lambda self, x: _rms_norm_llama_cpp(self, x, 1.0))
            mod.forward = _types.MethodType(fwd, mod)
        if gemma and hasattr(mod, "act_fn") and hasattr(mod, "gate_proj"):
            mod.act_fn = GeluTable()
    used: Dict[str, int] = {}
    amb: List[int] = []
    lin = F.linear
    state: Dict[str, Any] = {"flip": False, "gen": None}

    def rounded(x, w, b=None):
        r = rule.get(w.untyped_storage().data_ptr())
        if r is not None:
            if not state["flip"]:
                used[r] = used.get(r, 0) + 1
            x = ROUND[r](x, flip=state["flip"], count=None if state["flip"] else amb, gen=state["gen"])
        elif not state["flip"]:  # a matmul whose weight type is unknown cannot be emulated: say so
            unknown.append(f"a linear with weight {tuple(w.shape)}")
        return lin(x, w, b)

    F.linear = rounded
    try:
        emu = model(ids).logits.float()
        state["flip"] = True   # every rounding that float summation order could tip, tipped
        flipped = model(ids).logits.float()
        draws = []
        for k in range(N_DRAWS):   # llama.cpp tips some of them, not all: random halves, seeded
            state["gen"] = torch.Generator().manual_seed(k)
            draws.append(model(ids).logits.float())
    finally:
        F.linear = lin
    return {"plain": plain, "emulated": emu, "flipped": flipped, "draws": draws, "ambiguous": int(sum(amb)),
            "used": used, "unknown": unknown}


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
path, prompts, out, n_ctx = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
n = max(len(p) for p in prompts)
_defaults = C.llama_model_default_params
def _params():
    p = _defaults()
    p.use_extra_bufts = False   # the plain CPU backend: no AMX / repacked weight layouts
    return p
C.llama_model_default_params = _params
try:
    llm = Llama(model_path=path, logits_all=True, n_ctx=n_ctx, n_batch=max(32, n), n_ubatch=max(32, n),
                n_threads=max(1, min(4, os.cpu_count() or 1)), type_k=0, type_v=0, flash_attn=False, verbose=False)
except MemoryError as e:
    print(f"AllocationError: {e}", file=sys.stderr)
    sys.exit(4)
except ValueError as e:
    # the model loaded (else "Failed to load model"), its context did not: the machine's memory, not the file
    if "llama_context" not in str(e):
        raise
    print(f"AllocationError: {e} (n_ctx={n_ctx})", file=sys.stderr)
    sys.exit(4)
json.dump({"n_ctx": llm.n_ctx()}, open(out + ".json", "w"))
scores = []
for prompt in prompts:
    llm.reset()
    llm.eval(prompt)
    scores.append(np.array(llm.scores[: len(prompt)], dtype=np.float32))
np.save(out, np.stack(scores))
"""


class CannotRun(RuntimeError):
    """llama.cpp could not run here (its context could not be allocated, the process was killed): says
    nothing about the file, so the row is INCOMPLETE, never FAIL."""


def context_for(prompts: List[List[int]]) -> int:
    """The context the probe prompts need (their length plus a margin, a multiple of 32), never the
    model's trained context: a tiny Mistral claiming 131072 positions wanted 24 GiB at n_ctx=0."""
    n = max(len(p) for p in prompts) + 16
    return max(64, -(-n // 32) * 32)


def run_llama_cpp(path: Path, prompts: List[List[int]], timeout: float = 600.0, info: Optional[Dict] = None
                  ) -> torch.Tensor:
    """Logits [prompts, positions, vocab] of llama.cpp itself, in a separate process: llama.cpp's
    libggml must not meet libggml-python's (same soname, different ABI) loaded by the dequantizer check.
    ``info`` receives the context llama.cpp opened (n_ctx)."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise Missing("llama_cpp")
    with tempfile.TemporaryDirectory(prefix="qf-llama-") as td:
        out = os.path.join(td, "scores.npy")
        r = subprocess.run([sys.executable, "-c", _RUNNER, str(path), json.dumps([[int(i) for i in p] for p in prompts]),
                            out, str(context_for(prompts))],
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode == 3:
            raise Missing("llama_cpp", (r.stderr.strip().splitlines() or [""])[-1])
        if r.returncode in (4, -9):
            tail = [ln for ln in r.stderr.strip().splitlines() if ln.strip()][-1:]
            raise CannotRun("llama.cpp could not allocate what the probe needs on this machine ("
                            + ("killed, signal 9" if r.returncode == -9 else " | ".join(tail)[-300:]) + ")")
        if info is not None and os.path.exists(out + ".json"):
            with open(out + ".json") as f:
                info.update(json.load(f))
        if r.returncode != 0:
            tail = [ln for ln in r.stderr.strip().splitlines() if ln.strip()][-2:]
            how = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
            raise RuntimeError(f"llama.cpp failed to load/run the file ({how}): " + " | ".join(tail)[-400:])
        return torch.from_numpy(np.load(out))


def prompts_for(prompt: List[int], vocab: int, n: int = N_PROMPTS) -> List[List[int]]:
    """The gate's prompt and n-1 others of the same length (other strides through the vocabulary)."""
    return [list(prompt)] + [[(int(x) * (2 * k + 3) + 5 * k + 1) % vocab for x in prompt] for k in range(n - 1)]


def runtime_check(res: VerifyResult, path: Path, student: ConvertedModel, prompt: List[int], types: Dict[str, str],
                  names, cache: Dict[str, Any]) -> None:
    name = "llama.cpp runtime"
    prompts = prompts_for(prompt, int(student.config["vocab_size"]))
    info: Dict[str, Any] = {}
    try:
        got = run_llama_cpp(path, prompts, info=info)
    except Missing as e:
        res.missing("logits", name, e)
        return
    except CannotRun as e:
        res.add("logits", name, INCOMPLETE, f"not run: {e}", source=SOURCE)
        return
    except Exception as e:
        res.add("logits", name, FAIL, f"{type(e).__name__}: {e}", source=SOURCE)
        return
    try:
        ref = emulated_logits(student, prompts, types, names)
    except Missing as e:
        res.missing("logits", name, e)
        return
    emu, plain, tipped = ref["emulated"], ref["plain"], ref["flipped"]
    if tuple(got.shape) != tuple(emu.shape) or nonfinite(got):
        res.add("logits", name, FAIL, f"llama.cpp returned {tuple(got.shape)} logits with {nonfinite(got)} "
                                      f"NaN/Inf (reference {tuple(emu.shape)})", source=SOURCE)
        return
    kl = torch.stack([_kl_rows(emu[i], got[i]) for i in range(len(prompts))]).amax(-1)     # per prompt
    q8 = torch.stack([_kl_rows(emu[i], plain[i]) for i in range(len(prompts))]).amax(-1)
    # the tipping effect per prompt: the largest KL of the tipped forwards (all, and N_DRAWS random halves);
    # one draw alone is a noisy estimate of the spread (on SmolLM2 the draws of one prompt span ~3x)
    amb = torch.stack([torch.stack([_kl_rows(emu[i], t[i]).amax(-1) for t in [tipped] + ref["draws"]]).amax(0)
                       for i in range(len(prompts))])
    bound = torch.maximum(torch.maximum(KL_RATIO * q8, AMB_FACTOR * amb), torch.full_like(q8, KL_FLOOR))
    each_ok = bool((kl <= bound).all())
    # a boundary event is chance, an export error is not: at least one prompt stays within one
    # tipping effect (or 0.1 x the Q8 effect)
    tight = torch.maximum(torch.maximum(KL_RATIO * q8, amb), torch.full_like(q8, KL_FLOOR))
    best = int(torch.argmin(kl / tight))
    best_ok = float(kl[best]) <= float(tight[best])
    diff = float((got - emu).abs().max())
    rel = diff / max(float(emu.abs().max()), 1e-30)
    q8_logit = (plain - emu).abs().amax(-1)                         # the Q8 effect per position
    top2 = emu.topk(2, -1).values
    decisive = (top2[..., 0] - top2[..., 1]) > q8_logit
    am_eq = got.argmax(-1) == emu.argmax(-1)
    argmax_ok = bool(am_eq[decisive].all())
    res.logits["llama.cpp"] = {
        "prompts": len(prompts), "n_ctx": info.get("n_ctx"), "kl_max": float(kl.max()), "kl_per_prompt": kl.tolist(),
        "kl_q8_effect_max": float(q8.max()), "kl_q8_per_prompt": q8.tolist(),
        "kl_tipped_per_prompt": amb.tolist(), "kl_bound_per_prompt": bound.tolist(), "kl_bound": float(bound.min()),
        "best_prompt": best, "kl_best": float(kl[best]), "kl_best_bound": float(tight[best]),
        "max_abs_diff": diff, "max_rel": rel,
        "max_rel_first_prompt": float((got[0] - emu[0]).abs().max()) / max(float(emu[0].abs().max()), 1e-30),
        "argmax_agreement": float(am_eq.float().mean()), "decisive_positions": int(decisive.sum()),
        "plain_max_rel": float((got - plain).abs().max()) / max(float(plain.abs().max()), 1e-30),
        "plain_kl_max": float(max(float(_kl_rows(plain[i], got[i]).max()) for i in range(len(prompts)))),
        "ambiguous_roundings": ref["ambiguous"], "rounded": ref["used"], "not_emulated": ref["unknown"]}
    good = each_ok and best_ok and argmax_ok and not ref["unknown"]
    i = int(torch.argmax(kl / bound))
    detail = (f"{len(prompts)} prompts: KL <= max({KL_RATIO:g} x Q8 effect, {AMB_FACTOR:g} x tipping effect) on each "
              f"(worst {float(kl[i]):.2g} <= {float(bound[i]):.2g}; Q8 effect {float(q8[i]):.2g}, tipping "
              f"{float(amb[i]):.2g}); best prompt KL {float(kl[best]):.2g} <= {float(tight[best]):.2g}; "
              f"max rel diff {rel:.2g}; argmax equal at {int(am_eq.sum())}/{am_eq.numel()} positions "
              f"({int(decisive.sum())} decisive)")
    if not good:
        detail = ("FAILED: " + ("" if each_ok else "a prompt exceeds its bound; ") +
                  ("" if best_ok else "no prompt stays within one tipping effect / 0.1 x the Q8 effect; ") +
                  ("" if argmax_ok else "argmax differs at a decisive position; ") +
                  (f"no rounding rule for {ref['unknown'][:3]}; " if ref["unknown"] else "") + detail)
    res.ok_or_fail("logits", name, good, detail + "; reference rounds activations as llama.cpp's CPU matmul",
                   diff, SOURCE)


__all__ = ["runtime_check", "run_llama_cpp", "context_for", "CannotRun", "emulated_logits", "prompts_for", "q8_0", "q8_0_ref", "q8_k",
           "VEC_DOT", "KL_RATIO", "AMB_FACTOR"]
