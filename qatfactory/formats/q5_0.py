"""Q5_0: llama.cpp / ggml 5-bit blocks (GGML_TYPE_Q5_0 = 6), bit-exact with libggml.

Layout (``block_q5_0`` in ggml ``ggml-common.h``), 22 bytes per 32 weights (5.5 bpw)::

    offset 0        2                 6                          22
           +--------+-----------------+--------------------------+
           | d fp16 | qh: uint32 LE   | qs[16]                   |
           |        | bit j = q[j]>>4 | byte j = q[j] & 0xF      |
           |        |                 |        | (q[j+16] & 0xF) << 4
           +--------+-----------------+--------------------------+
    weight j of the block = (q[j] - 16) * fp32(d)     (dequantize_row_q5_0; exact in fp32)

Source followed: ggml ``ggml-quants.c`` ``quantize_row_q5_0_ref``, ``quantize_q5_0`` /
``quantize_row_q5_0_impl`` (imatrix), ``make_qx_quants`` and ``dequantize_row_q5_0``,
checked byte for byte against the libggml-python 0.20.2 wheel (ggml 0.20.2), which is the
oracle: where a newer llama.cpp differs, the oracle's bytes win.
The rules were read from ggml-org/ggml master (d99724f2, late 2026); they produced the
oracle's bytes in every test, so no difference between the two versions is known.

Without imatrix (``quantize_row_q5_0_ref``), float32, per block of 32:

1. ``max`` = signed value of the first largest |x| (strict ``<`` scan);
   ``d = max / -16``; ``id = d ? 1/d : 0``; ``d`` is stored as fp16 (RNE) but the elements
   use the unrounded ``id``.
2. ``q = min(31, (int8)(x*id + 16.5f))`` -- float32 add, then truncation toward zero
   (so the block max lands on q = 0, i.e. level -16, and the other side saturates at 15).

With imatrix (``quantize_row_q5_0_impl``, what llama-quantize runs for Q4_K rows whose
length is not a multiple of 256):

1. per row: ``sigma2 = (sum_j x_j^2) / n_per_row`` (sequential float32 sum over the row).
2. per block: ``w_j = imatrix_j * sqrtf(sigma2 + x_j^2)``;
   ``d = make_qx_quants(32, 16, x, L, rmse_type=1, w)`` (see ``q6_k.py``), q = L directly
   (no re-quantization against the fp16 ``d``); ``d`` stored as fp16.

Rows whose length is not a multiple of 32 are written as F16 by llama-quantize.

``PackedTensor`` produced here:

* ``codes``: uint8 ``[..., K]`` -- the stored 5-bit values q (0..31); the level is q - 16.
* ``scales``: float16 ``[..., K/32]`` -- the block scale ``d`` as stored (negative when the
  block's largest-magnitude value is positive: ggml maps the max to level -16).
* ``extra``: empty; ``global_scale``: None.

Training hooks: ``quantize(x, scales=d16)`` uses the given fp16 block scales and the
reference element rule with ``id = 1/d`` (clamped to 0..31). NaN / Inf inputs are refused.
Finite inputs whose fp16 scale overflows (block max above about 1.05e6) store an Inf
scale exactly as ggml does (tested); decoding such a block gives +-Inf / NaN, as in C.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .kquant_common import fp16_round, fp16_round_np, seq_sum, sqrt_f32, tdiv
from .layouts import GGMLType, GGUFLayout, LlamaFileType, ScaleRule
from .q6_k import imatrix_arg, make_qx_quants, make_qx_quants_np
from .q8_0 import CheckedInput, as_float32, fp16_scales_arg, no_amax
from .spec import Format, FormatSpec, PackedTensor, register

QK = 32
BLOCK_BYTES = 22
_BIT = np.arange(QK, dtype=np.uint32)


def _pack_np(q: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """q uint8 [B, 32] (0..31), d16 float16 [B] -> [B, 22]."""
    b = q.shape[0]
    q = q.astype(np.uint8)
    qh = (((q >> 4) & 1).astype(np.uint32) << _BIT).sum(axis=1, dtype=np.uint32)  # disjoint bits
    out = np.empty((b, BLOCK_BYTES), dtype=np.uint8)
    out[:, 0:2] = d16.astype(np.float16).view(np.uint8).reshape(b, 2)
    out[:, 2:6] = qh.astype("<u4").view(np.uint8).reshape(b, 4)
    out[:, 6:22] = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
    return out


def _unpack_np(blk: np.ndarray):
    b = blk.shape[0]
    d = blk[:, 0:2].copy().view(np.float16).reshape(b)
    qh = blk[:, 2:6].copy().view("<u4").reshape(b, 1)
    hi = ((qh >> _BIT) & 1).astype(np.uint8)
    qs = blk[:, 6:22]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1) | (hi << 4)
    return q, d


SPEC = FormatSpec(
    name="q5_0",
    engine="llama.cpp/ggml quantize_row_q5_0_ref / quantize_row_q5_0_impl "
           "(oracle: libggml-python 0.20.2 = ggml 0.20.2)",
    element="int5",
    block_size=32,
    super_block=32,
    bytes_per_block=BLOCK_BYTES,
    scale_codec="fp16",
    scale_rule=ScaleRule.Q5_0,
    tie_rule="trunc(x*id + 16.5) (half up) ; imatrix path: rne (nearest_int)",
    global_scale=None,
    nibble_order="split_halves (qs byte j = q[j] | q[j+16] << 4) + qh bit j = q[j] >> 4",
    oracle="libggml ggml_quantize_chunk / quantize_row_q5_0_ref; gguf.quants.dequantize",
    gguf=GGUFLayout(GGMLType.Q5_0, file_type=LlamaFileType.MOSTLY_Q5_0),
    fallback="F16 (llama-quantize keeps rows whose length is not a multiple of 32 in F16)",
    role="weight",
    symmetric=True,
    notes="llama-quantize's fallback for Q4_K rows whose length is not a multiple of 256.",
)


class Q5_0(CheckedInput, Format):
    # -- numpy reference ------------------------------------------------------------------
    def quantize_ref(self, x: np.ndarray, imatrix=None, **kw) -> np.ndarray:
        x = self._prep_np(x)
        lead, k = x.shape[:-1], x.shape[-1]
        f32 = np.float32
        xb = x.reshape(-1, QK)
        nb = xb.shape[0]
        if imatrix is None:
            amax = np.zeros(nb, f32)
            mx = np.zeros(nb, f32)
            for j in range(QK):  # strict '<': the first largest |x| wins, with its sign
                a = np.abs(xb[:, j])
                upd = amax < a
                amax = np.where(upd, a, amax)
                mx = np.where(upd, xb[:, j], mx)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                d = (mx / f32(-16)).astype(f32)
                idv = np.where(d != 0, f32(1) / np.where(d != 0, d, f32(1)), f32(0)).astype(f32)
                v = ((xb * idv[:, None]).astype(f32) + f32(16.5)).astype(f32)
            q = np.minimum(31, np.clip(np.trunc(v), -128, 127)).astype(np.uint8)
            d16 = fp16_round_np(d)
        else:
            qw = imatrix_arg(imatrix, x.shape, self.name).reshape(-1, QK)
            rows = x.reshape(-1, k)
            sum_x2 = np.zeros(rows.shape[0], f32)
            for j in range(k):
                sum_x2 += rows[:, j] * rows[:, j]
            sigma2 = (sum_x2 / f32(k)).astype(f32)
            s2b = np.repeat(sigma2, k // QK)                              # per block
            w = (qw * np.sqrt((s2b[:, None] + xb * xb).astype(f32))).astype(f32)
            d, L = make_qx_quants_np(np.ascontiguousarray(xb.T), 16, np.ascontiguousarray(w.T))
            q = L.T.astype(np.uint8)
            d16 = fp16_round_np(d)
        return _pack_np(q, d16.astype(np.float16)).reshape(*lead, k // QK * BLOCK_BYTES)

    def dequantize_ref(self, b: np.ndarray, k: Optional[int] = None) -> np.ndarray:
        b = np.ascontiguousarray(b, dtype=np.uint8)
        lead = b.shape[:-1]
        q, d = _unpack_np(b.reshape(-1, BLOCK_BYTES))
        with np.errstate(invalid="ignore"):  # an Inf scale (fp16 overflow) decodes 0 to NaN, as in C
            v = (q.astype(np.float32) - np.float32(16)) * d.astype(np.float32)[:, None]
        return v.reshape(*lead, b.shape[-1] // BLOCK_BYTES * QK).astype(np.float32)

    # -- torch emulator --------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, imatrix=None, scales=None, amax=None, **kw) -> PackedTensor:
        if kw:
            raise TypeError(f"{self.name}.quantize: unexpected arguments {sorted(kw)}; "
                            f"allowed: imatrix, scales, amax=None")
        no_amax(self.name, amax)
        x = self._prep(x)
        shape = tuple(x.shape)
        k = shape[-1]
        nb = k // QK
        xb = x.reshape(-1, QK)
        if scales is not None and imatrix is not None:
            raise ValueError(f"{self.name}: give either scales= (frozen scales) or imatrix=, not both")
        if imatrix is None:
            if scales is None:
                mx = self._signed_absmax(xb)
                d = tdiv(mx, -16.0)
                d16 = fp16_round(d)
            else:
                d16 = fp16_scales_arg(scales, shape[:-1] + (nb,), x.device, self.name).reshape(-1)
                d = d16
            q = self._levels(xb, d).clamp_(0, 31)
        else:
            im = imatrix_arg(imatrix, shape, self.name, x.device)
            rows = x.reshape(-1, k)
            x2 = rows * rows
            sum_x2 = seq_sum(x2.t().contiguous(), from_zero=True)  # sequential over the row, as in C
            sigma2 = tdiv(sum_x2, float(k))
            # w = imatrix * sqrtf(sigma2 + x^2), in row layout (sigma2 one value per row);
            # sqrt_f32: C sqrtf is correctly rounded, torch's CPU float32 sqrt is not
            w = sqrt_f32(x2.add_(sigma2.unsqueeze(1))).mul_(im.reshape(rows.shape))
            d, L = make_qx_quants(xb.t(), 16, w.reshape(-1, QK).t())
            q = L.t()
            d16 = fp16_round(d)
        return PackedTensor(self.name, shape, q.to(torch.uint8).reshape(shape),
                            d16.to(torch.float16).reshape(*shape[:-1], nb))

    @staticmethod
    def _signed_absmax(xb: torch.Tensor) -> torch.Tensor:
        """Signed value at the first position of the largest |x| (ggml's strict '<' scan)."""
        a = xb.abs()
        amax = a.amax(dim=1, keepdim=True)
        first = (a == amax).int().argmax(dim=1, keepdim=True)
        # C starts from max = +0.0f and never updates it when every |x| is 0, so an all -0.0
        # block gives d = +0/-16 = -0.0 (fp16 0x8000), not the -0.0 element itself
        return torch.where(amax.squeeze(1) == 0, torch.zeros_like(amax.squeeze(1)), xb.gather(1, first).squeeze(1))

    @staticmethod
    def _levels(xb: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """(int)(x*id + 16.5f) with id = d ? 1/d : 0, before the clamp to 0..31."""
        nz = d != 0
        id_ = torch.where(nz, tdiv(1.0, torch.where(nz, d, torch.ones_like(d))), torch.zeros_like(d))
        # the clamp only guards the int cast for supplied scales; -1 / 32 still read as clipped
        return torch.trunc(xb * id_.unsqueeze(1) + 16.5).clamp_(-1, 32).to(torch.int32)

    def searches_scales(self, imatrix: bool) -> bool:
        return imatrix       # make_qx_quants with an imatrix; without one d = max / -16, no search

    def scale_kwargs(self, p: PackedTensor):
        return {"scales": p.scales}

    def dequantize(self, p: PackedTensor) -> torch.Tensor:
        q = p.codes.reshape(-1, QK).float() - 16
        return (q * p.scales.reshape(-1, 1).float()).reshape(p.shape)

    def clip_mask(self, x: torch.Tensor, p: PackedTensor) -> torch.Tensor:
        x = as_float32(x, self.name)
        v = self._levels(x.reshape(-1, QK), p.scales.to(x.device).reshape(-1).float())
        return ((v >= 0) & (v <= 31)).reshape(p.shape)

    def to_bytes(self, p: PackedTensor) -> np.ndarray:
        lead = p.shape[:-1]
        q = p.codes.detach().cpu().numpy().astype(np.uint8).reshape(-1, QK)
        d = p.scales.detach().cpu().to(torch.float16).numpy().reshape(-1)
        return _pack_np(q, d).reshape(*lead, p.shape[-1] // QK * BLOCK_BYTES)

    def from_bytes(self, b, k: Optional[int] = None) -> PackedTensor:
        bn = b.detach().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
        if bn.dtype != np.uint8 or bn.ndim < 1 or bn.shape[-1] % BLOCK_BYTES:
            raise ValueError(f"{self.name}: from_bytes expects uint8 [..., n*{BLOCK_BYTES}], "
                             f"got {bn.dtype} {tuple(bn.shape)}")
        nb = bn.shape[-1] // BLOCK_BYTES
        if k is not None and k != nb * QK:
            raise ValueError(f"{self.name}: K={k} does not match {bn.shape[-1]} bytes per row "
                             f"({nb} blocks of {QK})")
        lead = bn.shape[:-1]
        q, d = _unpack_np(np.ascontiguousarray(bn).reshape(-1, BLOCK_BYTES))
        shape = tuple(lead) + (nb * QK,)
        return PackedTensor(self.name, shape, torch.from_numpy(q.reshape(shape).copy()),
                            torch.from_numpy(d.reshape(*lead, nb).copy()))


Q5_0_FORMAT = register(Q5_0(SPEC))
