"""NVFP4 with a per-tensor fp32 scale: ``nvfp4`` (weights, as NVIDIA ModelOpt exports them)
and ``nvfp4_act`` (activations, as vLLM / FlashInfer quantize them at serving time).

Layout of one row of K elements (K % 16 == 0)::

    x[0:16]      x[16:32]     ...                      16 elements share one E4M3 scale
      |            |
    codes  [K/2]  uint8: byte i = code[2i] | code[2i+1] << 4   ("pairs", low nibble first)
    scales [K/16] uint8: E4M3 (e4m3fn) bits of the block scale s8, always positive
    g      fp32 0-d (or [E] per expert): decode scale, amax / 2688 (= amax / (6 * 448))

    value = e2m1(code) * (fp32(s8) * g)        code bit 3 = sign, bits 2..0 index
                                               {0, .5, 1, 1.5, 2, 3, 4, 6}

    to_bytes(p) row = [ codes (K/2 bytes) | scales (K/16 bytes) ]   9 bytes per 16 elements;
    the engine keeps them as two tensors (``weight`` uint8 [N, K/2], ``weight_scale``
    float8_e4m3fn [N, K/16]) and g as ``weight_scale_2``: split the row at K/2 to get them.
    g is not part of the bytes; from_bytes takes it as ``global_scale=``.

``nvfp4`` follows ModelOpt 0.47 ``NVFP4QTensor.quantize(w, 16)``
(modelopt/torch/quantization/qtensor/nvfp4_tensor.py), the exporter whose bytes vLLM and
SGLang load, in its float32 order of operations:

    1. g  = fp32(amax) / 2688                    (one division by the fp32 constant)
    2. s  = amax_block / fl(6 * g)               (the product 6*g is rounded first)
    3. s  = 1.0 where s == 0                     (all-zero block -> byte 0x38)
    4. s8 = RNE_e4m3(clamp(s, 2^-9, 448))
    5. v  = x / fl(fp32(s8) * g)                 (product rounded, then a true division)
    6. code = RNE_e2m1(|v|) saturating at 6, sign bit = (v < 0)   (so -0.0 -> 0, -0.1 -> 8)
    7. pack pairs
    dequant: e2m1 * fl(fp32(s8) * g)

Device note: ModelOpt run on a CUDA tensor computes step 1 as amax * fl(1/2688) (PyTorch's
CUDA `tensor / scalar`), which differs from its CPU result in the last bit of g for ~23% of
amax values; this module uses the true division (ModelOpt on CPU) on every device.

Guard (ours, ModelOpt has none): when g = amax/2688 would be zero or subnormal
(amax < 2688 * 2^-126 ~ 3.2e-35, the all-zero tensor included) amax is taken as 1.0, so
g = 1/2688, every scale is finite and such a tensor quantizes to zeros. ModelOpt yields
NaN scales (0xFF) there. NaN / Inf inputs are refused (ModelOpt turns the whole tensor into
NaN scales).

``amax=`` supplies the per-tensor amax (fused q/k/v or gate/up must share one g, see
exporters.md 2.3): a scalar, or a tensor whose shape is a prefix of x.shape[:-1], broadcast
over the remaining dims. For experts x [E, N, K] pass amax of shape [E] (one g per expert,
as vLLM's ``w2_weight_scale_2 [E]``); p.global_scale then has that shape. Without it amax is
max|x| over the whole tensor, as NVFP4QTensor.quantize does.
``scales=`` supplies the block-scale bytes [..., K/16] (calibrated / learned / frozen);
then only steps 5-7 run. ``scales_from_block_amax`` computes such bytes from per-block amax
the way ModelOpt's static (MSE-calibrated) export path does.

``nvfp4_act`` follows vLLM ``csrc/quantization/fp4/nvfp4_utils.cuh::cvt_warp_fp16_to_fp4``
(same as FlashInfer / TRT-LLM, default fast-math path), with S = fp32(1 / input_scale),
input_scale = amax / 2688, computed on the host as vLLM does:

    1. vmax = max |x| per 16 (on the bf16/fp16 values, exact in fp32)
    2. SF   = S * fl(vmax * fl(1/6))             (rcp.approx(6) == RN(1/6), verified on sm_90)
    3. s8   = e4m3 RN satfinite(SF)              (no lower clamp: tiny blocks get byte 0)
    4. outScale = s8 != 0 ? 1 / fl(fp32(s8) * fl(1/S)) : 0
    5. v    = fl(x * outScale); code = RNE_e2m1 saturating (cvt.rn.satfinite.e2m1x2.f32)
    dequant (the value the tensor core multiplies, before alpha): fl(e2m1 * fp32(s8)) * input_scale

The GPU computes the two reciprocals of step 4 with ``rcp.approx.ftz.f32`` (not correctly
rounded: 1 ulp off for ~13% of inputs on sm_90); this emulator uses exact reciprocals, so
it can differ from the kernel by one E2M1 step only where v lies within a few ulp of a
rounding threshold: ``near_threshold_mask`` flags those elements (4 ulp). The sign bit of
the e2m1 code is the sign bit of v (IEEE conversion semantics, so -0.0 -> code 8; not
verified on Blackwell; it never changes a value). float32 input is accepted (vmax taken on
the fp32 values); the engine itself only receives bf16/fp16 activations. ``amax=None``
uses the tensor's own amax (dynamic).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import codecs as C
from .layouts import Codec, GGMLType, GGUFLayout, LlamaFileType, NibbleOrder, SafetensorsLayout, ScaleRule, TieRule
from .spec import Format, FormatSpec, PackedTensor, register

BLOCK = 16
_DIV = 6.0 * 448.0                     # 2688, exact in fp32
_G_MIN_NORMAL = 2.0 ** -126            # g below this -> amax replaced by 1.0 (documented guard)
_SCALE_MIN = 2.0 ** -9
_RCP6 = np.float32(1.0) / np.float32(6.0)          # RN(1/6) = 0x3E2AAAAB
_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ----------------------------------------------------------------------------- shared helpers
def _as_float32_np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x).astype(np.float32)


def _amax_shape_check(name: str, amax_shape, x_shape) -> None:
    lead = tuple(x_shape[:-1])
    if len(amax_shape) > len(lead) or tuple(amax_shape) != lead[:len(amax_shape)]:
        raise ValueError(f"{name}: amax of shape {tuple(amax_shape)} does not fit x of shape {tuple(x_shape)}; "
                         f"allowed: a scalar, or a shape that is a prefix of x.shape[:-1] = {lead} "
                         f"(e.g. [E] for experts [E, N, K])")


def _check_amax_values(name: str, bad: bool) -> None:
    if bad:
        raise ValueError(f"{name}: amax must be finite and >= 0")


def _guard_amax_np(a: np.ndarray) -> np.ndarray:
    return np.where(a / np.float32(_DIV) < np.float32(_G_MIN_NORMAL), np.float32(1.0), a).astype(np.float32)


def _div(t: torch.Tensor, c: float) -> torch.Tensor:
    """t / c as a true IEEE division on every device: PyTorch's CUDA kernel for
    `tensor / python_scalar` multiplies by fl(1/c) instead (differs for ~23% of inputs with
    c = 2688, measured on an H200), so the divisor is made a full tensor."""
    return t / torch.full_like(t, c)


def _guard_amax(a: torch.Tensor) -> torch.Tensor:
    return torch.where(_div(a, _DIV) < _G_MIN_NORMAL, torch.ones_like(a), a)


def _tensor_amax_np(name, x32, amax) -> np.ndarray:
    if amax is None:
        a = np.float32(np.abs(x32).max()) if x32.size else np.float32(0)
        a = np.asarray(a, dtype=np.float32)
    else:
        a = _as_float32_np(amax)
        _check_amax_values(name, not bool(np.all(np.isfinite(a) & (a >= 0))))
        _amax_shape_check(name, a.shape, x32.shape)
    return _guard_amax_np(a)


def _tensor_amax(name, x, amax) -> torch.Tensor:
    if amax is None:
        a = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    else:
        a = torch.as_tensor(amax).detach().to(device=x.device, dtype=torch.float32)
        _check_amax_values(name, not bool(torch.all(torch.isfinite(a) & (a >= 0))))
        _amax_shape_check(name, a.shape, x.shape)
    return _guard_amax(a)


def _bcast(g, ndim: int):
    """[E] -> [E, 1, ..., 1] with ndim dims, to meet the block-scale tensor [..., K/16]."""
    return g.reshape(tuple(g.shape) + (1,) * (ndim - g.ndim))


def _check_scale_bytes(name: str, s8, want_shape) -> None:
    if tuple(s8.shape) != tuple(want_shape):
        raise ValueError(f"{name}: scales= has shape {tuple(s8.shape)}; expected {tuple(want_shape)} "
                         f"(one E4M3 byte per {BLOCK} elements)")
    bad = (s8 == 0) | (s8 > 0x7E)
    if bool(bad.any()):
        v = int(s8[bad].reshape(-1)[0])
        raise ValueError(f"{name}: scales= contains byte 0x{v:02X}; allowed: positive finite E4M3 "
                         f"bytes 0x01..0x7E (zero, negative and NaN scales cannot encode a block)")


def _scales_to_u8(scales, device=None) -> torch.Tensor:
    s = torch.as_tensor(scales)
    if s.dtype == torch.float8_e4m3fn:
        s = s.view(torch.uint8)
    if s.dtype != torch.uint8:
        raise ValueError(f"scales= must be uint8 E4M3 bytes or a float8_e4m3fn tensor, got {s.dtype}; "
                         f"use scales_from_block_amax(...) to make them from float scales")
    return s.to(device) if device is not None else s


def _no_imatrix(name, imatrix) -> None:
    if imatrix is not None:
        raise ValueError(f"{name}: imatrix= is not supported: the engine's NVFP4 scale rule has no "
                         f"importance weights (calibrate block amax instead and pass scales=)")


def _split_bytes(b, k):
    b = np.asarray(b, dtype=np.uint8) if not isinstance(b, torch.Tensor) else b
    nb = b.shape[-1]
    if k is None:
        if nb % 9:
            raise ValueError(f"nvfp4 bytes: row of {nb} bytes is not a multiple of 9 (8 code bytes + 1 scale "
                             f"byte per {BLOCK} elements)")
        k = nb * 16 // 9
    if k % BLOCK or nb != k // 2 + k // BLOCK:
        raise ValueError(f"nvfp4 bytes: row of {nb} bytes does not hold K={k} elements "
                         f"(expected K/2 + K/16 = {k // 2 + k // BLOCK})")
    return b[..., : k // 2], b[..., k // 2:], k


def scales_from_block_amax(block_amax, amax, fp8_max: float = 448.0) -> torch.Tensor:
    """E4M3 scale bytes [..., K/16] from per-block amax, with ModelOpt's static-calibration
    association (NVFP4QTensor.get_weights_scaling_factor_from_quantizer, static path):

        s = fl(fl(fl(amax_b / 6) * fp8_max) / fl(amax / 6)),   amax_b == 0 -> amax_b/6 := 1.0
        s8 = RNE_e4m3(clamp(s, 2^-9, 448))

    ``amax`` is the per-tensor (or per-expert, shape a prefix of block_amax.shape[:-1]) amax;
    the zero/subnormal guard of ``nvfp4`` applies to it. The zero-block rule acts before the
    rescale, so an all-zero block can get 0x7E instead of 0x38, exactly as ModelOpt does.
    ``fp8_max`` is 448; ModelOpt's four_over_six mode normalises to 256 (and then uses
    g = amax / (6 * 256), which ``nvfp4`` does not compute)."""
    ba = torch.as_tensor(block_amax).detach().float()
    if not bool(torch.all(torch.isfinite(ba) & (ba >= 0))):
        raise ValueError("scales_from_block_amax: block_amax must be finite and >= 0")
    a = torch.as_tensor(amax).detach().to(device=ba.device, dtype=torch.float32)
    _check_amax_values("scales_from_block_amax", not bool(torch.all(torch.isfinite(a) & (a >= 0))))
    if a.ndim > ba.ndim - 1 or tuple(a.shape) != tuple(ba.shape[:a.ndim]):
        raise ValueError(f"scales_from_block_amax: amax of shape {tuple(a.shape)} does not fit block_amax "
                         f"of shape {tuple(ba.shape)}; allowed: scalar or a prefix of block_amax.shape[:-1]")
    a = _bcast(_guard_amax(a), ba.ndim)
    s = _div(ba, 6.0)
    s = torch.where(s == 0, torch.ones_like(s), s)
    s = (s * float(fp8_max)) / _div(a, 6.0)
    return C.e4m3_encode(s.clamp(_SCALE_MIN, 448.0))


# ----------------------------------------------------------------------------- nvfp4 (weights)
class NVFP4(Format):
    """ModelOpt NVFP4 export numerics (see module docstring)."""

    # -- numpy reference --------------------------------------------------------------------
    def global_scale_ref(self, x, amax=None) -> np.ndarray:
        """numpy g = amax/2688 (float32, 0-d or the shape of amax) after the zero guard."""
        x32 = _as_float32_np(x)
        return (_tensor_amax_np(self.name, x32, amax) / np.float32(_DIV)).astype(np.float32)

    def quantize_ref(self, x, amax=None, scales=None) -> np.ndarray:
        x32 = _as_float32_np(x)
        self.check_input(x32)
        self.check_finite(self.name, x32)
        g = _bcast(self.global_scale_ref(x32, amax), x32.ndim)
        xb = x32.reshape(*x32.shape[:-1], -1, BLOCK)
        if scales is None:
            ab = np.abs(xb).max(axis=-1)
            s = (ab / (np.float32(6.0) * g)).astype(np.float32)
            s = np.where(s == 0, np.float32(1.0), s)
            s8 = C.e4m3_encode_np(np.clip(s, np.float32(_SCALE_MIN), np.float32(448.0)))
        else:
            s8 = _scales_to_u8(scales).cpu().numpy()
            _check_scale_bytes(self.name, s8, xb.shape[:-1])
        sf = (C.e4m3_decode_np(s8) * g).astype(np.float32)
        v = (xb / sf[..., None]).astype(np.float32)
        codes = C.e2m1_encode_np(v, "rne", negative_zero=True).reshape(x32.shape)
        return np.concatenate([C.pack_pairs_np(codes), s8], axis=-1)

    def dequantize_ref(self, b, k=None, global_scale=None) -> np.ndarray:
        packed, s8, k = _split_bytes(np.asarray(b, dtype=np.uint8), k)
        if global_scale is None:
            raise ValueError(f"{self.name}: dequantize_ref needs global_scale= (the checkpoint's weight_scale_2)")
        g = _bcast(_as_float32_np(global_scale), s8.ndim)
        sf = (C.e4m3_decode_np(s8) * g).astype(np.float32)
        vals = C.e2m1_decode_np(C.unpack_pairs_np(packed)).reshape(*s8.shape, BLOCK)
        return (vals * sf[..., None]).astype(np.float32).reshape(*s8.shape[:-1], k)

    # -- torch emulator ---------------------------------------------------------------------
    def global_scale(self, x: torch.Tensor, amax=None) -> torch.Tensor:
        return _div(_tensor_amax(self.name, x, amax), _DIV)

    def block_scales(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Steps 2-4: E4M3 bytes [..., K/16] from x and the decode scale g (already shaped)."""
        ab = x.reshape(*x.shape[:-1], -1, BLOCK).abs().amax(dim=-1).float()
        s = ab / (6.0 * _bcast(g, ab.ndim))
        s = torch.where(s == 0, torch.ones_like(s), s)
        return C.e4m3_encode(s.clamp(_SCALE_MIN, 448.0))

    def _scaled(self, x: torch.Tensor, s8: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        sf = C.e4m3_decode(s8) * _bcast(g, s8.ndim)
        return x.float().reshape(*x.shape[:-1], -1, BLOCK) / sf.unsqueeze(-1)

    @torch.no_grad()
    def quantize(self, x: torch.Tensor, amax=None, scales=None, imatrix=None) -> PackedTensor:
        _no_imatrix(self.name, imatrix)
        self.check_input(x)
        self.check_finite(self.name, x)
        g = self.global_scale(x, amax)
        if scales is None:
            s8 = self.block_scales(x, g)
        else:
            s8 = _scales_to_u8(scales, x.device)
            _check_scale_bytes(self.name, s8, (*x.shape[:-1], x.shape[-1] // BLOCK))
        v = self._scaled(x, s8, g)
        codes = C.e2m1_encode(v, "rne", negative_zero=True).reshape(x.shape)
        return PackedTensor(self.name, tuple(x.shape), C.pack_pairs(codes), s8, g)

    def dequantize(self, p: PackedTensor) -> torch.Tensor:
        if p.global_scale is None:
            raise ValueError(f"{self.name}: PackedTensor has no global_scale; pass global_scale= to from_bytes "
                             f"(the checkpoint's weight_scale_2)")
        sf = C.e4m3_decode(p.scales) * _bcast(p.global_scale.float(), p.scales.ndim)
        vals = C.e2m1_decode(C.unpack_pairs(p.codes)).reshape(*p.scales.shape, BLOCK)
        return (vals * sf.unsqueeze(-1)).reshape(p.shape)

    def clip_mask(self, x: torch.Tensor, p: PackedTensor) -> torch.Tensor:
        v = self._scaled(x, p.scales, p.global_scale.float())
        return (v.abs() <= C.E2M1_MAX).reshape(x.shape)

    # -- frozen codes, moving scales (Format.code_values / block_multiplier / shift_scales) -------
    def code_values(self, p: PackedTensor) -> torch.Tensor:
        return C.e2m1_decode(C.unpack_pairs(p.codes)).reshape(p.shape)

    def block_multiplier(self, p: PackedTensor) -> torch.Tensor:
        if p.global_scale is None:
            raise ValueError(f"{self.name}: PackedTensor has no global_scale (the checkpoint's weight_scale_2)")
        return C.e4m3_decode(p.scales) * _bcast(p.global_scale.float(), p.scales.ndim)

    def shift_scales(self, scales: torch.Tensor, log2_offset: torch.Tensor):
        """Step 4 of the export rule on value * 2^theta: clamp to [2^-9, 448], RNE to E4M3 (satfinite,
        the NVIDIA cvt), so a trained scale is a byte this format itself could have produced."""
        s = _scales_to_u8(scales)
        valid = (s >= 0x01) & (s <= 0x7E)
        base = C.e4m3_decode(s)
        want = base * torch.exp2(log2_offset.float())
        want = torch.where(torch.isnan(want), base, want)      # a NaN offset never makes a NaN byte
        enc = C.e4m3_encode(want.clamp(_SCALE_MIN, 448.0))
        clamped = valid & ((want < _SCALE_MIN) | (want > 448.0))
        # a factor of exactly 1 keeps the byte (ggml's encoder never emits 0x78..0x7D itself)
        return torch.where(valid & (want != base), enc, s), clamped

    def to_bytes(self, p: PackedTensor) -> np.ndarray:
        return np.concatenate([p.codes.cpu().numpy(), p.scales.cpu().numpy()], axis=-1).astype(np.uint8)

    def from_bytes(self, b, k: Optional[int] = None, global_scale=None) -> PackedTensor:
        bt = torch.as_tensor(np.ascontiguousarray(np.asarray(b, dtype=np.uint8)))
        packed, s8, k = _split_bytes(bt, k)
        g = None if global_scale is None else torch.as_tensor(global_scale, dtype=torch.float32)
        return PackedTensor(self.name, (*bt.shape[:-1], k), packed.contiguous(), s8.contiguous(), g)


# ----------------------------------------------------------------------------- nvfp4_act (vLLM kernel)
class NVFP4Act(NVFP4):
    """vLLM / FlashInfer activation quantization with exact reciprocals (see module docstring)."""

    # -- numpy reference --------------------------------------------------------------------
    def _steps_np(self, x, amax):
        x32 = _as_float32_np(x)
        self.check_input(x32)
        self.check_finite(self.name, x32)
        if amax is not None and np.ndim(_as_float32_np(amax)) != 0:
            raise ValueError(f"{self.name}: amax must be a scalar (one static input_scale per tensor)")
        a = _tensor_amax_np(self.name, x32, amax)
        in_scale = (a / np.float32(_DIV)).astype(np.float32)
        S = (np.float32(1.0) / in_scale).astype(np.float32)
        xb = x32.reshape(*x32.shape[:-1], -1, BLOCK)
        vmax = np.abs(xb).max(axis=-1)
        sf = (S * (vmax * _RCP6).astype(np.float32)).astype(np.float32)
        s8 = C.e4m3_encode_np(sf)
        sfd = C.e4m3_decode_np(s8)
        inv_s = (np.float32(1.0) / S).astype(np.float32)
        with np.errstate(divide="ignore"):
            out = np.where(s8 != 0, np.float32(1.0) / (sfd * inv_s).astype(np.float32), np.float32(0.0))
        v = (xb * out.astype(np.float32)[..., None]).astype(np.float32)
        return x32, v, s8, in_scale

    def quantize_ref(self, x, amax=None, scales=None) -> np.ndarray:
        if scales is not None:
            raise ValueError(f"{self.name}: scales= is not supported; the engine computes activation "
                             f"block scales at run time")
        x32, v, s8, _ = self._steps_np(x, amax)
        mag = C.e2m1_magnitude_np(np.abs(v), "rne")
        codes = (mag | (np.signbit(v).astype(np.uint8) << 3)).reshape(x32.shape)
        return np.concatenate([C.pack_pairs_np(codes), s8], axis=-1)

    def dequantize_ref(self, b, k=None, global_scale=None) -> np.ndarray:
        packed, s8, k = _split_bytes(np.asarray(b, dtype=np.uint8), k)
        if global_scale is None:
            raise ValueError(f"{self.name}: dequantize_ref needs global_scale= (the checkpoint's input_scale)")
        vals = C.e2m1_decode_np(C.unpack_pairs_np(packed)).reshape(*s8.shape, BLOCK)
        prod = (vals * C.e4m3_decode_np(s8)[..., None]).astype(np.float32)
        return (prod * np.float32(global_scale)).astype(np.float32).reshape(*s8.shape[:-1], k)

    # -- torch emulator ---------------------------------------------------------------------
    def _steps(self, x: torch.Tensor, amax):
        self.check_input(x)
        self.check_finite(self.name, x)
        if amax is not None and torch.as_tensor(amax).ndim != 0:
            raise ValueError(f"{self.name}: amax must be a scalar (one static input_scale per tensor)")
        in_scale = _div(_tensor_amax(self.name, x, amax), _DIV)
        S = 1.0 / in_scale
        xb = x.float().reshape(*x.shape[:-1], -1, BLOCK)
        vmax = xb.abs().amax(dim=-1)
        sf = S * (vmax * float(_RCP6))
        s8 = C.e4m3_encode(sf)
        out = 1.0 / (C.e4m3_decode(s8) * (1.0 / S))
        out = torch.where(s8 != 0, out, torch.zeros_like(out))
        v = xb * out.unsqueeze(-1)
        return v, s8, in_scale

    @torch.no_grad()
    def quantize(self, x: torch.Tensor, amax=None, scales=None, imatrix=None) -> PackedTensor:
        _no_imatrix(self.name, imatrix)
        if scales is not None:
            raise ValueError(f"{self.name}: scales= is not supported; the engine computes activation "
                             f"block scales at run time")
        v, s8, in_scale = self._steps(x, amax)
        mag = C.e2m1_magnitude(v.abs(), "rne")
        codes = (mag | (torch.signbit(v).to(torch.uint8) << 3)).reshape(x.shape)
        return PackedTensor(self.name, tuple(x.shape), C.pack_pairs(codes), s8, in_scale)

    def dequantize(self, p: PackedTensor) -> torch.Tensor:
        if p.global_scale is None:
            raise ValueError(f"{self.name}: PackedTensor has no global_scale; pass global_scale= to from_bytes "
                             f"(the checkpoint's input_scale)")
        vals = C.e2m1_decode(C.unpack_pairs(p.codes)).reshape(*p.scales.shape, BLOCK)
        prod = vals * C.e4m3_decode(p.scales).unsqueeze(-1)      # exact (<= 6 significant bits)
        return (prod * p.global_scale.float()).reshape(p.shape)

    def clip_mask(self, x: torch.Tensor, p: PackedTensor) -> torch.Tensor:
        amax = p.global_scale.float() * _DIV
        v, _, _ = self._steps(x, amax)
        return (v.abs() <= C.E2M1_MAX).reshape(x.shape)

    @torch.no_grad()
    def near_threshold_mask(self, x: torch.Tensor, amax=None, ulps: int = 4) -> torch.Tensor:
        """True where the scaled value |x * outScale| lies within `ulps` float32 ulp of an E2M1
        rounding threshold: the only elements where the GPU's rcp.approx can change the code."""
        v, _, _ = self._steps(x, amax)
        a = v.abs().reshape(x.shape)
        m = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        for t in _THRESHOLDS:
            ulp = float(np.spacing(np.float32(t)))
            m |= (a - t).abs() <= ulps * ulp
        return m


def near_threshold_mask(x: torch.Tensor, amax=None, ulps: int = 4) -> torch.Tensor:
    """Module-level shortcut for NVFP4Act.near_threshold_mask."""
    return NVFP4_ACT.near_threshold_mask(x, amax, ulps)


_COMMON = dict(element="e2m1", block_size=BLOCK, super_block=BLOCK, bytes_per_block=9, scale_codec="e4m3",
               tie_rule=TieRule.RNE, nibble_order=NibbleOrder.PAIRS,
               fallback="none: vLLM refuses NVFP4 layers whose K is not a multiple of 16; leave such a "
                        "layer unquantized (exclude_modules / ignore)")

NVFP4_SPEC = FormatSpec(
    name="nvfp4",
    engine="NVIDIA ModelOpt 0.47 NVFP4QTensor.quantize (export path), loaded as is by vLLM / SGLang",
    scale_rule=ScaleRule.NVFP4_MODELOPT,
    global_scale="g = amax/2688 (decode scale, fp32; weight_scale_2)",
    oracle="nvidia-modelopt NVFP4QTensor.quantize(w, 16); compressed-tensors (fp32 statistics)",
    role="weight",
    notes="row bytes = packed codes (K/2) then E4M3 scale bytes (K/16); all-zero/subnormal-g amax -> 1.0",
    # llama.cpp: repacked into GGML NVFP4 blocks + an F32 <name>.scale; vLLM/SGLang: ModelOpt or CT NVFP4
    gguf=GGUFLayout(GGMLType.NVFP4, Codec.E2M1_E4M3_FP32, LlamaFileType.MOSTLY_NVFP4),
    safetensors=SafetensorsLayout(Codec.E2M1_E4M3_FP32, ct_format="nvfp4-pack-quantized", group_size=16,
                                  strategy="tensor_group", scale_dtype="float8_e4m3fn",
                                  modelopt_algo=("NVFP4", "W4A16_NVFP4")),
    **_COMMON)

NVFP4_ACT_SPEC = FormatSpec(
    name="nvfp4_act",
    engine="vLLM / FlashInfer cvt_warp_fp16_to_fp4 (scaled_fp4_quant, fast-math path), exact reciprocals",
    scale_rule=ScaleRule.NVFP4_VLLM_ACT,
    global_scale="input_scale = amax/2688 (decode, fp32); encode S = fl(1/input_scale)",
    oracle="TRANSCRIPTION (no run of vLLM's kernel yet; GPU run: benchmarks/gpu): vLLM's kernel formula in float64 "
           "-> float32 steps + ml_dtypes e2m1/e4m3",
    role="activation",
    notes="GPU rcp.approx may differ within a few ulp of an E2M1 threshold: see near_threshold_mask",
    **_COMMON)

NVFP4_FMT = register(NVFP4(NVFP4_SPEC))
NVFP4_ACT = register(NVFP4Act(NVFP4_ACT_SPEC))
