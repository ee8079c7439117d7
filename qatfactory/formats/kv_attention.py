"""FP8 attention arithmetic that vLLM runs on top of an ``fp8_e4m3`` KV cache: the query cast, the scores,
P's cast to FP8 and the output scaling of its two Hopper backends, as data plus one numerics function.

    from qatfactory.formats.kv_attention import get_kv_attention, fp8_attention, query_values
    r = get_kv_attention("fa3")                     # or "triton"
    o = fp8_attention(r, q, k8, v8, k_scale, v_scale, scaling, keep)   # float32 [B, Hq, Tq, Dv]

``k8`` / ``v8`` are the cache's E4M3 values without their scale (``e4m3_decode`` of the bytes
``fp8_e4m3`` writes, formats/kv_fp8.py), ``keep`` a bool mask (True = attend) broadcastable to
[B, Hq, Tq, Tk]. Read from vLLM 0.24.0 (the wheel's Python sources) and from the FlashAttention 3
sources vLLM 0.24.0 builds, vllm-project/flash-attention commit 803020a8 (all 48 ``vllm_flash_attn/cute``
files of the wheel are that commit's ``flash_attn/cute``; ``hopper/`` kernels are the same at today's
HEAD). Our own words; nothing copied.

What vLLM computes (Hopper, ``--kv-cache-dtype fp8``, a ModelOpt or compressed-tensors checkpoint
with k_scale / v_scale and **no q_scale**):

1. Which backend. ``platforms/cuda.py:152-158``: on SM90 the priority is FLASH_ATTN, FLASHINFER,
   TRITON_ATTN; FLASH_ATTN takes an fp8 cache only with FA3 on the SM90 family
   (``v1/attention/backends/flash_attn.py:186-193``). Default on an H200: FLASH_ATTN = FA3
   (``--attention-backend TRITON_ATTN`` picks the other).
2. The query is quantized, both backends. ``model_executor/layers/attention/attention.py:433-450``
   builds ``QuantFP8(static=True, per-tensor)`` when the backend's ``supports_quant_query_input``
   (FA3: every non-XPU platform, ``fa_utils.py:200-201``; Triton: CUDA, ``triton_attn.py:510``) and
   the cache dtype starts with fp8; ``attention.py:486`` applies it with ``layer._q_scale`` to the
   2-D [tokens, heads*head_dim] query after RoPE. The value of ``_q_scale``:
   ``quantization/kv_cache.py:133-140`` first copies k_scale into it when the checkpoint has no
   q_scale (the "Setting it to k_scale" warning), but ``kv_cache.py:154-160`` then takes
   ``q_scale = 1.0`` because the checkpoint's ``layer.q_scale`` is still the -1 placeholder, and
   ``kv_cache.py:180`` copies that 1.0 over it: **q_scale = 1.0**. (compressed-tensors:
   ``CompressedTensorsKVCacheMethod.create_weights`` initializes q_scale to ones,
   ``compressed_tensors.py:1035-1037``, ``:1128`` uses it: also 1.0.) The cast: the CUDA op
   ``static_scaled_fp8_quant`` (``input_quant_fp8.py:124``; csrc ``fp8/common.cu``: ``inv = 1/scale``,
   ``x * inv``, clamp to +-448, ``cvt.rn.satfinite.e4m3``) or, compiled, ``forward_native``
   (``input_quant_fp8.py:217-221``: ``x.float() * scale.reciprocal()``, clamp, ``.to(fp8)``). Both
   are ``E4M3_RNE(clamp(fp32(q) * fl(1/q_scale), +-448))``; with q_scale = 1.0 that is RNE of q itself,
   saturating above 448, subnormal below 2^-6 (step 2^-9), zero below 2^-10.
3. K and V are read from the cache without dequantization (FA3 runs FP8 WGMMA on the bytes; Triton:
   ``triton_unified_attention.py:51-53``, the tile is cast to Q's fp8 dtype unchanged).
4. Scores. FA3: ``S = dot(Q8, K8)`` in fp32 (FP8 WGMMA), then the softmax works in base 2 with
   ``c = fl32(fl32(softmax_scale) * log2(e))`` (``mainloop_fwd_sm90_tma_gmma_ws.hpp:585``) times
   ``q_descale * k_descale`` (``flash_fwd_kernel_sm90.h:425-431``). Triton:
   ``score_scale = scale * q_scale * k_scale`` (fp32, left to right, ``triton_unified_attention.py:368``),
   ``S = score_scale * dot(Q8, K8)`` (``:520``).
5. P. Both kernels run an online softmax over key tiles and cast each tile's P to FP8 against the
   running row max at that tile, RNE satfinite (FA3: cutlass ``NumericArrayConverter<float_e4m3_t,
   float>``, ``mainloop...hpp:1233,1276``; Triton: ``P.to(V.dtype)``, ``triton_unified_attention.py:562``,
   which Triton lowers to ``cvt.rn.satfinite.e4m3x2.f32`` on SM90).
   FA3 (``flash_fwd_kernel_sm90.h:433``: ``Max_offset = 8`` for FP8; ``softmax.h:64-85``):
   ``P = exp2(S*c - (m*c - 8))``, so P lies in [0, 256] before the cast: the largest P of a row is
   256, and an entry is lost (0) only when 256 * exp(s - m) < 2^-10, i.e. below 2^-18 of the row max.
   Key tiles of kBlockN keys (``tile_size.h:52-76``, FP8 prefill with the default two-level
   accumulation: 128 for head_dim <= 96, 192 for <= 128, 96 for <= 192, 128 above; decode tiles,
   ``seqlen_q * heads/kv_heads <= 64`` (``heuristics.h:10-13``), are 128 / 96) are visited from the
   last to the first (``mainloop...hpp:1098``: ``n_block = n_block_max - 1``, then ``--n_block``).
   Triton (``triton_attention_helpers.py:396-418``): ``P = exp(S - m)`` (``tl.exp`` lowers to
   ``ex2.approx(x * log2e)``), P in [0, 1], no offset: an entry is lost when exp(s - m) < 2^-10 (below
   ~1e-3 of the row max) and [2^-10, 2^-6) keeps only a 2^-9 step. Tiles of 32 keys for prefill
   (``triton_unified_attention.py:774-775``), visited first to last; a running max that is -inf
   (a fully masked tile) becomes 0 (``triton_attention_helpers.py:409``).
6. Normalization. Both kernels sum the **unrounded** fp32 P (rescaled by exp of the max changes) for
   the row sum L, and accumulate ``dot(P8, V8)`` (FA3: per tile in FP8 WGMMA, added in fp32,
   ``utils.h:238-326``). FA3 output: ``acc * (1/L * v_descale)`` (``softmax.h:140-145``; the 2^8 of
   the offset is in both acc and L and cancels). Triton: ``acc / L``, then ``* v_scale``
   (``triton_unified_attention.py:622-624``). Written to the model dtype (FA3's FP8 kernels output
   bf16, ``flash_fwd_launch_template.h:212``).

The emulation (:func:`fp8_attention`) is a **transcription, not bit-exact**: it computes all scores of
a row at once and then, per key tile, the running max the kernel had at that tile (a cumulative max
over tiles in the kernel's order), so P's FP8 rounding uses the same reference point as the kernel;
each tile's ``P8 @ V8`` is weighted by ``exp(m_tile - m_final)`` instead of the kernel's chain of
per-step rescales; fp32 matmuls and ``torch.exp2`` replace FP8 WGMMA accumulation and ``ex2.approx``,
and FA3's fused ``s*c - max_scaled`` (FFMA) is two roundings here;
FA3's split-KV (a heuristic for few query blocks) and Triton's segmented decode kernel (3-D, for
decode batches) each keep a max per split, which this does not model. The Q cast and the cache
bytes are exact.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from . import codecs as C

LOG2E_F32 = float(np.float32(1.4426950408889634))    # Triton's constant in tl.exp's lowering, as fp32


@dataclass(frozen=True)
class KVAttentionRule:
    """One engine backend's FP8 attention arithmetic, as data (see the module docstring)."""

    name: str
    engine: str
    vllm_backend: str            # vLLM --attention-backend that runs it
    kv_formats: tuple            # KV-cache formats (formats/kv.py) whose cache it reads
    q_scale: float               # what divides q before its cast (vLLM without a checkpoint q_scale: 1.0)
    p_offset_log2: int           # P = 2^offset * exp(s - m) before the FP8 cast
    tile_order: str              # "descending" (FA3: last key tile first) | "ascending"
    exp_form: str                # "exp2_fma" (FA3) | "exp_sub" (Triton)
    normalize: str               # "mul_inv" (acc * (1/L * v)) | "div" (acc / L * v)
    source: str
    notes: str = ""

    def tile_n(self, head_dim: int) -> int:
        """Keys per tile of the prefill kernel (what a training forward over whole sequences meets)."""
        if self.name == "fa3":
            d = int(head_dim)
            return 128 if d <= 96 else 192 if d <= 128 else 96 if d <= 192 else 128
        return 32

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


