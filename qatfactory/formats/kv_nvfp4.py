"""NVFP4 KV cache: E2M1 elements in blocks of 16 along head_dim, one E4M3 scale per block computed at
write time, one fp32 scale per layer for K and one for V from the checkpoint.

Layout of one (token, head) row of head_dim elements (vLLM ``nvfp4_kv_cache_full_dim``:
head_dim/2 + head_dim/16 bytes, data then scales)::

    codes [head_dim/2]   byte i = code[2i] | code[2i+1] << 4      (pairs, low nibble first)
    sf    [head_dim/16]  E4M3 bits of each block's scale
    read back = fl(e2m1(code) * fp32(sf)) * s                      s = k_scale / v_scale

The per-layer scale ``s = fp32(amax) / 448`` rounded up to a bf16 value (kv.amax_over_448: vLLM holds it in
the model's dtype): ModelOpt's HF exporter writes ``k_proj.k_scale`` /
``v_proj.v_scale`` = amax / 448 "for both FP8 and NVFP4 KV cache" (``unified_export_hf.py``) with
``kv_cache_quant_algo: NVFP4``, and vLLM 0.24 uses the loaded scales as the decode factors of its
NVFP4 attention (``v1/attention/backends/flashinfer.py``: ``bmm1_scale *= q_scale * k_scale``,
``bmm2_scale *= v_scale``). So s is the dequantization scale and the block scales are
``vmax / (6 s)`` (at most 448/6 = 74.7 for a calibrated amax).

Write rule: vLLM's NVFP4 quantizer in its float32 order (``nvfp4_utils.cuh cvt_warp_fp16_to_fp4``,
the rule of ``nvfp4_act``, see nvfp4.py) with input_scale = s, S = fl(1/s)::

    SF  = S * fl(vmax * RN(1/6));   sf = E4M3 RN satfinite(SF)   (no lower clamp: a tiny block -> 0)
    out = sf != 0 ? 1 / fl(fp32(sf) * fl(1/S)) : 0;   code = E2M1 RNE satfinite(x * out), sign of x*out

What is a transcription here: vLLM serves an NVFP4 KV cache only on Blackwell (sm100f, trtllm-gen
attention); its cache writer kernel of the 0.24 release was not read (not in the Python sources)
and cannot run on the H200 or the CPU. The rule above is its activation quantizer applied with the
checkpoint's scale, the reading that is consistent with the attention's bmm scales; the E2M1 and
E4M3 roundings are checked against ml_dtypes on CPU, the whole write path must be confirmed on a
Blackwell GPU (benchmarks/kv_cache.py --engine-check). SGLang's NVFP4 KV path was not read either.
"""
from __future__ import annotations

import numpy as np
import torch

from . import codecs as C
from .kv import KVCacheFormat, KVCacheSpec, amax_over_448, register_kv

BLOCK = 16
_RCP6 = np.float32(1.0) / np.float32(6.0)


def _f32(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x).astype(np.float32)


