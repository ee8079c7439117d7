"""q4_k: llama.cpp / ggml ``GGML_TYPE_Q4_K`` (type 12), bit-exact, with and without imatrix.

One ``block_q4_K`` record = 256 weights of a row = 144 bytes (4.5 bits per weight)::

    offset  0         2           4                    16                                  144
            +---------+-----------+--------------------+-----------------------------------+
            | d  fp16 | dmin fp16 | scales: 12 bytes   | qs: 128 bytes, 256 x 4-bit codes  |
            +---------+-----------+--------------------+-----------------------------------+
    scales packs eight 6-bit sub-block scales ls[0..7] and eight 6-bit mins lm[0..7]:
        byte k   (k=0..3) = ls[k] | (ls[k+4] >> 4) << 6
        byte k+4 (k=0..3) = lm[k] | (lm[k+4] >> 4) << 6
        byte k+8 (k=0..3) = (ls[k+4] & 0xF) | (lm[k+4] & 0xF) << 4
    qs: for chunk c = 0..3 (64 weights = sub-blocks 2c, 2c+1), byte 32c + l =
        code[64c + l] | code[64c + 32 + l] << 4          (l = 0..31)

    decode (float32, each product rounded, no FMA):
        w[32j + l] = (fp32(d) * ls[j]) * q - (fp32(dmin) * lm[j])      q in 0..15

Encoding follows ``ggml/src/ggml-quants.c`` of llama.cpp:

* no imatrix -> ``quantize_row_q4_K_ref``: per 32-weight sub-block the weights
  ``av_x + |x|`` (av_x = sqrt(sum x^2 / 32)), ``make_qkx2_quants(nmax=15, rmin=-1,
  rdelta=0.1, nstep=20)``; the 8 scales and 8 mins quantized linearly to 6 bits against
  their maxima, ``d = fp16(max_scale/63)``, ``dmin = fp16(max_min/63)``.
* imatrix -> ``quantize_row_q4_K_impl``: weights ``qw * sqrt(sigma2 + x^2)`` with
  ``sigma2 = 2 * sum_256 x^2 / 256``, ``make_qkx3_quants(rmin=-0.9, rdelta=0.05,
  nstep=36)``, then ``make_qp_quants(8, 63)`` (grid search + coordinate descent) for the
  scales and for the mins, weighted by each sub-block's weight sum.
* both: codes re-derived from the stored values, ``q = nearest_int((x + dmin*lm)/(d*ls))``
  clamped to 0..15, except where ``d*ls == 0``: there the search's codes are kept.

Numerics that decide the last bit:
float32 everywhere, sums accumulated one element at a time in C order, true IEEE
division, ggml ``nearest_int`` (round half to even), and the ``min`` variable of
``make_qkx2/3_quants`` reused by later candidates once one is accepted.

The torch emulator runs the same steps for all sub-blocks at once ([32, n] tensors, element
index first, so each of the C loop's sequential sums is 31 vector adds); divisions go through
two device tensors and square roots through float64, because torch's ``tensor / scalar`` on
CUDA and its CPU float32 ``sqrt`` are not always correctly rounded. imatrix: one float per
column ``[K]``, or one row per expert ``[E, K]`` for x ``[E, N, K]``.

:class:`PackedTensor` content for q4_k (x of shape ``[..., K]``, K % 256 == 0):

* ``codes``  uint8 ``[..., K]``: the 4-bit codes 0..15, unpacked, in weight order
* ``scales`` uint8 ``[..., K/32, 2]``: the 6-bit ``(ls, lm)`` pair of each sub-block
* ``extra["d"]``, ``extra["dmin"]`` float16 ``[..., K/256]``: the super-block scales
* ``global_scale`` None

Training hook (``quant.kquant_refresh_every``): ``quantize(x, scales=, d=, dmin=)`` with a
PackedTensor's ``scales``/``d``/``dmin`` skips the search and runs only the last stage above on x
(``_element_codes``, the same function the search ends with); sub-blocks with ``d*ls == 0`` get code 0.
``scale_kwargs(p)`` gives those keywords. The engine never quantizes this way: a trainer that keeps
scales between searches refreshes them before anything is evaluated or exported.

Oracle: libggml-python 0.20.2.post1 (``ggml_quantize_chunk`` / ``quantize_q4_K`` /
``dequantize_row_q4_K``) and gguf 0.19 ``gguf.quants.dequantize``; tests/formats/test_q4_k.py.
Rows whose length is not a multiple of 256 are not Q4_K in llama-quantize: it falls back
to Q5_0 (F16 if K % 32 != 0); :meth:`Format.check_input` says so.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .codecs import pack_split_halves, pack_split_halves_np, unpack_split_halves, unpack_split_halves_np
from .kquant_common import (
    fp16_round,
    fp16_round_np,
    nearest_int,
    nearest_int_np,
    pack_scale_min_k4,
    pack_scale_min_k4_np,
    select,
    select_mask,
    seq_sum,
    seq_sum_np,
    sqrt_f32,
    tdiv,
    unpack_scale_min_k4,
    unpack_scale_min_k4_np,
)
from .layouts import GGMLType, GGUFLayout, LlamaFileType, ScaleRule
from .spec import Format, FormatSpec, PackedTensor, register

QK_K = 256
SUB = 32
NSUB = QK_K // SUB
BLOCK_BYTES = 144
GROUP_MAX_EPS = np.float32(1e-15)

# (rmin, rdelta, nstep) of the two searches
_QKX2 = (-1.0, 0.1, 20)   # quantize_row_q4_K_ref
_QKX3 = (-0.9, 0.05, 36)  # quantize_row_q4_K_impl (imatrix)


def _candidate_numerators(rmin: float, rdelta: float, nstep: int):
    """(rmin + rdelta*is) + nmax for is = 0..nstep, each op rounded to float32 as in C."""
    f = np.float32
    return [float(f(f(f(rmin) + f(f(rdelta) * f(i))) + f(15))) for i in range(nstep + 1)]


_NUM_QKX2 = _candidate_numerators(*_QKX2)
_NUM_QKX3 = _candidate_numerators(*_QKX3)


class _Consts:
    """Python floats as 0-dim float32 tensors, made once per device: a division by them is the
    IEEE division of two tensors (see kquant_common.tdiv) without a tensor made per call."""

    def __init__(self, values):
        self.values = tuple(values)
        self._by_dev = {}

    def get(self, dev):
        t = self._by_dev.get(dev)
        if t is None:
            t = self._by_dev[dev] = [torch.full((), v, dtype=torch.float32, device=dev) for v in self.values]
        return t


_NUM_QKX2_T = _Consts(_NUM_QKX2)
_NUM_QKX3_T = _Consts(_NUM_QKX3)
# make_qp_quants: (0.1f*is + nmax) for is = -4..4 without 0
_NUM_QP = [float(np.float32(np.float32(np.float32(0.1) * np.float32(i)) + np.float32(63)))
           for i in (-4, -3, -2, -1, 1, 2, 3, 4)]

SPEC = FormatSpec(
    name="q4_k",
    engine="llama.cpp ggml (ggml-quants.c quantize_row_q4_K_ref / quantize_row_q4_K_impl), ggml 0.20.2",
    element="uint4",
    block_size=32,
    super_block=256,
    bytes_per_block=144,
    scale_codec="fp16+6bit",
    scale_rule=ScaleRule.Q4_K,
    tie_rule="half_even_int",
    global_scale=None,
    nibble_order="q4_k",
    oracle="libggml-python 0.20.2.post1 ggml_quantize_chunk / quantize_q4_K",
    gguf=GGUFLayout(GGMLType.Q4_K, file_type=LlamaFileType.MOSTLY_Q4_K_M),
    fallback="q5_0 (llama-quantize tensor_type_fallback; f16 if K % 32 != 0)",
    role="weight",
    symmetric=False,
    notes="w = d*ls*q - dmin*lm; codes 0..15 with a per-sub-block min; imatrix optional",
)


# ============================================================================ numpy reference
def _make_qkx_np(X: np.ndarray, W: np.ndarray, v3: bool):
    """make_qkx2_quants (v3=False) / make_qkx3_quants (v3=True), nmax=15, n=32, use_mad=False,
    for every sub-block at once. X, W: float32 [32, B] (element index first).
    Returns scale [B], the_min [B] (>= 0) and L uint8 [32, B]."""
    f32 = np.float32
    n = X.shape[0]
    mn = X[0].copy()
    mx = X[0].copy()
    sum_w = W[0].copy()
    sum_x = (sum_w * X[0]).astype(f32)
    for i in range(1, n):
        mn = np.where(X[i] < mn, X[i], mn)
        mx = np.where(X[i] > mx, X[i], mx)
        sum_w = sum_w + W[i]
        sum_x = sum_x + W[i] * X[i]
    mn = np.where(mn > 0, f32(0), mn)
    degenerate = (mx <= mn) if v3 else (mx == mn)
    numerators = _NUM_QKX3 if v3 else _NUM_QKX2
    with np.errstate(all="ignore"):
        iscale = f32(15) / (mx - mn)
        scale = f32(1) / iscale
        L = np.clip(nearest_int_np(iscale * (X - mn)), 0, 15)
        Lf = L.astype(f32)
        diff = (scale * Lf + mn) - X
        best = seq_sum_np(W * (diff * diff))
        for num in numerators:
            isc = f32(num) / (mx - mn)      # mn: the best min so far (the C variable is reused)
            v = isc * (X - mn)
            if v3:
                La = np.where(v > 0, nearest_int_np(np.where(v < 15, v, f32(15))), 0)
            else:
                La = np.clip(nearest_int_np(v), 0, 15)
            Laf = La.astype(f32)
            wl = W * Laf
            sum_l = seq_sum_np(wl)
            sum_l2 = seq_sum_np(wl * Laf)
            sum_xl = seq_sum_np(wl * X)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0
            this_min = np.where(pos, f32(0), this_min)
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            d2 = (this_scale * Laf + this_min) - X
            cur = seq_sum_np(W * (d2 * d2))
            take = (D > 0) & (cur < best) & ~degenerate
            L = np.where(take, La, L)
            best = np.where(take, cur, best)
            scale = np.where(take, this_scale, scale)
            mn = np.where(take, this_min, mn)
    L = np.where(degenerate, 0, L).astype(np.uint8)
    scale = np.where(degenerate, f32(0), scale).astype(f32)
    return scale, (-mn).astype(f32), L


def _make_qp_np(V: np.ndarray, Q: np.ndarray):
    """make_qp_quants(n=8, nmax=63) for every super-block. V, Q: float32 [8, S].
    Returns (scale [S], L int32 [8, S])."""
    f32 = np.float32
    n = V.shape[0]
    mx = np.zeros(V.shape[1], dtype=f32)
    for i in range(n):
        mx = np.where(mx > V[i], mx, V[i])
    zero = mx < GROUP_MAX_EPS
    with np.errstate(all="ignore"):
        iscale = f32(63) / mx
        L = nearest_int_np(iscale * V)
        scale = f32(1) / iscale
        diff = V - scale * L.astype(f32)
        best = seq_sum_np((Q * diff) * diff)
        for num in _NUM_QP:
            isc = f32(num) / mx
            sc = f32(1) / isc
            l = np.minimum(63, nearest_int_np(isc * V)).astype(f32)
            diff = V - sc * l
            mse = seq_sum_np((Q * diff) * diff)
            better = mse < best
            best = np.where(better, mse, best)
            iscale = np.where(better, isc, iscale)
        L = np.minimum(63, nearest_int_np(iscale * V))
        Lf = L.astype(f32)
        sumlx = seq_sum_np((Q * V) * Lf)
        suml2 = seq_sum_np((Q * Lf) * Lf)
        # a sweep that changes nothing leaves the state as it was, so running all five
        # sweeps for every block equals the C loop's early exit
        for _ in range(5):
            for i in range(n):
                w = Q[i]
                li = L[i].astype(f32)
                slx = sumlx - (w * V[i]) * li
                sl2 = suml2 - (w * li) * li
                ok = (slx > 0) & (sl2 > 0)
                new = np.minimum(63, nearest_int_np((V[i] * sl2) / slx))
                newf = new.astype(f32)
                ok &= new != L[i]
                slx = slx + (w * V[i]) * newf
                sl2 = sl2 + (w * newf) * newf
                ok &= (slx * slx) * suml2 > (sumlx * sumlx) * sl2
                L[i] = np.where(ok, new, L[i])
                sumlx = np.where(ok, slx, sumlx)
                suml2 = np.where(ok, sl2, suml2)
        out = np.where(suml2 > 0, sumlx / suml2, f32(0))
    out = np.where(zero, f32(0), out).astype(f32)
    L = np.where(zero, 0, L)
    return out, L


def _quantize_rows_np(x: np.ndarray, qw: Optional[np.ndarray]):
    """x float32 [R, K]; qw float32 [R, K] or None -> (L uint8 [R, K], ls, lm uint8 [R, K/32],
    d, dmin float32 [R, K/256] (fp16-representable))."""
    # overflow to Inf and 0/0 in degenerate blocks are part of what the C code does
    with np.errstate(all="ignore"):
        return _quantize_rows_np_impl(x, qw)


def _quantize_rows_np_impl(x: np.ndarray, qw: Optional[np.ndarray]):
    f32 = np.float32
    R, K = x.shape
    S = R * K // QK_K
    B = S * NSUB
    X = np.ascontiguousarray(x.reshape(B, SUB).T)            # [32, B], B = s*8 + j
    if qw is None:
        sum_x2 = seq_sum_np(X * X)
        av_x = np.sqrt(sum_x2 / f32(32)).astype(f32)
        W = (av_x + np.abs(X)).astype(f32)
        scale, the_min, L = _make_qkx_np(X, W, v3=False)
        scale = scale.reshape(S, NSUB)
        the_min = the_min.reshape(S, NSUB)
        max_scale = np.zeros(S, f32)
        max_min = np.zeros(S, f32)
        for j in range(NSUB):   # strict '>' from 0, as the C loop
            max_scale = np.where(scale[:, j] > max_scale, scale[:, j], max_scale)
            max_min = np.where(the_min[:, j] > max_min, the_min[:, j], max_min)
        with np.errstate(all="ignore"):
            inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0)).astype(f32)
            inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0)).astype(f32)
        # the C stores nearest_int into a uint8 before MIN(63, .)
        ls = np.minimum(63, nearest_int_np(inv_scale[:, None] * scale) & 0xFF)
        lm = np.minimum(63, nearest_int_np(inv_min[:, None] * the_min) & 0xFF)
        d = fp16_round_np(max_scale / f32(63))
        dmin = fp16_round_np(max_min / f32(63))
    else:
        Q = np.ascontiguousarray(qw.reshape(B, SUB).T)
        X3 = X.reshape(SUB, S, NSUB)
        sum_x2 = np.zeros(S, f32)
        for j in range(NSUB):
            for l in range(SUB):
                sum_x2 = sum_x2 + X3[l, :, j] * X3[l, :, j]
        sigma2 = (f32(2) * sum_x2) / f32(QK_K)
        sig = np.repeat(sigma2, NSUB)                          # [B]
        W = (Q * np.sqrt(sig + X * X)).astype(f32)
        sw = seq_sum_np(W).reshape(S, NSUB)
        scale, the_min, L = _make_qkx_np(X, W, v3=True)
        d_block, Ls = _make_qp_np(np.ascontiguousarray(scale.reshape(S, NSUB).T), np.ascontiguousarray(sw.T))
        m_block, Lm = _make_qp_np(np.ascontiguousarray(the_min.reshape(S, NSUB).T), np.ascontiguousarray(sw.T))
        ls = (Ls.T & 0xFF)
        lm = (Lm.T & 0xFF)
        d = fp16_round_np(d_block)
        dmin = fp16_round_np(m_block)
    ls = ls.astype(np.uint8)
    lm = lm.astype(np.uint8)
    # re-quantize with the stored values; d*ls == 0 keeps the search's codes
    dj = (np.repeat(d, NSUB) * ls.reshape(-1).astype(f32)).astype(f32)   # [B]
    mj = (np.repeat(dmin, NSUB) * lm.reshape(-1).astype(f32)).astype(f32)
    with np.errstate(all="ignore"):
        Lq = np.clip(nearest_int_np((X + mj) / dj), 0, 15)
    L = np.where(dj != 0, Lq, L).astype(np.uint8)
    codes = L.T.reshape(R, K)
    return (codes, ls.reshape(R, K // SUB), lm.reshape(R, K // SUB),
            d.reshape(R, K // QK_K), dmin.reshape(R, K // QK_K))


def _pack_np(codes, ls, lm, d, dmin) -> np.ndarray:
    """Fields -> engine bytes [R, K/256*144]."""
    R, K = codes.shape
    S = K // QK_K
    out = np.empty((R, S, BLOCK_BYTES), dtype=np.uint8)
    out[..., 0:2] = d.astype(np.float16).view(np.uint8).reshape(R, S, 2)
    out[..., 2:4] = dmin.astype(np.float16).view(np.uint8).reshape(R, S, 2)
    out[..., 4:16] = pack_scale_min_k4_np(ls.reshape(R, S, NSUB), lm.reshape(R, S, NSUB))
    out[..., 16:] = pack_split_halves_np(codes, 64).reshape(R, S, 128)
    return out.reshape(R, S * BLOCK_BYTES)


def _unpack_np(b: np.ndarray, K: int):
    b = np.ascontiguousarray(b, dtype=np.uint8).reshape(-1, K // QK_K, BLOCK_BYTES)
    R, S = b.shape[:2]
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    dmin = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    ls, lm = unpack_scale_min_k4_np(b[..., 4:16])
    codes = unpack_split_halves_np(b[..., 16:].reshape(R, S * 128), 64)
    return codes, ls.reshape(R, -1), lm.reshape(R, -1), d, dmin


def _broadcast_imatrix(imatrix, shape, to_np: bool):
    """Validate an imatrix for x of `shape` and expand it to `shape`: [K] (one weight per
    column, shared by all rows) or shape[:-2] + [K] (one per expert of a 3-D tensor)."""
    K = shape[-1]
    im = imatrix
    ishape = tuple(im.shape)
    if ishape == (K,):
        pass
    elif len(shape) >= 2 and ishape == tuple(shape[:-2]) + (K,):
        im = im[..., None, :]
    else:
        raise ValueError(f"q4_k: imatrix shape {ishape} does not fit x of shape {tuple(shape)}; "
                         f"allowed: ({K},) or {tuple(shape[:-2]) + (K,)} (one per expert)")
    if to_np:
        im = np.asarray(im, dtype=np.float32)
        if not np.isfinite(im).all():
            raise ValueError("q4_k: imatrix contains NaN or Inf")
        return np.broadcast_to(im, shape)
    im = im.float()
    if not bool(torch.isfinite(im).all()):
        raise ValueError("q4_k: imatrix contains NaN or Inf")
    return im.expand(shape)


# ============================================================================ torch emulator
# nearest_int is plain round-half-even for |v| <= 4194303; beyond that ggml's bit trick
# yields a deterministic pattern that only the int32 path reproduces
_NI_SAFE = 4194303.0


def _exact_round(bound: torch.Tensor) -> bool:
    return bool((bound <= _NI_SAFE).all())


def _round_codes(v: torch.Tensor, out: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (float32, into `out`) of v as make_qkx2 computes them: clamp(nearest_int(v)).
    `bound` [n] is an upper bound of |v| per block (NaN/Inf where v may be NaN/Inf): when every
    block is inside the exact range of nearest_int, torch.round (RNE) is the same function and
    much cheaper (up to the sign of a zero code, which no later step can see)."""
    if _exact_round(bound):
        torch.round(v, out=out)
        return out.clamp_(0, 15)
    out.copy_(nearest_int(v).clamp_(0, 15))
    return out


