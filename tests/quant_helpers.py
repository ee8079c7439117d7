"""Tiny random HF models and the "rebuild from converted tensors" reference used by test_quantize.

The rebuilt model never touches qatfactory.nn: it is a plain transformers model loaded with
``from_pretrained`` from a directory holding the dequantized packed tensors (by their on-disk
names) and the dense tensors; W4A4 activation fake quant is attached with hooks that call the
format API directly, using the converted input_amax."""
from __future__ import annotations

import contextlib
import json
import os
import types

import torch
from safetensors.torch import save_file

from qatfactory.formats import get_format

DT = torch.bfloat16


def tiny(kind: str, hidden: int = 64, inter: int = 128, layers: int = 2, seed: int = 0, **kw):
    import transformers as T
    torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64, dtype="bfloat16")
    common.update(kw)
    if kind == "llama":
        cfg, cls = T.LlamaConfig(intermediate_size=inter, **common), T.LlamaForCausalLM
    elif kind == "qwen2":
        cfg, cls = T.Qwen2Config(intermediate_size=inter, **common), T.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg, cls = T.Qwen3Config(intermediate_size=inter, head_dim=hidden // 2, **common), T.Qwen3ForCausalLM
    elif kind == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(intermediate_size=inter, moe_intermediate_size=inter // 2, head_dim=hidden // 2,
                               num_experts=4, num_experts_per_tok=2, **common)
        cls = T.Qwen3MoeForCausalLM
    elif kind == "mixtral":
        cfg = T.MixtralConfig(intermediate_size=inter // 2, head_dim=hidden // 2, num_local_experts=4,
                              num_experts_per_tok=2, **common)
        cls = T.MixtralForCausalLM
    else:
        raise ValueError(kind)
    m = cls._from_config(cfg, dtype=DT)
    # random init leaves routers / norms at trivial values; spread them so routing and scales vary
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p.float()))
            elif n.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p.float()))
    return m


def ids(batch=2, seq=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, seq), generator=g)


def write_dequantized(cm, out_dir: str) -> str:
    """config.json + model.safetensors with dequantized packed tensors (model dtype) + dense."""
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.contiguous() for k, v in cm.dense.items()}
    for k, p in cm.packed.items():
        state[k] = get_format(p.format).dequantize(p).to(DT).contiguous()
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cm.config, f)
    return out_dir


def _act(fmt_name, amax):
    fmt = get_format(fmt_name)
    if fmt.spec.global_scale is not None:
        return lambda x: fmt.fake_quantize(x, amax=amax)
    return lambda x: fmt.fake_quantize(x)


def rebuild(cm, out_dir: str):
    """AutoModelForCausalLM.from_pretrained(out_dir) with W4A4 input fake quant attached."""
    from transformers import AutoModelForCausalLM
    write_dequantized(cm, out_dir)
    m = AutoModelForCausalLM.from_pretrained(out_dir, dtype=DT)
    m.eval()
    mods = dict(m.named_modules())
    for name, fmt in cm.act_formats.items():
        if ".experts." in name:
            continue
        q = _act(fmt, cm.input_amax.get(name))
        mods[name].register_forward_pre_hook(lambda mod, args, q=q: (q(args[0]),) + tuple(args[1:]))
    for name, mod in mods.items():
        if not name.endswith("mlp.experts"):
            continue
        disk = name.replace("mlp.experts", "block_sparse_moe.experts") if "Mixtral" in type(m).__name__ else name
        gate, down = ("w1", "w2") if "Mixtral" in type(m).__name__ else ("gate_proj", "down_proj")
        gk, dk = f"{disk}.0.{gate}", f"{disk}.0.{down}"
        if gk in cm.act_formats:
            qg = _act(cm.act_formats[gk], cm.input_amax.get(gk))
            mod.register_forward_pre_hook(lambda mod, args, q=qg: (q(args[0]),) + tuple(args[1:]))
        if dk in cm.act_formats:
            qd = _act(cm.act_formats[dk], cm.input_amax.get(dk))
            base = type(mod)._apply_gate
            mod._apply_gate = types.MethodType(lambda self, x, q=qd, base=base: q(base(self, x)), mod)
    return m


