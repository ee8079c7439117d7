"""GGUF block layouts that hold the low-bit integer grids of ``intgrid.py`` (numpy, both ways).

Every function packs *integer codes* and fp16 scales that the grid format already decided; no
rounding happens here. Element ``e`` of a 256-element super-block (``QK_K``) and of a 32-element
Q4_0 block is placed as llama.cpp's dequantizers read it (``ggml/src/ggml-quants.c`` and the
structs in ``ggml-common.h`` of the llama.cpp vendored by llama-cpp-python 0.3.36; the decoders of
gguf-py 0.19 read the same bytes). Value decoded by the engine, in float32:

    Q4_0  (type 2,  18 B / 32)   [d fp16][qs 16 B]          y = (q - 8) * d,       q = byte j low (j<16) / high
    Q3_K  (type 11, 110 B / 256) [hmask 32][qs 64][sc 12][d] y = d * (sc_s - 32) * (lo2 - (hbit ? 0 : 4))
    Q2_K  (type 10, 84 B / 256)  [sc|m<<4 16][qs 64][d][dmin] y = d * sc_s * q2 - dmin * m_s
    TQ2_0 (type 35, 66 B / 256)  [qs 64][d]                  y = (q2 - 1) * d,      q2 in 0..3
    TQ1_0 (type 34, 54 B / 256)  [qs 48][qh 4][d]            y = (trit - 1) * d,    5 (qs) / 4 (qh) trits per byte

2-bit fields of Q3_K, Q2_K and TQ2_0 share one placement: element e = 128 h + 32 j + l sits in
byte ``32 h + l`` at bit ``2 j``. Q3_K's high bit of element e is bit ``e // 32`` of ``hmask[e % 32]``;
its 16 six-bit sub-block scales (stored + 32) are packed as: low nibble of s in byte s (s < 8) or in
the high nibble of byte s - 8 (s >= 8), the top two bits at bit ``2 (s // 4)`` of byte ``8 + s % 4``.

TQ1_0 stores base-3 digits as a fixed-point fraction: five trits t0..t4 (t0 most significant, each
0..2) form v = 81 t0 + 27 t1 + 9 t2 + 3 t3 + t4 and the byte is ceil(256 v / 243); trit n comes back
as ``((byte * 3^n) mod 256) * 3 >> 8``. Elements 0..159 use qs[0..31] (trit n of byte m = element
32 n + m), 160..239 use qs[32..47] (element 160 + 16 n + m), 240..255 use qh[0..3] with four trits
and t4 = 0 (element 240 + 4 n + j for byte j).
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

from .layouts import GGMLType, LlamaFileType

QK_K = 256
QK4_0 = 32
SIZES = {"q4_0": (32, 18), "q3_k": (256, 110), "q2_k": (256, 84), "tq2_0": (256, 66), "tq1_0": (256, 54)}
GGML_TYPE = {"q4_0": GGMLType.Q4_0, "q3_k": GGMLType.Q3_K, "q2_k": GGMLType.Q2_K, "tq2_0": GGMLType.TQ2_0,
             "tq1_0": GGMLType.TQ1_0}
# general.file_type of a GGUF whose main type is the layout (llama-quantize's names)
FILE_TYPE = {"q4_0": LlamaFileType.MOSTLY_Q4_0, "q3_k": LlamaFileType.MOSTLY_Q3_K_M, "q2_k": LlamaFileType.MOSTLY_Q2_K,
             "tq2_0": LlamaFileType.MOSTLY_TQ2_0, "tq1_0": LlamaFileType.MOSTLY_TQ1_0}
_POW3 = np.array([1, 3, 9, 27, 81, 243], dtype=np.uint16)


def _blocks(a: np.ndarray, n: int) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1, n)


def _fp16_bytes(d: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(d, dtype=np.float16).reshape(-1, 1).view(np.uint8)


def _fp16_of(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).reshape(-1)


# ----------------------------------------------------------------------------- 2-bit fields
def pack_2bit(v: np.ndarray) -> np.ndarray:
    """v uint8 [B, 256] (values 0..3) -> [B, 64]: element 128h + 32j + l in byte 32h + l, bit 2j."""
    v = v.astype(np.uint8).reshape(-1, 2, 4, 32)
    out = v[:, :, 0] | (v[:, :, 1] << 2) | (v[:, :, 2] << 4) | (v[:, :, 3] << 6)
    return out.reshape(-1, 64)


def unpack_2bit(b: np.ndarray) -> np.ndarray:
    b = b.reshape(-1, 2, 1, 32)
    sh = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((b >> sh) & 3).reshape(-1, 256)


# ----------------------------------------------------------------------------- Q4_0
def q4_0_pack(codes: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """codes int [B*32] (-8..7) as [B, 32], d16 float16 [B] -> [B, 18]."""
    q = (_blocks(codes, QK4_0).astype(np.int16) + 8).astype(np.uint8)
    out = np.empty((q.shape[0], 18), dtype=np.uint8)
    out[:, 0:2] = _fp16_bytes(d16)
    out[:, 2:] = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
    return out


def q4_0_unpack(b: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """[B, 18] -> (codes int8 [B, 32] = q - 8, d16 [B])."""
    b = _blocks(b, 18)
    qs = b[:, 2:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int8) - 8
    return q.astype(np.int8), _fp16_of(b[:, 0:2])


# ----------------------------------------------------------------------------- Q3_K
def q3_k_pack_scales(sc: np.ndarray) -> np.ndarray:
    """Signed sub-block scales [B, 16] (-32..31) -> the 12 packed bytes [B, 12]."""
    lv = (sc.astype(np.int16) + 32).astype(np.uint8)
    out = np.zeros((lv.shape[0], 12), dtype=np.uint8)
    out[:, 0:8] = (lv[:, 0:8] & 0xF) | ((lv[:, 8:16] & 0xF) << 4)
    hi = lv >> 4                                             # [B, 16], 2 bits each
    for s in range(16):
        out[:, 8 + s % 4] |= (hi[:, s] << (2 * (s // 4))).astype(np.uint8)
    return out


def q3_k_unpack_scales(b: np.ndarray) -> np.ndarray:
    """[B, 12] -> signed scales int16 [B, 16]."""
    low = np.concatenate([b[:, 0:8] & 0xF, b[:, 0:8] >> 4], axis=1).astype(np.int16)
    s = np.arange(16)
    hi = (b[:, 8 + s % 4] >> (2 * (s // 4)).astype(np.uint8)) & 3
    return (low | (hi.astype(np.int16) << 4)) - 32


def q3_k_pack(codes: np.ndarray, d16: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """codes (-4..3) [B, 256], d16 [B], signed sub-block scales [B, 16] -> [B, 110]."""
    L = (_blocks(codes, QK_K).astype(np.int16) + 4).astype(np.uint8)   # 0..7
    hbit = (L >> 2) & 1                                                 # set when code >= 0
    hm = np.zeros((L.shape[0], 32), dtype=np.uint8)
    for k in range(8):                                                  # bit k of hmask[m] = element 32k + m
        hm |= (hbit[:, 32 * k:32 * (k + 1)] << k).astype(np.uint8)
    out = np.empty((L.shape[0], 110), dtype=np.uint8)
    out[:, 0:32] = hm
    out[:, 32:96] = pack_2bit(L & 3)
    out[:, 96:108] = q3_k_pack_scales(sc)
    out[:, 108:110] = _fp16_bytes(d16)
    return out


def q3_k_unpack(b: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[B, 110] -> (codes int8 [B, 256], d16 [B], signed scales [B, 16])."""
    b = _blocks(b, 110)
    hm = b[:, 0:32]
    hbit = np.concatenate([(hm >> k) & 1 for k in range(8)], axis=1)   # element 32k + m
    lo = unpack_2bit(b[:, 32:96]).astype(np.int16)
    codes = lo - np.where(hbit == 1, 0, 4)
    return codes.astype(np.int8), _fp16_of(b[:, 108:110]), q3_k_unpack_scales(b[:, 96:108])