def _qkx3_codes(v: torch.Tensor, out: torch.Tensor, nan_free: bool) -> torch.Tensor:
    """Codes of make_qkx3, v > 0 ? nearest_int(min(v, 15)) : 0, for any v, into `out`.

    c = clamp(v, -0.5, 15): every v <= 0.5 has code 0 and so has -0.5 (a tie, to even); c is in
    [-0.5, 15], where nearest_int is round-half-even, i.e. torch.round (which may give -0.0 for
    code 0, a sign no later step can see: see _round_codes). NaN (v = inf * 0, see _make_qkx_t)
    gets code 0 as in C (NaN > 0 is false); `nan_free` says the caller proved there is none."""
    torch.clamp(v, -0.5, 15.0, out=out).round_()
    if not nan_free:
        torch.nan_to_num(out, nan=0.0, out=out)
    return out


def _make_qkx_t(X: torch.Tensor, W: torch.Tensor, v3: bool):
    """torch twin of _make_qkx_np on [32, n] float32 tensors. Work tensors are allocated
    once and reused (out=) because the [32, n] ops dominate and are memory bound.

    The codes of the best candidate are not copied out in every step: the search keeps the
    (iscale, min) that formed them and forms them once more at the end, with the same ops
    (so the same bits). Degenerate blocks (max <= min, i.e. max == min) end as L = 0, scale 0
    and their first min whatever the search computes for them, so they search with a span of 1
    instead of 0: finite codes, which keep the exact fast paths open for the whole pass."""
    n = X.shape[1]
    dev = X.device
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    xlo = X.amin(0)
    mx = X.amax(0)
    sums = seq_sum(torch.stack([W, W * X], dim=1))            # [2, n]: sum_w, sum_x
    mn = torch.where(xlo > 0, zero, xlo)
    degenerate = (mx <= mn) if v3 else (mx == mn)
    live = ~degenerate
    dspan = degenerate.float()                               # max - min of a live block + 0: unchanged
    iscale = tdiv(15.0, (mx - mn).add_(dspan))
    scale = tdiv(1.0, iscale)
    # work tensors: the codes, and one [32, 3, n] buffer whose rows hold v, then w*l, (w*l)*l and
    # (w*l)*x for the sums, then the errors (fewer live tensors: the pass stays nearer to L2)
    La = torch.empty_like(X)
    buf = torch.empty((X.shape[0], 3, n), dtype=torch.float32, device=dev)
    wl, wl2, wlx = buf.unbind(1)
    v, err = wl, wl2

    def scaled(isc, m):
        """v = iscale * (x - min) into `v`, and a bound of |v| per live block."""
        torch.sub(X, m, out=v)
        v.mul_(isc)
        # |X - m| <= max(|xlo - m|, |mx - m|) and rounding is monotone, so this bounds |v|
        return torch.where(degenerate, zero, isc.abs() * torch.maximum((xlo - m).abs(), (mx - m).abs()))

    # v = iscale * (x - min) is NaN only where iscale overflows (max - min < ~4e-38); min <= 0
    # throughout, so max - min >= max, and a live block whose max is not tiny never overflows
    nan_free = bool(((mx >= 2.0 ** -100) | degenerate).all())
    L0 = None
    bound = scaled(iscale, mn)                               # the first guess clamps in both variants
    first_exact = _exact_round(bound)
    L = _round_codes(v, La, bound)
    torch.mul(L, scale, out=err)
    err.add_(mn).sub_(X)
    err.mul_(err).mul_(W)                                    # w * diff^2 (one product: order-free)
    best = seq_sum(err)
    if v3 and not first_exact:
        L0 = L.clone()                                       # the clamp rule's codes, kept as they are
    # best, scale, min (the one the next candidates start from: C reuses it), and what formed the
    # best codes so far: (iscale, min)
    state = torch.stack([best, scale, mn, iscale, mn])
    # the candidate's values in the same order; E: the three sums, then sum_w, sum_x
    new = torch.empty_like(state)
    E = torch.empty((5, n), dtype=torch.float32, device=dev)
    E[3:] = sums
    ends = torch.tensor([3, 3, 4], device=dev)                # sum_w, sum_w, sum_x
    mids = torch.tensor([1, 2, 1], device=dev)                # sum_l2, sum_xl, sum_l2
    rights = torch.tensor([0, 4, 2], device=dev)              # sum_l, sum_x, sum_xl
    left = E.index_select(0, ends)
    fix = torch.zeros((2, n), dtype=torch.float32, device=dev)   # this_min > 0: (sum_xl / sum_l2, 0)
    took = torch.zeros(n, dtype=torch.bool, device=dev)      # best is a candidate, not the first guess
    for num in (_NUM_QKX3_T if v3 else _NUM_QKX2_T).get(dev):
        mn = state[2]
        isc = torch.div(num, (mx - mn).add_(dspan), out=new[3])
        new[4] = mn
        if v3:
            torch.sub(X, mn, out=v)
            v.mul_(isc)
            _qkx3_codes(v, La, nan_free)
        else:
            _round_codes(v, La, scaled(isc, mn))
        torch.mul(W, La, out=wl)
        torch.mul(wl, La, out=wl2)
        torch.mul(wl, X, out=wlx)
        seq_sum(buf, out=E[:3])                              # sum_l, sum_l2, sum_xl
        # [D, N_scale, N_min] = [sum_w*sum_l2 - sum_l*sum_l, sum_w*sum_xl - sum_x*sum_l,
        #                        sum_l2*sum_x - sum_l*sum_xl], each product as in C
        R = (left * E.index_select(0, mids)).sub_(E[0] * E.index_select(0, rights))
        D = R[0]
        ts = torch.div(R[1:], D)                                # this_scale, this_min
        torch.div(E[2], E[1], out=fix[0])
        ts = select(select_mask(ts[1] > 0), fix, ts)
        torch.mul(La, ts[0], out=err)
        err.add_(ts[1]).sub_(X)
        err.mul_(err).mul_(W)
        seq_sum(err, out=new[0])
        new[1:3] = ts
        take = (D > 0) & (new[0] < state[0]) & live
        if L0 is not None:
            took |= take
        # accepting: best = cur, scale, min = this_min, and the (iscale, min) of these codes
        state = select(select_mask(take), new, state)
    _, scale, mn, best_isc, best_m = state.unbind(0)
    if v3:
        torch.sub(X, best_m, out=v)
        v.mul_(best_isc)
        L = _qkx3_codes(v, La, nan_free)
        if L0 is not None:
            # the first guess's codes came from the clamp rule outside nearest_int's exact range
            L = torch.where(took, L, L0)
    else:
        L = _round_codes(v, La, scaled(best_isc, best_m))
    L = torch.where(degenerate, zero, L)
    scale = torch.where(degenerate, zero, scale)
    return scale, -mn, L


