"""What a GGUF file of a model family must say beyond the Llama/Qwen layout: tensor names, stored
values and hyperparameters, and the refusals where llama.cpp would compute something else.

Gemma 3 (HF ``gemma3_text``, ``Gemma3ForCausalLM``; llama.cpp architecture ``gemma3``), from llama.cpp's
converter (conversion/gemma.py ``Gemma3Model``, conversion/base.py) and what its runtime does with the file
(checked on tiny models against transformers, see tests/exporters/test_exporters_gemma3.py)::

    post_attention_layernorm   -> blk.N.post_attention_norm    (llama's ffn_norm name is taken by ...)
    pre_feedforward_layernorm  -> blk.N.ffn_norm
    post_feedforward_layernorm -> blk.N.post_ffw_norm
    every *norm.weight          stored as F32(1 + w): Gemma's RMSNorm multiplies by (1 + w) in fp32,
                                llama.cpp by the stored value, so the sum is the same float both sides
    gemma3.rope.freq_base       the full-attention layers' theta; .rope.freq_base_swa the sliding layers'
    gemma3.attention.sliding_window
    gemma3.final_logit_softcapping  when the config sets one (llama.cpp's gemma3 graph applies it)
    token_embd                  the raw table; llama.cpp scales rows by sqrtf(hidden) itself, as
                                transformers' Gemma3TextScaledWordEmbedding does

Refused, because llama.cpp's gemma3 would not run what the student runs: a query scale other than
1/sqrt(head_dim) (llama.cpp ignores query_pre_attn_scalar and uses head_dim, or hidden/heads for the
62-layer 27B); a layer pattern other than five sliding layers then one full (llama.cpp fixes it at
6); attention logit softcapping (the converter asserts Gemma 3 has none); an activation other than
gelu_pytorch_tanh; rope scaling on the sliding layers; and any tensor with a per-tensor scale (NVFP4
with ModelOpt numerics): llama.cpp's gemma3 graph multiplies by the weights alone (``build_lora_mm``
without the ``.scale`` tensor the llama graph passes), so such a file loads and computes garbage
(NaN logits on the tiny model). ``nvfp4_ggml`` (no per-tensor scale) and MXFP4 are fine.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

GEMMA3 = "gemma3_text"
GEMMA_NAMES = [
    (r"post_attention_layernorm\.weight", "post_attention_norm.weight"),
    (r"pre_feedforward_layernorm\.weight", "ffn_norm.weight"),
    (r"post_feedforward_layernorm\.weight", "post_ffw_norm.weight"),
]
SWA_PATTERN = 6          # llama.cpp: layer il slides unless il % 6 == 5
GEMMA_27B_LAYERS = 62    # the one size whose query scale llama.cpp takes from hidden/heads


def layer_names(model_type: Optional[str]) -> List:
    """Family-specific (HF layer suffix regex, GGUF suffix) pairs, tried before the common table."""
    return list(GEMMA_NAMES) if model_type == GEMMA3 else []


def norm_shift(model_type: Optional[str], hf_name: str) -> float:
    """What llama.cpp's converter adds to a stored tensor: Gemma's (1 + w) RMSNorm weights."""
    return 1.0 if model_type == GEMMA3 and hf_name.endswith("norm.weight") else 0.0


def rope_by_layer_type(cfg: Dict[str, Any], layer_type: str) -> Dict[str, Any]:
    """transformers 5 nests Gemma 3's rope parameters by layer type; older configs are flat."""
    rp = cfg.get("rope_parameters") or {}
    if isinstance(rp.get(layer_type), dict):
        return dict(rp[layer_type])
    return dict(rp)


def problems(cfg: Dict[str, Any]) -> List[str]:
    """Why llama.cpp's runtime would compute something else than this student (empty: none)."""
    if cfg.get("model_type") != GEMMA3:
        return []
    bad = []
    n_layer = int(cfg["num_hidden_layers"])
    hidden, n_head = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // n_head)
    want = hidden // n_head if n_layer == GEMMA_27B_LAYERS else head_dim
    qs = cfg.get("query_pre_attn_scalar")
    if qs is None or float(qs) != float(want):
        bad.append(f"query_pre_attn_scalar={qs!r}: llama.cpp's gemma3 scales queries by 1/sqrt({want}) "
                   f"({'hidden/heads for 62 layers' if n_layer == GEMMA_27B_LAYERS else 'head_dim'}), whatever the "
                   f"config says")
    types = cfg.get("layer_types")
    fixed = ["full_attention" if (i + 1) % SWA_PATTERN == 0 else "sliding_attention" for i in range(n_layer)]
    if cfg.get("sliding_window") is None:
        bad.append("sliding_window=None: llama.cpp's gemma3 without a window has no full/sliding split to match")
    elif types is not None and list(types) != fixed:
        bad.append(f"layer_types={list(types)[:8]}...: llama.cpp's gemma3 fixes the pattern at five sliding layers "
                   f"then one full ({fixed[:6]})")
    if cfg.get("attn_logit_softcapping") is not None:
        bad.append(f"attn_logit_softcapping={cfg['attn_logit_softcapping']!r}: Gemma 3 has none and llama.cpp's "
                   f"gemma3 applies none")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act != "gelu_pytorch_tanh":
        bad.append(f"hidden_activation={act!r}: llama.cpp's gemma3 runs tanh-approximated GELU (gelu_pytorch_tanh)")
    local = rope_by_layer_type(cfg, "sliding_attention")
    if (local.get("rope_type") or "default") != "default":
        bad.append(f"sliding-layer rope_type={local.get('rope_type')!r}: llama.cpp scales no sliding layer's rope")
    return bad


def metadata(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Extra GGUF keys (without the architecture prefix) and their values."""
    if cfg.get("model_type") != GEMMA3:
        return {}
    local = rope_by_layer_type(cfg, "sliding_attention")
    out = {"rope.freq_base_swa": float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))),
           "attention.sliding_window": int(cfg["sliding_window"])}
    if cfg.get("final_logit_softcapping"):
        out["final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
    return out


# llama.cpp architectures whose graph never applies a weight's per-tensor ``.scale``
NO_TENSOR_SCALE = {GEMMA3: "gemma3"}


def scale_problem(model_type: Optional[str], scaled: List[str]) -> Optional[str]:
    """Why tensors with a per-tensor scale cannot go to this family's GGUF (None: they can)."""
    if model_type not in NO_TENSOR_SCALE or not scaled:
        return None
    return (f"{len(scaled)} tensors carry a per-tensor scale (e.g. {scaled[0]}), which llama.cpp's "
            f"{NO_TENSOR_SCALE[model_type]} graph never applies (it multiplies by the blocks alone); train with "
            f"nvfp4_ggml (NVFP4 blocks, no per-tensor scale) or an MXFP4 / ggml format for llama.cpp, or export "
            f"this student to vLLM")
