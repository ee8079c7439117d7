"""The engine's FP8 attention in the student: with ``QuantConfig.kv_attention`` = ``fa3`` or
``triton`` on an ``fp8_e4m3`` cache, the attention output the student trains on is vLLM's FP8
arithmetic (query cast to E4M3, scores on the cache's E4M3 values with the k scale folded in, P cast to
E4M3 against the kernel's running row max, the v scale on the output), as transcribed in
``qatfactory.formats.kv_attention`` (not bit-exact: that module says where it differs from the kernels).

Gradient: straight-through. The forward value is :func:`fp8_attention`'s output, computed without
autograd; the backward is the gradient of the attention implementation the model used before
(sdpa / eager, memory-efficient) evaluated on the fake-quantized query, key and value, each with an
identity straight-through gradient: ``out = emulated + (reference - reference.detach())``, which is the
emulated value bit for bit (the added term is exactly 0) and differentiates as the reference. P's FP8
rounding is thus straight-through, as the cache's and the query's roundings are.

Masks: the inner implementation's own mask function runs (transformers' sdpa: bool or None, None
meaning causal when more than one query; eager: additive 0 / large negative); both become a bool
``keep``. Other inner implementations, dropout in training, soft-capping and position biases are
refused: vLLM's FP8 kernels have none of them for the supported architectures.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..formats.kv_attention import fp8_attention, get_kv_attention, query_values
from ..formats.spec import _STE

SUPPORTED_INNER = ("sdpa", "eager")


def _ste(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    if not x.requires_grad:
        return q
    return _STE.apply(x, q, torch.empty(0, device=x.device))


def keep_mask(attention_mask: Optional[torch.Tensor], inner: str, tq: int, tk: int, device, causal: bool) -> \
        Optional[torch.Tensor]:
    """bool [.., tq, tk] (True = attend) from the mask transformers built for ``inner``; None = all keys."""
    if attention_mask is None:
        if inner == "sdpa" and causal and tq > 1:
            # sdpa's is_causal: query i sees keys 0..i (transformers skips the mask only when that is right)
            i = torch.arange(tq, device=device).unsqueeze(-1)
            return torch.arange(tk, device=device).unsqueeze(0) <= i
        return None
    m = attention_mask[..., :tk]
    if m.dtype == torch.bool:
        return m
    lo = torch.finfo(m.dtype).min / 2
    keep = m > lo
    if bool((m[keep] != 0).any()):
        raise NotImplementedError("KV attention emulation: the attention mask carries additive biases other than 0 / "
                                  "-inf; vLLM's FP8 kernels take none for the supported architectures")
    return keep


def attend(module, kvq, inner: str, inner_fn, query, key, value, attention_mask, **kwargs):
    """The attention function's output ([B, Tq, Hq, Dv], None) with the engine's FP8 arithmetic."""
    rule = get_kv_attention(kvq.attention)
    if inner not in SUPPORTED_INNER:
        raise NotImplementedError(f"KV attention emulation ({rule.name}) wraps {list(SUPPORTED_INNER)} attention; the "
                                  f"model uses {inner!r}: load it with attn_implementation='sdpa'")
    dropout = float(kwargs.get("dropout", 0.0) or 0.0)
    if dropout and module.training:
        raise NotImplementedError(f"KV attention emulation ({rule.name}): attention dropout {dropout} in training; "
                                  f"the engine has none (set the model's attention_dropout to 0)")
    for k in ("softcap", "position_bias", "s_aux"):
        if kwargs.get(k) is not None:
            raise NotImplementedError(f"KV attention emulation ({rule.name}): {k} is not emulated")
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    k8, v8, ks, vs = kvq.cache_values(key, value)
    keep = keep_mask(attention_mask, inner, query.shape[2], key.shape[2], query.device, causal)
    out = fp8_attention(rule, query.detach(), k8, v8, ks, vs, float(scaling), keep).to(query.dtype)
    out = out.transpose(1, 2).contiguous()
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        qf = _ste(query, (query_values(query.detach(), rule.q_scale) * rule.q_scale).to(query.dtype))
        kf = _ste(key, (k8 * ks.to(k8.device)).to(key.dtype))
        vf = _ste(value, (v8 * vs.to(v8.device)).to(value.dtype))
        ref = inner_fn(module, qf, kf, vf, attention_mask, **kwargs)[0]
        out = out + (ref - ref.detach())
    return out, None
