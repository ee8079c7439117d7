"""Q6_K: llama.cpp / ggml 6-bit k-quant (GGML_TYPE_Q6_K = 14), bit-exact with libggml.

Layout (``block_q6_K`` in ggml ``ggml-common.h``), 210 bytes per 256 weights (6.5625 bpw)::

    offset 0                 128              192                208      210
           +-----------------+----------------+------------------+--------+
           | ql[128]         | qh[64]         | scales[16] int8  | d fp16 |
           | low 4 bits      | high 2 bits    | one per 16       | super  |
           +-----------------+----------------+------------------+--------+

    6-bit stored value q (0..63) of weight e, with h = e // 128 (half), r = e % 128,
    quarter t = r // 32, lane l = r % 32:
        ql[64h + l + 32*(t & 1)]  nibble (t >> 1)    = q & 0xF   (t=0,1 low, t=2,3 high)
        qh[32h + l]               bits 2t .. 2t+1    = q >> 4
    sub-block s = e // 16 owns scales[s].
    weight e = (fp32(d) * scales[s]) * (q - 32)  -- two float32 products, in this order
                                                    (dequantize_row_q6_K)

Source followed: ggml ``ggml-quants.c`` ``make_qx_quants``, ``quantize_row_q6_K_ref``,
``quantize_row_q6_K_impl`` / ``quantize_q6_K`` (imatrix) and ``dequantize_row_q6_K``,
checked byte for byte against the libggml-python 0.20.2 wheel (ggml 0.20.2), which is
the oracle: where a newer llama.cpp differs, the oracle's bytes win.
The rules were read from ggml-org/ggml master (d99724f2, late 2026); they produced the
oracle's bytes in every test, so no difference between the two versions is known.

Quantization (float32, sums strictly sequential, ``nearest_int`` = ggml's 1.5*2^23 trick,
true divisions; the x86 build has no FMA, so every product and sum is rounded):

1. per 16-weight sub-block: ``scale_s = make_qx_quants(n=16, nmax=32, x, rmse_type=1, w)``
   with ``w = x*x`` (no imatrix) or ``w = imatrix`` (the raw per-column importance; the
   ``sigma2`` weighting seen in q5_0 is commented out in ggml's q6_K).  make_qx_quants:
   ``max`` = signed value of the first largest |x|; if ``amax < 1e-15`` -> L = 0, scale 0.
   ``iscale = -32/max``; ``l = clamp(nearest_int(iscale*x), -32, 31)``;
   ``sumlx += (w*x)*l``, ``suml2 += (w*l)*l``; ``scale = sumlx/suml2``; ``best = scale*sumlx``;
   then for is = -9..9 (not 0): ``iscale = -(32 + 0.1f*is)/max``, same sums, accept when
   ``suml2 > 0 && sumlx*sumlx > best*suml2`` (strict, first wins ties).
2. ``max_scale`` = signed scale with the largest |scale| (strict ``>``). If its magnitude is
   < 1e-15 the whole block is zero bytes.
3. ``iscale = -128/max_scale``; ``d = fp16(1/iscale)``;
   ``scales[s] = (int8) min(127, nearest_int(iscale*scale_s))``.
4. re-quantize with the stored values: ``ds = fp32(d)*scales[s]``; if ``ds == 0`` the levels
   from step 1 are kept (a quirk that matters for zero sub-blocks and for d underflowing
   fp16); else ``q = clamp(nearest_int(x/ds), -32, 31) + 32``.

Row lengths that are not a multiple of 256: llama-quantize falls back to Q8_0 (and to F16
when the row is not a multiple of 32 either).

``PackedTensor`` produced here:

* ``codes``: uint8 ``[..., K]`` -- the stored 6-bit values q (0..63); the level is q - 32.
* ``scales``: int8 ``[..., K/16]`` -- the sub-block scales as stored.
* ``extra["d"]``: float16 ``[..., K/256]`` -- the super-block scale.

Training hooks: ``quantize(x, scales=int8 [..., K/16], d=fp16 [..., K/256])`` skips steps
1-3 and quantizes the elements against the given scales (step 4; sub-blocks whose
``ds == 0`` get level 0, i.e. q = 32). NaN / Inf inputs are refused.
Finite inputs whose fp16 scale overflows (block max above about 2.7e8) store an Inf
scale exactly as ggml does (tested); decoding such a block gives +-Inf / NaN, as in C.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from .kquant_common import fp16_round, fp16_round_np, nearest_int, nearest_int_np, select, select_mask, seq_sum, tdiv
from .layouts import GGMLType, GGUFLayout, LlamaFileType, ScaleRule
from .q8_0 import CheckedInput, as_float32, no_amax
from .spec import Format, FormatSpec, PackedTensor, register

QK_K = 256
SUB = 16
BLOCK_BYTES = 210
GROUP_MAX_EPS = np.float32(1e-15)


# ----------------------------------------------------------------------------- make_qx_quants
def make_qx_quants_np(x: np.ndarray, nmax: int, w: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """ggml ``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)`` over many groups at once.

    x, w: float32 ``[n, G]`` (element index first, so each C loop step is one vector op).
    Returns (scale float32 [G], L int32 [n, G] stored values 0..2*nmax-1)."""
    n, g = x.shape
    f32 = np.float32
    ax = np.abs(x)
    amax = np.zeros(g, f32)
    mx = np.zeros(g, f32)
    for i in range(n):  # strict '>': the first largest |x| wins, with its sign
        upd = ax[i] > amax
        amax = np.where(upd, ax[i], amax)
        mx = np.where(upd, x[i], mx)
    zero = amax < GROUP_MAX_EPS
    mxs = np.where(zero, f32(1), mx)
    if w is None:
        w = x * x
    wx = w * x

    def levels(iscale):
        return np.clip(nearest_int_np(iscale[None, :] * x), -nmax, nmax - 1)

    def sums(l):
        lf = l.astype(f32)
        sumlx = np.zeros(g, f32)
        suml2 = np.zeros(g, f32)
        for i in range(n):
            sumlx += wx[i] * lf[i]
            suml2 += (w[i] * lf[i]) * lf[i]
        return sumlx, suml2

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = (f32(-nmax) / mxs).astype(f32)
        L = levels(iscale)
        sumlx, suml2 = sums(L)
        scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, f32(1)), f32(0)).astype(f32)
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            c = f32(-(f32(nmax) + f32(0.1) * f32(step)))
            iscale = (c / mxs).astype(f32)
            l = levels(iscale)
            slx, sl2 = sums(l)
            acc = (sl2 > 0) & (slx * slx > best * sl2)
            L = np.where(acc[None, :], l, L)
            scale = np.where(acc, slx / np.where(sl2 != 0, sl2, f32(1)), scale).astype(f32)
            best = np.where(acc, scale * slx, best).astype(f32)
    L = np.where(zero[None, :], 0, L + nmax).astype(np.int32)
    scale = np.where(zero, f32(0), scale).astype(f32)
    return scale, L


def _qx_numerators(nmax: int):
    """The iscale numerators of make_qx_quants, in the C order: the first guess -nmax, then
    -(nmax + 0.1f*is) for is = -9..9 without 0, each op rounded to float32."""
    f = np.float32
    return [float(-nmax)] + [float(f(-(f(nmax) + f(0.1) * f(s)))) for s in range(-9, 10) if s]


# The candidate search runs on [n, cands, cols] pieces: `cols` groups side by side (the contiguous
# inner dimension of every op: long enough for torch's vector loops) times `cands` of the 19
# candidates, so that the pieces (three of them) stay in L2; CUDA is launch-bound and takes large
# passes. Any split gives the same bits: each (group, candidate) pair is computed on its own.
QX_COLS_CPU = 1024
QX_CANDS_CPU = 4
QX_COLS_CUDA = 1 << 16


def _signed_absmax(x: torch.Tensor):
    """Per column of x [n, m]: the signed value of the first largest |x| (the C scan with its strict
    '>' from 0), and whether the column is a zero group (largest |x| < 1e-15; its max is never
    read). From max and min: the largest |x| is max or -min, and only when both are (+a and -a
    both occur) does the order decide: there the first position of each settles it."""
    hi = x.amax(0)
    lo = x.amin(0)
    neg = -lo
    zero = torch.maximum(hi, neg) < float(GROUP_MAX_EPS)
    mx = select(select_mask(hi >= neg), hi, lo)
    tie = (hi == neg) & ~zero
    if bool(tie.any()):
        cols = tie.nonzero().squeeze(1)
        xt = x.index_select(1, cols)
        at = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
        past = torch.full_like(at, x.shape[0])
        first_pos = torch.where(xt == hi[cols], at, past).amin(0)
        first_neg = torch.where(xt == lo[cols], at, past).amin(0)
        mx = mx.index_copy(0, cols, torch.where(first_pos < first_neg, hi[cols], lo[cols]))
    return mx, zero


# The candidate search runs on [n, cands, cols] pieces: `cols` groups side by side (the contiguous
# inner dimension of every op: long enough for torch's vector loops) times `cands` of the 19
# candidates, so that the pieces (three of them) stay in L2; CUDA is launch-bound and takes large
# passes. Any split gives the same bits: each (group, candidate) pair is computed on its own.
QX_COLS_CPU = 1024
QX_CANDS_CPU = 4
QX_COLS_CUDA = 1 << 16


def make_qx_quants(x: torch.Tensor, nmax: int, w: Optional[torch.Tensor] = None):
    """torch twin of :func:`make_qx_quants_np` (x, w float32 [n, G] on any device, any strides;
    the transposed view of a contiguous [G, n] tensor is the fast case).

    The 19 candidates of the C loop are independent of each other (each has its own iscale from
    the same max), only their acceptance is sequential. So the levels and the two sums of the
    candidates are formed side by side (each element the same float32 product and rounding as the
    C loop; each sum one add per element, in element order, from +0), then the acceptance runs
    over the [19, G] sums in the C order. The winner's levels are formed again from its iscale
    (the same product and rounding), not kept per candidate. L comes back as the transposed view
    of a contiguous [G, n] tensor."""
    n, g = x.shape
    dev = x.device
    nums = torch.tensor(_qx_numerators(nmax), dtype=torch.float32, device=dev)
    nc = nums.numel()
    cols = min(g, QX_COLS_CUDA if x.is_cuda else QX_COLS_CPU)
    cands = nc if x.is_cuda else min(nc, QX_CANDS_CPU)
    # per candidate, what accepting it sets: best = scale*sumlx, scale, and the iscale of its levels
    gain = torch.empty((nc, 3, g), dtype=torch.float32, device=dev)
    iscale = gain[:, 2]
    sums = torch.empty((2, nc, g), dtype=torch.float32, device=dev)     # sumlx, suml2 per candidate
    lv_buf = torch.empty(n * cands * cols, dtype=torch.float32, device=dev)
    p_buf = torch.empty(2 * n * cands * cols, dtype=torch.float32, device=dev)
    one = torch.ones((), dtype=torch.float32, device=dev)
    mx, zero = _signed_absmax(x)
    torch.div(nums.unsqueeze(1), select(select_mask(zero), one, mx).unsqueeze(0), out=iscale)  # IEEE
    for a in range(0, g, cols):
        b = min(g, a + cols)
        m = b - a
        xc = x[:, a:b].contiguous()
        wc = xc * xc if w is None else w[:, a:b].contiguous()
        isc = iscale[:, a:b]
        wx = wc * xc
        # Levels are kept as float32 integers: |iscale * x| <= |c| (|x| <= |mx|, |c| < nmax + 1) up
        # to one rounding, far inside the range where ggml's nearest_int bit trick equals
        # round-half-even, so torch.round gives the same integers without the int32 round trip.
        for k0 in range(0, nc, cands):
            k1 = min(nc, k0 + cands)
            c = k1 - k0
            lv = lv_buf[:n * c * m].view(n, c, m)
            torch.mul(isc[k0:k1].unsqueeze(0), xc.unsqueeze(1), out=lv)
            torch.round(lv, out=lv).clamp_(-nmax, nmax - 1)
            p = p_buf[:2 * n * c * m].view(n, 2, c, m)                   # p[i] contiguous
            torch.mul(wx.unsqueeze(1), lv, out=p[:, 0])                   # (w*x)*l
            torch.mul(wc.unsqueeze(1), lv, out=p[:, 1])
            p[:, 1].mul_(lv)                                              # (w*l)*l
            seq_sum(p, from_zero=True, out=sums[:, k0:k1, a:b])           # from +0, in element order
    slx, sl2 = sums[0], sums[1]
    # each candidate's sumlx / (suml2 or 1): adding (suml2 == 0) leaves every other suml2 as it is
    ratio = torch.div(slx, sl2 + (sl2 == 0).float(), out=gain[:, 1])
    # the first guess: scale = suml2 ? sumlx/suml2 : 0, best = scale*sumlx
    ratio[0] = select(select_mask(sl2[0] != 0), ratio[0], torch.zeros_like(one))
    torch.mul(ratio, slx, out=gain[:, 0])
    sq = slx * slx
    pos = sl2 > 0
    state = gain[0].clone()                                           # best, scale, iscale
    for k in range(1, nc):
        take = pos[k] & (sq[k] > state[0] * sl2[k])
        state = select(select_mask(take), gain[k], state)
    scale, isb = state[1], state[2]
    lt = torch.mul(x.t(), isb.unsqueeze(1))                           # [G, n]: the winner's levels
    torch.round(lt, out=lt).clamp_(-nmax, nmax - 1).add_(nmax)
    lt.mul_((~zero).float().unsqueeze(1))                             # small integers: exact; zero groups 0
    scale = select(select_mask(zero), torch.zeros_like(one), scale)
    return scale, lt.to(torch.int32).t()


# ----------------------------------------------------------------------------- imatrix argument
def imatrix_arg(imatrix, shape, name: str, device=None):
    """Validate an importance matrix for x of ``shape`` and broadcast it to ``shape``.

    llama-quantize passes one float per input column ([K]); 3-D expert tensors get one row
    per expert ([E, 1, K]). Any shape broadcastable to x with last dim K is accepted.
    Returns a numpy float32 array (device None) or a float32 tensor on ``device``."""
    is_t = isinstance(imatrix, torch.Tensor)
    im = imatrix if is_t else np.asarray(imatrix)
    ishape = tuple(im.shape)
    ok = len(ishape) >= 1 and ishape[-1] == shape[-1] and len(ishape) <= len(shape)
    if ok:
        try:
            ok = np.broadcast_shapes(ishape, tuple(shape)) == tuple(shape)
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(f"{name}: imatrix has shape {ishape}; expected [K={shape[-1]}] or a shape "
                         f"broadcastable to the input {tuple(shape)} with last dim K")
    if device is None:
        im = (im.detach().cpu().float().numpy() if is_t else im.astype(np.float32))
        Format.check_finite(f"{name} imatrix", im)
        return np.broadcast_to(im, tuple(shape))
    im = torch.as_tensor(im, device=device).float()
    Format.check_finite(f"{name} imatrix", im)
    return im.expand(tuple(shape))


# ----------------------------------------------------------------------------- byte layout
def _pack_np(L: np.ndarray, sc: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """L uint8 [B, 256], sc int8 [B, 16], d16 float16 [B] -> [B, 210]."""
    b = L.shape[0]
    q = L.reshape(b, 2, 4, 32).astype(np.uint8)
    ql = (q[:, :, 0:2, :] & 0xF) | ((q[:, :, 2:4, :] & 0xF) << 4)       # [B, 2, 2, 32]
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2)
          | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))        # [B, 2, 32]
    out = np.empty((b, BLOCK_BYTES), dtype=np.uint8)
    out[:, 0:128] = ql.reshape(b, 128)
    out[:, 128:192] = qh.reshape(b, 64)
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = d16.astype(np.float16).view(np.uint8).reshape(b, 2)
    return out


def _unpack_np(blk: np.ndarray):
    b = blk.shape[0]
    ql = blk[:, 0:128].reshape(b, 2, 2, 32)
    qh = blk[:, 128:192].reshape(b, 2, 1, 32)
    lo = np.concatenate([ql & 0xF, ql >> 4], axis=2)                    # quarters 0,1,2,3
    hi = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    L = (lo | (hi << 4)).reshape(b, QK_K)
    sc = blk[:, 192:208].view(np.int8)
    d = blk[:, 208:210].copy().view(np.float16).reshape(b)
    return L, sc, d


# ----------------------------------------------------------------------------- format
SPEC = FormatSpec(
    name="q6_k",
    engine="llama.cpp/ggml quantize_row_q6_K_ref / quantize_row_q6_K_impl "
           "(oracle: libggml-python 0.20.2 = ggml 0.20.2)",
    element="int6",
    block_size=16,
    super_block=256,
    bytes_per_block=BLOCK_BYTES,
    scale_codec="fp16+int8",  # int8 sub-block scales under one fp16 super-scale
    scale_rule=ScaleRule.Q6_K,
    tie_rule="rne (ggml nearest_int)",
    global_scale=None,
    nibble_order="q6_k (ql low nibbles by 32-lanes, qh 2-bit pairs)",
    oracle="libggml ggml_quantize_chunk / quantize_row_q6_K_ref; gguf.quants.dequantize",
    gguf=GGUFLayout(GGMLType.Q6_K, file_type=LlamaFileType.MOSTLY_Q6_K),
    fallback="Q8_0 (llama-quantize: rows not a multiple of 256 become Q8_0, or F16 when not a "
             "multiple of 32 either; Q4_K falls back to Q5_0 the same way)",
    role="weight",
    symmetric=True,
    notes="imatrix used as the raw make_qx_quants weights (quantize_row_q6_K_impl).",
)


class Q6_K(CheckedInput, Format):
    # -- numpy reference ------------------------------------------------------------------
    def quantize_ref(self, x: np.ndarray, imatrix=None, **kw) -> np.ndarray:
        x = self._prep_np(x)
        lead = x.shape[:-1]
        f32 = np.float32
        nsb = x.size // QK_K
        xs = x.reshape(-1, SUB).T                                        # [16, nsub]
        w = None
        if imatrix is not None:
            w = np.ascontiguousarray(imatrix_arg(imatrix, x.shape, self.name).reshape(-1, SUB).T)
        scale, L = make_qx_quants_np(np.ascontiguousarray(xs), 32, w)
        scale = scale.reshape(nsb, 16)
        L = L.T.reshape(nsb, 16, SUB)
        # the signed scale of largest magnitude (strict '>', first wins)
        max_abs = np.zeros(nsb, f32)
        max_scale = np.zeros(nsb, f32)
        for s in range(16):
            a = np.abs(scale[:, s])
            upd = a > max_abs
            max_abs = np.where(upd, a, max_abs)
            max_scale = np.where(upd, scale[:, s], max_scale)
        zero = max_abs < GROUP_MAX_EPS
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            iscale = (f32(-128) / np.where(zero, f32(1), max_scale)).astype(f32)
            d16 = fp16_round_np((f32(1) / iscale).astype(f32))
            sc = np.minimum(127, nearest_int_np(iscale[:, None] * scale)).astype(np.int8)
            ds = (d16[:, None] * sc.astype(f32)).astype(f32)             # [nsb, 16]
            xq = x.reshape(nsb, 16, SUB)
            lq = np.clip(nearest_int_np(xq / ds[:, :, None]), -32, 31) + 32
        L = np.where((ds != 0)[:, :, None], lq, L).astype(np.uint8)
        sc = np.where(zero[:, None], np.int8(0), sc)
        d16 = np.where(zero, f32(0), d16)
        L = np.where(zero[:, None, None], np.uint8(0), L)
        out = _pack_np(L.reshape(nsb, QK_K), sc, d16.astype(np.float16))
        return out.reshape(*lead, x.shape[-1] // QK_K * BLOCK_BYTES)

    def dequantize_ref(self, b: np.ndarray, k: Optional[int] = None) -> np.ndarray:
        b = np.ascontiguousarray(b, dtype=np.uint8)
        lead = b.shape[:-1]
        L, sc, d = _unpack_np(b.reshape(-1, BLOCK_BYTES))
        with np.errstate(invalid="ignore"):  # an Inf scale (fp16 overflow) decodes 0 to NaN, as in C
            ds = (d.astype(np.float32)[:, None] * sc.astype(np.float32)).astype(np.float32)
            q = L.astype(np.float32).reshape(-1, 16, SUB) - np.float32(32)
            return (ds[:, :, None] * q).reshape(*lead, b.shape[-1] // BLOCK_BYTES * QK_K).astype(np.float32)

    # -- torch emulator --------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, imatrix=None, scales=None, d=None, amax=None, **kw) -> PackedTensor:
        if kw:
            raise TypeError(f"{self.name}.quantize: unexpected arguments {sorted(kw)}; "
                            f"allowed: imatrix, scales (+ d), amax=None")
        no_amax(self.name, amax)
        x = self._prep(x)
        shape = tuple(x.shape)
        nsb = x.numel() // QK_K
        xq = x.reshape(nsb, 16, SUB)
        if (scales is None) != (d is None):
            raise ValueError(f"{self.name}: scales= (int8 [..., K/16]) and d= (fp16 [..., K/256]) "
                             f"must be given together")
        if scales is not None:
            if imatrix is not None:
                raise ValueError(f"{self.name}: give either scales= (frozen scales) or imatrix=, not both")
            sc, d16 = self._scales_arg(scales, d, shape, x.device)
            L = torch.full((nsb, 16, SUB), 32, dtype=torch.int32, device=x.device)
        else:
            w = None
            if imatrix is not None:
                im = imatrix_arg(imatrix, shape, self.name, x.device)
                w = im.reshape(-1, SUB).t()
            scale, L = make_qx_quants(x.reshape(-1, SUB).t(), 32, w)
            scale = scale.reshape(nsb, 16)
            L = L.t().reshape(nsb, 16, SUB)
            max_abs = torch.zeros(nsb, dtype=torch.float32, device=x.device)
            max_scale = torch.zeros_like(max_abs)
            for s in range(16):
                a = scale[:, s].abs()
                upd = a > max_abs
                max_abs = torch.where(upd, a, max_abs)
                max_scale = torch.where(upd, scale[:, s], max_scale)
            zero = max_abs < float(GROUP_MAX_EPS)
            iscale = tdiv(-128.0, torch.where(zero, torch.ones_like(max_scale), max_scale))
            d16 = fp16_round(tdiv(1.0, iscale))
            sc = nearest_int(iscale.unsqueeze(1) * scale).clamp_(max=127).to(torch.int8)
            zf = zero.unsqueeze(1)
            sc = torch.where(zf, torch.zeros_like(sc), sc)
            d16 = torch.where(zero, torch.zeros_like(d16), d16)
            L = torch.where(zf.unsqueeze(2), torch.zeros_like(L), L)
        ds = d16.unsqueeze(1) * sc.float()                                # [nsb, 16]
        nzd = ds != 0
        ratio = tdiv(xq, torch.where(nzd, ds, torch.ones_like(ds)).unsqueeze(2))
        # the clamp keeps supplied tiny scales inside nearest_int's valid range; the engine's
        # own scales never get near it, so its bytes are unchanged
        lq = nearest_int(ratio.clamp_(-1e6, 1e6)).clamp_(-32, 31) + 32
        L = torch.where(nzd.unsqueeze(2), lq, L)
        lead = shape[:-1]
        return PackedTensor(self.name, shape, L.to(torch.uint8).reshape(shape),
                            sc.reshape(*lead, shape[-1] // SUB),
                            extra={"d": d16.to(torch.float16).reshape(*lead, shape[-1] // QK_K)})

    def _scales_arg(self, scales, d, shape, device):
        lead, k = shape[:-1], shape[-1]
        sc = torch.as_tensor(scales, device=device)
        if sc.dtype == torch.uint8:
            sc = sc.view(torch.int8)
        if sc.dtype != torch.int8 or tuple(sc.shape) != tuple(lead) + (k // SUB,):
            raise ValueError(f"{self.name}: scales= must be int8 (or uint8 bytes) of shape "
                             f"{tuple(lead) + (k // SUB,)}, got {sc.dtype} {tuple(sc.shape)}")
        dd = torch.as_tensor(d, device=device)
        if not torch.is_floating_point(dd) or tuple(dd.shape) != tuple(lead) + (k // QK_K,):
            raise ValueError(f"{self.name}: d= must be float16 of shape {tuple(lead) + (k // QK_K,)}, "
                             f"got {dd.dtype} {tuple(dd.shape)}")
        d16 = fp16_round(dd.float())
        if not bool(torch.isfinite(d16).all()):
            raise ValueError(f"{self.name}: d= contains NaN/Inf after rounding to fp16")
        return sc.reshape(-1, 16), d16.reshape(-1)

    def dequantize(self, p: PackedTensor) -> torch.Tensor:
        nsb = p.codes.numel() // QK_K
        d = p.extra["d"].float().reshape(nsb, 1)
        ds = d * p.scales.reshape(nsb, 16).float()
        q = p.codes.reshape(nsb, 16, SUB).float() - 32
        return (ds.unsqueeze(2) * q).reshape(p.shape)

    def searches_scales(self, imatrix: bool) -> bool:
        return True          # make_qx_quants per 16-weight sub-block, with or without an imatrix

    def scale_kwargs(self, p: PackedTensor):
        return {"scales": p.scales, "d": p.extra["d"]}

    def clip_mask(self, x: torch.Tensor, p: PackedTensor) -> torch.Tensor:
        x = as_float32(x, self.name)
        nsb = p.codes.numel() // QK_K
        ds = p.extra["d"].float().to(x.device).reshape(nsb, 1) * p.scales.to(x.device).reshape(nsb, 16).float()
        nzd = ds != 0
        v = nearest_int(tdiv(x.reshape(nsb, 16, SUB),
                             torch.where(nzd, ds, torch.ones_like(ds)).unsqueeze(2)).clamp_(-1e6, 1e6))
        inside = (v >= -32) & (v <= 31)
        return (inside | ~nzd.unsqueeze(2)).reshape(p.shape)

    def to_bytes(self, p: PackedTensor) -> np.ndarray:
        lead = p.shape[:-1]
        L = p.codes.detach().cpu().numpy().astype(np.uint8).reshape(-1, QK_K)
        sc = p.scales.detach().cpu().to(torch.int8).numpy().reshape(-1, 16)
        d = p.extra["d"].detach().cpu().to(torch.float16).numpy().reshape(-1)
        return _pack_np(L, sc, d).reshape(*lead, p.shape[-1] // QK_K * BLOCK_BYTES)

    def from_bytes(self, b, k: Optional[int] = None) -> PackedTensor:
        bn = b.detach().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
        if bn.dtype != np.uint8 or bn.ndim < 1 or bn.shape[-1] % BLOCK_BYTES:
            raise ValueError(f"{self.name}: from_bytes expects uint8 [..., n*{BLOCK_BYTES}], "
                             f"got {bn.dtype} {tuple(bn.shape)}")
        nb = bn.shape[-1] // BLOCK_BYTES
        if k is not None and k != nb * QK_K:
            raise ValueError(f"{self.name}: K={k} does not match {bn.shape[-1]} bytes per row "
                             f"({nb} blocks of {QK_K})")
        lead = bn.shape[:-1]
        L, sc, d = _unpack_np(np.ascontiguousarray(bn).reshape(-1, BLOCK_BYTES))
        shape = tuple(lead) + (nb * QK_K,)
        return PackedTensor(self.name, shape, torch.from_numpy(L.reshape(shape).copy()),
                            torch.from_numpy(sc.reshape(*lead, nb * 16).copy()),
                            extra={"d": torch.from_numpy(d.reshape(*lead, nb).copy())})


Q6_K_FORMAT = register(Q6_K(SPEC))
