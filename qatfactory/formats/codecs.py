"""Element and scale codecs shared by the formats: E2M1, E4M3, E8M0, fp16, nibble packing.

Each codec comes twice: a numpy version (used by the references) written from the bit
rules, and a torch version (used by the emulators). Tests compare both against
ml_dtypes and torch's own float8 / float4 casts over every code and every tie.

E2M1 (FP4), bit 3 = sign, bits 2..0 index the magnitudes:

    code  0    1    2    3    4    5    6    7
    value 0   0.5   1   1.5   2    3    4    6      (codes 8..15: the negatives)

RNE thresholds on a = |v| (ties go to the even code):
    a <= 0.25 -> 0 ; < 0.75 -> 0.5 ; <= 1.25 -> 1 ; < 1.75 -> 1.5 ;
    <= 2.5 -> 2 ; < 3.5 -> 3 ; <= 5 -> 4 ; else 6 (saturate)
Ties toward zero (ggml's argmin, first index wins) use strict '>' at every threshold.

E4M3 ("e4m3fn"): bias 7, 3 mantissa bits, max 448 = 0x7E, min subnormal 2^-9, NaN 0x7F.
Encoding here is the NVIDIA ``cvt.rn.satfinite`` rule: RNE, |v| > 448 saturates to 448.

E8M0: value 2^(e-127), e = 0..254, 255 = NaN.
"""
from __future__ import annotations

import numpy as np
import torch

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9

# thresholds and whether the tie at that threshold rounds up (RNE: up when the upper code is even)
_E2M1_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
_E2M1_RNE_TIE_UP = np.array([False, True, False, True, False, True, False])


# ----------------------------------------------------------------------------- E2M1, numpy
def e2m1_magnitude_np(a: np.ndarray, ties: str = "rne") -> np.ndarray:
    """Magnitude code 0..7 of a >= 0 (float32). ties: 'rne' or 'toward_zero'."""
    a = np.asarray(a, dtype=np.float32)
    idx = np.zeros(a.shape, dtype=np.uint8)
    for b, up in zip(_E2M1_BOUNDS, _E2M1_RNE_TIE_UP):
        if ties == "rne" and up:
            idx += (a >= b)
        elif ties in ("rne", "toward_zero"):
            idx += (a > b)
        else:
            raise ValueError(f"unknown E2M1 tie rule {ties!r}; allowed: 'rne', 'toward_zero'")
    # NaN compares False everywhere -> 0; callers refuse NaN before getting here
    return idx


def e2m1_encode_np(v: np.ndarray, ties: str = "rne", negative_zero: bool = True) -> np.ndarray:
    """Code 0..15 of v (already divided by the block scale). Saturates at +-6.
    negative_zero: negative values that round to 0 keep the sign bit (code 8), as
    ModelOpt/torchao/compressed-tensors do; False gives +0 (ggml)."""
    v = np.asarray(v, dtype=np.float32)
    mag = e2m1_magnitude_np(np.abs(v), ties)
    neg = v < 0
    if not negative_zero:
        neg = neg & (mag != 0)
    return (mag | (neg.astype(np.uint8) << 3)).astype(np.uint8)


def e2m1_decode_np(codes: np.ndarray) -> np.ndarray:
    return E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0xF]


# ----------------------------------------------------------------------------- E2M1, torch
_E2M1_BOUNDS_T = {}


def e2m1_magnitude(a: torch.Tensor, ties: str = "rne") -> torch.Tensor:
    """torch twin of e2m1_magnitude_np (a float32 >= 0) -> uint8 0..7."""
    if ties not in ("rne", "toward_zero"):
        raise ValueError(f"unknown E2M1 tie rule {ties!r}; allowed: 'rne', 'toward_zero'")
    idx = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for b, up in zip(_E2M1_BOUNDS.tolist(), _E2M1_RNE_TIE_UP.tolist()):
        if ties == "rne" and up:
            idx += (a >= b).to(torch.uint8)
        else:
            idx += (a > b).to(torch.uint8)
    return idx


def e2m1_encode(v: torch.Tensor, ties: str = "rne", negative_zero: bool = True) -> torch.Tensor:
    mag = e2m1_magnitude(v.abs(), ties)
    neg = v < 0
    if not negative_zero:
        neg = neg & (mag != 0)
    return mag | (neg.to(torch.uint8) << 3)


_E2M1_TABLES: dict = {}   # device -> the 16 values there, made once: a fresh host->GPU copy per call stalls the stream


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = _E2M1_TABLES.get(codes.device)
    if table is None:
        table = _E2M1_TABLES[codes.device] = torch.from_numpy(E2M1_VALUES.copy()).to(codes.device)
    return table[(codes & 0xF).long()]


