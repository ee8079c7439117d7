"""Weight and activation quantizers: the format's own fake quant, with its state as buffers.

Every quantizer delegates the numerics to ``qatfactory.formats`` (``fake_quantize`` /
``quantize`` / ``dequantize``), so the training forward is, by construction, the dequantized
value of what ``convert`` packs. What lives here is the *state* and where it comes from:

    strategy   per-tensor amax [G]            block scales [G, R, K/block]
    dynamic    from the current weights        computed by the format each forward
    frozen     buffer ``amax`` (calibrated)    buffer ``scales`` uint8 (format's scale bytes)
    learnable  buffer ``amax``                 Parameter ``scale`` (float, LSQ), rounded onto the
                                               format's own scale grid (E4M3 / E8M0) each forward

G is the number of per-tensor scale groups: 1 for a linear, E for fused 3-D experts (one NVFP4
global scale per expert, as vLLM's ``w13_weight_scale_2 [E, 2]``/``w2_weight_scale_2 [E]``).
"""
from __future__ import annotations

import inspect
import math
from typing import Callable, Optional

import torch
from torch import nn

from .. import kernels
from ..formats import codecs as C
from ..formats import get_format, list_formats
from ..formats.scale_search import GRID_CODECS as _GRID_CODECS  # the one-byte block-scale grids
from ..formats.scale_search import scale_grid

E2M1_QMAX = 6.0
# the hook of the trainer's optimizer steps for quantizers that keep k-quant scales between searches
# (refresh_every > 1): rule(quantizer, w3, imatrix) -> the fake-quantized w3, or None for the full search.
# Set only while a step runs (nn/kquant_refresh.py installs it), so everything else -- evaluation,
# calibration, export, a user's own forward -- runs the full search.
_STEP_RULE: dict = {"rule": None}


def set_step_rule(rule: Optional[Callable]) -> Optional[Callable]:
    """Install the optimizer-step rule (None: none); returns the previous one."""
    prev = _STEP_RULE["rule"]
    _STEP_RULE["rule"] = rule
    return prev


def has_global_scale(fmt) -> bool:
    return fmt.spec.global_scale is not None


def takes_imatrix(fmt) -> bool:
    """llama.cpp types whose quantizer weighs columns by an importance matrix (q4_k, q6_k, ...)."""
    if fmt.spec.ggml_type is None:
        return False
    return "imatrix" in inspect.signature(fmt.quantize).parameters


def grid_formats():
    return [n for n in list_formats() if scale_grid(get_format(n)) and get_format(n).spec.role != "activation"]


def encode_grid(s: torch.Tensor, grid: str) -> torch.Tensor:
    """Round float block scales onto the format's scale grid -> uint8 scale bytes."""
    s = s.detach().float()
    if grid == "e4m3":
        # byte 0 is refused by the formats (a zero scale cannot hold a block); 2^-9 is the least
        return C.e4m3_encode(s.clamp(C.E4M3_MIN_SUBNORMAL, C.E4M3_MAX))
    if grid == "e8m0":
        e = torch.round(torch.log2(s.clamp(min=2.0 ** -127))).clamp(-127, 127)
        return (e + 127).to(torch.uint8)
    raise ValueError(f"scale grid {grid!r}; allowed: {list(_GRID_CODECS)}")


def decode_grid(b: torch.Tensor, grid: str) -> torch.Tensor:
    if grid == "e4m3":
        return C.e4m3_decode(b)
    if grid == "e8m0":
        return C.e8m0_decode(b)
    raise ValueError(f"scale grid {grid!r}; allowed: {list(_GRID_CODECS)}")