FA3 = KVAttentionRule(
    name="fa3", engine="vLLM 0.24 FLASH_ATTN = FlashAttention 3 (vllm-project/flash-attention 803020a8, hopper/)",
    vllm_backend="FLASH_ATTN", kv_formats=("fp8_e4m3",), q_scale=1.0, p_offset_log2=8, tile_order="descending",
    exp_form="exp2_fma", normalize="mul_inv",
    source="attention.py:433-487, kv_cache.py:133-183, input_quant_fp8.py:124,217-221; FA3 softmax.h:64-85,140-149, "
           "flash_fwd_kernel_sm90.h:425-433, mainloop_fwd_sm90_tma_gmma_ws.hpp:585,1098,1233,1276,1329-1339, tile_size.h:52-76",
    notes="Q = E4M3(q) (q_scale 1.0); P = E4M3(exp2(s*c - (m_tile*c - 8))), c = fl(scale*log2e)*q_scale*k_scale; "
          "out = sum(P8 V8) * (1/L * v_scale), L over unrounded P")

TRITON = KVAttentionRule(
    name="triton", engine="vLLM 0.24 TRITON_ATTN (v1/attention/ops/triton_unified_attention.py, 2-D prefill kernel)",
    vllm_backend="TRITON_ATTN", kv_formats=("fp8_e4m3",), q_scale=1.0, p_offset_log2=0, tile_order="ascending",
    exp_form="exp_sub", normalize="div",
    source="attention.py:433-487, kv_cache.py:133-183, triton_attn.py:510,611-624; triton_unified_attention.py:51-55,"
           "362-368,520,539-562,622-624,774-775; triton_attention_helpers.py:396-418",
    notes="Q = E4M3(q) (q_scale 1.0); S = (scale*q_scale*k_scale) * dot(Q8, K8); P = E4M3(exp(S - m_tile)) in [0, 1]; "
          "out = sum(P8 V8) / L * v_scale, L over unrounded P")

