"""Learnable scales for the low-bit integer grids (formats/intgrid.py): ParetoQ's LSQ / SEQ / sign
quantizers with their gradients as released, the scale kept on the engine's grid.

    strategy   scale state                      forward
    learnable  Parameter ``alpha`` [G, R, n_g]  ParetoQ's quantizer on alpha rounded onto the format's
               (float32, ParetoQ's               fp16 scale grid (d = fmt.d_of_alpha(alpha), alpha_eff =
               ``weight_clip_val``)              fmt.alpha_of_d(d)); the rounding is straight-through
    frozen     buffer ``scales`` [G, R, n_g]    the format's quantizer on the stored fp16 scales
               (fp16 engine scales d)
    dynamic    none                             ParetoQ's init rule on the current weights each forward

n_g = 1 per row, or K / group. Gradients (ParetoQ ``utils_quant.py``, also torchao 0.18
``prototype/paretoq``; written here from its formulas, checked against it in tests/nn/test_lowbit.py), with
x = W / alpha_eff, N = the element count of the whole weight and g = 1/sqrt(N * Qp), Qp the integer
positive bound before SEQ redefines it (7, 3, 1 for 4/3/2-bit LSQ; 1 for SEQ and sign):

    LSQ     dW = dY where Qn <= x <= Qp;   dalpha = g * sum_row dY * (Qn if x < Qn, Qp if x > Qp,
                                                                    round(x) - x inside)
    SEQ     dW = dY where |x| <= 0.99;     dalpha = g * sum_row dY * (-Q if x < -0.99, Q if x > 0.99,
                                                                    level(x) - x inside)
            Q = 3/4 (2 bits) and Q = 1 for ternary although its outer level is 2/3: the released quirk.
            ``grad_rule="clean"`` uses 2/3 there (and changes nothing else).
    sign    dW = dY where |x| <= 1;        dalpha = g * sum_row dY * sign(W)

The products are formed in ParetoQ's order ((indicator terms) * dY * g, then the row sum), so the
gradients equal the released code's for the same float32 inputs. The optimizer sees alpha like any
other parameter (ParetoQ: same AdamW group, no weight decay of its own).

Calibration (``init_state``): ``max`` = ParetoQ's initialisation (max|W|/Qp for LSQ, max|W| for SEQ,
mean|W| for sign); ``mse`` = per row (group) the alpha among ``MSE_STEPS`` multiples of that init with
the least squared error of the rounded grid (for sign, mean|W| is already the MSE optimum).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..formats import get_format
from ..formats.intgrid import C23, IntGrid
from .fake_quant import WeightQuantizer

GRAD_RULES = ("released", "clean")
INIT_METHODS = ("max", "mse")
MSE_STEPS = torch.linspace(0.05, 1.25, 61)


def is_lowbit(fmt_name: str) -> bool:
    return isinstance(get_format(fmt_name), IntGrid)


def make_weight_quantizer(fmt_name: str, strategy: str, shape3, ste: str = "identity", device=None):
    """The quantizer module a QuantLinear holds for its weight: LowBitQuantizer for the ParetoQ grids,
    the E2M1 / ggml WeightQuantizer for every other format."""
    if is_lowbit(fmt_name):
        return LowBitQuantizer(fmt_name, strategy, shape3, ste, device=device)
    return WeightQuantizer(fmt_name, strategy, shape3, ste, device=device)


def grad_scale(fmt: IntGrid, numel: int) -> float:
    """ParetoQ's g = 1/sqrt(N * Qp), Qp = 2^(b-1) - 1 for LSQ, 1 for SEQ and sign."""
    qp = fmt.qp if fmt.family == "lsq" else 1
    return 1.0 / math.sqrt(numel * qp)


