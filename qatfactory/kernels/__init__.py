"""Fused CUDA fake-quant kernels (csrc/), registered as torch custom ops, with the torch
emulator of qatfactory.formats as the fallback.

    from qatfactory import kernels
    y = kernels.fake_quantize(w, "nvfp4")                 # dynamic amax: 2 launches
    y = kernels.fake_quantize(w, "nvfp4", amax=a)         # supplied amax: 1 launch
    y = kernels.fake_quantize(a, "mxfp4", ste="clipped")
    p = kernels.quantize(w, "nvfp4")                      # codes + scales on the GPU
    b = kernels.quantize_bytes(w, "q4_k")                 # the GGUF records, on the GPU

``fake_quantize(x, fmt, ste="identity", **kw)`` mirrors ``Format.fake_quantize``: same
result bit for bit (the kernels follow the emulator's float32 operation order; the CUDA
tests check kernel == emulator == numpy reference), same straight-through gradients
(``ste="clipped"`` zeroes the gradient where the format saturated x). It takes the CUDA path
when x is a CUDA tensor, the format has a kernel (``kernel_formats()``), CuPy and the sources
are there, and only kwargs the kernel implements are given (``amax=`` for nvfp4/nvfp4_act);
otherwise the emulator runs, and the first fallback for a given reason logs ONE line saying
why (a CPU-only machine logs exactly one line per process).

The ops (``torch.ops.qatfactory.*``) launch on ``torch.cuda.current_stream()`` and allocate
with torch, so they work under autograd, torch.compile (opaque custom ops with fake-tensor
rules) and CUDA graph capture. The CUDA path never synchronises with the host; therefore it
does not validate values the way the emulator does (NaN/Inf inputs, a negative amax): a NaN
in a block gives that block a NaN scale (MX: byte 0xFF) instead of an exception.

NVFP4 (nvfp4, nvfp4_act) forward and quantize-only run ``nvfp4_qdq16``: one thread per
16-element block, the per-tensor constants precomputed per group by a one-thread-per-group
launch (``nvfp4_consts``); weights read their own 32 bytes per thread (v2), activations use the
warp-coalesced lane-exchange layout (v2x); the clipped-STE backward stays on the original
``fp4_qdq`` (v1), which was faster there. ``set_nvfp4_kernel`` (the trainer: ``train.nvfp4_kernel``) or,
for code outside the trainer such as benchmarks, ``QF_NVFP4_KERNEL=v1|v2|v2x`` forces one (see
``nvfp4_kernel_version``); all give the same bits.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from ..formats import codecs as C
from ..formats import get_format, list_formats
from ..formats.layouts import ScaleRule, TieRule
from ..formats.spec import PackedTensor
from . import loader

log = logging.getLogger("qatfactory.kernels")

# E2M1 formats: the kernel reads block size and tie rule from the FormatSpec, and picks the
# scale rule of csrc/fp4_qdq.cu that implements the spec's typed `scale_rule` (so a new registry
# entry reusing a rule gets the kernel). Value: (RULE id, sign-of-zero mode NEGZ:
# 0 ggml's +0, 1 ModelOpt's (v < 0), 2 the sign bit of v). RULE 0 and 1 take a per-tensor amax.
_FP4_SCALE_RULES: Dict[ScaleRule, Tuple[int, int]] = {
    ScaleRule.NVFP4_MODELOPT: (0, 1),
    ScaleRule.NVFP4_VLLM_ACT: (1, 2),
    ScaleRule.MX_FLOOR: (2, 2),
    ScaleRule.MX_RCEIL: (3, 2),
    ScaleRule.MX_EVEN: (4, 2),
    ScaleRule.MX_GGML: (5, 0),
}
_TIE = {TieRule.RNE: 0, TieRule.TOWARD_ZERO: 1, TieRule.ARGMIN_FIRST: 1}


def _fp4_rule(fmt: str) -> Optional[Tuple[int, int]]:
    spec = get_format(fmt).spec
    if spec.element != "e2m1" or spec.block_size not in (16, 32) or not isinstance(spec.tie_rule, TieRule) \
            or not isinstance(spec.scale_rule, ScaleRule):
        return None
    return _FP4_SCALE_RULES.get(spec.scale_rule)


def _takes_amax(fmt: str) -> bool:
    """An E2M1 kernel rule with a per-tensor amax (the NVFP4 rules: RULE 0 and 1)."""
    r = _fp4_rule(fmt)
    return r is not None and r[0] <= 1


# ggml integer formats: the kernel of csrc/kquant_qdq.cu that implements the spec's typed scale rule
# (the whole quantizer of that ggml type); the block geometry comes from the spec: elements per thread =
# spec.block_size (one sub-block), record bytes / elements = spec.bytes_per_block / spec.super_block
_GGML_KERNELS: Dict[ScaleRule, str] = {ScaleRule.Q4_K: "q4k_qdq", ScaleRule.Q6_K: "q6k_qdq", ScaleRule.Q5_0: "q50_qdq"}


_GGML_OF: Dict[object, Optional[Tuple[str, int, int, int]]] = {}   # per Format object (the hot path looks up)


def _ggml_kernel(fmt: str) -> Optional[Tuple[str, int, int, int]]:
    """(kernel, elements per thread, record bytes, elements per record) of a ggml format, or None."""
    f = get_format(fmt)
    if f not in _GGML_OF:
        spec = f.spec
        kern = _GGML_KERNELS.get(spec.scale_rule) if isinstance(spec.scale_rule, ScaleRule) and \
            spec.ggml_type is not None else None
        _GGML_OF[f] = None if kern is None else (kern, spec.block_size, spec.bytes_per_block, spec.super_block)
    return _GGML_OF[f]
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_THREADS = 256
Q4K_MIN_BLOCKS = 2      # q4_k register budget: __launch_bounds__(256, Q4K_MIN_BLOCKS); see csrc
_warned: set = set()
_PARAMS: Dict[str, Tuple[int, int, int, int]] = {}
# tests set this: outputs start as NaN / 0xFF, so an element a kernel fails to write shows
POISON_OUTPUTS = False


def _out(shape, dtype, device) -> torch.Tensor:
    if not POISON_OUTPUTS:
        return torch.empty(shape, dtype=dtype, device=device)
    fill = 0xFF if dtype == torch.uint8 else float("nan")
    return torch.full(shape, fill, dtype=dtype, device=device)


def kernel_formats():
    """Names of the registered formats that have a CUDA kernel."""
    return sorted(n for n in list_formats() if _ggml_kernel(n) is not None or _fp4_rule(n) is not None)


def _fallback(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("qatfactory.kernels: CUDA fake-quant kernels not used (%s); running the torch emulator",
                    reason)


def _fp4_params(fmt: str) -> Tuple[int, int, int, int]:
    """(block, rule, tie, negz) for an E2M1 format, block and tie from its spec."""
    p = _PARAMS.get(fmt)
    if p is None:
        spec = get_format(fmt).spec
        rule, negz = _fp4_rule(fmt)
        p = _PARAMS[fmt] = (spec.block_size, rule, _TIE[spec.tie_rule], negz)
    return p


_WHY: Dict[tuple, Optional[str]] = {}


def why_not(x: torch.Tensor, fmt: str, ste: str = "identity", **kw) -> Optional[str]:
    """None when fake_quantize(x, fmt, ste, **kw) would take the CUDA path, else the reason."""
    ok, reason = loader.probe()
    if not ok:
        return reason
    if not isinstance(x, torch.Tensor) or not x.is_cuda:
        return "input is not a CUDA tensor"
    # the rest depends on (format, STE, dtype, which keywords are given) alone: decided once per key
    key = (fmt, ste, x.dtype, tuple(sorted(k for k, v in kw.items() if v is not None)))
    r = _WHY.get(key, _WHY)
    if r is _WHY:
        r = _WHY[key] = _why_not_kernel(*key)
    return r


def _why_not_kernel(fmt: str, ste: str, dtype, extra) -> Optional[str]:
    if dtype not in _DT:
        return f"dtype {dtype} (kernels take float32, bfloat16, float16)"
    ggml = _ggml_kernel(fmt) is not None
    if not ggml and _fp4_rule(fmt) is None:
        return f"format {fmt!r} has no kernel (kernels: {kernel_formats()})"
    allowed = {"amax"} if _takes_amax(fmt) else set()
    if set(extra) - allowed:
        return f"{fmt}: argument(s) {sorted(set(extra) - allowed)} are handled by the emulator only"
    if ste == "clipped" and ggml:
        return f"{fmt}: clipped STE is computed by the emulator"
    return None


# =============================================================================== launches
def _check_shape(x: torch.Tensor, fmt: str) -> None:
    get_format(fmt).check_input(x)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _launch_absmax(x: torch.Tensor, prefix_dims: int) -> torch.Tensor:
    lead = tuple(x.shape[:prefix_dims])
    groups = max(1, math.prod(lead))
    out = torch.zeros(groups, dtype=torch.float32, device=x.device)
    n_vec = x.numel() * x.element_size() // 16
    if n_vec:
        gv = n_vec // groups
        gx = min(max(1, (gv + _THREADS - 1) // _THREADS), 4096)
        loader.launch("fp4_qdq.cu", f"absmax_groups<{_DT[x.dtype]}>", x.device, (gx, groups), _THREADS,
                      (loader.ptr(x), loader.ptr(out), np.int64(gv)))
    return out.reshape(lead)


def _amax_group(x: torch.Tensor, amax: Optional[torch.Tensor], block: int) -> Tuple[Optional[torch.Tensor], int]:
    if amax is None:
        return None, 1
    a = amax.reshape(-1)
    lead = x.shape[:amax.ndim]
    if tuple(amax.shape) != tuple(lead):
        raise ValueError(f"amax of shape {tuple(amax.shape)} does not fit x of shape {tuple(x.shape)}; "
                         f"allowed: a scalar, or a prefix of x.shape[:-1]")
    bpg = max(1, x.numel() // max(1, a.numel()) // block)
    return a, bpg


def _launch_fp4(x, fmt, amax, mode, g=None):
    block, rule, tie, negz = _fp4_params(fmt)
    x = _aligned(x)
    K = x.shape[-1]
    n_vec = x.numel() * x.element_size() // 16
    y = _out(x.shape, x.dtype, x.device) if mode & 5 else None
    codes = scales = None
    if mode & 2:
        codes = _out((*x.shape[:-1], K // 2), torch.uint8, x.device)
        scales = _out((*x.shape[:-1], K // block), torch.uint8, x.device)
    if rule <= 1 and amax is None:
        raise ValueError(f"{fmt}: the kernel needs the per-tensor amax (the wrapper computes it)")
    a, bpg = _amax_group(x, amax, block) if rule <= 1 else (None, 1)
    if a is not None:
        a = a.to(device=x.device, dtype=torch.float32).contiguous()
    if g is not None:
        g = _aligned(g.to(x.dtype))
    if not n_vec:
        return y, codes, scales
    version = nvfp4_kernel_version() if (rule <= 1 and block == 16) else "v1"
    if version == "auto":
        # the fastest measured on an H200 (benchmarks/RESULTS.md), all bit-identical: the clipped-STE
        # backward on v1 (93% of copy vs 88%), activations (RULE 1) on v2x, weights on v2
        version = "v1" if mode & 4 else ("v2x" if rule == 1 else "v2")
    if version == "v1":
        expr = f"fp4_qdq<{_DT[x.dtype]},{block},{rule},{tie},{negz},{mode}>"
        grid = (n_vec + _THREADS - 1) // _THREADS
        loader.launch("fp4_qdq.cu", expr, x.device, grid, _THREADS,
                      (loader.ptr(x), loader.ptr(y), loader.ptr(g), loader.ptr(codes), loader.ptr(scales),
                       loader.ptr(a), np.int64(n_vec), np.int64(bpg)))
        return y, codes, scales
    # NVFP4 v2: the per-group constants (g, 6g / 1/S ...) once per group, then one thread per block
    groups = a.numel()
    gc = torch.empty((groups, 4), dtype=torch.float32, device=x.device)
    loader.launch("fp4_qdq.cu", f"nvfp4_consts<{rule}>", x.device, (groups + _THREADS - 1) // _THREADS, _THREADS,
                  (loader.ptr(a), loader.ptr(gc), np.int64(groups)))
    n_blk = x.numel() // 16
    xchg = 1 if (version == "v2x" and x.dtype != torch.float32) else 0   # fp32 has no exchange layout
    expr = f"nvfp4_qdq16<{_DT[x.dtype]},{rule},{tie},{negz},{mode},{xchg}>"
    grid = (n_blk + _THREADS - 1) // _THREADS      # one thread per 16-element block
    loader.launch("fp4_qdq.cu", expr, x.device, grid, _THREADS,
                  (loader.ptr(x), loader.ptr(y), loader.ptr(g), loader.ptr(codes), loader.ptr(scales),
                   loader.ptr(gc), np.int64(n_blk), np.int64(bpg)))
    return y, codes, scales


NVFP4_KERNELS = ("auto", "v1", "v2", "v2x")
_NVFP4_SET: Dict[str, Optional[str]] = {"version": None}


def set_nvfp4_kernel(version: Optional[str]) -> Optional[str]:
    """Fix the NVFP4 kernel for every launch until changed (the trainer sets ``train.nvfp4_kernel`` for its
    run and puts the previous setting back after); None: unset ($QF_NVFP4_KERNEL, else auto). Returns the
    previous setting."""
    if version is not None and version not in NVFP4_KERNELS:
        raise ValueError(f"NVFP4 kernel {version!r}; allowed: {', '.join(NVFP4_KERNELS)}")
    prev = _NVFP4_SET["version"]
    _NVFP4_SET["version"] = version
    return prev


def nvfp4_kernel_version() -> str:
    """Which NVFP4 (nvfp4 / nvfp4_act) kernel _launch_fp4 uses: what ``set_nvfp4_kernel`` set, else
    $QF_NVFP4_KERNEL (read at every launch, so a benchmark outside the trainer can switch it between
    calls; inside the trainer the setting always wins, so the environment never changes a run):
    ``auto`` (default) the fastest of the three per rule and direction, as measured on an H200;
    ``v2`` nvfp4_qdq16, one thread per 16-element block reading its own 32/64 bytes;
    ``v2x`` nvfp4_qdq16 with the warp-coalesced loads + lane exchange (bf16/fp16; fp32 runs v2);
    ``v1`` the original fp4_qdq (16 bytes per thread, the block scale computed per lane).
    All three give the same bits."""
    v = _NVFP4_SET["version"]
    if v is not None:
        return v
    v = os.environ.get("QF_NVFP4_KERNEL", "").strip().lower() or "auto"
    if v not in NVFP4_KERNELS:
        raise ValueError(f"QF_NVFP4_KERNEL={v!r}; allowed: {', '.join(NVFP4_KERNELS)}")
    return v


def _launch_ggml(x, fmt, mode):
    kern, per_thread, rec_bytes, rec_elems = _ggml_kernel(fmt)
    x = _aligned(x)
    n = x.numel()
    y = _out(x.shape, x.dtype, x.device) if mode & 1 else None
    out = None
    if mode & 2:
        out = _out((*x.shape[:-1], x.shape[-1] // rec_elems * rec_bytes), torch.uint8, x.device)
    n_thr = n // per_thread
    if n_thr:
        grid = (n_thr + _THREADS - 1) // _THREADS
        tmpl = f"{kern}<{_DT[x.dtype]},{mode},{Q4K_MIN_BLOCKS}>" if kern == "q4k_qdq" else f"{kern}<{_DT[x.dtype]},{mode}>"
        loader.launch("kquant_qdq.cu", tmpl, x.device, grid, _THREADS,
                      (loader.ptr(x), loader.ptr(y), loader.ptr(out), np.int64(n_thr)))
    return y, out


# =============================================================================== custom ops
@torch.library.custom_op("qatfactory::absmax", mutates_args=())
def _absmax_op(x: torch.Tensor, prefix_dims: int) -> torch.Tensor:
    """max |x| over everything but the first prefix_dims dims (float32)."""
    return _launch_absmax(_aligned(x), prefix_dims)


@_absmax_op.register_fake
def _(x, prefix_dims):
    return x.new_empty(tuple(x.shape[:prefix_dims]), dtype=torch.float32)


@torch.library.custom_op("qatfactory::fake_quant", mutates_args=())
def _fq_op(x: torch.Tensor, fmt: str, ste: str, amax: Optional[torch.Tensor]) -> torch.Tensor:
    if _ggml_kernel(fmt) is not None:
        return _launch_ggml(x, fmt, 1)[0]
    return _launch_fp4(x, fmt, amax, 1)[0]


@_fq_op.register_fake
def _(x, fmt, ste, amax):
    return torch.empty_like(x)


@torch.library.custom_op("qatfactory::fake_quant_clipped_grad", mutates_args=())
def _fq_clip_bwd_op(grad: torch.Tensor, x: torch.Tensor, fmt: str, amax: Optional[torch.Tensor]) -> torch.Tensor:
    return _launch_fp4(x, fmt, amax, 4, g=grad)[0]


@_fq_clip_bwd_op.register_fake
def _(grad, x, fmt, amax):
    return torch.empty_like(x)


def _fq_setup(ctx, inputs, output):
    x, fmt, ste, amax = inputs
    ctx.fmt, ctx.ste = fmt, ste
    if ste == "clipped":
        ctx.save_for_backward(x, amax)


def _fq_backward(ctx, grad):
    if ctx.ste != "clipped":
        return grad, None, None, None
    x, amax = ctx.saved_tensors
    return _fq_clip_bwd_op(grad.contiguous(), x, ctx.fmt, amax), None, None, None


_fq_op.register_autograd(_fq_backward, setup_context=_fq_setup)


@torch.library.custom_op("qatfactory::quantize_fp4", mutates_args=())
def _q_fp4_op(x: torch.Tensor, fmt: str, amax: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    _, codes, scales = _launch_fp4(x, fmt, amax, 2)
    return codes, scales


@_q_fp4_op.register_fake
def _(x, fmt, amax):
    block = get_format(fmt).spec.block_size
    K = x.shape[-1]
    return (x.new_empty((*x.shape[:-1], K // 2), dtype=torch.uint8),
            x.new_empty((*x.shape[:-1], K // block), dtype=torch.uint8))


@torch.library.custom_op("qatfactory::quantize_ggml", mutates_args=())
def _q_ggml_op(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return _launch_ggml(x, fmt, 2)[1]


@_q_ggml_op.register_fake
def _(x, fmt):
    _, _, rec_bytes, rec_elems = _ggml_kernel(fmt)
    return x.new_empty((*x.shape[:-1], x.shape[-1] // rec_elems * rec_bytes), dtype=torch.uint8)


# LSQ on the E2M1 grid: learned per-block float scales --------------------------------------
@torch.library.custom_op("qatfactory::lsq_e2m1", mutates_args=())
def _lsq_op(x: torch.Tensor, scale: torch.Tensor, block: int, grad_scale: float) -> torch.Tensor:
    return _launch_lsq(x, scale, block, grad_scale, None)[0]


@_lsq_op.register_fake
def _(x, scale, block, grad_scale):
    return torch.empty_like(x)


@torch.library.custom_op("qatfactory::lsq_e2m1_grad", mutates_args=())
def _lsq_bwd_op(grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, block: int,
                grad_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    return _launch_lsq(x, scale, block, grad_scale, grad)


@_lsq_bwd_op.register_fake
def _(grad, x, scale, block, grad_scale):
    return torch.empty_like(x), torch.empty_like(scale, dtype=torch.float32)


def _launch_lsq(x, scale, block, grad_scale, grad):
    x = _aligned(x)
    s = scale.detach().to(torch.float32).contiguous()
    n_vec = x.numel() * x.element_size() // 16
    y = _out(x.shape, x.dtype, x.device)
    ds = torch.zeros(s.shape, dtype=torch.float32, device=x.device) if grad is not None else None
    g = _aligned(grad.to(x.dtype)) if grad is not None else None
    if n_vec:
        mode = 4 if grad is not None else 1
        expr = f"lsq_e2m1<{_DT[x.dtype]},{block},0,{mode}>"
        grid = (n_vec + _THREADS - 1) // _THREADS
        loader.launch("fp4_qdq.cu", expr, x.device, grid, _THREADS,
                      (loader.ptr(x), loader.ptr(s), loader.ptr(g), loader.ptr(y), loader.ptr(ds),
                       np.int64(n_vec), np.float32(grad_scale)))
    return y, ds


def _lsq_setup(ctx, inputs, output):
    x, scale, block, grad_scale = inputs
    ctx.block, ctx.grad_scale, ctx.sdtype = block, grad_scale, scale.dtype
    ctx.save_for_backward(x, scale)


def _lsq_backward(ctx, grad):
    x, scale = ctx.saved_tensors
    dx, ds = _lsq_bwd_op(grad.contiguous(), x, scale, ctx.block, ctx.grad_scale)
    return dx, ds.to(ctx.sdtype), None, None


_lsq_op.register_autograd(_lsq_backward, setup_context=_lsq_setup)


# =============================================================================== public API
class _FakeQuantFn(torch.autograd.Function):
    """Eager twin of the qatfactory::fake_quant op (same launches, no dispatcher round trip:
    the custom op costs tens of microseconds of Python per call, as much as the kernel on a
    64 MB tensor). torch.compile traces the custom op instead."""

    @staticmethod
    def forward(ctx, x, fmt, ste, amax):
        ctx.fmt, ctx.ste = fmt, ste
        if ste == "clipped":
            ctx.save_for_backward(x, amax)
        if _ggml_kernel(fmt) is not None:
            return _launch_ggml(x, fmt, 1)[0]
        return _launch_fp4(x, fmt, amax, 1)[0]

    @staticmethod
    def backward(ctx, grad):
        if ctx.ste != "clipped":
            return grad, None, None, None
        x, amax = ctx.saved_tensors
        return _launch_fp4(x, ctx.fmt, amax, 4, g=grad.contiguous())[0], None, None, None


def _amax_tensor(x: torch.Tensor, fmt: str, amax) -> torch.Tensor:
    if amax is None:
        if torch.compiler.is_compiling():
            return _absmax_op(x.detach(), 0)
        return _launch_absmax(_aligned(x.detach()), 0)
    a = amax if isinstance(amax, torch.Tensor) and amax.dtype == torch.float32 else \
        torch.as_tensor(amax, dtype=torch.float32)
    if a.device.type == "cpu":
        # host values can be checked without a device sync
        if not bool(torch.all(torch.isfinite(a) & (a >= 0))):
            raise ValueError(f"{fmt}: amax must be finite and >= 0")
    if get_format(fmt).spec.role == "activation" and a.ndim != 0:
        raise ValueError(f"{fmt}: amax must be a scalar (one static input_scale per tensor)")
    lead = tuple(x.shape[:-1])
    if a.ndim > len(lead) or tuple(a.shape) != lead[:a.ndim]:
        raise ValueError(f"{fmt}: amax of shape {tuple(a.shape)} does not fit x of shape {tuple(x.shape)}; "
                         f"allowed: a scalar, or a shape that is a prefix of x.shape[:-1] = {lead}")
    return (a if a.device == x.device else a.to(x.device)).detach()


def fake_quantize(x: torch.Tensor, fmt: str, ste: str = "identity", **kw) -> torch.Tensor:
    """dequantize(quantize(x)) in x.dtype with a straight-through gradient; the CUDA kernel
    when possible (see module docstring), else ``get_format(fmt).fake_quantize``."""
    if ste not in ("identity", "clipped"):
        raise ValueError(f"fake_quantize: ste={ste!r}; allowed: 'identity', 'clipped'")
    name = get_format(fmt).name
    reason = why_not(x, name, ste, **kw)
    if reason is not None:
        _fallback(reason)
        return get_format(name).fake_quantize(x, ste=ste, **kw)
    _check_shape(x, name)
    amax = None
    if _takes_amax(name):
        amax = _amax_tensor(x, name, kw.get("amax"))
    if torch.compiler.is_compiling():
        return _fq_op(x, name, ste, amax)
    if x.requires_grad and torch.is_grad_enabled():
        return _FakeQuantFn.apply(x, name, ste, amax)
    if _ggml_kernel(name) is not None:
        return _launch_ggml(x, name, 1)[0]
    return _launch_fp4(x, name, amax, 1)[0]


def quantize(x: torch.Tensor, fmt: str, **kw) -> PackedTensor:
    """The format's PackedTensor computed on the GPU (E2M1 formats: codes/scales stay on the
    device; ggml formats: the records are made on the GPU and unpacked by ``from_bytes``).
    Equal to ``get_format(fmt).quantize(x, **kw)``; falls back to it like fake_quantize."""
    f = get_format(fmt)
    reason = why_not(x, f.name, **kw)
    if reason is not None:
        _fallback(reason)
        return f.quantize(x, **kw)
    _check_shape(x, f.name)
    with torch.no_grad():
        if _ggml_kernel(f.name) is not None:
            b = _q_ggml_op(x.detach(), f.name)
            return f.from_bytes(b.cpu().numpy(), x.shape[-1]).to(x.device)
        amax = _amax_tensor(x, f.name, kw.get("amax")) if _takes_amax(f.name) else None
        codes, scales = _q_fp4_op(x.detach(), f.name, amax)
        g = None
        if amax is not None:
            a = torch.where(amax / 2688.0 < 2.0 ** -126, torch.ones_like(amax), amax)
            g = torch.div(a, torch.full_like(a, 2688.0))   # tensor/tensor: IEEE division on CUDA too
        return PackedTensor(f.name, tuple(x.shape), codes, scales, g)


def quantize_bytes(x: torch.Tensor, fmt: str, **kw):
    """The engine's bytes of x (``Format.to_bytes(quantize(x))``). ggml formats: a uint8
    CUDA tensor [..., bytes_per_row] written by the kernel; others: numpy via to_bytes."""
    f = get_format(fmt)
    if _ggml_kernel(f.name) is not None and why_not(x, f.name, **kw) is None:
        _check_shape(x, f.name)
        with torch.no_grad():
            return _q_ggml_op(x.detach(), f.name)
    return f.to_bytes(quantize(x, f.name, **kw))


def lsq_fake_quantize(x: torch.Tensor, scale: torch.Tensor, block: int = 16, grad_scale: float = 1.0) -> torch.Tensor:
    """LSQ fake quant on the E2M1 grid (RNE, saturating at 6) with a learnable float scale per
    block of `block` elements along the last dim: y = e2m1(x/s)*s; dL/dx = g where |x/s| <= 6;
    dL/ds = grad_scale * sum_block g * (e2m1(v) - v if |v| <= 6 else 6*sign(v)).
    CUDA kernel for CUDA tensors, the same formula in torch otherwise."""
    if x.shape[-1] % block or tuple(scale.shape) != (*x.shape[:-1], x.shape[-1] // block):
        raise ValueError(f"lsq_fake_quantize: scale of shape {tuple(scale.shape)} does not fit x "
                         f"{tuple(x.shape)} with block {block}; expected {(*x.shape[:-1], x.shape[-1] // block)}")
    if block not in (16, 32):
        raise ValueError(f"lsq_fake_quantize: block={block}; allowed: 16, 32")
    ok, reason = loader.probe()
    if ok and x.is_cuda and x.dtype in _DT:
        return _lsq_op(x, scale, block, float(grad_scale))
    _fallback(reason if not ok else "input is not a CUDA tensor")
    return _LSQTorch.apply(x, scale, block, float(grad_scale))


def lsq_reference(x: torch.Tensor, scale: torch.Tensor, block: int):
    """(y, inside, d_scale_term) of the LSQ rule in torch (the kernel's reference)."""
    xb = x.float().reshape(*x.shape[:-1], -1, block)
    v = xb / scale.float().unsqueeze(-1)
    mag = C.e2m1_magnitude(v.abs(), "rne")
    code = mag | ((v < 0).to(torch.uint8) << 3)
    q = C.e2m1_decode(code)
    y = (q * scale.float().unsqueeze(-1)).reshape(x.shape).to(x.dtype)
    inside = v.abs() <= C.E2M1_MAX
    term = torch.where(inside, q - v, torch.where(v < 0, -6.0, 6.0))
    return y, inside.reshape(x.shape), term


class _LSQTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, block, grad_scale):
        y, inside, term = lsq_reference(x.detach(), scale.detach(), block)
        ctx.save_for_backward(inside, term)
        ctx.block, ctx.grad_scale, ctx.shape = block, grad_scale, x.shape
        return y

    @staticmethod
    def backward(ctx, g):
        inside, term = ctx.saved_tensors
        dx = g * inside.to(g.dtype)
        gb = g.float().reshape(*ctx.shape[:-1], -1, ctx.block)
        ds = (gb * term).sum(-1) * ctx.grad_scale
        return dx, ds, None, None


__all__ = ["fake_quantize", "quantize", "quantize_bytes", "lsq_fake_quantize", "kernel_formats", "why_not"]
