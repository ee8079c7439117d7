"""Low-bit integer grids with one scale per output row (or per group): ParetoQ's quantizers in the
llama.cpp block types that decode them exactly.

ParetoQ (arXiv 2502.02631; facebookresearch/ParetoQ ``utils_quant.py``, the same code as torchao 0.18
``prototype/paretoq/models/utils_quant.py``, which is installed and is the oracle of the tests). With
x = W / alpha computed in float32 and round = round-half-to-even (torch.round / np.rint)::

    grid            levels (x alpha)       code decision                          init alpha (per row)
    4-bit LSQ       -8 .. 7                clamp(round(x), -8, 7)                 max|W| / 7
    3-bit LSQ       -4 .. 3                clamp(round(x), -4, 3)                 max|W| / 3
    2-bit LSQ       -2 .. 1                clamp(round(x), -2, 1)                 max|W| / 1   (ablation grid)
    2-bit SEQ       -3/4 -1/4 1/4 3/4      r = round(2 clip(x, 0.99) - 0.5)       max|W|
                                           level (r + 0.5) / 2, code 2r + 1
    1.58-bit SEQ    -2/3 0 2/3             round(1.5 clip(x, 0.99)) (no shift)    max|W|
    1-bit           -1 1 (0 for W == 0)    sign(W)                                mean|W|

clip(x, 0.99) = clamp(x, -0.99, 0.99) in float32. alpha is first floored as ParetoQ does in every
forward (alpha <= 1e-5 -> 1e-5). Quirks kept on purpose (tested): the SEQ clip at 0.99 instead of 1
(the paper's formula would add a level), ternary with factor 1.5 and no half shift, and ties of the
2-bit SEQ grid that are not sign-symmetric: x = 0 and x = +1/2 give +1/4, x = -1/2 gives -3/4, and so
does every x in (-2^-25, 0), because 2x - 0.5 rounds to -0.5 in float32 and round(-0.5) = -0.

**What is stored (the engine scale d, fp16).** Each grid keeps an integer ``code`` per weight and an
fp16 scale ``d`` per row (per group), and its value is ``code * d`` -- the value llama.cpp decodes.
alpha is tied to d so that ParetoQ's own forward (``q_w * alpha``) gives exactly ``code * d``:

    LSQ, sign       d = fp16(alpha)              alpha = d
    2-bit SEQ       d = fp16(alpha / 4)          alpha = 4 d          (codes -3, -1, 1, 3)
    ternary SEQ     d = fp16(fl(C alpha))        alpha = fl(d / C)    C = fl32(1/1.5), ParetoQ's level 2/3:
                                                 fl(C * fl(d / C)) == d for every positive fp16 d (tested)

(``int4_lsq_bf16`` / ``int4_lsq_g128_bf16``: d on bf16's grid, 8 significant bits, which fp16 holds too:
the scales a bf16 model loads for compressed-tensors int4 without rounding)
so ``quantize(x, scales=d)`` decides codes with that alpha, and training rounds a learned alpha onto
this grid (nn/lowbit.py). Alphas are clamped to fp16's finite range; if the floor at 1e-5 would move
alpha, d goes one fp16 step up.

Engine layouts (``lowbit_blocks.py``): Q4_0 (any grid whose codes fit -8..7, 32-element blocks; a
per-row or per-group d is repeated in each block), Q3_K (codes + 4, every 6-bit sub-block scale = 1),
Q2_K (2-bit SEQ: q = (code + 3) / 2 with sc = 2, m = 3, dmin = d; 2-bit LSQ: q = code + 2, sc = 1,
m = 2, dmin = d), TQ2_0 and TQ1_0 (q = code + 1). Every layout was checked against gguf-py's
``dequantize`` and libggml's ``dequantize_row_*`` (tests/formats/test_intgrid.py); the TQ bytes also
equal libggml's and gguf-py's own TQ encoders on exact ternary rows.

``PackedTensor``: ``codes`` int8 [..., K]; ``scales`` float16 [..., G] with G = 1 (per row) or
K / group; ``global_scale`` None. Rows of the 256-element types must be a multiple of 256 (for
SmolLM2's 576-wide rows use the ``*_q4_0`` variant of the same grid: identical numerics, Q4_0 bytes).
NaN / Inf inputs are refused.

The ``mean|W|`` of the 1-bit init is summed in float64 (ParetoQ: torch.mean in the parameter dtype),
so the numpy reference and the torch emulator can differ only if that mean lands within ~1e-12
(relative) of an fp16 rounding boundary; the init is a heuristic, the quantizer itself is exact.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from . import lowbit_blocks as LB
from .kquant_common import tdiv
from .layouts import Codec, GGUFLayout, SafetensorsLayout
from .q8_0 import CheckedInput, as_float32, no_amax
from .spec import Format, FormatSpec, PackedTensor, register

EPS = np.float32(1e-5)                  # ParetoQ: alpha = where(alpha > 1e-5, alpha, 1e-5)
CLIP = np.float32(0.99)                 # SEQ clip, 1 - 1e-2
C23 = np.float32(1) / np.float32(1.5)   # fl32(1/1.5): ParetoQ's ternary level q / 1.5
FP16_MAX = np.float32(65504.0)
BF16_FP16_MAX = np.float32(65280.0)    # the largest bf16 value fp16 holds
FAMILIES = ("lsq", "seq2", "ternary", "sign")
_INIT = {"lsq": "max|W| / Qp", "seq2": "max|W|", "ternary": "max|W|", "sign": "mean|W|"}


def _bf16_np(v: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (RNE) as float32, for finite inputs (torch's .bfloat16())."""
    b = np.asarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