# ----------------------------------------------------------------------------- Q2_K
def q2_k_pack(q: np.ndarray, d16: np.ndarray, dmin16: np.ndarray, sc: int, m: int) -> np.ndarray:
    """q (0..3) [B, 256], d16 / dmin16 [B], one (sc, m) 4-bit pair for all 16 sub-blocks -> [B, 84]."""
    q = _blocks(q, QK_K)
    out = np.empty((q.shape[0], 84), dtype=np.uint8)
    out[:, 0:16] = np.uint8((sc & 0xF) | ((m & 0xF) << 4))
    out[:, 16:80] = pack_2bit(q)
    out[:, 80:82] = _fp16_bytes(d16)
    out[:, 82:84] = _fp16_bytes(dmin16)
    return out


def q2_k_unpack(b: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """[B, 84] -> (q uint8 [B, 256], d16 [B], dmin16 [B], sc [B, 16], m [B, 16])."""
    b = _blocks(b, 84)
    return (unpack_2bit(b[:, 16:80]), _fp16_of(b[:, 80:82]), _fp16_of(b[:, 82:84]), b[:, 0:16] & 0xF,
            b[:, 0:16] >> 4)


# ----------------------------------------------------------------------------- TQ2_0
def tq2_0_pack(t: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """t (0..2; 3 would decode to 2d) [B, 256], d16 [B] -> [B, 66]."""
    t = _blocks(t, QK_K)
    out = np.empty((t.shape[0], 66), dtype=np.uint8)
    out[:, 0:64] = pack_2bit(t)
    out[:, 64:66] = _fp16_bytes(d16)
    return out


def tq2_0_unpack(b: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    b = _blocks(b, 66)
    return unpack_2bit(b[:, 0:64]), _fp16_of(b[:, 64:66])


# ----------------------------------------------------------------------------- TQ1_0
def _trits_to_byte(t: np.ndarray) -> np.ndarray:
    """t uint8 [..., 5] (t0 most significant) -> ceil(256 v / 243)."""
    v = np.zeros(t.shape[:-1], dtype=np.uint16)
    for n in range(5):
        v = v * 3 + t[..., n].astype(np.uint16)
    return ((v * 256 + 242) // 243).astype(np.uint8)


def _byte_to_trits(b: np.ndarray, n: int) -> np.ndarray:
    """b uint8 [...] -> [..., n] trits (0..2), trit k = ((b * 3^k) mod 256) * 3 >> 8."""
    prod = (b[..., None].astype(np.uint16) * _POW3[:n]) & 0xFF
    return ((prod * 3) >> 8).astype(np.uint8)


def tq1_0_pack(t: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """t (0..2) [B, 256], d16 [B] -> [B, 54]."""
    t = _blocks(t, QK_K).astype(np.uint8)
    B = t.shape[0]
    out = np.empty((B, 54), dtype=np.uint8)
    a = t[:, 0:160].reshape(B, 5, 32).transpose(0, 2, 1)          # [B, m, n]
    out[:, 0:32] = _trits_to_byte(a)
    c = t[:, 160:240].reshape(B, 5, 16).transpose(0, 2, 1)
    out[:, 32:48] = _trits_to_byte(c)
    h = t[:, 240:256].reshape(B, 4, 4).transpose(0, 2, 1)         # [B, j, n], n = 0..3
    out[:, 48:52] = _trits_to_byte(np.concatenate([h, np.zeros((B, 4, 1), np.uint8)], axis=-1))
    out[:, 52:54] = _fp16_bytes(d16)
    return out


def tq1_0_unpack(b: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    b = _blocks(b, 54)
    B = b.shape[0]
    a = _byte_to_trits(b[:, 0:32], 5).transpose(0, 2, 1).reshape(B, 160)
    c = _byte_to_trits(b[:, 32:48], 5).transpose(0, 2, 1).reshape(B, 80)
    h = _byte_to_trits(b[:, 48:52], 4).transpose(0, 2, 1).reshape(B, 16)
    return np.concatenate([a, c, h], axis=1), _fp16_of(b[:, 52:54])
