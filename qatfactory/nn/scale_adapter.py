"""Scale-only adapters (Scale-QLoRA, arXiv 2609.04526): frozen 4-bit codes, trained block scales.

A native NVFP4 / MXFP4 checkpoint has no high-precision weights; each linear is

    codes  uint8 [out, in/2]   E2M1 pairs (buffer, frozen: never a parameter, never cast or partitioned)
    s0     uint8 [out, in/bs]  the checkpoint's block scale bytes (buffer)
    g      fp32 per-tensor scale (NVFP4; stored as int32 bits so a bf16 engine cannot cast it), frozen
           and therefore still shared across fused q/k/v and gate/up

and the only trainable tensor is a log2 offset per block, ``theta`` (dense [out, in/bs], or
low-rank ``U @ V`` with U [out, r] = 0 at the start). Every forward rounds the scales onto the
format's own grid with the format's own encoder (``Format.shift_scales``: E4M3 satfinite RNE for
nvfp4, ggml's UE4M3 for nvfp4_ggml, E8M0 byte + round(theta) for MXFP4) and multiplies the frozen
codes by them through the format's own ``dequantize``, so

    W = dequantize(codes, shift_scales(s0, theta), g)          theta = 0  ->  W is the checkpoint's

and the merge is writing those scale bytes: the codes ship byte for byte (qatfactory/native.py).

Gradient (``_ScaleFn``): straight-through on the scale rounding only, no STE on the weights:
dL/dtheta[o, b] = ln 2 * m[o, b] * sum_{j in b} G[o, j] * c[o, j], with G = dL/dW = gy^T x, c the
code values (``Format.code_values``) and m the block multiplier (``Format.block_multiplier``) of the
base scale times 2^theta (``ste="continuous"``, the default) or of the rounded one
(``ste="rounded"``). Blocks whose codes are all zero get zero gradient (a scale cannot revive
zeros); a block held at the grid's edge gets no gradient pushing it further out. Not fused: the
backward materializes G with one weight-gradient GEMM per layer and reduces it per block against
the frozen code values (a fused kernel could contract gy[t, o] * <c[o, b, :], x[t, b, :]> without
writing G); the forward dequantizes once and the backward once more (nothing weight-sized is saved).
"""
from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import PackedTensor, get_format

PARAMS = ("dense", "lowrank")
STES = ("continuous", "rounded")
_LN2 = math.log(2.0)
# the default trust region per scale grid: at most this fraction of the trained blocks may hold a scale byte
# that differs from the base's (limit_changed; why, and the measurements: its docstring)
E8M0_MAX_CHANGED = 0.001        # MXFP4: one step doubles or halves a whole block
E4M3_MAX_CHANGED = 0.01         # NVFP4: one step is 6-12 %
_MAX_CHANGED = {"e8m0": E8M0_MAX_CHANGED, "e4m3": E4M3_MAX_CHANGED, "ue4m3_ggml": E4M3_MAX_CHANGED}


