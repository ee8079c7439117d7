"""llama.cpp / ggml ``GGML_TYPE_NVFP4`` (type 40): NVFP4 blocks without a per-tensor scale.

One ggml block = 64 elements = 4 sub-blocks of 16, 36 bytes::

    byte  0   1   2   3  | 4 .. 11        | 12 .. 19       | 20 .. 27       | 28 .. 35
          d0  d1  d2  d3 | sub-block 0    | sub-block 1    | sub-block 2    | sub-block 3
          UE4M3 scales   | byte 4+8s+j = code[16s+j] | code[16s+j+8] << 4   ("split halves")

    value = kvalues[code] * ue4m3_half(d_s)    kvalues = 2*e2m1 = {0,1,2,3,4,6,8,12, -...}
          = e2m1(code) * ue4m3(d_s)            (both products exact)

Source followed: ggml ``ggml-quants.c::quantize_row_nvfp4_ref`` / ``dequantize_row_nvfp4`` and
``ggml-impl.h::ggml_fp32_to_ue4m3`` / ``ggml_ue4m3_to_fp32`` (llama.cpp, as in libggml 0.20.2):

* amax over the 16 float32 values (NaN never wins the ``amax < |x|`` test);
* scale byte = ue4m3(amax / 6) with ggml's own encoder, *not* the NVIDIA cvt:
  x <= 0 or NaN -> 0; x > 448 -> 448; a float32 exponent below 2^-6 takes
  ``(int)(x*512 + 0.5)`` (float32 sum, truncated) clamped to [1, 7] or 0; otherwise the top
  3 mantissa bits plus the 4th bit (round half up), a carry bumps the exponent; an exponent
  field >= 15 gives 0x7E (so every value >= 248 becomes 448). The decoder maps 0x00 and 0x7F to 0.
* elements: ``best_index_mxfp4``: argmin over the 16 codes of fl(|k*d - x|), d = ue4m3/2,
  first index wins, computed here the same way in float32 (the subtractions happen to be
  exact: neighbours are within a factor 2), i.e. nearest with ties toward the smaller
  magnitude; anything rounding to zero is +0 (code 0);
  |x| beyond 6*ue4m3 saturates; d == 0 gives all codes 0.
* no per-tensor scale inside the type (a converted ModelOpt checkpoint ships it as a
  separate ``<name>.scale`` tensor); the imatrix is ignored by ggml for this type.

``PackedTensor``: codes in the common *pairs* layout [..., K/2] (element 2i low nibble),
scales = UE4M3 bytes [..., K/16], global_scale None; to_bytes gives the 36-byte GGUF blocks.
``scales=`` takes precomputed UE4M3 bytes (then only the element choice runs).
NaN/Inf follow ggml: a NaN element gets code 0 and is ignored by the block max; an Inf
element gets code 0 and makes its sub-block scale 0x7E (448).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import codecs as C
from .layouts import GGMLType, GGUFLayout, LlamaFileType, NibbleOrder, ScaleRule, TieRule
from .spec import Format, FormatSpec, PackedTensor, register

SUB = 16
QK = 64
BLOCK_BYTES = 36
_KVALS_MAG = np.array([0, 1, 2, 3, 4, 6, 8, 12], dtype=np.float32)   # doubled e2m1 magnitudes


# ----------------------------------------------------------------------------- UE4M3 (ggml flavour)
def ue4m3_encode_np(x: np.ndarray) -> np.ndarray:
    """ggml_fp32_to_ue4m3, vectorised on float32."""
    x = np.asarray(x, dtype=np.float32)
    pos = x > 0                                      # False for NaN, zero and negatives
    xc = np.where(pos, np.minimum(x, np.float32(448.0)), np.float32(1.0))
    bits = xc.view(np.uint32).astype(np.int64)
    fexp = ((bits >> 23) & 0xFF) - 127
    fman = (bits >> 20) & 0x7
    e = fexp + 7
    sub_m = (xc * np.float32(512.0) + np.float32(0.5)).astype(np.float32).astype(np.int64)  # C (int) truncates
    sub_m = np.minimum(sub_m, 7)
    sub = np.where(sub_m < 1, 0, sub_m)
    m = fman + ((bits >> 19) & 1)
    e2 = np.where(m > 7, e + 1, e)
    m2 = np.where(m > 7, 0, m)
    normal = np.where(e2 >= 15, 0x7E, (e2 << 3) | m2)
    out = np.where(e <= 0, sub, np.where(e >= 15, 0x7E, normal))
    return np.where(pos, out, 0).astype(np.uint8)


def ue4m3_decode_np(b: np.ndarray) -> np.ndarray:
    """ggml_ue4m3_to_fp32 *without* the 0.5 factor: the scale value (0x00, 0x7F -> 0)."""
    b = np.asarray(b, dtype=np.uint8)
    v = C.e4m3_decode_np(b & 0x7F)
    return np.where((b & 0x7F) == 0x7F, np.float32(0), v).astype(np.float32)


def ue4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """torch twin of ue4m3_encode_np (float32 in, uint8 out)."""
    x = x.float()
    pos = x > 0
    xc = torch.where(pos, x.clamp(max=448.0), torch.ones_like(x))
    bits = xc.view(torch.int32).to(torch.int64)
    fexp = ((bits >> 23) & 0xFF) - 127
    fman = (bits >> 20) & 0x7
    e = fexp + 7
    sub_m = (xc * 512.0 + 0.5).to(torch.int64).clamp(max=7)      # float32 sum, then truncation
    sub = torch.where(sub_m < 1, torch.zeros_like(sub_m), sub_m)
    m = fman + ((bits >> 19) & 1)
    e2 = torch.where(m > 7, e + 1, e)
    m2 = torch.where(m > 7, torch.zeros_like(m), m)
    normal = torch.where(e2 >= 15, torch.full_like(e2, 0x7E), (e2 << 3) | m2)
    out = torch.where(e <= 0, sub, torch.where(e >= 15, torch.full_like(e, 0x7E), normal))
    return torch.where(pos, out, torch.zeros_like(out)).to(torch.uint8)


def ue4m3_decode(b: torch.Tensor) -> torch.Tensor:
    b7 = b & 0x7F
    v = C.e4m3_decode(b7)
    return torch.where(b7 == 0x7F, torch.zeros_like(v), v)


class NVFP4GGML(Format):
    """ggml NVFP4 (see module docstring)."""

    # -- numpy reference --------------------------------------------------------------------
    def quantize_ref(self, x, imatrix=None, scales=None) -> np.ndarray:
        # imatrix accepted and ignored, as ggml's quantize_nvfp4 does
        x32 = np.asarray(x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else x).astype(np.float32)
        self.check_input(x32)
        xb = x32.reshape(*x32.shape[:-1], -1, SUB)
        if scales is None:
            amax = np.fmax.reduce(np.abs(xb), axis=-1, initial=np.float32(0))  # NaN never wins
            ue = ue4m3_encode_np((amax / np.float32(6.0)).astype(np.float32))
        else:
            ue = np.asarray(scales, dtype=np.uint8)
            _check_scales(self.name, ue.shape, xb.shape[:-1])
        d = (ue4m3_decode_np(ue) * np.float32(0.5)).astype(np.float32)
        cand = (_KVALS_MAG * d[..., None, None]).astype(np.float32)          # [..., nb, 1, 8]
        err = np.abs(cand - np.abs(xb)[..., None]).astype(np.float32)      # [..., nb, 16, 8]
        mag = np.argmin(err, axis=-1).astype(np.uint8)
        # negative x: index 8 (-0) never beats index 0 (+0), so zero stays +0
        sign = ((xb < 0) & (mag != 0)).astype(np.uint8) << 3
        codes = (mag | sign).reshape(x32.shape)
        qs = C.pack_split_halves_np(codes, SUB).reshape(*ue.shape[:-1], -1, 4 * SUB // 2)
        blocks = np.concatenate([ue.reshape(*ue.shape[:-1], -1, 4), qs], axis=-1)
        return blocks.reshape(*x32.shape[:-1], -1)

    def dequantize_ref(self, b, k: Optional[int] = None) -> np.ndarray:
        b = np.asarray(b, dtype=np.uint8)
        blk = b.reshape(*b.shape[:-1], -1, BLOCK_BYTES)
        ue = blk[..., :4]
        codes = C.unpack_split_halves_np(blk[..., 4:].reshape(*blk.shape[:-1], -1), SUB)
        codes = codes.reshape(*ue.shape, SUB)
        d = ue4m3_decode_np(ue) * np.float32(0.5)
        kv = np.concatenate([_KVALS_MAG, -_KVALS_MAG])[codes]
        return (kv * d[..., None]).astype(np.float32).reshape(*b.shape[:-1], -1)

    # -- torch emulator ---------------------------------------------------------------------
    @torch.no_grad()
    def quantize(self, x: torch.Tensor, imatrix=None, scales=None, amax=None) -> PackedTensor:
        if amax is not None:
            raise ValueError(f"{self.name}: amax= is not supported; ggml NVFP4 has no per-tensor scale "
                             f"(use format 'nvfp4' for the two-level scheme)")
        self.check_input(x)
        xf = x.float()
        xb = xf.reshape(*x.shape[:-1], -1, SUB)
        if scales is None:
            a = xb.abs()
            amax_b = torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(dim=-1)
            # a full-tensor divisor: CUDA's tensor/scalar kernel multiplies by fl(1/6) instead
            ue = ue4m3_encode(amax_b / torch.full_like(amax_b, 6.0))
        else:
            ue = torch.as_tensor(scales).to(x.device)
            if ue.dtype != torch.uint8:
                raise ValueError(f"{self.name}: scales= must be uint8 UE4M3 bytes, got {ue.dtype}")
            _check_scales(self.name, tuple(ue.shape), tuple(xb.shape[:-1]))
        d = ue4m3_decode(ue) * 0.5
        cand = torch.tensor(_KVALS_MAG, device=x.device) * d[..., None, None]
        err = (cand - xb.abs().unsqueeze(-1)).abs()
        mag = torch.argmin(err, dim=-1).to(torch.uint8)     # first index on ties, as ggml
        # torch.argmin returns the NaN position for NaN rows; ggml keeps index 0 there
        mag = torch.where(torch.isnan(xb), torch.zeros_like(mag), mag)
        sign = ((xb < 0) & (mag != 0)).to(torch.uint8) << 3
        codes = (mag | sign).reshape(x.shape)
        return PackedTensor(self.name, tuple(x.shape), C.pack_pairs(codes), ue, None)

    def dequantize(self, p: PackedTensor) -> torch.Tensor:
        vals = C.e2m1_decode(C.unpack_pairs(p.codes)).reshape(*p.scales.shape, SUB)
        return (vals * ue4m3_decode(p.scales).unsqueeze(-1)).reshape(p.shape)

    # -- frozen codes, moving scales (Format.code_values / block_multiplier / shift_scales) -------
    def code_values(self, p: PackedTensor) -> torch.Tensor:
        return C.e2m1_decode(C.unpack_pairs(p.codes)).reshape(p.shape)

    def block_multiplier(self, p: PackedTensor) -> torch.Tensor:
        return ue4m3_decode(p.scales)

    def shift_scales(self, scales: torch.Tensor, log2_offset: torch.Tensor):
        """ggml's own UE4M3 encoder (half-up mantissa, subnormals by (int)(x*512+0.5), >= 248 -> 448) on
        value * 2^theta clamped to [2^-9, 448]: never the zero byte ggml decodes as 0."""
        s = torch.as_tensor(scales)
        if s.dtype != torch.uint8:
            raise ValueError(f"{self.name}: scales must be uint8 UE4M3 bytes, got {s.dtype}")
        valid = (s >= 0x01) & (s <= 0x7E)
        base = ue4m3_decode(s)
        want = base * torch.exp2(log2_offset.float())
        want = torch.where(torch.isnan(want), base, want)      # a NaN offset never makes a NaN byte
        enc = ue4m3_encode(want.clamp(C.E4M3_MIN_SUBNORMAL, C.E4M3_MAX))
        clamped = valid & ((want < C.E4M3_MIN_SUBNORMAL) | (want > C.E4M3_MAX))
        # a factor of exactly 1 keeps the byte (ggml's encoder never emits 0x78..0x7D itself)
        return torch.where(valid & (want != base), enc, s), clamped

    def clip_mask(self, x: torch.Tensor, p: PackedTensor) -> torch.Tensor:
        lim = ue4m3_decode(p.scales) * C.E2M1_MAX
        xb = x.float().reshape(*x.shape[:-1], -1, SUB)
        return (xb.abs() <= lim.unsqueeze(-1)).reshape(x.shape)

    def to_bytes(self, p: PackedTensor) -> np.ndarray:
        codes = C.unpack_pairs_np(p.codes.cpu().numpy())
        ue = p.scales.cpu().numpy().astype(np.uint8)
        qs = C.pack_split_halves_np(codes, SUB).reshape(*ue.shape[:-1], -1, 4 * SUB // 2)
        blocks = np.concatenate([ue.reshape(*ue.shape[:-1], -1, 4), qs], axis=-1)
        return blocks.reshape(*ue.shape[:-1], -1)

    def from_bytes(self, b, k: Optional[int] = None) -> PackedTensor:
        b = np.asarray(b, dtype=np.uint8)
        if b.shape[-1] % BLOCK_BYTES:
            raise ValueError(f"{self.name}: row of {b.shape[-1]} bytes is not a multiple of {BLOCK_BYTES}")
        nblk = b.shape[-1] // BLOCK_BYTES
        if k is not None and k != nblk * QK:
            raise ValueError(f"{self.name}: row of {b.shape[-1]} bytes holds {nblk * QK} elements, not K={k}")
        blk = b.reshape(*b.shape[:-1], nblk, BLOCK_BYTES)
        ue = blk[..., :4].reshape(*b.shape[:-1], -1)
        codes = C.unpack_split_halves_np(blk[..., 4:].reshape(*b.shape[:-1], -1), SUB)
        return PackedTensor(self.name, (*b.shape[:-1], nblk * QK),
                            torch.from_numpy(np.ascontiguousarray(C.pack_pairs_np(codes))),
                            torch.from_numpy(np.ascontiguousarray(ue)), None)


def _check_scales(name, got, want):
    if tuple(got) != tuple(want):
        raise ValueError(f"{name}: scales= has shape {tuple(got)}; expected {tuple(want)} "
                         f"(one UE4M3 byte per {SUB} elements)")


NVFP4_GGML_SPEC = FormatSpec(
    name="nvfp4_ggml",
    engine="llama.cpp / ggml GGML_TYPE_NVFP4 quantize_row_nvfp4_ref (libggml 0.20.2)",
    element="e2m1",
    block_size=SUB,
    super_block=QK,
    bytes_per_block=BLOCK_BYTES,
    scale_codec="ue4m3_ggml",
    scale_rule=ScaleRule.NVFP4_GGML,
    tie_rule=TieRule.TOWARD_ZERO,
    global_scale=None,
    nibble_order=NibbleOrder.SPLIT_HALVES,
    oracle="libggml-python ggml_quantize_chunk / dequantize_row_nvfp4; gguf.quants.dequantize",
    gguf=GGUFLayout(GGMLType.NVFP4, file_type=LlamaFileType.MOSTLY_NVFP4),
    fallback="none: llama.cpp stores NVFP4 rows only in multiples of 64; keep such a tensor in F16/BF16",
    role="weight",
    notes="36-byte blocks: 4 UE4M3 bytes then 32 code bytes; no per-tensor scale in the type",
)

NVFP4_GGML = register(NVFP4GGML(NVFP4_GGML_SPEC))
