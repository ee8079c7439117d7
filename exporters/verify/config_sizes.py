"""A safetensors export's config.json size claims against the tensors it holds, before the gate builds
a model from that config.

The gate builds transformers models from the exported config.json (a meta skeleton for the
compressed-tensors module check, a real model for the logits), so a config claiming 4,000 layers over
weights that hold 2 would have it prepare and run 4,000 layers before any comparison. The sizes a
tensor shape also states are compared with it first, and a disagreement is one FAIL naming the key,
the claimed value and what the tensors hold:

    num_hidden_layers                 the model.layers.<n> groups present (0 .. n-1)
    vocab_size / hidden_size          model.embed_tokens rows / model.norm.weight's length
    num_attention_heads, num_key_value_heads
                                      layer 0's q_proj / k_proj rows = heads x head_dim
    intermediate_size                 layer 0's mlp.up_proj rows (dense MLPs)

Packed weights keep the row count of the matrix (codes are packed along the input dimension), so one
rule covers dense, ModelOpt and compressed-tensors tensors.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

import torch

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _rows(sd: Dict[str, torch.Tensor], module: str) -> Optional[int]:
    for suffix in (".weight", ".weight_packed"):
        t = sd.get(module + suffix)
        if t is not None and t.ndim >= 1:
            return int(t.shape[0])
    return None


def _claim(cfg: Dict[str, Any], key: str, bad: List[str]) -> Optional[int]:
    v = cfg.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        bad.append(f"{key}={v!r}: not a non-negative integer")
        return None
    return v


def config_size_problems(cfg: Dict[str, Any], sd: Dict[str, torch.Tensor]) -> List[str]:
    bad: List[str] = []
    layers = sorted({int(m.group(1)) for k in sd for m in [_LAYER.match(k)] if m})
    n = _claim(cfg, "num_hidden_layers", bad)
    if n is not None and (n != len(layers) or layers != list(range(len(layers)))):
        bad.append(f"num_hidden_layers={n} claimed; the tensors hold {len(layers)} layers")
    vocab, hidden = _claim(cfg, "vocab_size", bad), _claim(cfg, "hidden_size", bad)
    emb = _rows(sd, "model.embed_tokens")
    if vocab is not None and emb is not None and vocab != emb:
        bad.append(f"vocab_size={vocab} claimed; model.embed_tokens holds {emb} rows")
    norm = sd.get("model.norm.weight")
    if hidden is not None and norm is not None and hidden != norm.numel():
        bad.append(f"hidden_size={hidden} claimed; model.norm.weight holds {norm.numel()} values")
    heads, kv = _claim(cfg, "num_attention_heads", bad), _claim(cfg, "num_key_value_heads", bad)
    head_dim = _claim(cfg, "head_dim", bad) or (hidden // heads if hidden and heads and hidden % heads == 0 else None)
    q, k = _rows(sd, "model.layers.0.self_attn.q_proj"), _rows(sd, "model.layers.0.self_attn.k_proj")
    if heads is not None and head_dim and q is not None and heads * head_dim != q:
        bad.append(f"num_attention_heads={heads} claimed (x head_dim {head_dim}); layer 0's q_proj holds {q} rows")
    if kv is not None and head_dim and k is not None and kv * head_dim != k:
        bad.append(f"num_key_value_heads={kv} claimed (x head_dim {head_dim}); layer 0's k_proj holds {k} rows")
    ff, up = _claim(cfg, "intermediate_size", bad), _rows(sd, "model.layers.0.mlp.up_proj")
    if ff is not None and up is not None and ff != up:
        bad.append(f"intermediate_size={ff} claimed; layer 0's mlp.up_proj holds {up} rows")
    return bad