class NVFP4KV(KVCacheFormat):
    def scale(self, amax) -> torch.Tensor:
        return amax_over_448(self.name, amax)

    def row_bytes(self, head_dim: int) -> int:
        self.check_head_dim(head_dim)
        return head_dim // 2 + head_dim // BLOCK

    # -- numpy reference --------------------------------------------------------------------
    def encode_ref(self, x, scale=None) -> np.ndarray:
        x32 = _f32(x)
        self._finite(self.name, x32)
        self.check_head_dim(x32.shape[-1])
        s = np.float32(float(self._scale_arg(scale)))
        S = np.float32(1.0) / s
        inv_S = np.float32(1.0) / S
        xb = x32.reshape(*x32.shape[:-1], -1, BLOCK)
        vmax = np.abs(xb).max(axis=-1)
        sf = (S * (vmax * _RCP6).astype(np.float32)).astype(np.float32)
        s8 = C.e4m3_encode_np(sf)
        with np.errstate(divide="ignore"):
            out = np.where(s8 != 0, np.float32(1.0) / (C.e4m3_decode_np(s8) * inv_S).astype(np.float32),
                           np.float32(0.0)).astype(np.float32)
        v = (xb * out[..., None]).astype(np.float32)
        codes = (C.e2m1_magnitude_np(np.abs(v), "rne") | (np.signbit(v).astype(np.uint8) << 3)).reshape(x32.shape)
        return np.concatenate([C.pack_pairs_np(codes), s8], axis=-1).astype(np.uint8)

    def decode_ref(self, b, head_dim: int, scale=None) -> np.ndarray:
        b = np.asarray(b, dtype=np.uint8)
        s = np.float32(float(self._scale_arg(scale)))
        packed, s8 = b[..., : head_dim // 2], b[..., head_dim // 2:]
        vals = C.e2m1_decode_np(C.unpack_pairs_np(packed)).reshape(*s8.shape, BLOCK)
        prod = (vals * C.e4m3_decode_np(s8)[..., None]).astype(np.float32)
        return (prod * s).astype(np.float32).reshape(*s8.shape[:-1], head_dim)

    # -- torch emulator ---------------------------------------------------------------------
    def encode(self, x: torch.Tensor, scale=None) -> torch.Tensor:
        self._finite(self.name, x)
        self.check_head_dim(x.shape[-1])
        s = self._scale_arg(scale).to(x.device)
        S = 1.0 / s
        inv_S = 1.0 / S
        xb = x.float().reshape(*x.shape[:-1], -1, BLOCK)
        vmax = xb.abs().amax(dim=-1)
        s8 = C.e4m3_encode(S * (vmax * float(_RCP6)))
        out = torch.where(s8 != 0, 1.0 / (C.e4m3_decode(s8) * inv_S), torch.zeros_like(vmax))
        v = xb * out.unsqueeze(-1)
        codes = (C.e2m1_magnitude(v.abs(), "rne") | (torch.signbit(v).to(torch.uint8) << 3)).reshape(x.shape)
        return torch.cat([C.pack_pairs(codes), s8], dim=-1)

    def decode(self, b: torch.Tensor, head_dim: int, scale=None) -> torch.Tensor:
        s = self._scale_arg(scale).to(b.device)
        packed, s8 = b[..., : head_dim // 2], b[..., head_dim // 2:]
        vals = C.e2m1_decode(C.unpack_pairs(packed)).reshape(*s8.shape, BLOCK)
        prod = vals * C.e4m3_decode(s8).unsqueeze(-1)       # exact: <= 6 significant bits
        return (prod * s).reshape(*s8.shape[:-1], head_dim)


NVFP4_KV_SPEC = KVCacheSpec(
    name="nvfp4_kv",
    engine="vLLM 0.24 NVFP4 KV cache (Blackwell): scales as ModelOpt 0.47 exports them; write rule = vLLM's "
           "cvt_warp_fp16_to_fp4 with input_scale = k_scale (a transcription, see kv_nvfp4.py)",
    element="e2m1", block=BLOCK, static_scale=True, head_order="hf", bits_per_element=4.5,
    scale_rule="s = fp32(amax)/448 rounded up to a bf16 value, per layer for K and V; block sf = E4M3(fl(1/s) * vmax * RN(1/6)); "
               "read = e2m1 * sf * s",
    rounding="E2M1 RNE satfinite of x * 1/(sf * s); E4M3 RN satfinite block scales, no lower clamp",
    oracle="ml_dtypes float4_e2m1fn and float8_e4m3fn casts composed in vLLM's float32 order (the composition "
           "itself is a transcription; the writer kernel runs on Blackwell only)",
    vllm_cache_dtype="nvfp4", modelopt_algo="NVFP4",
    notes="compressed-tensors cannot carry it (vLLM accepts only 8-bit float kv_cache_scheme); needs sm100f")

NVFP4_KV = register_kv(NVFP4KV(NVFP4_KV_SPEC))
