"""Q8_0: llama.cpp / ggml 8-bit blocks (GGML_TYPE_Q8_0 = 8), bit-exact with libggml.

Layout (``block_q8_0`` in ggml ``ggml-common.h``), 34 bytes per 32 weights (8.5 bpw)::

    offset 0        2                                   34
           +--------+-----------------------------------+
           | d fp16 | qs[0..31]  int8, one per weight    |
           +--------+-----------------------------------+
    weight j of the block = qs[j] * fp32(d)             (dequantize_row_q8_0; exact in fp32)

Source followed: ggml ``ggml-quants.c`` ``quantize_row_q8_0_ref`` / ``quantize_q8_0`` /
``dequantize_row_q8_0``, checked against the libggml-python 0.20.2 wheel (ggml 0.20.2),
which is the oracle: where a newer llama.cpp differs, the oracle's bytes win.
The rules were read from ggml-org/ggml master (d99724f2, late 2026); they produced the
oracle's bytes in every test, so no difference between the two versions is known.

Quantization (float32 throughout, per block of 32):

1. ``amax = max |x|``;  ``d = amax / 127`` (IEEE division);  ``id = d ? 1/d : 0``.
2. ``qs[j] = roundf(x[j] * id)`` -- C ``roundf``: ties *away from zero* (not RNE).
   The elements use the unrounded ``id``; only afterwards is ``d`` stored as fp16 (RNE).
3. The imatrix is ignored (``quantize_q8_0`` drops it); llama-quantize uses Q8_0 for
   tensors that must stay near lossless and as the fallback of Q6_K for rows whose
   length is not a multiple of 256. Rows not a multiple of 32 fall back to F16.

``PackedTensor`` produced here:

* ``codes``: int8 ``[..., K]`` -- the stored levels ``qs`` (-127..127).
* ``scales``: float16 ``[..., K/32]`` -- the block scale ``d`` as stored.
* ``extra``: empty; ``global_scale``: None.

Training hooks: ``quantize(x, scales=d16)`` uses the given fp16 block scales (frozen or
learned) instead of computing them; elements are then ``roundf(x / d)`` via ``id = 1/d``
and clamped to [-127, 127] (the engine never needs the clamp; supplied scales may).
NaN / Inf inputs are refused: ggml has no defined result for them.
Finite inputs whose fp16 scale overflows (block max above about 8.3e6) store an Inf
scale exactly as ggml does (tested); decoding such a block gives +-Inf / NaN, as in C.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .kquant_common import fp16_round, fp16_round_np, tdiv
from .layouts import GGMLType, GGUFLayout, LlamaFileType, ScaleRule
from .spec import Format, FormatSpec, PackedTensor, register

QK = 32
BLOCK_BYTES = 34


# ----------------------------------------------------------------------------- shared bits
def round_half_away_np(v: np.ndarray) -> np.ndarray:
    """C ``roundf`` on float32 (ties away from zero); exact for |v| < 2^23."""
    t = np.trunc(v)
    frac = v - t  # exact: t and v share the exponent range
    return t + np.sign(v) * (np.abs(frac) >= np.float32(0.5))


_BELOW_HALF = float(np.nextafter(np.float32(0.5), np.float32(0)))   # 0.5 - 2^-25


def round_half_away_(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf`` on float32, in place: trunc(v + copysign(0.5 - 2^-25, v)), exact for every
    float32 (NaN aside). For |v| < 0.5 the sum stays below 1 (at most 1 - 2^-24, exact); for
    0.5 <= |v| < 2^23 the sum's one rounding cannot cross the next integer except at the tie
    v = k + 0.5, where it lands on k + 1 (1 - 2^-25 rounds to 1, even; above 1 the spacing is at
    least 2^-23); from 2^23 on v is an integer and the sum rounds back to it. Three vectorised
    ops instead of the seven of the trunc-and-compare form."""
    return v.add_(torch.copysign(torch.full((), _BELOW_HALF, dtype=v.dtype, device=v.device), v)).trunc_()


def round_half_away(v: torch.Tensor) -> torch.Tensor:
    return round_half_away_(v.clone())


