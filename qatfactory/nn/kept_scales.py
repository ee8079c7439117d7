"""The k-quant scales a WeightQuantizer keeps between searches (``quant.kquant_refresh_every = K > 1``).

llama.cpp's Q4_K, Q6_K and (with an importance matrix) Q5_0 quantizers search each sub-block's scale (and
Q4_K's min) before they assign the element codes. With K > 1 the quantizer keeps the scales of its last
search as persistent buffers (``kq_step`` and ``kq_<field>``; fp16 fields stored as int16 bits, so no
dtype cast of the module touches them): DeepSpeed checkpoints hold them, so a resume in the middle of a
block of K steps quantizes with the very scales the uninterrupted run had. They exist only when K > 1
(K = 1 state dicts are unchanged).

This module is the state (made by ``quantize.prepare``) and the two ways to quantize with it: the full
search that refreshes the kept scales, and the element codes under the kept scales. When each runs is the
trainer's decision (nn/kquant_refresh.py, installed for each optimizer step through
``fake_quant.set_step_rule``); outside it the quantizer always runs the full search and ignores these.
"""
from __future__ import annotations

from typing import Dict

import torch

from .fake_quant import WeightQuantizer


def _probe_fields(fmt, G: int, R: int, K: int):
    """(field name, dtype, shape) of the kept scales of a [G, R, K] weight: from one row's PackedTensor."""
    probe = fmt.quantize(torch.zeros(1, 1, K))
    out = []
    for name, t in fmt.scale_kwargs(probe).items():
        out.append((name, t.dtype, (G, R) + tuple(t.shape[2:])))
    return out


def attach(q, every: int, device=None) -> bool:
    """Give WeightQuantizer ``q`` the kept-scale state for refreshing every ``every`` steps (buffers on
    ``device``). Returns whether it applies (a dynamic quantizer of a format with a scale search);
    every == 1 does nothing."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"kquant_refresh_every={every!r}; allowed: an int >= 1 (1 = a full search every forward)")
    fmt = q.fmt
    if every == 1 or q.strategy != "dynamic" or not (fmt.searches_scales(True) or fmt.searches_scales(False)):
        return False
    if "kq_step" in q._buffers:
        raise ValueError(f"{q!r}: kept scales are attached already")
    G, R, K = q.shape3
    dev = q.imatrix.device if q.uses_imatrix else device
    fields = []
    for name, dtype, shape in _probe_fields(fmt, G, R, K):
        store = torch.int16 if dtype == torch.float16 else dtype
        if store.is_floating_point:
            raise TypeError(f"{fmt.name}: kept scale field {name!r} is {dtype}; only fp16 and integer fields are kept")
        q.register_buffer(f"kq_{name}", torch.zeros(shape, dtype=store, device=dev))
        fields.append((name, dtype))
    q.register_buffer("kq_step", torch.full((), -1, dtype=torch.int64, device=dev))
    q.refresh_every = every
    q._kq_fields = tuple(fields)
    return True


def attach_all(model, every: int) -> int:
    """attach() every WeightQuantizer of a prepared model; returns how many keep scales."""
    p = next(iter(model.parameters()), None)
    dev = None if p is None else p.device
    seen, n = set(), 0
    for m in model.modules():
        if type(m) is WeightQuantizer and id(m) not in seen:
            seen.add(id(m))
            n += attach(m, every, dev)
    model.__dict__.pop("_qf_kq_any", None)
    return n


def kept_kwargs(q) -> Dict[str, torch.Tensor]:
    """The kept scales of ``q`` as the format's ``quantize(x, **kwargs)`` takes them."""
    out = {}
    for name, dtype in q._kq_fields:
        t = q._buffers[f"kq_{name}"]
        out[name] = t.view(torch.float16) if dtype == torch.float16 else t
    return out


@torch.no_grad()
def keep(q, p, step: int) -> None:
    """Keep the scales of PackedTensor ``p`` (a full search's result) as made in optimizer step ``step``."""
    for name, t in q.fmt.scale_kwargs(p).items():
        b = q._buffers[f"kq_{name}"]
        src = t.detach().reshape(b.shape)
        b.copy_(src.view(torch.int16) if src.dtype == torch.float16 else src)
    q.kq_step.fill_(step)


def uses_refresh(model) -> bool:
    """Whether any quantizer of ``model`` keeps scales between searches (checked once per model)."""
    hit = model.__dict__.get("_qf_kq_any")
    if hit is None:
        hit = any(getattr(m, "refresh_every", 1) > 1 for m in model.modules())
        model.__dict__["_qf_kq_any"] = hit
    return hit


__all__ = ["attach", "attach_all", "kept_kwargs", "keep", "uses_refresh"]