# ----------------------------------------------------------------------------- E4M3
def e4m3_encode_np(v: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 byte, RNE, saturating to +-448, NaN -> 0x7F (sign kept)."""
    v = np.asarray(v, dtype=np.float32)
    sign = (np.signbit(v).astype(np.uint8) << 7)
    a = np.minimum(np.abs(v), np.float32(E4M3_MAX))  # NaN stays NaN
    nan = np.isnan(a)
    a = np.where(nan, np.float32(0), a)
    _, ex = np.frexp(a)                       # a = m * 2^ex, m in [0.5, 1)
    e = ex.astype(np.int32) - 1               # floor(log2 a) for a > 0
    e = np.where(a > 0, e, -6)                # frexp(0) has exponent 0; zero must encode as 0x00
    e = np.maximum(e, -6)                     # subnormals share the step of 2^-6
    step_exp = e - 3
    q = np.rint(np.ldexp(a, -step_exp)).astype(np.int64)      # exact scaling, RNE
    # q counts steps of 2^step_exp; renormalise into (exponent field, mantissa)
    val_exp = np.where(q >= 16, e + 1, e)
    q = np.where(q >= 16, q // 2, q)                            # q == 16 only, exact
    sub = (e == -6) & (q < 8)
    field_e = np.where(sub, 0, val_exp + 7)
    mant = np.where(sub, q, q - 8)
    code = ((field_e << 3) | mant).astype(np.uint8)
    code = np.where(nan, np.uint8(0x7F), code)
    return (code | sign).astype(np.uint8)


def e4m3_decode_np(b: np.ndarray) -> np.ndarray:
    b = np.asarray(b, dtype=np.uint8)
    sign = np.where(b & 0x80, -1.0, 1.0).astype(np.float32)
    e = ((b >> 3) & 0xF).astype(np.int32)
    m = (b & 0x7).astype(np.float32)
    val = np.where(e == 0, np.ldexp(m, -9), np.ldexp(1.0 + m / 8.0, e - 7)).astype(np.float32)
    val = np.where((b & 0x7F) == 0x7F, np.float32(np.nan), val)
    return (sign * val).astype(np.float32)


def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """torch: float -> E4M3 byte (uint8), RNE satfinite. Clamped first so that old torch
    versions whose eager cast does not saturate give the same bytes."""
    v = v.float()
    return torch.where(torch.isnan(v), v, v.clamp(-E4M3_MAX, E4M3_MAX)).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float8_e4m3fn).float()


# ----------------------------------------------------------------------------- E8M0
def e8m0_decode_np(e: np.ndarray) -> np.ndarray:
    e = np.asarray(e, dtype=np.uint8)
    out = np.ldexp(np.float32(1.0), e.astype(np.int32) - 127).astype(np.float32)
    return np.where(e == 255, np.float32(np.nan), out).astype(np.float32)


def e8m0_decode(e: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> float32 built from the bits (e=0 is the subnormal 2^-127; 255 is NaN)."""
    e32 = e.to(torch.int32)
    bits = torch.where(e32 > 0, e32 << 23, torch.full_like(e32, 1 << 22))
    out = bits.view(torch.float32)
    return torch.where(e32 == 255, torch.full_like(out, float("nan")), out)


# ----------------------------------------------------------------------------- nibble packing
def pack_pairs_np(codes: np.ndarray) -> np.ndarray:
    """[..., K] codes -> [..., K/2] bytes, element 2i in the low nibble."""
    c = np.asarray(codes, dtype=np.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_pairs_np(b: np.ndarray) -> np.ndarray:
    b = np.asarray(b, dtype=np.uint8)
    out = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = b & 0xF
    out[..., 1::2] = b >> 4
    return out


def pack_pairs(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_pairs(b: torch.Tensor) -> torch.Tensor:
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)


def pack_split_halves_np(codes: np.ndarray, block: int) -> np.ndarray:
    """ggml order: inside each block of `block` codes, byte j = code[j] | code[j + block/2] << 4.
    [..., K] -> [..., K/2]."""
    c = np.asarray(codes, dtype=np.uint8)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // block, block)
    h = block // 2
    b = (c[..., :h] & 0xF) | ((c[..., h:] & 0xF) << 4)
    return b.reshape(*b.shape[:-2], -1)


def unpack_split_halves_np(b: np.ndarray, block: int) -> np.ndarray:
    b = np.asarray(b, dtype=np.uint8)
    h = block // 2
    b = b.reshape(*b.shape[:-1], b.shape[-1] // h, h)
    c = np.concatenate([b & 0xF, b >> 4], axis=-1)
    return c.reshape(*c.shape[:-2], -1)


def pack_split_halves(codes: torch.Tensor, block: int) -> torch.Tensor:
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // block, block)
    h = block // 2
    b = (c[..., :h] & 0xF) | ((c[..., h:] & 0xF) << 4)
    return b.reshape(*b.shape[:-2], -1)


def unpack_split_halves(b: torch.Tensor, block: int) -> torch.Tensor:
    h = block // 2
    bb = b.reshape(*b.shape[:-1], b.shape[-1] // h, h)
    c = torch.cat([bb & 0xF, bb >> 4], dim=-1)
    return c.reshape(*c.shape[:-2], -1)


# ----------------------------------------------------------------------------- fp16 / ints
def fp16_bits_np(v: np.ndarray) -> np.ndarray:
    """float32 -> IEEE half (RNE, overflow -> Inf) as uint16 bits."""
    return np.asarray(v, dtype=np.float32).astype(np.float16).view(np.uint16)


def nearest_int_np(f: np.ndarray) -> np.ndarray:
    """ggml nearest_int: round half to even on float32 (valid for |f| <= 4194303)."""
    return np.rint(np.asarray(f, dtype=np.float32)).astype(np.int32)