def _bcast(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.reshape(*t.shape, *([1] * (ndim - t.ndim)))


def quant_kwargs(fmt, amax=None, scales=None, imatrix=None):
    """Only the keywords the format has the concept of."""
    kw = {}
    if amax is not None and has_global_scale(fmt):
        kw["amax"] = amax
    if scales is not None:
        kw["scales"] = scales
    if imatrix is not None:
        kw["imatrix"] = imatrix
    return kw


class _LSQ(torch.autograd.Function):
    """y = dequant(quantize(w, scales=grid(s / g))); LSQ gradient for s, clipped STE for w.

    s is the effective block step (decode value, per-tensor scale g included), the quantity
    LSQ learns; the forward rounds s / g onto the format's scale grid. With d the rounded step
    and v = w / d:
        dy/dw = 1 where |v| <= Qmax else 0
        dy/ds = round(v) - v inside, round(v) outside (saturated), summed over the block,
    times LSQ's gradient scale 1/sqrt(block * Qmax). The grid rounding is straight-through."""

    @staticmethod
    def forward(ctx, w, s, gscale, amax, fmt, grid, grad_scale):
        gb = _bcast(gscale.float(), s.ndim)
        sb = encode_grid(s.detach() / gb, grid)
        p = fmt.quantize(w.detach(), **quant_kwargs(fmt, amax=amax, scales=sb))
        y = fmt.dequantize(p)
        d = decode_grid(sb, grid) * gb
        ctx.save_for_backward(w, y, d)
        ctx.grad_scale = grad_scale
        return y.to(w.dtype)

    @staticmethod
    def backward(ctx, gy):
        w, y, d = ctx.saved_tensors
        nb = d.shape[-1]
        shp = (*d.shape, w.shape[-1] // nb)
        wb = w.float().reshape(shp)
        yb = y.reshape(shp)
        gyb = gy.float().reshape(shp)
        d4 = d.unsqueeze(-1)
        ok = d4 > 0
        v = torch.where(ok, wb / torch.where(ok, d4, torch.ones_like(d4)), torch.zeros_like(wb))
        q = torch.where(ok, yb / torch.where(ok, d4, torch.ones_like(d4)), torch.zeros_like(yb))
        inside = v.abs() <= E2M1_QMAX
        gw = (gyb * inside).reshape(w.shape).to(w.dtype)
        gs = (gyb * (q - torch.where(inside, v, torch.zeros_like(v)))).sum(-1) * ctx.grad_scale
        return gw, gs, None, None, None, None, None


class WeightQuantizer(nn.Module):
    """Fake-quantizes a weight viewed as [G, R, K] (G per-tensor scale groups)."""

    # > 1: the k-quant scale search runs every this many optimizer steps (state: nn/kept_scales.py)
    refresh_every = 1

    def __init__(self, fmt_name: str, strategy: str, shape3, ste: str = "identity", device=None):
        super().__init__()
        self.fmt_name = fmt_name
        self.strategy = strategy
        self.ste = ste
        self.shape3 = tuple(int(s) for s in shape3)
        fmt = self.fmt
        G, R, K = self.shape3
        fmt.check_input(torch.empty(0, K))
        # ggml types: per-column importance (llama-imatrix's mean x^2), filled by calibrate;
        # all zeros = none given, the engine's plain quantizer
        self.uses_imatrix = takes_imatrix(fmt) and G == 1
        if self.uses_imatrix:
            self.register_buffer("imatrix", torch.zeros(K, dtype=torch.float32, device=device))
        if strategy != "dynamic":
            if scale_grid(fmt) is None:
                raise NotImplementedError(
                    f"scale_strategy={strategy!r} is not supported for format {fmt_name!r} (its block scales are "
                    f"not one byte on an E4M3/E8M0 grid); supported formats: {grid_formats()}; use 'dynamic'")
            nb = K // fmt.spec.block_size
            self.register_buffer("amax", torch.zeros(G, dtype=torch.float32, device=device))
            if strategy == "frozen":
                self.register_buffer("scales", torch.zeros(G, R, nb, dtype=torch.uint8, device=device))
            else:
                # the learned effective block step (decode value incl. the per-tensor scale)
                self.scale = nn.Parameter(torch.ones(G, R, nb, dtype=torch.float32, device=device))
                self.register_buffer("gscale", torch.ones(G, dtype=torch.float32, device=device))

    @property
    def fmt(self):
        return get_format(self.fmt_name)

    def extra_repr(self) -> str:
        return f"{self.fmt_name}, strategy={self.strategy}, shape={self.shape3}"

    # -- state ------------------------------------------------------------------------------
    def scale_bytes(self) -> Optional[torch.Tensor]:
        if self.strategy == "frozen":
            return self.scales
        if self.strategy == "learnable":
            return encode_grid(self.scale / _bcast(self.gscale, self.scale.ndim), scale_grid(self.fmt))
        return None

    @torch.no_grad()
    def set_state(self, amax: torch.Tensor, scale_bytes: torch.Tensor) -> None:
        """Install calibrated per-tensor amax [G] and block-scale bytes [G, R, K/block]."""
        if self.strategy == "dynamic":
            return
        self.amax.copy_(amax.float().reshape(self.amax.shape))
        if self.strategy == "frozen":
            self.scales.copy_(scale_bytes)
        else:
            fmt = self.fmt
            if has_global_scale(fmt):   # the format's own g for this amax (its guards included)
                probe = torch.zeros(self.shape3[0], 1, fmt.spec.block_size, device=self.amax.device)
                self.gscale.copy_(fmt.quantize(probe, amax=self.amax).global_scale.float().reshape(-1))
            g = _bcast(self.gscale, self.scale.ndim)
            self.scale.copy_(decode_grid(scale_bytes, scale_grid(fmt)) * g)

    def _imatrix(self):
        if self.uses_imatrix and bool(self.imatrix.any()):
            return self.imatrix
        return None

    def _amax(self, amax_dyn):
        return amax_dyn if self.strategy == "dynamic" else self.amax

    # -- forward / pack ---------------------------------------------------------------------
    def forward(self, w3: torch.Tensor, amax_dyn: Optional[torch.Tensor] = None) -> torch.Tensor:
        fmt = self.fmt
        amax = self._amax(amax_dyn)
        if self.strategy == "learnable":
            grid = scale_grid(fmt)
            gs = 1.0 / math.sqrt(fmt.spec.block_size * E2M1_QMAX)
            return _LSQ.apply(w3, self.scale, self.gscale, amax, fmt, grid, gs)
        rule = _STEP_RULE["rule"] if self.refresh_every > 1 else None
        y = None if rule is None else rule(self, w3, self._imatrix())
        if y is not None:
            return y
        # the fused CUDA kernel on GPU, the format's torch emulator elsewhere (bit-identical)
        return kernels.fake_quantize(w3, fmt.name, ste=self.ste, **quant_kwargs(
            fmt, amax=amax, scales=self.scale_bytes(), imatrix=self._imatrix()))

    @torch.no_grad()
    def pack(self, w3: torch.Tensor, g: int, r0: int, r1: int, amax_dyn: Optional[torch.Tensor] = None):
        """PackedTensor of rows r0:r1 of group g, exactly as the forward quantized them."""
        fmt = self.fmt
        amax = self._amax(amax_dyn)
        sb = self.scale_bytes()
        return fmt.quantize(w3[g, r0:r1].detach(), **quant_kwargs(
            fmt, amax=None if amax is None else amax[g], scales=None if sb is None else sb[g, r0:r1],
            imatrix=self._imatrix()))

    def bits(self) -> float:
        return self.fmt.spec.bits_per_weight


class ActQuantizer(nn.Module):
    """Input fake quant for W4A4 with the serving engine's runtime rule.

    Formats with a per-tensor scale (nvfp4_act) use the static calibrated ``amax`` buffer, as
    vLLM loads ``input_scale``; MX formats need none (scales come from each block)."""

    def __init__(self, fmt_name: str, device=None):
        super().__init__()
        self.fmt_name = fmt_name
        self.register_buffer("amax", torch.zeros((), dtype=torch.float32, device=device))
        self.calibrating = False
        self.owner = ""
        # the static amax was seen > 0 (checked once: reading a CUDA buffer syncs the host)
        self._amax_ok = False

    def _load_from_state_dict(self, *args, **kwargs):
        self._amax_ok = False
        return super()._load_from_state_dict(*args, **kwargs)

    @property
    def fmt(self):
        return get_format(self.fmt_name)

    @property
    def static(self) -> bool:
        return has_global_scale(self.fmt)

    def extra_repr(self) -> str:
        return f"{self.fmt_name}, amax={float(self.amax):.6g}" if self.static else self.fmt_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calibrating:
            self._amax_ok = False
            if x.numel():
                self.amax.copy_(torch.maximum(self.amax, x.detach().abs().amax().float()))
            return x
        if x.numel() == 0:
            return x
        fmt = self.fmt
        if self.static:
            if not self._amax_ok and not float(self.amax) > 0:
                raise RuntimeError(f"{self.owner or 'ActQuantizer'}: W4A4 activation format {self.fmt_name!r} uses "
                                   f"a static calibrated amax, which is not set; run "
                                   f"qatfactory.quantize.calibrate(model, batches) first")
            self._amax_ok = True
            return kernels.fake_quantize(x, fmt.name, amax=self.amax)
        return kernels.fake_quantize(x, fmt.name)