def _make_qp_t(V: torch.Tensor, Q: torch.Tensor):
    """torch twin of _make_qp_np. V, Q: float32 [8, S]."""
    dev = V.device
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    n = V.shape[0]
    mx = torch.zeros(V.shape[1], dtype=torch.float32, device=dev)
    for i in range(n):
        mx = torch.where(mx > V[i], mx, V[i])
    is_zero = mx < float(GROUP_MAX_EPS)
    iscale = tdiv(63.0, mx)
    L = nearest_int(iscale * V).float()
    scale = tdiv(1.0, iscale)
    diff = V - scale * L
    best = seq_sum((Q * diff) * diff)
    for num in _NUM_QP:
        isc = tdiv(num, mx)
        sc = tdiv(1.0, isc)
        l = nearest_int(isc * V).clamp_max_(63).float()
        diff = V - sc * l
        mse = seq_sum((Q * diff) * diff)
        better = mse < best
        best = torch.where(better, mse, best)
        iscale = torch.where(better, isc, iscale)
    L = nearest_int(iscale * V).clamp_max_(63).float()
    sumlx = seq_sum((Q * V) * L)
    suml2 = seq_sum((Q * L) * L)
    L = list(L.unbind(0))
    # the C loop stops a block after a sweep that changed nothing (at most 5 sweeps); such a
    # sweep leaves the state as it is, so stopping when no block changed gives the same bits
    for _ in range(5):
        changed = torch.zeros_like(is_zero)
        for i in range(n):
            w, vi, li = Q[i], V[i], L[i]
            wv = w * vi
            slx = sumlx - wv * li
            sl2 = suml2 - (w * li) * li
            ok = (slx > 0) & (sl2 > 0)
            new = nearest_int(tdiv(vi * sl2, slx)).clamp_max_(63).float()
            ok &= new != li
            slx = slx + wv * new
            sl2 = sl2 + (w * new) * new
            ok &= (slx * slx) * suml2 > (sumlx * sumlx) * sl2
            L[i] = torch.where(ok, new, li)
            sumlx = torch.where(ok, slx, sumlx)
            suml2 = torch.where(ok, sl2, suml2)
            changed |= ok
        if not bool(changed.any()):
            break
    out = torch.where(suml2 > 0, tdiv(sumlx, suml2), zero)
    out = torch.where(is_zero, zero, out)
    L = torch.where(is_zero, zero, torch.stack(L, 0))
    return out, L


