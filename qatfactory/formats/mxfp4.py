"""MXFP4: 32 E2M1 elements share one E8M0 power-of-two scale. Four engine flavours.

Block (32 elements along K) and the bytes each flavour's engine stores:

    x[0] x[1] ... x[31]            float (fp32 / bf16 / fp16), one block
          |  amax = max|x|  -> scale byte b (E8M0, value 2^(b-127)), rule = spec.scale_rule
          |  v = x * mult[b] (exact power of two) -> E2M1 code (rule = spec.tie_rule), saturating
          v
    PackedTensor (every flavour):  codes  uint8 [..., K/2]   byte i = c[2i] | c[2i+1] << 4
                                   scales uint8 [..., K/32]  E8M0 bytes; global_scale None

    to_bytes, nibble_order "pairs" (OCP / torchao / compressed-tensors / vLLM safetensors):
        one row = [ codes: K/2 bytes (pairs) ][ scales: K/32 bytes ]        17 bytes per 32 elements
    to_bytes, nibble_order "split_halves" (ggml block_mxfp4, GGUF type 39):
        one row = K/32 blocks of [ e8m0 b | 16 bytes: byte j = c[j] | c[j+16] << 4 ]

    decode: x = e2m1(c) * 2^(b-127)  (OCP; b = 255 is NaN)
            x = kvalues[c] * 2^(b-128), kvalues = 2 * e2m1  (ggml's e8m0_to_fp32_half; same value)

Scale rules (spec.scale_rule; each with the source it follows):

* "floor(log2 amax) - 2" (``mxfp4``): OCP MX v1.0 section 6.3 as torchao 0.18
  ``to_mx(..., ScaleCalculationMode.FLOOR)`` computes it: the exponent field of fp32 amax minus 2
  (exact, no float log2), clamped at byte 0. torchao divides by max(2^(b-127), 2^-126): a block
  with byte 0 (amax < 2^-124, all-zero blocks included) is scaled by 2^126, not 2^127; we follow
  it so the codes match, and decode byte 0 as 2^-127 as every MX decoder does.
* "floor(log2(amax rounded half-up to 2 significant bits)) - 2" (``mxfp4_even``): torchao EVEN =
  compressed-tensors ``generate_mx_scales``: add 2^21 to the fp32 bits of amax, keep the exponent
  (one more than FLOOR when the mantissa of amax is >= 1.75).
* "ceil(log2(amax / 6))" (``mxfp4_rceil``): triton_kernels ``downcast_to_mxfp`` ROUND_UP (also the
  Blackwell ``cvt.rp.satfinite.ue8m0x2`` / cuBLAS / FlashInfer recipe). The engine takes
  q = RN(amax / 6) and rounds its fp32 bits up to a power of two (bits + 0x7FFFFF, masked). We
  compute the same byte from the bits of amax with integers only: for normal amax = M * 2^E,
  e = E - 2 + (M > 1.5); a subnormal q rounds up to 2^-126 (byte 1); RN(amax/6) == 0 (amax <= 3
  smallest subnormals, or amax == 0) gives byte 0 and quant_scale 0, i.e. all-zero codes. This is
  exact; torchao's eager RCEIL (``ceil(torch.log2(amax/6))``) differs just above powers of two
  and for blocks with amax < 6 * 2^-126 (it emits byte 0 and leaves x unscaled).
* "floor(log2f(amax)) - 2, byte mod 256" (``mxfp4_ggml``): ggml ``quantize_row_mxfp4_ref``:
  e = (uint8)(floorf(log2f(amax)) - 2 + 127), 0 for amax == 0. log2f is fp32: just below 2^k it
  rounds up to k (scale 2x larger than OCP FLOOR); we reproduce it exactly from the bits with a
  threshold table built from the correctly rounded float32 log2 (matched libggml on every k).
  amax < 2^-125 makes the exponent negative; the C cast is undefined, x86 libggml and gguf-py wrap
  it modulo 256 (bytes 232..255) and all codes come out 0 (block flushed to zero): we reproduce
  those bytes. Elements: argmin over kvalues * d, first index wins -> ties toward zero, +0 for
  anything that rounds to zero; candidates whose kvalue * d overflows fp32 never win (bytes >= 253).

Near FLT_MAX (amax >= 1.75 * 2^127, EVEN and RCEIL) the element rounds to 4 * 2^126 and the
engines' own decode overflows to Inf; the emulator reproduces that. ggml never emits such a code.
fake_quantize returns x.dtype: for fp16 inputs near 65504 the dequantized value may exceed the fp16
range (RCEIL / EVEN round 65504 up to 65536 -> Inf), exactly as casting the engine's output would.

Tie rules (spec.tie_rule): "rne" = IEEE round-half-even on v, saturating at 6, sign bit of x
copied (-0.0 and small negatives give code 8, as torchao/triton_kernels pack them); "argmin_first"
= ggml's argmin (ties toward zero, +0).

NaN / Inf input: refused with ValueError for every flavour. torchao maps a NaN amax to scale 255
but leaves the element codes undefined, and ggml's cast of a non-finite exponent is undefined
behaviour, so no engine defines a full result.

``imatrix=`` is accepted and ignored (ggml's quantize_mxfp4 ignores it too; MX has no weighted
search). ``amax=`` is refused: MX formats have no per-tensor scale. ``scales=``: uint8 E8M0 bytes
[..., K/32] used instead of the rule (frozen / calibrated / learned scales); the engine's element
step then runs unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import numpy as np
import torch

from .codecs import (
    E2M1_VALUES,
    e2m1_magnitude_np,
    pack_pairs,
    pack_pairs_np,
    pack_split_halves_np,
    unpack_pairs,
    unpack_pairs_np,
    unpack_split_halves_np,
)
from .layouts import Codec, GGMLType, GGUFLayout, LlamaFileType, NibbleOrder, SafetensorsLayout, ScaleRule, TieRule
from .spec import _STE, Format, FormatSpec, PackedTensor, register

BLOCK = 32
_F32_MIN_NORMAL = np.float32(2.0 ** -126)
_KVALUES_GGML = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


def _pow2_f32(n: np.ndarray) -> np.ndarray:
    """Exact float32 2^n for integer n in [-149, 127] (ldexp in float64, then exact cast)."""
    return np.ldexp(1.0, np.asarray(n, dtype=np.int64)).astype(np.float32)


def _ggml_half_np(b: np.ndarray) -> np.ndarray:
    """ggml e8m0_to_fp32_half: 2^(b-128) built from the bits (b < 2 are fp32 subnormals)."""
    b = np.asarray(b, dtype=np.uint32)
    bits = np.where(b < 2, np.uint32(0x00200000) << b, (b - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


# ----------------------------------------------------------------------------- per-byte tables
_BYTES = np.arange(256)
_OCP_DECODE = np.where(_BYTES == 255, np.float32(np.nan), _pow2_f32(np.minimum(_BYTES, 254) - 127))


def _ggml_max_code() -> np.ndarray:
    """Largest magnitude code whose kvalue * d is finite, per scale byte (7 below byte 253)."""
    d = _ggml_half_np(_BYTES)
    with np.errstate(over="ignore"):
        fin = np.isfinite(_KVALUES_GGML[None, :8] * d[:, None])
    return (fin.sum(axis=1) - 1).astype(np.uint8)


@dataclass(frozen=True)
class _ScaleRule:
    """One scale rule: how the engine picks the byte, scales the elements and decodes.

    mult[b]: factor applied to x before E2M1 rounding (the engine's exact power-of-two step);
    elem[c] * decode[b]: the dequantized value (the engine's own tables, so the sign of zero
    matches too); max_code[b]: largest magnitude code the engine can emit with byte b."""

    byte_torch: Callable[[torch.Tensor], torch.Tensor]   # fp32 amax [...] -> int32 byte [...]
    ref_block: Callable[..., tuple]                       # numpy engine-order reference
    mult: np.ndarray
    decode: np.ndarray
    elem: np.ndarray
    max_code: np.ndarray
    reserved_bytes: tuple                                 # bytes refused in scales=


def _exp_field(a: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int32) >> 23) & 0xFF


# -- torchao FLOOR / EVEN ---------------------------------------------------------------------
def _byte_floor(amax: torch.Tensor) -> torch.Tensor:
    return (_exp_field(amax) - 2).clamp_min(0)


def _byte_even(amax: torch.Tensor) -> torch.Tensor:
    # amax >= 0, so the carry out of the mantissa lands in the exponent (255 = Inf stays finite byte)
    bits = amax.view(torch.int32) + (1 << 21)
    return (((bits >> 23) & 0xFF) - 2).clamp_min(0)


def _ref_torchao(xb: np.ndarray, scales: Optional[np.ndarray], even: bool):
    """torchao 0.18 to_mx FLOOR/EVEN op order, numpy: amax bits -> clamp -> divide -> RNE E2M1."""
    if scales is None:
        amax = np.abs(xb).max(axis=-1)
        bits = amax.view(np.uint32).astype(np.int64)
        if even:
            bits = (bits + (1 << 21)) & 0xFF800000
        pow2 = ((bits >> 23) & 0xFF) - 127
        e = np.clip(pow2 - 2, -127, 128)
        b = (e + 127).astype(np.uint8)
    else:
        b = scales
    scale = (b.astype(np.uint32) << np.uint32(23)).view(np.float32)
    scale = np.maximum(scale, _F32_MIN_NORMAL)      # torchao's clamp: byte 0 divides by 2^-126
    v = (xb / scale[..., None]).astype(np.float32)
    mag = e2m1_magnitude_np(np.abs(v), "rne")
    codes = mag | (np.signbit(v).astype(np.uint8) << 3)
    return b, codes


# -- triton_kernels ROUND_UP (RCEIL) ----------------------------------------------------------
def _byte_rceil(amax: torch.Tensor) -> torch.Tensor:
    bits = amax.view(torch.int32)
    ex = (bits >> 23) & 0xFF
    up = ((bits & 0x7FFFFF) > 0x400000).to(torch.int32)       # mantissa > 1.5: amax/6 above 2^(E-2)
    b = (ex - 2 + up).clamp_min(1)                            # subnormal amax/6 rounds up to 2^-126
    return torch.where(bits <= 3, torch.zeros_like(b), b)     # RN(amax/6) == 0: byte 0


def _ref_triton(xb: np.ndarray, scales: Optional[np.ndarray]):
    """triton_kernels _compute_quant_and_scale (ROUND_UP, fp4 branch), numpy, same op order."""
    if scales is None:
        amax = np.abs(xb).max(axis=-1)
        q = (amax / np.float32(6.0)).astype(np.float32)
        qbits = q.view(np.uint32).astype(np.uint64)
        eb = ((qbits + 0x7FFFFF) & 0x7F800000).astype(np.uint32)
        b = (eb >> np.uint32(23)).astype(np.uint8)
    else:
        b = scales
        eb = b.astype(np.uint32) << np.uint32(23)
    rounded = eb.astype(np.uint32).view(np.float32)
    with np.errstate(divide="ignore"):
        qs = np.where(rounded == 0, np.float32(0), np.float32(1.0) / rounded).astype(np.float32)
    v = (xb * qs[..., None]).astype(np.float32)
    # triton: guard/sticky RNE on the fp32 bits, min(.., 7), sign bit of v copied
    mag = e2m1_magnitude_np(np.abs(v), "rne")
    codes = mag | (np.signbit(v).astype(np.uint8) << 3)
    return b, codes


# -- ggml (log2f) ------------------------------------------------------------------------------
def _log2f_thresholds() -> np.ndarray:
    """thr[k + 149] (k = -149..128): bits of the smallest float32 a with floor(float32(log2 a)) >= k.

    Below 2^k the fp32 log2 can round up to k; ggml then picks scale byte k + 125. The table is
    the exact boundary of that rounding, found with the correctly rounded float32(log2_f64)."""
    ks = np.arange(-149, 129)
    thr = np.empty(ks.shape, dtype=np.int64)
    n = 512
    for i, k in enumerate(ks):
        top = np.float32(np.finfo(np.float32).max) if k == 128 else np.float32(np.ldexp(1.0, int(k)))
        start = top.view(np.uint32).astype(np.int64)
        cand = start - np.arange(1 if k < 128 else 0, n)
        cand = cand[cand > 0]
        a = cand.astype(np.uint32).view(np.float32)
        up = np.floor(np.log2(a.astype(np.float64)).astype(np.float32)) >= k
        # up is True on a contiguous run starting at the top; threshold = last True
        run = np.argmin(up) if not up.all() else len(up)
        thr[i] = cand[run - 1] if run > 0 else (start if k < 128 else 0x7F800000)
    return thr


_GGML_THR = _log2f_thresholds()


def _byte_ggml(amax: torch.Tensor) -> torch.Tensor:
    bits = amax.view(torch.int32)
    sub = bits < (1 << 23)
    # floor(log2 amax), exact, subnormals too (scaling by 2^64 is exact and makes them normal)
    a2 = torch.where(sub, amax * (2.0 ** 64), amax)
    fl = _exp_field(a2) - 127 - torch.where(sub, 64, 0).to(torch.int32)
    thr = torch.as_tensor(_GGML_THR, dtype=torch.int64, device=amax.device)
    k = (fl + 1).clamp(-149, 128)
    bump = (bits.to(torch.int64) >= thr[(k + 149).long()]).to(torch.int32)
    b = (fl + bump + 125) & 0xFF              # x86 cast of a negative exponent wraps modulo 256
    return torch.where(bits == 0, torch.zeros_like(b), b)


def _ref_ggml(xb: np.ndarray, scales: Optional[np.ndarray]):
    """ggml quantize_row_mxfp4_ref, numpy, same op order: floorf(log2f(amax)), then argmin of
    |kvalues*d - x| in float32 (first index wins)."""
    if scales is None:
        amax = np.abs(xb).max(axis=-1)
        with np.errstate(divide="ignore"):
            lg = np.log2(amax.astype(np.float64)).astype(np.float32)     # correctly rounded log2f
        e = np.where(amax > 0, np.floor(lg) - 2 + 127, 0).astype(np.int64)
        b = (e & 0xFF).astype(np.uint8)
    else:
        b = scales
    d = _ggml_half_np(b)
    codes = np.empty(xb.shape, dtype=np.uint8)
    kv = _KVALUES_GGML
    with np.errstate(over="ignore", invalid="ignore"):
        for j in range(xb.shape[-1]):           # per element column: memory stays O(blocks * 16)
            err = np.abs(kv * d[..., None] - xb[..., j, None])
            err = np.where(np.isnan(err), np.float32(np.inf), err)
            codes[..., j] = np.argmin(err, axis=-1)
    return b, codes


def _mult(kind: str) -> np.ndarray:
    m = _pow2_f32(127 - np.minimum(_BYTES, 254 if kind != "ggml" else 255)).astype(np.float32)
    if kind == "ggml":
        return m
    m = m.copy()
    m[255] = np.nan
    if kind == "torchao":
        m[0] = np.float32(2.0 ** 126)
    elif kind == "triton":
        m[0] = 0.0
    return m


_SCALE_RULES: Dict[str, _ScaleRule] = {
    ScaleRule.MX_FLOOR: _ScaleRule(
        _byte_floor, lambda xb, s: _ref_torchao(xb, s, even=False), _mult("torchao"), _OCP_DECODE,
        E2M1_VALUES, np.full(256, 7, np.uint8), (255,)),
    ScaleRule.MX_EVEN: _ScaleRule(
        _byte_even, lambda xb, s: _ref_torchao(xb, s, even=True), _mult("torchao"), _OCP_DECODE,
        E2M1_VALUES, np.full(256, 7, np.uint8), (255,)),
    ScaleRule.MX_RCEIL: _ScaleRule(
        _byte_rceil, _ref_triton, _mult("triton"), _OCP_DECODE, E2M1_VALUES, np.full(256, 7, np.uint8), (255,)),
    ScaleRule.MX_GGML: _ScaleRule(
        _byte_ggml, _ref_ggml, _mult("ggml"), _ggml_half_np(_BYTES), _KVALUES_GGML, _ggml_max_code(), ()),
}

# tie rule -> (E2M1 tie handling, whether the sign bit survives a zero magnitude)
_TIE_RULES = {TieRule.RNE: ("rne", True), TieRule.ARGMIN_FIRST: ("toward_zero", False)}

# E2M1 magnitude code = number of bounds strictly below |v| (one bucketize pass instead of seven
# compares). The RNE ties that round up (0.75, 1.75, 3.5) use '>=', i.e. '>' the float just below.
_E2M1_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
_E2M1_BOUNDS_BY_TIES = {
    "toward_zero": _E2M1_BOUNDS,
    "rne": np.where([False, True, False, True, False, True, False],
                    np.nextafter(_E2M1_BOUNDS, np.float32(0)), _E2M1_BOUNDS).astype(np.float32),
}


# ----------------------------------------------------------------------------- layouts
def _row_pack_np(codes_packed, scales):
    return np.concatenate([codes_packed, scales], axis=-1)


def _row_unpack_np(b, k):
    return b[..., : k // 2], b[..., k // 2:]


def _ggml_pack_np(codes_packed, scales):
    # codes arrive packed in pairs; ggml wants split halves inside each 32-block
    codes = unpack_pairs_np(codes_packed)
    qs = pack_split_halves_np(codes, BLOCK)
    nb = scales.shape[-1]
    qs = qs.reshape(*qs.shape[:-1], nb, BLOCK // 2)
    out = np.concatenate([scales[..., None], qs], axis=-1)
    return out.reshape(*out.shape[:-2], nb * (BLOCK // 2 + 1))


def _ggml_unpack_np(b, k):
    nb = k // BLOCK
    blk = b.reshape(*b.shape[:-1], nb, BLOCK // 2 + 1)
    scales = blk[..., 0]
    qs = blk[..., 1:].reshape(*b.shape[:-1], nb * (BLOCK // 2))
    codes = unpack_split_halves_np(qs, BLOCK)
    return pack_pairs_np(codes), scales


_LAYOUTS = {NibbleOrder.PAIRS: (_row_pack_np, _row_unpack_np),
            NibbleOrder.SPLIT_HALVES: (_ggml_pack_np, _ggml_unpack_np)}


# ----------------------------------------------------------------------------- the format
class MXFP4Format(Format):
    """One class for every MXFP4 flavour; the flavour is entirely in the spec's rule fields."""

    def __init__(self, spec: FormatSpec):
        super().__init__(spec)
        try:
            self.rule = _SCALE_RULES[spec.scale_rule]
            self.ties, self.signed_zero = _TIE_RULES[spec.tie_rule]
            self._pack_np, self._unpack_np = _LAYOUTS[spec.nibble_order]
        except KeyError as e:
            raise ValueError(f"{spec.name}: no implementation for {e.args[0]!r}; known scale rules "
                             f"{sorted(_SCALE_RULES)}, tie rules {sorted(_TIE_RULES)}, "
                             f"nibble orders {sorted(_LAYOUTS)}") from None
        self._tables: Dict[str, tuple] = {}

    # -- helpers ------------------------------------------------------------------------------
    def _dev_tables(self, device) -> tuple:
        key = str(device)
        t = self._tables.get(key)
        if t is None:
            r = self.rule
            t = (torch.as_tensor(r.mult, device=device), torch.as_tensor(r.decode, device=device),
                 torch.as_tensor(r.max_code, device=device),
                 torch.as_tensor(E2M1_VALUES[:8].copy(), device=device),
                 torch.as_tensor(r.elem.copy(), device=device),
                 torch.as_tensor(_E2M1_BOUNDS_BY_TIES[self.ties], device=device))
            self._tables[key] = t
        return t

    def _check_kwargs(self, amax, kw):
        if amax is not None:
            raise ValueError(f"{self.name}: amax= does not apply; MX formats have no per-tensor scale "
                             f"(each 32-block carries its own E8M0 byte)")
        kw.pop("imatrix", None)           # ggml ignores it for MXFP4; nothing to weight in MX
        if kw:
            raise TypeError(f"{self.name}: unexpected keyword arguments {sorted(kw)}; "
                            f"allowed: scales=, imatrix= (ignored)")

    def _check_scales(self, scales, lead, nb, device=None, numpy=False):
        if isinstance(scales, np.ndarray):
            if scales.dtype != np.uint8:
                raise ValueError(f"{self.name}: scales= must be uint8 E8M0 bytes, got dtype {scales.dtype}")
            s = scales if numpy else torch.from_numpy(np.ascontiguousarray(scales)).to(device)
        elif isinstance(scales, torch.Tensor):
            s = scales.detach()
            if s.dtype == getattr(torch, "float8_e8m0fnu", None):
                s = s.view(torch.uint8)
            if s.dtype != torch.uint8:
                raise ValueError(f"{self.name}: scales= must be uint8 E8M0 bytes, got dtype {s.dtype}")
            s = s.cpu().numpy() if numpy else s.to(device)
        else:
            raise ValueError(f"{self.name}: scales= must be a uint8 tensor [..., K/32], got {type(scales)}")
        if tuple(s.shape) != tuple(lead) + (nb,):
            raise ValueError(f"{self.name}: scales= has shape {tuple(s.shape)}, expected "
                             f"{tuple(lead) + (nb,)} (one E8M0 byte per {BLOCK} elements)")
        for r in self.rule.reserved_bytes:
            if bool((s == r).any()):
                raise ValueError(f"{self.name}: scales= contains byte {r}, the E8M0 NaN encoding; "
                                 f"allowed bytes are 0..254")
        return s

    # -- torch emulator -------------------------------------------------------------------------
    def _codes(self, x: torch.Tensor, scales, amax, kw):
        """-> (codes uint8 [..., K/32, 32] unpacked, scale bytes uint8 [..., K/32], v = x * mult)."""
        self._check_kwargs(amax, kw)
        self.check_input(x)
        self.check_finite(self.name, x)
        xf = x.detach().to(torch.float32)
        k = xf.shape[-1]
        lead = xf.shape[:-1]
        xb = xf.reshape(*lead, k // BLOCK, BLOCK)
        mult, _, max_code, _, _, bounds = self._dev_tables(xf.device)
        if scales is None:
            b = self.rule.byte_torch(xb.abs().amax(dim=-1)).to(torch.uint8)
        else:
            b = self._check_scales(scales, lead, k // BLOCK, device=xf.device)
        bl = b.long()
        v = xb * mult[bl].unsqueeze(-1)
        mag = torch.bucketize(v.abs(), bounds, out_int32=True).to(torch.uint8)
        mag = torch.minimum(mag, max_code[bl].unsqueeze(-1))
        neg = torch.signbit(xb) if self.signed_zero else (xb < 0) & (mag != 0)
        return mag | (neg.to(torch.uint8) << 3), b, v

    def _decode(self, c: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """codes [..., nb, 32] + bytes [..., nb] -> float32 [..., nb, 32]; exact (<= 4 significant bits)."""
        _, decode, _, _, elem, _ = self._dev_tables(c.device)
        return elem[c.long()] * decode[b.to(c.device).long()].unsqueeze(-1)

    def quantize(self, x: torch.Tensor, scales=None, amax=None, **kw) -> PackedTensor:
        c, b, _ = self._codes(x, scales, amax, kw)
        return PackedTensor(self.name, tuple(x.shape), pack_pairs(c.reshape(x.shape)), b, None)

    def dequantize(self, p: PackedTensor) -> torch.Tensor:
        codes = unpack_pairs(p.codes)
        k = codes.shape[-1]
        c = codes.reshape(*codes.shape[:-1], k // BLOCK, BLOCK)
        return self._decode(c, p.scales).reshape(*codes.shape[:-1], k)

    # -- frozen codes, moving scales (Format.code_values / block_multiplier / shift_scales) -------
    def code_values(self, p: PackedTensor) -> torch.Tensor:
        codes = unpack_pairs(p.codes)
        elem = self._dev_tables(codes.device)[4]
        return elem[codes.long()].reshape(p.shape)

    def block_multiplier(self, p: PackedTensor) -> torch.Tensor:
        decode = self._dev_tables(p.scales.device)[1]
        return decode[p.scales.long()]

    def shift_scales(self, scales: torch.Tensor, log2_offset: torch.Tensor):
        """E8M0 is a grid of powers of two, so value * 2^theta lands on byte + round(theta) (nearest
        in the log domain, ties to even), clamped to bytes 0..254 (255 is NaN, or for ggml 2^127
        where its largest codes overflow). The engines' amax -> byte rules (FLOOR, RCEIL, EVEN) do not
        apply to a learned scale: they map a block maximum, not a scale, and a floor or ceiling on
        theta itself would move every block one step on the first update of an unbiased optimizer."""
        s = torch.as_tensor(scales)
        if s.dtype != torch.uint8:
            raise ValueError(f"{self.name}: scales must be uint8 E8M0 bytes, got {s.dtype}")
        valid = s <= 254
        step = torch.nan_to_num(log2_offset.float(), nan=0.0, posinf=512.0, neginf=-512.0).clamp(-512, 512)
        want = s.to(torch.int32) + torch.round(step).to(torch.int32)
        clamped = valid & ((want < 0) | (want > 254))
        return torch.where(valid, want.clamp(0, 254).to(torch.uint8), s), clamped

    def _in_range(self, v: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        _, _, max_code, e2m1, _, _ = self._dev_tables(v.device)
        return v.abs() <= e2m1[max_code[b.to(v.device).long()].long()].unsqueeze(-1)

    def clip_mask(self, x: torch.Tensor, p: PackedTensor) -> Optional[torch.Tensor]:
        mult = self._dev_tables(x.device)[0]
        xf = x.detach().to(torch.float32)
        xb = xf.reshape(*xf.shape[:-1], xf.shape[-1] // BLOCK, BLOCK)
        b = p.scales.to(x.device)
        return self._in_range(xb * mult[b.long()].unsqueeze(-1), b).reshape(xf.shape)

    def fake_quantize(self, x: torch.Tensor, ste: str = "identity", scales=None, amax=None,
                      **kw) -> torch.Tensor:
        """Same numerics as dequantize(quantize(x)).to(x.dtype), without the nibble packing."""
        if ste not in ("identity", "clipped"):
            raise ValueError(f"fake_quantize: ste={ste!r}; allowed: 'identity', 'clipped'")
        c, b, v = self._codes(x, scales, amax, kw)
        q = self._decode(c, b).reshape(x.shape).to(x.dtype)
        if not x.requires_grad:
            return q
        mask = self._in_range(v, b).reshape(x.shape) if ste == "clipped" else torch.empty(0, device=x.device)
        return _STE.apply(x, q, mask)

    # -- engine bytes ----------------------------------------------------------------------------
    def to_bytes(self, p: PackedTensor) -> np.ndarray:
        codes = p.codes.detach().cpu().numpy().astype(np.uint8)
        scales = p.scales.detach().cpu().numpy().astype(np.uint8)
        return np.ascontiguousarray(self._pack_np(codes, scales))

    def from_bytes(self, b, k: Optional[int] = None) -> PackedTensor:
        b = np.asarray(b.cpu().numpy() if isinstance(b, torch.Tensor) else b, dtype=np.uint8)
        per = BLOCK // 2 + 1
        if b.shape[-1] % per != 0:
            raise ValueError(f"{self.name}: a row of engine bytes must be a multiple of {per} bytes "
                             f"(one {BLOCK}-element block), got {b.shape[-1]}")
        kk = b.shape[-1] // per * BLOCK
        if k is not None and k != kk:
            raise ValueError(f"{self.name}: {b.shape[-1]} bytes per row hold K={kk} elements, not K={k}")
        codes, scales = self._unpack_np(b, kk)
        return PackedTensor(self.name, tuple(b.shape[:-1]) + (kk,), torch.from_numpy(np.ascontiguousarray(codes)),
                            torch.from_numpy(np.ascontiguousarray(scales)), None)

    # -- numpy reference (the engine's own op order) ------------------------------------------
    def quantize_ref(self, x: np.ndarray, scales=None, amax=None, **kw) -> np.ndarray:
        self._check_kwargs(amax, kw)
        x = np.asarray(x)
        if x.dtype not in (np.float32, np.float16, np.float64) and x.dtype.name != "bfloat16":
            raise ValueError(f"{self.name}: quantize_ref expects a float array, got {x.dtype}")
        x = x.astype(np.float32)
        self.check_input(x)
        self.check_finite(self.name, x)
        k = x.shape[-1]
        lead = x.shape[:-1]
        xb = x.reshape(*lead, k // BLOCK, BLOCK)
        s = None if scales is None else self._check_scales(scales, lead, k // BLOCK, numpy=True)
        b, codes = self.rule.ref_block(xb, s)
        return np.ascontiguousarray(self._pack_np(pack_pairs_np(codes.reshape(*lead, k)), b.astype(np.uint8)))

    def dequantize_ref(self, b: np.ndarray, k: Optional[int] = None) -> np.ndarray:
        """numpy decode of engine bytes, written from the decode rule alone."""
        b = np.asarray(b, dtype=np.uint8)
        kk = b.shape[-1] // (BLOCK // 2 + 1) * BLOCK
        codes, scales = self._unpack_np(b, kk)
        c = unpack_pairs_np(codes).reshape(*b.shape[:-1], kk // BLOCK, BLOCK)
        val = self.rule.elem[c]
        with np.errstate(over="ignore", invalid="ignore"):
            out = val * self.rule.decode[scales][..., None]
        return out.reshape(*b.shape[:-1], kk).astype(np.float32)


# ----------------------------------------------------------------------------- registry
_OCP_FALLBACK = ("bf16: vLLM / compressed-tensors need K % 32 == 0, so such a layer stays unquantized "
                 "(list it in the checkpoint's ignore list)")
_COMMON = dict(element="e2m1", block_size=BLOCK, super_block=BLOCK, bytes_per_block=BLOCK // 2 + 1,
               scale_codec="e8m0", global_scale=None, role="both", symmetric=True)
# the OCP flavours: compressed-tensors mxfp4-pack-quantized (the container keeps only the E8M0 byte, so
# any OCP scale rule fits) and, repacked, GGML MXFP4 blocks (written only when ggml decodes the same values)
_OCP_LAYOUTS = dict(
    gguf=GGUFLayout(GGMLType.MXFP4, Codec.E2M1_E8M0, LlamaFileType.MOSTLY_MXFP4_MOE),
    safetensors=SafetensorsLayout(Codec.E2M1_E8M0, ct_format="mxfp4-pack-quantized", group_size=32,
                                  strategy="group", scale_dtype="uint8"))

register(MXFP4Format(FormatSpec(
    name="mxfp4", engine="OCP MX v1.0 FLOOR as torchao 0.18 to_mx(ScaleCalculationMode.FLOOR)",
    scale_rule=ScaleRule.MX_FLOOR, tie_rule=TieRule.RNE, nibble_order=NibbleOrder.PAIRS,
    oracle="torchao 0.18 to_mx(x, float4_e2m1fn_x2, 32, FLOOR)", fallback=_OCP_FALLBACK,
    notes="row bytes = packed pair codes [K/2] then E8M0 scales [K/32]", **_OCP_LAYOUTS, **_COMMON)))

register(MXFP4Format(FormatSpec(
    name="mxfp4_rceil", engine="triton_kernels downcast_to_mxfp ROUND_UP (= cvt.rp.satfinite.ue8m0, "
                               "cuBLAS/FlashInfer/TRT-LLM MXFP4 recipe)",
    scale_rule=ScaleRule.MX_RCEIL, tie_rule=TieRule.RNE, nibble_order=NibbleOrder.PAIRS,
    oracle="TRANSCRIPTION (no run of triton_kernels/cuBLAS yet): our exact integer derivation (fractions) of the "
           "ROUND_UP rule; torchao 0.18 to_mx RCEIL agrees off its log2 edge values",
    fallback=_OCP_FALLBACK, notes="row bytes = packed pair codes [K/2] then E8M0 scales [K/32]; "
                                  "never clips the block max", **_OCP_LAYOUTS, **_COMMON)))

register(MXFP4Format(FormatSpec(
    name="mxfp4_even", engine="torchao 0.18 to_mx(ScaleCalculationMode.EVEN) = compressed-tensors 0.20 "
                              "generate_mx_scales (vLLM Quark OCP-MX emulation)",
    scale_rule=ScaleRule.MX_EVEN, tie_rule=TieRule.RNE,
    nibble_order=NibbleOrder.PAIRS, oracle="torchao 0.18 to_mx EVEN; compressed-tensors generate_mx_scales",
    fallback=_OCP_FALLBACK, notes="row bytes = packed pair codes [K/2] then E8M0 scales [K/32]",
    **_OCP_LAYOUTS, **_COMMON)))

register(MXFP4Format(FormatSpec(
    name="mxfp4_ggml", engine="llama.cpp / ggml GGML_TYPE_MXFP4 quantize_row_mxfp4_ref (ggml 0.20.2)",
    scale_rule=ScaleRule.MX_GGML, tie_rule=TieRule.ARGMIN_FIRST, nibble_order=NibbleOrder.SPLIT_HALVES,
    oracle="libggml-python 0.20.2 (ggml_quantize_chunk / dequantize_row_mxfp4) and gguf 0.19 gguf.quants",
    gguf=GGUFLayout(GGMLType.MXFP4, file_type=LlamaFileType.MOSTLY_MXFP4_MOE),   # its own bytes are the blocks
    fallback="F16/BF16: ggml rows must hold whole 32-element blocks, and llama-quantize "
             "has no fallback type for MXFP4 (it aborts: 'Unsupported tensor size')",
    notes="17-byte blocks: e8m0 byte, then byte j = c[j] | c[j+16] << 4",
    **_COMMON)))
