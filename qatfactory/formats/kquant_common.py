"""Helpers shared by the ggml k-quant formats (q4_k, q5_k, q6_k, ...): numpy and torch twins.

What they reproduce (llama.cpp ``ggml/src/ggml-quants.c``, ``ggml-impl.h``):

* ``nearest_int(f)``: ggml adds 1.5*2^23 in float32 and reads the low 23 mantissa bits,
  i.e. round-half-to-even for |f| <= 4194303. Outside that range the C result is a
  deterministic bit pattern (the reference asserts are compiled out), reproduced here
  exactly so that degenerate blocks still match the engine.
* fp16 conversion: IEEE round-to-nearest-even, overflow to Inf (``GGML_FP32_TO_FP16``).
* 6-bit scale/min packing of q4_k / q5_k (``get_scale_min_k4``), 12 bytes per 8 pairs:

      byte k   (k=0..3) = ls[k] | (ls[k+4] >> 4) << 6
      byte k+4 (k=0..3) = lm[k] | (lm[k+4] >> 4) << 6
      byte k+8 (k=0..3) = (ls[k+4] & 0xF) | (lm[k+4] & 0xF) << 4

* sequential float32 sums: the C loops add one element at a time; ``np.sum`` and
  ``torch.sum`` sum pairwise / in vector lanes and round differently. The helpers here
  reduce over the *first* axis (element index first, blocks along the rest) so that each
  step is one vectorised add across all blocks.

Division note: on CUDA ``tensor / python_scalar`` is computed as a multiply by the
reciprocal (one ulp off at times) and torch's ``scalar / tensor`` goes through
``reciprocal()``; :func:`tdiv` always divides two device tensors, which is IEEE
division on CPU and CUDA. Likewise torch's CPU float32 ``sqrt`` is not always correctly
rounded; :func:`sqrt_f32` is.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

_MAGIC = 12582912.0  # 1.5 * 2^23


# ----------------------------------------------------------------------------- numpy
def nearest_int_np(f: np.ndarray) -> np.ndarray:
    """ggml nearest_int on float32, bit for bit (int32), including out-of-range inputs."""
    v = (np.asarray(f, dtype=np.float32) + np.float32(_MAGIC)).astype(np.float32)
    return (v.view(np.int32) & np.int32(0x007FFFFF)) - np.int32(0x00400000)


def fp16_round_np(v: np.ndarray) -> np.ndarray:
    """float32 -> nearest fp16 (RNE, overflow -> Inf) -> float32."""
    with np.errstate(over="ignore"):
        return np.asarray(v, dtype=np.float32).astype(np.float16).astype(np.float32)


def seq_sum_np(a: np.ndarray) -> np.ndarray:
    """Sum over axis 0, one element at a time, in float32 (the C loop order)."""
    acc = a[0].astype(np.float32, copy=True)
    for i in range(1, a.shape[0]):
        acc += a[i]
    return acc


def pack_scale_min_k4_np(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """ls, lm uint8 [..., 8] (6-bit values) -> the 12 packed bytes [..., 12]."""
    ls = np.asarray(ls, dtype=np.uint8)
    lm = np.asarray(lm, dtype=np.uint8)
    out = np.empty(ls.shape[:-1] + (12,), dtype=np.uint8)
    out[..., 0:4] = (ls[..., 0:4] & 63) | ((ls[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (lm[..., 0:4] & 63) | ((lm[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (ls[..., 4:8] & 0xF) | ((lm[..., 4:8] & 0xF) << 4)
    return out


def unpack_scale_min_k4_np(b: np.ndarray):
    """[..., 12] bytes -> (ls, lm) uint8 [..., 8] (``get_scale_min_k4`` for j = 0..7)."""
    b = np.asarray(b, dtype=np.uint8)
    ls = np.empty(b.shape[:-1] + (8,), dtype=np.uint8)
    lm = np.empty_like(ls)
    ls[..., 0:4] = b[..., 0:4] & 63
    lm[..., 0:4] = b[..., 4:8] & 63
    ls[..., 4:8] = (b[..., 8:12] & 0xF) | ((b[..., 0:4] >> 6) << 4)
    lm[..., 4:8] = (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)
    return ls, lm


# ----------------------------------------------------------------------------- torch
def nearest_int(f: torch.Tensor) -> torch.Tensor:
    """torch twin of :func:`nearest_int_np` (float32 in, int32 out)."""
    v = f.float() + _MAGIC
    return (v.view(torch.int32) & 0x007FFFFF) - 0x00400000


def fp16_round(v: torch.Tensor) -> torch.Tensor:
    return v.float().half().float()


_ZERO_INDEX: dict = {}


def _zero_index(n: int) -> torch.Tensor:
    idx = _ZERO_INDEX.get(n)
    if idx is None:
        idx = _ZERO_INDEX[n] = torch.zeros(n, dtype=torch.int32)
    return idx


def seq_sum(a: torch.Tensor, from_zero: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum over dim 0, one element at a time (float32, C loop order): ``a[0] + a[1] + ...``, or
    ``((0 + a[0]) + a[1]) + ...`` with ``from_zero`` (the C loops that start from ``sum = 0``;
    the two differ only in the sign of an all-zero sum).

    CPU: one ``index_add_`` with an int32 index of zeros. ATen runs it as the loop it documents
    ("adding to the indices in the order given in index"): for i = 0, 1, ... one call of the add
    kernel of ``add_`` on the whole slice, so the same float32 adds in the same order as the
    Python loop, without a Python dispatch per element. (An int64 index would take ATen's
    scatter_add_ path instead, hence int32.) Elsewhere (CUDA's index_add_ uses atomics, whose
    order is not fixed) the Python loop. ``out`` (shape a.shape[1:], any strides) receives the
    sum in place of a new tensor."""
    n = a.shape[0]
    if out is None:
        out = torch.empty(a.shape[1:], dtype=a.dtype, device=a.device)
    if from_zero:
        out.zero_()
    else:
        out.copy_(a[0])
    first = 0 if from_zero else 1
    if a.device.type == "cpu" and a.dtype == torch.float32:
        if n > first:
            out.unsqueeze(0).index_add_(0, _zero_index(n - first), a[first:])
        return out
    for i in range(first, n):
        out.add_(a[i])
    return out