def _quantize_chunk_t(X: torch.Tensor, Q: Optional[torch.Tensor]):
    """X (and Q) float32 [32, n], n = 8 * super-blocks. Returns L [32, n] float,
    ls, lm [n] float (0..63), d, dmin [n/8] float (fp16 values)."""
    dev = X.device
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    n = X.shape[1]
    S = n // NSUB
    if Q is None:
        sum_x2 = seq_sum(X * X)
        av_x = sqrt_f32(sum_x2 / 32.0)      # exact: a power of two
        W = av_x + X.abs()
        scale, the_min, L = _make_qkx_t(X, W, v3=False)
        scale = scale.view(S, NSUB)
        the_min = the_min.view(S, NSUB)
        max_scale = torch.zeros(S, dtype=torch.float32, device=dev)
        max_min = torch.zeros(S, dtype=torch.float32, device=dev)
        for j in range(NSUB):
            max_scale = torch.where(scale[:, j] > max_scale, scale[:, j], max_scale)
            max_min = torch.where(the_min[:, j] > max_min, the_min[:, j], max_min)
        inv_scale = torch.where(max_scale > 0, tdiv(63.0, max_scale), zero)
        inv_min = torch.where(max_min > 0, tdiv(63.0, max_min), zero)
        ls = (nearest_int(inv_scale[:, None] * scale) & 0xFF).clamp_max_(63).float().reshape(n)
        lm = (nearest_int(inv_min[:, None] * the_min) & 0xFF).clamp_max_(63).float().reshape(n)
        d = fp16_round(tdiv(max_scale, 63.0))
        dmin = fp16_round(tdiv(max_min, 63.0))
    else:
        X3 = X.view(SUB, S, NSUB)
        sq = (X3 * X3).permute(2, 0, 1).reshape(QK_K, S)     # element 32j + l of each super-block first
        sum_x2 = seq_sum(sq)
        sigma2 = (sum_x2 * 2.0) / 256.0      # exact scalings by powers of two
        sig = sigma2.repeat_interleave(NSUB)
        W = Q * sqrt_f32(sig + X * X)
        sw = seq_sum(W).view(S, NSUB).t().contiguous()
        scale, the_min, L = _make_qkx_t(X, W, v3=True)
        # scales and mins go through make_qp_quants side by side (independent columns)
        both = torch.cat([scale.view(S, NSUB), the_min.view(S, NSUB)], 0).t().contiguous()
        blk, Lsm = _make_qp_t(both, torch.cat([sw, sw], 1))
        d_block, m_block = blk[:S], blk[S:]
        ls = Lsm[:, :S].t().reshape(n)
        lm = Lsm[:, S:].t().reshape(n)
        d = fp16_round(d_block)
        dmin = fp16_round(m_block)
    dj = d.repeat_interleave(NSUB) * ls
    mj = dmin.repeat_interleave(NSUB) * lm
    L = torch.where(dj != 0, _element_codes(X, dj, mj), L)
    return L, ls, lm, d, dmin


