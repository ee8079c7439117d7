"""llama.cpp KV-cache types (``--cache-type-k`` / ``--cache-type-v``): q8_0, q4_0, q5_0 blocks of 32
along head_dim, each block its own fp16 scale, no per-tensor scale in any file.

Where the rule comes from (llama.cpp as vendored in llama-cpp-python 0.3.36, commit 0c1e570):
the cache is a ggml tensor of the cache type and every new K/V row (F32, one row of
n_kv_heads * head_dim per token) is written by ``ggml_set_rows``:

* CPU backend (``ggml-cpu/ops.cpp`` ``ggml_compute_forward_set_rows_impl``): the type's CPU
  ``from_float`` (``ggml-cpu.c`` type_traits_cpu). For Q4_0 and Q5_0 that is ``quantize_row_q4_0`` /
  ``quantize_row_q5_0`` = the reference ``quantize_row_*_ref``. For Q8_0 it is the SIMD
  ``quantize_row_q8_0`` (``ggml-cpu/arch/x86/quants.c`` on x86 with AVX/AVX2, what the runtime
  built here uses): ``d = fp16(amax/127)``, ``q = round-half-even(x * (127/amax))``, which is NOT the
  reference (``id = 1/d``, ``roundf`` half away from zero): ``q8_0_kv_x86``.
* CUDA backend (``ggml-cuda/cpy-utils.cuh`` ``quantize_f32_q8_0_block`` / ``_q4_0_`` / ``_q5_0_``):
  the reference rules, element for element (``q8_0_kv``, ``q4_0_kv``, ``q5_0_kv``).

Block layouts are the weight formats' (q8_0.py, q5_0.py; Q4_0 here: 18 bytes = fp16 d + 16 bytes,
byte j = q[j] | q[j+16] << 4, value (q - 8) * d). llama.cpp refuses a quantized cache type whose
block (32) does not divide head_dim, and a quantized V cache without flash attention (its default
``-fa auto`` turns flash attention on for it), so V rows are stored untransposed, blocks along
head_dim like K. The ``llama`` architecture (Llama, Mistral, Mixtral) stores K in its converter's
permuted row order (``head_order = "gguf"``, see kv.gguf_k_order): the 32-element blocks then hold
interleaved halves of a transformers-order head.

What the engine's attention does with the cache beyond storing it is not emulated: the CPU flash
attention converts Q to the K type's vec_dot_type (Q8_0) for the K dot products and dequantizes V
rows to F32. Oracles: libggml-python's ``ggml_quantize_chunk`` / ``quantize_row_*_ref`` and
``dequantize_row_*`` (ggml 0.20.2), and its CPU backend's own ``quantize_row_q8_0`` (an AVX build).
"""
from __future__ import annotations

import numpy as np
import torch

from .kquant_common import fp16_round, fp16_round_np, tdiv
from .kv import KVCacheFormat, KVCacheSpec, register_kv
from .layouts import GGMLType
from .q5_0 import Q5_0_FORMAT
from .q8_0 import Q8_0_FORMAT, QK
from .spec import PackedTensor

Q4_0_BYTES = 18


def _f32(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x).astype(np.float32)


class GGMLKV(KVCacheFormat):
    """A llama.cpp cache type whose rule is a registered weight format's reference quantizer."""

    def __init__(self, spec: KVCacheSpec, weight_format):
        super().__init__(spec)
        self.wf = weight_format

    def row_bytes(self, head_dim: int) -> int:
        self.check_head_dim(head_dim)
        return head_dim // QK * self.wf.spec.bytes_per_block

    def encode_ref(self, x, scale=None) -> np.ndarray:
        self._scale_arg(scale)
        x32 = _f32(x)
        self.check_head_dim(x32.shape[-1])
        return self.wf.quantize_ref(x32)

    def decode_ref(self, b, head_dim: int, scale=None) -> np.ndarray:
        self._scale_arg(scale)
        return self.wf.dequantize_ref(np.asarray(b, dtype=np.uint8), head_dim)

    def encode(self, x: torch.Tensor, scale=None) -> torch.Tensor:
        self._scale_arg(scale)
        self.check_head_dim(x.shape[-1])
        return torch.from_numpy(self.wf.to_bytes(self.wf.quantize(x.detach().float().cpu()))).to(x.device)

    def decode(self, b: torch.Tensor, head_dim: int, scale=None) -> torch.Tensor:
        self._scale_arg(scale)
        return self.wf.dequantize(self.wf.from_bytes(b.detach().cpu(), head_dim)).to(b.device)

    def values(self, x: torch.Tensor, scale=None) -> torch.Tensor:
        self._scale_arg(scale)
        self.check_head_dim(x.shape[-1])
        return self.wf.dequantize(self.wf.quantize(x.detach().float()))