def as_float32(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(np.asarray(x))
    if not torch.is_floating_point(x):
        raise ValueError(f"{name}: expected a floating-point tensor (float32/bf16/fp16), got {x.dtype}")
    return x.float()


class CheckedInput:
    """Input handling shared by the llama.cpp companion formats: floating point, K a multiple of
    the block, finite. ``_prep`` for the torch emulator, ``_prep_np`` for the numpy reference."""

    def _prep(self, x):
        x = as_float32(x, self.name)
        self.check_input(x)
        self.check_finite(self.name, x)
        return x

    def _prep_np(self, x) -> np.ndarray:
        x = np.asarray(x)
        if x.dtype != np.float32:
            x = x.astype(np.float32)
        self.check_input(x)
        self.check_finite(self.name, x)
        return x


def fp16_scales_arg(scales, shape, device, name: str) -> torch.Tensor:
    """Validate a user-supplied per-block scale tensor -> fp16 values as float32."""
    s = torch.as_tensor(scales, device=device)
    if s.dtype == torch.uint8:  # raw little-endian fp16 bytes [..., nb*2]
        s = s.contiguous().view(torch.float16)
    if not torch.is_floating_point(s):
        raise ValueError(f"{name}: scales= must be float16 values (or their uint8 bytes), got {s.dtype}")
    if tuple(s.shape) != tuple(shape):
        raise ValueError(f"{name}: scales= has shape {tuple(s.shape)}, expected {tuple(shape)} "
                         f"(one fp16 scale per {QK}-element block)")
    s = fp16_round(s.float())
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"{name}: scales= contains NaN/Inf after rounding to fp16")
    return s


def no_amax(name: str, amax) -> None:
    if amax is not None:
        raise ValueError(f"{name}: amax= was given, but this format has no per-tensor scale "
                         f"(only per-block fp16 scales); pass amax=None")


# ----------------------------------------------------------------------------- format
SPEC = FormatSpec(
    name="q8_0",
    engine="llama.cpp/ggml quantize_row_q8_0_ref (oracle: libggml-python 0.20.2 = ggml 0.20.2)",
    element="int8",
    block_size=32,
    super_block=32,
    bytes_per_block=BLOCK_BYTES,
    scale_codec="fp16",
    scale_rule=ScaleRule.Q8_0,
    tie_rule="half_away (C roundf)",
    global_scale=None,
    nibble_order="bytes (one int8 per weight)",
    oracle="libggml ggml_quantize_chunk / quantize_row_q8_0_ref; gguf.quants.dequantize",
    gguf=GGUFLayout(GGMLType.Q8_0, file_type=LlamaFileType.MOSTLY_Q8_0),
    fallback="F16 (llama-quantize keeps rows whose length is not a multiple of 32 in F16)",
    role="weight",
    symmetric=True,
    notes="imatrix is ignored by the engine (quantize_q8_0 drops it).",
)