class IntGrid(CheckedInput, Format):
    """One grid family x one GGUF layout x per-row or per-group scales (see the module docstring)."""

    def __init__(self, spec: FormatSpec, family: str, qn: int, qp: int, layout: str, group: int = 0,
                 grid: str = "fp16"):
        super().__init__(spec)
        if family not in FAMILIES:
            raise ValueError(f"IntGrid family {family!r}; allowed: {FAMILIES}")
        if grid not in ("fp16", "bf16") or (grid == "bf16" and family != "lsq"):
            raise ValueError(f"IntGrid scale grid {grid!r}; allowed: 'fp16', or 'bf16' for LSQ grids")
        self.family, self.qn, self.qp, self.layout, self.group = family, qn, qp, layout, group
        self.grid = grid      # bf16: d on bf16's grid (8 significant bits), still stored as fp16
        # the least alpha this grid uses: ParetoQ's floor 1e-5, rounded up onto the grid (~1.0014e-5)
        self.scale_floor = float(self.alpha_of_d_np(self.d_of_alpha_np(np.zeros(1, np.float32)))[0])

    # ---------------------------------------------------------------- shapes
    def check_input(self, x) -> None:
        super().check_input(x)
        if self.group and x.shape[-1] % self.group:
            raise ValueError(f"{self.name}: last dimension K={x.shape[-1]} is not a multiple of the scale group "
                             f"{self.group} (nor, then, of the {self.spec.super_block}-element engine block)")

    def n_groups(self, k: int) -> int:
        return k // self.group if self.group else 1

    def _grouped(self, x, k: int):
        return x.reshape(*x.shape[:-1], self.n_groups(k), k // self.n_groups(k))

    # ---------------------------------------------------------------- alpha <-> d (numpy)
    def alpha_of_d_np(self, d) -> np.ndarray:
        d = np.asarray(d).astype(np.float32)
        if self.family == "seq2":
            return (d * np.float32(4)).astype(np.float32)
        if self.family == "ternary":
            return (d / C23).astype(np.float32)
        return d

    def d_of_alpha_np(self, alpha) -> np.ndarray:
        """alpha float32 -> the fp16 engine scale (ParetoQ floor, grid rounding RNE, fp16 range)."""
        a = np.asarray(alpha, dtype=np.float32)
        a = np.where(a > EPS, a, EPS).astype(np.float32)
        if self.family == "seq2":
            t = a * np.float32(0.25)
        elif self.family == "ternary":
            t = (C23 * a).astype(np.float32)
        else:
            t = a
        if self.grid == "bf16":
            d = _bf16_np(np.minimum(t, BF16_FP16_MAX)).astype(np.float16)
            for _ in range(2):
                low = self.alpha_of_d_np(d) <= EPS
                up = (d.astype(np.float32).view(np.uint32) + np.uint32(1 << 16)).view(np.float32)
                with np.errstate(over="ignore"):       # rows that are not bumped may overflow here
                    d = np.where(low, up.astype(np.float16), d)
            return d
        d = np.minimum(t, FP16_MAX).astype(np.float16)
        for _ in range(2):
            low = self.alpha_of_d_np(d) <= EPS
            d = np.where(low, (d.view(np.uint16) + 1).view(np.float16), d)
        return d

    # ---------------------------------------------------------------- alpha <-> d (torch)
    def alpha_of_d(self, d: torch.Tensor) -> torch.Tensor:
        """fp16 engine scales -> the float32 alpha ParetoQ's forward sees."""
        d = d.float()
        if self.family == "seq2":
            return d * 4.0
        if self.family == "ternary":
            return tdiv(d, torch.full((), float(C23), dtype=torch.float32, device=d.device))
        return d

    def d_of_alpha(self, alpha: torch.Tensor) -> torch.Tensor:
        """float32 alpha -> fp16 engine scale (float16 tensor), the grid the trained alpha is rounded onto."""
        a = alpha.detach().float()
        eps = torch.full((), float(EPS), dtype=torch.float32, device=a.device)
        a = torch.where(a > eps, a, eps)
        if self.family == "seq2":
            t = a * 0.25
        elif self.family == "ternary":
            t = torch.full((), float(C23), dtype=torch.float32, device=a.device) * a
        else:
            t = a
        if self.grid == "bf16":
            d = t.clamp(max=float(BF16_FP16_MAX)).bfloat16().half()
            for _ in range(2):
                low = self.alpha_of_d(d) <= eps
                d = torch.where(low, (d.bfloat16().view(torch.int16) + 1).view(torch.bfloat16).half(), d)
            return d
        d = t.clamp(max=float(FP16_MAX)).half()
        for _ in range(2):
            low = self.alpha_of_d(d) <= eps
            d = torch.where(low, (d.view(torch.int16) + 1).view(torch.float16), d)
        return d

    # ---------------------------------------------------------------- init rule
    def init_alpha_np(self, xg: np.ndarray) -> np.ndarray:
        """ParetoQ's initial alpha per group: xg [..., G, n] -> [..., G]."""
        ax = np.abs(xg)
        if self.family == "sign":
            return (ax.astype(np.float64).sum(-1) / ax.shape[-1]).astype(np.float32)
        amax = ax.max(-1).astype(np.float32)
        if self.family == "lsq":
            return (amax / np.float32(self.qp)).astype(np.float32)
        return amax

    def init_alpha(self, xg: torch.Tensor) -> torch.Tensor:
        ax = xg.float().abs()
        if self.family == "sign":
            return (ax.double().sum(-1) / ax.shape[-1]).float()
        amax = ax.amax(-1)
        if self.family == "lsq":
            return tdiv(amax, float(self.qp))
        return amax

    # ---------------------------------------------------------------- decisions
    def codes_np(self, xg: np.ndarray, alpha: np.ndarray) -> np.ndarray:
        """ParetoQ's rounding: xg [..., G, n], alpha [..., G] float32 -> int8 codes."""
        if self.family == "sign":
            return np.sign(xg).astype(np.int8)
        v = (xg / alpha[..., None]).astype(np.float32)
        if self.family == "lsq":
            return np.clip(np.rint(v), self.qn, self.qp).astype(np.int8)
        c = np.clip(v, -CLIP, CLIP).astype(np.float32)
        if self.family == "ternary":
            return np.rint((c * np.float32(1.5)).astype(np.float32)).astype(np.int8)
        r = np.rint(((c * np.float32(2)).astype(np.float32) - np.float32(0.5)).astype(np.float32))
        return (2 * r + 1).astype(np.int8)

    def codes(self, xg: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """torch twin of :meth:`codes_np` (same float32 operations, same order)."""
        if self.family == "sign":
            return torch.sign(xg).to(torch.int8)
        v = torch.div(xg, alpha.unsqueeze(-1))
        if self.family == "lsq":
            return torch.round(v).clamp_(self.qn, self.qp).to(torch.int8)
        c = torch.clamp(v, -float(CLIP), float(CLIP))
        if self.family == "ternary":
            return torch.round(c * 1.5).to(torch.int8)
        return (2 * torch.round(c * 2 - 0.5) + 1).to(torch.int8)

    def fake_values(self, xg: torch.Tensor, alpha: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """``codes(xg, alpha) * d`` in float32 with the codes kept in float32: the same values as
        ``dequantize(quantize(x, scales=d))`` (every code is a small integer, exact in float32, and the
        product is the one dequantize forms) without the int8 round trip, the scale checks and their
        host syncs. For the training forward, where d = d_of_alpha(alpha) holds by construction;
        x must be float32 and finite (the caller checks). A zero code is +0 as the int8 path gives it
        (a float round of a small negative is -0, hence the + 0.0: it changes no other value)."""
        df = d.float().unsqueeze(-1)
        if self.family == "sign":
            return torch.sign(xg).mul_(df).add_(0.0)
        v = torch.div(xg, alpha.unsqueeze(-1))
        if self.family == "lsq":
            return torch.round(v).clamp_(self.qn, self.qp).mul_(df).add_(0.0)
        c = torch.clamp(v, -float(CLIP), float(CLIP))
        if self.family == "ternary":
            return torch.round(c * 1.5).mul_(df).add_(0.0)
        return torch.round(c * 2 - 0.5).mul_(2).add_(1).mul_(df)     # odd codes: never zero

    def pass_mask(self, xg: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """Where ParetoQ's weight gradient passes (its clipped STE): Qn <= x <= Qp (LSQ), |x| <= 0.99
        (SEQ), |x| <= 1 (sign), with x = W / alpha."""
        v = torch.div(xg, alpha.unsqueeze(-1))
        if self.family == "lsq":
            return (v >= self.qn) & (v <= self.qp)
        if self.family == "sign":
            return (v >= -1) & (v <= 1)
        return (v >= -float(CLIP)) & (v <= float(CLIP))

    # ---------------------------------------------------------------- numpy reference
    def quantize_ref(self, x: np.ndarray, scales=None, **kw) -> np.ndarray:
        if kw:
            raise TypeError(f"{self.name}.quantize_ref: unexpected arguments {sorted(kw)}; allowed: scales")
        x = self._prep_np(x)
        k = x.shape[-1]
        xg = self._grouped(x, k)
        d = self.d_of_alpha_np(self.init_alpha_np(xg)) if scales is None else \
            np.asarray(scales, dtype=np.float16).reshape(xg.shape[:-1])
        codes = self.codes_np(xg, self.alpha_of_d_np(d)).reshape(x.shape)
        return self._pack(codes, d)

    # ---------------------------------------------------------------- torch emulator
    def _scales_arg(self, scales, shape, device) -> torch.Tensor:
        s = torch.as_tensor(scales, device=device)
        if not torch.is_floating_point(s):
            raise ValueError(f"{self.name}: scales= must be the fp16 engine scales d, got {s.dtype}")
        if tuple(s.shape) != tuple(shape):
            raise ValueError(f"{self.name}: scales= has shape {tuple(s.shape)}, expected {tuple(shape)} "
                             f"(one fp16 scale per {'row' if not self.group else f'{self.group} elements'})")
        d = s.half()
        if not torch.equal(d.float(), s.float()):
            raise ValueError(f"{self.name}: scales= are not fp16 values; round them with d_of_alpha(alpha)")
        if not bool(torch.isfinite(d).all()) or not bool((self.alpha_of_d(d) > float(EPS)).all()):
            raise ValueError(f"{self.name}: scales= must be finite with alpha > {float(EPS):g} (ParetoQ's floor); "
                             f"use d_of_alpha(alpha), which applies it")
        return d

    def quantize(self, x: torch.Tensor, scales=None, amax=None, **kw) -> PackedTensor:
        """scales: fp16 engine scales d [..., G] (frozen or learned, see d_of_alpha); None = ParetoQ's
        init rule on x."""
        if kw:
            raise TypeError(f"{self.name}.quantize: unexpected arguments {sorted(kw)}; allowed: scales, amax=None")
        no_amax(self.name, amax)
        x = self._prep(x)
        shape = tuple(x.shape)
        xg = self._grouped(x, shape[-1])
        d = self.d_of_alpha(self.init_alpha(xg)) if scales is None else \
            self._scales_arg(scales, xg.shape[:-1], x.device)
        codes = self.codes(xg, self.alpha_of_d(d)).reshape(shape)
        return PackedTensor(self.name, shape, codes, d)

    def dequantize(self, p: PackedTensor) -> torch.Tensor:
        k = p.shape[-1]
        cg = self._grouped(p.codes, k).float()
        return (cg * p.scales.float().unsqueeze(-1)).reshape(p.shape)

    def clip_mask(self, x: torch.Tensor, p: PackedTensor) -> torch.Tensor:
        x = as_float32(x, self.name)
        xg = self._grouped(x, p.shape[-1])
        return self.pass_mask(xg, self.alpha_of_d(p.scales.to(x.device))).reshape(p.shape)

    # ---------------------------------------------------------------- engine bytes
    def _block_scales(self, d: np.ndarray, k: int) -> np.ndarray:
        """Per-group d [R, G] -> per engine block [R, K / super_block]."""
        per = (self.group or k) // self.spec.super_block     # groups are whole engine blocks
        return np.repeat(d.reshape(d.shape[0], -1), per, axis=1).astype(np.float16)

    def _pack(self, codes: np.ndarray, d: np.ndarray) -> np.ndarray:
        lead, k = codes.shape[:-1], codes.shape[-1]
        c = codes.reshape(-1, k)
        db = self._block_scales(np.asarray(d, dtype=np.float16).reshape(c.shape[0], -1), k).reshape(-1)
        if self.layout == "q4_0":
            raw = LB.q4_0_pack(c, db)
        elif self.layout == "q3_k":
            raw = LB.q3_k_pack(c, db, np.ones((db.size, 16), dtype=np.int16))
        elif self.layout == "q2_k":
            sc, m = (2, 3) if self.family == "seq2" else (1, 2)
            q = ((c.astype(np.int16) + m) // sc).astype(np.uint8)
            raw = LB.q2_k_pack(q, db, db, sc, m)
        elif self.layout == "tq2_0":
            raw = LB.tq2_0_pack((c.astype(np.int16) + 1).astype(np.uint8), db)
        else:
            raw = LB.tq1_0_pack((c.astype(np.int16) + 1).astype(np.uint8), db)
        return raw.reshape(*lead, k // self.spec.super_block * self.spec.bytes_per_block)

    def to_bytes(self, p: PackedTensor) -> np.ndarray:
        return self._pack(p.codes.detach().cpu().numpy(), p.scales.detach().cpu().to(torch.float16).numpy())

    def _unpack(self, blk: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """[B, bytes] -> codes [B, super_block], d16 [B]; refuses blocks this grid does not write."""
        if self.layout == "q4_0":
            return LB.q4_0_unpack(blk)
        if self.layout == "q3_k":
            c, d, sc = LB.q3_k_unpack(blk)
            if not (sc == 1).all():
                raise ValueError(f"{self.name}: Q3_K blocks with sub-block scales other than 1 hold a general "
                                 f"Q3_K tensor, not one per-row {self.name} scale")
            return c, d
        if self.layout == "q2_k":
            q, d, dmin, sc, m = LB.q2_k_unpack(blk)
            want = (2, 3) if self.family == "seq2" else (1, 2)
            if not ((sc == want[0]).all() and (m == want[1]).all() and np.array_equal(d.view(np.uint16),
                                                                                      dmin.view(np.uint16))):
                raise ValueError(f"{self.name}: Q2_K blocks are not of this grid (want every sub-block scale "
                                 f"{want[0]}, min {want[1]} and dmin == d)")
            return (q.astype(np.int16) * want[0] - want[1]).astype(np.int8), d
        t, d = LB.tq2_0_unpack(blk) if self.layout == "tq2_0" else LB.tq1_0_unpack(blk)
        if (t > 2).any():
            raise ValueError(f"{self.name}: TQ2_0 code 3 (value 2d) is outside the grid")
        return (t.astype(np.int16) - 1).astype(np.int8), d

    def from_bytes(self, b, k: Optional[int] = None) -> PackedTensor:
        bn = b.detach().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
        bpb, sb = self.spec.bytes_per_block, self.spec.super_block
        if bn.dtype != np.uint8 or bn.ndim < 1 or bn.shape[-1] % bpb:
            raise ValueError(f"{self.name}: from_bytes expects uint8 [..., n*{bpb}], got {bn.dtype} {tuple(bn.shape)}")
        nb = bn.shape[-1] // bpb
        if k is not None and k != nb * sb:
            raise ValueError(f"{self.name}: K={k} does not match {bn.shape[-1]} bytes per row ({nb} blocks of {sb})")
        k = nb * sb
        lead = bn.shape[:-1]
        self.check_input(np.empty((0, k), np.float32))
        codes, d = self._unpack(np.ascontiguousarray(bn).reshape(-1, bpb))
        rows = int(np.prod(lead)) if lead else 1
        db = d.reshape(rows, nb)
        g = self.n_groups(k)
        dg = db.reshape(rows, g, nb // g)
        if not (dg.view(np.uint16) == dg[..., :1].view(np.uint16)).all():
            raise ValueError(f"{self.name}: blocks of one {'row' if not self.group else 'group'} carry different "
                             f"scales; this is not a {self.name} tensor")
        shape = tuple(lead) + (k,)
        return PackedTensor(self.name, shape, torch.from_numpy(codes.reshape(shape).copy()),
                            torch.from_numpy(dg[..., 0].reshape(*lead, g).copy()))


# ----------------------------------------------------------------------------- registry
_ORACLE = ("torchao.prototype.paretoq (ParetoQ's quantizer: forward, backward); gguf.quants.dequantize; "
           "libggml dequantize_row_{t}")
_LAYOUT_TEXT = {
    "q4_0": "q4_0: byte j = (code[j]+8) | (code[j+16]+8) << 4, d fp16 per 32",
    "q3_k": "q3_k: hmask + 2-bit qs of code+4, every sub-block scale 1, d fp16",
    "q2_k": "q2_k: 2-bit q, one (sc, m) for all sub-blocks, dmin = d",
    "tq2_0": "tq2_0: 2-bit code+1, 4 per byte, d fp16",
    "tq1_0": "tq1_0: base-3 code+1, 5 (qs) / 4 (qh) per byte, d fp16",
}
_ELEMENT = {"lsq": "int", "seq2": "int2_seq", "ternary": "ternary", "sign": "binary"}


def _grid(name: str, family: str, qn: int, qp: int, layout: str, group: int = 0, fallback: Optional[str] = None,
          ct: Optional[str] = None, note: str = "", grid: str = "fp16") -> IntGrid:
    sb, bpb = LB.SIZES[layout]
    d_rule = {"lsq": "d = fp16(alpha)", "sign": "d = fp16(alpha)", "seq2": "d = fp16(alpha/4)",
              "ternary": "d = fp16(fl(alpha * fl(1/1.5)))"}[family]
    if grid == "bf16":
        d_rule = "d = bf16(alpha) (8 significant bits, exact in fp16 and bf16)"
    init = _INIT[family].replace("Qp", str(qp))
    element = _ELEMENT[family] + (str(int(np.log2(qp - qn + 1))) if family == "lsq" else "")
    spec = FormatSpec(
        name=name,
        engine=f"ParetoQ {family.upper()} grid (facebookresearch/ParetoQ = torchao 0.18 prototype/paretoq) in "
               f"llama.cpp/ggml {layout.upper()} blocks",
        element=element,
        block_size=group,
        super_block=sb,
        bytes_per_block=bpb,
        scale_codec="fp16",
        scale_rule=f"learned alpha per {'row' if not group else f'{group} elements'} (init {init}, floor 1e-5); "
                   f"{d_rule}",
        tie_rule="half_even (torch.round)" + ("; 2-bit SEQ ties not sign-symmetric" if family == "seq2" else ""),
        global_scale=None,
        nibble_order=_LAYOUT_TEXT[layout],
        oracle=_ORACLE.format(t=layout.replace("_k", "_K")),
        gguf=GGUFLayout(LB.GGML_TYPE[layout], file_type=LB.FILE_TYPE[layout]),
        # compressed-tensors int4 pack-quantized (W4A16): the codes and the fp16 scales as vLLM loads them
        safetensors=None if ct is None else SafetensorsLayout(
            Codec.INT4_FP16, ct_format=ct, group_size=group or None, strategy="group" if group else "channel",
            scale_dtype=None, type="int"),
        fallback=fallback,
        role="weight",
        symmetric=True,
        notes=note,
    )
    return IntGrid(spec, family, qn, qp, layout, group, grid)


_Q40 = "not this type; {}_q4_0 holds the same grid (same numerics, Q4_0 bytes, rows a multiple of 32)"
INT4_LSQ = register(_grid("int4_lsq", "lsq", -8, 7, "q4_0", ct="pack-quantized",
                          note="compressed-tensors int4 pack-quantized W4A16, strategy channel"))
INT4_LSQ_G32 = register(_grid("int4_lsq_g32", "lsq", -8, 7, "q4_0", group=32, ct="pack-quantized",
                              note="compressed-tensors int4 pack-quantized W4A16, group 32"))
INT4_LSQ_G128 = register(_grid("int4_lsq_g128", "lsq", -8, 7, "q4_0", group=128, ct="pack-quantized",
                               note="compressed-tensors int4 pack-quantized W4A16, group 128"))
# scales that a bf16 model holds too: vLLM loads weight_scale in the model dtype
INT4_LSQ_BF16 = register(_grid("int4_lsq_bf16", "lsq", -8, 7, "q4_0", ct="pack-quantized", grid="bf16",
                               note="compressed-tensors int4 pack-quantized W4A16, channel, for bf16 models"))
INT4_LSQ_G128_BF16 = register(_grid("int4_lsq_g128_bf16", "lsq", -8, 7, "q4_0", group=128, ct="pack-quantized",
                                    grid="bf16", note="compressed-tensors int4 pack-quantized W4A16, group 128, "
                                                      "for bf16 models"))
INT3_LSQ = register(_grid("int3_lsq", "lsq", -4, 3, "q3_k", fallback=_Q40.format("int3_lsq")))
INT3_LSQ_Q4_0 = register(_grid("int3_lsq_q4_0", "lsq", -4, 3, "q4_0"))
INT2_SEQ = register(_grid("int2_seq", "seq2", -3, 3, "q2_k", fallback=_Q40.format("int2_seq")))
INT2_SEQ_Q4_0 = register(_grid("int2_seq_q4_0", "seq2", -3, 3, "q4_0"))
INT2_LSQ = register(_grid("int2_lsq", "lsq", -2, 1, "q2_k", fallback=_Q40.format("int2_lsq"),
                          note="ablation grid (ParetoQ uses SEQ at 2 bits); calibrate with 'mse'"))
INT2_LSQ_Q4_0 = register(_grid("int2_lsq_q4_0", "lsq", -2, 1, "q4_0"))
TERNARY_SEQ = register(_grid("ternary_seq", "ternary", -1, 1, "tq2_0", fallback=_Q40.format("ternary_seq")))
TERNARY_SEQ_TQ1 = register(_grid("ternary_seq_tq1", "ternary", -1, 1, "tq1_0", fallback=_Q40.format("ternary_seq")))
TERNARY_SEQ_Q4_0 = register(_grid("ternary_seq_q4_0", "ternary", -1, 1, "q4_0"))
BINARY_SIGN = register(_grid("binary_sign", "sign", -1, 1, "tq2_0", fallback=_Q40.format("binary_sign")))
BINARY_SIGN_TQ1 = register(_grid("binary_sign_tq1", "sign", -1, 1, "tq1_0", fallback=_Q40.format("binary_sign")))
BINARY_SIGN_Q4_0 = register(_grid("binary_sign_q4_0", "sign", -1, 1, "q4_0"))