@dataclass
class ScaleAdapterConfig:
    """Hydra schema ``method.scale`` (method=scale_adapter, train/methods/scale_adapter.py). ``target``: the format
    whose scale encoder rounds the trained scales, "auto" = the base's own (another must decode the
    base's bytes identically, else a format-mismatch error); ``param``: dense theta per block or low-rank
    U @ V (``rank``); ``ste``: gradient through the continuous or the rounded scale; ``targets``: fnmatch
    patterns of the 4-bit linears that train (the others stay at the base's bytes); ``task``: a label
    written into the scale file; ``max_changed``: the trust region of ``limit_changed`` (the most trained
    blocks whose byte may differ from the base, as a fraction), None = ``default_max_changed``."""

    target: str = "auto"
    param: str = "dense"
    rank: int = 8
    ste: str = "continuous"
    targets: List[str] = field(default_factory=lambda: ["*"])
    task: str = ""
    max_changed: Optional[float] = None

    def validate(self) -> "ScaleAdapterConfig":
        m = self.max_changed
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m <= 1.0):
            raise ValueError(f"method.scale.max_changed={m!r}; allowed: null (auto: {E8M0_MAX_CHANGED} on MXFP4's "
                             f"E8M0 grid, {E4M3_MAX_CHANGED} on NVFP4's E4M3) or a fraction in 0..1 (1 = no limit)")
        if m is not None and m < 1.0 and self.param != "dense":
            raise ValueError(f"method.scale.max_changed={m!r} needs method.scale.param=dense (a low-rank U @ V "
                             f"offset cannot be pulled back block by block); use max_changed=1 with lowrank")
        if self.param not in PARAMS:
            raise ValueError(f"method.scale.param={self.param!r}; allowed: {list(PARAMS)}")
        if self.ste not in STES:
            raise ValueError(f"method.scale.ste={self.ste!r}; allowed: {list(STES)}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"method.scale.rank={self.rank!r}; allowed: an int >= 1")
        if not list(self.targets):
            raise ValueError("method.scale.targets=[]; allowed: fnmatch patterns of module names (['*'] = all)")
        return self


class ScaleAdapterLinear(nn.Module):
    """y = x @ dequantize(codes, shift_scales(s0, theta), g)^T + bias, only theta trained."""

    def __init__(self, fmt: str, codes: torch.Tensor, scales: torch.Tensor, global_scale: Optional[torch.Tensor],
                 shape, bias: Optional[torch.Tensor] = None, param: str = "dense", rank: int = 8,
                 ste: str = "continuous", name: str = ""):
        super().__init__()
        if param not in PARAMS:
            raise ValueError(f"scale adapter: param={param!r}; allowed: {list(PARAMS)}")
        if ste not in STES:
            raise ValueError(f"scale adapter: ste={ste!r}; allowed: {list(STES)}")
        f = get_format(fmt)
        self.fmt_name = f.name
        self.out_features, self.in_features = int(shape[0]), int(shape[1])
        bs = f.spec.block_size
        nb = self.in_features // bs
        if codes.dtype != torch.uint8 or tuple(codes.shape) != (self.out_features, self.in_features // 2):
            raise ValueError(f"{name}: codes must be uint8 [{self.out_features}, {self.in_features // 2}], got "
                             f"{codes.dtype} {tuple(codes.shape)}")
        if scales.dtype != torch.uint8 or tuple(scales.shape) != (self.out_features, nb):
            raise ValueError(f"{name}: scale bytes must be uint8 [{self.out_features}, {nb}], got "
                             f"{scales.dtype} {tuple(scales.shape)}")
        self.qname, self.param, self.ste = name, param, ste
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales0", scales.clone().contiguous())    # set_scales writes into it
        self.has_global = global_scale is not None
        gb = torch.as_tensor(0.0 if global_scale is None else global_scale, dtype=torch.float32).reshape(())
        self.register_buffer("global_bits", gb.clone().view(torch.int32))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        dev = codes.device
        if param == "dense":
            self.theta = nn.Parameter(torch.zeros(self.out_features, nb, dtype=torch.float32, device=dev))
        else:
            if not isinstance(rank, int) or rank < 1:
                raise ValueError(f"scale adapter: rank={rank!r}; allowed: an int >= 1 (param=lowrank)")
            self.rank = rank
            self.U = nn.Parameter(torch.zeros(self.out_features, rank, dtype=torch.float32, device=dev))
            g = torch.Generator(device="cpu").manual_seed(zlib.crc32(name.encode()))   # the same on every rank
            self.V = nn.Parameter((torch.randn(rank, nb, generator=g) / math.sqrt(rank)).to(dev))

    def extra_repr(self) -> str:
        r = f", rank={self.rank}" if self.param == "lowrank" else ""
        return f"{self.fmt_name}, in={self.in_features}, out={self.out_features}, {self.param}{r}, ste={self.ste}"

    @property
    def fmt(self):
        return get_format(self.fmt_name)

    def global_scale(self) -> Optional[torch.Tensor]:
        return self.global_bits.view(torch.float32) if self.has_global else None

    def log2_offset(self) -> torch.Tensor:
        if self.param == "dense":
            return self.theta.float()
        return self.U.float() @ self.V.float()

    def packed_with(self, scales: torch.Tensor) -> PackedTensor:
        return PackedTensor(self.fmt_name, (self.out_features, self.in_features), self.codes, scales,
                            self.global_scale())

    @torch.no_grad()
    def scale_bytes(self) -> torch.Tensor:
        """The scale bytes the forward uses now (what a merge writes)."""
        return self.fmt.shift_scales(self.scales0, self.log2_offset())[0]

    @torch.no_grad()
    def packed(self) -> PackedTensor:
        return self.packed_with(self.scale_bytes())

    @torch.no_grad()
    def weight_now(self) -> torch.Tensor:
        """float32 [out, in]: the weight the forward multiplies by (the dequantized merged tensor)."""
        return self.fmt.dequantize(self.packed())

    @torch.no_grad()
    def stats(self) -> Dict[str, float]:
        t = self.log2_offset()
        if not bool(torch.isfinite(t).all()):
            raise FloatingPointError(f"{self.qname}: the scale offsets hold NaN/Inf (diverged); lower train.lr")
        b, clamped = self.fmt.shift_scales(self.scales0, t)
        return {"blocks": float(b.numel()), "changed": float((b != self.scales0).sum()),
                "clamped": float(clamped.sum()), "abs_theta_sum": float(t.abs().sum())}

    @torch.no_grad()
    def set_scales(self, scales: torch.Tensor) -> None:
        """Make ``scales`` the bytes theta is relative to and zero theta: the forward then uses exactly
        these bytes (a task swap, a rollback, or baking a trained offset in)."""
        s = torch.as_tensor(scales).to(self.scales0.device)
        if s.dtype != torch.uint8 or s.shape != self.scales0.shape:
            raise ValueError(f"{self.qname}: scale bytes must be uint8 {tuple(self.scales0.shape)}, got "
                             f"{s.dtype} {tuple(s.shape)}")
        self.scales0.copy_(s)
        for p in self.trainable():
            if p is not getattr(self, "V", None):
                p.zero_()

    def trainable(self) -> List[nn.Parameter]:
        return [self.theta] if self.param == "dense" else [self.U, self.V]

    _frozen: Optional[Dict[tuple, torch.Tensor]] = None   # frozen_weights(): dequantized weights by (dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.log2_offset()
        if torch.is_grad_enabled() and t.requires_grad:
            if self._frozen is not None:
                raise RuntimeError(f"{self.qname}: a training forward inside frozen_weights(): the offsets must not "
                                   f"change while dequantized weights are reused; leave the context first")
            return _ScaleFn.apply(x, t, self)
        key = (x.dtype, x.device)
        w = None if self._frozen is None else self._frozen.get(key)
        if w is None:
            with torch.no_grad():
                b = self.fmt.shift_scales(self.scales0, t)[0]
                w = self.fmt.dequantize(self.packed_with(b)).to(x.dtype)
            if self._frozen is not None:
                self._frozen[key] = w
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


class _ScaleFn(torch.autograd.Function):
    """Forward: dequantize with the rounded scales (exactly the merged tensor). Backward: the input
    gradient through W, and the block-scale gradient against the frozen codes (module docstring)."""

    @staticmethod
    def forward(ctx, x, t, mod: ScaleAdapterLinear):
        f = mod.fmt
        with torch.no_grad():
            b, clamped = f.shift_scales(mod.scales0, t.detach())
            w = f.dequantize(mod.packed_with(b))
            y = F.linear(x, w.to(x.dtype), None if mod.bias is None else mod.bias.to(x.dtype))
        ctx.save_for_backward(x, t, b, clamped)
        ctx.mod = mod
        return y

    @staticmethod
    def backward(ctx, gy):
        x, t, b, clamped = ctx.saved_tensors
        mod: ScaleAdapterLinear = ctx.mod
        f = mod.fmt
        p = mod.packed_with(b)
        gx = gt = None
        need_x, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = f.dequantize(p)
        if need_x:
            gx = gy.matmul(w.to(gy.dtype))
        if need_t:
            g2 = gy.reshape(-1, gy.shape[-1])
            x2 = x.reshape(-1, x.shape[-1])
            G = g2.t().matmul(x2.to(g2.dtype)).float()                     # dL/dW [out, in]
            bs = f.spec.block_size
            red = (G * f.code_values(p)).reshape(mod.out_features, -1, bs).sum(-1)
            if mod.ste == "continuous":
                m = f.block_multiplier(mod.packed_with(mod.scales0)) * torch.exp2(t.detach().float())
            else:
                m = f.block_multiplier(p)
            gt = (_LN2 * m * red).to(t.dtype)
            # at the grid's edge: no gradient that would push the offset further out
            tt = t.detach()
            out_hi = clamped & (tt > 0) & (gt < 0)
            out_lo = clamped & (tt < 0) & (gt > 0)
            gt = torch.where(out_hi | out_lo, torch.zeros_like(gt), gt)
        return gx, gt, None


# ----------------------------------------------------------------------------- model-level helpers
def modules(model: nn.Module) -> Dict[str, ScaleAdapterLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, ScaleAdapterLinear)}


def parameters(model: nn.Module) -> List[nn.Parameter]:
    return [p for m in modules(model).values() for p in m.trainable()]


@contextlib.contextmanager
def frozen_weights(model: nn.Module):
    """Inside, every adapted linear dequantizes its current weight once (per dtype and device) and reuses it:
    greedy generation re-runs the model once per token, and re-decoding every code plane each time cost the
    H200's NVFP4 scale arm minutes per evaluation. The weights are the ones the plain no-grad forward computes
    (the same function, once); a training forward inside raises, so the offsets cannot move under the cache."""
    mods = list(modules(model).values())
    for m in mods:
        m._frozen = {}
    try:
        yield model
    finally:
        for m in mods:
            m._frozen = None


@torch.no_grad()
def scale_stats(model: nn.Module) -> Dict[str, float]:
    """Fractions over every block of every adapted linear: scale byte differs from the base
    (``changed``), requested scale outside the grid (``saturated``); mean |theta|."""
    tot = {"blocks": 0.0, "changed": 0.0, "clamped": 0.0, "abs_theta_sum": 0.0}
    for m in modules(model).values():
        for k, v in m.stats().items():
            tot[k] += v
    n = max(tot["blocks"], 1.0)
    return {"scales/changed": tot["changed"] / n, "scales/saturated": tot["clamped"] / n,
            "scales/abs_theta": tot["abs_theta_sum"] / n, "scales/blocks": tot["blocks"]}


def default_max_changed(fmt_name: str, param: str = "dense") -> float:
    """``max_changed`` when the config leaves it None: E8M0_MAX_CHANGED on MXFP4's E8M0 grid, E4M3_MAX_CHANGED
    on NVFP4's E4M3 (either encoder); 1.0 (no limit) for a low-rank offset, which cannot be pulled back."""
    return _MAX_CHANGED.get(get_format(fmt_name).spec.scale_codec, 1.0) if param == "dense" else 1.0


@torch.no_grad()
def limit_changed(model: nn.Module, fraction: float) -> int:
    """A trust region on the scale bytes, applied after every optimizer step: at most ``fraction`` of the trained
    blocks may hold a byte that differs from the base's. The changed blocks with the largest |theta| keep their
    offsets; the others are pulled back inside their base byte's rounding interval (E8M0: |theta| <= 1/2, which
    rounds half to even onto the base byte; any other grid: halved until the byte is the base's). Returns how
    many offsets it pulled back (0: nothing to do). The forward, the merge and the scale file all read theta,
    so they agree with each other after it as before.

    Why (numbers in benchmarks/RESULTS.md): AdamW moves every offset whose gradient keeps its sign
    by about lr per step, whatever the gradient's size, and every block starts on the grid, so offsets reach
    their rounding boundary together: on E8M0 (boundary |theta| = 1/2 for every block) at step 1/(2 lr), each a
    factor of 2 on a whole block. H200, SmolLM2-135M MXFP4, batch 32, lr 2e-2, no limit: the loss flat for 25
    steps, then 1.7 -> 6.0 -> 10.8, held-out NLL 1.70 -> 4.18 with 32 % of the bytes changed; on CPU 17 % of
    the bytes flipped in one step. The gradient is right (single flips along it lower the loss, against it
    raise it), but many flips at once interact: flipping even the 100 blocks with the largest mean gradient
    raises the held-out NLL 1.77 -> 4.2. Under this limit the optimizer's largest offsets compete for few
    slots and a flip that hurts loses its slot (CPU, 30 steps: MXFP4 NLL 1.64 -> 1.22 at 0.1 %; NVFP4 1.35 ->
    1.09 at 1 %, where the unlimited run changed 47 % of its bytes and ended at the base's NLL)."""
    if fraction >= 1.0:
        return 0
    mods = [m for m in modules(model).values() if any(p.requires_grad for p in m.trainable())]
    low = [m.qname for m in mods if m.param != "dense"]
    if low:
        raise ValueError(f"limit_changed: {low[0]} has a low-rank offset (U @ V), which cannot be pulled back "
                         f"block by block; use max_changed=1 with param=lowrank")
    if not mods:
        return 0
    changed = [m.fmt.shift_scales(m.scales0, m.theta)[0] != m.scales0 for m in mods]
    n_changed = sum(int(c.sum()) for c in changed)
    k = int(fraction * sum(m.theta.numel() for m in mods))
    if n_changed <= k:
        return 0
    # rank the changed blocks by |theta|; exactly k keep theirs (ties broken by position, the same on every rank)
    score = torch.cat([torch.where(c, m.theta.detach().abs().float(), torch.full_like(m.theta, -1.0, dtype=torch.float32))
                       .reshape(-1) for m, c in zip(mods, changed)])
    keep = torch.zeros_like(score, dtype=torch.bool)
    if k > 0:
        keep[torch.topk(score, k, sorted=False).indices] = True
    pulled, o = 0, 0
    for m, c in zip(mods, changed):
        n = m.theta.numel()
        sel = c & ~keep[o:o + n].view_as(c).to(c.device)
        o += n
        if not bool(sel.any()):
            continue
        t = torch.where(sel, m.theta.clamp(-0.5, 0.5), m.theta)
        for _ in range(32):
            still = sel & (m.fmt.shift_scales(m.scales0, t)[0] != m.scales0)
            if not bool(still.any()):
                break
            t = torch.where(still, t * 0.5, t)
        else:
            t = torch.where(still, torch.zeros_like(t), t)
        m.theta.copy_(t)
        pulled += int(sel.sum())
    return pulled