KV_ATTENTION: Dict[str, KVAttentionRule] = {r.name: r for r in (FA3, TRITON)}


def get_kv_attention(name) -> KVAttentionRule:
    if isinstance(name, KVAttentionRule):
        return name
    try:
        return KV_ATTENTION[name]
    except KeyError:
        raise ValueError(f"unknown KV attention rule {name!r}; registered: {sorted(KV_ATTENTION)}") from None


def list_kv_attentions() -> List[str]:
    return sorted(KV_ATTENTION)


def attentions_for(kv_format: Optional[str]) -> List[str]:
    """The attention rules that read this KV-cache format's cache."""
    return [n for n, r in sorted(KV_ATTENTION.items()) if kv_format in r.kv_formats]


def default_attention(kv_format: Optional[str]) -> str:
    """The attention emulation a student trains with unless asked: "none" (only the cache write, whose bytes
    equal vLLM's own write op's) for every format. Until 2026-12-06 it was "fa3" for fp8_e4m3, FLASH_ATTN being
    vLLM's pick on SM90; measured against vLLM 0.24 serving a 2K fp8 export with FLASH_ATTN, the fa3 emulation
    was the further of the two from vLLM both times (KL 0.0193 vs 0.0186 cache-only on an H200, 2026-12-03;
    0.0197 vs 0.0190 on an H100, 2026-12-06; benchmarks/RESULTS.md). "fa3" and "triton" stay selectable."""
    return "none"


# ----------------------------------------------------------------------------- numerics
def e4m3_values(x: torch.Tensor) -> torch.Tensor:
    """float32 value of RNE-satfinite E4M3 of fp32(x) (the cvt.rn.satfinite.e4m3 of both kernels)."""
    return C.e4m3_decode(C.e4m3_encode(x.float()))


def query_values(q: torch.Tensor, q_scale: float = 1.0) -> torch.Tensor:
    """The FP8 query vLLM hands the kernel, as float32 E4M3 values: E4M3(fp32(q) * fl32(1/q_scale))."""
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(q_scale), dtype=torch.float32)
    return e4m3_values(q.float() * inv.to(q.device))


def _f32(x: float) -> float:
    return float(np.float32(x))