class Q8_0KVX86(GGMLKV):
    """ggml-cpu/arch/x86/quants.c quantize_row_q8_0 (AVX/AVX2): d = fp16(amax/127), q = RNE(x*(127/amax))."""

    def encode_ref(self, x, scale=None) -> np.ndarray:
        self._scale_arg(scale)
        x32 = _f32(x)
        self.check_head_dim(x32.shape[-1])
        self._finite(self.name, x32)
        lead, k = x32.shape[:-1], x32.shape[-1]
        xb = x32.reshape(-1, QK)
        amax = np.abs(xb).max(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            d = (amax / np.float32(127.0)).astype(np.float32)
            idv = np.where(amax != 0, np.float32(127.0) / np.where(amax != 0, amax, np.float32(1)),
                           np.float32(0)).astype(np.float32)
        q = np.rint((xb * idv[:, None]).astype(np.float32))          # numpy rint: ties to even
        out = np.empty((xb.shape[0], 34), dtype=np.uint8)
        out[:, 0:2] = fp16_round_np(d).astype(np.float16).view(np.uint8).reshape(-1, 2)
        out[:, 2:] = q.astype(np.int8).view(np.uint8)
        return out.reshape(*lead, k // QK * 34)

    def _packed(self, x: torch.Tensor, scale=None) -> PackedTensor:
        self._scale_arg(scale)
        self.check_head_dim(x.shape[-1])
        self._finite(self.name, x)
        xf = x.detach().float()
        shape = tuple(xf.shape)
        xb = xf.reshape(*shape[:-1], shape[-1] // QK, QK)
        amax = xb.abs().amax(dim=-1)
        d16 = fp16_round(tdiv(amax, 127.0))
        nz = amax != 0
        idv = torch.where(nz, tdiv(127.0, torch.where(nz, amax, torch.ones_like(amax))), torch.zeros_like(amax))
        q = torch.round(xb * idv.unsqueeze(-1)).clamp_(-127, 127)       # torch.round: ties to even
        return PackedTensor("q8_0", shape, q.to(torch.int8).reshape(shape), d16.to(torch.float16))

    def encode(self, x: torch.Tensor, scale=None) -> torch.Tensor:
        return torch.from_numpy(self.wf.to_bytes(self._packed(x, scale))).to(x.device)

    def values(self, x: torch.Tensor, scale=None) -> torch.Tensor:
        return self.wf.dequantize(self._packed(x, scale))


class Q4_0KV(KVCacheFormat):
    """quantize_row_q4_0_ref (= the CPU from_float and CUDA's quantize_f32_q4_0_block)."""

    def row_bytes(self, head_dim: int) -> int:
        self.check_head_dim(head_dim)
        return head_dim // QK * Q4_0_BYTES

    @staticmethod
    def _pack_np(q: np.ndarray, d: np.ndarray) -> np.ndarray:
        out = np.empty((q.shape[0], Q4_0_BYTES), dtype=np.uint8)
        out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
        out[:, 2:] = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
        return out

    def encode_ref(self, x, scale=None) -> np.ndarray:
        self._scale_arg(scale)
        x32 = _f32(x)
        self.check_head_dim(x32.shape[-1])
        self._finite(self.name, x32)
        lead, k = x32.shape[:-1], x32.shape[-1]
        f32 = np.float32
        xb = x32.reshape(-1, QK)
        amax = np.zeros(xb.shape[0], f32)
        mx = np.zeros(xb.shape[0], f32)
        for j in range(QK):                       # strict '<': the first largest |x| wins, signed
            a = np.abs(xb[:, j])
            upd = amax < a
            amax = np.where(upd, a, amax)
            mx = np.where(upd, xb[:, j], mx)
        with np.errstate(divide="ignore", invalid="ignore"):
            d = (mx / f32(-8)).astype(f32)
            idv = np.where(d != 0, f32(1) / np.where(d != 0, d, f32(1)), f32(0)).astype(f32)
            v = ((xb * idv[:, None]).astype(f32) + f32(8.5)).astype(f32)
        q = np.minimum(15, np.trunc(v)).astype(np.uint8)
        return self._pack_np(q, fp16_round_np(d)).reshape(*lead, k // QK * Q4_0_BYTES)

    def decode_ref(self, b, head_dim: int, scale=None) -> np.ndarray:
        self._scale_arg(scale)
        b = np.ascontiguousarray(b, dtype=np.uint8)
        lead = b.shape[:-1]
        blk = b.reshape(-1, Q4_0_BYTES)
        d = blk[:, 0:2].copy().view(np.float16).astype(np.float32)
        qs = blk[:, 2:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32) - np.float32(8)
        with np.errstate(invalid="ignore"):
            return (q * d).reshape(*lead, head_dim).astype(np.float32)

    def encode(self, x: torch.Tensor, scale=None) -> torch.Tensor:
        self._scale_arg(scale)
        self.check_head_dim(x.shape[-1])
        self._finite(self.name, x)
        xf = x.detach().float()
        shape = tuple(xf.shape)
        xb = xf.reshape(-1, QK)
        a = xb.abs()
        am = a.amax(dim=1, keepdim=True)
        first = (a == am).int().argmax(dim=1, keepdim=True)
        mx = torch.where(am.squeeze(1) == 0, torch.zeros_like(am.squeeze(1)), xb.gather(1, first).squeeze(1))
        d = tdiv(mx, -8.0)
        nz = d != 0
        idv = torch.where(nz, tdiv(1.0, torch.where(nz, d, torch.ones_like(d))), torch.zeros_like(d))
        q = torch.trunc(xb * idv.unsqueeze(1) + 8.5).clamp_(max=15).to(torch.uint8)
        d16 = fp16_round(d).to(torch.float16).view(torch.uint8).reshape(-1, 2)
        qs = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
        return torch.cat([d16, qs], dim=1).reshape(*shape[:-1], shape[-1] // QK * Q4_0_BYTES)

    def decode(self, b: torch.Tensor, head_dim: int, scale=None) -> torch.Tensor:
        self._scale_arg(scale)
        lead = b.shape[:-1]
        blk = b.contiguous().reshape(-1, Q4_0_BYTES)
        d = blk[:, 0:2].contiguous().view(torch.float16).float()
        qs = blk[:, 2:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=1).float() - 8.0
        return (q * d).reshape(*lead, head_dim)


_GG = dict(block=QK, static_scale=False, head_order="gguf", scale_rule="none per tensor: one fp16 scale per 32 "
                                                                        "elements, computed at write time")
Q8_0_KV_SPEC = KVCacheSpec(
    name="q8_0_kv", engine="llama.cpp 0c1e570 CUDA set_rows (ggml-cuda/cpy-utils.cuh quantize_f32_q8_0_block) = "
                           "ggml quantize_row_q8_0_ref",
    element="int8", rounding="d = amax/127, fp16 RNE; q = roundf(x * (1/d)) (half away from zero)",
    bits_per_element=8.5, oracle="libggml quantize_row_q8_0_ref / dequantize_row_q8_0 (libggml-python 0.20.2)",
    llama_cpp_type="q8_0", ggml_type=int(GGMLType.Q8_0),
    notes="llama.cpp's CPU backend on x86 writes q8_0 with another rule: q8_0_kv_x86", **_GG)
Q8_0_KV_X86_SPEC = KVCacheSpec(
    name="q8_0_kv_x86", engine="llama.cpp 0c1e570 CPU set_rows with x86 AVX/AVX2 from_float "
                               "(ggml-cpu/arch/x86/quants.c quantize_row_q8_0)",
    element="int8", rounding="d = amax/127, fp16 RNE; q = round-half-even(x * fl(127/amax)) (_mm256_round_ps)",
    bits_per_element=8.5, oracle="libggml-python's CPU backend quantize_row_q8_0 (its AVX build)",
    llama_cpp_type="q8_0", ggml_type=int(GGMLType.Q8_0),
    notes="differs from q8_0_kv on exact .5 ties and where 127/amax != 1/(amax/127) in the last bit", **_GG)
Q4_0_KV_SPEC = KVCacheSpec(
    name="q4_0_kv", engine="llama.cpp 0c1e570 set_rows: CPU quantize_row_q4_0 (= _ref), CUDA quantize_f32_q4_0_block",
    element="int4", rounding="max = signed first largest |x|; d = max/-8 fp16 RNE; q = min(15, (int)(x/d + 8.5))",
    bits_per_element=4.5, oracle="libggml ggml_quantize_chunk(Q4_0) / dequantize_row_q4_0 (libggml-python 0.20.2)",
    llama_cpp_type="q4_0", ggml_type=int(GGMLType.Q4_0), **_GG)
Q5_0_KV_SPEC = KVCacheSpec(
    name="q5_0_kv", engine="llama.cpp 0c1e570 set_rows: CPU quantize_row_q5_0 (= _ref), CUDA quantize_f32_q5_0_block",
    element="int5", rounding="max = signed first largest |x|; d = max/-16 fp16 RNE; q = min(31, (int)(x/d + 16.5))",
    bits_per_element=5.5, oracle="libggml ggml_quantize_chunk(Q5_0) / dequantize_row_q5_0 (libggml-python 0.20.2)",
    llama_cpp_type="q5_0", ggml_type=int(GGMLType.Q5_0), **_GG)

Q8_0_KV = register_kv(GGMLKV(Q8_0_KV_SPEC, Q8_0_FORMAT))
Q8_0_KV_X86 = register_kv(Q8_0KVX86(Q8_0_KV_X86_SPEC, Q8_0_FORMAT))
Q4_0_KV = register_kv(Q4_0KV(Q4_0_KV_SPEC))
Q5_0_KV = register_kv(GGMLKV(Q5_0_KV_SPEC, Q5_0_FORMAT))
