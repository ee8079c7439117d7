"""The KV cache in the loop: keys and values fake-quantized in the student's attention where the engine
stores them (after RoPE, and after Qwen3's k_norm), with the engine's own write rule
(``qatfactory.formats.kv``) and a straight-through gradient.

Hook point. Every decoder attention of the supported transformers 5.x architectures (Llama,
Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral) computes q/k/v, applies RoPE, updates its cache and
then calls ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)(self, q, k,
v, mask, ...)``. :func:`attach` registers, through transformers' own ``AttentionInterface`` /
``AttentionMaskInterface``, an attention function ``qatfactory_kv_<inner>`` that fake-quantizes
``key`` and ``value`` with the calling module's :class:`KVCacheQuantizer` and hands them to the
implementation the model used before (sdpa, eager, flash...), and points ``config._attn_implementation``
at it (the name is not serialized: ``_attn_implementation_internal`` is dropped from config.json).
No transformers code is copied or patched. K and V arrive as [batch, kv_heads, tokens, head_dim],
before GQA's repeat, including the cached tokens during generation: the rules act per (token, head)
row with a static scale, so re-quantizing cached rows gives the bytes they were stored as.

Scales (formats with a per-layer scale: fp8, nvfp4), per attention layer, K and V separately:

    frozen   ``k_amax`` / ``v_amax`` buffers set by calibration (max: largest |K| over the
             calibration batches; mse: the amax among 2^(-i/8) * max, i = 0..16, with the least
             squared error of the fake-quantized K over the calibration K rows, thinned to every
             other row beyond 16384, the max row kept); the scale the engine
             loads is ``fmt.scale(amax)`` (amax / 448 rounded up to a bf16 value), exported as k_scale / v_scale
    dynamic  amax of the tensor in each forward (what vLLM's ``calculate_kv_scales`` does once);
             the buffers keep the running max. The engine has one static scale per layer, so
             :func:`freeze_kv_scales` (ship the running max) or calibrate must come before convert.

Attention (``QuantConfig.kv_attention``): on vLLM's ``fp8_e4m3`` cache the quantizer's
``attention`` ("fa3" = vLLM's FLASH_ATTN, the default; "triton" = TRITON_ATTN) makes the wrapper run the
engine's FP8 attention arithmetic instead of the inner implementation on fake-quantized K/V
(nn/kv_attention.py, formats/kv_attention.py); "none" keeps the cache-only emulation. Calibration
always runs the inner attention on unquantized K/V.

llama.cpp cache types have no per-tensor scale (one fp16 scale per 32 elements, computed at write
time). For them on the ``llama`` GGUF architecture (Llama, Mistral, Mixtral), K is quantized in the
converter's permuted element order (:func:`qatfactory.formats.kv.gguf_k_order`), as llama.cpp's
cache holds it. Calibration collects nothing for them.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..formats import codecs as C
from ..formats.kv import get_kv_format, gguf_k_order
from ..formats.kv_attention import attentions_for, get_kv_attention
from . import kv_attention as KA

KV_STRATEGIES = ("frozen", "dynamic")
KV_CALIB_METHODS = ("max", "mse")
ATTN_PREFIX = "qatfactory_kv_"
# HF model_type -> llama.cpp's converter permutes q/k rows (GGUF architecture "llama")
GGUF_PERMUTES_K: Dict[str, bool] = {"llama": True, "mistral": True, "mixtral": True,
                                    "qwen2": False, "qwen3": False, "qwen3_moe": False}
MSE_STEPS = 17                 # candidates 2^(-i/8) * amax, i = 0..16 (down to amax/4)
MSE_SAMPLE_ROWS = 8192         # K (or V) rows of head_dim kept per layer for the MSE search


class KVCacheQuantizer(nn.Module):
    """K/V fake quant of one attention layer; ``k_amax`` / ``v_amax`` are its calibrated state."""

    def __init__(self, fmt_name: str, strategy: str = "frozen", head_dim: int = 0, permute_k: bool = False,
                 name: str = "", attention: str = "none"):
        super().__init__()
        if strategy not in KV_STRATEGIES:
            raise ValueError(f"KVCacheQuantizer: strategy={strategy!r}; allowed: {list(KV_STRATEGIES)}")
        fmt = get_kv_format(fmt_name)
        fmt.check_head_dim(head_dim)
        check_attention(fmt_name, attention)
        self.fmt_name = fmt_name
        self.strategy = strategy
        self.attention = attention      # "none": only the cache write; else a formats.kv_attention rule
        self.head_dim = int(head_dim)
        self.owner = name
        self.static = fmt.spec.static_scale
        self.permute_k = bool(permute_k and fmt.spec.head_order == "gguf")
        if self.permute_k:
            order = gguf_k_order(head_dim)
            self.register_buffer("k_order", order, persistent=False)
            self.register_buffer("k_unorder", torch.argsort(order), persistent=False)
        self.register_buffer("k_amax", torch.zeros((), dtype=torch.float32))
        self.register_buffer("v_amax", torch.zeros((), dtype=torch.float32))
        self.calibrating: Optional[str] = None   # "max" | "mse" while observing; "pass": K/V untouched
        self._samples: Dict[str, List[torch.Tensor]] = {"k": [], "v": []}

    @property
    def fmt(self):
        return get_kv_format(self.fmt_name)

    def extra_repr(self) -> str:
        s = f"{self.fmt_name}, strategy={self.strategy}"
        if self.static:
            s += f", k_amax={float(self.k_amax):.6g}, v_amax={float(self.v_amax):.6g}"
        if self.attention != "none":
            s += f", attention={self.attention}"
        return s + (", K in GGUF order" if self.permute_k else "")

    # -- scales -----------------------------------------------------------------------------
    def scales(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(k_scale, v_scale) the engine loads (None for cache types without one)."""
        if not self.static:
            return None, None
        for which in ("k", "v"):
            if not float(getattr(self, f"{which}_amax")) > 0:
                raise RuntimeError(f"{self.owner or 'KVCacheQuantizer'}: KV-cache format {self.fmt_name!r} needs a "
                                   f"calibrated {which.upper()} scale ({which}_amax is 0); run "
                                   f"qatfactory.quantize.calibrate(model, batches) first")
        f = self.fmt
        return f.scale(self.k_amax), f.scale(self.v_amax)

    # -- calibration ------------------------------------------------------------------------
    def start_calibration(self, method: str) -> None:
        if method not in KV_CALIB_METHODS:
            raise ValueError(f"KV-cache calibration method={method!r}; allowed: {list(KV_CALIB_METHODS)}")
        self.calibrating = method
        self._samples = {"k": [], "v": []}
        with torch.no_grad():
            self.k_amax.zero_()
            self.v_amax.zero_()

    @torch.no_grad()
    def _observe(self, which: str, x: torch.Tensor) -> None:
        if x.numel() == 0:
            return
        buf = getattr(self, f"{which}_amax")
        buf.copy_(torch.maximum(buf, x.detach().abs().amax().float()))
        if self.calibrating == "mse":
            rows = x.detach().float().reshape(-1, x.shape[-1])
            keep = self._samples[which]
            keep.append(rows.cpu())
            if sum(r.shape[0] for r in keep) > 2 * MSE_SAMPLE_ROWS:
                # thin deterministically, every other row, keeping the row that holds the max
                allr = torch.cat(keep)
                top = int(allr.abs().amax(-1).argmax())
                self._samples[which] = [allr[0::2]] + ([allr[top:top + 1]] if top % 2 else [])

    @torch.no_grad()
    def finish_calibration(self) -> Dict[str, float]:
        """Set k_amax / v_amax from what was observed; returns {k_amax, v_amax} as floats."""
        method, self.calibrating = self.calibrating, None
        if method == "mse" and self.static:
            for which in ("k", "v"):
                buf = getattr(self, f"{which}_amax")
                if not float(buf) > 0 or not self._samples[which]:
                    continue
                rows = torch.cat(self._samples[which])
                if which == "k" and self.permute_k:
                    rows = rows[:, self.k_order.cpu()]
                best, best_err = float(buf), None
                for i in range(MSE_STEPS):
                    a = torch.tensor(float(buf) * 2.0 ** (-i / 8), dtype=torch.float32)
                    err = float(((self.fmt.values(rows, self.fmt.scale(a)) - rows) ** 2).sum())
                    if best_err is None or err < best_err:
                        best, best_err = float(a), err
                buf.fill_(best)
        self._samples = {"k": [], "v": []}
        return {"k_amax": float(self.k_amax), "v_amax": float(self.v_amax)}

    # -- forward ----------------------------------------------------------------------------
    def _fq(self, x: torch.Tensor, scale, permute: bool) -> torch.Tensor:
        if permute:
            return self.fmt.fake_quantize(x[..., self.k_order], scale)[..., self.k_unorder]
        return self.fmt.fake_quantize(x, scale)

    def _forward_scales(self, key: torch.Tensor, value: torch.Tensor):
        f = self.fmt
        if self.strategy == "dynamic":
            with torch.no_grad():
                ka, va = key.detach().abs().amax().float(), value.detach().abs().amax().float()
                self.k_amax.copy_(torch.maximum(self.k_amax, ka))
                self.v_amax.copy_(torch.maximum(self.v_amax, va))
            return f.scale(ka), f.scale(va)
        return self.scales()

    @torch.no_grad()
    def cache_values(self, key: torch.Tensor, value: torch.Tensor):
        """(k8, v8, k_scale, v_scale): the E4M3 values the cache holds (float32, without the scale) and the
        per-layer scales, for the FP8 attention rules (an fp8 cache in transformers' element order)."""
        if self.fmt.spec.element != "e4m3" or not self.static or self.permute_k:
            raise ValueError(f"{self.owner or 'KVCacheQuantizer'}: cache values are defined for the FP8 caches only, "
                             f"not {self.fmt_name!r}")
        ks, vs = self._forward_scales(key, value)
        f = self.fmt
        return C.e4m3_decode(f.encode(key.detach(), ks)), C.e4m3_decode(f.encode(value.detach(), vs)), ks, vs

    def forward(self, key: torch.Tensor, value: torch.Tensor):
        if self.calibrating is not None:
            if self.static and self.calibrating != "pass":
                self._observe("k", key)
                self._observe("v", value)
            return key, value
        if not self.static:
            return self._fq(key, None, self.permute_k), self._fq(value, None, False)
        f = self.fmt
        ks, vs = self._forward_scales(key, value)
        kq, vq = self._fq(key, ks, self.permute_k), self._fq(value, vs, False)
        if f.spec.overflow == "nan":
            for which, t in (("K", kq), ("V", vq)):
                if not bool(torch.isfinite(t).all()):
                    raise RuntimeError(
                        f"{self.owner or 'KVCacheQuantizer'}: {which} exceeds the largest value its scale can store "
                        f"(464/448 of the calibrated {which.lower()}_amax); the engine's write rule {self.fmt_name!r} "
                        f"({f.spec.rounding}) turns it into NaN, in serving as here. Calibrate the KV scales on data "
                        f"that reaches such values, or use a saturating rule (e.g. fp8_e4m3 for vLLM)")
        return kq, vq


