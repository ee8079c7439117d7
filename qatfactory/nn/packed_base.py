"""A frozen base held as the engine stores it: codes and block scales, dequantized per layer in each use.

QeRL's memory claim is that only the 4-bit base is held beside the adapter. ``serving_weights``
(nn/adapter.py) keeps the fake-quantized weight of every linear as a bf16 tensor next to the bf16
weight itself: two full copies of the model. Here each frozen QuantLinear instead keeps the
``PackedTensor`` that ``convert`` would hand the exporters (``QuantLinear.pack``: the same amax,
block scales and codes), and

    forward:   y = fq_x(x) @ D(P)^T + b          D = the format's own dequantizer, into W's dtype
    backward:  dx = dy @ D(P)                    D(P) recomputed, never kept between the two

so the only weight-sized tensor alive at a time is the one linear being multiplied. ``D(P)`` equals
the fake-quantized weight bit for bit (the parity gate proves the same decode against independent
readers on every export), so this forward and backward equal ``serving_weights``' exactly
(tests/nn/test_packed_base.py, every weight format family).

The bf16 weights are not needed while the base is frozen: they move to host memory on entry (pinned
where CUDA is present) and come back on exit, bit for bit, for the export and for checkpoints. A
weight shared with a module that is not packed (a tied output head shares the embedding's table)
stays where it is. Mixture-of-experts blocks are not packed here (their weights stay as they are).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .linear import QuantLinear


class _PackedLinearFn(torch.autograd.Function):
    """y = x @ D(P)^T + b, with D(P) rebuilt in the backward instead of saved."""

    @staticmethod
    def forward(ctx, x, bias, holder):
        w = holder.weight()
        ctx.holder = holder
        ctx.has_bias = bias is not None
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx, dy):
        dx = db = None
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(ctx.holder.weight())
        if ctx.has_bias and ctx.needs_input_grad[1]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0)
        return dx, db, None


def _narrow(codes: torch.Tensor) -> Tuple[torch.Tensor, int, Optional[torch.Tensor]]:
    """Codes kept one per byte (the k-quants' and the integer grids' torch form) packed losslessly: each
    code becomes its index among the distinct values present, at the width their count needs (1, 2 or 4
    bits, ``8 // bits`` indices a byte along the last dimension, index i of a byte in bits
    [i*bits, (i+1)*bits)). Codes with more distinct values, or already two to a byte, stay as they are."""
    if codes.numel() == 0 or codes.dtype not in (torch.uint8, torch.int8):
        return codes, 8, None
    values = torch.unique(codes)
    for bits in (1, 2, 4):
        per = 8 // bits
        if values.numel() <= (1 << bits) and codes.shape[-1] % per == 0:
            idx = torch.searchsorted(values, codes).to(torch.uint8)
            c = idx.reshape(*codes.shape[:-1], -1, per)
            out = c[..., 0].clone()
            for i in range(1, per):
                out |= c[..., i] << (bits * i)
            return out, bits, values
    return codes, 8, None


def _widen(b: torch.Tensor, bits: int, values: Optional[torch.Tensor]) -> torch.Tensor:
    if values is None:
        return b
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(b >> (bits * i)) & mask for i in range(per)]
    idx = torch.stack(parts, -1).reshape(*b.shape[:-1], b.shape[-1] * per)
    return values[idx.long()]


class _Holder:
    """The packed weight of one linear (its codes at their narrowest lossless width) and the dtype its
    dequantized form takes."""

    def __init__(self, packed, dtype: torch.dtype):
        self.codes, self.bits, self.values = _narrow(packed.codes)
        packed.codes = None
        self.packed = packed
        self.dtype = dtype

    def weight(self) -> torch.Tensor:
        p = self.packed
        full = type(p)(p.format, p.shape, _widen(self.codes, self.bits, self.values), p.scales, p.global_scale, p.extra)
        return full.dequantize().to(self.dtype)

    def nbytes(self) -> int:
        p = self.packed
        ts = [self.codes, p.scales, p.global_scale, *p.extra.values()]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _bind(m: QuantLinear, h: _Holder):
    def fwd(x):
        return _PackedLinearFn.apply(m._quant_input(x), m.bias, h)
    return fwd


def _shared_elsewhere(model: nn.Module, packed_ids: set) -> set:
    """ids of weight tensors that a module outside the packed set also holds (a tied table)."""
    out = set()
    for m in model.modules():
        if id(m) in packed_ids:
            continue
        for p in m.parameters(recurse=False):
            out.add(id(p))
    return out


@contextlib.contextmanager
def packed_base(model: nn.Module) -> Iterator[Dict[str, Dict[str, int]]]:
    """Inside, every QuantLinear multiplies by its weight decoded from the packed bytes at each use; the
    bf16 weights wait in host memory. Yields {module name: {"packed_bytes", "weight_bytes"}}."""
    mods: List[Tuple[str, QuantLinear]] = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    for n, m in mods:
        if "forward" in m.__dict__:
            raise RuntimeError(f"packed_base: {n} is already frozen (nested use with serving_weights or packed_base)")
        if m.lora is not None:
            raise ValueError(f"packed_base: {n} has a merged LoRA that trains through the quantizer; a packed base "
                             f"is for a frozen base with side adapters (method.rl.lora_mode=adapter)")
        if m.weight.requires_grad:
            raise ValueError(f"packed_base: {n}.weight trains; only a frozen base can be held packed")
    report: Dict[str, Dict[str, int]] = {}
    holders = []
    with torch.no_grad():
        # every pack first: a fused group's members share an amax read from all their weights
        for n, m in mods:
            h = _Holder(m.pack(), m.weight.dtype)
            holders.append(h)
            report[n] = {"packed_bytes": h.nbytes(), "weight_bytes": m.weight.numel() * m.weight.element_size()}
    shared = _shared_elsewhere(model, {id(m) for _, m in mods})
    moved: List[Tuple[nn.Parameter, torch.device]] = []
    try:
        for (n, m), h in zip(mods, holders):
            m.forward = _bind(m, h)
        for _, m in mods:
            w = m.weight
            if id(w) in shared or w.device.type == "cpu" or any(w is p for p, _ in moved):
                continue
            host = torch.empty(w.shape, dtype=w.dtype, device="cpu", pin_memory=torch.cuda.is_available())
            host.copy_(w.data)
            moved.append((w, w.device))
            w.data = host
        yield report
    finally:
        for w, dev in moved:
            w.data = w.data.to(dev)
        for _, m in mods:
            m.__dict__.pop("forward", None)


__all__ = ["packed_base"]