def _chunk(b: int, hq: int, tq: int, tk: int, n_tiles: int, dv: int, budget: int = 1 << 23) -> int:
    per_q = b * hq * max(tk, n_tiles * dv)
    return max(1, min(tq, budget // max(1, per_q)))


@torch.no_grad()
def fp8_attention(rule, q: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, k_scale, v_scale, scaling: float,
                  keep: Optional[torch.Tensor] = None, q_scale: Optional[float] = None,
                  tile_n: Optional[int] = None) -> torch.Tensor:
    """The attention output of ``rule`` (float32 [B, Hq, Tq, Dv]) for query ``q`` [B, Hq, Tq, D] (model
    dtype, after RoPE), cache values ``k8`` [B, Hkv, Tk, D] / ``v8`` [B, Hkv, Tk, Dv] (E4M3 values,
    unscaled), the per-layer ``k_scale`` / ``v_scale`` and ``keep`` (bool, True = attend; None = all).
    Rows with no key to attend give 0 (vLLM has none). See the module docstring for what is and is not
    the kernels' arithmetic."""
    r = get_kv_attention(rule)
    qs = r.q_scale if q_scale is None else float(q_scale)
    B, Hq, Tq, D = q.shape
    Bk, Hkv, Tk, Dk = k8.shape
    if Bk != B or Dk != D or v8.shape[:3] != k8.shape[:3] or Hq % Hkv:
        raise ValueError(f"fp8_attention: shapes q {tuple(q.shape)} k {tuple(k8.shape)} v {tuple(v8.shape)} do "
                         f"not fit one attention (GQA needs Hq % Hkv == 0)")
    G, Dv = Hq // Hkv, v8.shape[-1]
    tn = int(tile_n or r.tile_n(D))
    nT = -(-Tk // tn)
    pad = nT * tn - Tk
    ks, vs = _f32(float(k_scale)), _f32(float(v_scale))
    qv = query_values(q, qs).reshape(B, Hkv, G, Tq, D)
    k32 = k8.float().unsqueeze(2)                                        # [B, Hkv, 1, Tk, D]
    v32 = F.pad(v8.float(), (0, 0, 0, pad)).reshape(B, Hkv, nT, tn, Dv)
    if keep is not None:
        keep = keep.to(torch.bool)
        while keep.dim() < 4:
            keep = keep.unsqueeze(0)
    if r.exp_form == "exp2_fma":
        c = _f32(_f32(_f32(float(scaling)) * math.log2(math.e)) * _f32(_f32(qs) * ks))
    else:
        c = _f32(_f32(_f32(float(scaling)) * _f32(qs)) * ks)
    out = torch.empty(B, Hkv, G, Tq, Dv, dtype=torch.float32, device=q.device)
    step = _chunk(B, Hq, Tq, Tk + pad, nT, Dv, budget=1 << (25 if q.is_cuda else 23))
    ninf = float("-inf")
    for q0 in range(0, Tq, step):
        q1 = min(Tq, q0 + step)
        s = torch.matmul(qv[:, :, :, q0:q1], k32.transpose(-1, -2))       # [B, Hkv, G, tq, Tk] fp32
        if keep is not None:
            kp = keep[..., q0:q1, :].expand(B, Hq, q1 - q0, Tk).reshape(B, Hkv, G, q1 - q0, Tk)
            s = s.masked_fill(~kp, ninf)
        s = F.pad(s, (0, pad), value=ninf).reshape(B, Hkv, G, q1 - q0, nT, tn)
        if r.exp_form == "exp2_fma":
            tmax = s.amax(-1)                                             # raw-score max per tile
            m = tmax.flip(-1).cummax(-1).values.flip(-1)                  # running max, last tile first
            mfin = m[..., :1]
            ms = torch.where(torch.isneginf(m), torch.zeros_like(m), m * c - float(r.p_offset_log2))
            p = torch.exp2(s * c - ms.unsqueeze(-1))
            w = torch.exp2((m - mfin) * c)
        else:
            s = s * c
            tmax = s.amax(-1)
            m = tmax.cummax(-1).values                                    # running max, first tile first
            m = torch.where(torch.isneginf(tmax[..., :1]), m.clamp_min(0.0), m)   # -inf running max -> 0
            mfin = m[..., -1:]
            p = torch.exp2((s - m.unsqueeze(-1)) * LOG2E_F32)
            w = torch.exp2((m - mfin) * LOG2E_F32)
        w = torch.where(torch.isneginf(mfin) | torch.isneginf(m), torch.zeros_like(w), w)
        p8 = e4m3_values(p)
        L = (p.sum(-1) * w).sum(-1)                                       # unrounded P
        part = torch.einsum("bhgqtk,bhtkd->bhgqtd", p8, v32)             # each tile's P8 @ V8
        acc = (part * w.unsqueeze(-1)).sum(-2)
        if r.normalize == "mul_inv":
            inv = torch.where(L == 0, torch.zeros_like(L), 1.0 / L)
            o = acc * (inv * vs).unsqueeze(-1)
        else:
            o = torch.where(L.unsqueeze(-1) == 0, torch.zeros_like(acc), acc / L.unsqueeze(-1)) * vs
        out[:, :, :, q0:q1] = o
    return out.reshape(B, Hq, Tq, Dv)