# ----------------------------------------------------------------------------- KV cache reference
@contextlib.contextmanager
def kv_reference(m, fmt_name: str, scales=None, gguf_order=None, attention=None):
    """K/V fake quant on a plain transformers model, at another hook point than qatfactory's
    (nn/kv_cache.py wraps the attention interface): the modeling module's ``apply_rotary_pos_emb`` is
    wrapped so the K it returns is fake-quantized, and a forward hook fake-quantizes v_proj's output
    per head. ``scales``: {attention module name: (k_scale, v_scale)} for formats with a per-layer
    scale. Llama-architecture K goes through llama.cpp's element order, built from transformers'
    GGUF loader's un-permutation (``gguf_order`` overrides the choice). ``attention`` ("fa3" /
    "triton"): the model runs eager attention for the duration and the modeling module's
    ``eager_attention_forward`` is replaced by the engine's FP8 arithmetic (formats/kv_attention.py's
    rule) on the E4M3 values of the fake-quantized K and V (recovered with torch's own float8 cast of
    K / k_scale) and eager's additive mask read as "0 = attend". A context manager: the patches and the
    hooks are removed on exit."""
    import sys as _sys

    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from qatfactory.formats.kv import get_kv_format
    fmt = get_kv_format(fmt_name)
    mods = {n: mod for n, mod in m.named_modules() if hasattr(mod, "k_proj") and hasattr(mod, "v_proj")}
    modeling = _sys.modules[type(next(iter(mods.values()))).__module__]
    hd = next(iter(mods.values())).head_dim
    order = None
    if gguf_order is None:
        gguf_order = fmt.spec.head_order == "gguf" and m.config.model_type in ("llama", "mistral", "mixtral")
    if gguf_order:
        import numpy as _np
        # GGUF position j holds the element p[j] such that un-permuting [p] gives 0..hd-1
        inv = LlamaTensorProcessor()._reverse_permute_weights(_np.arange(hd).reshape(hd, 1), 1, 1).reshape(-1)
        order = torch.from_numpy(_np.argsort(inv))
    state = {"layer": None}
    names = list(mods)

    def sc(n, i):
        return None if scales is None else scales[n][i]

    def fq_k(k, n):
        if order is None:
            return fmt.fake_quantize(k, sc(n, 0))
        return fmt.fake_quantize(k[..., order], sc(n, 0))[..., torch.argsort(order)]

    base_rope = modeling.apply_rotary_pos_emb

    def rope(q, k, *a, **kw):
        q2, k2 = base_rope(q, k, *a, **kw)
        return q2, fq_k(k2, state["layer"])

    hooks = []
    for n, mod in mods.items():
        hooks.append(mod.register_forward_pre_hook(lambda mod, args, n=n: state.__setitem__("layer", n)))

        def v_hook(lin, args, out, n=n):
            v = out.reshape(*out.shape[:-1], -1, hd)
            return fmt.fake_quantize(v, sc(n, 1)).reshape(out.shape)
        hooks.append(mod.v_proj.register_forward_hook(v_hook))
    modeling.apply_rotary_pos_emb = rope
    base_eager, base_impl = modeling.eager_attention_forward, m.config._attn_implementation
    if attention not in (None, "none"):       # "none": the student emulates only the cache write
        from qatfactory.formats.kv_attention import fp8_attention

        def fp8_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
            n = state["layer"]
            ks, vs = float(sc(n, 0)), float(sc(n, 1))
            k8 = (key.float() / ks).to(torch.float8_e4m3fn).float()
            v8 = (value.float() / vs).to(torch.float8_e4m3fn).float()
            keep = None if attention_mask is None else attention_mask[..., :key.shape[-2]] == 0
            out = fp8_attention(attention, query, k8, v8, ks, vs, scaling, keep).to(query.dtype)
            return out.transpose(1, 2).contiguous(), None
        modeling.eager_attention_forward = fp8_eager
        m.config._attn_implementation = "eager"
    assert names
    try:
        yield m
    finally:
        modeling.apply_rotary_pos_emb = base_rope
        modeling.eager_attention_forward = base_eager
        m.config._attn_implementation = base_impl
        for h in hooks:
            h.remove()