def sqrt_f32(a: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 sqrt (C ``sqrtf``). torch's CPU float32 sqrt is not always
    correctly rounded (MKL/SLEEF paths); sqrt in float64 then one rounding is exact."""
    return torch.sqrt(a.double()).float()


def tdiv(a, b) -> torch.Tensor:
    """IEEE a / b where either side may be a Python number (see the module note)."""
    if not isinstance(a, torch.Tensor):
        a = torch.full((), a, dtype=torch.float32, device=b.device)
    if not isinstance(b, torch.Tensor):
        b = torch.full((), b, dtype=torch.float32, device=a.device)
    return torch.div(a, b)


def select_mask(m: torch.Tensor) -> torch.Tensor:
    """A bool mask as the int32 bit mask of :func:`select` (-1 where True, 0 where False)."""
    return m.to(torch.int32).neg_()


def select(mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.where(m, a, b)`` for float32 a, b, bit for bit (NaN payloads and -0.0 included):
    ``((a ^ b) & mask) ^ b`` on the int32 views, with ``mask = select_mask(m)``. On CPU torch's
    ``where`` runs element by element (~3 ns per element here, 30x a vectorised add); the three
    integer ops are vectorised. Shapes broadcast as in ``where``."""
    ai = a.view(torch.int32)
    bi = b.view(torch.int32)
    return torch.bitwise_xor(ai, bi).bitwise_and_(mask).bitwise_xor_(bi).view(torch.float32)


def pack_scale_min_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    ls = ls.to(torch.uint8)
    lm = lm.to(torch.uint8)
    return torch.cat([(ls[..., 0:4] & 63) | ((ls[..., 4:8] >> 4) << 6),
                      (lm[..., 0:4] & 63) | ((lm[..., 4:8] >> 4) << 6),
                      (ls[..., 4:8] & 0xF) | ((lm[..., 4:8] & 0xF) << 4)], dim=-1)


def unpack_scale_min_k4(b: torch.Tensor):
    b = b.to(torch.uint8)
    ls = torch.cat([b[..., 0:4] & 63, (b[..., 8:12] & 0xF) | ((b[..., 0:4] >> 6) << 4)], dim=-1)
    lm = torch.cat([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], dim=-1)
    return ls, lm