# ============================================================================= attention hook
def _inner_function(module, inner: str):
    if inner == "eager":
        mod = sys.modules.get(type(module).__module__)
        fn = getattr(mod, "eager_attention_forward", None)
        if fn is None:
            raise NotImplementedError(f"{type(module).__name__}: no eager_attention_forward in {type(module).__module__}")
        return fn
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415 (heavy: transformers)
    return ALL_ATTENTION_FUNCTIONS[inner]


def _attention_for(inner: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        q = getattr(module, "kv_quant", None)
        if isinstance(q, KVCacheQuantizer):
            if q.attention != "none" and q.calibrating is None:     # the engine's FP8 attention (nn/kv_attention.py)
                return KA.attend(module, q, inner, _inner_function(module, inner), query, key, value, attention_mask,
                                 **kwargs)
            key, value = q(key, value)
        return _inner_function(module, inner)(module, query, key, value, attention_mask, **kwargs)
    attention.__name__ = f"{ATTN_PREFIX}{inner}"
    return attention


def register_attention(inner: str) -> str:
    """Register ``qatfactory_kv_<inner>`` (attention and mask functions) with transformers; returns it."""
    from transformers.masking_utils import (  # noqa: PLC0415 (heavy: transformers)
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
    )
    from transformers.modeling_utils import AttentionInterface  # noqa: PLC0415 (heavy: transformers)
    name = f"{ATTN_PREFIX}{inner}"
    if name not in AttentionInterface._global_mapping:
        mask_fn = AttentionMaskInterface._global_mapping.get(inner)
        if mask_fn is None:
            raise NotImplementedError(f"attention implementation {inner!r} has no mask function in transformers' "
                                      f"AttentionMaskInterface ({sorted(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping)})"
                                      f"; the KV-cache emulation wraps sdpa, eager and flash attention")
        AttentionInterface.register(name, _attention_for(inner))
        AttentionMaskInterface.register(name, mask_fn)
    return name


def attention_modules(model) -> List[Tuple[str, nn.Module]]:
    """(name, module) of each decoder self-attention: a module with k_proj and v_proj children and a
    head_dim, one per layer."""
    out = []
    for n, m in model.named_modules():
        if isinstance(m, KVCacheQuantizer):
            continue
        if hasattr(m, "k_proj") and hasattr(m, "v_proj") and hasattr(m, "head_dim") and type(m).__name__.endswith(
                "Attention"):
            out.append((n, m))
    return out


def check_attention(fmt_name: Optional[str], attention: str) -> None:
    """Refuse an attention rule that does not read this KV format's cache, naming those that do."""
    if attention == "none":
        return
    get_kv_attention(attention)
    ok = attentions_for(fmt_name)
    if attention not in ok:
        raise ValueError(f"QuantConfig.kv_attention={attention!r} does not run on the KV-cache format {fmt_name!r}; "
                         f"allowed: {ok + ['none']} (the FP8 attention rules are vLLM's, on its fp8_e4m3 cache)")


def attach(model, fmt_name: str, strategy: str = "frozen", attention: str = "none") -> List[str]:
    """Install a KVCacheQuantizer on every attention layer and route attention through it (in place).
    ``attention``: "none" (the cache write only) or a formats.kv_attention rule ("fa3", "triton").
    Returns the attention module names. Raises for architectures whose attention was not checked."""
    config = getattr(model, "config", None)
    mt = getattr(config, "model_type", None)
    if mt not in GGUF_PERMUTES_K:
        raise NotImplementedError(f"KV-cache emulation: model_type {mt!r} is not supported (its attention was not "
                                  f"checked to receive K after RoPE through transformers' attention interface); "
                                  f"supported: {sorted(GGUF_PERMUTES_K)}")
    if strategy not in KV_STRATEGIES:
        raise ValueError(f"QuantConfig.kv_scale_strategy={strategy!r}; allowed: {list(KV_STRATEGIES)}")
    check_attention(fmt_name, attention)
    mods = attention_modules(model)
    n_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    if not mods or (n_layers and len(mods) != n_layers):
        raise NotImplementedError(f"KV-cache emulation: found {len(mods)} attention modules for {n_layers} layers in "
                                  f"{type(model).__name__}; cannot place the cache quantizers")
    inner = config._attn_implementation or "eager"
    if inner.startswith(ATTN_PREFIX):
        raise ValueError("KV-cache emulation is already attached to this model")
    if attention != "none" and inner not in KA.SUPPORTED_INNER:
        raise NotImplementedError(f"KV attention emulation ({attention}) wraps {list(KA.SUPPORTED_INNER)} attention; "
                                  f"the model uses {inner!r}: load it with attn_implementation='sdpa'")
    name = register_attention(inner)
    names = []
    for n, m in mods:
        if "kv_quant" in m._modules:
            raise ValueError(f"{n}: already has a kv_quant module")
        m.kv_quant = KVCacheQuantizer(fmt_name, strategy, int(m.head_dim), GGUF_PERMUTES_K[mt], n, attention)
        names.append(n)
    model._qf_kv_inner = inner
    config._attn_implementation = name
    return names


def detach(model) -> None:
    """Undo :func:`attach`: remove the quantizers, restore the attention implementation."""
    for _, m in attention_modules(model):
        if "kv_quant" in m._modules:
            del m._modules["kv_quant"]
    inner = model.__dict__.pop("_qf_kv_inner", None)
    if inner is not None:
        model.config._attn_implementation = inner


def kv_quantizers(model) -> List[Tuple[str, KVCacheQuantizer]]:
    """(attention module name, its quantizer) in model order."""
    return [(n, m.kv_quant) for n, m in attention_modules(model) if isinstance(getattr(m, "kv_quant", None),
                                                                            KVCacheQuantizer)]


def set_attention(model, attention: str) -> int:
    """Switch every layer's attention rule ("none" | "fa3" | "triton"), e.g. to score one student against
    each vLLM backend; returns the count. The saved QuantConfig follows."""
    qs = kv_quantizers(model)
    for _, q in qs:
        check_attention(q.fmt_name, attention)
    for _, q in qs:
        q.attention = attention
    cfg = getattr(model, "_qf_config", None)
    if cfg is not None and getattr(cfg, "kv_format", None):
        cfg.kv_attention = attention
    return len(qs)


def freeze_kv_scales(model) -> int:
    """Dynamic -> frozen at the running max of every layer (what convert ships); returns the count."""
    qs = kv_quantizers(model)
    for _, q in qs:
        q.strategy = "frozen"
    cfg = getattr(model, "_qf_config", None)
    if cfg is not None and getattr(cfg, "kv_format", None):
        cfg.kv_scale_strategy = "frozen"
    return len(qs)


@torch.no_grad()
def kv_record(model) -> Dict[str, object]:
    """What convert hands the exporters: {"format", "strategy", "attention" ("none" | a kv_attention rule),
    "layers": {attn: {k_scale, v_scale, k_amax, v_amax}}} (scales float32 0-d, absent for cache types
    without one); {} without a KV format."""
    qs = kv_quantizers(model)
    if not qs:
        return {}
    fmts = {q.fmt_name for _, q in qs}
    if len(fmts) != 1:
        raise ValueError(f"convert: attention layers use different KV-cache formats {sorted(fmts)}")
    atts = {q.attention for _, q in qs}
    if len(atts) != 1:
        raise ValueError(f"convert: attention layers use different KV attention rules {sorted(atts)}")
    layers: Dict[str, Dict[str, torch.Tensor]] = {}
    for n, q in qs:
        if q.strategy == "dynamic":
            raise ValueError(f"convert: {n} has dynamic KV-cache scales, but the engine loads one static k_scale / "
                             f"v_scale per layer; call qatfactory.nn.kv_cache.freeze_kv_scales(model) (ships the running "
                             f"max, then re-check the student) or calibrate(model, batches) first")
        ks, vs = q.scales()
        if ks is None:
            layers[n] = {}
        else:
            layers[n] = {"k_scale": ks.detach().clone().cpu(), "v_scale": vs.detach().clone().cpu(), "k_amax": q.k_amax.detach().clone().cpu(),
                         "v_amax": q.v_amax.detach().clone().cpu()}
    return {"format": fmts.pop(), "strategy": "frozen", "attention": atts.pop(), "layers": layers}