def paretoq_grads(fmt: IntGrid, wg: torch.Tensor, a: torch.Tensor, go: torch.Tensor, g, clean: bool):
    """ParetoQ's backward (module docstring) on float32 ``wg`` [..., n_g, n] (W viewed per scale group),
    ``a`` [..., n_g] (alpha_eff), ``go`` like wg (dL/dW_q), ``g`` the gradient scale (a float, or a float32
    tensor broadcasting against [..., n_g, 1]: one value per row in a batched call, the same float32 value
    the scalar would be rounded to). Returns (dW like wg, float32; dalpha [..., n_g], float32). Every
    element and every row sum is computed as in a call on that row alone (rows never mix)."""
    x = torch.div(wg, a.unsqueeze(-1))
    if fmt.family == "lsq":
        lo, hi = float(fmt.qn), float(fmt.qp)
        small, big = (x < lo).float(), (x > hi).float()
        mid = 1.0 - small - big
        term = small * lo + big * hi + mid * (-x + x.round())
    elif fmt.family == "sign":
        mid = 1.0 - (x < -1).float() - (x > 1).float()
        term = wg.sign()
    else:
        clip = 0.99
        small, big = (x < -clip).float(), (x > clip).float()
        mid = 1.0 - small - big
        c = torch.clamp(x, -clip, clip)
        if fmt.family == "seq2":
            q, level = 0.75, (torch.round(c * 2 - 0.5) + 0.5) / 2
        else:
            q, level = (float(C23) if clean else 1.0), torch.round(c * 1.5) / 1.5
        term = small * -q + big * q + mid * (-x + level)
    return mid * go, torch.sum(term * go * g, dim=-1)


def scales_of(fmt: IntGrid, alpha: torch.Tensor):
    """(d, alpha_eff): the fp16 engine scales of a learned alpha and the alpha ParetoQ's forward sees."""
    d = fmt.d_of_alpha(alpha)
    return d, fmt.alpha_of_d(d)