def _element_codes(X: torch.Tensor, dj: torch.Tensor, mj: torch.Tensor, guard: bool = False) -> torch.Tensor:
    """The last stage of quantize_row_q4_K: each weight's code from its sub-block's stored scale and
    min, ``clamp(nearest_int((x + dmin*lm) / (d*ls)), 0, 15)`` (float32 codes). dj = d*ls and
    mj = dmin*lm broadcast against X (the search's [32, n] layout or rows [B, 32]: elementwise, so
    the same bits either way). Where dj == 0 the caller decides (the search keeps its own codes).
    ``guard`` clamps the ratio to +-1e6 first: scales given from outside (kept from an earlier search
    while the weights moved) may put it beyond nearest_int's exact range; the engine's own scales
    never do, and inside that range the clamp changes nothing."""
    v = tdiv(X + mj, dj)
    if guard:
        v = v.clamp_(-1e6, 1e6)
    return nearest_int(v).clamp_(0, 15).float()


class Q4K(Format):
    """llama.cpp Q4_K; see the module docstring for the layout and the rules."""

    # sub-blocks per pass. CPU: keeps the [32, n] work tensors near cache size. CUDA: the
    # loop is launch-bound, so large passes (H200, 4096x4096: 23 M/s at 16384, 606 M/s at
    # 524288); 2^20 sub-blocks use about 1.5 GB of work memory.
    chunk_subblocks = 8192
    chunk_subblocks_cuda = 1 << 20

    # ---------------------------------------------------------------- numpy reference
    def quantize_ref(self, x: np.ndarray, imatrix: Optional[np.ndarray] = None, **kw) -> np.ndarray:
        x = np.asarray(x)
        self.check_input(x)
        x = x.astype(np.float32)
        self.check_finite(self.name, x)
        K = x.shape[-1]
        qw = None if imatrix is None else _broadcast_imatrix(np.asarray(imatrix), x.shape, to_np=True)
        rows = x.reshape(-1, K)
        fields = _quantize_rows_np(rows, None if qw is None else qw.reshape(-1, K))
        return _pack_np(*fields).reshape(*x.shape[:-1], K // QK_K * BLOCK_BYTES)

    def dequantize_ref(self, b: np.ndarray, k: int) -> np.ndarray:
        b = np.asarray(b, dtype=np.uint8)
        if b.shape[-1] != k // QK_K * BLOCK_BYTES or k % QK_K:
            raise ValueError(f"q4_k: {b.shape[-1]} bytes per row do not hold K={k} weights "
                             f"(need K % 256 == 0 and K/256*144 bytes)")
        codes, ls, lm, d, dmin = _unpack_np(b, k)
        f32 = np.float32
        dl = (np.repeat(d, NSUB, axis=-1) * ls.astype(f32)).astype(f32)
        ml = (np.repeat(dmin, NSUB, axis=-1) * lm.astype(f32)).astype(f32)
        R = codes.shape[0]
        q = codes.reshape(R, -1, SUB).astype(f32)
        y = (dl[..., None] * q) - ml[..., None]
        return y.reshape(*b.shape[:-1], k).astype(f32)

    # ---------------------------------------------------------------- torch emulator
    def quantize(self, x: torch.Tensor, imatrix=None, scales=None, d=None, dmin=None, **kw) -> PackedTensor:
        if kw.get("amax") is not None:
            raise ValueError("q4_k.quantize: amax= is not supported: q4_k has no per-tensor scale and "
                             "derives d/dmin/ls/lm per super-block; it takes imatrix=, or kept scales "
                             "(scales=, d=, dmin=)")
        unknown = set(kw) - {"amax"}
        if unknown:
            raise TypeError(f"q4_k.quantize: unexpected keyword(s) {sorted(unknown)}; q4_k takes imatrix=, "
                            f"or scales= with d= and dmin=")
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(x)
        self.check_input(x)
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"q4_k.quantize: dtype {x.dtype}; allowed: float32, bfloat16, float16")
        shape = tuple(x.shape)
        K = shape[-1]
        xf = x.detach().float()
        self.check_finite(self.name, xf)
        given = [scales is not None, d is not None, dmin is not None]
        if any(given):
            if not all(given):
                raise ValueError("q4_k.quantize: scales= (uint8 [..., K/32, 2]: ls, lm), d= and dmin= (fp16 "
                                 "[..., K/256]) must be given together")
            if imatrix is not None:
                raise ValueError("q4_k.quantize: give either kept scales (scales=, d=, dmin=) or imatrix=, not both")
            return self._quantize_with_scales(xf, shape, scales, d, dmin)
        qw = None
        if imatrix is not None:
            im = imatrix if isinstance(imatrix, torch.Tensor) else torch.as_tensor(np.asarray(imatrix))
            qw = _broadcast_imatrix(im.to(xf.device), shape, to_np=False)
        B = xf.numel() // SUB
        Xall = xf.reshape(B, SUB)
        Qall = None if qw is None else qw.reshape(B, SUB)
        codes = torch.empty((B, SUB), dtype=torch.uint8, device=xf.device)
        ls = torch.empty(B, dtype=torch.uint8, device=xf.device)
        lm = torch.empty(B, dtype=torch.uint8, device=xf.device)
        d = torch.empty(B // NSUB, dtype=torch.float32, device=xf.device)
        dmin = torch.empty_like(d)
        step = self.chunk_subblocks_cuda if xf.is_cuda else self.chunk_subblocks
        for a in range(0, B, step):
            e = min(B, a + step)
            X = Xall[a:e].t().contiguous()
            Q = None if Qall is None else Qall[a:e].t().contiguous()
            L, cls, clm, cd, cdm = _quantize_chunk_t(X, Q)
            codes[a:e] = L.t().to(torch.uint8)
            ls[a:e] = cls.to(torch.uint8)
            lm[a:e] = clm.to(torch.uint8)
            d[a // NSUB:e // NSUB] = cd
            dmin[a // NSUB:e // NSUB] = cdm
        lead = shape[:-1]
        return PackedTensor(
            format=self.name, shape=shape,
            codes=codes.reshape(shape),
            scales=torch.stack([ls, lm], dim=-1).reshape(*lead, K // SUB, 2),
            global_scale=None,
            extra={"d": d.half().reshape(*lead, K // QK_K), "dmin": dmin.half().reshape(*lead, K // QK_K)},
        )

    def _quantize_with_scales(self, xf: torch.Tensor, shape, scales, d, dmin) -> PackedTensor:
        """Codes of xf under given (kept) sub-block scales and mins: the emulator's last stage
        (_element_codes) without the search. Sub-blocks whose d*ls is 0 get code 0 (their value is
        -dmin*lm whatever the code)."""
        K = shape[-1]
        lead = shape[:-1]
        sc = torch.as_tensor(scales, device=xf.device)
        if sc.dtype != torch.uint8 or tuple(sc.shape) != tuple(lead) + (K // SUB, 2):
            raise ValueError(f"q4_k.quantize: scales= must be uint8 of shape {tuple(lead) + (K // SUB, 2)} "
                             f"((ls, lm) per sub-block), got {sc.dtype} {tuple(sc.shape)}")
        if bool((sc > 63).any()):
            raise ValueError("q4_k.quantize: scales= holds values above 63; ls and lm are 6-bit")
        dd = []
        for name, v in (("d", d), ("dmin", dmin)):
            t = torch.as_tensor(v, device=xf.device)
            if t.dtype != torch.float16 or tuple(t.shape) != tuple(lead) + (K // QK_K,):
                raise ValueError(f"q4_k.quantize: {name}= must be float16 of shape {tuple(lead) + (K // QK_K,)}, "
                                 f"got {t.dtype} {tuple(t.shape)}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"q4_k.quantize: {name}= contains NaN or Inf")
            dd.append(t)
        B = xf.numel() // SUB
        ls = sc[..., 0].reshape(B).float()
        lm = sc[..., 1].reshape(B).float()
        dj = dd[0].float().reshape(-1).repeat_interleave(NSUB) * ls
        mj = dd[1].float().reshape(-1).repeat_interleave(NSUB) * lm
        X = xf.reshape(B, SUB)
        nz = (dj != 0).unsqueeze(1)
        L = _element_codes(X, dj.unsqueeze(1), mj.unsqueeze(1), guard=True).mul_(nz)
        return PackedTensor(format=self.name, shape=shape, codes=L.to(torch.uint8).reshape(shape),
                            scales=sc.clone(), global_scale=None,
                            extra={"d": dd[0].clone(), "dmin": dd[1].clone()})

    def searches_scales(self, imatrix: bool) -> bool:
        return True

    def scale_kwargs(self, p: PackedTensor):
        return {"scales": p.scales, "d": p.extra["d"], "dmin": p.extra["dmin"]}

    def dequantize(self, p: PackedTensor) -> torch.Tensor:
        shape = tuple(p.shape)
        K = shape[-1]
        d = p.extra["d"].float().reshape(-1, K // QK_K, 1)
        dmin = p.extra["dmin"].float().reshape(-1, K // QK_K, 1)
        sc = p.scales.reshape(-1, K // QK_K, NSUB, 2)
        dl = d * sc[..., 0].float()                      # [R, S, 8]
        ml = dmin * sc[..., 1].float()
        q = p.codes.reshape(-1, K // QK_K, NSUB, SUB).float()
        y = dl[..., None] * q - ml[..., None]
        return y.reshape(shape)

    def to_bytes(self, p: PackedTensor) -> np.ndarray:
        shape = tuple(p.shape)
        K = shape[-1]
        S = K // QK_K
        codes = p.codes.reshape(-1, K).cpu()
        R = codes.shape[0]
        sc = p.scales.reshape(R, S, NSUB, 2).cpu()
        out = torch.empty((R, S, BLOCK_BYTES), dtype=torch.uint8)
        out[..., 0:2] = p.extra["d"].reshape(R, S).cpu().half().contiguous().view(torch.uint8).reshape(R, S, 2)
        out[..., 2:4] = p.extra["dmin"].reshape(R, S).cpu().half().contiguous().view(torch.uint8).reshape(R, S, 2)
        out[..., 4:16] = pack_scale_min_k4(sc[..., 0], sc[..., 1])
        out[..., 16:] = pack_split_halves(codes, 64).reshape(R, S, 128)
        return out.reshape(*shape[:-1], S * BLOCK_BYTES).numpy()

    def from_bytes(self, b, k: Optional[int] = None) -> PackedTensor:
        b = torch.as_tensor(np.ascontiguousarray(b, dtype=np.uint8))
        nb = b.shape[-1]
        if nb % BLOCK_BYTES:
            raise ValueError(f"q4_k: a row of {nb} bytes is not a whole number of {BLOCK_BYTES}-byte blocks")
        K = nb // BLOCK_BYTES * QK_K
        if k is not None and k != K:
            raise ValueError(f"q4_k: rows of {nb} bytes hold K={K} weights, not K={k}")
        lead = tuple(b.shape[:-1])
        S = K // QK_K
        r = b.reshape(-1, S, BLOCK_BYTES)
        R = r.shape[0]
        d = r[..., 0:2].contiguous().view(torch.float16).reshape(*lead, S)
        dmin = r[..., 2:4].contiguous().view(torch.float16).reshape(*lead, S)
        ls, lm = unpack_scale_min_k4(r[..., 4:16])
        codes = unpack_split_halves(r[..., 16:].reshape(R, S * 128), 64)
        return PackedTensor(format=self.name, shape=lead + (K,), codes=codes.reshape(*lead, K),
                            scales=torch.stack([ls, lm], dim=-1).reshape(*lead, K // SUB, 2),
                            global_scale=None, extra={"d": d, "dmin": dmin})

    def clip_mask(self, x: torch.Tensor, p: PackedTensor) -> torch.Tensor:
        """True where x lies in [-(dmin*lm), (d*ls)*15 - dmin*lm] of its sub-block."""
        shape = tuple(p.shape)
        K = shape[-1]
        d = p.extra["d"].float().reshape(-1, K // QK_K, 1)
        dmin = p.extra["dmin"].float().reshape(-1, K // QK_K, 1)
        sc = p.scales.reshape(-1, K // QK_K, NSUB, 2)
        dl = (d * sc[..., 0].float())[..., None]
        ml = (dmin * sc[..., 1].float())[..., None]
        lo = -ml
        hi = dl * 15.0 - ml
        xv = x.detach().float().reshape(-1, K // QK_K, NSUB, SUB)
        return ((xv >= lo) & (xv <= hi)).reshape(shape)


register(Q4K(SPEC))