class Q8_0(CheckedInput, Format):
    # blocks per pass on CPU: each pass's temporaries stay near L2 size and are reused by the
    # allocator, where whole-tensor temporaries (the 49152x576 embedding: 113 MB each) cost their
    # page faults on every call
    chunk_blocks = 4096

    # -- numpy reference: the C loop, vectorised across blocks only -------------------------
    def quantize_ref(self, x: np.ndarray, imatrix=None, **kw) -> np.ndarray:
        x = self._prep_np(x)
        lead = x.shape[:-1]
        xb = x.reshape(-1, QK)
        amax = np.zeros(xb.shape[0], dtype=np.float32)
        for j in range(QK):
            amax = np.maximum(amax, np.abs(xb[:, j]))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            d = amax / np.float32(127)
            idv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0))
            idv = idv.astype(np.float32)
            q = round_half_away_np((xb * idv[:, None]).astype(np.float32))
        out = np.empty((xb.shape[0], BLOCK_BYTES), dtype=np.uint8)
        out[:, 0:2] = fp16_round_np(d).astype(np.float16).view(np.uint8).reshape(-1, 2)
        out[:, 2:] = q.astype(np.int8).view(np.uint8)
        return out.reshape(*lead, x.shape[-1] // QK * BLOCK_BYTES)

    def dequantize_ref(self, b: np.ndarray, k: Optional[int] = None) -> np.ndarray:
        b = np.ascontiguousarray(b, dtype=np.uint8)
        lead = b.shape[:-1]
        blk = b.reshape(-1, BLOCK_BYTES)
        d = blk[:, 0:2].copy().view(np.float16).astype(np.float32)
        q = blk[:, 2:].view(np.int8).astype(np.float32)
        with np.errstate(invalid="ignore"):  # an Inf scale (fp16 overflow) decodes 0 to NaN, as in C
            return (q * d).reshape(*lead, b.shape[-1] // BLOCK_BYTES * QK).astype(np.float32)

    # -- torch emulator --------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, imatrix=None, scales=None, amax=None, **kw) -> PackedTensor:
        if kw:
            raise TypeError(f"{self.name}.quantize: unexpected arguments {sorted(kw)}; "
                            f"allowed: imatrix (ignored, as the engine does), scales, amax=None")
        no_amax(self.name, amax)
        x = self._prep(x)
        shape = tuple(x.shape)
        nb = shape[-1] // QK
        xb = x.reshape(-1, QK)
        n = xb.shape[0]
        codes = torch.empty((n, QK), dtype=torch.int8, device=x.device)
        if scales is None:
            d16 = torch.empty(n, dtype=torch.float32, device=x.device)
        else:
            d16 = fp16_scales_arg(scales, shape[:-1] + (nb,), x.device, self.name).reshape(-1)
        step = n if x.is_cuda else self.chunk_blocks
        for a in range(0, n, step):
            b = min(n, a + step)
            xc = xb[a:b]
            if scales is None:
                d = tdiv(xc.abs().amax(dim=-1), 127.0)  # a max is exact in any order
                d16[a:b] = fp16_round(d)
            else:
                d = d16[a:b]
            id_ = torch.where(d != 0, tdiv(1.0, torch.where(d != 0, d, torch.ones_like(d))), torch.zeros_like(d))
            codes[a:b] = round_half_away_(xc * id_.unsqueeze(-1)).clamp_(-127, 127)
        return PackedTensor(self.name, shape, codes.reshape(shape), d16.to(torch.float16).reshape(*shape[:-1], nb))

    def dequantize(self, p: PackedTensor) -> torch.Tensor:
        q = p.codes.reshape(-1, QK)
        d = p.scales.reshape(-1, 1).float()
        if q.is_cuda:
            return (q.float() * d).reshape(p.shape)
        out = torch.empty(q.shape, dtype=torch.float32)
        for a in range(0, q.shape[0], self.chunk_blocks):
            b = a + self.chunk_blocks
            torch.mul(q[a:b].float(), d[a:b], out=out[a:b])
        return out.reshape(p.shape)

    def clip_mask(self, x: torch.Tensor, p: PackedTensor) -> torch.Tensor:
        x = as_float32(x, self.name)
        nb = p.shape[-1] // QK
        d = p.scales.float().to(x.device).unsqueeze(-1)
        id_ = torch.where(d != 0, tdiv(1.0, torch.where(d != 0, d, torch.ones_like(d))), torch.zeros_like(d))
        v = round_half_away_(x.reshape(*p.shape[:-1], nb, QK) * id_)
        return (v.abs() <= 127).reshape(p.shape)

    def to_bytes(self, p: PackedTensor) -> np.ndarray:
        nb = p.shape[-1] // QK
        d = p.scales.detach().cpu().to(torch.float16).contiguous().numpy().view(np.uint8)
        q = p.codes.detach().cpu().to(torch.int8).contiguous().numpy().view(np.uint8)
        out = np.empty(p.shape[:-1] + (nb, BLOCK_BYTES), dtype=np.uint8)
        out[..., 0:2] = d.reshape(*p.shape[:-1], nb, 2)
        out[..., 2:] = q.reshape(*p.shape[:-1], nb, QK)
        return out.reshape(*p.shape[:-1], nb * BLOCK_BYTES)

    def from_bytes(self, b, k: Optional[int] = None) -> PackedTensor:
        b = torch.as_tensor(np.asarray(b) if not isinstance(b, torch.Tensor) else b)
        if b.dtype != torch.uint8 or b.ndim < 1 or b.shape[-1] % BLOCK_BYTES:
            raise ValueError(f"{self.name}: from_bytes expects uint8 [..., n*{BLOCK_BYTES}], "
                             f"got {b.dtype} {tuple(b.shape)}")
        nb = b.shape[-1] // BLOCK_BYTES
        if k is not None and k != nb * QK:
            raise ValueError(f"{self.name}: K={k} does not match {b.shape[-1]} bytes per row "
                             f"({nb} blocks of {QK})")
        blk = b.contiguous().reshape(*b.shape[:-1], nb, BLOCK_BYTES)
        d = blk[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
        q = blk[..., 2:].contiguous().view(torch.int8)
        shape = tuple(b.shape[:-1]) + (nb * QK,)
        return PackedTensor(self.name, shape, q.reshape(shape), d)


Q8_0_FORMAT = register(Q8_0(SPEC))
