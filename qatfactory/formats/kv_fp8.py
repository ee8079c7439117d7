"""FP8 E4M3 KV cache with one fp32 scale per layer for K and one for V: vLLM's and SGLang's write paths.

Layout (per token and head, head_dim elements; the scale is one fp32 per layer and tensor)::

    cache byte[j] = E4M3(x[j] / s)          e4m3fn: bias 7, 3 mantissa bits, max 448, no Inf
    read back     = fp32(byte[j]) * s        s = k_scale (K) or v_scale (V), from the checkpoint

The scale: ``s = fp32(amax) / 448`` -- what ModelOpt's HF exporter writes as
``<attn>.k_proj.k_scale`` / ``v_proj.v_scale`` (``modelopt/torch/export/unified_export_hf.py``:
amax / kv_cache_max_bound, 448 for FP8 and NVFP4 alike) and what compressed-tensors' FP8 observer
stores as ``<attn>.k_scale`` -- rounded up to a bfloat16 value (kv.amax_over_448). vLLM loads the
scale into a parameter of the model's dtype (``quantization/kv_cache.py`` ``KVCacheScaleParameter``),
then ``BaseKVCacheMethod.process_weights_after_loading`` uses both scales > 0 as they are (x2 on fnuz
ROCm platforms, 1.0 when the checkpoint has none): a bf16 value is the one scale a bf16 model keeps
unchanged (a float32 amax / 448 came back moved by up to 0.32% from a served SmolLM2, H100, 2026-12-06).
SGLang keeps the scales in float32.

``fp8_e4m3`` -- vLLM (read: 0.24 Python sources, ``csrc/quantization/fp8/nvidia/quant_utils.cuh``
``scaled_vec_conversion``, called by ``cache_kernels.cu`` ``reshape_and_cache_flash`` through
``CopyWithScaleOp``)::

    byte = __nv_cvt_float_to_fp8(float(x) / s, __NV_SATFINITE, __NV_E4M3)
         = RNE to E4M3 of the float32 quotient, saturating to +-448        (|x/s| > 448 -> +-448)

  The quotient is the C ``/`` as written (IEEE division unless the extension is built with
  fast-math; benchmarks/kv_cache.py --engine-check compares the op's bytes with this rule on a GPU).
  The attention kernels multiply the scale back in (FA3: ``softmax_scale_log2 *= q_descale * k_descale``,
  the output times ``v_descale``; Triton: ``score_scale = scale * q_scale * k_scale``); where they dequantize
  to the model dtype they compute ``bf16(fp32(byte) * s)``, which is ``decode(...).to(bf16)`` here. On
  Hopper vLLM's fp8 backends read the bytes without dequantizing and run the attention in FP8 (query and P
  cast to E4M3): formats/kv_attention.py.

``fp8_e4m3_sglang`` -- SGLang (``python/sglang/srt/mem_cache/memory_pool.py``
``MHATokenToKVPool.set_kv_buffer``)::

    cache_k.div_(k_scale); cache_k = cache_k.to(torch.float8_e4m3fn)

  an in-place division of the model-dtype tensor, so the quotient is rounded to the model dtype
  (bf16) first, and PyTorch's CUDA kernel for ``tensor / python scalar`` multiplies by the float32
  reciprocal: ``y = bf16(float(x) * fl(1/s))``, then torch's float -> e4m3fn cast, RNE and NOT
  saturating (c10 ``fp8e4m3fn_from_fp32_value``, the conversion torch's CUDA cast uses):
  ``|y| > 464`` gives NaN (0x7F, sign kept), ``[448, 464]`` rounds to 448.
  The double rounding (bf16, then E4M3) and the reciprocal make it a different rule from vLLM's;
  tests/formats/test_kv.py shows bytes where they differ. A transcription of torch's CUDA behaviour
  (torch 2.13's CPU cast saturates instead), checked against ml_dtypes' non-saturating cast.

Calibrated amax is K's or V's largest magnitude over the calibration data (or the MSE choice),
so ``x/s`` stays within 448 there; a larger activation at serving time saturates (vLLM) or
becomes NaN (SGLang), in training exactly as in the engine.
"""
from __future__ import annotations

import numpy as np
import torch

from . import codecs as C
from .kv import KVCacheFormat, KVCacheSpec, amax_over_448, register_kv

# torch's non-saturating cast (c10 fp8e4m3fn_from_fp32_value): above 464, the midpoint between 448 and the
# NaN pattern's "480", the result is NaN; 464 itself rounds to even, 448
_NAN_ABOVE = 464.0


def _f32(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x).astype(np.float32)