class _ParetoQ(torch.autograd.Function):
    """y = code(W, alpha_eff) * d with d = fmt.d_of_alpha(alpha); ParetoQ's backward (module docstring).
    One call per linear: the path outside the trainer (the trainer batches all linears of a format and
    row length into one call per forward, nn/lowbit_batch.py; same values). Host syncs: one (the
    finite check of W)."""

    @staticmethod
    def forward(ctx, w, alpha, fmt, g, clean):
        shp = (*alpha.shape, w.shape[-1] // alpha.shape[-1])
        wf = w.detach().float()
        fmt.check_finite(fmt.name, wf)
        d, a = scales_of(fmt, alpha)
        y = fmt.fake_values(wf.reshape(shp), a, d).reshape(w.shape)
        # W itself, not its float32 copy: the backward converts again (exact from any float dtype)
        ctx.save_for_backward(w, a)
        ctx.fmt, ctx.g, ctx.clean = fmt, g, clean
        return y.to(w.dtype)

    @staticmethod
    def backward(ctx, gy):
        w, a = ctx.saved_tensors
        wg = w.detach().float().reshape(*a.shape, -1)
        gw, ga = paretoq_grads(ctx.fmt, wg, a, gy.float().reshape(wg.shape), ctx.g, ctx.clean)
        return gw.reshape(gy.shape).to(gy.dtype), ga, None, None, None


class LowBitQuantizer(nn.Module):
    """Fake-quantizes a weight viewed as [G, R, K] on a ParetoQ grid (same interface as WeightQuantizer)."""

    uses_imatrix = False

    def __init__(self, fmt_name: str, strategy: str, shape3, ste: str = "identity", device=None):
        super().__init__()
        self.fmt_name, self.strategy, self.ste = fmt_name, strategy, ste
        self.shape3 = tuple(int(s) for s in shape3)
        self.grad_rule = "released"
        G, R, K = self.shape3
        fmt = self.fmt
        fmt.check_input(torch.empty(0, K))
        ng = fmt.n_groups(K)
        if strategy == "learnable":
            self.alpha = nn.Parameter(torch.ones(G, R, ng, dtype=torch.float32, device=device))
        elif strategy == "frozen":
            self.register_buffer("scales", torch.ones(G, R, ng, dtype=torch.float16, device=device))
        elif strategy != "dynamic":
            raise ValueError(f"scale_strategy={strategy!r}; allowed: 'dynamic', 'frozen', 'learnable'")

    @property
    def fmt(self) -> IntGrid:
        return get_format(self.fmt_name)

    def extra_repr(self) -> str:
        return f"{self.fmt_name}, strategy={self.strategy}, shape={self.shape3}, grad={self.grad_rule}"

    def bits(self) -> float:
        return self.fmt.spec.bits_per_weight

    # -- state ------------------------------------------------------------------------------
    def scale_bytes(self) -> Optional[torch.Tensor]:
        """The fp16 engine scales d [G, R, n_g] the forward uses (None for dynamic)."""
        if self.strategy == "learnable":
            return self.fmt.d_of_alpha(self.alpha)
        if self.strategy == "frozen":
            return self.scales
        return None

    @torch.no_grad()
    def init_state(self, w3: torch.Tensor, method: str = "max") -> None:
        """Scale init from the weights (calibrate): ParetoQ's rule or an MSE search around it."""
        if method not in INIT_METHODS:
            raise ValueError(f"calibrate: method={method!r} for the low-bit grid {self.fmt_name!r}; "
                             f"allowed: {list(INIT_METHODS)}")
        if self.strategy == "dynamic":
            if method != "max":
                raise ValueError(f"calibrate: method={method!r} produces fixed scales, but {self.fmt_name} uses "
                                 f"scale_strategy='dynamic'; allowed: 'max', or scale_strategy frozen / learnable")
            return
        a = self.search_alpha(w3, method)
        if self.strategy == "learnable":
            self.alpha.copy_(a)
        else:
            self.scales.copy_(self.fmt.d_of_alpha(a))

    @torch.no_grad()
    def search_alpha(self, w3: torch.Tensor, method: str) -> torch.Tensor:
        fmt = self.fmt
        K = w3.shape[-1]
        wg = fmt._grouped(w3.detach().float(), K)
        a0 = fmt.init_alpha(wg)
        if method == "max" or fmt.family == "sign":
            return a0
        best, best_err = a0, None
        for s in MSE_STEPS.tolist():
            a = a0 * s
            d = fmt.d_of_alpha(a)
            y = fmt.codes(wg, fmt.alpha_of_d(d)).float() * d.float().unsqueeze(-1)
            err = ((y - wg) ** 2).sum(-1)
            if best_err is None:
                best, best_err = a, err
            else:
                better = err < best_err
                best, best_err = torch.where(better, a, best), torch.where(better, err, best_err)
        return best

    # -- forward / pack ---------------------------------------------------------------------
    def forward(self, w3: torch.Tensor, amax_dyn: Optional[torch.Tensor] = None) -> torch.Tensor:
        fmt = self.fmt
        if self.strategy == "learnable":
            return _ParetoQ.apply(w3, self.alpha, fmt, grad_scale(fmt, w3[0].numel()), self.grad_rule == "clean")
        K = w3.shape[-1]
        sc = self.scale_bytes()
        # ParetoQ's clipped STE for the weights (pass region of the grid), frozen or recomputed scales
        y = fmt.fake_quantize(w3.reshape(-1, K), ste="clipped",
                              **({} if sc is None else {"scales": sc.reshape(-1, sc.shape[-1])}))
        return y.reshape(w3.shape)

    @torch.no_grad()
    def pack(self, w3: torch.Tensor, g: int, r0: int, r1: int, amax_dyn: Optional[torch.Tensor] = None):
        """PackedTensor of rows r0:r1 of group g, exactly as the forward quantized them."""
        sc = self.scale_bytes()
        return self.fmt.quantize(w3[g, r0:r1].detach(), **({} if sc is None else {"scales": sc[g, r0:r1]}))