def _bf16_round_np(v: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even) -> float32, from the bits (finite inputs)."""
    b = np.ascontiguousarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


class FP8KV(KVCacheFormat):
    """vLLM: E4M3 RN satfinite of fp32(x) / s."""

    def scale(self, amax) -> torch.Tensor:
        return amax_over_448(self.name, amax)

    def row_bytes(self, head_dim: int) -> int:
        return head_dim

    def encode_ref(self, x, scale=None) -> np.ndarray:
        x32 = _f32(x)
        self._finite(self.name, x32)
        s = np.float32(float(self._scale_arg(scale)))
        with np.errstate(over="ignore"):
            v = (x32 / s).astype(np.float32)
        return C.e4m3_encode_np(v)

    def decode_ref(self, b, head_dim: int, scale=None) -> np.ndarray:
        s = np.float32(float(self._scale_arg(scale)))
        return (C.e4m3_decode_np(np.asarray(b, dtype=np.uint8)) * s).astype(np.float32)

    def encode(self, x: torch.Tensor, scale=None) -> torch.Tensor:
        self._finite(self.name, x)
        s = self._scale_arg(scale).to(x.device)
        # a full tensor divisor: CUDA's `tensor / scalar` would multiply by fl(1/s) instead
        v = x.float() / s.expand(x.shape)
        return C.e4m3_encode(v)

    def decode(self, b: torch.Tensor, head_dim: int, scale=None) -> torch.Tensor:
        s = self._scale_arg(scale).to(b.device)
        return C.e4m3_decode(b) * s


class FP8KVSGLang(FP8KV):
    """SGLang: y = model_dtype(float(x) * fl(1/s)); torch's non-saturating cast of y to e4m3fn."""

    def encode_ref(self, x, scale=None) -> np.ndarray:
        dt = x.dtype if isinstance(x, torch.Tensor) else torch.float32
        x32 = _f32(x)
        self._finite(self.name, x32)
        s = np.float32(float(self._scale_arg(scale)))
        r = np.float32(1.0) / s
        with np.errstate(over="ignore"):
            y = (x32 * r).astype(np.float32)
        if dt == torch.bfloat16:
            y = _bf16_round_np(y)
        elif dt == torch.float16:
            y = y.astype(np.float16).astype(np.float32)
        b = C.e4m3_encode_np(y)
        nan = np.abs(y) > np.float32(_NAN_ABOVE)
        return np.where(nan, (b & 0x80) | 0x7F, b).astype(np.uint8)

    def encode(self, x: torch.Tensor, scale=None) -> torch.Tensor:
        self._finite(self.name, x)
        s = self._scale_arg(scale).to(x.device)
        r = 1.0 / s                                   # float32 reciprocal, as CUDA's scalar division
        y = (x.float() * r).to(x.dtype).float() if x.dtype in (torch.bfloat16, torch.float16) else x.float() * r
        b = C.e4m3_encode(y)
        return torch.where(y.abs() > _NAN_ABOVE, (b & 0x80) | 0x7F, b)


_COMMON = dict(element="e4m3", block=0, static_scale=True, head_order="hf", bits_per_element=8.0)

FP8_SPEC = KVCacheSpec(
    name="fp8_e4m3",
    engine="vLLM 0.24 reshape_and_cache_flash (csrc/quantization/fp8/nvidia/quant_utils.cuh scaled_vec_conversion)",
    scale_rule="s = fp32(amax)/448 rounded up to a bf16 value (vLLM holds it in the model's dtype), per layer for K "
               "and for V (k_scale / v_scale); cache = E4M3(x/s); read = e4m3*s",
    rounding="fp32 x/s (IEEE division), RNE to E4M3, saturating to +-448 (__NV_SATFINITE)",
    oracle="torch float8_e4m3fn cast and ml_dtypes float8_e4m3fn (after a clip to +-448) of fp32 x/s",
    vllm_cache_dtype="fp8", modelopt_algo="FP8", ct_num_bits=8,
    notes="vLLM's FLASH_ATTN (FA3) and TRITON_ATTN backends also cast the query (q_scale 1.0 without a checkpoint "
          "q_scale) and P to FP8: not part of the cache; emulated by QuantConfig.kv_attention (formats/kv_attention.py)",
    **_COMMON)

FP8_SGLANG_SPEC = KVCacheSpec(
    name="fp8_e4m3_sglang",
    engine="SGLang memory_pool.py MHATokenToKVPool.set_kv_buffer (cache_k.div_(k_scale); .to(float8_e4m3fn))",
    scale_rule="s = fp32(amax)/448 rounded up to a bf16 value (as for vLLM; SGLang keeps it in float32), per layer "
               "for K and for V (k_scale / v_scale); cache = E4M3(dtype(x*fl(1/s)))",
    rounding="x * fl(1/s) rounded to the model dtype (in-place div_ on a CUDA tensor), then RNE to E4M3, "
             "non-saturating: |y| > 464 -> NaN (torch's CUDA cast)",
    oracle="ml_dtypes bfloat16 and float8_e4m3fn casts (non-saturating, as torch's CUDA cast); a transcription "
           "of torch's CUDA scalar division",
    sglang_cache_dtype="fp8_e4m3", modelopt_algo="FP8", ct_num_bits=8, overflow="nan",
    notes="the same checkpoint scales as fp8_e4m3; differs from vLLM's rule in the last E4M3 bit where the bf16 "
          "rounding moves x/s across a tie, and beyond 448 (NaN instead of saturation)",
    **_COMMON)

FP8_KV = register_kv(FP8KV(FP8_SPEC))
FP8_KV_SGLANG = register_kv(FP8KVSGLang(FP8_SGLANG_SPEC))
